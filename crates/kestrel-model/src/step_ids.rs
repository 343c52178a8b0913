//! A step's token ids: gathered from the inputs' host slices, or a tensor already on the
//! device (a drafted tree's tokens, which then need no round trip through the host).

use crate::cache::SeqId;
use crate::error::{invalid, Result};
use candle_core::{DType, Device, Tensor};

pub(crate) enum StepIds<'a> {
    Host(Vec<u32>),
    /// The ids on the device and as many zeros: the host-side placeholders a graphed step's
    /// packed inputs carry until the ids are copied over them there.
    Device {
        ids: &'a Tensor,
        placeholders: Vec<u32>,
    },
}

impl<'a> StepIds<'a> {
    /// The ids of `inputs` (`(sequence, host tokens, token count)`, the count given by the
    /// input's positions): their host tokens, or `device_ids` (u32 `[Σ count]`), in which case
    /// the inputs must carry no host tokens.
    pub fn of<'i>(
        inputs: impl Iterator<Item = (SeqId, &'i [u32], usize)>,
        device_ids: Option<&'a Tensor>,
    ) -> Result<Self> {
        let mut host = Vec::new();
        let mut total = 0;
        for (seq, tokens, n) in inputs {
            total += n;
            match device_ids {
                None if tokens.len() != n => {
                    return Err(invalid(format!(
                        "sequence {seq:?}: {} tokens but {n} positions",
                        tokens.len()
                    )))
                }
                None => host.extend_from_slice(tokens),
                Some(_) if !tokens.is_empty() => {
                    return Err(invalid(format!(
                        "sequence {seq:?}: host tokens given with the step's ids on the device"
                    )))
                }
                Some(_) => {}
            }
        }
        let Some(ids) = device_ids else {
            return Ok(StepIds::Host(host));
        };
        if ids.dtype() != DType::U32 || ids.dims() != [total] {
            return Err(invalid(format!(
                "device token ids: expected u32 [{total}], got {:?} {:?}",
                ids.dtype(),
                ids.dims()
            )));
        }
        Ok(StepIds::Device {
            ids,
            placeholders: vec![0; total],
        })
    }

    /// Host ids must be inside the vocabulary (a bad id would read past the embedding).
    /// Device ids are not read back to check: their producer (a top-k over the model's own
    /// logits) guarantees it.
    pub fn check(&self, vocab: usize) -> Result<()> {
        match self {
            StepIds::Host(tokens) => match tokens.iter().find(|&&t| t as usize >= vocab) {
                Some(&bad) => Err(invalid(format!(
                    "token id {bad} is outside the vocabulary of {vocab}"
                ))),
                None => Ok(()),
            },
            StepIds::Device { .. } => Ok(()),
        }
    }

    /// What a graphed step's packed inputs carry: the ids, or placeholders for device ids.
    pub fn host(&self) -> &[u32] {
        match self {
            StepIds::Host(tokens) => tokens,
            StepIds::Device { placeholders, .. } => placeholders,
        }
    }

    /// The device ids, if that is where they are.
    pub fn device(&self) -> Option<&'a Tensor> {
        match self {
            StepIds::Host(_) => None,
            StepIds::Device { ids, .. } => Some(ids),
        }
    }

    /// The ids as a tensor on `device`.
    pub fn on(&self, device: &Device) -> Result<Tensor> {
        Ok(match self {
            StepIds::Host(tokens) => Tensor::from_slice(tokens, tokens.len(), device)?,
            StepIds::Device { ids, .. } => ids.contiguous()?,
        })
    }
}
