//! Where a model's weights come from: an in-memory map of named tensors (inference, tests,
//! checkpoints loaded onto a GPU), a checkpoint streamed into one packed CPU buffer
//! (`PackedSource`), a candle `VarBuilder` (trainable `Var`s for the EAGLE head), or both
//! (a draft model whose embedding stays frozen while its layers train).

use crate::arena::PackedWeights;
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use std::collections::BTreeMap;

pub(crate) trait WeightSource {
    /// The tensor `name` of exactly `shape`, in the source's dtype and device.
    fn get(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor>;
    /// Like `get`, but `None` when the tensor is absent.
    fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>>;
    /// Whether projections may be fused at load (not for trainable `Var`s, whose updates a
    /// fused copy would not see).
    fn fuse(&self) -> bool;
    /// The tensors `parts` (name, shape) concatenated along their first dimension: a fused
    /// projection's weight. Asked only of sources that [`WeightSource::fuse`]; by default the
    /// parts are fetched (and created with `Init::Const(0)` where a source creates missing
    /// tensors, which fusing sources do not) and concatenated on the device.
    fn get_cat(&self, parts: &[(String, Vec<usize>)]) -> Result<Tensor> {
        let ts = parts
            .iter()
            .map(|(name, shape)| self.get(name, shape, Init::Const(0.0)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&ts, 0)?)
    }
    fn dtype(&self) -> DType;
    fn device(&self) -> &Device;
    /// Whether the tensors it hands out are views of one packed CPU buffer already
    /// ([`PackedSource`]), so that the model need not pack them.
    fn packed(&self) -> bool {
        false
    }
}

/// A checkpoint's weights streamed into one CPU buffer at load ([`crate::arena::load_packed`]):
/// every tensor is a view of it, and a fused projection whose parts were loaded in a row is
/// one view too.
pub(crate) struct PackedSource<'a> {
    pub weights: &'a PackedWeights,
    pub origin: &'a str,
    /// The CPU, where the buffer is.
    pub device: &'a Device,
}

impl WeightSource for PackedSource<'_> {
    fn get(&self, name: &str, shape: &[usize], _init: Init) -> Result<Tensor> {
        present(self.get_opt(name, shape)?, name, self.origin)
    }

    fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        let Some(t) = self.weights.get(name)? else {
            return Ok(None);
        };
        check_shape(&t, name, shape, self.origin)?;
        Ok(Some(t))
    }

    fn fuse(&self) -> bool {
        true
    }

    fn get_cat(&self, parts: &[(String, Vec<usize>)]) -> Result<Tensor> {
        let names: Vec<&str> = parts.iter().map(|(n, _)| n.as_str()).collect();
        let views = parts
            .iter()
            .map(|(name, shape)| self.get(name, shape, Init::Const(0.0)))
            .collect::<Result<Vec<_>>>()?;
        // Loaded in a row, the parts are already their concatenation; else they are copied.
        match self.weights.get_adjacent(&names)? {
            Some(fused) => Ok(fused),
            None => Ok(Tensor::cat(&views, 0)?),
        }
    }

    fn dtype(&self) -> DType {
        self.weights.dtype()
    }

    fn device(&self) -> &Device {
        self.device
    }

    fn packed(&self) -> bool {
        true
    }
}

pub(crate) struct MapSource<'a> {
    pub map: &'a BTreeMap<String, Tensor>,
    pub origin: &'a str,
    pub dtype: DType,
    pub device: &'a Device,
}

impl MapSource<'_> {
    /// The map's tensor `name`, which must have `shape`; `None` when absent.
    fn held(&self, name: &str, shape: &[usize]) -> Result<Option<&Tensor>> {
        let Some(t) = self.map.get(name) else {
            return Ok(None);
        };
        check_shape(t, name, shape, self.origin)?;
        Ok(Some(t))
    }
}

/// Tensor `name`, which `origin` must hold.
fn present(found: Option<Tensor>, name: &str, origin: &str) -> Result<Tensor> {
    found.ok_or_else(|| ModelError::MissingTensor {
        name: name.to_string(),
        origin: origin.to_string(),
    })
}

/// Tensor `name` from `origin` must have `shape`.
fn check_shape(t: &Tensor, name: &str, shape: &[usize], origin: &str) -> Result<()> {
    if t.dims() != shape {
        return Err(ModelError::ShapeMismatch {
            name: name.to_string(),
            origin: origin.to_string(),
            expected: shape.to_vec(),
            got: t.dims().to_vec(),
        });
    }
    Ok(())
}

impl WeightSource for MapSource<'_> {
    fn get(&self, name: &str, shape: &[usize], _init: Init) -> Result<Tensor> {
        present(self.get_opt(name, shape)?, name, self.origin)
    }

    fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        let Some(t) = self.held(name, shape)? else {
            return Ok(None);
        };
        Ok(Some(
            t.to_device(self.device)?
                .to_dtype(self.dtype)?
                .contiguous()?,
        ))
    }

    fn fuse(&self) -> bool {
        true
    }

    /// Concatenated where the map holds them (the host, for a loaded checkpoint) and moved
    /// once: the device never holds the parts, whose freed memory would stay behind as holes
    /// in CUDA's stream-ordered pool between the model's weights.
    fn get_cat(&self, parts: &[(String, Vec<usize>)]) -> Result<Tensor> {
        let ts = parts
            .iter()
            .map(|(name, shape)| {
                self.held(name, shape)?
                    .ok_or_else(|| ModelError::MissingTensor {
                        name: name.to_string(),
                        origin: self.origin.to_string(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&ts, 0)?
            .to_device(self.device)?
            .to_dtype(self.dtype)?
            .contiguous()?)
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device(&self) -> &Device {
        self.device
    }
}

pub(crate) struct VarSource<'a> {
    pub vb: &'a VarBuilder<'a>,
}

impl WeightSource for VarSource<'_> {
    fn get(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        Ok(self.vb.get_with_hints(shape.to_vec(), name, init)?)
    }
    fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.vb.contains_tensor(name) {
            Ok(Some(self.vb.get(shape.to_vec(), name)?))
        } else {
            Ok(None)
        }
    }
    fn fuse(&self) -> bool {
        false
    }
    fn dtype(&self) -> DType {
        self.vb.dtype()
    }
    fn device(&self) -> &Device {
        self.vb.device()
    }
}

/// Trainable `Var`s from `vars`, except the tensors `frozen` holds, which come as constants:
/// autograd tracks no operation on them, so no gradient is computed for a frozen embedding.
pub(crate) struct TrainSource<'a> {
    pub vars: VarSource<'a>,
    pub frozen: MapSource<'a>,
}

impl WeightSource for TrainSource<'_> {
    fn get(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        if self.frozen.map.contains_key(name) {
            self.frozen.get(name, shape, init)
        } else {
            self.vars.get(name, shape, init)
        }
    }
    fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.frozen.map.contains_key(name) {
            self.frozen.get_opt(name, shape)
        } else {
            self.vars.get_opt(name, shape)
        }
    }
    fn fuse(&self) -> bool {
        false
    }
    fn dtype(&self) -> DType {
        self.vars.dtype()
    }
    fn device(&self) -> &Device {
        self.vars.device()
    }
}

/// The usual init of a linear weight with `fan_in` inputs (PyTorch's default bound).
pub(crate) fn linear_init(fan_in: usize) -> Init {
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}
