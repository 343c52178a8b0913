//! Forward-pass equivalences of the Llama decoder on CPU/f32 against a naive reference and
//! against itself (batched vs alone, prefill vs decode, prefill whole vs in pieces, tree +
//! compact vs causal, rollback).

mod common;

use candle_core::Device;
use common::*;
use kestrel_core::{DType, ModelConfig};
use kestrel_model::llama::random_tensors;
use kestrel_model::{Llama, ModelError, OutputRows, PagedKvCache, SeqId, SeqInput};

const SEED: u64 = 11;

fn model(cfg: &ModelConfig) -> (Llama, Weights) {
    let m = Llama::random(cfg, SEED, DType::F32, &Device::Cpu).unwrap();
    (m, Weights::new(&random_tensors(cfg, SEED).unwrap()))
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 17 + salt * 7 + 3) % 61)
        .collect()
}

fn positions(start: usize, n: usize) -> Vec<u32> {
    (start as u32..(start + n) as u32).collect()
}

/// Feeds `tokens` causally at positions continuing the sequence; returns all rows.
fn feed(m: &Llama, cache: &mut PagedKvCache, seq: SeqId, tokens: &[u32]) -> Vec<Vec<f32>> {
    let start = cache.seq_len(seq).unwrap();
    rows(&forward_rows(m, cache, seq, tokens, start, None))
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    let d = max_abs_diff(a, b);
    assert!(d <= tol, "{what}: max abs diff {d} > {tol}");
}

#[test]
fn paged_forward_with_block_churn_matches_naive_reference() {
    for (name, cfg) in all_cfgs() {
        let (mut m, w) = model(&cfg);
        // Block sizes 2..4 with the CPU kernels; block size 3 also through the portable
        // candle path that CUDA runs.
        for (block_size, kernels) in [(2, true), (3, true), (4, true), (3, false)] {
            m.set_cpu_kernels(kernels);
            let name = &format!("{name} kernels {kernels}");
            let mut cache = m.new_cache(40, block_size).unwrap();
            // Churn: interleave sequences and free one so later block tables are scattered.
            let a = cache.add_sequence();
            let b = cache.add_sequence();
            let c = cache.add_sequence();
            let ta = toks(13, 1);
            let tc = toks(9, 3);
            feed(&m, &mut cache, a, &ta[..3]);
            feed(&m, &mut cache, b, &toks(7, 2));
            feed(&m, &mut cache, c, &tc[..5]);
            cache.free_sequence(b).unwrap();
            let d = cache.add_sequence();
            let td = toks(11, 4);
            // Batched varlen steps mixing prefill chunks and single-token decodes.
            let chunks: [(usize, usize, usize, usize); 4] =
                [(3, 7, 0, 4), (7, 8, 4, 5), (8, 11, 5, 8), (11, 13, 8, 11)];
            for (a0, a1, d0, d1) in chunks {
                let pa = positions(a0, a1 - a0);
                let pd = positions(d0, d1 - d0);
                let out = m
                    .forward(
                        &[
                            SeqInput {
                                seq: a,
                                tokens: &ta[a0..a1],
                                positions: &pa,
                                mask: None,
                                output_rows: OutputRows::All,
                            },
                            SeqInput {
                                seq: d,
                                tokens: &td[d0..d1],
                                positions: &pd,
                                mask: None,
                                output_rows: OutputRows::Last,
                            },
                        ],
                        &mut cache,
                    )
                    .unwrap();
                let got = rows(&out);
                assert_eq!(got.len(), (a1 - a0) + 1);
                let ref_a = causal(&cfg, &w, &ta[..a1]);
                for (i, r) in got[..a1 - a0].iter().enumerate() {
                    assert_close(
                        r,
                        &ref_a[a0 + i],
                        1e-4,
                        &format!("{name} bs{block_size} seq a row {}", a0 + i),
                    );
                }
                let ref_d = causal(&cfg, &w, &td[..d1]);
                assert_close(
                    &got[a1 - a0],
                    &ref_d[d1 - 1],
                    1e-4,
                    &format!("{name} bs{block_size} seq d"),
                );
                // Logits through the LM head (tied or not).
                let logits = rows(&m.logits(&out).unwrap());
                assert_close(
                    &logits[a1 - a0],
                    &llama_logits(&cfg, &w, &ref_d[d1 - 1]),
                    1e-4,
                    "logits",
                );
            }
            // d's blocks came from the freed b and fresh ones: not one contiguous run.
            let table = cache.block_table(d).unwrap().to_vec();
            assert!(
                table.windows(2).any(|p| p[1] != p[0] + 1),
                "{name}: table {table:?} is contiguous"
            );
            // c is untouched by the others' traffic.
            let more = feed(&m, &mut cache, c, &tc[5..]);
            let ref_c = causal(&cfg, &w, &tc);
            assert_close(&more[3], &ref_c[8], 1e-4, &format!("{name} seq c"));
        }
    }
}

#[test]
fn batched_varlen_equals_each_sequence_alone() {
    for (name, cfg) in all_cfgs() {
        let (m, _) = model(&cfg);
        let seqs = [toks(5, 1), toks(1, 2), toks(9, 3)];
        let mut batched = m.new_cache(32, 4).unwrap();
        let ids: Vec<SeqId> = seqs.iter().map(|_| batched.add_sequence()).collect();
        // A common prefix step, then a mixed step.
        let pos: Vec<Vec<u32>> = seqs.iter().map(|s| positions(0, s.len())).collect();
        let batch: Vec<SeqInput> = seqs
            .iter()
            .zip(&ids)
            .zip(&pos)
            .map(|((t, &seq), p)| SeqInput {
                seq,
                tokens: t,
                positions: p,
                mask: None,
                output_rows: OutputRows::All,
            })
            .collect();
        let together = rows(&m.forward(&batch, &mut batched).unwrap());
        let mut alone = Vec::new();
        for s in &seqs {
            let mut cache = m.new_cache(32, 4).unwrap();
            let id = cache.add_sequence();
            alone.extend(feed(&m, &mut cache, id, s));
        }
        assert_eq!(together.len(), alone.len());
        for (i, (a, b)) in together.iter().zip(&alone).enumerate() {
            assert_close(a, b, 1e-5, &format!("{name} row {i}"));
        }
    }
}

/// Steps where every sequence brings the same number of tokens (decode, equal trees) take
/// one batched attention call on the portable path; prompts of other lengths take the
/// per-sequence loop. Both must equal each sequence run alone.
#[test]
fn equal_length_steps_equal_each_sequence_alone() {
    for (name, cfg) in all_cfgs() {
        let (mut m, _) = model(&cfg);
        for kernels in [false, true] {
            m.set_cpu_kernels(kernels);
            let name = &format!("{name} kernels {kernels}");
            let prompts = [toks(6, 1), toks(2, 2), toks(11, 3)];
            let chunks: Vec<Vec<Vec<u32>>> = (0..3u32)
                .map(|s| vec![toks(1, 10 + s), toks(1, 20 + s), toks(2, 30 + s)])
                .collect();
            let mut cache = m.new_cache(48, 4).unwrap();
            let ids: Vec<SeqId> = prompts.iter().map(|_| cache.add_sequence()).collect();
            let mut lens: Vec<usize> = vec![0; 3];
            let mut together = Vec::new();
            let steps: Vec<Vec<&[u32]>> =
                std::iter::once(prompts.iter().map(|p| p.as_slice()).collect())
                    .chain((0..3).map(|c| chunks.iter().map(|ch| ch[c].as_slice()).collect()))
                    .collect();
            for step in &steps {
                let pos: Vec<Vec<u32>> = step
                    .iter()
                    .zip(&lens)
                    .map(|(t, &l)| positions(l, t.len()))
                    .collect();
                let batch: Vec<SeqInput> = step
                    .iter()
                    .zip(&ids)
                    .zip(&pos)
                    .map(|((t, &seq), p)| SeqInput {
                        seq,
                        tokens: t,
                        positions: p,
                        mask: None,
                        output_rows: OutputRows::All,
                    })
                    .collect();
                together.push(rows(&m.forward(&batch, &mut cache).unwrap()));
                for (l, t) in lens.iter_mut().zip(step) {
                    *l += t.len();
                }
            }
            for s in 0..3 {
                let mut alone = m.new_cache(48, 4).unwrap();
                let id = alone.add_sequence();
                for (k, step) in steps.iter().enumerate() {
                    let want = feed(&m, &mut alone, id, step[s]);
                    let first: usize = steps[k][..s].iter().map(|t| t.len()).sum();
                    for (r, w) in want.iter().enumerate() {
                        assert_close(
                            &together[k][first + r],
                            w,
                            1e-5,
                            &format!("{name} step {k} seq {s} row {r}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn prefill_at_once_equals_token_by_token_decode() {
    for (name, cfg) in all_cfgs() {
        let (m, _) = model(&cfg);
        let t = toks(12, 5);
        let mut c1 = m.new_cache(16, 2).unwrap();
        let s1 = c1.add_sequence();
        let pos = positions(0, t.len());
        let out = m
            .forward(
                &[SeqInput {
                    seq: s1,
                    tokens: &t,
                    positions: &pos,
                    mask: None,
                    output_rows: OutputRows::Last,
                }],
                &mut c1,
            )
            .unwrap();
        let prefill = rows(&out).pop().unwrap();
        let mut c2 = m.new_cache(16, 2).unwrap();
        let s2 = c2.add_sequence();
        let mut last = Vec::new();
        for &tok in &t {
            last = feed(&m, &mut c2, s2, &[tok]).pop().unwrap();
        }
        assert_close(&prefill, &last, 1e-5, name);
        assert_eq!(c1.seq_len(s1).unwrap(), 12);
        assert_eq!(c2.seq_len(s2).unwrap(), 12);
    }
}

/// `forward_prompt` over `(sequence, new tokens)` parts continuing each sequence; the bits of
/// every returned row.
fn prompt_bits(m: &Llama, cache: &mut PagedKvCache, parts: &[(SeqId, &[u32])]) -> Vec<Vec<u32>> {
    let pos: Vec<Vec<u32>> = parts
        .iter()
        .map(|(seq, t)| positions(cache.seq_len(*seq).unwrap(), t.len()))
        .collect();
    let batch: Vec<SeqInput> = parts
        .iter()
        .zip(&pos)
        .map(|((seq, tokens), p)| SeqInput {
            seq: *seq,
            tokens,
            positions: p,
            mask: None,
            output_rows: OutputRows::All,
        })
        .collect();
    let hidden = m.forward_prompt(&batch, cache).unwrap();
    rows(&hidden)
        .iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// What prefix reuse relies on: a prompt prefilled in pieces (its first tokens alone, more of
/// them beside another sequence, its last token alone) gets bit-identical final hidden
/// states, hence logits, to the same prompt prefilled whole. In f32 prompts take candle's
/// GEMM (padded to its batch-invariant path), in f16 the matrix-vector kernel, in bf16 the
/// AMX tiles where the CPU has them (amx.rs), else the matrix-vector kernel.
#[test]
fn prompt_prefill_in_pieces_is_bit_identical() {
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    for ((name, cfg), dtype) in all_cfgs()
        .into_iter()
        .flat_map(|c| dtypes.map(|d| (c.clone(), d)))
    {
        let name = format!("{name} {dtype:?}");
        let m = Llama::random(&cfg, SEED, dtype, &Device::Cpu).unwrap();
        let t = toks(13, 9);
        let other = toks(6, 4);
        let mut whole_cache = m.new_cache(16, 4).unwrap();
        let a = whole_cache.add_sequence();
        let whole = prompt_bits(&m, &mut whole_cache, &[(a, &t)]);

        let mut cache = m.new_cache(16, 4).unwrap();
        let b = cache.add_sequence();
        let o = cache.add_sequence();
        let mut pieces = prompt_bits(&m, &mut cache, &[(b, &t[..8])]);
        let mixed = prompt_bits(&m, &mut cache, &[(o, &other), (b, &t[8..12])]);
        pieces.extend_from_slice(&mixed[other.len()..]);
        pieces.extend(prompt_bits(&m, &mut cache, &[(b, &t[12..])]));
        assert_eq!(pieces.len(), whole.len());
        for (i, (p, w)) in pieces.iter().zip(&whole).enumerate() {
            assert!(p == w, "{name}: row {i} differs when prefilled in pieces");
        }
    }
}

#[test]
fn tree_forward_then_compact_equals_causal_path() {
    for ((name, cfg), kernels) in all_cfgs()
        .into_iter()
        .flat_map(|c| [(c.clone(), true), (c, false)])
    {
        let (mut m, w) = model(&cfg);
        m.set_cpu_kernels(kernels);
        let name = &format!("{name} kernels {kernels}");
        let prefix = toks(6, 7);
        // Tree: 0 root; 1, 2 children of 0; 3, 4 children of 1; 5 child of 2.
        let tree = [9u32, 14, 23, 31, 40, 52];
        let parent = [usize::MAX, 0, 0, 1, 1, 2];
        let depth = [0u32, 1, 1, 2, 2, 2];
        let n = tree.len();
        let is_ancestor = |i: usize, j: usize| {
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
        };
        let mask: Vec<bool> = (0..n * n).map(|ij| is_ancestor(ij / n, ij % n)).collect();
        let base = prefix.len();
        let pos: Vec<u32> = depth.iter().map(|d| base as u32 + d).collect();

        let mut cache = m.new_cache(24, 3).unwrap();
        let s = cache.add_sequence();
        feed(&m, &mut cache, s, &prefix);
        let out = m
            .forward(
                &[SeqInput {
                    seq: s,
                    tokens: &tree,
                    positions: &pos,
                    mask: Some(&mask),
                    output_rows: OutputRows::All,
                }],
                &mut cache,
            )
            .unwrap();
        let got = rows(&out);
        // Each node's output equals the causal run over prefix + its root path.
        for node in [3usize, 5] {
            let mut path = vec![node];
            while parent[*path.last().unwrap()] != usize::MAX {
                path.push(parent[*path.last().unwrap()]);
            }
            path.reverse();
            let mut seq = prefix.clone();
            seq.extend(path.iter().map(|&k| tree[k]));
            let want = causal(&cfg, &w, &seq);
            assert_close(
                &got[node],
                want.last().unwrap(),
                1e-4,
                &format!("{name} node {node}"),
            );
        }
        // Accept root → 1 → 4, compact, and decode one more token.
        let kept = [0usize, 1, 4];
        cache.compact(s, base, &kept).unwrap();
        assert_eq!(cache.seq_len(s).unwrap(), base + 3);
        let next = feed(&m, &mut cache, s, &[33]).pop().unwrap();

        let mut fresh = m.new_cache(24, 3).unwrap();
        let f = fresh.add_sequence();
        let mut seq = prefix.clone();
        seq.extend(kept.iter().map(|&k| tree[k]));
        feed(&m, &mut fresh, f, &seq);
        let want = feed(&m, &mut fresh, f, &[33]).pop().unwrap();
        assert_close(&next, &want, 1e-5, &format!("{name} after compact"));
    }
}

#[test]
fn truncate_rollback_equals_never_fed() {
    for (name, cfg) in all_cfgs() {
        let (m, _) = model(&cfg);
        let prefix = toks(7, 9);
        let mut cache = m.new_cache(12, 2).unwrap();
        let s = cache.add_sequence();
        feed(&m, &mut cache, s, &prefix);
        let free_before = cache.free_blocks();
        feed(&m, &mut cache, s, &[1, 2, 3, 4, 5]);
        cache.truncate(s, prefix.len() + 1).unwrap();
        assert_eq!(
            cache.free_blocks(),
            free_before,
            "{name}: whole blocks past the end are freed"
        );
        let got = feed(&m, &mut cache, s, &[50, 51]);

        let mut fresh = m.new_cache(12, 2).unwrap();
        let f = fresh.add_sequence();
        let mut seq = prefix.clone();
        seq.push(1);
        feed(&m, &mut fresh, f, &seq);
        let want = feed(&m, &mut fresh, f, &[50, 51]);
        for (a, b) in got.iter().zip(&want) {
            assert_close(a, b, 1e-5, name);
        }
    }
}

#[test]
fn half_precision_stays_close_to_f32() {
    let cfg = tiny_cfg(4, 2, false, true);
    let f32m = Llama::random(&cfg, SEED, DType::F32, &Device::Cpu).unwrap();
    for kernels in [true, false] {
        let t = toks(10, 2);
        let run = |m: &Llama| {
            let mut cache = m.new_cache(16, 4).unwrap();
            let s = cache.add_sequence();
            let mut out = feed(m, &mut cache, s, &t[..8]);
            out.extend(feed(m, &mut cache, s, &t[8..9]));
            out.extend(feed(m, &mut cache, s, &t[9..]));
            out
        };
        let want = run(&f32m);
        for (dtype, tol) in [(DType::F16, 0.02f32), (DType::BF16, 0.1)] {
            let mut m = Llama::random(&cfg, SEED, dtype, &Device::Cpu).unwrap();
            m.set_cpu_kernels(kernels);
            assert_eq!(m.dtype(), kestrel_model::candle_dtype(dtype));
            let got = run(&m);
            for (a, b) in got.iter().zip(&want) {
                let scale = b.iter().map(|v| v.abs()).fold(0.0, f32::max);
                let d = max_abs_diff(a, b);
                assert!(
                    d <= tol * scale.max(1.0),
                    "{dtype} kernels {kernels}: diff {d} (scale {scale})"
                );
            }
        }
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let cfg = tiny_cfg(4, 2, true, false);
    let (m, _) = model(&cfg);
    let mut cache = m.new_cache(3, 2).unwrap();
    let s = cache.add_sequence();
    let t = toks(7, 1);
    let pos = positions(0, 7);
    let err = m
        .forward(
            &[SeqInput {
                seq: s,
                tokens: &t,
                positions: &pos,
                mask: None,
                output_rows: OutputRows::All,
            }],
            &mut cache,
        )
        .unwrap_err();
    assert!(
        matches!(err, ModelError::OutOfBlocks { needed: 4, free: 3 }),
        "{err}"
    );
    assert_eq!(cache.seq_len(s).unwrap(), 0);
    assert_eq!(cache.free_blocks(), 3);

    let bad_tok = [1000u32];
    let err = m
        .forward(
            &[SeqInput {
                seq: s,
                tokens: &bad_tok,
                positions: &[0],
                mask: None,
                output_rows: OutputRows::All,
            }],
            &mut cache,
        )
        .unwrap_err();
    assert!(err.to_string().contains("1000"), "{err}");
    let err = m
        .forward(
            &[SeqInput {
                seq: s,
                tokens: &[1, 2],
                positions: &[0],
                mask: None,
                output_rows: OutputRows::All,
            }],
            &mut cache,
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::InvalidInput(_)), "{err}");
    let err = m
        .forward(
            &[SeqInput {
                seq: s,
                tokens: &[1, 2],
                positions: &[0, 1],
                mask: None,
                output_rows: OutputRows::Rows(vec![2]),
            }],
            &mut cache,
        )
        .unwrap_err();
    assert!(err.to_string().contains("output row 2"), "{err}");
    let err = m
        .forward(
            &[SeqInput {
                seq: s,
                tokens: &[1, 2],
                positions: &[0, 1],
                mask: Some(&[true]),
                output_rows: OutputRows::All,
            }],
            &mut cache,
        )
        .unwrap_err();
    assert!(err.to_string().contains("mask"), "{err}");
    let err = m
        .forward(
            &[SeqInput {
                seq: SeqId(99),
                tokens: &[1],
                positions: &[0],
                mask: None,
                output_rows: OutputRows::All,
            }],
            &mut cache,
        )
        .unwrap_err();
    assert!(
        matches!(err, ModelError::UnknownSequence(SeqId(99))),
        "{err}"
    );
    // A cache of the wrong geometry is refused.
    let mut wrong =
        PagedKvCache::new(1, 2, 8, 4, 2, candle_core::DType::F32, &Device::Cpu).unwrap();
    let w = wrong.add_sequence();
    assert!(m
        .forward(
            &[SeqInput {
                seq: w,
                tokens: &[1],
                positions: &[0],
                mask: None,
                output_rows: OutputRows::All
            }],
            &mut wrong
        )
        .is_err());
    assert_eq!(cache.seq_len(s).unwrap(), 0);
}

/// The training forward (`from_var_builder` + `forward_train`, right-padded batch) gives the
/// inference forward's hidden states, and gradients reach the trainable variables only.
#[test]
fn training_forward_equals_the_inference_forward() {
    use candle_nn::{VarBuilder, VarMap};
    for (name, cfg) in all_cfgs() {
        let (m, _) = model(&cfg);
        let tensors = random_tensors(&cfg, SEED).unwrap();
        let varmap = VarMap::new();
        let mut frozen = std::collections::BTreeMap::new();
        for (n, t) in &tensors {
            if n == "model.embed_tokens.weight" {
                frozen.insert(n.clone(), t.clone());
            } else {
                let var = candle_core::Var::from_tensor(t).unwrap();
                varmap.data().lock().unwrap().insert(n.clone(), var);
            }
        }
        let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu);
        let trainable = Llama::from_var_builder(&cfg, vb, &frozen).unwrap();
        let (a, b) = (toks(9, 1), toks(5, 2));
        let mut padded = a.clone();
        padded.extend(&b);
        padded.extend([0; 4]);
        let batch = candle_core::Tensor::from_vec(padded, (2, 9), &Device::Cpu).unwrap();
        let out = trainable.forward_train(&batch).unwrap();
        for (i, seq) in [&a, &b].into_iter().enumerate() {
            let mut cache = m.new_cache(8, 4).unwrap();
            let id = cache.add_sequence();
            let want = feed(&m, &mut cache, id, seq);
            let got = rows(&out.get(i).unwrap().narrow(0, 0, seq.len()).unwrap());
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_close(g, w, 1e-4, &format!("{name} seq {i} row {r}"));
            }
        }
        let grads = out.sum_all().unwrap().backward().unwrap();
        let vars = varmap.data().lock().unwrap();
        let q = &vars["model.layers.1.self_attn.q_proj.weight"];
        assert!(grads.get(q.as_tensor()).is_some(), "{name}");
        assert!(
            grads.get(&frozen["model.embed_tokens.weight"]).is_none(),
            "{name}"
        );
    }
}

fn one_sequence<'a>(
    seq: SeqId,
    tokens: &'a [u32],
    positions: &'a [u32],
    output_rows: OutputRows,
) -> [SeqInput<'a>; 1] {
    [SeqInput {
        seq,
        tokens,
        positions,
        mask: None,
        output_rows,
    }]
}

/// A tapped forward returns the untapped rows, then each tapped layer's state: checked
/// against models cut after that layer, whose final norm (weight 1) is what a tap applies,
/// on the decode and the prompt path, for all rows and for the last row only.
#[test]
fn tapped_rows_are_the_final_rows_then_each_layer_state() {
    for (name, cfg) in all_cfgs() {
        let h = cfg.hidden_size;
        let mut tensors = random_tensors(&cfg, SEED).unwrap();
        let ones = candle_core::Tensor::ones(h, candle_core::DType::F32, &Device::Cpu).unwrap();
        tensors.insert("model.norm.weight".into(), ones);
        let cut = |layers: usize| {
            let mut c = cfg.clone();
            c.num_hidden_layers = layers;
            let kept = tensors
                .iter()
                .filter(|(n, _)| {
                    n.strip_prefix("model.layers.")
                        .and_then(|r| r.split('.').next()?.parse::<usize>().ok())
                        .is_none_or(|l| l < layers)
                })
                .map(|(n, t)| (n.clone(), t.clone()))
                .collect();
            Llama::from_tensors(&c, kept, DType::F32, &Device::Cpu).unwrap()
        };
        let full = cut(cfg.num_hidden_layers);
        let first = cut(1);
        let t = toks(9, 2);
        let pos = positions(0, t.len());
        for prompt in [false, true] {
            for output_rows in [OutputRows::All, OutputRows::Last] {
                let run = |m: &Llama, taps: &[usize]| {
                    let mut cache = m.new_cache(8, 4).unwrap();
                    let seq = cache.add_sequence();
                    let batch = one_sequence(seq, &t, &pos, output_rows.clone());
                    rows(&m.forward_tapped(&batch, &mut cache, taps, prompt).unwrap())
                };
                let tapped = run(&full, &[0, 1]);
                let (plain, layer0) = (run(&full, &[]), run(&first, &[]));
                assert_eq!(tapped.len(), plain.len());
                for (r, row) in tapped.iter().enumerate() {
                    let what = format!("{name}, prompt {prompt}, {output_rows:?}, row {r}");
                    assert_eq!(row.len(), 3 * h, "{what}");
                    assert!(row[..h] == plain[r][..], "{what}: final columns differ");
                    assert!(row[h..2 * h] == layer0[r][..], "{what}: layer 0 differs");
                    // The last layer's state normed without a weight is the final row here.
                    assert!(row[2 * h..] == plain[r][..], "{what}: layer 1 differs");
                }
            }
        }
        let mut cache = full.new_cache(8, 4).unwrap();
        let seq = cache.add_sequence();
        let batch = one_sequence(seq, &t, &pos, OutputRows::All);
        let err = full.forward_tapped(&batch, &mut cache, &[1, 0], false);
        assert_eq!(
            err.unwrap_err().to_string(),
            "invalid input: feature taps must be strictly increasing, found 1 then 0"
        );
        let err = full.forward_tapped(&batch, &mut cache, &[2], false);
        assert_eq!(
            err.unwrap_err().to_string(),
            "invalid input: feature tap 2 is not a decoder layer of this 2-layer model"
        );
    }
}

/// A verification step over token ids already on the device gives, bit for bit, the step over
/// the same ids from the host (a batch of two trees, with taps), and the cache ends alike.
/// Inputs that mix the two, or ids of the wrong shape or type, are refused by name.
#[test]
fn device_token_ids_give_the_host_ids_step() {
    use candle_core::Tensor;
    for (name, cfg) in all_cfgs() {
        let (m, _) = model(&cfg);
        let taps = [0usize];
        let mask = [
            true, false, false, false, //
            true, true, false, false, //
            true, false, true, false, //
            true, true, false, true,
        ];
        let trees = [toks(4, 5), toks(4, 9)];
        let run = |device: bool| -> (Vec<Vec<f32>>, Vec<usize>) {
            let mut cache = m.new_cache(32, 4).unwrap();
            let seqs = [cache.add_sequence(), cache.add_sequence()];
            feed(&m, &mut cache, seqs[0], &toks(5, 1));
            feed(&m, &mut cache, seqs[1], &toks(3, 2));
            let pos: Vec<Vec<u32>> = [5u32, 3]
                .iter()
                .map(|&b| [0u32, 1, 1, 2].iter().map(|d| b + d).collect())
                .collect();
            let batch: Vec<SeqInput> = (0..2)
                .map(|i| SeqInput {
                    seq: seqs[i],
                    tokens: if device { &[] } else { &trees[i] },
                    positions: &pos[i],
                    mask: Some(&mask),
                    output_rows: OutputRows::All,
                })
                .collect();
            let out = if device {
                let ids = Tensor::new(trees.concat().as_slice(), &Device::Cpu).unwrap();
                m.forward_tapped_device_ids(&batch, &ids, &mut cache, &taps)
            } else {
                m.forward_tapped(&batch, &mut cache, &taps, false)
            };
            let lens = seqs.iter().map(|&s| cache.seq_len(s).unwrap()).collect();
            (rows(&out.unwrap()), lens)
        };
        let (want, want_lens) = run(false);
        let (got, got_lens) = run(true);
        assert_eq!(got, want, "{name}");
        assert_eq!(got_lens, want_lens, "{name}");
        assert_eq!(got_lens, vec![9, 7], "{name}");

        let mut cache = m.new_cache(8, 4).unwrap();
        let s = cache.add_sequence();
        let input = |tokens: &'static [u32]| SeqInput {
            seq: s,
            tokens,
            positions: &[0, 1],
            mask: None,
            output_rows: OutputRows::All,
        };
        let mut refused = |tokens: &'static [u32], ids: Tensor| {
            m.forward_tapped_device_ids(&[input(tokens)], &ids, &mut cache, &[])
                .unwrap_err()
                .to_string()
        };
        let cpu = &Device::Cpu;
        assert_eq!(
            refused(&[1, 2], Tensor::new(&[1u32, 2], cpu).unwrap()),
            format!("invalid input: sequence {s:?}: host tokens given with the step's ids on the device"),
            "{name}"
        );
        assert_eq!(
            refused(&[], Tensor::new(&[1u32, 2, 3], cpu).unwrap()),
            "invalid input: device token ids: expected u32 [2], got U32 [3]",
            "{name}"
        );
        assert_eq!(
            refused(&[], Tensor::new(&[1f32, 2.], cpu).unwrap()),
            "invalid input: device token ids: expected u32 [2], got F32 [2]",
            "{name}"
        );
        assert_eq!(cache.seq_len(s).unwrap(), 0, "{name}");
    }
}

#[test]
fn lm_head_rows_give_the_heads_columns_and_refuse_ids_past_the_vocabulary() {
    use candle_core::Tensor;
    let cfg = tiny_cfg(4, 2, true, false);
    let (m, _) = model(&cfg);
    let h = cfg.hidden_size;
    let values: Vec<f32> = (0..2 * h).map(|i| (i as f32 * 0.37).sin()).collect();
    let hidden = Tensor::from_vec(values, (2, h), &Device::Cpu).unwrap();
    let ids = [7u32, 0, cfg.vocab_size as u32 - 1, 7];
    let full = m.logits(&hidden).unwrap().to_vec2::<f32>().unwrap();
    let part = m
        .logits_of(&m.lm_head_rows(&ids).unwrap(), &hidden)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for (r, row) in part.iter().enumerate() {
        let want: Vec<f32> = ids.iter().map(|&id| full[r][id as usize]).collect();
        assert_eq!(row, &want, "row {r}");
    }
    let err = m.lm_head_rows(&[3, cfg.vocab_size as u32]).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "invalid input: LM head row {} is outside the vocabulary of {}",
            cfg.vocab_size, cfg.vocab_size
        )
    );
}

/// A copy that skips decoder layers computes, bit for bit, what the model computes with
/// those layers' o and down projections zeroed (each then adds exactly nothing to the
/// residual stream), on the prompt and the decode path, each layer over its own place in
/// the KV cache (the two share a cache); the copy refuses taps at layers it skips, and bad
/// layer lists are refused by name.
#[test]
fn a_copy_skipping_layers_equals_the_model_with_those_layers_silenced() {
    for (name, mut cfg) in all_cfgs() {
        cfg.num_hidden_layers = 3;
        let tensors = random_tensors(&cfg, SEED).unwrap();
        let full = Llama::from_tensors(&cfg, tensors.clone(), DType::F32, &Device::Cpu).unwrap();
        for skip in [vec![1], vec![0, 2]] {
            let mut silenced = tensors.clone();
            for l in &skip {
                for proj in ["self_attn.o_proj", "mlp.down_proj"] {
                    let key = format!("model.layers.{l}.{proj}.weight");
                    let zeros = silenced[&key].zeros_like().unwrap();
                    silenced.insert(key, zeros);
                }
            }
            let want = Llama::from_tensors(&cfg, silenced, DType::F32, &Device::Cpu).unwrap();
            let copy = full.skipping_layers(&skip).unwrap();
            let kept: Vec<usize> = (0..3).filter(|l| !skip.contains(l)).collect();
            assert_eq!(copy.layer_ids(), &kept[..], "{name}");
            // The prompt through one model, then two decode steps through another over the
            // same cache: a silenced layer's K/V reach nothing, so the two models may share
            // a cache if the copy keeps each layer's K/V in that layer's place.
            let run = |first: &Llama, then: &Llama| {
                let mut cache = first.new_cache(8, 4).unwrap();
                let seq = cache.add_sequence();
                let prompt = toks(7, 3);
                let pos = positions(0, prompt.len());
                let batch = one_sequence(seq, &prompt, &pos, OutputRows::All);
                let mut out = rows(&first.forward_prompt(&batch, &mut cache).unwrap());
                out.extend(feed(then, &mut cache, seq, &toks(1, 5)));
                out.extend(feed(then, &mut cache, seq, &toks(3, 8)));
                out
            };
            let silent = run(&want, &want);
            for (a, b, how) in [
                (&copy, &copy, "alone"),
                (&copy, &want, "then silenced"),
                (&want, &copy, "after silenced"),
            ] {
                assert!(
                    run(a, b) == silent,
                    "{name}, skipping {skip:?}, {how}: rows differ"
                );
            }
            assert!(
                run(&full, &full) != silent,
                "{name}, skipping {skip:?}: no layer was silenced"
            );
        }
        let copy = full.skipping_layers(&[1]).unwrap();
        let mut cache = copy.new_cache(8, 4).unwrap();
        let seq = cache.add_sequence();
        let (t, pos) = (toks(2, 1), positions(0, 2));
        let batch = one_sequence(seq, &t, &pos, OutputRows::All);
        let err = copy.forward_tapped(&batch, &mut cache, &[1], false);
        assert_eq!(
            err.unwrap_err().to_string(),
            "invalid input: feature tap 1 is a layer this copy of the model skips"
        );
        for (skip, want) in [
            (vec![3], "invalid input: layer 3 to skip is not a decoder layer of this 3-layer model (0 to 2)"),
            (vec![2, 0, 2], "invalid input: layer 2 is named twice to skip"),
            (vec![0, 1, 2], "invalid input: skipping layers [0, 1, 2] leaves none of the model's 3 layers to run"),
        ] {
            let err = full.skipping_layers(&skip).unwrap_err().to_string();
            assert_eq!(err, want);
        }
    }
}
