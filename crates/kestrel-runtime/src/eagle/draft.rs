//! Drafting a token tree per sequence with the EAGLE head: EAGLE-1's static `eagle_choices`
//! tree or EAGLE-2's dynamic tree, level by level, batched over the sequences.

use super::feed::{feed_trees, TreeFeed};
use super::node_outputs::{NodeOutputs, NodeRef};
use super::node_tokens::{Children, NodeTokens};
use crate::device::draft_on_device;
use crate::error::{Result, RuntimeError};
use crate::logit_rows::{draws_on_device, top_k_ids, top_k_rows};
use candle_core::Tensor;
use kestrel_kernels::gather_rows;
use kestrel_model::{EagleHead, Llama, LmHeadRows, PagedKvCache, SeqId};
use kestrel_spec::dynamic::{DynamicTreeBuilder, DynamicTreeConfig};
use kestrel_spec::sampling::{self, SamplingParams};
use kestrel_spec::{EagleTree, SeqRng, TreeBuffers};
use std::borrow::Cow;

/// Where one sequence's tree grows from.
pub(crate) struct DraftRoot {
    pub seq: SeqId,
    /// Committed pairs in the head cache.
    pub committed: usize,
    /// Head position of the last committed pair (the root's); depth-d nodes sit at +d.
    pub root_pos: usize,
    /// The last committed token: the tree's root.
    pub token: u32,
    /// The head's output for the last committed pair (`[1, hidden]`).
    pub output: Tensor,
}

/// A batch's drafted trees.
pub(crate) struct DraftedTrees<'t> {
    pub trees: Vec<DraftedTree<'t>>,
    /// The trees' tokens (u32, tree after tree) when they were drafted where the head runs;
    /// the trees then hold none until acceptance fetches them with the target's.
    pub device_tokens: Option<Tensor>,
}

/// A drafted tree: node tokens (root first; empty until fetched when they were drafted on
/// the device), its structure and, when the children were sampled, the draft distribution at
/// every node.
pub(crate) struct DraftedTree<'t> {
    pub tokens: Vec<u32>,
    pub buffers: Cow<'t, TreeBuffers>,
    pub draft_laws: DraftLaws,
}

impl DraftedTree<'static> {
    /// The root alone: verifying it is a plain decode step.
    pub fn root_only(token: u32) -> Self {
        DraftedTree {
            tokens: vec![token],
            buffers: Cow::Owned(TreeBuffers::root_only()),
            draft_laws: DraftLaws::None,
        }
    }
}

/// The laws a tree's children were drawn from, for exact acceptance.
pub(crate) enum DraftLaws {
    /// Fixed independently of the target (the head's top-k).
    None,
    /// `num_nodes × vocab` probabilities on the host (zero rows for leaves).
    Host(Vec<f32>),
    /// Each node's row of the step's draft logits on the device
    /// ([`Drafter::device_laws`]); `None` for leaves.
    Device(Vec<Option<u32>>),
}

/// How children are chosen from the head's distribution at a node.
pub(crate) enum ChildChoice<'a> {
    /// The k most likely tokens (greedy, token-match and typical acceptance).
    TopK,
    /// k tokens drawn without replacement from the warped draft distribution (exact
    /// rejection sampling needs to know the proposal).
    Sample(&'a SamplingParams),
}

pub(crate) struct Drafter<'a> {
    pub head: &'a EagleHead,
    pub base: &'a Llama,
    pub cache: &'a mut PagedKvCache,
    /// Candidates come from these tokens only (`EagleOptions::draft_vocab`).
    pub draft_vocab: Option<&'a DraftVocab>,
    /// Sampled children drawn on the device: the levels' draft logits, in order
    /// ([`DraftLaws::Device`] rows count through them).
    pub device_laws: Vec<Tensor>,
}

/// The tokens a head drafts from, and the LM head's rows for them.
pub(crate) struct DraftVocab {
    /// Logits column j is token `ids[j]`.
    pub ids: Vec<u32>,
    /// `ids` on the engine's device, where top-k columns become tokens.
    pub ids_tensor: Tensor,
    pub rows: LmHeadRows,
    /// On a device, every token's column (`u32::MAX` outside), for exact acceptance there.
    pub col_of: Option<Tensor>,
}

impl Drafter<'_> {
    /// The draft logits of head outputs: over the whole vocabulary, or the draft vocabulary's
    /// columns.
    fn logits(&self, rows: &Tensor) -> Result<Tensor> {
        Ok(match self.draft_vocab {
            Some(v) => self.base.logits_of(&v.rows, rows)?,
            None => self.base.logits(rows)?,
        })
    }

    /// The token of logits column `c`.
    fn token(&self, c: u32) -> u32 {
        self.draft_vocab.map_or(c, |v| v.ids[c as usize])
    }

    /// The `k` best tokens of each head output (draft-vocabulary columns mapped to token
    /// ids), u32 `[rows, k]` where the outputs are.
    fn best_tokens(&self, rows: &Tensor, k: usize) -> Result<Tensor> {
        let columns = top_k_ids(&self.logits(rows)?, k)?;
        Ok(match self.draft_vocab {
            Some(v) => {
                gather_rows(&v.ids_tensor, &columns.flatten_all()?)?.reshape(columns.dims())?
            }
            None => columns,
        })
    }

    /// The `k` best tokens of each head output with their log-probabilities (over the
    /// draft vocabulary).
    fn top_k(&self, rows: &Tensor, k: usize) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        let mut best = top_k_rows(&self.logits(rows)?, k)?;
        if self.draft_vocab.is_some() {
            for (ids, _) in &mut best {
                for id in ids.iter_mut() {
                    *id = self.token(*id);
                }
            }
        }
        Ok(best)
    }

    /// The static `tree` from every root. Top-k children stay where the head's logits are
    /// ([`NodeTokens::pooled`], unless [`crate::device::set_draft_on_device`] turned that
    /// off or `host_tokens` asks for them on the host, where a lookup chain is grafted);
    /// sampled ones are drawn into host tokens.
    pub fn draft_static<'t>(
        &mut self,
        tree: &'t EagleTree,
        roots: &[DraftRoot],
        choice: &ChildChoice,
        rngs: &mut [&mut SeqRng],
        host_tokens: bool,
    ) -> Result<DraftedTrees<'t>> {
        let buf = tree.buffers();
        let n = buf.num_nodes();
        let vocab = self.base.config().vocab_size;
        let pooled = matches!(choice, ChildChoice::TopK) && draft_on_device() && !host_tokens;
        let mut tokens = if pooled {
            NodeTokens::pooled(roots, n, roots[0].output.device())?
        } else {
            NodeTokens::host(roots, n)
        };
        // Made at the first level that feeds the head: a one-level tree drafts from the roots'
        // outputs alone and needs no per-node buffer (a few launches and uploads a step).
        let mut outputs: Option<NodeOutputs> = None;
        let mut laws: Vec<DraftLaws> = roots.iter().map(|_| DraftLaws::None).collect();
        let mut device_rows = 0;
        for level in buf.draft_levels() {
            // The expanded nodes' outputs: the root's, or those of this level's feed.
            let rows = if level.depth == 0 {
                debug_assert_eq!(level.expand, [0], "depth 0 expands the root alone");
                root_outputs(roots)?
            } else {
                let outputs = match &mut outputs {
                    Some(o) => o,
                    None => outputs.insert(NodeOutputs::new(roots, n)?),
                };
                let fed: Vec<usize> = (1..n)
                    .filter(|&i| buf.depths()[i] <= level.depth && !buf.is_leaf(i))
                    .collect();
                let want: Vec<usize> = level
                    .expand
                    .iter()
                    .map(|e| {
                        fed.iter()
                            .position(|f| f == e)
                            .expect("expanded nodes are fed")
                    })
                    .collect();
                let fed_tokens = tokens.feed(&fed)?;
                let feeds: Vec<TreeFeed> = roots
                    .iter()
                    .zip(fed_tokens.host)
                    .enumerate()
                    .map(|(tree, (r, tokens))| TreeFeed {
                        tree,
                        seq: r.seq,
                        committed: r.committed,
                        root_pos: r.root_pos,
                        nodes: fed.clone(),
                        tokens,
                        parents: fed.iter().map(|&i| buf.parents()[i].unwrap_or(0)).collect(),
                        depths: fed.iter().map(|&i| buf.depths()[i]).collect(),
                        want: want.clone(),
                    })
                    .collect();
                let out = feed_trees(
                    self.head,
                    self.base,
                    self.cache,
                    &feeds,
                    fed_tokens.device.as_ref(),
                    outputs,
                )?;
                outputs.set(&expanded(roots.len(), &level.expand), &out)?;
                out
            };
            // Children of every expanded node, sequence-major (row = s · expanded + j).
            let width = level.expand.len();
            let children = match choice {
                ChildChoice::TopK if pooled => {
                    Children::Device(self.best_tokens(&rows, level.top_k)?)
                }
                ChildChoice::TopK => Children::Host(
                    self.top_k(&rows, level.top_k)?
                        .into_iter()
                        .map(|(ids, _)| ids)
                        .collect(),
                ),
                ChildChoice::Sample(params) => {
                    let logits = self.logits(&rows)?;
                    Children::Host(if draws_on_device(&logits) {
                        let picked =
                            self.draw_on_device(&logits, width, level.top_k, params, rngs)?;
                        for (row, s) in (0..picked.len()).map(|r| (r, r / width)) {
                            let node = level.expand[row % width];
                            if !matches!(laws[s], DraftLaws::Device(_)) {
                                laws[s] = DraftLaws::Device(vec![None; n]);
                            }
                            if let DraftLaws::Device(at) = &mut laws[s] {
                                at[node] = Some((device_rows + row) as u32);
                            }
                        }
                        device_rows += picked.len();
                        self.device_laws.push(logits);
                        picked
                    } else {
                        let rows = logits.to_vec2::<f32>()?;
                        let mut picked = Vec::with_capacity(rows.len());
                        for (row, logits) in rows.iter().enumerate() {
                            let (s, node) = (row / width, level.expand[row % width]);
                            let q = sampling::probs(logits, params);
                            let columns = sample_without_replacement(&q, level.top_k, rngs[s]);
                            picked.push(columns.into_iter().map(|c| self.token(c)).collect());
                            if !matches!(laws[s], DraftLaws::Host(_)) {
                                laws[s] = DraftLaws::Host(vec![0f32; n * vocab]);
                            }
                            if let DraftLaws::Host(p) = &mut laws[s] {
                                // Tokens outside a draft vocabulary keep probability 0.
                                let p = &mut p[node * vocab..(node + 1) * vocab];
                                for (c, &qc) in q.iter().enumerate() {
                                    p[self.token(c as u32) as usize] = qc;
                                }
                            }
                        }
                        picked
                    })
                }
            };
            tokens.place(children, width, &level.picks)?;
        }
        let drafted = tokens.finish()?;
        Ok(DraftedTrees {
            trees: drafted
                .host
                .into_iter()
                .zip(laws)
                .map(|(tokens, draft_laws)| DraftedTree {
                    tokens,
                    buffers: Cow::Borrowed(buf),
                    draft_laws,
                })
                .collect(),
            device_tokens: drafted.device,
        })
    }

    /// `k` children of every row of a level's draft `logits` (`width` rows a sequence), drawn
    /// without replacement on the device (`kestrel_kernels::draw_children`) from uniforms taken
    /// ahead from copies of the sequences' streams, which then advance by the draws made, as
    /// [`sample_without_replacement`] draws on the host.
    fn draw_on_device(
        &self,
        logits: &Tensor,
        width: usize,
        k: usize,
        params: &SamplingParams,
        rngs: &mut [&mut SeqRng],
    ) -> Result<Vec<Vec<u32>>> {
        let uniforms: Vec<Vec<f32>> = rngs.iter().map(|rng| rng.peek_f32(width * k)).collect();
        let (columns, used) = kestrel_kernels::draw_children(
            logits,
            rngs.len(),
            width,
            k,
            &uniforms,
            params.temperature,
            params.top_k,
            params.top_p,
        )?;
        for (rng, used) in rngs.iter_mut().zip(used) {
            rng.skip(used);
        }
        Ok(columns
            .into_iter()
            .map(|row| row.into_iter().map(|c| self.token(c)).collect())
            .collect())
    }

    /// EAGLE-2: N drafts from the root, then `layers - 1` expansions of the best N frontier
    /// nodes by cumulative log-probability; the best `max_draft_len` candidates form the tree.
    pub fn draft_dynamic(
        &mut self,
        cfg: &DynamicTreeConfig,
        roots: &[DraftRoot],
    ) -> Result<DraftedTrees<'static>> {
        let bad = |e: kestrel_spec::DynamicTreeError| RuntimeError::InvalidRequest(e.to_string());
        let top = cfg.top_k;
        let mut builders = Vec::with_capacity(roots.len());
        // Node id 0 is the root; candidate c has node id c + 1. The buffer is for the
        // expansions: a one-layer tree drafts from the roots' outputs alone.
        let mut outputs = None;
        for (t, lp) in self.top_k(&root_outputs(roots)?, top)? {
            let mut b = DynamicTreeBuilder::new(*cfg).map_err(bad)?;
            b.push_root_layer(&t, &lp).map_err(bad)?;
            builders.push(b);
        }
        // Each level feeds every frontier expanded so far (each frontier node's parent is in
        // the previous one, so these hold its ancestors): N nodes a layer whatever the tree's
        // shape, one step layout a level that its CUDA graph replays. Kept in creation order,
        // the order an ancestors-only feed would have; a node attends to its ancestors alone.
        // A gated tree (`min_prob`) may leave a sequence nothing to expand: it is not fed,
        // and a level nobody has anything to expand is not run.
        let mut fed: Vec<Vec<usize>> = vec![Vec::new(); roots.len()];
        for _layer in 1..cfg.num_layers {
            if builders.iter().all(|b| b.frontier().is_empty()) {
                break;
            }
            let mut feeds = Vec::with_capacity(roots.len());
            for (tree, ((r, b), fed)) in roots.iter().zip(&builders).zip(&mut fed).enumerate() {
                if b.frontier().is_empty() {
                    continue;
                }
                fed.extend_from_slice(b.frontier());
                fed.sort_unstable();
                let cands = b.candidates();
                let want = b
                    .frontier()
                    .iter()
                    .map(|c| fed.binary_search(c).expect("the frontier is fed"))
                    .collect();
                feeds.push(TreeFeed {
                    tree,
                    seq: r.seq,
                    committed: r.committed,
                    root_pos: r.root_pos,
                    nodes: fed.iter().map(|&c| c + 1).collect(),
                    tokens: fed.iter().map(|&c| cands[c].token).collect(),
                    parents: fed
                        .iter()
                        .map(|&c| cands[c].parent.map_or(0, |p| p + 1))
                        .collect(),
                    depths: fed.iter().map(|&c| cands[c].depth).collect(),
                    want,
                });
            }
            let outputs = match &mut outputs {
                Some(o) => o,
                None => outputs.insert(NodeOutputs::new(roots, cfg.num_candidates() + 1)?),
            };
            let out = feed_trees(self.head, self.base, self.cache, &feeds, None, outputs)?;
            let mut ids_per_seq = Vec::with_capacity(roots.len());
            let mut frontier_nodes: Vec<NodeRef> = Vec::new();
            for (s, b) in builders.iter().enumerate() {
                let ids: Vec<usize> = b.frontier().iter().map(|&c| c + 1).collect();
                frontier_nodes.extend(ids.iter().map(|&id| (s, id)));
                ids_per_seq.push(ids);
            }
            outputs.set(&frontier_nodes, &out)?;
            let best = self.top_k(&out, top)?;
            let mut offset = 0;
            for (s, b) in builders.iter_mut().enumerate() {
                let k = ids_per_seq[s].len();
                let (mut toks, mut lps) =
                    (Vec::with_capacity(k * top), Vec::with_capacity(k * top));
                for (t, lp) in &best[offset..offset + k] {
                    toks.extend_from_slice(t);
                    lps.extend_from_slice(lp);
                }
                offset += k;
                b.push_layer(&toks, &lps).map_err(bad)?;
            }
        }
        let trees = builders
            .iter()
            .zip(roots)
            .map(|(b, r)| {
                let tree = b.finish(r.token).map_err(bad)?;
                let buffers = tree.buffers().clone();
                Ok(DraftedTree {
                    tokens: tree.tokens,
                    buffers: Cow::Owned(buffers),
                    draft_laws: DraftLaws::None,
                })
            })
            .collect::<Result<_>>()?;
        Ok(DraftedTrees {
            trees,
            device_tokens: None,
        })
    }
}

/// The roots' outputs, `[roots, hidden]` (one root's is its own tensor, with no copy).
pub(super) fn root_outputs(roots: &[DraftRoot]) -> Result<Tensor> {
    Ok(match roots {
        [one] => one.output.clone(),
        _ => Tensor::cat(&roots.iter().map(|r| &r.output).collect::<Vec<_>>(), 0)?,
    })
}

/// The same nodes of every one of `trees` trees, tree-major.
fn expanded(trees: usize, nodes: &[usize]) -> Vec<NodeRef> {
    (0..trees)
        .flat_map(|s| nodes.iter().map(move |&n| (s, n)))
        .collect()
}

/// k distinct tokens drawn without replacement from `q`; once q is exhausted the rest repeat
/// the first draw (never reached by exact acceptance, which stops when q is used up).
fn sample_without_replacement(q: &[f32], k: usize, rng: &mut SeqRng) -> Vec<u32> {
    let mut q = q.to_vec();
    let mut out = Vec::with_capacity(k);
    for _ in 0..k {
        if q.iter().all(|&x| x <= 0.0) {
            let filler = out.first().copied().unwrap_or(0);
            out.push(filler);
            continue;
        }
        let t = sampling::sample(&q, rng);
        q[t as usize] = 0.0;
        out.push(t);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_without_replacement_gives_distinct_tokens() {
        let mut rng = SeqRng::new(7, 0);
        let picked = sample_without_replacement(&[0.1, 0.2, 0.3, 0.4], 4, &mut rng);
        let mut sorted = picked.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 1, 2, 3]);
    }
}
