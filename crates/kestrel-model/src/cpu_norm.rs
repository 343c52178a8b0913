//! HF Llama's RMSNorm of f16/bf16 rows on the CPU in one pass, with the bits of candle's
//! four-op composition (`layer.rs`, `RmsNorm::forward`): widen to f32, `candle_nn`'s
//! `rms_norm` with unit weights (a row's squares summed in order, `x / sqrt(mean + eps)`),
//! round to the dtype, then the dtype's product with the weight (an f32 product, rounded).
//! Those four ops each walked the rows and allocated: on 2 cores, 8 of a bf16 decoder
//! layer's ~13 elementwise launches, run by one thread while the step's other waited.

use crate::error::{invalid, Result};
use candle_core::{DType, Device, Storage, Tensor};
use half::{bf16, f16};

/// A dtype the CPU kernels compute in f32 and round back to: f16 and bf16 (to nearest, ties
/// to even), and f32 itself.
pub(crate) trait Rounded: Copy + Send + Sync + candle_core::WithDType {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Rounded for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// f32 itself, for the kernels that also take f32 rows (no rounding).
impl Rounded for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Rounded for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// `w · round(x / sqrt(mean(x²) + eps))` over the last dimension of the CPU tensor `x`
/// (f16 or bf16, `w` of the same dtype).
pub(crate) fn rms_norm_half(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 => run::<bf16>(x, w, eps),
        DType::F16 => run::<f16>(x, w, eps),
        other => Err(invalid(format!(
            "rms_norm_half: {other:?} is not f16 or bf16"
        ))),
    }
}

fn run<T: Rounded>(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let x = x.contiguous()?;
    let h = x.dim(candle_core::D::Minus1)?;
    let w = w.contiguous()?;
    if w.elem_count() != h {
        return Err(invalid(format!(
            "rms_norm_half: weight of {} for rows of {h}",
            w.elem_count()
        )));
    }
    let out = cpu_slice::<T, _>(&x, |xv| {
        cpu_slice::<T, _>(&w, |wv| {
            let mut out = Vec::with_capacity(xv.len());
            for row in xv.chunks(h) {
                let sum2: f32 = row
                    .iter()
                    .map(|&v| {
                        let v = v.to_f32();
                        v * v
                    })
                    .sum();
                let m = (sum2 / h as f32 + eps).sqrt();
                out.extend(row.iter().zip(wv).map(|(&v, &g)| {
                    T::from_f32(T::from_f32(v.to_f32() / m).to_f32() * g.to_f32())
                }));
            }
            Ok(out)
        })
    })?;
    Ok(Tensor::from_vec(out, x.shape(), &Device::Cpu)?)
}

/// `f` of the elements of the contiguous CPU tensor `t` of dtype `T`.
pub(crate) fn cpu_slice<T: candle_core::WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(s) = &*s else {
        return Err(invalid("a CPU kernel was called on a non-CPU tensor"));
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        return Err(invalid(
            "a CPU kernel was called on a non-contiguous tensor",
        ));
    };
    f(&s.as_slice::<T>()?[start..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The composition this replaces, as `RmsNorm::forward` ran it.
    fn candle_ops(x: &Tensor, w: &Tensor, eps: f32) -> Tensor {
        let ones = Tensor::ones(w.elem_count(), DType::F32, &Device::Cpu).unwrap();
        let normed =
            candle_nn::ops::rms_norm(&x.to_dtype(DType::F32).unwrap(), &ones, eps).unwrap();
        normed
            .to_dtype(x.dtype())
            .unwrap()
            .broadcast_mul(w)
            .unwrap()
    }

    #[test]
    fn same_bits_as_candles_ops_for_bf16_and_f16() {
        // 40 rows also takes candle's parallel branch (more than 32 rows).
        for rows in [1, 3, 40] {
            for dtype in [DType::BF16, DType::F16] {
                let x = (Tensor::randn(0f32, 3.0, (rows, 576), &Device::Cpu).unwrap())
                    .to_dtype(dtype)
                    .unwrap();
                let w = (Tensor::randn(1f32, 0.5, 576, &Device::Cpu).unwrap())
                    .to_dtype(dtype)
                    .unwrap();
                let got = rms_norm_half(&x, &w, 1e-5).unwrap();
                let want = candle_ops(&x, &w, 1e-5);
                use crate::cpu_elementwise::tests::bits;
                assert_eq!(bits(&got), bits(&want), "{rows} rows of {dtype:?}");
            }
        }
    }

    #[test]
    fn refuses_f32_and_a_weight_of_another_width() {
        let x = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::ones(8, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            rms_norm_half(&x, &w, 1e-5).unwrap_err().to_string(),
            "invalid input: rms_norm_half: F32 is not f16 or bf16"
        );
        let x = x.to_dtype(DType::BF16).unwrap();
        let w = Tensor::ones(6, DType::BF16, &Device::Cpu).unwrap();
        assert_eq!(
            rms_norm_half(&x, &w, 1e-5).unwrap_err().to_string(),
            "invalid input: rms_norm_half: weight of 6 for rows of 8"
        );
    }
}
