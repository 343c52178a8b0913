//! The CUDA path (Kestrel's kernels, and candle ops only) against the CPU path on the tiny
//! random models: greedy tokens equal, hidden states close. Built only with the `cuda`
//! feature; such a binary fails when no CUDA device is present.
#![cfg(feature = "cuda")]

mod common;

use candle_core::Device;
use common::*;
use kestrel_core::{DType, ModelConfig};
use kestrel_model::{CudaKernels, Llama, OutputRows, PagedKvCache, SeqId, SeqInput};

const SEED: u64 = 23;

/// The device as the runtime opens it (the per-thread stack cut to Kestrel's need).
fn gpu() -> Device {
    kestrel_kernels::open_cuda(0)
        .expect("these tests need a CUDA device (built with --features cuda)")
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The prompts prefilled together in a fresh cache: the cache, their sequences and each
/// prompt's last hidden state.
fn prefill(m: &Llama, prompts: &[Vec<u32>]) -> (PagedKvCache, Vec<SeqId>, candle_core::Tensor) {
    let mut cache = m.new_cache(64, 4).unwrap();
    let seqs: Vec<SeqId> = prompts.iter().map(|_| cache.add_sequence()).collect();
    let pos: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| (0..p.len() as u32).collect())
        .collect();
    let batch: Vec<SeqInput> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| SeqInput {
            seq: seqs[i],
            tokens: p,
            positions: &pos[i],
            mask: None,
            output_rows: OutputRows::Last,
        })
        .collect();
    let h = m.forward_prompt(&batch, &mut cache).unwrap();
    (cache, seqs, h)
}

/// Greedy decoding of a batch: prompts through `forward_prompt`, then `steps` one-token
/// steps of every sequence together. Returns the generated tokens and the last step's hidden
/// states.
fn greedy(m: &Llama, prompts: &[Vec<u32>], steps: usize) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let (mut cache, seqs, h) = prefill(m, prompts);
    let mut next: Vec<u32> = rows(&m.logits(&h).unwrap())
        .iter()
        .map(|r| argmax(r))
        .collect();
    let mut out: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let mut last = Vec::new();
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let pos: Vec<[u32; 1]> = seqs
            .iter()
            .map(|&s| [cache.seq_len(s).unwrap() as u32])
            .collect();
        let batch: Vec<SeqInput> = (0..seqs.len())
            .map(|i| SeqInput {
                seq: seqs[i],
                tokens: &toks[i],
                positions: &pos[i],
                mask: None,
                output_rows: OutputRows::All,
            })
            .collect();
        let h = m.forward(&batch, &mut cache).unwrap();
        last = rows(&h);
        next = rows(&m.logits(&h).unwrap())
            .iter()
            .map(|r| argmax(r))
            .collect();
        for (o, &t) in out.iter_mut().zip(&next) {
            o.push(t);
        }
    }
    (out, last)
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![3, 17, 42, 5, 9, 11, 23],
        vec![7],
        vec![
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
        ],
    ]
}

fn models(cfg: &ModelConfig, dtype: DType, kernels: CudaKernels) -> (Llama, Llama) {
    let cpu = Llama::random(cfg, SEED, dtype, &Device::Cpu).unwrap();
    let mut gpu_m = Llama::random(cfg, SEED, dtype, &gpu()).unwrap();
    gpu_m.set_cuda_kernels(kernels);
    (cpu, gpu_m)
}

#[test]
fn greedy_tokens_on_cuda_equal_the_cpu_path() {
    for (name, cfg) in all_cfgs() {
        for (label, kernels) in [
            ("kestrel kernels", CudaKernels::all()),
            ("candle ops", CudaKernels::none()),
            (
                "attention kernel only",
                CudaKernels {
                    add_rmsnorm: false,
                    swiglu: false,
                    kv_append: false,
                    qkv_rope: false,
                    gemv: false,
                    ..CudaKernels::all()
                },
            ),
        ] {
            let (cpu, gpu_m) = models(&cfg, DType::F32, kernels);
            let (want, want_h) = greedy(&cpu, &prompts(), 12);
            let (got, got_h) = greedy(&gpu_m, &prompts(), 12);
            assert_eq!(got, want, "{name}, {label}: greedy tokens differ");
            for (g, w) in got_h.iter().zip(&want_h) {
                let d = max_abs_diff(g, w);
                assert!(d < 1e-4, "{name}, {label}: hidden states differ by {d}");
            }
        }
    }
}

#[test]
fn batched_equal_length_step_uses_the_kv_append_kernel() {
    // Attention through candle's batched path, K/V through the kv_append kernel.
    let cfg = tiny_cfg(6, 2, true, true);
    let kernels = CudaKernels {
        attention_decode: false,
        attention_tree: false,
        attention_context: false,
        ..CudaKernels::all()
    };
    let (cpu, gpu_m) = models(&cfg, DType::F32, kernels);
    let (want, _) = greedy(&cpu, &prompts(), 8);
    let (got, _) = greedy(&gpu_m, &prompts(), 8);
    assert_eq!(got, want);
}

/// A cache holding [`prompts`], each prefilled on its own; returns it with their sequences.
fn prefilled(m: &Llama) -> (PagedKvCache, Vec<SeqId>) {
    let mut cache: PagedKvCache = m.new_cache(64, 4).unwrap();
    let seqs: Vec<SeqId> = prompts().iter().map(|_| cache.add_sequence()).collect();
    for (seq, p) in seqs.iter().zip(prompts()) {
        let pos: Vec<u32> = (0..p.len() as u32).collect();
        let input = SeqInput {
            seq: *seq,
            tokens: &p,
            positions: &pos,
            mask: None,
            output_rows: OutputRows::Last,
        };
        m.forward_prompt(&[input], &mut cache).unwrap();
    }
    (cache, seqs)
}

/// One verification step: every sequence brings a tree under an ancestor mask.
fn tree_step(m: &Llama) -> Vec<Vec<f32>> {
    let (mut cache, seqs) = prefilled(m);
    let prompts = prompts();
    // Tree: 0 root; 1, 2 children of 0; 3 child of 1; 4 child of 2.
    let parent = [usize::MAX, 0, 0, 1, 2];
    let depth = [0u32, 1, 1, 2, 2];
    let n = parent.len();
    let mask: Vec<bool> = (0..n * n)
        .map(|ij| {
            let (i, j) = (ij / n, ij % n);
            let mut k = i;
            loop {
                if k == j {
                    return true;
                }
                if parent[k] == usize::MAX {
                    return false;
                }
                k = parent[k];
            }
        })
        .collect();
    let tokens: Vec<Vec<u32>> = (0..seqs.len())
        .map(|i| {
            (0..n as u32)
                .map(|k| (k * 13 + i as u32 * 5 + 2) % 61)
                .collect()
        })
        .collect();
    let pos: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| depth.iter().map(|d| p.len() as u32 + d).collect())
        .collect();
    let batch: Vec<SeqInput> = (0..seqs.len())
        .map(|i| SeqInput {
            seq: seqs[i],
            tokens: &tokens[i],
            positions: &pos[i],
            mask: Some(&mask),
            output_rows: OutputRows::All,
        })
        .collect();
    rows(&m.forward(&batch, &mut cache).unwrap())
}

#[test]
fn tree_verification_on_cuda_matches_the_cpu_path() {
    for (name, cfg) in all_cfgs() {
        let (cpu, gpu_m) = models(&cfg, DType::F32, CudaKernels::all());
        let want = tree_step(&cpu);
        let got = tree_step(&gpu_m);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            let d = max_abs_diff(g, w);
            assert!(d < 1e-4, "{name}: tree hidden states differ by {d}");
        }
    }
}

#[test]
fn bf16_kernels_stay_close_to_bf16_candle_ops_on_cuda() {
    let cfg = tiny_cfg(6, 2, true, true);
    let dev = gpu();
    let mut a = Llama::random(&cfg, SEED, DType::BF16, &dev).unwrap();
    a.set_cuda_kernels(CudaKernels::all());
    let mut b = Llama::random(&cfg, SEED, DType::BF16, &dev).unwrap();
    b.set_cuda_kernels(CudaKernels::none());
    let ha = tree_step(&a);
    let hb = tree_step(&b);
    for (x, y) in ha.iter().zip(&hb) {
        let d = max_abs_diff(x, y);
        // Hidden states are O(1); a few bf16 ulps after two layers.
        assert!(d < 0.15, "bf16 kernels vs candle ops: {d}");
    }
}

/// The graphed model's outputs must be the eager model's, bit for bit: a replay runs the same
/// kernels on the same inputs.
fn assert_same_bits(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: row counts differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let gb: Vec<u32> = g.iter().map(|v| v.to_bits()).collect();
        let wb: Vec<u32> = w.iter().map(|v| v.to_bits()).collect();
        assert!(gb == wb, "{what}: row {i} differs from the eager step");
    }
}

fn graphed_and_eager(cfg: &ModelConfig, dtype: DType) -> (Llama, Llama) {
    let dev = gpu();
    let mut graphed = Llama::random(cfg, SEED, dtype, &dev).unwrap();
    graphed.set_cuda_graphs(true);
    let eager = Llama::random(cfg, SEED, dtype, &dev).unwrap();
    (graphed, eager)
}

#[test]
fn cuda_graph_decode_steps_equal_eager_steps() {
    for (name, cfg) in all_cfgs() {
        for dtype in [DType::F32, DType::BF16] {
            let (graphed, eager) = graphed_and_eager(&cfg, dtype);
            let (want, want_h) = greedy(&eager, &prompts(), 12);
            let (got, got_h) = greedy(&graphed, &prompts(), 12);
            let what = format!("{name} {dtype:?}");
            assert_eq!(graphed.cuda_graph_failure(), None, "{what}");
            // One layout (3 sequences × 1 token, one slot bucket): captured on its third
            // step, replayed by the 9 after.
            assert_eq!(graphed.cuda_graph_count(), 1, "{what}");
            assert_eq!(eager.cuda_graph_count(), 0, "{what}");
            // Its activations were moved out of the driver's graph pool into the model's
            // arena, every allocation with its free.
            let moved = graphed.cuda_graph_relocations();
            assert_eq!(moved.len(), 1, "{what}: {moved:?}");
            assert!(
                moved[0].allocations > 0 && moved[0].nodes_rewritten > 0,
                "{what}: {moved:?}"
            );
            assert!(
                graphed.cuda_graph_arena_bytes() as u64 >= moved[0].arena_bytes,
                "{what}"
            );
            assert_eq!(got, want, "{what}: greedy tokens differ");
            assert_same_bits(&got_h, &want_h, &what);
        }
    }
}

/// `reps` verification steps of the same tree shape on one cache, each rolled back after it
/// (a rejected tree): the third is captured, the later ones replay its graph. Returns every
/// step's hidden states. With `device_ids`, each step's tokens go to the device first and the
/// step reads them there (`forward_tapped_device_ids`), as drafted trees are verified.
fn repeated_tree_steps(m: &Llama, reps: usize, device_ids: bool) -> Vec<Vec<Vec<f32>>> {
    let (mut cache, seqs) = prefilled(m);
    let prompts = prompts();
    // Root 0; 1 and 2 under 0; 3 under 1. Output rows 1 and 3 only (an EAGLE-2 selection).
    let mask = [
        true, false, false, false, //
        true, true, false, false, //
        true, false, true, false, //
        true, true, false, true,
    ];
    let mut out = Vec::new();
    for rep in 0..reps {
        let tokens: Vec<Vec<u32>> = (0..seqs.len())
            .map(|i| {
                (0..4)
                    .map(|k| (k * 7 + i as u32 * 3 + rep as u32) % 61)
                    .collect()
            })
            .collect();
        let pos: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| [0u32, 1, 1, 2].iter().map(|d| p.len() as u32 + d).collect())
            .collect();
        let batch: Vec<SeqInput> = (0..seqs.len())
            .map(|i| SeqInput {
                seq: seqs[i],
                tokens: if device_ids { &[] } else { &tokens[i] },
                positions: &pos[i],
                mask: Some(&mask),
                output_rows: OutputRows::Rows(vec![1, 3]),
            })
            .collect();
        let h = if device_ids {
            let ids = candle_core::Tensor::new(tokens.concat().as_slice(), m.device()).unwrap();
            m.forward_tapped_device_ids(&batch, &ids, &mut cache, &[])
        } else {
            m.forward(&batch, &mut cache)
        };
        out.push(rows(&h.unwrap()));
        for (s, p) in seqs.iter().zip(&prompts) {
            cache.truncate(*s, p.len()).unwrap();
        }
    }
    out
}

#[test]
fn cuda_graph_tree_steps_equal_eager_steps() {
    for (name, cfg) in all_cfgs() {
        let (graphed, eager) = graphed_and_eager(&cfg, DType::F32);
        let got = repeated_tree_steps(&graphed, 5, false);
        let want = repeated_tree_steps(&eager, 5, false);
        assert_eq!(graphed.cuda_graph_failure(), None, "{name}");
        assert_eq!(graphed.cuda_graph_count(), 1, "{name}");
        for (rep, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_same_bits(g, w, &format!("{name}, tree step {rep}"));
        }
        // Token ids already on the device: eager, captured and replayed steps alike.
        let (graphed, eager) = graphed_and_eager(&cfg, DType::F32);
        for (m, how) in [(&graphed, "graphed"), (&eager, "eager")] {
            let got = repeated_tree_steps(m, 5, true);
            for (rep, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_same_bits(g, w, &format!("{name}, {how} tree step {rep}, device ids"));
            }
        }
        assert_eq!(graphed.cuda_graph_count(), 1, "{name}");
    }
}

#[test]
fn cuda_graph_head_steps_equal_eager_steps() {
    use kestrel_model::{EagleHead, EagleSeqInput};
    let cfg = tiny_cfg(6, 2, true, true);
    let hc = head_cfg(&cfg);
    let dev = gpu();
    let base = Llama::random(&cfg, SEED, DType::F32, &dev).unwrap();
    let head = |graphs: bool| {
        let t = random_head_tensors(&hc, 8, false);
        let mut h = EagleHead::from_tensors(&hc, t, &base, DType::F32, &dev).unwrap();
        h.set_cuda_graphs(graphs);
        h
    };
    // With `device_ids`, each step's token goes to the device first (a drafted node's).
    let run = |h: &EagleHead, device_ids: bool| -> Vec<Vec<Vec<f32>>> {
        let mut cache = h.new_cache(64, 4).unwrap();
        let seq = cache.add_sequence();
        let mut out = Vec::new();
        for step in 0..6u32 {
            let feats =
                candle_core::Tensor::ones((1, cfg.hidden_size), candle_core::DType::F32, &dev)
                    .unwrap()
                    .affine(0.1 * step as f64 - 0.2, 0.0)
                    .unwrap();
            let token = [(step * 11 + 3) % 61];
            let input = EagleSeqInput {
                seq,
                tokens: if device_ids { &[] } else { &token },
                features: feats,
                positions: &[step],
                mask: None,
                output_rows: OutputRows::All,
            };
            let h = if device_ids {
                let ids = candle_core::Tensor::new(&token, &dev).unwrap();
                h.forward_device_ids(&base, &[input], &ids, &mut cache)
            } else {
                h.forward(&base, &[input], &mut cache)
            };
            out.push(rows(&h.unwrap()));
        }
        out
    };
    let graphed = head(true);
    let got = run(&graphed, false);
    let want = run(&head(false), false);
    assert_eq!(graphed.cuda_graph_failure(), None);
    assert_eq!(graphed.cuda_graph_count(), 1);
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_same_bits(g, w, &format!("head step {step}"));
    }
    for (h, how) in [(head(true), "graphed"), (head(false), "eager")] {
        for (step, (g, w)) in run(&h, true).iter().zip(&want).enumerate() {
            assert_same_bits(g, w, &format!("{how} head step {step}, device ids"));
        }
    }
}

/// Hidden-state rows of `tokens` fed to a fresh cache after `prompt`: one step of all of
/// them (a chain verification, causal over the new tokens) or one step per token (decoding).
fn chain_rows(m: &Llama, prompt: &[u32], tokens: &[u32], one_step: bool) -> Vec<Vec<f32>> {
    let mut cache = m.new_cache(64, 4).unwrap();
    let seq = cache.add_sequence();
    let pos: Vec<u32> = (0..(prompt.len() + tokens.len()) as u32).collect();
    let input = |toks: &[u32], start: usize, cache: &mut PagedKvCache, prompt: bool| {
        let batch = [SeqInput {
            seq,
            tokens: toks,
            positions: &pos[start..start + toks.len()],
            mask: None,
            output_rows: OutputRows::All,
        }];
        let h = if prompt {
            m.forward_prompt(&batch, cache)
        } else {
            m.forward(&batch, cache)
        };
        rows(&h.unwrap())
    };
    input(prompt, 0, &mut cache, true);
    let start = prompt.len();
    if one_step {
        return input(tokens, start, &mut cache, false);
    }
    let mut out = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        out.extend(input(std::slice::from_ref(t), start + i, &mut cache, false));
    }
    out
}

/// Greedy speculation is exact only if a verified row is computed exactly as the decode
/// step it stands for. In bf16 a rounding difference easily flips a greedy choice, so the
/// rows must match bit for bit: 12 tokens verified in one step (more than one gemv chunk of
/// rows) against the same 12 decoded one at a time, hidden states and logits.
#[test]
fn bf16_verified_rows_equal_decoded_rows_bit_for_bit() {
    // Widths the gemv kernels take in bf16 (multiples of 8 elements): hidden 64, whose
    // projections fuse the add + norm before them; and 2,176, too wide for that (as
    // Llama-2-7B's 4,096 is), whose norms run as a kernel of their own.
    for (hidden, heads, kv_heads) in [(64, 4, 2), (2176, 17, 1)] {
        let cfg: ModelConfig = serde_json::from_str(&format!(
            r#"{{"vocab_size": 96, "hidden_size": {hidden}, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": {heads},
                "num_key_value_heads": {kv_heads}, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": true}}"#
        ))
        .unwrap();
        verified_rows_equal_decoded_rows(&cfg, CudaKernels::all());
    }
}

/// The same on the tensor-core attention (heads of 128 and SmolLM2's of 64): it sums in
/// another order than the scalar kernels, but one order for every step.
#[test]
fn tensor_core_attention_keeps_verified_rows_equal_to_decoded_rows() {
    let wide: ModelConfig = serde_json::from_str(
        r#"{"vocab_size": 96, "hidden_size": 2176, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 17,
            "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let kernels = CudaKernels {
        attention_tensor_cores: true,
        context_tensor_cores: true,
        ..CudaKernels::all()
    };
    for cfg in [wide, smollm2_shaped()] {
        verified_rows_equal_decoded_rows(&cfg, kernels);
    }
}

fn verified_rows_equal_decoded_rows(cfg: &ModelConfig, kernels: CudaKernels) {
    let hidden = cfg.hidden_size;
    let mut m = Llama::random(cfg, SEED, DType::BF16, &gpu()).unwrap();
    m.set_cuda_kernels(kernels);
    let prompt = [5u32, 17, 42, 9, 11, 23, 3];
    let tokens: Vec<u32> = (0..12).map(|k| (k * 29 + 7) % 96).collect();
    let verified = chain_rows(&m, &prompt, &tokens, true);
    let decoded = chain_rows(&m, &prompt, &tokens, false);
    assert_same_bits(&verified, &decoded, "verified hidden states");
    let logits = |hs: &[Vec<f32>]| {
        let flat: Vec<f32> = hs.concat();
        let h = candle_core::Tensor::from_slice(&flat, (hs.len(), hidden), &gpu())
            .unwrap()
            .to_dtype(candle_core::DType::BF16)
            .unwrap();
        rows(&m.logits(&h).unwrap())
    };
    assert_same_bits(&logits(&verified), &logits(&decoded), "verified logits");

    // A branching tree: the path root → 2 → 5 → 9 → 11 has other nodes between its nodes,
    // and each of its rows must still be that token decoded after its ancestors.
    let parent = [0usize, 0, 0, 1, 2, 2, 3, 4, 5, 5, 8, 9];
    let depth = |mut i: usize| {
        let mut d = 0;
        while i != 0 {
            i = parent[i];
            d += 1;
        }
        d
    };
    let n = parent.len();
    let sees = |i: usize, j: usize| {
        let mut k = i;
        loop {
            if k == j {
                return true;
            }
            if k == 0 {
                return false;
            }
            k = parent[k];
        }
    };
    let mask: Vec<bool> = (0..n * n).map(|ij| sees(ij / n, ij % n)).collect();
    let mut cache = m.new_cache(64, 4).unwrap();
    let seq = cache.add_sequence();
    let prompt_pos: Vec<u32> = (0..prompt.len() as u32).collect();
    let prefill = SeqInput {
        seq,
        tokens: &prompt,
        positions: &prompt_pos,
        mask: None,
        output_rows: OutputRows::Last,
    };
    m.forward_prompt(&[prefill], &mut cache).unwrap();
    let pos: Vec<u32> = (0..n).map(|i| (prompt.len() + depth(i)) as u32).collect();
    let tree = SeqInput {
        seq,
        tokens: &tokens,
        positions: &pos,
        mask: Some(&mask),
        output_rows: OutputRows::All,
    };
    let tree_rows = rows(&m.forward(&[tree], &mut cache).unwrap());
    let path = [0usize, 2, 5, 9, 11];
    let path_tokens: Vec<u32> = path.iter().map(|&i| tokens[i]).collect();
    let decoded = chain_rows(&m, &prompt, &path_tokens, false);
    let on_path: Vec<Vec<f32>> = path.iter().map(|&i| tree_rows[i].clone()).collect();
    assert_same_bits(&on_path, &decoded, "tree rows on a branch");
}

/// SmolLM2's layer shapes (hidden 576, 9 query / 3 KV heads of 64, MLP 1,536) with 4 layers
/// and a 4,096-token vocabulary: the tensor-core gemvs and grids of tens to hundreds of
/// blocks, so that consecutive kernels do overlap under programmatic dependent launch.
fn smollm2_shaped() -> ModelConfig {
    serde_json::from_str(
        r#"{"vocab_size": 4096, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 4, "num_attention_heads": 9, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": true}"#,
    )
    .unwrap()
}

/// Programmatic dependent launch (on by default on Hopper) lets a kernel start before the one
/// it depends on has finished; every kernel waits for its predecessor before it touches
/// anything but weights, so outputs must be bit-identical with it off: decode steps and tree
/// steps, eager and replayed from graphs, f32 and bf16.
#[test]
fn dependent_launch_changes_no_bits() {
    let cfg = smollm2_shaped();
    let dev = gpu();
    for graphs in [false, true] {
        for dtype in [DType::F32, DType::BF16] {
            let run = |dependent: bool| {
                kestrel_kernels::set_dependent_launch(dependent);
                let mut m = Llama::random(&cfg, SEED, dtype, &dev).unwrap();
                m.set_cuda_kernels(CudaKernels::all());
                m.set_cuda_graphs(graphs);
                let (tokens, hidden) = greedy(&m, &prompts(), 12);
                let trees = repeated_tree_steps(&m, 4, false);
                assert_eq!(m.cuda_graph_failure(), None);
                (tokens, hidden, trees)
            };
            let off = run(false);
            let on = run(true);
            kestrel_kernels::set_dependent_launch(true);
            let what = format!("graphs {graphs}, {dtype:?}");
            assert_eq!(on.0, off.0, "{what}: greedy tokens differ");
            assert_same_bits(&on.1, &off.1, &what);
            for (rep, (a, b)) in on.2.iter().zip(&off.2).enumerate() {
                assert_same_bits(a, b, &format!("{what}, tree step {rep}"));
            }
        }
    }
}

/// The device's context, once the stream's work is done.
fn settled_context(dev: &Device) -> std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext> {
    dev.synchronize().unwrap();
    let ctx = dev
        .as_cuda_device()
        .unwrap()
        .cuda_stream()
        .context()
        .clone();
    ctx.bind_to_thread().unwrap();
    ctx
}

/// Device memory in use (total − free) once the stream's work is done.
fn used_bytes(dev: &Device) -> u64 {
    let (free, total) = settled_context(dev).mem_get_info().unwrap();
    (total - free) as u64
}

/// Gives the device's stream-ordered pool's unused memory back, so that a measurement starts
/// from what is live (the pool keeps freed memory across synchronisations); returns the
/// pool's release threshold.
fn trim_pool(dev: &Device) -> u64 {
    use candle_core::cuda::cudarc::driver::{result, sys};
    let ctx = settled_context(dev);
    let mut threshold = 0u64;
    // SAFETY: the device's current pool, queried on its bound context; the attribute is a
    // u64, written into a local.
    unsafe {
        let pool = result::device::get_mem_pool(ctx.cu_device()).unwrap();
        result::mem_pool::get_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .unwrap();
        result::mem_pool::trim_to(pool, 0).unwrap();
    }
    threshold
}

/// Bytes the driver's graph memory pool (what allocations inside captured graphs use) holds
/// for them now, and has reserved.
fn graph_pool_bytes(dev: &Device) -> (u64, u64) {
    use candle_core::cuda::cudarc::driver::sys;
    let ctx = settled_context(dev);
    let get = |attr| {
        let mut v = 0u64;
        // SAFETY: the attribute is a u64, written into a local, for the context's device.
        unsafe {
            sys::cuDeviceGetGraphMemAttribute(ctx.cu_device(), attr, (&mut v as *mut u64).cast())
                .result()
                .unwrap();
        }
        v
    };
    (
        get(sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
        get(sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
    )
}

/// CUDA's stream-ordered pool reserves device memory in chunks of this size (measured on the
/// H200: every level above the pre-load one is a multiple of it).
const POOL_CHUNK: u64 = 32 << 20;

/// Loading full-size SmolLM2 in bf16 takes no more pool chunks than its weights fill: fused
/// projections are concatenated before they reach the device, so no freed parts stay behind
/// between the weights (they took a whole extra chunk when fused on the device), and the
/// first decode and prompt steps add no more than a chunk. Also prints the level after each
/// first use, which locates the rest of the fixed memory: run it alone
/// in a fresh process with --nocapture (`tools/gpu/memory_h200.sh` does), since modules the
/// other tests loaded stay loaded.
#[test]
fn smollm2_loads_into_its_weights_chunks_and_steps_within_one_more() {
    let mut cfg = smollm2_shaped();
    cfg.num_hidden_layers = 30;
    cfg.vocab_size = 49152;
    let dev = gpu();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let threshold = trim_pool(&dev);
    let start = used_bytes(&dev);
    let mut m = Llama::random(&cfg, SEED, DType::BF16, &dev).unwrap();
    let weights = cfg.num_parameters() as u64 * 2;
    let loaded = used_bytes(&dev) - start;
    let mut cache = m.new_cache(64, 16).unwrap();
    let with_cache = used_bytes(&dev) - start;
    let seq = cache.add_sequence();
    let tokens: Vec<u32> = (0..9).map(|i| i * 97 + 5).collect();
    let pos: Vec<u32> = (0..9).collect();
    let step = |range: std::ops::Range<usize>, cache: &mut PagedKvCache| {
        let batch = [SeqInput {
            seq,
            tokens: &tokens[range.clone()],
            positions: &pos[range.clone()],
            mask: None,
            output_rows: OutputRows::Last,
        }];
        let h = if range.len() > 1 {
            m.forward_prompt(&batch, cache)
        } else {
            m.forward(&batch, cache)
        };
        m.logits(&h.unwrap()).unwrap();
    };
    // A candle op and a Kestrel kernel alone (each loads its module), a one-token step
    // (Kestrel's kernels and a few candle ops), then a prompt's (candle's matmul: cuBLAS), so
    // that each stage's first use shows apart.
    let x = candle_core::Tensor::ones((4, 64), candle_core::DType::F32, &dev).unwrap();
    (&x * 2.0)
        .unwrap()
        .to_dtype(candle_core::DType::BF16)
        .unwrap();
    let candle_op = used_bytes(&dev) - start;
    kestrel_kernels::argmax_rows(&x).unwrap();
    let kestrel_kernel = used_bytes(&dev) - start;
    // The kernel with Kestrel's largest stack frame (256 bytes: what the runtime limits the
    // per-thread stack to).
    kestrel_kernels::top_k_logp(&x, 8).unwrap();
    let local_memory = used_bytes(&dev) - start;
    // One bf16 gemv of SmolLM2's shape.
    let xb = candle_core::Tensor::ones((1, 576), candle_core::DType::BF16, &dev).unwrap();
    let wb = candle_core::Tensor::ones((960, 576), candle_core::DType::BF16, &dev).unwrap();
    kestrel_kernels::gemv(&xb, &wb).unwrap();
    let gemv = used_bytes(&dev) - start;
    step(0..1, &mut cache);
    let decoded = used_bytes(&dev) - start;
    step(1..9, &mut cache);
    let prefilled = used_bytes(&dev) - start;
    // candle's other modules, one at a time, after the steps (which use none of them through
    // its indexing ops): indexing, binary, unary, reduce, ternary.
    let ids = candle_core::Tensor::new(&[1u32, 3], &dev).unwrap();
    let y = x.index_select(&ids, 0).unwrap();
    let mut modules = vec![("indexing", used_bytes(&dev) - start)];
    let z = (&y + &y).unwrap();
    modules.push(("binary", used_bytes(&dev) - start));
    let z = z.exp().unwrap();
    modules.push(("unary", used_bytes(&dev) - start));
    z.sum_keepdim(1).unwrap();
    modules.push(("reduce", used_bytes(&dev) - start));
    y.ge(0.5).unwrap().where_cond(&y, &y).unwrap();
    modules.push(("cmp + ternary", used_bytes(&dev) - start));
    eprintln!(
        "SmolLM2 bf16, MiB above the start: weights {:.1}; loaded {:.1}; + KV cache {:.1}; \
         after a candle op {:.1}; after a Kestrel kernel {:.1}; after top-k (a stack frame) \
         {:.1}; after a gemv {:.1}; after a one-token step {:.1}; after an 8-token prompt \
         step {:.1} (pool release threshold {threshold}); then candle's modules: {}",
        mib(weights),
        mib(loaded),
        mib(with_cache),
        mib(candle_op),
        mib(kestrel_kernel),
        mib(local_memory),
        mib(gemv),
        mib(decoded),
        mib(prefilled),
        modules
            .iter()
            .map(|(m, b)| format!("{m} {:.1}", mib(*b)))
            .collect::<Vec<_>>()
            .join("; ")
    );
    // CUDA graphs: more decode steps with graphs on (a layout is captured at its third step);
    // the level after, and what the driver's graph memory pool holds.
    m.set_cuda_graphs(true);
    for i in 9..14u32 {
        let batch = [SeqInput {
            seq,
            tokens: &[i * 31 + 7],
            positions: &[i],
            mask: None,
            output_rows: OutputRows::Last,
        }];
        let h = m.forward(&batch, &mut cache).unwrap();
        m.logits(&h).unwrap();
    }
    assert_eq!(m.cuda_graph_count(), 1, "{:?}", m.cuda_graph_failure());
    let graphed = used_bytes(&dev) - start;
    let (graph_used, graph_reserved) = graph_pool_bytes(&dev);
    eprintln!(
        "after 5 graphed decode steps {:.1} MiB above the start; the graph memory pool: \
         {:.1} MiB in use, {:.1} MiB reserved; the step's arena {:.2} MiB; the graph: {:?}",
        mib(graphed),
        mib(graph_used),
        mib(graph_reserved),
        mib(m.cuda_graph_arena_bytes() as u64),
        m.cuda_graph_relocations()
    );
    // The captured step keeps its activations in the model's arena, so the driver's graph
    // pool (32 MiB at a time) holds nothing.
    assert_eq!((graph_used, graph_reserved), (0, 0));
    // Under dependent launch, the kernels joined across the removed allocations keep it:
    // Kestrel's kernels follow kernels through programmatic edges, which the capture alone
    // never made (an allocation sat before every Kestrel kernel).
    if kestrel_kernels::dependent_launch_on(&dev).unwrap() {
        let stats = m.cuda_graph_relocations();
        assert!(stats[0].programmatic_edges.1 > 0, "{stats:?}");
    }
    // The steps' activations fit in one pool chunk; candle's indexing module, which took
    // ~90 MiB at the first step before the row gathers became Kestrel's, must not load.
    assert!(
        prefilled <= gemv + POOL_CHUNK,
        "the first steps took {:.1} MiB above the {:.1} MiB before them",
        mib(prefilled - gemv),
        mib(gemv)
    );
    let chunks = weights.div_ceil(POOL_CHUNK) * POOL_CHUNK;
    assert!(
        loaded <= chunks,
        "loading {:.1} MiB of weights left {:.1} MiB in use ({:.0} MiB of whole chunks)",
        mib(weights),
        mib(loaded),
        mib(chunks)
    );
}

/// Value `i` of a fixed pseudo-random sequence in [-1, 1) (SplitMix64's mix of the index).
fn hashed_unit(seed: u64, i: usize) -> f32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64 + 1);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// The quantized gemv on CUDA against the CPU kernel on the same copy: the same quantized
/// weights and inputs (each row quantized per block of 32 to i8 on both), the same integer
/// block products, f32 sums in another order. So every output is within f32 rounding of the
/// CPU's, for 4- and 8-bit codes, f32 and bf16 inputs, and row counts that fill, split and
/// leave short the kernel's groups of two rows. The shapes take each of the kernel's column
/// widths on a GPU of 100-140 multiprocessors: a column a warp at a time (the small ones), two
/// (4,100 columns, one row) and four (8,202, its last group two columns short); and rows of
/// weights a warp reads in one pass (576 inputs) or several (8,202 × 1,536 at four columns,
/// 40 × 8,192 at one).
#[test]
fn quantized_gemv_on_cuda_matches_the_cpu_kernel() {
    use kestrel_model::matvec_quant::{Bits, QuantWeights};
    let dev = gpu();
    for (n, k) in [
        (96, 576),
        (40, 1536),
        (33, 4096),
        (40, 8192),
        (4100, 576),
        (8202, 1536),
    ] {
        let wv: Vec<f32> = (0..n * k).map(|i| 0.05 * hashed_unit(3, i)).collect();
        let w = candle_core::Tensor::from_vec(wv.clone(), (n, k), &Device::Cpu).unwrap();
        for bits in [Bits::Four, Bits::Eight] {
            let q = QuantWeights::quantize(&w, bits).unwrap().unwrap();
            let g = q.to_cuda(&dev).unwrap();
            for m in [1, 2, 3, 5, 17] {
                let x: Vec<f32> = (0..m * k).map(|i| 2.0 * hashed_unit(4, i)).collect();
                let want = q.matmul_nt(&x, m);
                // The sum of |w·x| bounds each output's rounding.
                let scale: Vec<f32> = (0..m * n)
                    .map(|o| {
                        let (i, j) = (o / n, o % n);
                        (0..k).map(|t| (wv[j * k + t] * x[i * k + t]).abs()).sum()
                    })
                    .collect();
                for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
                    // bf16 inputs: the CPU's reference takes the same rounded inputs.
                    let xt = candle_core::Tensor::from_vec(x.clone(), (m, k), &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    let want = if dtype == candle_core::DType::F32 {
                        want.clone()
                    } else {
                        q.matmul_nt(&to_vec(&xt), m)
                    };
                    let got = to_vec(&g.matmul(&xt.to_device(&dev).unwrap()).unwrap());
                    assert_eq!(got.len(), m * n);
                    // f32 outputs: f32 rounding of the sums; bf16 outputs: their own rounding.
                    let tol = if dtype == candle_core::DType::F32 {
                        1e-5
                    } else {
                        8e-3
                    };
                    for (o, (&a, &b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= tol * scale[o] + tol * b.abs(),
                            "{bits:?} {n}x{k}, {m} rows, {dtype:?}: output {o} is {a} on CUDA, {b} on the CPU"
                        );
                    }
                }
            }
        }
    }
}

/// A model's quantized draft copy computes on CUDA what it does on the CPU, and it is the copy
/// that runs. Not within f32 rounding: each projection quantizes its inputs to i8 again, so an
/// input a rounding apart on the two devices can land a code apart; the prompt rows must stay
/// far closer to the CPU copy's than to the full weights'.
#[test]
fn quantized_draft_copies_decode_on_cuda_as_on_the_cpu() {
    let cfg = smollm2_shaped();
    for dtype in [DType::F32, DType::BF16] {
        let (cpu, gpu_m) = models(&cfg, dtype, CudaKernels::all());
        let (cpu_q, cpu_bytes) = cpu.with_quantized_draft_weights().unwrap();
        let (gpu_q, gpu_bytes) = gpu_m.with_quantized_draft_weights().unwrap();
        assert_eq!(gpu_bytes, cpu_bytes);
        let want = rows(&prefill(&cpu_q, &prompts()).2);
        let got = rows(&prefill(&gpu_q, &prompts()).2);
        let full = rows(&prefill(&gpu_m, &prompts()).2);
        for ((g, w), f) in got.iter().zip(&want).zip(&full) {
            let (d, from_full) = (max_abs_diff(g, w), max_abs_diff(g, f));
            eprintln!("{dtype:?}: CUDA copy vs CPU copy {d}, vs the full weights {from_full}");
            assert!(
                d < 0.25 * from_full,
                "{dtype:?}: the CUDA copy's prompt rows are {d} from the CPU copy's, {from_full} from the full weights'"
            );
        }
    }
}
