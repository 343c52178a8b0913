//! Rotary position embeddings, computed exactly like HF transformers' `LlamaRotaryEmbedding`:
//! `inv_freq` in f32 (with Llama-3 scaling when configured), `freqs = position * inv_freq`
//! in f32, `cos`/`sin` in f32 and then cast to the model dtype; `rotate_half` convention.

use crate::error::Result;
use candle_core::{DType, Device, Tensor, D};
use kestrel_core::RopeScaling;

/// HF's `inv_freq`: `1 / base^(arange(0, dim, 2) / dim)` in f32, then Llama-3's
/// `_compute_llama3_parameters` when `scaling` is given.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let dim = head_dim as f32;
    let base = theta as f32;
    let default: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1.0f32 / base.powf(i as f32 / dim))
        .collect();
    let Some(s) = scaling else {
        return default;
    };
    // Python scalars are computed in f64 and meet the f32 tensors as f32.
    let factor = s.factor as f32;
    let low = s.low_freq_factor as f32;
    let old_ctx = s.original_max_position_embeddings as f64;
    let low_freq_wavelen = (old_ctx / s.low_freq_factor) as f32;
    let high_freq_wavelen = (old_ctx / s.high_freq_factor) as f32;
    let high_minus_low = (s.high_freq_factor - s.low_freq_factor) as f32;
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    default
        .iter()
        .map(|&f| {
            let wavelen = two_pi / f;
            let llama = if wavelen > low_freq_wavelen {
                f / factor
            } else {
                f
            };
            let smooth = ((old_ctx as f32) / wavelen - low) / high_minus_low;
            let smoothed = (1.0 - smooth) * llama / factor + smooth * llama;
            let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
            if medium {
                smoothed
            } else {
                llama
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub(crate) struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Self {
        Rope {
            inv_freq: inv_freq(head_dim, theta, scaling),
        }
    }

    /// `cos`, `sin` of shape `[positions.len(), head_dim / 2]` in `dtype`.
    pub fn cos_sin(
        &self,
        positions: &[u32],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let shape = (positions.len(), self.inv_freq.len());
        let (cos, sin) = self.cos_sin_host(positions);
        let cos = Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }

    /// The f32 values of [`Rope::cos_sin`], row-major `[positions, head_dim / 2]`.
    pub fn cos_sin_host(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let p = p as f32;
            for &f in &self.inv_freq {
                let x = p * f;
                cos.push(x.cos());
                sin.push(x.sin());
            }
        }
        (cos, sin)
    }
}

/// Applies RoPE to `x: [b, t, heads, head_dim]` with `cos`/`sin: [t, head_dim / 2]`.
/// `differentiable` picks plain candle ops (tracked by autograd) over the fused kernel.
pub(crate) fn apply(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    differentiable: bool,
) -> Result<Tensor> {
    if !differentiable {
        return Ok(candle_nn::rotary_emb::rope_thd(&x.contiguous()?, cos, sin)?);
    }
    let (_b, t, _h, d) = x.dims4()?;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?.reshape((1, t, 1, d))?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?.reshape((1, t, 1, d))?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling {
            rope_type: "llama3".into(),
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        };
        let plain = inv_freq(16, 500000.0, None);
        let scaled = inv_freq(16, 500000.0, Some(&s));
        // wavelen < 16/4 = 4: unchanged; wavelen > 16: divided by factor.
        for (p, q) in plain.iter().zip(&scaled) {
            let wavelen = 2.0 * std::f32::consts::PI / p;
            if wavelen < 4.0 {
                assert_eq!(p, q);
            } else if wavelen > 16.0 {
                assert_eq!(*q, p / 8.0);
            } else {
                assert!(*q <= *p && *q >= p / 8.0);
            }
        }
    }

    #[test]
    fn fused_and_differentiable_rope_agree() {
        let dev = Device::Cpu;
        let rope = Rope::new(8, 10000.0, None);
        let (cos, sin) = rope.cos_sin(&[0, 3, 7], DType::F32, &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (2, 3, 2, 8), &dev).unwrap();
        let a = apply(&x, &cos, &sin, false).unwrap();
        let b = apply(&x, &cos, &sin, true).unwrap();
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
    }
}
