//! Kestrel's CUDA kernels against CPU references on the same random inputs.
//!
//! Built only with the `cuda` feature; a binary built that way fails (not skips) when no CUDA
//! device is present, so a GPU run cannot pass vacuously.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use kestrel_kernels::{
    add_rms_norm, argmax_rows, gather_rows, gemv, gemv_add_rms_norm, gemv_add_rms_norm_applies,
    gemv_applies, gemv_swiglu, gemv_swiglu_applies, kv_append, kv_move, limit_thread_stack,
    open_cuda, paged_attention, paged_attention_grouped, paged_attention_tensor_cores,
    paged_attention_tensor_cores_merged, paged_attention_with_warps, qkv_rope_append, scatter_rows,
    swiglu, top_k_logp, AttnSeq, PagedAttnMeta, GEMV_MAX_K, GEMV_MAX_ROWS, GEMV_STAGE_MAX_BYTES,
    GEMV_TILED_MIN_ROWS, TC_MAX_MASKED_NEW,
};
use kestrel_kernels::{chain_accept, draw_children, tree_accept, ChainOutcome, ChainSeq, TreeSeq};
use kestrel_kernels::{upload_into, IdsReadback};
use kestrel_spec::accept::{draft_target, exact_tree_sampling, DraftProposal};
use kestrel_spec::sampling::{probs, sample_token, SamplingParams, SeqRng};
use kestrel_spec::tree::{EagleTree, TreeLimits};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The device as the runtime opens it: with the per-thread stack cut to Kestrel's need, so
/// every kernel here (`top_k_logp`'s 256-byte frame the largest) runs under that limit.
fn gpu() -> Device {
    open_cuda(0).expect("these tests need a CUDA device (built with --features cuda)")
}

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

/// The values as `dtype` rounds them (so the CPU reference sees the kernel's inputs).
fn rounded(v: &[f32], dtype: DType) -> Vec<f32> {
    Tensor::new(v, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn to_dev(v: &[f32], shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Attention tolerances per dtype: the reference sees the rounded inputs and computes in
/// f32, so the error is the kernel's f32 order plus the output's rounding.
fn attn_tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

struct Case {
    nh: usize,
    nkv: usize,
    d: usize,
    /// Per sequence: (slots L, new tokens n, explicit tree mask?).
    seqs: Vec<(usize, usize, bool)>,
}

/// A tree mask over n new tokens: node i's parent is (i − 1) / 2, visible = ancestors + self.
fn tree_mask(n: usize) -> Vec<bool> {
    let mut m = vec![false; n * n];
    for i in 0..n {
        let mut k = i;
        loop {
            m[i * n + k] = true;
            if k == 0 {
                break;
            }
            k = (k - 1) / 2;
        }
    }
    m
}

/// An attention kernel family's entry point ([`paged_attention`] or
/// [`paged_attention_tensor_cores`]).
type Attend = fn(&Tensor, &Tensor, &Tensor, &PagedAttnMeta) -> candle_core::Result<Tensor>;

fn run_attention_case(case: &Case, dtype: DType, seed: u64, attend: Attend) {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (nh, nkv, d) = (case.nh, case.nkv, case.d);
    let total_slots: usize = case.seqs.iter().map(|s| s.0).sum::<usize>() + 7;
    // Slots scattered over the pool: a random permutation of its rows.
    let mut perm: Vec<u32> = (0..total_slots as u32).collect();
    for i in (1..perm.len()).rev() {
        let j = rng.random_range(0..=i);
        perm.swap(i, j);
    }
    let mut next = 0;
    let mut slot_lists = Vec::new();
    let mut masks = Vec::new();
    for &(l, n, tree) in &case.seqs {
        slot_lists.push(perm[next..next + l].to_vec());
        next += l;
        masks.push(tree.then(|| tree_mask(n)));
    }
    let seqs: Vec<AttnSeq> = case
        .seqs
        .iter()
        .enumerate()
        .map(|(i, &(_, n, _))| AttnSeq {
            slots: &slot_lists[i],
            n_new: n,
            mask: masks[i].as_deref(),
        })
        .collect();
    let n_tok: usize = case.seqs.iter().map(|s| s.1).sum();
    let kp = rounded(&randn(&mut rng, total_slots * nkv * d, 1.0), dtype);
    let vp = rounded(&randn(&mut rng, total_slots * nkv * d, 1.0), dtype);
    let q = rounded(&randn(&mut rng, n_tok * nh * d, 1.0), dtype);

    // CPU reference, f32 over the rounded values.
    let scale = 1.0 / (d as f32).sqrt();
    let mut want = vec![0f32; n_tok * nh * d];
    let mut t = 0;
    for (s, &(l, n, _)) in case.seqs.iter().enumerate() {
        for r in 0..n {
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let qr = &q[(t * nh + h) * d..(t * nh + h + 1) * d];
                let mut scores = Vec::new();
                for (i, &slot) in slot_lists[s].iter().enumerate().take(l) {
                    let visible = i < l - n || {
                        let j = i - (l - n);
                        match &masks[s] {
                            Some(m) => m[r * n + j],
                            None => j <= r,
                        }
                    };
                    if !visible {
                        continue;
                    }
                    let row = slot as usize;
                    let kr = &kp[(row * nkv + kvh) * d..(row * nkv + kvh + 1) * d];
                    let dot: f32 = qr.iter().zip(kr).map(|(a, b)| a * b).sum();
                    scores.push((row, dot * scale));
                }
                let mx = scores.iter().map(|s| s.1).fold(f32::NEG_INFINITY, f32::max);
                let denom: f32 = scores.iter().map(|s| (s.1 - mx).exp()).sum();
                let o = &mut want[(t * nh + h) * d..(t * nh + h + 1) * d];
                for &(row, sc) in &scores {
                    let p = (sc - mx).exp() / denom;
                    let vr = &vp[(row * nkv + kvh) * d..(row * nkv + kvh + 1) * d];
                    for e in 0..d {
                        o[e] += p * vr[e];
                    }
                }
            }
            t += 1;
        }
    }

    let meta = PagedAttnMeta::new(&seqs, &dev).unwrap();
    let out = attend(
        &to_dev(&q, &[n_tok, nh, d], dtype, &dev),
        &to_dev(&kp, &[total_slots, nkv, d], dtype, &dev),
        &to_dev(&vp, &[total_slots, nkv, d], dtype, &dev),
        &meta,
    )
    .unwrap();
    assert_eq!(out.dims(), [n_tok, nh * d]);
    assert_eq!(out.dtype(), dtype);
    let got = host(&out);
    let err = max_abs(&got, &want);
    assert!(
        err <= attn_tol(dtype),
        "paged attention {dtype:?} nh {nh} nkv {nkv} d {d} seqs {:?}: max abs error {err}",
        case.seqs
    );
}

#[test]
fn paged_attention_matches_cpu_reference() {
    let cases = [
        // SmolLM2's heads: decode of three sequences of different lengths (one long enough
        // for several 32-slot chunks per warp).
        Case {
            nh: 9,
            nkv: 3,
            d: 64,
            seqs: vec![(1, 1, false), (37, 1, false), (300, 1, false)],
        },
        // Verification: a tree under an explicit mask next to a causal chain.
        Case {
            nh: 9,
            nkv: 3,
            d: 64,
            seqs: vec![(45, 7, true), (20, 5, false), (130, 1, false)],
        },
        // Llama-2 shape (MHA, d 128) with a prompt (all slots new, causal).
        Case {
            nh: 4,
            nkv: 4,
            d: 128,
            seqs: vec![(70, 70, false), (9, 3, true)],
        },
        // Head dims that are not a multiple of 32, MQA, the tiny test model's d 8.
        Case {
            nh: 6,
            nkv: 1,
            d: 40,
            seqs: vec![(33, 2, false), (65, 1, false)],
        },
        Case {
            nh: 4,
            nkv: 2,
            d: 8,
            seqs: vec![(12, 4, true), (3, 1, false)],
        },
        // Long rows (4,100 slots: 16 chunks a warp), in one step with a short row and a
        // masked tree.
        Case {
            nh: 9,
            nkv: 3,
            d: 64,
            seqs: vec![(4100, 1, false), (700, 9, true), (5, 1, false)],
        },
        Case {
            nh: 4,
            nkv: 4,
            d: 128,
            seqs: vec![(1030, 4, false), (257, 1, false)],
        },
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (i, case) in cases.iter().enumerate() {
            run_attention_case(case, dtype, 100 + i as u64, paged_attention);
        }
    }
}

/// The tensor-core family against the same f32 reference: decode steps, chains and trees
/// whose lists end inside, at and past 64-slot tiles, cached tails that part-fill a tile,
/// contexts that spread over all four splits, several sequences of different sizes a step.
#[test]
fn tensor_core_attention_matches_cpu_reference() {
    let cases = [
        Case {
            nh: 9,
            nkv: 3,
            d: 64,
            seqs: vec![
                (1, 1, false),
                (64, 1, false),
                (65, 1, false),
                (300, 1, false),
            ],
        },
        Case {
            nh: 9,
            nkv: 3,
            d: 64,
            seqs: vec![
                (45, 7, true),
                (20, 5, false),
                (130, 1, false),
                (200, 64, true),
            ],
        },
        Case {
            nh: 4,
            nkv: 4,
            d: 128,
            seqs: vec![(70, 70, false), (9, 3, true), (1100, 64, false)],
        },
        Case {
            nh: 4,
            nkv: 2,
            d: 128,
            seqs: vec![(4100, 1, false), (700, 40, true), (5, 1, false)],
        },
    ];
    for dtype in [DType::F16, DType::BF16] {
        for (i, case) in cases.iter().enumerate() {
            run_attention_case(case, dtype, 300 + i as u64, paged_attention_tensor_cores);
        }
    }
}

#[test]
fn kv_append_writes_exactly_the_given_rows() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (slots, nkv, d) = (16, 3, 64);
        let ids = [5u32, 2, 9, 15];
        let rows = rounded(&randn(&mut rng, ids.len() * nkv * d, 1.0), dtype);
        let pool = Tensor::zeros((slots, nkv, d), dtype, &dev).unwrap();
        kv_append(
            &pool,
            &to_dev(&rows, &[ids.len(), nkv, d], dtype, &dev),
            &Tensor::new(&ids, &dev).unwrap(),
        )
        .unwrap();
        let got = host(&pool);
        let w = nkv * d;
        for s in 0..slots {
            let want: Vec<f32> = match ids.iter().position(|&i| i as usize == s) {
                Some(r) => rows[r * w..(r + 1) * w].to_vec(),
                None => vec![0.0; w],
            };
            assert_eq!(&got[s * w..(s + 1) * w], &want[..], "{dtype:?} slot {s}");
        }
    }
}

#[test]
fn kv_append_accepts_a_narrowed_slot_tensor() {
    // The model passes `PagedAttnMeta::new_slots`, a view at offset 0 of a longer buffer,
    // and rows built from a non-contiguous narrow.
    let dev = gpu();
    let a = [3u32, 1];
    let seqs = [AttnSeq {
        slots: &a,
        n_new: 2,
        mask: None,
    }];
    let meta = PagedAttnMeta::new(&seqs, &dev).unwrap();
    let wide = Tensor::arange(0f32, 2.0 * 8.0, &dev)
        .unwrap()
        .reshape((2, 8))
        .unwrap();
    let rows = wide.narrow(1, 4, 4).unwrap().reshape((2, 1, 4)).unwrap();
    let pool = Tensor::zeros((4, 1, 4), DType::F32, &dev).unwrap();
    kv_append(&pool, &rows, &meta.new_slots).unwrap();
    let got = host(&pool);
    assert_eq!(&got[12..16], &[4.0, 5.0, 6.0, 7.0]);
    assert_eq!(&got[4..8], &[12.0, 13.0, 14.0, 15.0]);
    assert_eq!(&got[0..4], &[0.0; 4]);
}

#[test]
fn add_rms_norm_matches_candle_cpu() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let eps = 1e-5f32;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // The one-pass path takes 1 to 4 vectors a thread (16,384 f32: 4); 20 and 1,500 in
        // f16/bf16 are not whole vectors. f16/bf16 rows of whole 16-column blocks up to 8,192
        // take the column-block kernel (8,192: two blocks a thread; 576: one or none).
        for (rows, h) in [
            (1usize, 576usize),
            (5, 4096),
            (2, 8192),
            (3, 20),
            (2, 1500),
            (2, 16384),
        ] {
            let x = rounded(&randn(&mut rng, rows * h, 2.0), dtype);
            let r = rounded(&randn(&mut rng, rows * h, 2.0), dtype);
            let w = rounded(&randn(&mut rng, h, 0.5), dtype)
                .iter()
                .map(|v| v + 1.0)
                .collect::<Vec<_>>();
            let w = rounded(&w, dtype);
            // CPU reference: candle ops as the model runs them.
            let xc = Tensor::from_slice(&x, (rows, h), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let rc = Tensor::from_slice(&r, (rows, h), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let wc = Tensor::from_slice(&w, h, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let sum = (&xc + &rc).unwrap();
            let ones = Tensor::ones(h, DType::F32, &Device::Cpu).unwrap();
            let normed = candle_nn::ops::rms_norm(&sum.to_dtype(DType::F32).unwrap(), &ones, eps)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .broadcast_mul(&wc)
                .unwrap();
            let (gs, gn) = add_rms_norm(
                &to_dev(&x, &[rows, h], dtype, &dev),
                &to_dev(&r, &[rows, h], dtype, &dev),
                &to_dev(&w, &[h], dtype, &dev),
                eps,
            )
            .unwrap();
            assert_eq!(gs.dims(), [rows, h]);
            assert_eq!(gn.dims(), [rows, h]);
            assert_eq!(host(&gs), host(&sum), "{dtype:?} sum must be exact");
            let tol = match dtype {
                DType::F32 => 1e-5,
                // One rounding step of a value up to ~4 (|normed|·|w|).
                DType::F16 => 4e-3,
                _ => 3.2e-2,
            };
            let err = max_abs(&host(&gn), &host(&normed));
            assert!(err <= tol, "{dtype:?} [{rows}, {h}]: max abs error {err}");
        }
    }
}

/// The fused kernel against the ops it replaces: candle's `rope_thd` on the projection's q
/// and k parts and `kv_append` of k and v.
#[test]
fn qkv_rope_append_matches_rope_and_two_appends() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // d = 24: 12 pairs a head, whole 16-byte vectors in f32 only.
        for (n_tok, nh, nkv, d) in [
            (1usize, 9usize, 3usize, 64usize),
            (5, 4, 2, 128),
            (3, 32, 32, 128),
            (2, 4, 2, 24),
        ] {
            let slots = 16;
            let ids: Vec<u32> = (0..n_tok as u32).map(|i| (i * 7 + 3) % slots).collect();
            let w = (nh + 2 * nkv) * d;
            let qkv = to_dev(&randn(&mut rng, n_tok * w, 2.0), &[n_tok, w], dtype, &dev);
            let angles: Vec<f32> = randn(&mut rng, n_tok * d / 2, 3.0);
            let cos_h: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
            let sin_h: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
            let cos = to_dev(&cos_h, &[n_tok, d / 2], dtype, &dev);
            let sin = to_dev(&sin_h, &[n_tok, d / 2], dtype, &dev);
            let slot_t = Tensor::new(ids.as_slice(), &dev).unwrap();
            let pools = || {
                let k = Tensor::zeros((slots as usize, nkv, d), dtype, &dev).unwrap();
                (k.clone(), k.zeros_like().unwrap())
            };
            let (kf, vf) = pools();
            let q = qkv_rope_append(&qkv, &cos, &sin, &slot_t, &kf, &vf, nh, nkv).unwrap();
            // The same rows one element past a 16-byte boundary take the kernel's one-pair
            // path, written like the 16-byte one (which keeps the old one-pair kernel's bits:
            // spec-bench's output digests) but contracted by ptxas in its own way: within the
            // rounding checked below, not bit for bit. Every step of a model takes the same
            // path (its tensors' alignment does not depend on the step).
            let (ku, vu) = pools();
            let qu =
                qkv_rope_append(&unaligned(&qkv), &cos, &sin, &slot_t, &ku, &vu, nh, nkv).unwrap();

            let part = |start: usize, heads: usize| {
                qkv.narrow(1, start * d, heads * d)
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .reshape((1, n_tok, heads, d))
                    .unwrap()
            };
            // candle's rope on the CPU: its CUDA kernel exists only where candle-nn is built
            // with `cuda`, which this crate's feature does not (and cannot, for a
            // dev-dependency) turn on.
            let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
            let rope = |x: Tensor| {
                candle_nn::rotary_emb::rope_thd(&cpu(&x), &cpu(&cos), &cpu(&sin))
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap()
            };
            let want_q = rope(part(0, nh));
            let (kr, vr) = pools();
            kv_append(&kr, &rope(part(nh, nkv)), &slot_t).unwrap();
            kv_append(&vr, &part(nh + nkv, nkv).squeeze(0).unwrap(), &slot_t).unwrap();
            let case = format!("{dtype:?} n_tok {n_tok}, {nh}/{nkv} heads, d {d}");
            assert_eq!(q.dims(), [n_tok, nh, d], "{case}");
            // Written like candle's kernel in the same dtype: equal, or at most a rounding
            // apart where nvcc contracted the two products differently.
            let tol = match dtype {
                DType::F32 => 2e-6,
                DType::F16 => 4e-3,
                _ => 3.2e-2,
            };
            for (what, got, want) in [
                ("q", &q, &want_q),
                ("K pool", &kf, &kr),
                ("V pool", &vf, &vr),
            ] {
                let err = max_abs(&host(got), &host(want));
                assert!(err <= tol, "{case}: {what} max abs error {err}");
            }
            assert_eq!(host(&vf), host(&vr), "{case}: V rows are copied exactly");
            assert_eq!(
                host(&vu),
                host(&vr),
                "{case}: V rows are copied exactly unaligned"
            );
            for (what, got, want) in [("q", &qu, &want_q), ("K pool", &ku, &kr)] {
                let err = max_abs(&host(got), &host(want));
                assert!(err <= tol, "{case}: {what} unaligned, max abs error {err}");
            }
        }
    }
}

#[test]
fn swiglu_matches_candle_cpu() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (rows, inter) in [(1usize, 1536usize), (7, 40), (3, 11008)] {
            let gu = rounded(&randn(&mut rng, rows * 2 * inter, 4.0), dtype);
            let c = Tensor::from_slice(&gu, (rows, 2 * inter), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want = (c.narrow(1, 0, inter).unwrap().silu().unwrap()
                * c.narrow(1, inter, inter).unwrap())
            .unwrap();
            let dev_gu = to_dev(&gu, &[rows, 2 * inter], dtype, &dev);
            let got = swiglu(&dev_gu).unwrap();
            assert_eq!(got.dims(), [rows, inter]);
            // One element past a 16-byte boundary: the kernel's one-value path, same bits.
            assert!(
                host(&swiglu(&unaligned(&dev_gu)).unwrap()) == host(&got),
                "{dtype:?} [{rows}, {inter}]: differs unaligned"
            );
            let tol = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 2e-2,
                _ => 1.3e-1,
            };
            let err = max_abs(&host(&got), &host(&want));
            assert!(
                err <= tol,
                "{dtype:?} [{rows}, {inter}]: max abs error {err}"
            );
        }
    }
}

#[test]
fn argmax_rows_matches_cpu_with_ties_to_the_lowest_index() {
    // 49,152 takes the kernel's 16-byte loads, 49,159 its one-by-one path.
    for vocab in [49_152, 49_152 + 7] {
        argmax_case(vocab);
    }
}

fn argmax_case(vocab: usize) {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let rows = 6;
    let mut x = randn(&mut rng, rows * vocab, 10.0);
    // Row 1: a tie between two far-apart entries; row 2: all equal.
    x[vocab + 100] = 50.0;
    x[vocab + 40_000] = 50.0;
    for v in &mut x[2 * vocab..3 * vocab] {
        *v = 1.0;
    }
    // Row 3: NaNs, one of them first; row 4: all NaN; row 5: all -inf.
    x[3 * vocab] = f32::NAN;
    x[3 * vocab + 7] = f32::NAN;
    for v in &mut x[4 * vocab..5 * vocab] {
        *v = f32::NAN;
    }
    for v in &mut x[5 * vocab..6 * vocab] {
        *v = f32::NEG_INFINITY;
    }
    let want: Vec<u32> = (0..rows)
        .map(|r| kestrel_spec::sampling::argmax(&x[r * vocab..(r + 1) * vocab]))
        .collect();
    let t = Tensor::from_slice(&x, (rows, vocab), &Device::Cpu)
        .unwrap()
        .to_device(&dev)
        .unwrap();
    let got = argmax_rows(&t).unwrap().to_vec1::<u32>().unwrap();
    assert_eq!(got, want, "vocabulary {vocab}");
    assert_eq!(got[1], 100);
    assert_eq!(got[2], 0);
    assert_ne!(got[3], 0, "a NaN must not win");
    assert_eq!(got[4], 0);
}

/// `kestrel_kernels::sample_rows` with the params' filter, rows and uniforms on the device.
fn device_samples(x: &[f32], vocab: usize, uniforms: &[f32], p: &SamplingParams) -> Vec<u32> {
    let dev = gpu();
    kestrel_kernels::sample_rows(
        &Tensor::from_slice(x, (uniforms.len(), vocab), &Device::Cpu)
            .unwrap()
            .to_device(&dev)
            .unwrap(),
        &Tensor::from_slice(uniforms, uniforms.len(), &Device::Cpu)
            .unwrap()
            .to_device(&dev)
            .unwrap(),
        p.temperature,
        p.top_k,
        p.top_p,
    )
    .unwrap()
    .to_vec1::<u32>()
    .unwrap()
}

/// Whether the host's nucleus of `row` is decided within rounding at `token`: the mass before
/// it (descending probability, lower id first, after top-k) is within 1e-5 of top_p, so f32
/// weights on the device may keep or drop it where the host's f64 does the opposite.
fn at_nucleus_edge(row: &[f32], p: &SamplingParams, token: u32) -> bool {
    let top_k_only = SamplingParams { top_p: 1.0, ..*p };
    let q = kestrel_spec::sampling::probs(row, &top_k_only);
    let mut order: Vec<usize> = (0..q.len()).collect();
    order.sort_by(|&a, &b| q[b].total_cmp(&q[a]).then(a.cmp(&b)));
    let mut before = 0.0f64;
    for i in order {
        if i == token as usize {
            return (before - p.top_p as f64).abs() < 1e-5;
        }
        before += q[i] as f64;
    }
    false
}

#[test]
fn sample_rows_picks_the_hosts_token_from_the_same_draw() {
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    // Temperature alone, top-k, top-p, both, and filters that keep one token. No top_p puts
    // the flat row's cut at a whole number of tokens: there the host's f64 running sum may
    // land a hair under top_p and keep one token more than exact arithmetic (the device's
    // integer masses) does.
    let filters = [
        (0, 1.0),
        (40, 1.0),
        (0, 0.9),
        (50, 0.8),
        (1, 1.0),
        (0, 0.05),
        (3, 0.45),
    ];
    // 49,152: SmolLM2's rows; 1,003: chunks and tiles that do not divide it.
    for vocab in [49_152usize, 1_003] {
        let rows = 96;
        let mut x = randn(&mut rng, rows * vocab, 3.0);
        // Row 0: NaNs; row 1: all -inf (the argmax, 0); row 2: one finite entry; row 3: every
        // logit equal (top-p keeps the lowest ids: ties in id order); row 4: five equal
        // maxima far above the rest (top-k keeps all five: ties with the k-th).
        x[5] = f32::NAN;
        x[vocab - 1] = f32::NAN;
        x[vocab..2 * vocab].fill(f32::NEG_INFINITY);
        x[2 * vocab..3 * vocab].fill(f32::NEG_INFINITY);
        x[2 * vocab + vocab / 2] = -3.0;
        x[3 * vocab..4 * vocab].fill(0.5);
        let maxima = [
            4 * vocab + 3,
            4 * vocab + 100,
            4 * vocab + 500,
            4 * vocab + 501,
            5 * vocab - 2,
        ];
        x[4 * vocab..5 * vocab].iter_mut().for_each(|v| *v -= 30.0);
        maxima.iter().for_each(|&i| x[i] = 9.0);
        for (top_k, top_p) in filters {
            let params = SamplingParams {
                temperature: 0.7,
                top_k,
                top_p,
                ..SamplingParams::default()
            };
            let what = format!("vocabulary {vocab}, top_k {top_k}, top_p {top_p}");
            let mut stream = SeqRng::new(7, vocab as u64);
            let mut uniforms = Vec::with_capacity(rows);
            let mut want = Vec::with_capacity(rows);
            for r in 0..rows {
                uniforms.push(stream.clone().uniform() as f32);
                want.push(sample_token(
                    &x[r * vocab..(r + 1) * vocab],
                    &params,
                    &mut stream,
                ));
            }
            let got = device_samples(&x, vocab, &uniforms, &params);
            assert_eq!(got[1], 0, "{what}: a row without a finite logit");
            assert_eq!(got[2] as usize, vocab / 2, "{what}: one finite logit");
            assert!(
                maxima.contains(&(4 * vocab + got[4] as usize)),
                "{what}: {}",
                got[4]
            );
            if top_p < 1.0 {
                // The first ceil(top_p · vocab) ids are the nucleus of a flat row.
                let kept = (top_p as f64 * vocab as f64).ceil() as u32;
                assert!(got[3] < kept.max(1), "{what}: flat row drew {}", got[3]);
            }
            if top_k == 1 {
                // Only the maximum is left (every token equal to it: ties with the k-th stay).
                for r in 5..rows {
                    let row = &x[r * vocab..(r + 1) * vocab];
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    assert_eq!(row[got[r] as usize], max, "{what}, row {r}: {}", got[r]);
                }
            }
            // f32 weights on the device against f64 on the host: a draw within rounding of a
            // token's cumulative boundary may land on its neighbour, and a token whose
            // nucleus membership is decided within rounding may go either way; nothing else.
            let mut near_boundary = 0;
            for r in 0..rows {
                if got[r] == want[r] {
                    continue;
                }
                let row = &x[r * vocab..(r + 1) * vocab];
                let probs = kestrel_spec::sampling::probs(row, &params);
                let edge: f64 = probs[..=got[r].min(want[r]) as usize]
                    .iter()
                    .map(|&p| p as f64)
                    .sum();
                assert!(
                    (edge - uniforms[r] as f64).abs() < 1e-5
                        || at_nucleus_edge(row, &params, got[r])
                        || at_nucleus_edge(row, &params, want[r]),
                    "{what}, row {r}: device {} host {} for u = {}",
                    got[r],
                    want[r],
                    uniforms[r]
                );
                near_boundary += 1;
            }
            assert!(near_boundary <= 2, "{what}: {near_boundary} rows differ");
        }
    }
}

/// Counts of the tokens drawn against probabilities `probs` (8 tokens): a token of
/// probability 0 never drawn, and χ² under the critical value at p = 0.001.
fn assert_follows(counts: &[f64; 8], probs: &[f32], what: &str) {
    // χ² critical values at p = 0.001 for 1..=7 degrees of freedom.
    let critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32];
    let n: f64 = counts.iter().sum();
    let mut chi2 = 0.0;
    let mut cells = 0;
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            assert_eq!(c, 0.0, "{what}: a filtered token was drawn");
            continue;
        }
        let e = p as f64 * n;
        chi2 += (c - e) * (c - e) / e;
        cells += 1;
    }
    assert!(
        chi2 < critical[cells - 2],
        "{what}: chi-square {chi2}: counts {counts:?}, probabilities {probs:?}"
    );
}

#[test]
fn sample_rows_follows_the_filtered_softmax() {
    let logits = [0.0f32, 0.5, 1.0, -1.0, 2.0, 0.25, -0.5, 1.5];
    let draws = 20_000;
    for (top_k, top_p) in [(0, 1.0), (5, 1.0), (0, 0.8), (6, 0.7)] {
        let params = SamplingParams {
            temperature: 0.9,
            top_k,
            top_p,
            ..SamplingParams::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(43);
        let x: Vec<f32> = logits.iter().copied().cycle().take(draws * 8).collect();
        let uniforms: Vec<f32> = (0..draws).map(|_| rng.random::<f32>()).collect();
        let got = device_samples(&x, 8, &uniforms, &params);
        let mut counts = [0f64; 8];
        for &t in &got {
            counts[t as usize] += 1.0;
        }
        let probs = kestrel_spec::sampling::probs(&logits, &params);
        assert_follows(&counts, &probs, &format!("top_k {top_k} top_p {top_p}"));
    }
}

/// `kestrel_kernels::sample_typical_rows` on the device.
fn device_typical(x: &[f32], vocab: usize, uniforms: &[f32], t: f32, eps: f32) -> Vec<u32> {
    let dev = gpu();
    kestrel_kernels::sample_typical_rows(
        &Tensor::from_slice(x, (uniforms.len(), vocab), &dev).unwrap(),
        &Tensor::from_slice(uniforms, uniforms.len(), &dev).unwrap(),
        t,
        eps,
    )
    .unwrap()
    .to_vec1::<u32>()
    .unwrap()
}

#[test]
fn sample_typical_rows_picks_the_hosts_token_from_the_same_draw() {
    use kestrel_spec::accept::{typical_probs, TypicalParams};
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    for vocab in [49_152usize, 1_003] {
        let rows = 64;
        // Scales from flat rows (every token above the cut) to peaked ones (one or two left).
        let mut x: Vec<f32> = (0..rows)
            .flat_map(|r| randn(&mut rng, vocab, 0.5 + 0.25 * (r % 16) as f32))
            .collect();
        // Row 0: NaNs; row 1: all -inf (the argmax, 0); row 2: one finite entry.
        x[5] = f32::NAN;
        x[vocab..2 * vocab].fill(f32::NEG_INFINITY);
        x[2 * vocab..3 * vocab].fill(f32::NEG_INFINITY);
        x[2 * vocab + 7] = -1.0;
        for (temperature, eps) in [(0.7f32, 0.09f32), (1.0, 0.3), (1.3, 0.01)] {
            let params = TypicalParams {
                posterior_threshold: eps,
                temperature,
            };
            let what = format!("vocabulary {vocab}, temperature {temperature}, ε {eps}");
            let uniforms: Vec<f32> = (0..rows).map(|_| rng.random::<f32>()).collect();
            let got = device_typical(&x, vocab, &uniforms, temperature, eps);
            assert_eq!(got[1], 0, "{what}: a row without a finite logit");
            assert_eq!(got[2], 7, "{what}: one finite logit");
            let mut differ = 0;
            for r in 0..rows {
                let row = &x[r * vocab..(r + 1) * vocab];
                let p = typical_probs(row, &params);
                let want = kestrel_spec::sampling::sample_at(&p, uniforms[r] as f64);
                assert!(
                    p[got[r] as usize] > 0.0 || p.iter().all(|&v| v == 0.0),
                    "{what}, row {r}: {} is cut",
                    got[r]
                );
                if got[r] == want {
                    continue;
                }
                // Within rounding of a cumulative boundary, or of the cut.
                let edge: f64 = p[..=got[r].min(want) as usize]
                    .iter()
                    .map(|&v| v as f64)
                    .sum();
                let soft = kestrel_spec::sampling::softmax(row, temperature);
                let h: f64 = -soft
                    .iter()
                    .filter(|&&v| v > 0.0)
                    .map(|&v| v as f64 * (v as f64).ln())
                    .sum::<f64>();
                let cut = (eps as f64).min((eps as f64).sqrt() * (-h).exp());
                let near_cut = soft.iter().any(|&v| ((v as f64) - cut).abs() < 1e-6);
                assert!(
                    (edge - uniforms[r] as f64).abs() < 1e-5 || near_cut,
                    "{what}, row {r}: device {} host {want} for u = {}",
                    got[r],
                    uniforms[r]
                );
                differ += 1;
            }
            assert!(differ <= 2, "{what}: {differ} rows differ");
        }
    }
}

/// One sequence of a chain-acceptance case: its target rows (k + 1) and draft rows (k) as
/// indices into the case's logits, its drafts and its k + 1 uniforms.
struct Chain {
    target_row: usize,
    draft_rows: Vec<u32>,
    tokens: Vec<u32>,
    uniforms: Vec<f32>,
}

/// `chain_accept` on the device over `target` `[.., vocab]` and `draft` logits.
fn device_chains(
    target: &[f32],
    draft: &[f32],
    vocab: usize,
    chains: &[Chain],
    p: &SamplingParams,
) -> candle_core::Result<Vec<ChainOutcome>> {
    let dev = gpu();
    let t = Tensor::from_slice(target, (target.len() / vocab, vocab), &dev)?;
    let d = Tensor::from_slice(draft, (draft.len() / vocab, vocab), &dev)?;
    let seqs: Vec<ChainSeq> = chains
        .iter()
        .map(|c| ChainSeq {
            target_row: c.target_row,
            draft_rows: &c.draft_rows,
            tokens: &c.tokens,
            uniforms: &c.uniforms,
        })
        .collect();
    chain_accept(&t, &d, &seqs, p.temperature, p.top_k, p.top_p)
}

/// Row `r` of `[.., vocab]` logits.
fn row(x: &[f32], vocab: usize, r: usize) -> &[f32] {
    &x[r * vocab..(r + 1) * vocab]
}

#[test]
fn chain_accept_gives_the_hosts_outcome_from_the_same_uniforms() {
    let mut rng = ChaCha8Rng::seed_from_u64(47);
    for vocab in [49_152usize, 1_003] {
        for (top_k, top_p) in [(0, 1.0), (50, 1.0), (0, 0.9), (40, 0.8)] {
            let params = SamplingParams {
                temperature: 0.8,
                top_k,
                top_p,
                ..SamplingParams::default()
            };
            let what = format!("vocabulary {vocab}, top_k {top_k}, top_p {top_p}");
            // 48 sequences of 0 to 4 drafts; a draft row is its target row plus noise (none
            // for every fifth sequence: p = q, every draft accepted up to rounding), stored in
            // reverse order so that the draft rows are looked up, not assumed.
            let mut target = Vec::new();
            let mut drafts: Vec<Vec<f32>> = Vec::new();
            let mut chains = Vec::new();
            let mut host = Vec::new();
            for s in 0..48usize {
                let k = s % 5;
                let noise = if s % 5 == 4 {
                    0.0
                } else {
                    0.3 + 0.3 * (s % 3) as f32
                };
                let target_row = target.len() / vocab;
                target.extend(randn(&mut rng, (k + 1) * vocab, 3.0));
                let mut q_probs = Vec::new();
                let mut tokens = Vec::new();
                let mut draft_rows = Vec::new();
                let mut stream = SeqRng::new(11, s as u64);
                for i in 0..k {
                    let t_row = row(&target, vocab, target_row + i);
                    let d_row: Vec<f32> = t_row
                        .iter()
                        .zip(randn(&mut rng, vocab, noise.max(1e-9)))
                        .map(|(&a, b)| if noise == 0.0 { a } else { a + b })
                        .collect();
                    let q = probs(&d_row, &params);
                    tokens.push(kestrel_spec::sampling::sample(&q, &mut stream));
                    q_probs.extend_from_slice(&q);
                    draft_rows.push(drafts.len() as u32);
                    drafts.push(d_row);
                }
                let p_probs: Vec<f32> = (0..=k)
                    .flat_map(|i| probs(row(&target, vocab, target_row + i), &params))
                    .collect();
                let uniforms: Vec<f32> = {
                    let mut ahead = stream.clone();
                    (0..=k).map(|_| ahead.uniform() as f32).collect()
                };
                host.push(draft_target(&tokens, &q_probs, &p_probs, vocab, &mut stream).unwrap());
                chains.push(Chain {
                    target_row,
                    draft_rows,
                    tokens,
                    uniforms,
                });
            }
            let n_draft = drafts.len() as u32;
            for c in &mut chains {
                c.draft_rows.iter_mut().for_each(|r| *r = n_draft - 1 - *r);
            }
            let draft: Vec<f32> = drafts.into_iter().rev().flatten().collect();
            let got = device_chains(&target, &draft, vocab, &chains, &params).unwrap();
            let mut differ = 0;
            for (s, ((c, h), g)) in chains.iter().zip(&host).zip(&got).enumerate() {
                let k = c.tokens.len();
                if s % 5 == 4 {
                    assert_eq!(
                        g.accepted, k,
                        "{what}, sequence {s}: p = q accepts every draft"
                    );
                }
                if g.accepted == h.accepted_len && Some(&g.token) == h.tokens.last() {
                    continue;
                }
                // f32 laws on the device against f64 on the host: an outcome may differ only
                // where a test or a draw was decided within rounding.
                let i = g.accepted.min(h.accepted_len);
                let p = probs(row(&target, vocab, c.target_row + i), &params);
                let near = if i < k {
                    let q = probs(row(&draft, vocab, c.draft_rows[i] as usize), &params);
                    let x = c.tokens[i] as usize;
                    ((c.uniforms[i] * q[x]) as f64 - p[x] as f64).abs() < 1e-5
                        || g.accepted == h.accepted_len // the residual's draw
                } else {
                    let edge: f64 = p[..=g.token.min(*h.tokens.last().unwrap()) as usize]
                        .iter()
                        .map(|&v| v as f64)
                        .sum();
                    (edge - c.uniforms[k] as f64).abs() < 1e-5
                        || at_nucleus_edge(row(&target, vocab, c.target_row + k), &params, g.token)
                };
                assert!(near, "{what}, sequence {s}: device {g:?}, host {h:?}");
                differ += 1;
            }
            assert!(differ <= 2, "{what}: {differ} of 48 sequences differ");
        }
    }
}

#[test]
fn chain_accept_refuses_a_draft_its_law_excludes() {
    let vocab = 16;
    let x: Vec<f32> = (0..2 * vocab).map(|i| (i % vocab) as f32 * 0.1).collect();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        ..SamplingParams::default()
    };
    // top_k 1 keeps token 15 alone; token 3 cannot have been drawn from the draft row.
    let chain = Chain {
        target_row: 0,
        draft_rows: vec![0],
        tokens: vec![3],
        uniforms: vec![0.5, 0.5],
    };
    let err = device_chains(&x, &x[..vocab], vocab, &[chain], &params).unwrap_err();
    assert!(
        err.to_string().contains(
            "chain_accept: draft token 3 of sequence 0 (position 0) has probability 0 under its draft row's law"
        ),
        "{err}"
    );
}

/// Speculative sampling is lossless: over 20,000 chains of two drafts the first emitted token
/// follows the target's first law and the second its second (the laws here do not depend on
/// the first token), whatever the draft proposed, with top-k and top-p filters on both.
#[test]
fn chain_accept_emits_the_targets_distribution() {
    let vocab = 8;
    let draws = 20_000;
    let p_rows: [[f32; 8]; 3] = [
        [0.0, 0.5, 1.0, -1.0, 2.0, 0.25, -0.5, 1.5],
        [1.0, -2.0, 0.3, 0.3, 0.9, 1.7, -0.2, 0.0],
        [0.0; 8],
    ];
    let q_rows: [[f32; 8]; 2] = [
        [1.5, 0.5, -1.0, 0.0, 0.5, 1.25, 0.5, -0.5],
        [0.0, 0.0, 2.0, -1.0, 0.9, 0.2, 0.4, 1.0],
    ];
    for (top_k, top_p) in [(0, 1.0), (6, 1.0), (0, 0.85)] {
        let params = SamplingParams {
            temperature: 0.9,
            top_k,
            top_p,
            ..SamplingParams::default()
        };
        let target: Vec<f32> = p_rows.iter().flatten().copied().collect();
        let draft: Vec<f32> = q_rows.iter().flatten().copied().collect();
        let q: Vec<Vec<f32>> = q_rows.iter().map(|r| probs(r, &params)).collect();
        let mut rng = SeqRng::new(43, top_k as u64);
        let chains: Vec<Chain> = (0..draws)
            .map(|_| Chain {
                target_row: 0,
                draft_rows: vec![0, 1],
                tokens: vec![
                    kestrel_spec::sampling::sample(&q[0], &mut rng),
                    kestrel_spec::sampling::sample(&q[1], &mut rng),
                ],
                uniforms: (0..3).map(|_| rng.uniform() as f32).collect(),
            })
            .collect();
        let got = device_chains(&target, &draft, vocab, &chains, &params).unwrap();
        let mut counts = [[0f64; 8]; 2];
        for (c, g) in chains.iter().zip(&got) {
            let emitted: Vec<u32> = c.tokens[..g.accepted]
                .iter()
                .copied()
                .chain([g.token])
                .collect();
            for (position, &t) in emitted.iter().take(2).enumerate() {
                counts[position][t as usize] += 1.0;
            }
        }
        for (position, counts) in counts.iter().enumerate() {
            assert_follows(
                counts,
                &probs(&p_rows[position], &params),
                &format!("top_k {top_k} top_p {top_p}, token {position}"),
            );
        }
    }
}

/// kestrel-runtime's sample_without_replacement: k draws from `q`, each zeroing what it drew;
/// once nothing is left the first draw (0 for none) fills in without a uniform.
fn host_draws(q: &[f32], k: usize, rng: &mut SeqRng) -> Vec<u32> {
    let mut q = q.to_vec();
    let mut out = Vec::with_capacity(k);
    for _ in 0..k {
        if q.iter().all(|&x| x <= 0.0) {
            out.push(out.first().copied().unwrap_or(0));
            continue;
        }
        let t = kestrel_spec::sampling::sample(&q, rng);
        q[t as usize] = 0.0;
        out.push(t);
    }
    out
}

#[test]
fn draw_children_draws_the_hosts_children_from_the_same_uniforms() {
    let mut rng = ChaCha8Rng::seed_from_u64(59);
    let (n_seq, width, k) = (6, 3, 4);
    for columns in [4_096usize, 1_003] {
        // top_k 2 and a tight top_p leave fewer than k tokens: the fillers take no uniform.
        for (top_k, top_p) in [(0, 1.0), (2, 1.0), (0, 0.5), (20, 0.9)] {
            let params = SamplingParams {
                temperature: 0.8,
                top_k,
                top_p,
                ..SamplingParams::default()
            };
            let what = format!("{columns} columns, top_k {top_k}, top_p {top_p}");
            let x = randn(&mut rng, n_seq * width * columns, 3.0);
            let mut want = Vec::new();
            let mut want_used = Vec::new();
            let mut uniforms = Vec::new();
            for s in 0..n_seq {
                let mut stream = SeqRng::new(13, s as u64);
                let mut ahead = stream.clone();
                uniforms.push(
                    (0..width * k)
                        .map(|_| ahead.uniform() as f32)
                        .collect::<Vec<f32>>(),
                );
                let mut probe = stream.clone();
                for j in 0..width {
                    let q = probs(row(&x, columns, s * width + j), &params);
                    want.push(host_draws(&q, k, &mut stream));
                }
                let mut used = 0;
                while probe.uniform() != stream.clone().uniform() {
                    used += 1;
                }
                want_used.push(used);
            }
            let dev = gpu();
            let logits = Tensor::from_slice(&x, (n_seq * width, columns), &dev).unwrap();
            let (got, used) = draw_children(
                &logits,
                n_seq,
                width,
                k,
                &uniforms,
                params.temperature,
                params.top_k,
                params.top_p,
            )
            .unwrap();
            let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            assert!(
                differ <= 1,
                "{what}: {differ} rows differ: {got:?} vs {want:?}"
            );
            if differ == 0 {
                assert_eq!(used, want_used, "{what}");
            }
            for picks in &got {
                let mut distinct = picks.clone();
                distinct.sort_unstable();
                distinct.dedup();
                // Without replacement: k distinct columns while k are kept; top_k 2 keeps two
                // (ties aside), so the rest repeat the first draw.
                match top_k {
                    0 if top_p == 1.0 => assert_eq!(distinct.len(), k, "{what}: {picks:?}"),
                    2 => assert!(
                        distinct.len() == 2 && picks[2..].iter().all(|&c| c == picks[0]),
                        "{what}: {picks:?}"
                    ),
                    _ => {}
                }
            }
        }
    }
}

fn tree_limits() -> TreeLimits {
    TreeLimits {
        num_eagle_layers: 4,
        max_non_leaves_per_layer: 10,
        max_draft_len: 63,
        max_top_k: 10,
    }
}

/// A verified tree for the tree-acceptance tests: target logits for every node, draft logits
/// (over `ids`' columns) for every non-leaf, tokens drawn from them without replacement (or
/// their top-k when `deterministic`), and the host's inputs.
struct TreeCase {
    target: Vec<f32>,
    draft: Vec<f32>,
    draft_rows: Vec<Option<u32>>,
    tokens: Vec<u32>,
    target_probs: Vec<f32>,
    draft_probs: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn tree_case(
    tree: &EagleTree,
    vocab: usize,
    ids: &[u32],
    params: &SamplingParams,
    noise: f32,
    deterministic: bool,
    rng: &mut ChaCha8Rng,
    stream: &mut SeqRng,
) -> TreeCase {
    let b = tree.buffers();
    let n = b.num_nodes();
    let target = randn(rng, n * vocab, 3.0);
    let mut case = TreeCase {
        target_probs: (0..n)
            .flat_map(|i| probs(row(&target, vocab, i), params))
            .collect(),
        target,
        draft: Vec::new(),
        draft_rows: vec![None; n],
        tokens: vec![0; n],
        draft_probs: vec![0f32; n * vocab],
    };
    for node in 0..n {
        let children = b.children(node);
        if children.is_empty() {
            continue;
        }
        // The draft row over ids' columns: the target's logits there plus noise.
        let d_row: Vec<f32> = ids
            .iter()
            .map(|&t| case.target[node * vocab + t as usize] + noise * rng.random::<f32>())
            .collect();
        let q = probs(&d_row, params);
        for (c, &t) in ids.iter().enumerate() {
            case.draft_probs[node * vocab + t as usize] = q[c];
        }
        let picks: Vec<u32> = if deterministic {
            let mut order: Vec<usize> = (0..ids.len()).collect();
            order.sort_by(|&a, &b| q[b].total_cmp(&q[a]).then(a.cmp(&b)));
            order.iter().map(|&c| c as u32).collect()
        } else {
            let k = children.iter().map(|&c| b.ranks()[c]).max().unwrap() + 1;
            host_draws(&q, k, stream)
        };
        for &c in children {
            case.tokens[c] = ids[picks[b.ranks()[c]] as usize];
        }
        case.draft_rows[node] = Some((case.draft.len() / ids.len()) as u32);
        case.draft.extend(d_row);
    }
    case
}

#[test]
fn tree_accept_gives_the_hosts_outcome_from_the_same_uniforms() {
    let mut rng = ChaCha8Rng::seed_from_u64(61);
    let trees = [
        EagleTree::from_json(
            "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,1]]",
            &tree_limits(),
        )
        .unwrap(),
        EagleTree::from_json("[[0],[1],[2],[3],[0,0],[0,0,0]]", &tree_limits()).unwrap(),
    ];
    let vocab = 1_003;
    // The whole vocabulary as draft columns, or a draft vocabulary of 600 ids out of order.
    let mut subset: Vec<u32> = (0..vocab as u32).rev().step_by(1).take(600).collect();
    subset.rotate_left(17);
    let all: Vec<u32> = (0..vocab as u32).collect();
    for (ids, deterministic) in [(&all, false), (&subset, false), (&all, true)] {
        for (top_k, top_p) in [(0, 1.0), (0, 0.9), (30, 1.0)] {
            let params = SamplingParams {
                temperature: 0.9,
                top_k,
                top_p,
                ..SamplingParams::default()
            };
            let what = format!(
                "{} draft columns, deterministic {deterministic}, top_k {top_k}, top_p {top_p}",
                ids.len()
            );
            let mut target = Vec::new();
            let mut draft = Vec::new();
            let mut cases = Vec::new();
            let mut root = 0;
            for s in 0..32usize {
                let tree = &trees[s % 2];
                let mut stream = SeqRng::new(17, s as u64);
                // Agreeing drafts, loose ones, and ones far off: every outcome occurs.
                let noise = [0.0, 1.0, 4.0][s % 3];
                let mut c = tree_case(
                    tree,
                    vocab,
                    ids,
                    &params,
                    noise,
                    deterministic,
                    &mut rng,
                    &mut stream,
                );
                let offset = (draft.len() / ids.len()) as u32;
                c.draft_rows.iter_mut().flatten().for_each(|r| *r += offset);
                target.extend_from_slice(&c.target);
                draft.extend_from_slice(&c.draft);
                let n = c.tokens.len();
                let uniforms: Vec<f32> = {
                    let mut ahead = stream.clone();
                    (0..n).map(|_| ahead.uniform() as f32).collect()
                };
                let proposal = if deterministic {
                    DraftProposal::Deterministic
                } else {
                    DraftProposal::WithoutReplacement {
                        draft_probs: &c.draft_probs,
                    }
                };
                let mut after = stream.clone();
                let host = exact_tree_sampling(
                    tree.buffers(),
                    &c.tokens,
                    &c.target_probs,
                    vocab,
                    proposal,
                    &mut after,
                )
                .unwrap();
                cases.push((tree, c, uniforms, host, stream, after, root));
                root += n;
            }
            let dev = gpu();
            let t = Tensor::from_slice(&target, (target.len() / vocab, vocab), &dev).unwrap();
            let d = Tensor::from_slice(&draft, (draft.len() / ids.len(), ids.len()), &dev).unwrap();
            let mut table = vec![u32::MAX; vocab];
            for (c, &id) in ids.iter().enumerate() {
                table[id as usize] = c as u32;
            }
            let col_of = Tensor::from_vec(table, vocab, &dev).unwrap();
            let seqs: Vec<TreeSeq> = cases
                .iter()
                .map(|(tree, c, u, _, _, _, root)| {
                    let b = tree.buffers();
                    TreeSeq {
                        root_row: *root,
                        tokens: &c.tokens,
                        ranks: b.ranks(),
                        children: (0..b.num_nodes()).map(|i| b.children(i)).collect(),
                        draft_rows: (!deterministic).then(|| c.draft_rows.clone()),
                        uniforms: u,
                    }
                })
                .collect();
            let got = tree_accept(
                &t,
                (!deterministic).then_some(&d),
                (ids.len() < vocab).then_some(&col_of),
                &seqs,
                params.temperature,
                params.top_k,
                params.top_p,
            )
            .unwrap();
            let mut differ = 0;
            for (s, ((_, _, _, host, stream, after, _), g)) in cases.iter().zip(&got).enumerate() {
                if g.accepted_nodes == host.accepted_nodes && g.bonus == host.bonus_token {
                    let mut advanced = stream.clone();
                    for _ in 0..g.uniforms_used {
                        advanced.uniform();
                    }
                    assert_eq!(
                        advanced.uniform(),
                        after.clone().uniform(),
                        "{what}, sequence {s}: {} uniforms used",
                        g.uniforms_used
                    );
                    continue;
                }
                differ += 1;
                eprintln!("{what}, sequence {s}: device {g:?}, host {host:?}");
            }
            // f32 on the device against f64 on the host: only draws decided within rounding.
            assert!(differ <= 1, "{what}: {differ} of 32 trees differ");
        }
    }
}

/// Lossless: the first emitted token of a tree whose root has three sampled children follows
/// the target's law at the root, over 20,000 trees, with and without filters.
#[test]
fn tree_accept_emits_the_targets_distribution() {
    let vocab = 8;
    let draws = 20_000;
    let tree = EagleTree::from_json("[[0],[1],[2]]", &tree_limits()).unwrap();
    let b = tree.buffers();
    let p_root = [0.0f32, 0.5, 1.0, -1.0, 2.0, 0.25, -0.5, 1.5];
    let q_root = [1.5f32, 0.5, -1.0, 0.0, 0.5, 1.25, 0.5, -0.5];
    for (top_k, top_p) in [(0, 1.0), (6, 1.0), (0, 0.85)] {
        let params = SamplingParams {
            temperature: 0.9,
            top_k,
            top_p,
            ..SamplingParams::default()
        };
        let q = probs(&q_root, &params);
        let mut rng = SeqRng::new(71, top_k as u64);
        let mut target = Vec::new();
        let trees: Vec<(Vec<u32>, Vec<f32>)> = (0..draws)
            .map(|_| {
                let picks = host_draws(&q, 3, &mut rng);
                let mut tokens = vec![0u32];
                tokens.extend(picks);
                target.extend_from_slice(&p_root);
                target.extend(std::iter::repeat_n(0.0f32, 3 * vocab)); // leaves: uniform
                (tokens, (0..4).map(|_| rng.uniform() as f32).collect())
            })
            .collect();
        let dev = gpu();
        let t = Tensor::from_slice(&target, (target.len() / vocab, vocab), &dev).unwrap();
        let d = Tensor::from_slice(&q_root, (1, vocab), &dev).unwrap();
        let seqs: Vec<TreeSeq> = trees
            .iter()
            .enumerate()
            .map(|(s, (tokens, u))| TreeSeq {
                root_row: 4 * s,
                tokens,
                ranks: b.ranks(),
                children: (0..4).map(|i| b.children(i)).collect(),
                draft_rows: Some(vec![Some(0), None, None, None]),
                uniforms: u,
            })
            .collect();
        let got = tree_accept(&t, Some(&d), None, &seqs, params.temperature, top_k, top_p).unwrap();
        let mut counts = [0f64; 8];
        for ((tokens, _), g) in trees.iter().zip(&got) {
            let first = match g.accepted_nodes.get(1) {
                Some(&node) => tokens[node],
                None => g.bonus,
            };
            counts[first as usize] += 1.0;
        }
        assert_follows(
            &counts,
            &probs(&p_root, &params),
            &format!("top_k {top_k} top_p {top_p}"),
        );
    }
}

/// The host's selection: larger first, lower index on equal values, NaN left out; log-probs
/// under softmax over the non-NaN entries, summed in f64.
fn host_top_k_logp(row: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut idx: Vec<u32> = (0..row.len() as u32)
        .filter(|&i| !row[i as usize].is_nan())
        .collect();
    idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let max = idx.first().map_or(0.0, |&i| row[i as usize]);
    let sum: f64 = idx
        .iter()
        .map(|&i| ((row[i as usize] - max) as f64).exp())
        .sum();
    let lse = max + sum.ln() as f32;
    idx.truncate(k);
    let logp = idx
        .iter()
        .map(|&i| (row[i as usize] - lse).min(0.0))
        .collect();
    (idx, logp)
}

#[test]
fn top_k_logp_matches_the_host_selection() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    let (rows, vocab) = (5, 49_152 + 3);
    let mut x = randn(&mut rng, rows * vocab, 10.0);
    // Row 1: ties among the best; row 2: NaNs among the best; row 3: all equal.
    for i in [5, 900, 30_000, 49_000] {
        x[vocab + i] = 40.0;
    }
    x[2 * vocab + 11] = f32::NAN;
    x[2 * vocab + 12] = 45.0;
    x[2 * vocab + 13] = f32::NAN;
    for v in &mut x[3 * vocab..4 * vocab] {
        *v = -2.0;
    }
    let t = Tensor::from_slice(&x, (rows, vocab), &Device::Cpu)
        .unwrap()
        .to_device(&dev)
        .unwrap();
    for k in [1usize, 4, 10, 32] {
        let got = top_k_logp(&t, k).unwrap().to_vec2::<u32>().unwrap();
        for (r, g) in got.iter().enumerate() {
            let (want_ids, want_logp) = host_top_k_logp(&x[r * vocab..(r + 1) * vocab], k);
            assert_eq!(&g[..k], &want_ids[..], "k {k} row {r}: ids");
            for (b, w) in g[k..].iter().zip(&want_logp) {
                let lp = f32::from_bits(*b);
                assert!((lp - w).abs() < 1e-4, "k {k} row {r}: log-prob {lp} vs {w}");
            }
        }
    }
    // Fewer choosable entries than k: the rest are token 0 at -inf.
    let few = Tensor::new(&[[f32::NAN, 2.0, f32::NAN]], &dev).unwrap();
    let got = top_k_logp(&few, 3).unwrap().to_vec2::<u32>().unwrap();
    assert_eq!(&got[0][..3], &[1, 0, 0]);
    assert_eq!(f32::from_bits(got[0][3]), 0.0);
    assert_eq!(f32::from_bits(got[0][4]), f32::NEG_INFINITY);
}

/// `t` (any dtype) as f64 values on the host, for exact comparisons.
fn exact(t: &Tensor) -> Vec<f64> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Tensors on the CPU and on the GPU holding the same `rows × width` values of `dtype`,
/// viewed from element `skip` of a flat buffer (so the GPU view may start off alignment), and
/// the GPU's whole flat buffer.
fn row_tables(
    rng: &mut ChaCha8Rng,
    rows: usize,
    width: usize,
    skip: usize,
    dtype: DType,
) -> (Tensor, Tensor, Tensor) {
    let flat: Vec<f32> = (0..skip + rows * width)
        .map(|_| rng.random_range(0..1000) as f32)
        .collect();
    let cpu = Tensor::new(flat.as_slice(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let view = |t: &Tensor| {
        let t = t.narrow(0, skip, rows * width).unwrap();
        if width == 1 {
            t
        } else {
            t.reshape((rows, width)).unwrap()
        }
    };
    let flat_gpu = cpu.to_device(&gpu()).unwrap();
    (view(&cpu), view(&flat_gpu), flat_gpu)
}

#[test]
fn gather_and_scatter_rows_match_candles_cpu_ops() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    // (dtype, rows, width, skip): rows of 16-byte words (bf16 576, f32 8), 4-byte words (f32 5,
    // u32 1-D, bf16 6 at a 4-byte offset), 2-byte words (bf16 3; bf16 8 at a 2-byte offset).
    let cases = [
        (DType::BF16, 9, 576, 0),
        (DType::F32, 7, 8, 0),
        (DType::F32, 7, 5, 0),
        (DType::U32, 10, 1, 1),
        (DType::BF16, 6, 6, 2),
        (DType::BF16, 5, 3, 0),
        (DType::BF16, 4, 8, 1),
        (DType::F16, 4, 8, 0),
        (DType::I64, 3, 2, 1),
    ];
    for (dtype, rows, width, skip) in cases {
        let what = format!("{dtype:?} [{rows}, {width}] at +{skip}");
        let (cpu, gpu_t, flat) = row_tables(&mut rng, rows, width, skip, dtype);
        let before = exact(&flat);
        let ids = [rows as u32 - 1, 0, 2, 2, 1];
        let cpu_ids = Tensor::new(&ids, &Device::Cpu).unwrap();
        let got = gather_rows(&gpu_t, &cpu_ids.to_device(&dev).unwrap()).unwrap();
        assert_eq!(got.dims()[0], ids.len(), "{what}");
        assert_eq!(got.dims()[1..], cpu.dims()[1..], "{what}");
        let want = cpu.index_select(&cpu_ids, 0).unwrap();
        assert_eq!(exact(&got), exact(&want), "gather {what}");
        // Ids past the rows gather zero rows; u32::MAX among them.
        let far = Tensor::new(&[u32::MAX, 1, rows as u32], &dev).unwrap();
        let got = exact(&gather_rows(&gpu_t, &far).unwrap());
        let row = got.len() / 3;
        let one = exact(&cpu.narrow(0, 1, 1).unwrap());
        assert!(
            got[..row].iter().all(|&v| v == 0.0),
            "gather {what}: u32::MAX"
        );
        assert_eq!(got[row..2 * row], one[..], "gather {what}: row 1");
        assert!(
            got[2 * row..].iter().all(|&v| v == 0.0),
            "gather {what}: past the end"
        );

        // Scatter rows 0 and 2 of a gathered copy over rows 3 and 1; an id past the end is
        // skipped and writes nothing.
        let dst_ids = [3u32.min(rows as u32 - 1), 1, rows as u32 + 4];
        let src = gather_rows(&gpu_t, &Tensor::new(&[0u32, 2, 2], &dev).unwrap()).unwrap();
        scatter_rows(&gpu_t, &Tensor::new(&dst_ids, &dev).unwrap(), &src).unwrap();
        let mut want = exact(&cpu);
        let picked = exact(&src);
        for (r, &id) in dst_ids.iter().enumerate() {
            if (id as usize) < rows {
                want[id as usize * width..(id as usize + 1) * width]
                    .copy_from_slice(&picked[r * width..(r + 1) * width]);
            }
        }
        assert_eq!(exact(&gpu_t), want, "scatter {what}");
        // Only the view's rows were written: the elements before it are intact.
        assert_eq!(
            exact(&flat)[..skip],
            before[..skip],
            "scatter {what}: before the view"
        );
    }
    let empty = gather_rows(
        &Tensor::zeros((4, 3), DType::F32, &dev).unwrap(),
        &Tensor::zeros(0, DType::U32, &dev).unwrap(),
    )
    .unwrap();
    assert_eq!(empty.dims(), [0, 3]);
}

#[test]
fn kv_move_moves_rows_in_every_pool_reading_before_writing() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    // Row 4 is written by the second move and read by the first: it must give its old value.
    let moves = [(4u32, 2u32), (6, 4), (9, 5)];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (slots, nkv, d) = (12, 3, 8);
        let w = nkv * d;
        let host_pools: Vec<Vec<f32>> = (0..5)
            .map(|_| rounded(&randn(&mut rng, slots * w, 1.0), dtype))
            .collect();
        let pools: Vec<Tensor> = host_pools
            .iter()
            .map(|p| to_dev(p, &[slots, nkv, d], dtype, &dev))
            .collect();
        kv_move(&pools, &moves).unwrap();
        for (i, (pool, old)) in pools.iter().zip(&host_pools).enumerate() {
            let mut want = old.clone();
            for &(src, dst) in &moves {
                let (s, t) = (src as usize * w, dst as usize * w);
                want[t..t + w].copy_from_slice(&old[s..s + w]);
            }
            assert_eq!(host(pool), want, "{dtype:?} pool {i}");
        }
    }
    let pool = Tensor::zeros((4, 1, 2), DType::F32, &dev).unwrap();
    let err = kv_move(&[pool], &[(1, 4)]).unwrap_err().to_string();
    assert!(
        err.contains("row 1 → 4 is outside pools of 4 slots"),
        "{err}"
    );
}

#[test]
fn gemv_matches_a_cpu_matmul_and_each_row_ignores_the_others() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    // More rows than a 64-node tree verifies: several chunks of the FMA engine; on tensor
    // cores (f16/bf16 with K a multiple of 64; K = 72 takes the FMA engine in every dtype)
    // the one-row engine's passes up to GEMV_TILED_MIN_ROWS − 1 rows (GEMV_TILED_MIN_ROWS_WIDE
    // − 1 for K ≥ GEMV_TILED_WIDE_K: the K = 2,048 and 11,008 shapes) and the tiled engine's
    // two row blocks past it, so the prefixes compare the two engines row for row. At 75 rows
    // the tiled engine splits each tile's 8 chains between 8 blocks up to N = 2,112, 4 up to
    // 4,224, 2 up to 8,448 and 1 past it (cuda.rs, gemv_tiled_groups): the last three shapes
    // take 4, 2 and 1, with K giving some chains one more block than others. A row alone on
    // tensor cores takes the deep weight ring up to 2 blocks a multiprocessor (cuda.rs,
    // gemv_row_kernel) and the ring of one past it: on an H200, N = 8,708 the latter.
    let rows = 9 * GEMV_MAX_ROWS + 3;
    assert!(GEMV_TILED_MIN_ROWS > 1 && rows > GEMV_TILED_MIN_ROWS.max(64));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (n, k) in [
            (960usize, 576usize),
            (300, 2048),
            (7, 64),
            (33, 72),
            (40, 11008),
            (2560, 576),
            (4480, 1536),
            (8708, 640),
        ] {
            let w_h = rounded(&randn(&mut rng, n * k, 1.0 / (k as f32).sqrt()), dtype);
            let x_h = rounded(&randn(&mut rng, rows * k, 1.0), dtype);
            let w = to_dev(&w_h, &[n, k], dtype, &dev);
            let x_all = to_dev(&x_h, &[rows, k], dtype, &dev);
            if k > GEMV_MAX_K && dtype == DType::F32 {
                // Only the tensor-core engine takes K past the FMA engine's limit.
                assert!(!gemv_applies(&x_all, &w));
                continue;
            }
            let full = host(&gemv(&x_all, &w).unwrap());
            let reference = Tensor::from_slice(&x_h, (rows, k), &Device::Cpu)
                .unwrap()
                .matmul(
                    &Tensor::from_slice(&w_h, (n, k), &Device::Cpu)
                        .unwrap()
                        .t()
                        .unwrap(),
                )
                .unwrap();
            let want = host(&reference);
            let tol = match dtype {
                DType::F32 => 1e-4,
                DType::F16 => 4e-3,
                _ => 3e-2,
            };
            let case = format!("{dtype:?} [{n}, {k}]");
            let err = max_abs(&full, &want);
            assert!(err <= tol, "{case}: max abs error {err}");
            // Every prefix of the rows gives exactly those rows of the full product, and the
            // last row alone gives that row's bits too (a decode step against a verification).
            for m in 1..rows {
                let x = x_all.narrow(0, 0, m).unwrap();
                let part = host(&gemv(&x, &w).unwrap());
                assert!(
                    part == full[..m * n],
                    "{case}: {m} rows differ from the same rows of {rows}"
                );
            }
            let last = host(&gemv(&x_all.narrow(0, rows - 1, 1).unwrap(), &w).unwrap());
            assert!(
                last == full[(rows - 1) * n..],
                "{case}: the last row alone differs"
            );
        }
    }
    // K not a multiple of the vector width, or a misaligned view: not taken.
    let w = Tensor::zeros((4, 6), DType::F32, &dev).unwrap();
    assert!(!gemv_applies(
        &Tensor::zeros((1, 6), DType::F32, &dev).unwrap(),
        &w
    ));
    let w = Tensor::zeros((4, 8), DType::F32, &dev).unwrap();
    let x = Tensor::zeros((1, 9), DType::F32, &dev)
        .unwrap()
        .narrow(1, 1, 8)
        .unwrap();
    assert!(!gemv_applies(&x, &w));
    let err = gemv(&x, &w).unwrap_err().to_string();
    assert!(err.contains("do not fit the kernel"), "{err}");
}

/// `t`'s values in a contiguous view that starts one element past a 16-byte boundary.
fn unaligned(t: &Tensor) -> Tensor {
    let n = t.elem_count();
    let flat = t.flatten_all().unwrap();
    let padded = Tensor::cat(&[&flat.narrow(0, 0, 1).unwrap(), &flat], 0).unwrap();
    padded.narrow(0, 1, n).unwrap().reshape(t.dims()).unwrap()
}

/// A tensor's first `m` rows.
fn first_rows(t: &Tensor, m: usize) -> Tensor {
    t.narrow(0, 0, m).unwrap()
}

#[test]
fn gemv_swiglu_equals_swiglu_then_gemv_bit_for_bit() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (n, k) in [(576usize, 1536usize), (7, 64), (5, 72)] {
            let w = to_dev(
                &randn(&mut rng, n * k, 1.0 / (k as f32).sqrt()),
                &[n, k],
                dtype,
                &dev,
            );
            // More than a chunk of rows: past one, the op runs swiglu and gemv apart; past
            // GEMV_TILED_MIN_ROWS on a Hopper GPU in f16/bf16, with SwiGLU's rows written in the
            // warpgroup engine's layout (and past 64, in two tiles of it).
            let max_rows = 64 + 9;
            let gu = to_dev(
                &randn(&mut rng, max_rows * 2 * k, 4.0),
                &[max_rows, 2 * k],
                dtype,
                &dev,
            );
            let case = format!("{dtype:?} [{n}, {k}]");
            for m in 1..=max_rows {
                let rows = first_rows(&gu, m);
                // A full chunk of staged rows must fit the block's shared memory, whatever the
                // rows (8 f32 rows of 1,536 do not).
                let fits = GEMV_MAX_ROWS * k * dtype.size_in_bytes() <= GEMV_STAGE_MAX_BYTES;
                assert_eq!(gemv_swiglu_applies(&rows, &w), fits, "{case}, {m} rows");
                if !fits {
                    continue;
                }
                let fused = host(&gemv_swiglu(&rows, &w).unwrap());
                let apart = host(&gemv(&swiglu(&rows).unwrap(), &w).unwrap());
                assert!(fused == apart, "{case}, {m} rows: fused differs from apart");
            }
        }
    }
    // The fused width must be twice the weight's K.
    let w = Tensor::zeros((4, 8), DType::F32, &dev).unwrap();
    let gu = Tensor::zeros((1, 8), DType::F32, &dev).unwrap();
    assert!(!gemv_swiglu_applies(&gu, &w));
    let err = gemv_swiglu(&gu, &w).unwrap_err().to_string();
    assert!(
        err.contains("gemv_swiglu: x [1, 8] F32 and w [4, 8] F32 do not fit"),
        "{err}"
    );
}

#[test]
fn gemv_add_rms_norm_matches_the_two_kernels_and_each_row_ignores_the_others() {
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    let eps = 1e-5f32;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (n, k) in [(960usize, 576usize), (3072, 576), (9, 2048), (9, 72)] {
            let w = to_dev(
                &randn(&mut rng, n * k, 1.0 / (k as f32).sqrt()),
                &[n, k],
                dtype,
                &dev,
            );
            // Two chunks of rows and more: past one chunk, the op runs add_rms_norm in the
            // fused kernel's order and then gemv (past GEMV_TILED_MIN_ROWS on a Hopper GPU in
            // f16/bf16, with the normed rows written in the warpgroup engine's layout, two
            // tiles of it past 64), and every prefix must match those rows.
            let rows = 64 + 9;
            let shape = [rows, k];
            let x = to_dev(&randn(&mut rng, rows * k, 2.0), &shape, dtype, &dev);
            let r = to_dev(&randn(&mut rng, rows * k, 2.0), &shape, dtype, &dev);
            let nw: Vec<f32> = randn(&mut rng, k, 0.5).iter().map(|v| v + 1.0).collect();
            let nw = to_dev(&nw, &[k], dtype, &dev);
            let case = format!("{dtype:?} [{n}, {k}]");
            if dtype == DType::F32 && k == 2048 {
                // A full chunk of 8 rows of 2,048 f32 (and the norm weight) exceeds the
                // staging limit, and the kernel is then refused for any number of rows: a
                // decode step and a verification must take the same path.
                assert!(!gemv_add_rms_norm_applies(&x, &w));
                assert!(!gemv_add_rms_norm_applies(&first_rows(&x, 1), &w));
                let err = gemv_add_rms_norm(&x, Some(&r), &nw, eps, &w).unwrap_err();
                assert!(err.to_string().contains("do not fit the kernel"), "{err}");
                continue;
            }
            let (sum_all, y_all) = gemv_add_rms_norm(&x, Some(&r), &nw, eps, &w).unwrap();
            // Without a residual: the norm of x alone, bit for bit the add of exact zeros.
            let zeros = x.zeros_like().unwrap();
            let (same_x, y_alone) = gemv_add_rms_norm(&x, None, &nw, eps, &w).unwrap();
            let (_, y_zeros) = gemv_add_rms_norm(&x, Some(&zeros), &nw, eps, &w).unwrap();
            assert!(
                host(&same_x) == host(&x),
                "{case}: the sum without a residual is x"
            );
            assert!(
                host(&y_alone) == host(&y_zeros),
                "{case}: no residual ≠ zero residual"
            );
            assert_eq!(y_all.dims(), [rows, n], "{case}");
            let (want_sum, normed) = add_rms_norm(&x, &r, &nw, eps).unwrap();
            assert!(
                host(&sum_all) == host(&want_sum),
                "{case}: the sum must be exact"
            );
            // The scales' sums of squares are taken in another order than add_rms_norm's:
            // a normed value may differ by one rounding, each product by a few of them.
            let want = host(&gemv(&normed, &w).unwrap());
            let tol = match dtype {
                DType::F32 => 1e-4,
                DType::F16 => 1e-2,
                _ => 6e-2,
            };
            let err = max_abs(&host(&y_all), &want);
            assert!(err <= tol, "{case}: max abs error {err}");
            let y_all = host(&y_all);
            for m in 1..rows {
                let (s, y) =
                    gemv_add_rms_norm(&first_rows(&x, m), Some(&first_rows(&r, m)), &nw, eps, &w)
                        .unwrap();
                assert!(
                    host(&y) == y_all[..m * n],
                    "{case}: {m} rows differ from the same rows of {rows}"
                );
                assert!(
                    host(&s) == host(&first_rows(&want_sum, m)),
                    "{case}: sum of {m}"
                );
            }
        }
    }
}

/// A query row attends to the same keys bit-identically whether it is a decode step's only
/// row or a row of a tree step with many blocks: greedy speculation's equality with plain
/// decoding relies on it. Every row of a step of two sequences (62 and 12 new rows), causal
/// and under a tree mask, against the same row decoded alone over the slots it sees; and the
/// whole step with each real warp count a block may take, and on the grouped kernel (cached
/// K/V staged once for 4 rows) where the head size allows it.
#[test]
fn paged_attention_rows_do_not_depend_on_the_step() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    // 300 slots: 1 or 2 chunks a warp; 4,100: 16 or 17; 90: the 12-row sequence has two
    // chunks of cached slots, the 62-row one none. SmolLM2's heads and Llama-2-7B's. The
    // last field: whether the grouped kernel takes the head (it is compiled for heads of 64
    // and 128 only; f32 × 128 needs 134 KiB of shared memory, which Hopper and the A100 hold).
    for (dtype, l, (nh, nkv, d), grouped) in [
        (DType::F32, 300usize, (9usize, 3usize, 64usize), true),
        (DType::BF16, 300, (9, 3, 64), true),
        (DType::BF16, 4100, (9, 3, 64), true),
        (DType::BF16, 200, (4, 4, 128), true),
        (DType::F16, 90, (4, 4, 128), true),
        (DType::F32, 200, (4, 4, 128), true),
        (DType::BF16, 100, (2, 1, 40), false), // V read element by element
    ] {
        for masked in [false, true] {
            let step = RowStep::new(&mut rng, dtype, l, (nh, nkv, d), masked, [62, 12]);
            let (q, meta) = step.tensors();
            let all = host(&paged_attention(&q, &step.kp, &step.vp, &meta).unwrap());
            let what = format!("{dtype:?}, {l} slots, d {d}, masked {masked}");
            // However many real warps share a block's virtual ones, and on either build of
            // the block-per-row kernel (a decode step's, many blocks'), the bits stay.
            for (warps, many) in [1, 2, 4, 8]
                .into_iter()
                .flat_map(|w| [(w, false), (w, true)])
            {
                let forced = host(
                    &paged_attention_with_warps(&q, &step.kp, &step.vp, &meta, warps, many)
                        .unwrap(),
                );
                assert!(
                    forced == all,
                    "{what}: {warps} warps a block (many-block kernel: {many}) change the \
                     step's output"
                );
            }
            // And so do they on the grouped kernel, which refuses the heads it cannot take.
            match paged_attention_grouped(&q, &step.kp, &step.vp, &meta) {
                Ok(out) => assert!(
                    grouped && host(&out) == all,
                    "{what}: the grouped kernel changes the step's output (or took a head it \
                     should refuse)"
                ),
                Err(e) => assert!(
                    !grouped
                        && e.to_string()
                            .starts_with("grouped paged attention: a head of"),
                    "{dtype:?}, d {d}: {e}"
                ),
            }
            step.assert_rows_decode_alike(paged_attention, &all, &what);
        }
    }
}

/// The same for the tensor-core family: every row of a 62-row and a 12-row sequence (blocks
/// of 4 warps) has the bits of its decode step (blocks of one), causal and under tree masks,
/// over contexts inside one tile, across the four splits and far past them; and the splits'
/// fold gives the same bits in a cluster as by a second launch.
#[test]
fn tensor_core_attention_rows_do_not_depend_on_the_step() {
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    for (dtype, l, heads) in [
        (DType::BF16, 300usize, (9usize, 3usize, 64usize)),
        (DType::BF16, 4100, (9, 3, 64)),
        (DType::BF16, 200, (4, 4, 128)),
        (DType::F16, 90, (4, 4, 128)),
        (DType::F16, 1500, (4, 2, 128)),
    ] {
        for masked in [false, true] {
            let step = RowStep::new(&mut rng, dtype, l, heads, masked, [62, 12]);
            let (q, meta) = step.tensors();
            let all = host(&paged_attention_tensor_cores(&q, &step.kp, &step.vp, &meta).unwrap());
            let scalar = host(&paged_attention(&q, &step.kp, &step.vp, &meta).unwrap());
            let what =
                format!("tensor cores, {dtype:?}, {l} slots, heads {heads:?}, masked {masked}");
            // A different order of sums, within the 16-bit type's rounding of the scalar one.
            let err = max_abs(&all, &scalar);
            assert!(
                err <= attn_tol(dtype),
                "{what}: {err} from the scalar kernels"
            );
            // The splits folded by a second launch instead of in their cluster: the same fold.
            let merged = paged_attention_tensor_cores_merged(&q, &step.kp, &step.vp, &meta);
            assert!(
                host(&merged.unwrap()) == all,
                "{what}: the merge launch and the cluster fold disagree"
            );
            step.assert_rows_decode_alike(paged_attention_tensor_cores, &all, &what);
        }
    }
    // A tree of more nodes than the family takes runs on the scalar kernels, bit for bit.
    let step = RowStep::new(
        &mut rng,
        DType::BF16,
        300,
        (9, 3, 64),
        true,
        [TC_MAX_MASKED_NEW + 1, 3],
    );
    let (q, meta) = step.tensors();
    assert!(
        host(&paged_attention_tensor_cores(&q, &step.kp, &step.vp, &meta).unwrap())
            == host(&paged_attention(&q, &step.kp, &step.vp, &meta).unwrap()),
        "a {}-node tree is not left to the scalar kernels",
        TC_MAX_MASKED_NEW + 1
    );
}

/// A step of two sequences over `l` slots each (pools of 2l rows, random), bringing `new`
/// tokens, causal or under [`tree_mask`]s, and its rows' queries.
struct RowStep {
    dtype: DType,
    heads: (usize, usize, usize),
    l: usize,
    new: [usize; 2],
    masked: bool,
    q_h: Vec<f32>,
    kp: Tensor,
    vp: Tensor,
    slots: [Vec<u32>; 2],
    masks: [Vec<bool>; 2],
    dev: Device,
}

impl RowStep {
    fn new(
        rng: &mut ChaCha8Rng,
        dtype: DType,
        l: usize,
        heads: (usize, usize, usize),
        masked: bool,
        new: [usize; 2],
    ) -> Self {
        let dev = gpu();
        let (nh, nkv, d) = heads;
        let total = 2 * l;
        let mut pool = || {
            to_dev(
                &randn(rng, total * nkv * d, 1.0),
                &[total, nkv, d],
                dtype,
                &dev,
            )
        };
        let (kp, vp) = (pool(), pool());
        let q_h = randn(rng, new.iter().sum::<usize>() * nh * d, 1.0);
        RowStep {
            dtype,
            heads,
            l,
            new,
            masked,
            q_h,
            kp,
            vp,
            // Sequence 0 takes pool rows l-1 … 0, sequence 1 rows l … 2l-1.
            slots: [
                (0..l as u32).rev().collect(),
                (l as u32..total as u32).collect(),
            ],
            masks: [tree_mask(new[0]), tree_mask(new[1])],
            dev,
        }
    }

    /// The queries and the step's metadata.
    fn tensors(&self) -> (Tensor, PagedAttnMeta) {
        let (nh, _, d) = self.heads;
        let seqs: Vec<AttnSeq> = (0..2)
            .map(|s| AttnSeq {
                slots: &self.slots[s],
                n_new: self.new[s],
                mask: self.masked.then_some(&self.masks[s][..]),
            })
            .collect();
        let n_all: usize = self.new.iter().sum();
        let q = to_dev(&self.q_h, &[n_all, nh, d], self.dtype, &self.dev);
        (q, PagedAttnMeta::new(&seqs, &self.dev).unwrap())
    }

    /// Each row of `all` (the step's output through `attend`) equals the same row decoded
    /// alone through `attend` over the slots it sees (cached, then its visible new ones).
    fn assert_rows_decode_alike(&self, attend: Attend, all: &[f32], what: &str) {
        let (nh, _, d) = self.heads;
        let mut t = 0;
        for s in 0..2 {
            let n = self.new[s];
            let past = self.l - n;
            for r in 0..n {
                let mut seen: Vec<u32> = self.slots[s][..past].to_vec();
                seen.extend(
                    (0..n)
                        .filter(|&j| {
                            if self.masked {
                                self.masks[s][r * n + j]
                            } else {
                                j <= r
                            }
                        })
                        .map(|j| self.slots[s][past + j]),
                );
                let decode = AttnSeq {
                    slots: &seen,
                    n_new: 1,
                    mask: None,
                };
                let row = to_dev(
                    &self.q_h[t * nh * d..(t + 1) * nh * d],
                    &[1, nh, d],
                    self.dtype,
                    &self.dev,
                );
                let meta = PagedAttnMeta::new(&[decode], &self.dev).unwrap();
                let one = host(&attend(&row, &self.kp, &self.vp, &meta).unwrap());
                assert!(
                    one == all[t * nh * d..(t + 1) * nh * d],
                    "{what}: row {r} of sequence {s} differs from the same row decoded alone"
                );
                t += 1;
            }
        }
    }
}

/// The context keeps `stack limit × resident threads` of device memory; the default 1 KiB a
/// thread costs an H200 264 MiB. Cutting the limit to Kestrel's 256 bytes must give back
/// three quarters of it.
#[test]
fn limit_thread_stack_gives_back_the_default_reservation() {
    use candle_core::cuda::cudarc::driver::sys;
    let dev = gpu();
    let cuda = dev.as_cuda_device().unwrap();
    let ctx = cuda.cuda_stream().context().clone();
    let attr = |a| ctx.attribute(a).unwrap() as usize;
    let threads = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        * attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
    let used = || {
        let (free, total) = ctx.mem_get_info().unwrap();
        total - free
    };
    let stack_limit = || {
        let mut v = 0usize;
        // SAFETY: reads a limit of the current context into a local.
        let status = unsafe { sys::cuCtxGetLimit(&mut v, sys::CUlimit::CU_LIMIT_STACK_SIZE) };
        assert_eq!(status, sys::cudaError_enum::CUDA_SUCCESS);
        v
    };
    // Back to the driver's default first: other tests in this process have cut it already.
    // SAFETY: sets a limit of the current context (made current by `gpu`).
    let status = unsafe { sys::cuCtxSetLimit(sys::CUlimit::CU_LIMIT_STACK_SIZE, 1024) };
    assert_eq!(status, sys::cudaError_enum::CUDA_SUCCESS);
    assert_eq!(stack_limit(), 1024);
    let before = used();
    limit_thread_stack(&dev).unwrap();
    assert_eq!(stack_limit(), kestrel_kernels::THREAD_STACK_BYTES);
    let freed = before.saturating_sub(used());
    let expected = (1024 - kestrel_kernels::THREAD_STACK_BYTES) * threads;
    assert!(
        freed * 10 >= expected * 9,
        "cutting the stack freed {freed} bytes, expected about {expected} ({threads} threads)"
    );
    // The largest frame among the kernels still launches under the limit.
    let logits = Tensor::new(&[[0.5f32, 3.0, -1.0, 2.0]], &dev).unwrap();
    let got = top_k_logp(&logits, 2).unwrap().to_vec2::<u32>().unwrap();
    assert_eq!(got[0][..2], [1, 3], "the 2 best ids of the row");
}

/// Ids read back through page-locked memory are the values the tensor held when the read was
/// queued: work queued after it (here, new ids uploaded over them) does not reach them; the
/// buffer grows for a longer read and is reused.
#[test]
fn ids_read_back_are_those_queued_before_later_work() {
    let dev = gpu();
    let ids = Tensor::new(&[5u32, 0, 49_151, 7], &dev).unwrap();
    let mut readback = IdsReadback::default();
    readback.start(&ids).unwrap();
    upload_into(&ids, 0, &[9u32, 9, 9, 9]).unwrap();
    assert_eq!(readback.finish().unwrap(), vec![5, 0, 49_151, 7]);
    assert_eq!(ids.to_vec1::<u32>().unwrap(), vec![9, 9, 9, 9]);
    let long = Tensor::arange(0u32, 1000, &dev)
        .unwrap()
        .reshape((10, 100))
        .unwrap();
    readback.start(&long).unwrap();
    assert_eq!(readback.finish().unwrap(), (0..1000).collect::<Vec<u32>>());
    readback.start(&ids).unwrap();
    assert_eq!(readback.finish().unwrap(), vec![9, 9, 9, 9]);
}
