use super::*;
use crate::stats::{assert_fits, counts};
use crate::tree::{EagleTree, TreeLimits};
use rand::Rng;

const V: usize = 8;

fn limits() -> TreeLimits {
    TreeLimits {
        num_eagle_layers: 4,
        max_non_leaves_per_layer: 10,
        max_draft_len: 63,
        max_top_k: 10,
    }
}

/// A random distribution over `V` tokens with some exact zeros.
fn random_dist(rng: &mut SeqRng, zeros: bool) -> Vec<f32> {
    let mut v: Vec<f32> = (0..V)
        .map(|_| {
            let u = rng.uniform() as f32;
            if zeros && u < 0.2 {
                0.0
            } else {
                u * u + 0.01
            }
        })
        .collect();
    if v.iter().all(|&x| x == 0.0) {
        v[0] = 1.0;
    }
    let s: f32 = v.iter().sum();
    v.iter_mut().for_each(|x| *x /= s);
    v
}

/// Draws `k` distinct tokens from `q` without replacement, in draw order.
fn draw_without_replacement(q: &[f32], k: usize, rng: &mut SeqRng) -> Vec<u32> {
    let mut w: Vec<f64> = q.iter().map(|&x| x as f64).collect();
    let mut out = Vec::with_capacity(k);
    for _ in 0..k {
        let x = crate::sampling::sample_f64(&w, rng);
        out.push(x);
        w[x as usize] = 0.0;
    }
    out
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

// ---------------------------------------------------------------- greedy

#[test]
fn greedy_tree_picks_longest_matching_path() {
    // small tree: nodes 1:[0] 2:[1] 3:[0,0] 4:[0,1] 5:[1,0] 6:[0,0,0]
    let t =
        EagleTree::from_json("[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]", &limits()).unwrap();
    let b = t.buffers();
    let tokens = [100, 5, 6, 7, 8, 9, 10];
    // Target argmax after each node: root → 5 (node 1 ok), node1 → 8 (node 4 ok),
    // node 4 is a leaf: bonus = argmax after node 4 = 42.
    let argmax = [5, 8, 0, 0, 42, 0, 0];
    let a = greedy_tree(&tokens, &argmax, b.retrieve_paths()).unwrap();
    assert_eq!(a.accepted_nodes, vec![0, 1, 4]);
    assert_eq!(a.accepted_len, 2);
    assert_eq!(a.bonus_token, 42);
    assert_eq!(a.tokens, vec![5, 8, 42]);
    assert_eq!(b.retrieve_paths()[a.path_index], vec![0, 1, 4]);

    // Whole deepest path: root→5, node1→7, node3→10, node6→77.
    let argmax = [5, 7, 0, 10, 0, 0, 77];
    let a = greedy_tree(&tokens, &argmax, b.retrieve_paths()).unwrap();
    assert_eq!(a.accepted_nodes, vec![0, 1, 3, 6]);
    assert_eq!(a.tokens, vec![5, 7, 10, 77]);

    // Nothing matches: bonus = argmax at the root.
    let argmax = [55, 0, 0, 0, 0, 0, 0];
    let a = greedy_tree(&tokens, &argmax, b.retrieve_paths()).unwrap();
    assert_eq!(a.accepted_len, 0);
    assert_eq!(a.accepted_nodes, vec![0]);
    assert_eq!(a.tokens, vec![55]);
    assert_eq!(a.path_index, 0);

    // Second branch: root → 6 (node 2), node 2 → 9 (node 5), node 5 → 3.
    let argmax = [6, 0, 9, 0, 0, 3, 0];
    let a = greedy_tree(&tokens, &argmax, b.retrieve_paths()).unwrap();
    assert_eq!(a.accepted_nodes, vec![0, 2, 5]);
    assert_eq!(a.tokens, vec![6, 9, 3]);
}

#[test]
fn greedy_tree_input_errors() {
    let paths = vec![vec![0, 1]];
    assert_eq!(
        greedy_tree(&[1, 2], &[1], &paths).unwrap_err().to_string(),
        "target tokens has 1 entries, expected 2"
    );
    assert_eq!(
        greedy_tree(&[1, 2], &[1, 2], &[vec![1]])
            .unwrap_err()
            .to_string(),
        "retrieve path #0 does not start at the root (node 0)"
    );
    assert_eq!(
        greedy_tree(&[1, 2], &[1, 2], &[vec![0, 1], vec![0, 5]])
            .unwrap_err()
            .to_string(),
        "retrieve path #1 refers to node 5, but the tree has only 2 nodes"
    );
}

#[test]
fn token_match() {
    let a = draft_target_token_match(&[3, 4, 5], &[3, 4, 9, 1]).unwrap();
    assert_eq!(a.accepted_len, 2);
    assert_eq!(a.tokens, vec![3, 4, 9]);
    let a = draft_target_token_match(&[3, 4], &[3, 4, 7]).unwrap();
    assert_eq!(a.tokens, vec![3, 4, 7]);
    let a = draft_target_token_match(&[], &[7]).unwrap();
    assert_eq!(a.tokens, vec![7]);
    assert_eq!(
        draft_target_token_match(&[3, 4], &[3])
            .unwrap_err()
            .to_string(),
        "target tokens has 1 entries, expected 3"
    );
}

// ---------------------------------------------------------------- typical

#[test]
fn typical_probs_by_hand() {
    let p = [0.5f64, 0.3, 0.15, 0.05];
    let logits: Vec<f32> = p.iter().map(|x| x.ln() as f32).collect();
    let params = TypicalParams {
        posterior_threshold: 0.09,
        temperature: 1.0,
    };
    let h: f64 = -p.iter().map(|x| x * x.ln()).sum::<f64>();
    let thr = 0.09f64.min(0.3 * (-h).exp());
    // H ≈ 1.14, 0.3·e^−H ≈ 0.096 → thr = 0.09: only 0.05 is cut.
    assert!((thr - 0.09).abs() < 1e-12);
    let got = typical_probs(&logits, &params);
    let want = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0];
    for (g, w) in got.iter().zip(want) {
        assert!((*g as f64 - w).abs() < 1e-6, "{got:?}");
    }
    // High-entropy distribution: alpha·exp(−H) is the binding threshold (below ε), so 0.08
    // survives although it is below ε.
    let p = [0.3f64, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02];
    let logits: Vec<f32> = p.iter().map(|x| x.ln() as f32).collect();
    let h: f64 = -p.iter().map(|x| x * x.ln()).sum::<f64>();
    let thr = 0.3 * (-h).exp();
    assert!(thr < 0.08 && thr > 0.03, "thr {thr}");
    let got = typical_probs(&logits, &params);
    let s = 0.95;
    let want = [
        0.3 / s,
        0.2 / s,
        0.15 / s,
        0.12 / s,
        0.1 / s,
        0.08 / s,
        0.0,
        0.0,
    ];
    for (g, w) in got.iter().zip(want) {
        assert!((*g as f64 - w).abs() < 1e-6, "{got:?}");
    }
}

#[test]
fn typical_tree_greedy_equals_greedy_tree() {
    let t = EagleTree::from_preset("small_8", &limits()).unwrap();
    let b = t.buffers();
    let n = b.num_nodes();
    let mut rng = SeqRng::new(1, 0);
    for _ in 0..50 {
        let tokens: Vec<u32> = (0..n).map(|_| rng.inner().random_range(0..4)).collect();
        let logits: Vec<f32> = (0..n * V).map(|_| rng.uniform() as f32 * 4.0).collect();
        let am: Vec<u32> = logits.chunks(V).map(crate::sampling::argmax).collect();
        let g = greedy_tree(&tokens, &am, b.retrieve_paths()).unwrap();
        let params = TypicalParams {
            posterior_threshold: 0.09,
            temperature: 0.0,
        };
        let ty = typical_tree(&tokens, &logits, V, b.retrieve_paths(), &params, &mut rng).unwrap();
        assert_eq!(g, ty);
    }
}

#[test]
fn typical_tree_samples_truncated_distribution() {
    // Root-only tree: the output token is one draw from typical_probs at the root.
    let logits = [1.0f32, 0.2, -1.0, 2.0, 0.5, -3.0, 0.0, 1.5];
    let params = TypicalParams {
        posterior_threshold: 0.09,
        temperature: 0.7,
    };
    let want = f64s(&typical_probs(&logits, &params));
    assert!(want.contains(&0.0));
    let mut rng = SeqRng::new(5, 0);
    let paths = vec![vec![0]];
    let c = counts(V, 100_000, || {
        typical_tree(&[0], &logits, V, &paths, &params, &mut rng)
            .unwrap()
            .bonus_token as usize
    });
    assert_fits(&c, &want, "typical_tree bonus");
    // A matching draft is accepted when the sampled target token equals it.
    let tokens = [0u32, 3];
    let mut two_rows = logits.to_vec();
    two_rows.extend_from_slice(&logits);
    let mut accepted = 0;
    let n = 20_000;
    for _ in 0..n {
        let a = typical_tree(&tokens, &two_rows, V, &[vec![0, 1]], &params, &mut rng).unwrap();
        accepted += a.accepted_len;
    }
    let rate = accepted as f64 / n as f64;
    assert!((rate - want[3]).abs() < 0.02, "rate {rate} vs {}", want[3]);
}

// ---------------------------------------------------------------- draft-target

#[test]
fn draft_target_input_errors() {
    let mut rng = SeqRng::new(0, 0);
    let q = vec![0.5f32, 0.5, 0.0, 0.0];
    let p = vec![0.25f32; 8];
    assert_eq!(
        draft_target(&[2], &q, &p, 4, &mut rng).unwrap_err().to_string(),
        "draft token 2 at chain position 0 has zero draft probability: pass the draft distribution it was sampled from"
    );
    assert_eq!(
        draft_target(&[9], &q, &p, 4, &mut rng)
            .unwrap_err()
            .to_string(),
        "token 9 at draft position 0 is outside the vocabulary of 4 tokens"
    );
    assert_eq!(
        draft_target(&[0], &q, &p[..4], 4, &mut rng)
            .unwrap_err()
            .to_string(),
        "target probs has 4 entries, expected 8"
    );
    let bad = vec![0.25f32, -0.25, 0.25, 0.25, 0.0, 0.0, 0.0, 1.0];
    assert_eq!(
        draft_target(&[0], &q, &bad, 4, &mut rng).unwrap_err().to_string(),
        "target probs row 0 is not a distribution: it has a negative or non-finite entry or sums to 0"
    );
}

#[test]
fn draft_target_equal_distributions_accept_everything() {
    let mut rng = SeqRng::new(3, 0);
    let q = random_dist(&mut rng, false);
    let mut dq = q.clone();
    dq.extend_from_slice(&q);
    let mut tp = dq.clone();
    tp.extend_from_slice(&q);
    for _ in 0..200 {
        let x: Vec<u32> = (0..2)
            .map(|_| crate::sampling::sample(&q, &mut rng))
            .collect();
        let a = draft_target(&x, &dq, &tp, V, &mut rng).unwrap();
        assert_eq!(a.accepted_len, 2);
        assert_eq!(&a.tokens[..2], &x[..]);
    }
}

/// A device draws draft_target's tests from k + 1 uniforms taken ahead from a copy of the
/// stream and then advances the stream by `speculative_uniforms`: that must leave it exactly
/// where draft_target itself leaves it, for every outcome (rejection at each position, all
/// accepted, k = 0..3).
#[test]
fn speculative_uniforms_counts_what_draft_target_draws() {
    let mut setup = SeqRng::new(5, 0);
    let mut outcomes = vec![0usize; 4];
    for trial in 0..400 {
        let k = trial % 4;
        let q: Vec<f32> = (0..k)
            .flat_map(|_| random_dist(&mut setup, false))
            .collect();
        // Targets close to the drafts at some positions, far at others: every outcome occurs.
        let p: Vec<f32> = (0..=k)
            .flat_map(|_| random_dist(&mut setup, true))
            .collect();
        let x: Vec<u32> = (0..k)
            .map(|i| crate::sampling::sample(&q[i * V..(i + 1) * V], &mut setup))
            .collect();
        let mut host = SeqRng::new(9, trial as u64);
        let mut ahead = host.clone();
        let a = draft_target(&x, &q, &p, V, &mut host).unwrap();
        outcomes[a.accepted_len] += 1;
        for _ in 0..a.speculative_uniforms(k) {
            ahead.uniform();
        }
        assert_eq!(host.uniform(), ahead.uniform(), "trial {trial}: {a:?}");
    }
    assert!(outcomes.iter().all(|&n| n > 0), "outcomes {outcomes:?}");
}

/// Joint law of the first two emitted tokens of draft-target speculative sampling (γ = 2,
/// the drafts and targets conditioned on the previous token), including the next round when
/// a round emits a single token. Must be P1(y1)·P2[y1](y2).
#[test]
fn draft_target_first_and_second_token_follow_target() {
    let mut setup = SeqRng::new(2024, 0);
    let p1 = random_dist(&mut setup, true);
    let q1 = random_dist(&mut setup, false);
    let p2: Vec<Vec<f32>> = (0..V).map(|_| random_dist(&mut setup, true)).collect();
    let q2: Vec<Vec<f32>> = (0..V).map(|_| random_dist(&mut setup, false)).collect();
    let p3 = random_dist(&mut setup, false); // bonus row; not observed
    let mut rng = SeqRng::new(77, 1);
    let mut dq = vec![0f32; 2 * V];
    let mut tp = vec![0f32; 3 * V];
    let c = counts(V * V, 200_000, || {
        let x1 = crate::sampling::sample(&q1, &mut rng);
        let x2 = crate::sampling::sample(&q2[x1 as usize], &mut rng);
        dq[..V].copy_from_slice(&q1);
        dq[V..].copy_from_slice(&q2[x1 as usize]);
        tp[..V].copy_from_slice(&p1);
        tp[V..2 * V].copy_from_slice(&p2[x1 as usize]);
        tp[2 * V..].copy_from_slice(&p3);
        let a = draft_target(&[x1, x2], &dq, &tp, V, &mut rng).unwrap();
        let y1 = a.tokens[0];
        let y2 = if a.tokens.len() >= 2 {
            a.tokens[1]
        } else {
            // Next round: one draft from q2[y1], target p2[y1].
            let q = &q2[y1 as usize];
            let x = crate::sampling::sample(q, &mut rng);
            let mut t = p2[y1 as usize].clone();
            t.extend_from_slice(&p3);
            draft_target(&[x], q, &t, V, &mut rng).unwrap().tokens[0]
        };
        y1 as usize * V + y2 as usize
    });
    let expected: Vec<f64> = (0..V * V)
        .map(|k| p1[k / V] as f64 * p2[k / V][k % V] as f64)
        .collect();
    assert_fits(&c, &expected, "draft_target joint (y1, y2)");
    let first: Vec<u64> = (0..V).map(|a| c[a * V..(a + 1) * V].iter().sum()).collect();
    assert_fits(&first, &f64s(&p1), "draft_target first token");
}

// ---------------------------------------------------------------- exact tree sampling

#[test]
fn exact_tree_errors() {
    let t = EagleTree::from_json("[[0], [1]]", &limits()).unwrap();
    let b = t.buffers();
    let mut rng = SeqRng::new(0, 0);
    let p = vec![0.25f32; 12];
    let q = vec![
        0.5f32, 0.5, 0.0, 0.0, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25,
    ];
    let prop = DraftProposal::WithoutReplacement { draft_probs: &q };
    assert_eq!(
        exact_tree_sampling(b, &[0, 0, 2], &p, 4, prop, &mut rng)
            .unwrap_err()
            .to_string(),
        "draft token 2 at tree node 2 has zero draft probability at its parent node 0: pass the draft distribution its children were sampled from, without duplicate siblings"
    );
    assert_eq!(
        exact_tree_sampling(b, &[0, 0, 4], &p, 4, prop, &mut rng)
            .unwrap_err()
            .to_string(),
        "token 4 at tree node 2 is outside the vocabulary of 4 tokens"
    );
    assert_eq!(
        exact_tree_sampling(b, &[0, 0], &p, 4, prop, &mut rng)
            .unwrap_err()
            .to_string(),
        "tree tokens has 2 entries, expected 3"
    );
}

/// Children of the root drawn without replacement from q, in rank order, tried in order: the
/// first emitted token must follow p. `choices` may skip ranks (the trials stop at the gap).
fn exact_first_token(choices: &str, draws: usize, seed: u64, n: usize) {
    let t = EagleTree::from_json(choices, &limits()).unwrap();
    let b = t.buffers();
    let nodes = b.num_nodes();
    let mut setup = SeqRng::new(seed, 0);
    let p = random_dist(&mut setup, true);
    let q = random_dist(&mut setup, false);
    let mut tp = vec![0f32; nodes * V];
    let mut dq = vec![0f32; nodes * V];
    for i in 0..nodes {
        tp[i * V..(i + 1) * V].copy_from_slice(if i == 0 { &p } else { &q });
        dq[i * V..(i + 1) * V].copy_from_slice(&q);
    }
    let mut rng = SeqRng::new(seed, 9);
    let mut tokens = vec![0u32; nodes];
    let c = counts(V, n, || {
        let drawn = draw_without_replacement(&q, draws, &mut rng);
        for &child in b.children(0) {
            tokens[child] = drawn[b.ranks()[child]];
        }
        let a = exact_tree_sampling(
            b,
            &tokens,
            &tp,
            V,
            DraftProposal::WithoutReplacement { draft_probs: &dq },
            &mut rng,
        )
        .unwrap();
        a.tokens[0] as usize
    });
    assert_fits(
        &c,
        &f64s(&p),
        &format!("exact_tree_sampling first token, {choices}"),
    );
}

#[test]
fn exact_tree_first_token_three_siblings() {
    exact_first_token("[[0], [1], [2]]", 3, 31, 200_000);
}

#[test]
fn exact_tree_first_token_with_rank_gap() {
    exact_first_token("[[0], [1], [3]]", 4, 32, 100_000);
}

/// Two levels: node tokens at depth 1 drawn w/o replacement from q1 at the root; each depth-1
/// node with children gets its children drawn from q2[its token]; target at a node = p2[its
/// token]. Joint law of the first two emitted tokens (next round when only one is emitted).
#[test]
fn exact_tree_first_and_second_token_follow_target() {
    let t = EagleTree::from_json("[[0], [1], [2], [0, 0], [0, 1], [1, 0]]", &limits()).unwrap();
    let b = t.buffers();
    let nodes = b.num_nodes();
    let mut setup = SeqRng::new(4242, 0);
    let p1 = random_dist(&mut setup, true);
    let q1 = random_dist(&mut setup, false);
    let p2: Vec<Vec<f32>> = (0..V).map(|_| random_dist(&mut setup, true)).collect();
    let q2: Vec<Vec<f32>> = (0..V).map(|_| random_dist(&mut setup, false)).collect();
    let uniform = vec![1.0 / V as f32; V];
    let mut rng = SeqRng::new(4242, 5);
    let mut tokens = vec![0u32; nodes];
    let mut tp = vec![0f32; nodes * V];
    let mut dq = vec![0f32; nodes * V];
    let c = counts(V * V, 150_000, || {
        let drawn = draw_without_replacement(&q1, 3, &mut rng);
        for &n1 in b.children(0) {
            tokens[n1] = drawn[b.ranks()[n1]];
            let k = b.children(n1).len();
            let sub = draw_without_replacement(&q2[tokens[n1] as usize], k, &mut rng);
            for &n2 in b.children(n1) {
                tokens[n2] = sub[b.ranks()[n2]];
            }
        }
        for i in 0..nodes {
            let (p, q): (&[f32], &[f32]) = match b.depths()[i] {
                0 => (&p1, &q1),
                1 => (&p2[tokens[i] as usize], &q2[tokens[i] as usize]),
                _ => (&uniform, &uniform),
            };
            tp[i * V..(i + 1) * V].copy_from_slice(p);
            dq[i * V..(i + 1) * V].copy_from_slice(q);
        }
        let a = exact_tree_sampling(
            b,
            &tokens,
            &tp,
            V,
            DraftProposal::WithoutReplacement { draft_probs: &dq },
            &mut rng,
        )
        .unwrap();
        let y1 = a.tokens[0];
        let y2 = if a.tokens.len() >= 2 {
            a.tokens[1]
        } else {
            // Next round from context y1: a one-node tree whose child is drawn from q2[y1].
            let q = &q2[y1 as usize];
            let x = crate::sampling::sample(q, &mut rng);
            let small = EagleTree::from_json("[[0]]", &limits()).unwrap();
            let mut tp1 = p2[y1 as usize].clone();
            tp1.extend_from_slice(&uniform);
            let mut dq1 = q.clone();
            dq1.extend_from_slice(&uniform);
            exact_tree_sampling(
                small.buffers(),
                &[y1, x],
                &tp1,
                V,
                DraftProposal::WithoutReplacement { draft_probs: &dq1 },
                &mut rng,
            )
            .unwrap()
            .tokens[0]
        };
        y1 as usize * V + y2 as usize
    });
    let expected: Vec<f64> = (0..V * V)
        .map(|k| p1[k / V] as f64 * p2[k / V][k % V] as f64)
        .collect();
    assert_fits(&c, &expected, "exact_tree_sampling joint (y1, y2)");
}

#[test]
fn exact_tree_deterministic_top_k_first_token() {
    let t = EagleTree::from_json("[[0], [1], [2]]", &limits()).unwrap();
    let b = t.buffers();
    let mut setup = SeqRng::new(99, 0);
    let p = random_dist(&mut setup, true);
    let mut tp = p.clone();
    for _ in 0..3 {
        tp.extend_from_slice(&p);
    }
    // Fixed candidates (e.g. the draft's top-3), including a zero-probability token.
    let zero = p.iter().position(|&x| x == 0.0).unwrap_or(7) as u32;
    let tokens = [0u32, 2, zero, 5];
    let mut rng = SeqRng::new(99, 1);
    let c = counts(V, 200_000, || {
        exact_tree_sampling(b, &tokens, &tp, V, DraftProposal::Deterministic, &mut rng)
            .unwrap()
            .tokens[0] as usize
    });
    assert_fits(&c, &f64s(&p), "exact_tree_sampling deterministic");
}

#[test]
fn exact_tree_with_one_hot_target_is_greedy() {
    // Temperature-0 target (one-hot): acceptance follows the argmax like greedy_tree.
    let t = EagleTree::from_preset("small_8", &limits()).unwrap();
    let b = t.buffers();
    let n = b.num_nodes();
    let mut rng = SeqRng::new(8, 0);
    for _ in 0..100 {
        let mut tokens = vec![0u32; n];
        let mut dq = vec![0f32; n * V];
        for i in 0..n {
            let q = random_dist(&mut rng, false);
            let drawn = draw_without_replacement(&q, b.children(i).len(), &mut rng);
            for &c in b.children(i) {
                tokens[c] = drawn[b.ranks()[c]];
            }
            dq[i * V..(i + 1) * V].copy_from_slice(&q);
        }
        let am: Vec<u32> = (0..n)
            .map(|_| rng.inner().random_range(0..V as u32))
            .collect();
        let mut tp = vec![0f32; n * V];
        for i in 0..n {
            tp[i * V + am[i] as usize] = 1.0;
        }
        let g = greedy_tree(&tokens, &am, b.retrieve_paths()).unwrap();
        let e = exact_tree_sampling(
            b,
            &tokens,
            &tp,
            V,
            DraftProposal::WithoutReplacement { draft_probs: &dq },
            &mut rng,
        )
        .unwrap();
        assert_eq!(g.tokens, e.tokens);
        assert_eq!(g.accepted_nodes, e.accepted_nodes);
    }
}
