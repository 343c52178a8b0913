//! The element-wise ops of a CPU step (half-precision residual adds; SwiGLU in any dtype),
//! with the bits of the candle ops they replace (`layer.rs`: `x + y`, `silu(gate) · up`).
//!
//! Why: through candle, a bf16 SmolLM2 verification of 8 rows spent ~14% of its thread time
//! in these ops (bf16 widening and narrowing helpers called per vector, `silu` and the product
//! walking `gate_up`'s strided halves element by element); a row of a tree cost ~1 ms in
//! them. Here each op is one pass over contiguous rows, split over the step's team
//! (`team.rs`) when it is long. Every element's arithmetic is fixed, so the results do not
//! depend on the rows or the threads.

use crate::cpu_norm::{cpu_slice, Rounded};
use crate::error::{invalid, Result};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

/// Elements a task of a split pass takes (shorter passes run on the calling thread).
const TASK: usize = 8192;

/// `a + b` for CPU tensors of one shape and half dtype: each element `round(a + b)` in f32,
/// as candle's add.
pub(crate) fn add_half(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return Err(invalid(format!(
            "add_half: {:?} {:?} + {:?} {:?}",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype()
        )));
    }
    match a.dtype() {
        DType::BF16 => add::<bf16>(a, b),
        DType::F16 => add::<f16>(a, b),
        other => Err(invalid(format!("add_half: {other:?} is not f16 or bf16"))),
    }
}

fn add<T: Rounded>(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let mut out = vec![T::from_f32(0.0); a.elem_count()];
    cpu_slice::<T, _>(&a, |av| {
        cpu_slice::<T, _>(&b, |bv| {
            split(&mut out, 1, |i0, o| {
                for ((o, &x), &y) in o.iter_mut().zip(&av[i0..]).zip(&bv[i0..]) {
                    *o = T::from_f32(x.to_f32() + y.to_f32());
                }
            });
            Ok(())
        })
    })?;
    Ok(Tensor::from_vec(out, a.shape(), &Device::Cpu)?)
}

/// `silu(gate) · up` of the fused rows `gu [T, 2I]` (gate then up) → `[T, I]`, with candle's
/// roundings: `silu(g) = g / (1 + exp(−g))`, in a half dtype each of `exp`, `+` and `/`
/// rounded to it, then the product rounded (in f32 candle's scalar formula: its `silu` of
/// `gate`, a strided view, takes that path).
pub(crate) fn swiglu_cpu(gu: &Tensor) -> Result<Tensor> {
    let (rows, two_i) = gu.dims2()?;
    if two_i % 2 != 0 {
        return Err(invalid(format!("swiglu_cpu: odd width {two_i}")));
    }
    match gu.dtype() {
        DType::BF16 => swiglu::<bf16>(gu, rows, two_i / 2),
        DType::F16 => swiglu::<f16>(gu, rows, two_i / 2),
        DType::F32 => swiglu::<f32>(gu, rows, two_i / 2),
        other => Err(invalid(format!(
            "swiglu_cpu: {other:?} is not f32, f16 or bf16"
        ))),
    }
}

fn swiglu<T: Silu>(gu: &Tensor, rows: usize, i: usize) -> Result<Tensor> {
    let gu = gu.contiguous()?;
    let mut out = vec![T::from_f32(0.0); rows * i];
    let silu = T::silu();
    cpu_slice::<T, _>(&gu, |v| {
        // Tasks are whole rows (`split` keeps them multiples of i).
        split(&mut out, i, |at, o| {
            for (r, o) in o.chunks_mut(i).enumerate() {
                let row = &v[(at / i + r) * 2 * i..][..2 * i];
                let (gate, up) = row.split_at(i);
                for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                    *o = T::from_f32(silu(g) * u.to_f32());
                }
            }
        });
        Ok(())
    })?;
    Ok(Tensor::from_vec(out, (rows, i), &Device::Cpu)?)
}

/// `silu(g) = g / (1 + exp(−g))` with candle's roundings: each of `exp`, `+` and `/` rounded
/// to `T` (nothing rounded in f32).
fn silu_rounded<T: Rounded>(g: T) -> T {
    let one = T::from_f32(1.0).to_f32();
    let g = g.to_f32();
    let e = T::from_f32((-g).exp()).to_f32();
    T::from_f32(g / T::from_f32(one + e).to_f32())
}

/// [`silu_rounded`] as SwiGLU takes it, in f32: a function fetched once per call, so the
/// element loop does no table initialisation check.
trait Silu: Rounded {
    fn silu() -> impl Fn(Self) -> f32 + Sync;
}

impl Silu for f32 {
    fn silu() -> impl Fn(f32) -> f32 + Sync {
        silu_rounded::<f32>
    }
}

/// A 16-bit float has 65,536 values, so its SiLU is looked up in a table of them all (128
/// KiB, made on first use): the same bits without an `exp` and two divisions an element,
/// which were most of a bf16 SwiGLU's time (~0.2 ms a row of a SmolLM2 step on 2 cores).
macro_rules! silu_by_table {
    ($t:ty) => {
        impl Silu for $t {
            fn silu() -> impl Fn($t) -> f32 + Sync {
                static TABLE: std::sync::OnceLock<Vec<$t>> = std::sync::OnceLock::new();
                let table = TABLE.get_or_init(|| {
                    (0..=u16::MAX)
                        .map(|b| silu_rounded(<$t>::from_bits(b)))
                        .collect()
                });
                move |g: $t| table[g.to_bits() as usize].to_f32()
            }
        }
    };
}
silu_by_table!(bf16);
silu_by_table!(f16);

/// Runs `f(first index, chunk)` over `out` in chunks of about [`TASK`] elements (a multiple
/// of `unit`), on the step's team when there is more than one.
fn split<T: Send>(out: &mut [T], unit: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let task = TASK.next_multiple_of(unit.max(1));
    if out.len() <= task {
        f(0, out);
        return;
    }
    crate::team::for_each_chunk_mut(out, task, |t, chunk| f(t * task, chunk));
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn operand(rows: usize, cols: usize, seed: u64, dtype: DType) -> Tensor {
        Tensor::randn(0f32, 3.0, (rows, cols), &Device::Cpu)
            .unwrap()
            .affine(1.0, seed as f64 * 0.01)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// The f32 bits of every element of `t`.
    pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The same bits as candle's ops, in one row and in many (split over tasks): adds in bf16
    /// and f16, SwiGLU in those and f32.
    #[test]
    fn same_bits_as_candles_ops() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for rows in [1, 3, 40] {
                let (a, b) = (operand(rows, 576, 1, dtype), operand(rows, 576, 2, dtype));
                if dtype != DType::F32 {
                    let want = (&a + &b).unwrap();
                    let got = add_half(&a, &b).unwrap();
                    assert_eq!(bits(&got), bits(&want), "add {dtype:?} {rows}");
                }

                let gu = operand(rows, 2 * 1536, 3, dtype);
                let (g, u) = (
                    gu.narrow(1, 0, 1536).unwrap(),
                    gu.narrow(1, 1536, 1536).unwrap(),
                );
                let want = (g.silu().unwrap() * u).unwrap();
                assert_eq!(
                    bits(&swiglu_cpu(&gu).unwrap()),
                    bits(&want),
                    "swiglu {dtype:?} {rows}"
                );
            }
        }
    }

    /// SwiGLU's table of SiLU values against candle's `silu` for every bf16 and f16 gate
    /// value (NaNs compared as NaN, their payloads aside), times an `up` of 1 and of -2.5.
    #[test]
    fn every_half_gate_value_gets_candles_silu() {
        let n = 1 << 16;
        let same = |got: &Tensor, want: &Tensor, what: &str| {
            let canon = |t: &Tensor| -> Vec<u32> {
                bits(t)
                    .into_iter()
                    .map(|b| {
                        if f32::from_bits(b).is_nan() {
                            u32::MAX
                        } else {
                            b
                        }
                    })
                    .collect()
            };
            let (got, want) = (canon(got), canon(want));
            let wrong = (0..n).filter(|&i| got[i] != want[i]).count();
            assert_eq!(wrong, 0, "{what}: {wrong} gate values differ");
        };
        let every = |dtype: DType| -> Tensor {
            let dev = &Device::Cpu;
            match dtype {
                DType::BF16 => {
                    Tensor::from_vec((0..=u16::MAX).map(bf16::from_bits).collect(), (1, n), dev)
                }
                _ => Tensor::from_vec((0..=u16::MAX).map(f16::from_bits).collect(), (1, n), dev),
            }
            .unwrap()
        };
        for dtype in [DType::BF16, DType::F16] {
            let gate = every(dtype);
            for up in [1.0f64, -2.5] {
                let up = (Tensor::ones((1, n), DType::F32, &Device::Cpu).unwrap() * up)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let gu = Tensor::cat(&[&gate, &up], 1).unwrap();
                let want = (gate.silu().unwrap() * &up).unwrap();
                same(&swiglu_cpu(&gu).unwrap(), &want, &format!("{dtype:?}"));
            }
        }
    }

    #[test]
    fn mismatched_operands_are_refused() {
        let a = operand(2, 8, 1, DType::BF16);
        let err = add_half(&a, &operand(2, 9, 1, DType::BF16))
            .unwrap_err()
            .to_string();
        assert!(err.contains("add_half: [2, 8] BF16 + [2, 9] BF16"), "{err}");
        let err = swiglu_cpu(&operand(2, 7, 1, DType::BF16))
            .unwrap_err()
            .to_string();
        assert!(err.contains("swiglu_cpu: odd width 7"), "{err}");
        let err = add_half(&operand(2, 8, 1, DType::F32), &operand(2, 8, 1, DType::F32));
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("F32 is not f16 or bf16"));
    }
}
