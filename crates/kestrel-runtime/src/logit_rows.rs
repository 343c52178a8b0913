//! What a decoder copies back from a `[rows, vocab]` logits tensor.
//!
//! Greedy decoding needs one token id per row, not the row. On a GPU the logits of a verified
//! 64-node tree are 64 × 49 152 floats (12.6 MB for SmolLM2): copying them to the host and
//! scanning them there cost more than the target forward itself. So greedy steps reduce each
//! row to its argmax where the logits are and copy `rows` ids. The device reduction keeps the
//! host rule exactly (the largest value, the lowest token id among equal maxima, NaN never
//! chosen), so a greedy step picks the same token on either path, and plain decoding and
//! verification pick alike.
//!
//! On the CPU the rows are already in host memory, and the plain scan
//! ([`kestrel_spec::sampling::argmax`]) beats five tensor passes, so it stays there.

use crate::error::Result;
use candle_core::{DType, Tensor, D};
use kestrel_spec::sampling;

/// A model's rows as an acceptance rule or a greedy draft needs them.
pub(crate) enum LogitRows {
    /// Greedy: each row's argmax.
    Argmax(Vec<u32>),
    /// Sampling: the full rows (probabilities are computed from them on the host).
    Logits(Vec<Vec<f32>>),
}

/// A run of consecutive rows of [`LogitRows`] (one sequence's rows in a batched step).
#[derive(Clone, Copy)]
pub(crate) enum LogitSlice<'a> {
    Argmax(&'a [u32]),
    Logits(&'a [Vec<f32>]),
}

impl LogitRows {
    /// `logits`: `[rows, vocab]` f32. `greedy`: only the argmax of each row is wanted.
    pub(crate) fn fetch(logits: &Tensor, greedy: bool) -> Result<Self> {
        Ok(if greedy {
            Self::Argmax(argmax_rows(logits)?)
        } else {
            Self::Logits(logits.to_vec2::<f32>()?)
        })
    }

    pub(crate) fn slice(&self, start: usize, len: usize) -> LogitSlice<'_> {
        match self {
            Self::Argmax(ids) => LogitSlice::Argmax(&ids[start..start + len]),
            Self::Logits(rows) => LogitSlice::Logits(&rows[start..start + len]),
        }
    }
}

impl LogitSlice<'_> {
    /// Row `i`'s greedy token.
    pub(crate) fn argmax(&self, i: usize) -> u32 {
        match self {
            Self::Argmax(ids) => ids[i],
            Self::Logits(rows) => sampling::argmax(&rows[i]),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Argmax(ids) => ids.len(),
            Self::Logits(rows) => rows.len(),
        }
    }

    /// The full rows; `None` when only argmaxes were fetched (a greedy step).
    pub(crate) fn logits(&self) -> Option<&[Vec<f32>]> {
        match self {
            Self::Argmax(_) => None,
            Self::Logits(rows) => Some(rows),
        }
    }
}

/// Each row's argmax by the host rule ([`sampling::argmax`]): on the host for CPU tensors, on
/// the device otherwise.
pub(crate) fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    if logits.device().is_cpu() {
        return Ok(logits
            .to_vec2::<f32>()?
            .iter()
            .map(|r| sampling::argmax(r))
            .collect());
    }
    Ok(argmax_on_device(logits)?.to_vec1::<u32>()?)
}

/// `[rows]` u32: the lowest index holding each row's largest non-NaN value (index 0 for a row
/// of NaNs), with tensor ops that run where `logits` lives.
pub fn argmax_on_device(logits: &Tensor) -> candle_core::Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let dev = logits.device();
    let shape = (rows, vocab);
    // NaN != NaN: NaNs become -inf, so they are never the maximum of a row that has numbers.
    let neg_inf = Tensor::new(f32::NEG_INFINITY, dev)?.broadcast_as(shape)?;
    let clean = logits.eq(logits)?.where_cond(logits, &neg_inf)?;
    let max = clean.max_keepdim(D::Minus1)?;
    let at_max = clean.broadcast_eq(&max)?;
    let ids = Tensor::arange(0u32, vocab as u32, dev)?
        .unsqueeze(0)?
        .broadcast_as(shape)?;
    let past_end = Tensor::new(vocab as u32, dev)?.broadcast_as(shape)?;
    // The smallest index at the maximum; a row of NaNs has its maximum (-inf) everywhere → 0.
    at_max
        .where_cond(&ids, &past_end)?
        .min(D::Minus1)?
        .to_dtype(DType::U32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The device formulation, run on CPU tensors, against the host scan on rows with planted
    /// ties, NaNs, infinities and all-NaN / all -inf rows.
    #[test]
    fn device_argmax_keeps_the_host_rule() {
        let vocab = 97;
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let mut x = 0x2545_f491_u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 1000) as f32 / 37.0 - 13.0
        };
        for r in 0..24 {
            let mut row: Vec<f32> = (0..vocab).map(|_| next()).collect();
            let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) + 1.0;
            match r % 6 {
                // The same maximum at several ids: the lowest must win.
                0 => {
                    row[r + 5] = top;
                    row[r + 40] = top;
                    row[90] = top;
                }
                // A NaN bigger than nothing still must not be picked.
                1 => {
                    row[0] = f32::NAN;
                    row[r] = f32::NAN;
                }
                2 => row[r + 3] = f32::INFINITY,
                3 => row.iter_mut().for_each(|v| *v = f32::NAN),
                4 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                _ => {}
            }
            rows.push(row);
        }
        let t = Tensor::from_vec(rows.concat(), (rows.len(), vocab), &Device::Cpu).unwrap();
        let got = argmax_on_device(&t).unwrap().to_vec1::<u32>().unwrap();
        let want: Vec<u32> = rows.iter().map(|r| sampling::argmax(r)).collect();
        assert_eq!(got, want);
        // Guard against a vacuous comparison: the planted ties are not all at index 0.
        assert_eq!(want[0], 5);
        assert_eq!(want[3], 0);
    }
}
