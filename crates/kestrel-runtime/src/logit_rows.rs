//! What a decoder copies back from a `[rows, vocab]` logits tensor.
//!
//! Greedy decoding needs one token id per row, not the row. On a GPU the logits of a verified
//! 64-node tree are 64 × 49 152 floats (12.6 MB for SmolLM2): copying them to the host and
//! scanning them there cost more than the target forward itself. So greedy steps reduce each
//! row to its argmax on the device (`kestrel_kernels::argmax_rows`, one launch) and copy
//! `rows` ids. The kernel keeps the host rule exactly (the largest value, the lowest token id
//! among equal maxima, NaN never chosen; its GPU test checks it against
//! [`kestrel_spec::sampling::argmax`]), so a greedy step picks the same token on either path,
//! and plain decoding and verification pick alike.
//!
//! EAGLE drafting needs the k best tokens of each head row and their log-probabilities. On a
//! device one kernel (`kestrel_kernels::top_k_logp`) selects them in the host's order and one
//! copy brings back `rows × 2k` values instead of `rows × vocab` floats. Its log-softmax
//! normaliser is summed in f32 (the host sums in f64); drafts only propose, so that changes
//! no output.
//!
//! On the CPU the rows are already in host memory, and the plain scans
//! ([`kestrel_spec::sampling::argmax`], [`top_k`]) beat tensor passes, so they stay there.

use crate::error::Result;
use candle_core::Tensor;
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
    Ok(kestrel_kernels::argmax_rows(logits)?.to_vec1::<u32>()?)
}

/// Each row's `k` best tokens, best first, with their log-probabilities under softmax(row):
/// on the host for CPU tensors (and k beyond the kernel's limit), on the device otherwise.
pub(crate) fn top_k_rows(logits: &Tensor, k: usize) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
    if logits.device().is_cpu() || k > kestrel_kernels::TOP_K_MAX {
        return Ok(logits
            .to_vec2::<f32>()?
            .iter()
            .map(|r| top_k_logp(r, k))
            .collect());
    }
    let k = k.clamp(1, logits.dim(1)?.max(1));
    Ok(kestrel_kernels::top_k_logp(logits, k)?
        .to_vec2::<u32>()?
        .into_iter()
        .map(|row| {
            let (ids, logp) = row.split_at(k);
            (
                ids.to_vec(),
                logp.iter().map(|&b| f32::from_bits(b)).collect(),
            )
        })
        .collect())
}

/// The k largest entries, best first (lower token id first on ties).
pub(crate) fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(row.len());
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, row[i as usize])).collect()
}

/// Top-k tokens with their log-probabilities under softmax(row).
pub(crate) fn top_k_logp(row: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + row
            .iter()
            .map(|&x| ((x - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    top_k(row, k)
        .into_iter()
        .map(|(t, l)| (t, (l - lse).min(0.0)))
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_value_then_id() {
        assert_eq!(
            top_k(&[0.5, 2.0, 2.0, -1.0, 1.0], 3),
            vec![(1, 2.0), (2, 2.0), (4, 1.0)]
        );
    }

    #[test]
    fn top_k_logp_are_log_softmax() {
        let (t, lp) = top_k_logp(&[0.0, 0.0f32.ln_1p(), 1.0], 2);
        assert_eq!(t, vec![2, 0]);
        let z = 2.0 + std::f32::consts::E;
        assert!((lp[0] - (std::f32::consts::E / z).ln()).abs() < 1e-6);
        assert!((lp[1] - (1.0 / z).ln()).abs() < 1e-6);
    }
}
