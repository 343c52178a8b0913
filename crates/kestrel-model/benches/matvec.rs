//! How fast the CPU matrix-vector kernels stream a bf16 weight matrix, in weight bytes a
//! second: `cargo bench -p kestrel-model --bench matvec`.
//!
//! A [200,000, 576] bf16 matrix (230 MB, far past the caches; SmolLM2's rows) against 1, 2
//! (EAGLE's one-candidate verification), 3 and 8 rows: `widened` is the kernel f32 rows take (bf16 weights widened in registers),
//! `bf16_rows` what a bf16 engine's rows take (`vdpbf16ps` where the CPU has AVX512-BF16,
//! else the widened kernel), `q4_rows` and `q8_rows` the 4- and 8-bit copies of the same
//! matrix a quantized draft reads (`matvec_quant.rs`; throughput still counted in the bf16
//! matrix's bytes, so all compare as times), and both again over a slice small enough for L3. One row should stream at the machine's read bandwidth; more rows show
//! where the multiply-adds start to cost.

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use kestrel_model::matvec::{matmul_nt, matmul_nt_bf16};
use kestrel_model::matvec_quant::{Bits, QuantWeights};
use std::hint::black_box;

const K: usize = 576;
const N: usize = 200_000;

fn bench(c: &mut Criterion) {
    let w: Vec<bf16> = (0..N * K)
        .map(|i| bf16::from_f32(((i * 13 % 89) as f32 - 44.0) / 2300.0))
        .collect();
    let quantized = |w: &[bf16], n: usize, bits: Bits| {
        QuantWeights::quantize(
            &Tensor::from_slice(w, (n, K), &Device::Cpu).expect("weights as a tensor"),
            bits,
        )
        .expect("quantized")
        .expect("K is a multiple of 64")
    };
    let (q4, q8) = (quantized(&w, N, Bits::Four), quantized(&w, N, Bits::Eight));
    let mut group = c.benchmark_group("matvec-bf16-200000x576");
    group.sample_size(10);
    group.throughput(Throughput::Bytes((N * K * 2) as u64));
    for m in [1usize, 2, 3, 8] {
        let xb: Vec<bf16> = (0..m * K)
            .map(|i| bf16::from_f32(((i * 31 % 97) as f32 - 48.0) / 17.0))
            .collect();
        let xf: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        group.bench_function(format!("widened_{m}_rows"), |b| {
            b.iter(|| black_box(matmul_nt(&xf, &w, m, K, N)))
        });
        group.bench_function(format!("bf16_rows_{m}_rows"), |b| {
            b.iter(|| black_box(matmul_nt_bf16(&xb, &w, m, K, N)))
        });
        group.bench_function(format!("q4_rows_{m}_rows"), |b| {
            b.iter(|| black_box(q4.matmul_nt(&xf, m)))
        });
        group.bench_function(format!("q8_rows_{m}_rows"), |b| {
            b.iter(|| black_box(q8.matmul_nt(&xf, m)))
        });
    }
    group.finish();

    // The first 16,384 rows (19 MB in bf16, 6 MB at 4 bits, 11 MB at 8): from L3, where only the
    // arithmetic bounds a kernel.
    const SMALL: usize = 16_384;
    let ws = &w[..SMALL * K];
    let (q4s, q8s) = (
        quantized(ws, SMALL, Bits::Four),
        quantized(ws, SMALL, Bits::Eight),
    );
    let xb: Vec<bf16> = (0..K)
        .map(|i| bf16::from_f32(((i * 31 % 97) as f32 - 48.0) / 17.0))
        .collect();
    let xf: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    let mut group = c.benchmark_group("matvec-bf16-16384x576-in-l3");
    group.sample_size(20);
    group.throughput(Throughput::Bytes((SMALL * K * 2) as u64));
    for m in [1usize, 2, 3] {
        let xm: Vec<bf16> = xb.iter().copied().cycle().take(m * K).collect();
        group.bench_function(format!("bf16_rows_{m}_rows"), |b| {
            b.iter(|| black_box(matmul_nt_bf16(&xm, ws, m, K, SMALL)))
        });
    }
    group.bench_function("q4_rows_1_rows", |b| {
        b.iter(|| black_box(q4s.matmul_nt(&xf, 1)))
    });
    group.bench_function("q8_rows_1_rows", |b| {
        b.iter(|| black_box(q8s.matmul_nt(&xf, 1)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
