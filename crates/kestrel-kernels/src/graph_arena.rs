//! A captured step's allocations moved into one buffer that its model's graphs share, so that
//! replaying a step takes no memory from the driver's graph pool.
//!
//! Why: candle's ops allocate their outputs, so a captured step is full of allocation and free
//! nodes. At replay the driver serves those from its graph memory pool, which reserves 32 MiB
//! at a time: on SmolLM2 that is 12% of the weights, for well under 1 MiB of activations, and
//! the difference between issue 6's memory bound and missing it. After capture,
//! `relocate` gives every allocation an offset in an arena (allocations live at the same
//! time never share bytes) and copies the graph without its allocation and free nodes, each
//! kernel, memset and memcpy node that used one pointed at its place in the arena and each
//! node that followed a removed one made to depend on that node's predecessors, so the order
//! of everything else is unchanged. Those joins are full dependencies, except that a Kestrel
//! kernel after a kernel gets a programmatic one under dependent launch: every Kestrel kernel
//! waits for its predecessor (`griddepcontrol.wait`) before it reads anything but weights, and
//! the capture itself made no such edge, since an allocation sat between every two kernels.
//!
//! The planning ([`plan_offsets`], [`Allocation::place`], [`relocate_words`]) is plain
//! arithmetic, tested without a GPU; the graph surgery needs CUDA.

// Without CUDA only the tests use the planning: it is compiled anyway so that CI tests it.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Offsets in the arena are multiples of this, like `cudaMalloc`'s addresses, so that an
/// address keeps its alignment for vector loads.
pub const ARENA_ALIGN: u64 = 256;

/// One allocation of a captured step: its device range when captured, and where in the
/// step's order it is allocated and freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub start: u64,
    pub bytes: u64,
    /// Positions of the allocation and free nodes in the step's order.
    pub alloc: usize,
    pub free: usize,
}

impl Allocation {
    /// Whether the two are live at the same time (so may not share bytes).
    pub fn overlaps_in_time(&self, other: &Allocation) -> bool {
        !(self.free < other.alloc || other.free < self.alloc)
    }

    /// The relocated address of `address` used by the node at `position`, when it points into
    /// this allocation while the allocation is live.
    pub fn place(&self, address: u64, position: usize, offset: u64, base: u64) -> Option<u64> {
        let inside = address >= self.start && address < self.start + self.bytes;
        let live = self.alloc < position && position < self.free;
        (inside && live).then(|| base + offset + (address - self.start))
    }
}

/// An arena offset for each allocation and the arena's size: each allocation, in the order it
/// is allocated, takes the lowest aligned offset where it overlaps none of those already placed
/// that are live at the same time.
pub fn plan_offsets(allocs: &[Allocation]) -> (Vec<u64>, u64) {
    let mut order: Vec<usize> = (0..allocs.len()).collect();
    order.sort_by_key(|&i| allocs[i].alloc);
    let size = |i: usize| allocs[i].bytes.max(1).div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
    let mut offsets = vec![0u64; allocs.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(allocs.len());
    let mut total = 0u64;
    for &i in &order {
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&j| allocs[j].overlaps_in_time(&allocs[i]))
            .map(|&j| (offsets[j], offsets[j] + size(j)))
            .collect();
        busy.sort_unstable();
        let mut offset = 0u64;
        for (start, end) in busy {
            if offset + size(i) <= start {
                break;
            }
            offset = offset.max(end);
        }
        offsets[i] = offset;
        total = total.max(offset + size(i));
        placed.push(i);
    }
    (offsets, total)
}

/// Rewrites, in a kernel parameter's bytes, every 8-byte-aligned word that `relocate` maps
/// (device addresses, alone or inside a struct passed by value); returns whether any changed.
pub fn relocate_words<E>(
    bytes: &mut [u8],
    mut relocate: impl FnMut(u64) -> Result<Option<u64>, E>,
) -> Result<bool, E> {
    let mut changed = false;
    for word in bytes.chunks_exact_mut(8) {
        let value = u64::from_ne_bytes(word.try_into().expect("chunks of 8"));
        if let Some(new) = relocate(value)? {
            word.copy_from_slice(&new.to_ne_bytes());
            changed = true;
        }
    }
    Ok(changed)
}

/// What moving a captured step's allocations into its arena did, for tests and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelocationStats {
    /// Nodes of the captured graph.
    pub nodes: usize,
    /// Allocation nodes moved into the arena (each with its free node, both left out of the
    /// copy that is instantiated).
    pub allocations: usize,
    /// The arena bytes the step needs.
    pub arena_bytes: u64,
    /// Kernel, memset and memcpy nodes pointed into the arena.
    pub nodes_rewritten: usize,
    /// Edges between kernels that let the second start before the first ends
    /// (programmatic dependent launch), before and after the surgery.
    pub programmatic_edges: (usize, usize),
    /// Edges that join a removed node's neighbours in the copy: full, programmatic.
    pub joined_edges: (usize, usize),
}

/// The nodes in dependency order when each depends on the one before it (what capturing
/// one stream gives), else None. `incoming[i]`: node i's predecessors (and edge data).
pub fn chain_order<D>(incoming: &[Vec<(usize, D)>]) -> Option<Vec<usize>> {
    let n = incoming.len();
    let mut indegree: Vec<usize> = incoming.iter().map(Vec::len).collect();
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut pairs = std::collections::HashSet::new();
    for (t, from) in incoming.iter().enumerate() {
        for (f, _) in from {
            next[*f].push(t);
            pairs.insert((*f, t));
        }
    }
    let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop() {
        order.push(i);
        for &t in &next[i] {
            indegree[t] -= 1;
            if indegree[t] == 0 {
                ready.push(t);
            }
        }
    }
    let chain = order.len() == n && order.windows(2).all(|w| pairs.contains(&(w[0], w[1])));
    chain.then_some(order)
}

/// Node `i`'s predecessors once the `removed` nodes are gone: a kept predecessor with its
/// edge's data, a removed one replaced by its own predecessors (recursively) with None, to be
/// joined by a full dependency, as the removed node waited for them. A node reached both
/// ways is joined.
pub fn joined_predecessors<D: Copy>(
    incoming: &[Vec<(usize, D)>],
    removed: &[bool],
    i: usize,
) -> Vec<(usize, Option<D>)> {
    let mut deps: Vec<(usize, Option<D>)> = Vec::new();
    let mut stack: Vec<(usize, Option<D>)> =
        incoming[i].iter().map(|&(p, d)| (p, Some(d))).collect();
    let mut walked = std::collections::HashSet::new();
    while let Some((p, d)) = stack.pop() {
        if !removed[p] {
            match deps.iter_mut().find(|(q, _)| *q == p) {
                Some(entry) if d.is_none() => entry.1 = None,
                Some(_) => {}
                None => deps.push((p, d)),
            }
        } else if walked.insert(p) {
            stack.extend(incoming[p].iter().map(|&(pp, _)| (pp, None)));
        }
    }
    deps.sort_by_key(|(p, _)| *p);
    deps
}

#[cfg(feature = "cuda")]
pub(crate) use surgery::relocate;

#[cfg(feature = "cuda")]
mod surgery {
    //! The driver allows no node of a graph holding allocation nodes to be removed, so the
    //! step is copied, node by node in its order, into a new graph without them.

    use super::{chain_order, joined_predecessors, plan_offsets, relocate_words};
    use super::{Allocation, RelocationStats};
    use candle_core::cuda::cudarc::driver::sys::{
        self, CUgraph, CUgraphEdgeData, CUgraphNode, CUgraphNodeType, CUresult,
    };
    use candle_core::{bail, Result};
    use std::collections::HashMap;
    use CUgraphNodeType::*;

    fn check(r: CUresult, what: &str) -> Result<()> {
        match r {
            CUresult::CUDA_SUCCESS => Ok(()),
            e => bail!("CUDA graph surgery: {what} failed: {e:?}"),
        }
    }

    /// An edge of a graph: from, to, and its kind.
    type Edge = (CUgraphNode, CUgraphNode, CUgraphEdgeData);

    /// The graph's nodes and edges.
    unsafe fn nodes_and_edges(graph: CUgraph) -> Result<(Vec<CUgraphNode>, Vec<Edge>)> {
        let mut n = 0usize;
        check(
            sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n),
            "listing nodes",
        )?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        check(
            sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n),
            "listing nodes",
        )?;
        nodes.truncate(n);
        let mut e = 0usize;
        let (no_nodes, no_data) = (std::ptr::null_mut(), std::ptr::null_mut());
        check(
            sys::cuGraphGetEdges_v2(graph, no_nodes, no_nodes, no_data, &mut e),
            "listing edges",
        )?;
        let mut from = vec![std::ptr::null_mut(); e];
        let mut to = vec![std::ptr::null_mut(); e];
        let mut data = vec![std::mem::zeroed::<CUgraphEdgeData>(); e];
        check(
            sys::cuGraphGetEdges_v2(
                graph,
                from.as_mut_ptr(),
                to.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut e,
            ),
            "listing edges",
        )?;
        let edges = (0..e).map(|i| (from[i], to[i], data[i])).collect();
        Ok((nodes, edges))
    }

    unsafe fn node_type(node: CUgraphNode) -> Result<CUgraphNodeType> {
        let mut t = CU_GRAPH_NODE_TYPE_EMPTY;
        check(
            sys::cuGraphNodeGetType(node, &mut t),
            "reading a node's type",
        )?;
        Ok(t)
    }

    /// Byte sizes of a kernel's parameters, in order.
    unsafe fn param_sizes(params: &sys::CUDA_KERNEL_NODE_PARAMS) -> Result<Vec<usize>> {
        let mut sizes = Vec::new();
        loop {
            let (mut offset, mut size) = (0usize, 0usize);
            let r = if !params.func.is_null() {
                sys::cuFuncGetParamInfo(params.func, sizes.len(), &mut offset, &mut size)
            } else {
                sys::cuKernelGetParamInfo(params.kern, sizes.len(), &mut offset, &mut size)
            };
            match r {
                CUresult::CUDA_SUCCESS => sizes.push(size),
                CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(sizes),
                e => bail!("CUDA graph surgery: reading a kernel's parameters failed: {e:?}"),
            }
        }
    }

    /// A graph being built, destroyed unless handed over.
    struct Building(CUgraph);

    impl Drop for Building {
        fn drop(&mut self) {
            if !self.0.is_null() {
                // SAFETY: a graph this module created, destroyed once.
                unsafe { sys::cuGraphDestroy(self.0) };
            }
        }
    }

    /// Copies kernel `node` into `graph`, parameters relocated, launch attributes kept;
    /// returns the copy and whether any parameter moved.
    unsafe fn copy_kernel(
        graph: CUgraph,
        node: CUgraphNode,
        mut relocate: impl FnMut(u64) -> Result<Option<u64>>,
    ) -> Result<(CUgraphNode, bool)> {
        let mut params = std::mem::zeroed::<sys::CUDA_KERNEL_NODE_PARAMS>();
        check(
            sys::cuGraphKernelNodeGetParams_v2(node, &mut params),
            "reading a kernel node",
        )?;
        if params.kernelParams.is_null() {
            bail!("CUDA graph surgery: a captured kernel passes its parameters as `extra`");
        }
        let mut values: Vec<Vec<u8>> = Vec::new();
        let mut changed = false;
        for (i, size) in param_sizes(&params)?.into_iter().enumerate() {
            let src = *params.kernelParams.add(i) as *const u8;
            let mut bytes = std::slice::from_raw_parts(src, size).to_vec();
            changed |= relocate_words(&mut bytes, &mut relocate)?;
            values.push(bytes);
        }
        let mut pointers: Vec<*mut std::ffi::c_void> =
            values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        params.kernelParams = pointers.as_mut_ptr();
        params.extra = std::ptr::null_mut();
        let mut copy = std::ptr::null_mut();
        check(
            sys::cuGraphAddKernelNode_v2(&mut copy, graph, std::ptr::null(), 0, &params),
            "copying a kernel node",
        )?;
        check(
            sys::cuGraphKernelNodeCopyAttributes(copy, node),
            "copying a kernel's attributes",
        )?;
        Ok((copy, changed))
    }

    unsafe fn copy_memset(
        graph: CUgraph,
        node: CUgraphNode,
        ctx: sys::CUcontext,
        mut relocate: impl FnMut(u64) -> Result<Option<u64>>,
    ) -> Result<(CUgraphNode, bool)> {
        let mut p = std::mem::zeroed::<sys::CUDA_MEMSET_NODE_PARAMS>();
        check(
            sys::cuGraphMemsetNodeGetParams(node, &mut p),
            "reading a memset node",
        )?;
        let moved = relocate(p.dst)?;
        p.dst = moved.unwrap_or(p.dst);
        let mut copy = std::ptr::null_mut();
        check(
            sys::cuGraphAddMemsetNode(&mut copy, graph, std::ptr::null(), 0, &p, ctx),
            "copying a memset node",
        )?;
        Ok((copy, moved.is_some()))
    }

    unsafe fn copy_memcpy(
        graph: CUgraph,
        node: CUgraphNode,
        ctx: sys::CUcontext,
        mut relocate: impl FnMut(u64) -> Result<Option<u64>>,
    ) -> Result<(CUgraphNode, bool)> {
        use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED};
        let mut p = std::mem::zeroed::<sys::CUDA_MEMCPY3D>();
        check(
            sys::cuGraphMemcpyNodeGetParams(node, &mut p),
            "reading a memcpy node",
        )?;
        let device = |t| t == CU_MEMORYTYPE_DEVICE || t == CU_MEMORYTYPE_UNIFIED;
        let mut changed = false;
        if device(p.srcMemoryType) {
            if let Some(src) = relocate(p.srcDevice)? {
                p.srcDevice = src;
                changed = true;
            }
        }
        if device(p.dstMemoryType) {
            if let Some(dst) = relocate(p.dstDevice)? {
                p.dstDevice = dst;
                changed = true;
            }
        }
        let mut copy = std::ptr::null_mut();
        check(
            sys::cuGraphAddMemcpyNode(&mut copy, graph, std::ptr::null(), 0, &p, ctx),
            "copying a memcpy node",
        )?;
        Ok((copy, changed))
    }

    /// Copies a node that touches no memory: empty, event record or event wait.
    unsafe fn copy_plain(
        graph: CUgraph,
        node: CUgraphNode,
        kind: CUgraphNodeType,
    ) -> Result<CUgraphNode> {
        let mut copy = std::ptr::null_mut();
        let none = std::ptr::null();
        let mut event = std::ptr::null_mut();
        match kind {
            CU_GRAPH_NODE_TYPE_EMPTY => check(
                sys::cuGraphAddEmptyNode(&mut copy, graph, none, 0),
                "copying an empty node",
            )?,
            CU_GRAPH_NODE_TYPE_EVENT_RECORD => {
                check(
                    sys::cuGraphEventRecordNodeGetEvent(node, &mut event),
                    "reading an event node",
                )?;
                check(
                    sys::cuGraphAddEventRecordNode(&mut copy, graph, none, 0, event),
                    "copying an event node",
                )?
            }
            CU_GRAPH_NODE_TYPE_WAIT_EVENT => {
                check(
                    sys::cuGraphEventWaitNodeGetEvent(node, &mut event),
                    "reading an event node",
                )?;
                check(
                    sys::cuGraphAddEventWaitNode(&mut copy, graph, none, 0, event),
                    "copying an event node",
                )?
            }
            other => bail!(
                "CUDA graph surgery: a captured step holds a {other:?} node, which it cannot copy"
            ),
        }
        Ok(copy)
    }

    /// Whether `node` is one of Kestrel's kernels, all of which wait for their predecessor
    /// (`griddepcontrol.wait`) before they touch anything but weights.
    unsafe fn is_kestrel_kernel(node: CUgraphNode) -> Result<bool> {
        if node_type(node)? != CU_GRAPH_NODE_TYPE_KERNEL {
            return Ok(false);
        }
        let mut params = std::mem::zeroed::<sys::CUDA_KERNEL_NODE_PARAMS>();
        check(
            sys::cuGraphKernelNodeGetParams_v2(node, &mut params),
            "reading a kernel node",
        )?;
        if params.func.is_null() {
            return Ok(false);
        }
        let mut name: *const std::ffi::c_char = std::ptr::null();
        check(
            sys::cuFuncGetName(&mut name, params.func),
            "reading a kernel's name",
        )?;
        Ok(!name.is_null()
            && std::ffi::CStr::from_ptr(name)
                .to_bytes()
                .starts_with(b"kestrel_"))
    }

    fn is_programmatic(data: &CUgraphEdgeData) -> bool {
        data.type_ == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8
    }

    /// A copy of `graph` without its allocation and free nodes: every allocation placed in an
    /// arena of the returned stats' `arena_bytes`, whose device address `arena` gives once it
    /// knows the size, and every node that used one pointed there. A node that depended on a
    /// removed one depends on that node's predecessors instead (the capture's order, and the
    /// completion an allocation waited for, kept): fully, or, under `dependent_launch`, a
    /// Kestrel kernel after a kernel programmatically. Returns None (the graph to be
    /// used as it is) when its nodes do not form a chain, where allocations' lifetimes are not
    /// a simple order; capturing one stream always gives a chain. `dependent_launch`: whether
    /// the step's kernels were launched with programmatic dependent launch (Hopper, on).
    ///
    /// # Safety
    /// `graph` is a valid graph of the current context; the arena `arena` returns must
    /// outlive every instantiation of the copy.
    pub(crate) unsafe fn relocate(
        graph: CUgraph,
        dependent_launch: bool,
        arena: impl FnOnce(u64) -> Result<u64>,
    ) -> Result<Option<(CUgraph, RelocationStats)>> {
        let (nodes, edges) = nodes_and_edges(graph)?;
        let index: HashMap<CUgraphNode, usize> =
            nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut incoming: Vec<Vec<(usize, CUgraphEdgeData)>> = vec![Vec::new(); nodes.len()];
        for (f, t, d) in &edges {
            incoming[index[t]].push((index[f], *d));
        }
        let Some(order) = chain_order(&incoming) else {
            return Ok(None);
        };
        let programmatic_before = edges.iter().filter(|e| is_programmatic(&e.2)).count();
        let mut stats = RelocationStats {
            nodes: nodes.len(),
            ..Default::default()
        };
        let kinds = nodes
            .iter()
            .map(|&n| node_type(n))
            .collect::<Result<Vec<_>>>()?;
        let mut position = vec![0usize; nodes.len()];
        let mut allocs: Vec<Allocation> = Vec::new();
        let mut open: HashMap<u64, usize> = HashMap::new();
        let mut removed = vec![false; nodes.len()];
        for (at, &i) in order.iter().enumerate() {
            position[i] = at;
            match kinds[i] {
                CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
                    let mut p = std::mem::zeroed::<sys::CUDA_MEM_ALLOC_NODE_PARAMS>();
                    check(
                        sys::cuGraphMemAllocNodeGetParams(nodes[i], &mut p),
                        "reading an allocation",
                    )?;
                    open.insert(p.dptr, allocs.len());
                    allocs.push(Allocation {
                        start: p.dptr,
                        bytes: p.bytesize as u64,
                        alloc: at,
                        free: usize::MAX,
                    });
                    removed[i] = true;
                }
                CU_GRAPH_NODE_TYPE_MEM_FREE => {
                    let mut dptr = 0u64;
                    check(
                        sys::cuGraphMemFreeNodeGetParams(nodes[i], &mut dptr),
                        "reading a free",
                    )?;
                    let Some(a) = open.remove(&dptr) else {
                        bail!("a captured step frees memory allocated before its capture (a tensor made outside the step dropped inside it)")
                    };
                    allocs[a].free = at;
                    removed[i] = true;
                }
                _ => {}
            }
        }
        if !open.is_empty() {
            bail!("a captured step keeps {} allocation(s) past its end (a tensor made inside the step outlives it)", open.len());
        }
        stats.allocations = allocs.len();
        let (offsets, bytes) = plan_offsets(&allocs);
        stats.arena_bytes = bytes;
        let base = if bytes > 0 { arena(bytes)? } else { 0 };
        let mut ctx = std::ptr::null_mut();
        check(
            sys::cuCtxGetCurrent(&mut ctx),
            "reading the current context",
        )?;
        let mut copy = Building(std::ptr::null_mut());
        check(sys::cuGraphCreate(&mut copy.0, 0), "creating a graph")?;
        // A Kestrel kernel joined to a kernel across a removed node keeps dependent launch
        // where its launch asked for it. The edge is built here: the capture makes none where
        // an allocation sits between two kernels, which is before every Kestrel kernel (its
        // output is allocated just before it launches), so in graphs dependent launch only
        // takes effect through these joins.
        let join_as = dependent_launch.then(|| {
            let mut data = std::mem::zeroed::<CUgraphEdgeData>();
            data.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
            data.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
            data
        });
        let mut copies: Vec<CUgraphNode> = vec![std::ptr::null_mut(); nodes.len()];
        for &i in &order {
            if removed[i] {
                continue;
            }
            let at = position[i];
            let relocate = |address: u64| -> Result<Option<u64>> {
                let mut inside = false;
                for (a, &offset) in allocs.iter().zip(&offsets) {
                    if let Some(new) = a.place(address, at, offset, base) {
                        return Ok(Some(new));
                    }
                    inside |= address >= a.start && address < a.start + a.bytes;
                }
                if inside {
                    bail!("a captured step uses memory outside the lifetime of its allocation");
                }
                Ok(None)
            };
            let (node, rewritten) = match kinds[i] {
                CU_GRAPH_NODE_TYPE_KERNEL => copy_kernel(copy.0, nodes[i], relocate)?,
                CU_GRAPH_NODE_TYPE_MEMSET => copy_memset(copy.0, nodes[i], ctx, relocate)?,
                CU_GRAPH_NODE_TYPE_MEMCPY => copy_memcpy(copy.0, nodes[i], ctx, relocate)?,
                kind => (copy_plain(copy.0, nodes[i], kind)?, false),
            };
            stats.nodes_rewritten += rewritten as usize;
            copies[i] = node;
            let deps = joined_predecessors(&incoming, &removed, i);
            for (p, d) in deps {
                let data = match d {
                    Some(d) => d,
                    None => match join_as {
                        Some(j)
                            if kinds[p] == CU_GRAPH_NODE_TYPE_KERNEL
                                && is_kestrel_kernel(nodes[i])? =>
                        {
                            stats.joined_edges.1 += 1;
                            j
                        }
                        _ => {
                            stats.joined_edges.0 += 1;
                            std::mem::zeroed()
                        }
                    },
                };
                check(
                    sys::cuGraphAddDependencies_v2(copy.0, &copies[p], &node, &data, 1),
                    "adding a dependency",
                )?;
            }
        }
        let (_, new_edges) = nodes_and_edges(copy.0)?;
        stats.programmatic_edges = (
            programmatic_before,
            new_edges.iter().filter(|e| is_programmatic(&e.2)).count(),
        );
        let graph = std::mem::replace(&mut copy.0, std::ptr::null_mut());
        Ok(Some((graph, stats)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(start: u64, bytes: u64, alloc: usize, free: usize) -> Allocation {
        Allocation {
            start,
            bytes,
            alloc,
            free,
        }
    }

    /// No two allocations live at the same time share a byte, whatever the order.
    fn assert_disjoint(allocs: &[Allocation], offsets: &[u64], total: u64) {
        for (i, a) in allocs.iter().enumerate() {
            assert_eq!(offsets[i] % ARENA_ALIGN, 0);
            assert!(offsets[i] + a.bytes <= total);
            for (j, b) in allocs.iter().enumerate().skip(i + 1) {
                if a.overlaps_in_time(b) {
                    let apart =
                        offsets[i] + a.bytes <= offsets[j] || offsets[j] + b.bytes <= offsets[i];
                    assert!(
                        apart,
                        "{a:?} at {} and {b:?} at {} share bytes",
                        offsets[i], offsets[j]
                    );
                }
            }
        }
    }

    #[test]
    fn a_chain_of_steps_reuses_what_each_freed() {
        // x → y → z, each freed once the next is made: two buffers' worth at any time.
        let allocs = [
            alloc(0x1000, 1000, 0, 3),
            alloc(0x9000, 1000, 2, 5),
            alloc(0x1000, 1000, 4, 7),
        ];
        let (offsets, total) = plan_offsets(&allocs);
        assert_eq!(offsets, vec![0, 1024, 0]);
        assert_eq!(total, 2048);
        assert_disjoint(&allocs, &offsets, total);
    }

    #[test]
    fn allocations_live_together_get_their_own_aligned_ranges() {
        let allocs = [
            alloc(0, 1, 0, 10),
            alloc(256, 300, 1, 10),
            alloc(1024, 256, 2, 10),
        ];
        let (offsets, total) = plan_offsets(&allocs);
        assert_eq!(offsets, vec![0, 256, 768]);
        assert_eq!(total, 1024);
    }

    #[test]
    fn a_freed_gap_takes_the_next_allocation_that_fits() {
        // a and c stay; b is freed before d: d fits b's gap, e (bigger) goes past c.
        let allocs = [
            alloc(0, 256, 0, 20),
            alloc(1, 512, 1, 4),
            alloc(2, 256, 2, 20),
            alloc(3, 512, 5, 20),
            alloc(4, 1024, 6, 20),
        ];
        let (offsets, total) = plan_offsets(&allocs);
        assert_eq!(offsets, vec![0, 256, 768, 256, 1024]);
        assert_eq!(total, 2048);
        assert_disjoint(&allocs, &offsets, total);
    }

    #[test]
    fn many_random_lifetimes_never_share_live_bytes() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        };
        for _ in 0..50 {
            let allocs: Vec<Allocation> = (0..60)
                .map(|i| {
                    let at = i * 3;
                    alloc(
                        next(1 << 20),
                        1 + next(5000),
                        at,
                        at + 1 + next(40) as usize,
                    )
                })
                .collect();
            let (offsets, total) = plan_offsets(&allocs);
            assert_disjoint(&allocs, &offsets, total);
            let sum: u64 = allocs
                .iter()
                .map(|a| a.bytes.div_ceil(ARENA_ALIGN) * ARENA_ALIGN)
                .sum();
            assert!(total <= sum);
        }
    }

    #[test]
    fn an_address_moves_only_while_its_allocation_is_live() {
        // The driver may give two allocations of one graph the same addresses when their
        // lifetimes do not overlap; a node's position says which one it means.
        let first = alloc(0x7000, 512, 1, 4);
        let second = alloc(0x7000, 512, 5, 9);
        assert_eq!(first.place(0x7010, 3, 0, 0x10_0000), Some(0x10_0010));
        assert_eq!(second.place(0x7010, 3, 512, 0x10_0000), None);
        assert_eq!(second.place(0x7010, 6, 512, 0x10_0000), Some(0x10_0210));
        assert_eq!(
            first.place(0x7200, 3, 0, 0x10_0000),
            None,
            "one past the end"
        );
        assert_eq!(first.place(0x6fff, 3, 0, 0x10_0000), None);
    }

    #[test]
    fn one_streams_capture_is_a_chain_and_a_fork_is_not() {
        // 2 → 0 → 1 → 3 (listed out of order, one edge doubled as another kind).
        let chain = vec![
            vec![(2, 'd')],
            vec![(0, 'd'), (0, 'p')],
            vec![],
            vec![(1, 'p')],
        ];
        assert_eq!(chain_order(&chain), Some(vec![2, 0, 1, 3]));
        // 0 → 1, 0 → 2, both → 3: no order in which each depends on the one before.
        let fork = vec![
            vec![],
            vec![(0, 'd')],
            vec![(0, 'd')],
            vec![(1, 'd'), (2, 'd')],
        ];
        assert_eq!(chain_order(&fork), None);
        let cycle = vec![vec![(1, 'd')], vec![(0, 'd')]];
        assert_eq!(chain_order(&cycle), None);
    }

    #[test]
    fn a_removed_nodes_predecessors_are_joined_in_its_place() {
        // k0 → alloc(1) → k2 -p-> k3 → free(4) → alloc(5) → k6, and k0 -p-> k2 directly too.
        let incoming = vec![
            vec![],
            vec![(0, 'd')],
            vec![(1, 'd'), (0, 'p')],
            vec![(2, 'p')],
            vec![(3, 'd')],
            vec![(4, 'd')],
            vec![(5, 'd')],
        ];
        let removed = [false, true, false, false, true, true, false];
        // Reached through the allocation too, k0 → k2 becomes a full dependency.
        assert_eq!(joined_predecessors(&incoming, &removed, 2), vec![(0, None)]);
        assert_eq!(
            joined_predecessors(&incoming, &removed, 3),
            vec![(2, Some('p'))]
        );
        assert_eq!(joined_predecessors(&incoming, &removed, 6), vec![(3, None)]);
        assert_eq!(joined_predecessors(&incoming, &removed, 0), vec![]);
    }

    #[test]
    fn parameter_words_that_are_addresses_are_rewritten_in_place() {
        // A pointer, a u32 pair and a second pointer, as a kernel's parameter struct lays them.
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&0x7010u64.to_ne_bytes());
        bytes.extend_from_slice(&7u32.to_ne_bytes());
        bytes.extend_from_slice(&9u32.to_ne_bytes());
        bytes.extend_from_slice(&0x9000u64.to_ne_bytes());
        let map = |v: u64| Ok::<_, ()>((0x7000..0x7200).contains(&v).then(|| v + 0x1000));
        assert_eq!(relocate_words(&mut bytes, map), Ok(true));
        assert_eq!(u64::from_ne_bytes(bytes[0..8].try_into().unwrap()), 0x8010);
        assert_eq!(u32::from_ne_bytes(bytes[8..12].try_into().unwrap()), 7);
        assert_eq!(
            u64::from_ne_bytes(bytes[16..24].try_into().unwrap()),
            0x9000
        );
        let mut small = 5u32.to_ne_bytes().to_vec();
        assert_eq!(relocate_words(&mut small, map), Ok(false));
    }
}
