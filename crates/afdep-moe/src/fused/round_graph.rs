//! A captured round's CUDA graph, with its kernel-to-kernel edges made programmatic.
//!
//! A graph replay launches each kernel of a rank's chain only when the one before it has
//! ended: launch latency and block start sit on the round's critical path once per phase. A
//! *programmatic* edge (`CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`, from the kernel node's
//! `CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC`) lets the next kernel be launched as soon as every
//! block of the one before has executed `griddepcontrol.launch_dependents`; it then holds in
//! `griddepcontrol.wait` until that grid has completed and its memory is visible. Every kernel of
//! the fused round opens with both (`AFDEP_GRID_DEPENDENCY_SYNC`, `cuda/common/ptx.cuh`), so it
//! reads nothing of its predecessor's before the wait: the edge changes when the kernel is
//! launched, not what it sees.
//!
//! `RoundGraph::end_capture` ends a stream capture, rewrites the edges whose both ends are
//! kernel nodes and whose downstream kernel is one of [`GRID_DEPENDENCY_KERNELS`] (others, such
//! as memset or event nodes, or a kernel without the wait, keep their full dependency), then
//! instantiates the graph. cudarc's `CudaGraph` instantiates inside its `end_capture`, before
//! the edges could change, hence this type.

use std::ffi::CStr;
use std::sync::Arc;

use afdep_kernels::KernelError;
use afdep_kernels::cudarc::driver::{CudaStream, DriverError, result, sys};

/// The kernels that open with `AFDEP_GRID_DEPENDENCY_SYNC()` (the `extern "C"` entries of
/// `cuda/fused_*.cu`; a test checks the sources): the only ones an edge may become programmatic
/// into.
pub const GRID_DEPENDENCY_KERNELS: &[&str] = &[
    "afdep_cf_counts",
    "afdep_cf_dequant",
    "afdep_cf_dispatch",
    "afdep_cf_dispatch_fp8",
    "afdep_cf_plan",
    "afdep_cf_stream_epilogue",
    "afdep_cf_stream_epilogue_fp8",
    "afdep_cf_wait",
    "afdep_ffn_front",
    "afdep_ffn_front_fp8",
    "afdep_fused_combine",
    "afdep_fused_combine_bf16",
    "afdep_fused_combine_reduce",
    "afdep_fused_combine_reduce_bf16",
    "afdep_round_begin",
    "afdep_round_check_payload",
    "afdep_round_experts",
    "afdep_round_stamp",
    "afdep_round_start_gate",
    "afdep_source_front",
    "afdep_source_front_fp8",
];

/// Kernels whose outgoing edges stay full dependencies: `afdep_cf_wait` is the combine's
/// one-block pre-wait ([`FusedEngine::set_combine_prewait`](super::FusedEngine::set_combine_prewait)),
/// whose purpose is that the combine's grid is not resident while the FFN ranks' experts run;
/// a programmatic edge out of it would launch that grid at once, parked in its wait.
pub const NOT_PROGRAMMATIC_FROM: &[&str] = &["afdep_cf_wait"];

/// A round's graph and its executable (owned; destroyed on drop), launched on the stream it
/// was captured on.
pub(crate) struct RoundGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
    programmatic: usize,
}

impl RoundGraph {
    /// Ends the capture on `stream` (`None` when nothing was captured). With `programmatic`,
    /// every kernel-to-kernel edge into one of [`GRID_DEPENDENCY_KERNELS`] becomes programmatic
    /// first ([module docs](self)).
    pub(crate) fn end_capture(
        stream: &Arc<CudaStream>,
        programmatic: bool,
    ) -> Result<Option<Self>, KernelError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(KernelError::driver("binding the context"))?;
        // SAFETY: the stream is live and capturing on this thread (the caller began it).
        let graph = unsafe { result::stream::end_capture(stream.cu_stream()) }
            .map_err(KernelError::driver("ending the graph capture"))?;
        if graph.is_null() {
            return Ok(None);
        }
        let mut out = RoundGraph {
            graph,
            exec: std::ptr::null_mut(),
            stream: stream.clone(),
            programmatic: 0,
        };
        if programmatic {
            // SAFETY: `graph` is the live, not yet instantiated graph `out` owns.
            out.programmatic = unsafe { make_edges_programmatic(graph) }?;
        }
        // SAFETY: as above; the executable is owned by `out` from here (destroyed on drop).
        out.exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(KernelError::driver("instantiating the round's graph"))?;
        Ok(Some(out))
    }

    /// Launches the graph on its stream.
    pub(crate) fn launch(&self) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: exec is this object's live executable; the stream is the one it was captured on.
        unsafe { result::graph::launch(self.exec, self.stream.cu_stream()) }
    }

    /// Uploads the executable's resources, so that the first launch does not pay for it.
    pub(crate) fn upload(&self) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: as for launch.
        unsafe { result::graph::upload(self.exec, self.stream.cu_stream()) }
    }

    /// The graph (owned by this object: not to be destroyed or changed).
    pub(crate) fn cu_graph(&self) -> sys::CUgraph {
        self.graph
    }

    /// How many of the graph's edges are programmatic.
    pub(crate) fn programmatic_edges(&self) -> usize {
        self.programmatic
    }
}

impl Drop for RoundGraph {
    fn drop(&mut self) {
        let ctx = self.stream.context();
        if ctx.bind_to_thread().is_err() {
            return;
        }
        if !self.exec.is_null() {
            // SAFETY: the executable is owned by this object and no launch of it is pending
            // that the driver would not finish first (destroy waits for none, it defers).
            ctx.record_err(unsafe { result::graph::exec_destroy(self.exec) });
        }
        // SAFETY: the graph is owned by this object.
        ctx.record_err(unsafe { result::graph::destroy(self.graph) });
    }
}

/// The name of a kernel node's function, `None` for other nodes.
///
/// # Safety
/// `node` is a node of a live graph.
unsafe fn kernel_name(node: sys::CUgraphNode) -> Result<Option<String>, KernelError> {
    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: node is live (the caller's contract).
    unsafe { sys::cuGraphNodeGetType(node, &mut t) }
        .result()
        .map_err(KernelError::driver("reading a graph node's type"))?;
    if t != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(None);
    }
    // SAFETY: a kernel node's parameters; zeroed is a valid value of the plain C struct.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: node is a live kernel node; p is written by the driver.
    unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut p) }
        .result()
        .map_err(KernelError::driver("reading a kernel node's parameters"))?;
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: p.func is the node's live function; the driver returns a string it owns.
    unsafe { sys::cuFuncGetName(&mut name, p.func) }
        .result()
        .map_err(KernelError::driver("reading a kernel's name"))?;
    if name.is_null() {
        return Ok(None);
    }
    // SAFETY: a NUL-terminated string owned by the driver, read at once.
    Ok(Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    ))
}

/// Rewrites every edge from a kernel node (but those of [`NOT_PROGRAMMATIC_FROM`]) into a
/// kernel node of [`GRID_DEPENDENCY_KERNELS`] as a programmatic edge; returns how many.
///
/// # Safety
/// `graph` is a live graph that is not instantiated yet and that no other thread uses.
unsafe fn make_edges_programmatic(graph: sys::CUgraph) -> Result<usize, KernelError> {
    let mut n = 0usize;
    // SAFETY: null arrays ask for the edge count (the caller's contract: a live graph).
    unsafe {
        sys::cuGraphGetEdges_v2(
            graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut n,
        )
    }
    .result()
    .map_err(KernelError::driver("counting graph edges"))?;
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    // SAFETY: zeroed edge data is a valid value of the plain C struct.
    let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; n];
    // SAFETY: every array holds n entries, the count the driver gave.
    unsafe {
        sys::cuGraphGetEdges_v2(
            graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut n,
        )
    }
    .result()
    .map_err(KernelError::driver("listing graph edges"))?;
    let mut changed = 0;
    for i in 0..n {
        if data[i].type_ != sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8 {
            continue;
        }
        // SAFETY: both are nodes of the live graph.
        let (a, b) = unsafe { (kernel_name(from[i])?, kernel_name(to[i])?) };
        let into_waiting = b
            .as_deref()
            .is_some_and(|k| GRID_DEPENDENCY_KERNELS.contains(&k));
        let from_kernel = a
            .as_deref()
            .is_some_and(|k| !NOT_PROGRAMMATIC_FROM.contains(&k));
        if !from_kernel || !into_waiting {
            continue;
        }
        let mut prog: sys::CUgraphEdgeData = data[i];
        prog.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        prog.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
        // SAFETY: the edge exists (listed above); one edge from, to and its data each.
        unsafe { sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1) }
            .result()
            .map_err(KernelError::driver("removing a graph edge"))?;
        // SAFETY: as above; the new edge joins the same two nodes.
        unsafe { sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &prog, 1) }
            .result()
            .map_err(KernelError::driver("adding a programmatic graph edge"))?;
        changed += 1;
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::GRID_DEPENDENCY_KERNELS;
    use afdep_kernels::sources::KernelId;

    /// Every kernel entry of the fused sources opens with the grid dependency sync, and the
    /// list names exactly those entries: an edge must never become programmatic into a kernel
    /// that could read its predecessor's output before the wait.
    #[test]
    fn the_list_is_the_entries_that_wait() {
        let mut found = Vec::new();
        for k in KernelId::ALL {
            let file = k.source();
            if !file.name().starts_with("fused_") {
                continue;
            }
            let text = file.text();
            // the entry's definition: its name and '(' in the head of an `extern "C"` kernel
            // (no ';', '{' or '}' between the `extern` and the name)
            let def = text
                .match_indices(&format!("{}(", k.entry()))
                .map(|(i, _)| i)
                .find(|&i| {
                    // not a forward declaration: no ';' before the body's '{' either
                    let head_end = text[i..].find('{').map_or(text.len(), |b| i + b);
                    text[..i]
                        .rfind("extern \"C\" __global__")
                        .is_some_and(|e| !text[e..head_end].contains([';', '}']))
                })
                .unwrap_or_else(|| panic!("{}: no definition found", k.entry()));
            let body = &text[def..];
            let open = body.find('{').expect("a body");
            assert!(
                body[open + 1..]
                    .trim_start()
                    .starts_with("AFDEP_GRID_DEPENDENCY_SYNC();"),
                "{}: {} does not open with AFDEP_GRID_DEPENDENCY_SYNC()",
                file.name(),
                k.entry()
            );
            found.push(k.entry().to_string());
        }
        found.sort();
        found.dedup();
        let mut listed: Vec<String> = GRID_DEPENDENCY_KERNELS
            .iter()
            .map(|s| s.to_string())
            .collect();
        listed.sort();
        assert_eq!(found, listed);
    }
}
