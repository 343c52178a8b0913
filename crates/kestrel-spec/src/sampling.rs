//! Logit warping (temperature → top-k → top-p, Hugging Face warper semantics), greedy argmax,
//! and a seeded per-sequence RNG.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Temperatures below this are greedy.
pub const GREEDY_TEMPERATURE: f32 = 1e-6;

/// Why sampling parameters were refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0 (0 = greedy), got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1] (1 = disabled), got {0}")]
    TopP(f32),
}

/// How to turn logits into a token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Divides the logits; `< 1e-6` (including 0) means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` largest logits (ties with the k-th are kept); 0 = disabled.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability sums to ≥ `top_p`
    /// (at least one); 1 = disabled.
    pub top_p: f32,
    /// Seed of the request; sequence `i` of a batch uses `SeqRng::new(seed, i)`.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }
    /// Whether these parameters mean greedy decoding (temperature < 1e-6).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }
    /// Checks the ranges of temperature and top_p.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        Ok(())
    }
}

/// Index of the first maximum (NaN values are skipped; 0 for an empty or all-NaN slice).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// `softmax(logits / temperature)`, computed in f64. A slice without any finite maximum gives
/// a one-hot at [`argmax`].
pub fn softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    softmax_f64(logits, temperature)
        .into_iter()
        .map(|p| p as f32)
        .collect()
}

pub(crate) fn softmax_f64(logits: &[f32], temperature: f32) -> Vec<f64> {
    if logits.is_empty() {
        return Vec::new();
    }
    let t = if temperature > 0.0 && temperature.is_finite() {
        temperature as f64
    } else {
        1.0
    };
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        let mut out = vec![0.0; logits.len()];
        out[argmax(logits) as usize] = 1.0;
        return out;
    }
    let mut out: Vec<f64> = logits
        .iter()
        .map(|&v| {
            if v.is_nan() {
                0.0
            } else {
                ((v as f64 - max as f64) / t).exp()
            }
        })
        .collect();
    let sum: f64 = out.iter().sum();
    out.iter_mut().for_each(|p| *p /= sum);
    out
}

/// The warped distribution: greedy → one-hot at the argmax; otherwise softmax(logits / T),
/// then top-k (ties with the k-th largest kept), then top-p (the smallest most-likely set with
/// cumulative probability ≥ top_p, at least one token), renormalised. Out-of-range parameters
/// are treated leniently (top_p outside (0, 1] as 1); call [`SamplingParams::validate`] first.
pub fn probs(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    if logits.is_empty() {
        return Vec::new();
    }
    if params.is_greedy() {
        let mut out = vec![0.0; logits.len()];
        out[argmax(logits) as usize] = 1.0;
        return out;
    }
    let mut p = softmax_f64(logits, params.temperature);
    if params.top_k > 0 && params.top_k < p.len() {
        let mut sorted = p.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[params.top_k - 1];
        p.iter_mut().filter(|x| **x < kth).for_each(|x| *x = 0.0);
        normalise(&mut p);
    }
    if params.top_p > 0.0 && params.top_p < 1.0 {
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let mut before = 0.0f64;
        let top_p = params.top_p as f64;
        for &i in &order {
            if before >= top_p {
                p[i] = 0.0;
            } else {
                before += p[i];
            }
        }
        normalise(&mut p);
    }
    p.into_iter().map(|x| x as f32).collect()
}

pub(crate) fn normalise(p: &mut [f64]) {
    let sum: f64 = p.iter().sum();
    if sum > 0.0 && sum.is_finite() {
        p.iter_mut().for_each(|x| *x /= sum);
    }
}

/// Draws an index from `probs` (need not be normalised; negative and NaN entries count as 0)
/// with one uniform from `rng`: [`sample_at`] of that uniform. An all-zero vector gives
/// [`argmax`] (and still takes its uniform).
pub fn sample(probs: &[f32], rng: &mut SeqRng) -> u32 {
    sample_at(probs, rng.uniform())
}

/// The index where `probs`' cumulative weight first exceeds `u · Σ probs` (`u` in `[0, 1)`:
/// the inverse CDF; the last positive entry where rounding leaves it past every prefix).
/// Negative and NaN entries count as 0; an all-zero vector gives [`argmax`].
pub fn sample_at(probs: &[f32], u: f64) -> u32 {
    let clean = |x: f32| if x > 0.0 { x as f64 } else { 0.0 };
    let total: f64 = probs.iter().map(|&x| clean(x)).sum();
    if !(total > 0.0 && total.is_finite()) {
        return argmax(probs);
    }
    sample_weighted(probs.iter().map(|&x| clean(x)), total, u)
}

/// Draws an index from f64 weights summing to `total`.
pub(crate) fn sample_f64(weights: &[f64], rng: &mut SeqRng) -> u32 {
    let total: f64 = weights.iter().filter(|x| **x > 0.0).sum();
    if !(total > 0.0 && total.is_finite()) {
        let mut best = 0;
        for (i, &w) in weights.iter().enumerate() {
            if w > weights[best] {
                best = i;
            }
        }
        return best as u32;
    }
    sample_weighted(weights.iter().map(|&x| x.max(0.0)), total, rng.uniform())
}

fn sample_weighted(weights: impl Iterator<Item = f64>, total: f64, u: f64) -> u32 {
    let target = u * total;
    let mut acc = 0.0;
    let mut last_positive = 0usize;
    for (i, w) in weights.enumerate() {
        if w > 0.0 {
            acc += w;
            last_positive = i;
            if target < acc {
                return i as u32;
            }
        }
    }
    last_positive as u32
}

/// Greedy argmax or a draw from [`probs`], depending on `params`.
pub fn sample_token(logits: &[f32], params: &SamplingParams, rng: &mut SeqRng) -> u32 {
    if params.is_greedy() {
        argmax(logits)
    } else {
        sample(&probs(logits, params), rng)
    }
}

/// A per-sequence random stream: ChaCha12 seeded from the request's seed, on the stream given
/// by the sequence's index in the batch, so each sequence's draws do not depend on the batch
/// composition.
#[derive(Debug, Clone)]
pub struct SeqRng(ChaCha12Rng);

impl SeqRng {
    /// The stream of sequence `seq_index` for `random_seed`.
    pub fn new(random_seed: u64, seq_index: u64) -> Self {
        let mut rng = ChaCha12Rng::seed_from_u64(random_seed);
        rng.set_stream(seq_index);
        Self(rng)
    }
    /// A uniform draw in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0.random::<f64>()
    }
    /// The next `n` uniforms as f32 (a device's draws), leaving the stream where it is: a
    /// caller that hands them to a device then [`skip`](Self::skip)s what the device used.
    pub fn peek_f32(&self, n: usize) -> Vec<f32> {
        let mut ahead = self.clone();
        (0..n).map(|_| ahead.uniform() as f32).collect()
    }
    /// Moves the stream past `n` uniforms.
    pub fn skip(&mut self, n: usize) {
        for _ in 0..n {
            self.uniform();
        }
    }
    /// The underlying generator (for other `rand` APIs).
    pub fn inner(&mut self) -> &mut ChaCha12Rng {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{assert_fits, counts};

    #[test]
    fn argmax_first_max() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, 5.0, 5.0]), 2);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn validate_messages() {
        let p = SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        };
        assert_eq!(
            p.validate().unwrap_err().to_string(),
            "temperature must be a finite number >= 0 (0 = greedy), got -1"
        );
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert_eq!(
            p.validate().unwrap_err().to_string(),
            "top_p must be in (0, 1] (1 = disabled), got 0"
        );
        assert!(SamplingParams::default().validate().is_ok());
    }

    #[test]
    fn greedy_is_one_hot() {
        let p = probs(&[0.1, 2.0, 2.0, -1.0], &SamplingParams::greedy());
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
        let p = probs(
            &[0.1, 2.0, 2.0, -1.0],
            &SamplingParams {
                temperature: 1e-7,
                ..SamplingParams::default()
            },
        );
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn warping_by_hand() {
        // probs of ln([0.4, 0.3, 0.2, 0.1]) at T=1.
        let logits: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
        let base = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        };
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        assert!(close(&probs(&logits, &base), &[0.4, 0.3, 0.2, 0.1]));
        let k2 = SamplingParams { top_k: 2, ..base };
        assert!(close(
            &probs(&logits, &k2),
            &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]
        ));
        // top_p 0.7: 0.4 (<0.7, keep), 0.3 (0.4 before <0.7, keep) → cum 0.7, stop.
        let p7 = SamplingParams { top_p: 0.7, ..base };
        assert!(close(
            &probs(&logits, &p7),
            &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]
        ));
        let p5 = SamplingParams { top_p: 0.5, ..base };
        assert!(close(
            &probs(&logits, &p5),
            &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]
        ));
        let p1 = SamplingParams { top_p: 0.1, ..base };
        assert!(close(&probs(&logits, &p1), &[1.0, 0.0, 0.0, 0.0]));
        // Temperature 2 = sqrt of the probabilities, renormalised.
        let t2 = SamplingParams {
            temperature: 2.0,
            ..base
        };
        let s: f32 = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.sqrt()).sum();
        let want: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1]
            .iter()
            .map(|p| p.sqrt() / s)
            .collect();
        assert!(close(&probs(&logits, &t2), &want));
        // Top-k then top-p: k=3 → [4/9,3/9,2/9]; p=0.5: keep 4/9, then 3/9 (4/9 < 0.5) → stop.
        let kp = SamplingParams {
            top_k: 3,
            top_p: 0.5,
            ..base
        };
        assert!(close(
            &probs(&logits, &kp),
            &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]
        ));
        // Ties with the k-th are kept.
        let tie = probs(&[1.0, 1.0, 1.0, 0.0], &SamplingParams { top_k: 2, ..base });
        assert!(tie[2] > 0.0 && tie[3] == 0.0);
    }

    #[test]
    fn rng_streams_reproducible_and_distinct() {
        let a: Vec<f64> = {
            let mut r = SeqRng::new(7, 0);
            (0..4).map(|_| r.uniform()).collect()
        };
        let b: Vec<f64> = {
            let mut r = SeqRng::new(7, 0);
            (0..4).map(|_| r.uniform()).collect()
        };
        let c: Vec<f64> = {
            let mut r = SeqRng::new(7, 1);
            (0..4).map(|_| r.uniform()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
        // peek_f32 leaves the stream alone; skip moves it past what was peeked.
        let mut r = SeqRng::new(7, 0);
        let peeked = r.peek_f32(3);
        assert_eq!(peeked, a[..3].iter().map(|&u| u as f32).collect::<Vec<_>>());
        r.skip(3);
        assert_eq!(r.uniform(), a[3]);
    }

    #[test]
    fn sample_follows_warped_distribution() {
        let logits = [1.2f32, -0.3, 0.8, 2.0, 0.0, -1.5, 1.9, 0.4];
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 6,
            top_p: 0.9,
            seed: 11,
        };
        let p = probs(&logits, &params);
        assert!(p.iter().filter(|&&x| x == 0.0).count() >= 2);
        let mut rng = SeqRng::new(params.seed, 3);
        let n = 200_000;
        let c = counts(8, n, || sample(&p, &mut rng) as usize);
        let expected: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        assert_fits(&c, &expected, "probs + sample");
    }
}
