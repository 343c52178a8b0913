//! CUDA graphs of a model's steps: one captured graph per step layout ([`GraphLayout`]: the
//! batch's shape, not its values), replayed with new inputs uploaded in place.
//!
//! The first steps of a layout run eagerly. On its third (`CAPTURE_AFTER`), the eager run
//! also fills candle's cache of the small constant uploads its ops make, and the same
//! computation is then captured, writing its result into a buffer the graph owns. Later steps of that layout upload their packed inputs (two
//! copies), launch the graph and copy the result out, so the caller may keep it across steps.
//! A graph writes the KV pools it was captured with, so the graphs are dropped whenever the
//! model is run over another cache. A failed capture turns graphs off for the model (its step
//! still returns the eager result), and the reason is kept for reporting.

use crate::error::Result;
use crate::step::{GraphInputs, GraphLayout, Step};
use candle_core::{DType, Device, Tensor, TensorId};
use kestrel_kernels::{GraphArena, StepGraph};
use std::collections::HashMap;
use std::sync::Mutex;

/// Graphs kept per model. Once that many are held, further layouts run eagerly: layouts
/// recur in proportion to how common they are, so the first to be captured are the ones worth
/// keeping, and starting over would recapture them again and again (a batch of EAGLE
/// sequences, each feeding its own number of accepted tokens, has hundreds of layouts).
const MAX_GRAPHS: usize = 128;

/// A layout is captured on its this-many-th step: capturing costs a few eager steps, which
/// layouts seen once or twice (a feed of an unusual number of accepted tokens) never repay.
const CAPTURE_AFTER: u32 = 3;

struct Captured {
    graph: StepGraph,
    u32s: Tensor,
    f32s: Tensor,
    /// The buffer a device-side input is copied into before each replay.
    input: Option<Tensor>,
    out: Tensor,
}

/// What a model's step graphs have done since it was loaded: for reports, and to tell a run
/// that replays its graphs from one that keeps capturing new ones.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GraphActivity {
    /// Graphs captured.
    pub captures: u64,
    /// Wall time of those captures, including the eager step each one repeats.
    pub capture_s: f64,
    /// Steps that replayed a graph.
    pub replays: u64,
    /// Times every graph was dropped because the model moved to another KV cache.
    pub cache_changes: u64,
}

impl std::ops::Add for GraphActivity {
    type Output = GraphActivity;
    fn add(self, o: GraphActivity) -> GraphActivity {
        GraphActivity {
            captures: self.captures + o.captures,
            capture_s: self.capture_s + o.capture_s,
            replays: self.replays + o.replays,
            cache_changes: self.cache_changes + o.cache_changes,
        }
    }
}

#[derive(Default)]
struct Graphs {
    enabled: bool,
    activity: GraphActivity,
    /// Why capturing failed, which turned graphs off.
    failure: Option<String>,
    /// The KV cache the graphs write (its first K pool).
    cache: Option<TensorId>,
    entries: HashMap<GraphLayout, Captured>,
    /// Steps seen per layout not captured yet.
    seen: HashMap<GraphLayout, u32>,
    /// Where the captured steps keep their activations.
    arena: GraphArena,
}

/// A model's step graphs. Cloning a model gives the clone none of them (they write the
/// original's buffers).
#[derive(Default)]
pub(crate) struct StepGraphs(Mutex<Graphs>);

impl Clone for StepGraphs {
    fn clone(&self) -> Self {
        let enabled = self.lock().enabled;
        let graphs = StepGraphs::default();
        graphs.set_enabled(enabled);
        graphs
    }
}

impl std::fmt::Debug for StepGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.lock();
        write!(f, "StepGraphs({} captured)", g.entries.len())
    }
}

impl StepGraphs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Graphs> {
        // A panic while holding the lock leaves at worst a missing graph: keep going.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_enabled(&self, enabled: bool) {
        let mut g = self.lock();
        g.enabled = enabled;
        if !enabled {
            g.entries.clear();
            g.seen.clear();
            g.arena = GraphArena::default();
        }
    }

    /// On, and no capture has failed.
    pub fn active(&self) -> bool {
        let g = self.lock();
        g.enabled && g.failure.is_none()
    }

    pub fn failure(&self) -> Option<String> {
        self.lock().failure.clone()
    }

    /// Captured graphs held now.
    pub fn count(&self) -> usize {
        self.lock().entries.len()
    }

    /// What moving each captured step's allocations into the arena did (graphs captured with
    /// the driver's pool instead have none).
    pub fn relocations(&self) -> Vec<kestrel_kernels::RelocationStats> {
        let g = self.lock();
        g.entries
            .values()
            .filter_map(|c| c.graph.relocation())
            .collect()
    }

    /// Device bytes of the arena the captured steps keep their activations in.
    pub fn arena_bytes(&self) -> usize {
        self.lock().arena.bytes()
    }

    pub fn activity(&self) -> GraphActivity {
        self.lock().activity
    }

    /// `compute(ids, step, input)` over `inputs` and an optional device tensor `input` (its
    /// shape fixed by the layout), through the graph of their layout when there is one (else
    /// eagerly, capturing the layout once it recurs); `cache`: the KV cache's identity.
    /// `device_ids` (u32 `[n_tok]`), when given, are the step's token ids: they overwrite the
    /// placeholders at the head of `inputs.u32s` on the device, so ids that never left it
    /// (drafted tokens) need no round trip through the host.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        cache: TensorId,
        inputs: &GraphInputs,
        device_ids: Option<&Tensor>,
        input: Option<&Tensor>,
        dtype: DType,
        device: &Device,
        compute: impl Fn(&Tensor, &Step, Option<&Tensor>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let mut g = self.lock();
        if g.cache != Some(cache) {
            if g.cache.is_some() && !g.entries.is_empty() {
                g.activity.cache_changes += 1;
            }
            g.entries.clear();
            g.seen.clear();
            g.cache = Some(cache);
        }
        let graphs = &mut *g;
        if let Some(c) = graphs.entries.get_mut(&inputs.layout) {
            kestrel_kernels::upload_into(&c.u32s, 0, &inputs.u32s)?;
            place_ids(&c.u32s, device_ids)?;
            kestrel_kernels::upload_into(&c.f32s, 0, &inputs.f32s)?;
            if let (Some(buf), Some(x)) = (&c.input, input) {
                buf.slice_set(&x.contiguous()?, 0, 0)?;
            }
            c.graph.launch()?;
            graphs.activity.replays += 1;
            return Ok(c.out.copy()?);
        }
        let layout = inputs.layout;
        if g.seen.len() > 16 * MAX_GRAPHS {
            g.seen.clear();
        }
        let seen = g.seen.entry(layout).or_insert(0);
        *seen += 1;
        if *seen < CAPTURE_AFTER || g.entries.len() >= MAX_GRAPHS {
            drop(g);
            return eager(inputs, device_ids, input, dtype, device, &compute);
        }
        g.seen.remove(&layout);
        let started = std::time::Instant::now();
        let (u32s, f32s) = upload(inputs, device_ids, device)?;
        let input = match input {
            Some(x) => Some(x.copy()?),
            None => None,
        };
        let run = || -> Result<Tensor> {
            let (ids, step) = layout.step(&u32s, &f32s, dtype)?;
            compute(&ids, &step, input.as_ref())
        };
        let out = kestrel_kernels::with_upload_cache(device, run)??;
        let kept = out.zeros_like()?;
        let captured = kestrel_kernels::capture(device, &mut g.arena, || {
            kept.slice_set(&run()?, 0, 0)?;
            Ok::<(), crate::error::ModelError>(())
        });
        match captured {
            Ok((graph, ())) => {
                g.activity.captures += 1;
                g.activity.capture_s += started.elapsed().as_secs_f64();
                g.entries.insert(
                    layout,
                    Captured {
                        graph,
                        u32s,
                        f32s,
                        input,
                        out: kept,
                    },
                );
            }
            Err(e) => {
                g.entries.clear();
                g.failure = Some(e.to_string());
            }
        }
        Ok(out)
    }
}

fn upload(
    inputs: &GraphInputs,
    device_ids: Option<&Tensor>,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let u32s = Tensor::from_slice(&inputs.u32s, inputs.u32s.len(), device)?;
    place_ids(&u32s, device_ids)?;
    Ok((
        u32s,
        Tensor::from_slice(&inputs.f32s, inputs.f32s.len(), device)?,
    ))
}

/// Copies `device_ids` over the token-id placeholders that open a step's `u32s`.
fn place_ids(u32s: &Tensor, device_ids: Option<&Tensor>) -> Result<()> {
    if let Some(ids) = device_ids {
        u32s.slice_set(&ids.contiguous()?, 0, 0)?;
    }
    Ok(())
}

/// The step without a graph, from the same packed inputs.
fn eager(
    inputs: &GraphInputs,
    device_ids: Option<&Tensor>,
    input: Option<&Tensor>,
    dtype: DType,
    device: &Device,
    compute: &impl Fn(&Tensor, &Step, Option<&Tensor>) -> Result<Tensor>,
) -> Result<Tensor> {
    let (u32s, f32s) = upload(inputs, device_ids, device)?;
    let (ids, step) = inputs.layout.step(&u32s, &f32s, dtype)?;
    compute(&ids, &step, input)
}
