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
//! Sampled steps that need only the target's own token at each row (plain decoding, EAGLE's
//! and draft-target's token matching) draw it the same way: the host draws each row's uniform
//! from its sequence's stream, in the order the host path would, and on a device
//! `kestrel_kernels::sample_rows` picks the token there ([`sample_row_ids`]), so again one id
//! a row crosses and the same seed gives the host's tokens (rounding at a CDF boundary
//! aside). Only the lossless tree rejection sampling and typical acceptance still need the
//! rows ([`LogitRows::logits`]).
//!
//! EAGLE drafting needs the k best tokens of each head row and their log-probabilities. On a
//! device one kernel (`kestrel_kernels::top_k_logp`) selects them in the host's order and one
//! copy brings back `rows × 2k` values instead of `rows × vocab` floats. Its log-softmax
//! normaliser is summed in f32 (the host sums in f64); drafts only propose, so that changes
//! no output.
//!
//! On the CPU the rows are already in host memory, and the plain scans
//! ([`kestrel_spec::sampling::argmax`], [`top_k`]) beat tensor passes, so they stay there.

use crate::device::device_sampling;
use crate::error::Result;
use candle_core::{Device, Tensor};
use kestrel_spec::sampling::{self, SamplingParams};

/// A model's rows as an acceptance rule needs them.
pub(crate) enum LogitRows {
    /// The target's own token at each row ([`row_tokens`]).
    Tokens(Vec<u32>),
    /// The full rows (probabilities are computed from them on the host).
    Logits(Vec<Vec<f32>>),
}

/// A run of consecutive rows of [`LogitRows`] (one sequence's rows in a batched step).
#[derive(Clone, Copy)]
pub(crate) enum LogitSlice<'a> {
    Tokens(&'a [u32]),
    Logits(&'a [Vec<f32>]),
}

impl LogitRows {
    /// The full rows, on the host.
    pub(crate) fn logits(logits: &Tensor) -> Result<Self> {
        Ok(Self::Logits(logits.to_vec2::<f32>()?))
    }

    pub(crate) fn slice(&self, start: usize, len: usize) -> LogitSlice<'_> {
        match self {
            Self::Tokens(ids) => LogitSlice::Tokens(&ids[start..start + len]),
            Self::Logits(rows) => LogitSlice::Logits(&rows[start..start + len]),
        }
    }
}

impl LogitSlice<'_> {
    /// The rows' own tokens; `None` when the full rows were fetched.
    pub(crate) fn tokens(&self) -> Option<&[u32]> {
        match self {
            Self::Tokens(ids) => Some(ids),
            Self::Logits(_) => None,
        }
    }

    /// The full rows; `None` when only tokens were fetched.
    pub(crate) fn logits(&self) -> Option<&[Vec<f32>]> {
        match self {
            Self::Tokens(_) => None,
            Self::Logits(rows) => Some(rows),
        }
    }
}

/// Token ids, one per row: picked on the host, or on the device and not fetched yet, so that
/// they can cross together with other ids of the step ([`RowIds::fetch_with`]).
pub(crate) enum RowIds {
    Host(Vec<u32>),
    /// u32 `[rows]`.
    Device(Tensor),
}

impl RowIds {
    /// The ids as u32 `[rows]` on `device`, for a step that reads them there: the same
    /// tensor when they were picked on it, else an upload.
    pub(crate) fn on(&self, device: &Device) -> Result<Tensor> {
        match self {
            RowIds::Device(ids) => Ok(ids.clone()),
            RowIds::Host(ids) => Ok(Tensor::from_slice(ids, ids.len(), device)?),
        }
    }

    pub(crate) fn fetch(self) -> Result<Vec<u32>> {
        Ok(self.fetch_with(None)?.0)
    }

    /// The ids, and those of `also` (u32 ids, on the device when these are there): in one
    /// copy when both are on the device.
    pub(crate) fn fetch_with(self, also: Option<&Tensor>) -> Result<(Vec<u32>, Vec<u32>)> {
        match (self, also) {
            (RowIds::Device(ids), Some(also)) => {
                let n = ids.dim(0)?;
                let mut all = fetch_ids(Some(&Tensor::cat(&[&ids, &also.flatten_all()?], 0)?))?;
                let also = all.split_off(n);
                Ok((all, also))
            }
            (RowIds::Device(ids), None) => Ok((fetch_ids(Some(&ids))?, Vec::new())),
            (RowIds::Host(ids), also) => Ok((ids, fetch_ids(also)?)),
        }
    }
}

/// The values of u32 ids (any shape), on the host; none for `None`.
pub(crate) fn fetch_ids(ids: Option<&Tensor>) -> Result<Vec<u32>> {
    match ids {
        Some(t) => Ok(t.flatten_all()?.to_vec1::<u32>()?),
        None => Ok(Vec::new()),
    }
}

/// Row r's token under typical acceptance (`kestrel_spec::accept::typical_probs` at
/// `temperature` and `posterior_threshold`) drawn at `uniforms[r]`, on the device
/// (`kestrel_kernels::sample_typical_rows`); the rows must be on one ([`draws_on_device`]).
pub(crate) fn typical_row_ids(
    logits: &Tensor,
    temperature: f32,
    posterior_threshold: f32,
    uniforms: &[f64],
) -> Result<RowIds> {
    let u: Vec<f32> = uniforms.iter().map(|&u| u as f32).collect();
    let u = Tensor::from_vec(u, uniforms.len(), logits.device())?;
    Ok(RowIds::Device(kestrel_kernels::sample_typical_rows(
        logits,
        &u,
        temperature,
        posterior_threshold,
    )?))
}

/// Each row's own token: the argmax when `sampling` is greedy (`uniforms` unused), else row
/// r's draw with `uniforms[r]` ([`sample_row_ids`]).
pub(crate) fn row_tokens(
    logits: &Tensor,
    sampling: &SamplingParams,
    uniforms: &[f64],
) -> Result<Vec<u32>> {
    row_ids(logits, sampling, uniforms)?.fetch()
}

/// [`row_tokens`], left on the device when picked there.
pub(crate) fn row_ids(
    logits: &Tensor,
    sampling: &SamplingParams,
    uniforms: &[f64],
) -> Result<RowIds> {
    if sampling.is_greedy() {
        argmax_row_ids(logits)
    } else {
        sample_row_ids(logits, sampling, uniforms)
    }
}

/// Whether sampled rows of `logits` are drawn where they are: on a device, unless
/// [`crate::device::set_device_sampling`] sends them to the host.
pub(crate) fn draws_on_device(logits: &Tensor) -> bool {
    !logits.device().is_cpu() && device_sampling()
}

/// Row r's token drawn from its warped law (`sampling::probs`) by inverse CDF at
/// `uniforms[r]` (`sampling::sample_at`): on the device when the rows are there
/// (`kestrel_kernels::sample_rows`, which takes the uniform as f32), else on the host.
/// `sampling` must not be greedy.
fn sample_row_ids(logits: &Tensor, sampling: &SamplingParams, uniforms: &[f64]) -> Result<RowIds> {
    if draws_on_device(logits) {
        let u: Vec<f32> = uniforms.iter().map(|&u| u as f32).collect();
        let u = Tensor::from_vec(u, uniforms.len(), logits.device())?;
        return Ok(RowIds::Device(kestrel_kernels::sample_rows(
            logits,
            &u,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
        )?));
    }
    Ok(RowIds::Host(
        logits
            .to_vec2::<f32>()?
            .iter()
            .zip(uniforms)
            .map(|(row, &u)| sampling::sample_at(&sampling::probs(row, sampling), u))
            .collect(),
    ))
}

/// Each row's argmax by the host rule ([`sampling::argmax`]): on the host for CPU tensors, on
/// the device otherwise.
pub(crate) fn argmax_row_ids(logits: &Tensor) -> Result<RowIds> {
    if logits.device().is_cpu() {
        return Ok(RowIds::Host(
            logits
                .to_vec2::<f32>()?
                .iter()
                .map(|r| sampling::argmax(r))
                .collect(),
        ));
    }
    Ok(RowIds::Device(kestrel_kernels::argmax_rows(logits)?))
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

/// Each row's `k` best token ids (at most the row's width), best first in the host's order
/// ([`top_k`]), as u32 `[rows, k]` where the rows are: on a device they never leave it.
pub(crate) fn top_k_ids(logits: &Tensor, k: usize) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let k = k.clamp(1, vocab.max(1));
    if logits.device().is_cpu() || k > kestrel_kernels::TOP_K_MAX {
        let ids: Vec<u32> = top_k_rows(logits, k)?
            .into_iter()
            .flat_map(|(ids, _)| ids)
            .collect();
        return Ok(Tensor::from_vec(ids, (rows, k), logits.device())?);
    }
    Ok(kestrel_kernels::top_k_logp(logits, k)?
        .narrow(1, 0, k)?
        .contiguous()?)
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
