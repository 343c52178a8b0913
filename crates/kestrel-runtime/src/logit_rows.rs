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
//! device those come from a two-stage sort ([`top_k_on_device`]): every 1024-wide slice of a
//! row is sorted and keeps its k best, then the survivors are sorted again, so about fifteen
//! launches replace copying `rows × vocab` floats. Equal logits may come out in another order
//! than the host's (lower id first); drafts only propose, so that changes no output.
//!
//! On the CPU the rows are already in host memory, and the plain scans
//! ([`kestrel_spec::sampling::argmax`], [`top_k`]) beat tensor passes, so they stay there.

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
    Ok(kestrel_kernels::argmax_rows(logits)?.to_vec1::<u32>()?)
}

/// Each row's `k` best tokens, best first, with their log-probabilities under softmax(row):
/// on the host for CPU tensors, on the device otherwise.
pub(crate) fn top_k_rows(logits: &Tensor, k: usize) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
    if logits.device().is_cpu() {
        return Ok(logits
            .to_vec2::<f32>()?
            .iter()
            .map(|r| top_k_logp(r, k))
            .collect());
    }
    let (ids, logp) = top_k_on_device(logits, k)?;
    Ok(ids
        .to_vec2::<u32>()?
        .into_iter()
        .zip(logp.to_vec2::<f32>()?)
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

/// Widest slice candle's device sort takes (one thread block per row).
const SORT_WIDTH: usize = 1024;

/// `([rows, k] u32 ids, [rows, k] f32 log-probs)`, best first, with tensor ops that run where
/// `logits` (`[rows, vocab]` f32) lives: rows are cut into [`SORT_WIDTH`]-wide slices, each
/// slice is sorted and keeps its k best, and the survivors are cut and sorted again until one
/// slice is left.
pub fn top_k_on_device(logits: &Tensor, k: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, vocab) = logits.dims2()?;
    let k = k.clamp(1, vocab.min(SORT_WIDTH));
    let dev = logits.device();
    let max = logits.max_keepdim(D::Minus1)?;
    let lse = logits
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        .add(&max)?;
    let mut values = logits.contiguous()?;
    // Survivors' token ids; `None` while the columns are the token ids themselves, so no
    // vocabulary-wide index is uploaded: the first cut derives them from the slice offsets.
    let mut ids: Option<Tensor> = None;
    while values.dim(1)? > SORT_WIDTH {
        let width = values.dim(1)?;
        let slices = width.div_ceil(SORT_WIDTH);
        let pad = slices * SORT_WIDTH - width;
        if pad > 0 {
            let neg_inf = Tensor::full(f32::NEG_INFINITY, (rows, pad), dev)?;
            values = Tensor::cat(&[&values, &neg_inf], 1)?;
            if let Some(t) = &ids {
                ids = Some(Tensor::cat(
                    &[t, &Tensor::zeros((rows, pad), DType::U32, dev)?],
                    1,
                )?);
            }
        }
        let v = values.reshape((rows * slices, SORT_WIDTH))?;
        let best = v.arg_sort_last_dim(false)?.narrow(1, 0, k)?.contiguous()?;
        values = v.gather(&best, 1)?.reshape((rows, slices * k))?;
        let kept = match &ids {
            Some(t) => t.reshape((rows * slices, SORT_WIDTH))?.gather(&best, 1)?,
            None => {
                let offsets = Tensor::arange_step(
                    0u32,
                    width.next_multiple_of(SORT_WIDTH) as u32,
                    SORT_WIDTH as u32,
                    dev,
                )?
                .reshape((1, slices, 1))?;
                best.reshape((rows, slices, k))?.broadcast_add(&offsets)?
            }
        };
        ids = Some(kept.reshape((rows, slices * k))?);
    }
    let best = values
        .arg_sort_last_dim(false)?
        .narrow(1, 0, k)?
        .contiguous()?;
    let top = values.gather(&best, 1)?;
    let logp = top.broadcast_sub(&lse)?.clamp(f32::NEG_INFINITY, 0.0)?;
    let ids = match ids {
        Some(t) => t.gather(&best, 1)?,
        None => best,
    };
    // A padding column can only win in a row with fewer than k values above -inf; keep its
    // id inside the vocabulary.
    Ok((ids.clamp(0u32, vocab as u32 - 1)?, logp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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

    /// The two-stage device sort, run on CPU tensors, against the host selection: rows wider
    /// than two sort slices (so survivors are cut again) and a width that needs padding.
    #[test]
    fn device_top_k_equals_the_host_selection() {
        for (vocab, k) in [(2500usize, 10usize), (1024 * 3, 4), (700, 1), (5000, 300)] {
            let rows = 3;
            // Distinct values (a permutation scaled), so the order is unique.
            let mut data: Vec<f32> = Vec::with_capacity(rows * vocab);
            for r in 0..rows {
                data.extend((0..vocab).map(|i| ((i * 7919 + r * 104_729) % vocab) as f32 / 97.0));
            }
            let t = Tensor::from_vec(data.clone(), (rows, vocab), &Device::Cpu).unwrap();
            let (ids, logp) = top_k_on_device(&t, k).unwrap();
            let (ids, logp) = (
                ids.to_vec2::<u32>().unwrap(),
                logp.to_vec2::<f32>().unwrap(),
            );
            for r in 0..rows {
                let (want_ids, want_logp) = top_k_logp(&data[r * vocab..(r + 1) * vocab], k);
                assert_eq!(ids[r], want_ids, "vocab {vocab} k {k} row {r}");
                for (g, w) in logp[r].iter().zip(&want_logp) {
                    assert!(
                        (g - w).abs() < 1e-4,
                        "vocab {vocab} k {k}: log-prob {g} vs {w}"
                    );
                }
            }
        }
    }
}
