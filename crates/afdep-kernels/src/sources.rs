//! The embedded CUDA C++ sources, the kernel ids, and the specialisations they are compiled for.
//!
//! Every `.cu` and `.cuh` file under `crates/afdep-kernels/cuda/` is embedded with
//! `include_str!`. Headers are handed to NVRTC as in-memory headers (by their path relative to
//! `cuda/`, e.g. `common/ptx.cuh`), so a compiled module depends only on the embedded text, the
//! options, the NVRTC version and the architecture: exactly what the cache key hashes.

use std::fmt;

use sha2::{Digest, Sha256};

/// The folder of the crate whose sources this build embeds (its `CARGO_MANIFEST_DIR` at
/// compile time): worktrees that share one target folder can leave a build of another
/// worktree's sources that cargo takes as fresh, and this tells (`cargo xtask kernels` checks
/// it through the `compile_all` example).
pub const EMBEDDED_FROM: &str = env!("CARGO_MANIFEST_DIR");

/// The embedded headers: `(include name, text)`, sorted by name.
pub const HEADERS: &[(&str, &str)] = &[
    ("common/fault.cuh", include_str!("../cuda/common/fault.cuh")),
    ("common/fp8.cuh", include_str!("../cuda/common/fp8.cuh")),
    ("common/probe.cuh", include_str!("../cuda/common/probe.cuh")),
    ("common/ptx.cuh", include_str!("../cuda/common/ptx.cuh")),
    (
        "common/softmax.cuh",
        include_str!("../cuda/common/softmax.cuh"),
    ),
    ("common/types.cuh", include_str!("../cuda/common/types.cuh")),
    ("layout/fused.cuh", include_str!("../cuda/layout/fused.cuh")),
    (
        "layout/gemm_problem.cuh",
        include_str!("../cuda/layout/gemm_problem.cuh"),
    ),
    (
        "layout/route_check.cuh",
        include_str!("../cuda/layout/route_check.cuh"),
    ),
    (
        "layout/route_error.cuh",
        include_str!("../cuda/layout/route_error.cuh"),
    ),
    ("phase/begin.cuh", include_str!("../cuda/phase/begin.cuh")),
    (
        "phase/cf_dispatch.cuh",
        include_str!("../cuda/phase/cf_dispatch.cuh"),
    ),
    ("phase/counts.cuh", include_str!("../cuda/phase/counts.cuh")),
    (
        "phase/stream_epilogue.cuh",
        include_str!("../cuda/phase/stream_epilogue.cuh"),
    ),
];

/// Threads per block of every kernel (`AFDEP_BLOCK` on the device).
pub const BLOCK: u32 = 256;

/// Slots per block of the layout kernels (`AFDEP_LAYOUT_CHUNK` on the device).
pub const LAYOUT_CHUNK: u32 = 4096;

/// Most experts a module may be specialised for.
pub const MAX_EXPERTS: u32 = 1024;

/// Most slots per token a module may be specialised for.
pub const MAX_TOP_K: u32 = 32;

/// The top-k values the runtime compiles for (`cargo xtask kernels` builds all of them).
pub const RUNTIME_TOP_K: [u32; 4] = [1, 2, 6, 8];

/// The expert counts the runtime compiles for (`cargo xtask kernels` builds all of them).
pub const RUNTIME_EXPERTS: [u32; 3] = [64, 96, 128];

/// Defines the kernel registry from one table: [`SourceFile`] (with its file name, embedded text
/// and the constants it is specialised by), [`KernelId`] (with its entry point) and the mapping
/// between them. Each row of the table is a source file followed by the kernels it defines, so a
/// kernel cannot be added without naming its file and entry point, and every `match` the macro
/// writes is exhaustive.
macro_rules! kernel_registry {
    (
        $(
            $(#[$file_meta:meta])*
            $file:ident = $file_name:literal, experts: $experts:literal, top_k: $top_k:literal {
                $(
                    $(#[$kernel_meta:meta])*
                    $kernel:ident = $entry:literal
                ),* $(,)?
            }
        )*
    ) => {
        /// One `.cu` file: a module of one or more kernels.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum SourceFile {
            $( $(#[$file_meta])* $file, )*
        }

        impl SourceFile {
            /// Every source file.
            pub const ALL: [SourceFile; [$(stringify!($file)),*].len()] = [$(SourceFile::$file),*];

            /// The file name (also the NVRTC program name).
            pub fn name(self) -> &'static str {
                match self {
                    $( SourceFile::$file => $file_name, )*
                }
            }

            /// The embedded text.
            pub fn text(self) -> &'static str {
                match self {
                    $( SourceFile::$file => include_str!(concat!("../cuda/", $file_name)), )*
                }
            }

            /// Whether the module is specialised by the number of experts.
            pub fn uses_experts(self) -> bool {
                match self {
                    $( SourceFile::$file => $experts, )*
                }
            }

            /// Whether the module is specialised by top-k.
            pub fn uses_top_k(self) -> bool {
                match self {
                    $( SourceFile::$file => $top_k, )*
                }
            }
        }

        /// A kernel: its source file and its entry point.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum KernelId {
            $( $( $(#[$kernel_meta])* $kernel, )* )*
        }

        impl KernelId {
            /// Every kernel, grouped by source file.
            pub const ALL: [KernelId; [$($(stringify!($kernel)),*),*].len()] =
                [$($(KernelId::$kernel),*),*];

            /// The source file that defines the kernel.
            pub fn source(self) -> SourceFile {
                match self {
                    $( $( KernelId::$kernel => SourceFile::$file, )* )*
                }
            }

            /// The `extern "C"` entry name.
            pub fn entry(self) -> &'static str {
                match self {
                    $( $( KernelId::$kernel => $entry, )* )*
                }
            }
        }
    };
}

kernel_registry! {
    /// `router.cu`: logits GEMM and softmax/top-k (specialised by experts and top-k).
    Router = "router.cu", experts: true, top_k: true {
        /// `logits = x·Wr` in f32 (SIMT tiles, bf16 inputs, any hidden size).
        RouterLogits = "afdep_router_logits",
        /// `logits = x·Wr` in f32 on tensor cores (mma.sync; hidden a multiple of 8).
        RouterLogitsMma = "afdep_router_logits_mma",
        /// Softmax, top-k with ties to the lower id, renormalisation.
        RouterTopk = "afdep_router_topk",
    }
    /// `validate.cu`: route validation into the error word (specialised by top-k).
    Validate = "validate.cu", experts: false, top_k: true {
        /// Route validation, pass 1: the first offending (token, slot) by an atomic on its key.
        ValidateRoutes = "afdep_validate_scan",
        /// Route validation, pass 2: writes the error word of the winning offence.
        ValidateWord = "afdep_validate_word",
    }
    /// `layout.cu`: per-expert counts, offsets and the counting sort (specialised by experts).
    Layout = "layout.cu", experts: true, top_k: false {
        /// Layout: per-block, per-expert slot counts.
        ExpertCounts = "afdep_layout_count",
        /// Layout: per-expert scan of the block counts and the expert totals.
        ExpertScanBlocks = "afdep_layout_scan_blocks",
        /// Layout: 64-bit exclusive offsets of the experts.
        ExpertOffsets = "afdep_layout_scan_experts",
        /// Layout: the stable scatter of slots to rows.
        ExpertScatter = "afdep_layout_scatter",
    }
    /// `permute.cu`: permute and weighted un-permute (specialised by top-k).
    Permute = "permute.cu", experts: false, top_k: true {
        /// Gather token rows into expert order.
        Permute = "afdep_permute",
        /// Weighted sum of expert rows back into token order.
        Unpermute = "afdep_unpermute",
    }
    /// `gemm.cu`: the grouped GEMMs of the MoE layer (not specialised).
    Gemm = "gemm.cu", experts: false, top_k: false {
        /// Grouped GEMM: forward up-projection with SwiGLU.
        GemmUpSwiglu = "afdep_gemm_up_swiglu",
        /// Grouped GEMM: down-projection into rows.
        GemmDownStore = "afdep_gemm_down_store",
        /// Grouped GEMM: down-projection scattered into token order.
        GemmDownScatter = "afdep_gemm_down_scatter",
        /// Grouped GEMM: down-projection added to an accumulator, cast to bf16.
        GemmDownAcc = "afdep_gemm_down_acc",
        /// Grouped GEMM: dy·W2ᵀ with the SwiGLU backward.
        GemmDhDswiglu = "afdep_gemm_dh_dswiglu",
        /// Grouped GEMM: data gradient into rows.
        GemmDxStore = "afdep_gemm_dx_store",
        /// Grouped GEMM: data gradient scattered into token order.
        GemmDxScatter = "afdep_gemm_dx_scatter",
        /// Grouped GEMM: data gradient added in place (f32).
        GemmDxAdd = "afdep_gemm_dx_add",
        /// Grouped GEMM: data gradient added to an accumulator, cast to bf16.
        GemmDxAcc = "afdep_gemm_dx_acc",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): forward up-projection with SwiGLU.
        GemmWsUpSwiglu = "afdep_gemm_ws_up_swiglu",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): down-projection into rows.
        GemmWsDownStore = "afdep_gemm_ws_down_store",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): down-projection scattered into token order.
        GemmWsDownScatter = "afdep_gemm_ws_down_scatter",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): down-projection added to an accumulator, cast to bf16.
        GemmWsDownAcc = "afdep_gemm_ws_down_acc",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): dy·W2ᵀ with the SwiGLU backward.
        GemmWsDhDswiglu = "afdep_gemm_ws_dh_dswiglu",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): data gradient into rows.
        GemmWsDxStore = "afdep_gemm_ws_dx_store",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): data gradient scattered into token order.
        GemmWsDxScatter = "afdep_gemm_ws_dx_scatter",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): data gradient added in place (f32).
        GemmWsDxAdd = "afdep_gemm_ws_dx_add",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws engine): data gradient added to an accumulator, cast to bf16.
        GemmWsDxAcc = "afdep_gemm_ws_dx_acc",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): forward up-projection with SwiGLU.
        GemmWs2UpSwiglu = "afdep_gemm_ws2_up_swiglu",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): down-projection into rows.
        GemmWs2DownStore = "afdep_gemm_ws2_down_store",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): down-projection scattered into token order.
        GemmWs2DownScatter = "afdep_gemm_ws2_down_scatter",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): down-projection added to an accumulator, cast to bf16.
        GemmWs2DownAcc = "afdep_gemm_ws2_down_acc",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): dy·W2ᵀ with the SwiGLU backward.
        GemmWs2DhDswiglu = "afdep_gemm_ws2_dh_dswiglu",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): data gradient into rows.
        GemmWs2DxStore = "afdep_gemm_ws2_dx_store",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): data gradient scattered into token order.
        GemmWs2DxScatter = "afdep_gemm_ws2_dx_scatter",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): data gradient added in place (f32).
        GemmWs2DxAdd = "afdep_gemm_ws2_dx_add",
        /// The ws engine in pairs of blocks (2-block clusters along M, B multicast): data gradient added to an accumulator, cast to bf16.
        GemmWs2DxAcc = "afdep_gemm_ws2_dx_acc",
        /// Grouped GEMM: weight gradients (bf16, or f32 partials per chunk).
        GemmWgrad = "afdep_gemm_wgrad",
        /// Warp-specialised grouped GEMM (`gemm.cu`'s ws KSUM engine): weight gradients.
        GemmWsWgrad = "afdep_gemm_ws_wgrad",
        /// Sum of weight-gradient partials in split order.
        GemmReduce = "afdep_gemm_reduce",
    }
    /// `moe.cu`: combine, cast and router backward (specialised by experts and top-k).
    Moe = "moe.cu", experts: true, top_k: true {
        /// Routed combine into an f32 accumulator.
        MoeCombine = "afdep_moe_combine",
        /// f32 to bf16.
        MoeCast = "afdep_moe_cast",
        /// Strided bf16 column copy with zero padding (the router's matrices padded to 16-byte
        /// rows for the GEMMs, and back).
        MoeCopyCols = "afdep_moe_copy_cols",
        /// Router backward: softmax and renormalisation.
        RouterBackward = "afdep_router_backward",
    }
    /// `reference.cu`: the simple GPU reference path of the MoE layer (not specialised: every
    /// shape is a run-time value).
    Reference = "reference.cu", experts: false, top_k: false {
        /// Reference: exact bf16 transpose of a batch of matrices.
        RefTranspose = "afdep_ref_transpose",
        /// Reference: the first slot the route rules reject.
        RefCheckRoutes = "afdep_ref_check_routes",
        /// Reference: router logits, one thread per element.
        RefLogits = "afdep_ref_logits",
        /// Reference: the independent check of the router's top-k choice.
        RefTopkCheck = "afdep_ref_topk_check",
        /// Reference: softmax in place, one thread per token.
        RefSoftmax = "afdep_ref_softmax",
        /// Reference: slot weights (recomputed from the probabilities, or given).
        RefWeights = "afdep_ref_weights",
        /// Reference: per-(chunk, expert) slot counts of the row lists.
        RefRowsCount = "afdep_ref_rows_count",
        /// Reference: per-expert scan of the chunk counts.
        RefRowsScan = "afdep_ref_rows_scan",
        /// Reference: expert offsets of the row lists.
        RefRowsOffsets = "afdep_ref_rows_offsets",
        /// Reference: the stable scatter of slots into the row lists.
        RefRowsScatter = "afdep_ref_rows_scatter",
        /// Reference: routed experts' a, b and h.
        RefExpertUp = "afdep_ref_expert_up",
        /// Reference: the shared expert's a, b and h.
        RefSharedUp = "afdep_ref_shared_up",
        /// Reference: the layer output.
        RefCombine = "afdep_ref_combine",
        /// Reference: routed experts' unweighted dy·W2ᵀ.
        RefExpertDh = "afdep_ref_expert_dh",
        /// Reference: the router's per-slot <dy, y>.
        RefRouterG = "afdep_ref_router_g",
        /// Reference: routed experts' SwiGLU backward, in place.
        RefExpertDab = "afdep_ref_expert_dab",
        /// Reference: the shared expert's dh and SwiGLU backward, in place.
        RefSharedDab = "afdep_ref_shared_dab",
        /// Reference: the router backward to the logits.
        RefRouterDlogits = "afdep_ref_router_dlogits",
        /// Reference: the data gradient.
        RefDx = "afdep_ref_dx",
        /// Reference: routed experts' dW2.
        RefGradW2 = "afdep_ref_grad_w2",
        /// Reference: routed experts' dW1 and dW3.
        RefGradW13 = "afdep_ref_grad_w13",
        /// Reference: the shared expert's dS2.
        RefGradS2 = "afdep_ref_grad_s2",
        /// Reference: the shared expert's dS1 and dS3.
        RefGradS13 = "afdep_ref_grad_s13",
        /// Reference: the router's dWr.
        RefGradWr = "afdep_ref_grad_wr",
        /// Reference: statistics of the error metric of two tensors.
        RefErrStats = "afdep_ref_err_stats",
    }
    /// `fused_combine.cu`: the combine's two halves, the FFN ranks' partial sums and the sources'
    /// fixed-order sum, with f32 partials and with bf16 partials (specialised by top-k).
    FusedCombine = "fused_combine.cu", experts: false, top_k: true {
        /// `afdep_fused_combine_reduce`: an FFN rank's f32 partial sum of each token's slots into
        /// its source's return area.
        FusedCombineReduce = "afdep_fused_combine_reduce",
        /// `afdep_fused_combine`: waits for the FFN ranks, adds their partials in the fixed order.
        FusedCombine = "afdep_fused_combine",
        /// `afdep_fused_combine_reduce_bf16`: [`KernelId::FusedCombineReduce`] with bf16
        /// partials (each partial rounded to bf16, nearest even, as it is stored).
        FusedCombineReduceBf16 = "afdep_fused_combine_reduce_bf16",
        /// `afdep_fused_combine_bf16`: [`KernelId::FusedCombine`] with bf16 partials (each
        /// widened to f32 as it is read).
        FusedCombineBf16 = "afdep_fused_combine_bf16",
    }
    /// `fused_counts.cu`: count-first counts on the device, their publication, the FFN rank's
    /// plan and offsets, a bounded flag wait (specialised by top-k).
    FusedCounts = "fused_counts.cu", experts: false, top_k: true {
        /// Count-first: a source's counts, block positions and compact rows from its routes,
        /// then (its last block) the counts stored into each FFN rank's workspace and its flag.
        CfCounts = "afdep_cf_counts",
        /// Count-first: an FFN rank's plan (prefix sums) and each source's published offsets.
        CfPlan = "afdep_cf_plan",
        /// Count-first: a bounded wait for a set of flags.
        CfWait = "afdep_cf_wait",
    }
    /// `fused_cf_dispatch.cu`: count-first row stores of a source, source arm and streaming
    /// (specialised by top-k).
    FusedCfDispatch = "fused_cf_dispatch.cu", experts: false, top_k: true {
        /// Count-first: a source's row stores (source arm or streaming).
        CfDispatch = "afdep_cf_dispatch",
        /// `afdep_cf_dispatch_fp8`: [`KernelId::CfDispatch`] with fp8 payloads, quantised while
        /// stored.
        CfDispatchFp8 = "afdep_cf_dispatch_fp8",
    }
    /// `fused_stream_epilogue.cu`: the count-first streaming epilogue (specialised by top-k).
    FusedStreamEpilogue = "fused_stream_epilogue.cu", experts: false, top_k: true {
        /// Count-first: the streaming epilogue.
        CfStreamEpilogue = "afdep_cf_stream_epilogue",
        /// `afdep_cf_stream_epilogue_fp8`: the streaming epilogue of fp8 payloads (codes, scales
        /// and dequantised rows).
        CfStreamEpilogueFp8 = "afdep_cf_stream_epilogue_fp8",
        /// `afdep_cf_dequant`: the source arm's fp8 expanded rows dequantised on the FFN rank.
        CfDequant = "afdep_cf_dequant",
    }
    /// `fused_front.cu`: a device round's fronts, the launches from the round's start to its
    /// rows in one kernel per role (specialised by top-k).
    FusedFront = "fused_front.cu", experts: false, top_k: true {
        /// Device round, a source: the start, the counts and the rows in one grid.
        SourceFront = "afdep_source_front",
        /// `afdep_source_front_fp8`: [`KernelId::SourceFront`] with fp8 payloads.
        SourceFrontFp8 = "afdep_source_front_fp8",
        /// Device round, an FFN rank: the start, the plan and the epilogue in one grid.
        FfnFront = "afdep_ffn_front",
        /// `afdep_ffn_front_fp8`: [`KernelId::FfnFront`] with fp8 payloads.
        FfnFrontFp8 = "afdep_ffn_front_fp8",
    }
    /// `fused_round.cu`: the device round: round control, device route validation with the
    /// verdict shared among ranks, the fp8 payload check, the device expert (specialised by
    /// top-k).
    FusedRound = "fused_round.cu", experts: false, top_k: true {
        /// Device round: round + 1, device route validation, the verdict shared among ranks.
        RoundBegin = "afdep_round_begin",
        /// Device round: the reproducible device expert (a per-expert scale).
        RoundExperts = "afdep_round_experts",
        /// `afdep_round_check_payload`: a device round's fp8 payload check (non-finite rows).
        RoundCheckPayload = "afdep_round_check_payload",
        /// `afdep_round_stamp`: `%globaltimer` into one slot of a traced round's stamps.
        RoundStamp = "afdep_round_stamp",
        /// `afdep_round_start_gate`: holds a gated round's launches until its gate opens.
        RoundStartGate = "afdep_round_start_gate",
    }
    /// `nccl_round.cu`: the device round of the NCCL exchange: packing into capacity-padded
    /// slabs, the FFN rank's plan and expansion, the combine's two halves (specialised by top-k).
    NcclRound = "nccl_round.cu", experts: false, top_k: true {
        /// `afdep_nccl_pack`: a source's slab headers, row metadata and token rows per FFN rank.
        NcclPack = "afdep_nccl_pack",
        /// `afdep_nccl_pack_rows`: a source's payload rows into its slabs.
        NcclPackRows = "afdep_nccl_pack_rows",
        /// `afdep_nccl_count`: an FFN rank's per (expert, source) row counts.
        NcclCount = "afdep_nccl_count",
        /// `afdep_nccl_plan`: an FFN rank's block starts and expert offsets.
        NcclPlan = "afdep_nccl_plan",
        /// `afdep_nccl_expand`: an FFN rank's slot and row maps of the expanded layout.
        NcclExpand = "afdep_nccl_expand",
        /// `afdep_nccl_expand_rows`: an FFN rank's payload rows into the expanded layout.
        NcclExpandRows = "afdep_nccl_expand_rows",
        /// `afdep_nccl_reduce`: an FFN rank's f32 partials per compact row.
        NcclReduce = "afdep_nccl_reduce",
        /// `afdep_nccl_combine`: a source's fixed-order sum of the partials.
        NcclCombine = "afdep_nccl_combine",
    }
    /// `fp8.cu`: e4m3 encode, decode, and row quantisation with the fused exchange's device
    /// functions (not specialised).
    Fp8 = "fp8.cu", experts: false, top_k: false {
        /// `afdep_fp8_encode`: f32 values to e4m3 codes.
        Fp8Encode = "afdep_fp8_encode",
        /// `afdep_fp8_decode`: e4m3 codes to f32 values.
        Fp8Decode = "afdep_fp8_decode",
        /// `afdep_fp8_quantise_rows`: bf16 rows to codes, scales and dequantised rows.
        Fp8QuantiseRows = "afdep_fp8_quantise_rows",
    }
}

impl SourceFile {
    /// The kernels the file defines.
    pub fn kernels(self) -> impl Iterator<Item = KernelId> {
        KernelId::ALL
            .into_iter()
            .filter(move |k| k.source() == self)
    }
}

impl KernelId {
    /// The kernel whose entry name is `entry`.
    pub fn from_entry(entry: &str) -> Option<KernelId> {
        KernelId::ALL.into_iter().find(|k| k.entry() == entry)
    }

    /// Whether the kernel may use local memory for spills (`cargo xtask kernels` fails on any
    /// spill of a kernel not allowed here). None may, for now.
    pub fn may_spill(self) -> bool {
        false
    }
}

impl fmt::Display for KernelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.entry())
    }
}

/// The compile-time constants a module is specialised by. Values a file does not use are
/// `None` (see [`ModuleSpec::new`]), so every kernel of one specialisation shares one module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleSpec {
    /// The source file.
    pub file: SourceFile,
    /// `AFDEP_EXPERTS`, for files that use it.
    pub experts: Option<u32>,
    /// `AFDEP_TOP_K`, for files that use it.
    pub top_k: Option<u32>,
    /// `AFDEP_FAULT`: the fault-injection points compiled in (`cuda/common/fault.cuh`), 0 for
    /// every production module. Only `with_fault` (feature `fault-injection`) sets it.
    fault: u32,
}

impl ModuleSpec {
    /// The module of `file` for `experts` and `top_k`, keeping only the values the file uses.
    pub fn new(file: SourceFile, experts: u32, top_k: u32) -> ModuleSpec {
        ModuleSpec {
            file,
            experts: file.uses_experts().then_some(experts),
            top_k: file.uses_top_k().then_some(top_k),
            fault: 0,
        }
    }

    /// The module built with `fault`'s points of this file compiled in (`-DAFDEP_FAULT`, also in
    /// the label and so in the cache key), or the production module when the fault has no
    /// point in this file or `fault` is `None` ([`crate::ops::fault`]).
    #[cfg(feature = "fault-injection")]
    pub fn with_fault(self, fault: Option<crate::ops::fault::Fault>) -> ModuleSpec {
        ModuleSpec {
            fault: fault.map_or(0, |f| f.mask_in(self.file)),
            ..self
        }
    }

    /// The fault-injection points compiled into the module (`AFDEP_FAULT`; 0: a production
    /// module).
    pub fn fault_mask(&self) -> u32 {
        self.fault
    }

    /// The module that holds `kernel` for `experts` and `top_k`.
    pub fn of(kernel: KernelId, experts: u32, top_k: u32) -> ModuleSpec {
        ModuleSpec::new(kernel.source(), experts, top_k)
    }

    /// Checks the constants against the supported ranges; the reason when they are out.
    pub fn check(&self) -> Result<(), String> {
        match (self.experts, self.top_k) {
            (Some(e), _) if !(1..=MAX_EXPERTS).contains(&e) => {
                Err(format!("{e} experts: supported are 1..={MAX_EXPERTS}"))
            }
            (_, Some(k)) if !(1..=MAX_TOP_K).contains(&k) => {
                Err(format!("top-k {k}: supported are 1..={MAX_TOP_K}"))
            }
            (Some(e), Some(k)) if k > e => Err(format!("top-k {k} above the {e} experts")),
            _ => Ok(()),
        }
    }

    /// The `-D` defines of the module (always `AFDEP_BLOCK`, the layout chunk for the layout,
    /// `AFDEP_FAULT` for a fault-built module).
    pub fn defines(&self) -> Vec<(&'static str, u32)> {
        let mut d = vec![("AFDEP_BLOCK", BLOCK)];
        if let Some(e) = self.experts {
            d.push(("AFDEP_EXPERTS", e));
        }
        if let Some(k) = self.top_k {
            d.push(("AFDEP_TOP_K", k));
        }
        if self.file == SourceFile::Layout {
            d.push(("AFDEP_LAYOUT_CHUNK", LAYOUT_CHUNK));
        }
        if self.fault != 0 {
            d.push(("AFDEP_FAULT", self.fault));
        }
        d
    }

    /// A short label, e.g. `router E=64 K=8` (` fault=0x…` appended for a fault-built module).
    pub fn label(&self) -> String {
        let mut s = self.file.name().trim_end_matches(".cu").to_string();
        if let Some(e) = self.experts {
            s.push_str(&format!(" E={e}"));
        }
        if let Some(k) = self.top_k {
            s.push_str(&format!(" K={k}"));
        }
        if self.fault != 0 {
            s.push_str(&format!(" fault={:#x}", self.fault));
        }
        s
    }
}

impl fmt::Display for ModuleSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// Every module variant the runtime uses: each source file × [`RUNTIME_EXPERTS`] ×
/// [`RUNTIME_TOP_K`], deduplicated by what the file is specialised by. This is the list
/// `cargo xtask kernels` compiles.
pub fn runtime_variants() -> Vec<ModuleSpec> {
    let mut v = Vec::new();
    for file in SourceFile::ALL {
        for e in RUNTIME_EXPERTS {
            for k in RUNTIME_TOP_K {
                let m = ModuleSpec::new(file, e, k);
                if !v.contains(&m) {
                    v.push(m);
                }
            }
        }
    }
    v
}

/// SHA-256 over every embedded source (file names and texts, in a fixed order) and the
/// block and chunk constants, as lowercase hex.
pub fn source_digest_full() -> String {
    let mut h = Sha256::new();
    h.update(b"afdep-kernels sources v1\0");
    for (name, text) in HEADERS {
        hash_part(&mut h, name.as_bytes());
        hash_part(&mut h, text.as_bytes());
    }
    for f in SourceFile::ALL {
        hash_part(&mut h, f.name().as_bytes());
        hash_part(&mut h, f.text().as_bytes());
    }
    hash_part(
        &mut h,
        format!("BLOCK={BLOCK} LAYOUT_CHUNK={LAYOUT_CHUNK}").as_bytes(),
    );
    hex(&h.finalize())
}

/// A short hex digest (16 hex digits) of all embedded kernel sources: printed by
/// `afdep kernels --digest` and carried by every benchmark row, so a result names the exact
/// kernels that produced it.
pub fn source_digest() -> String {
    source_digest_full()[..16].to_string()
}

/// Hashes a length-prefixed part, so that concatenations cannot collide.
pub(crate) fn hash_part(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// Lowercase hex of bytes.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_short_stable_hex() {
        let d = source_digest();
        assert_eq!(d.len(), 16);
        assert!(
            d.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_eq!(d, source_digest());
        assert!(source_digest_full().starts_with(&d));
        assert_eq!(source_digest_full().len(), 64);
    }

    #[test]
    fn digest_covers_every_source() {
        // Every file the sources include is embedded, and every embedded file is hashed.
        let mut names: Vec<&str> = HEADERS.iter().map(|(n, _)| *n).collect();
        let sorted = {
            let mut s = names.clone();
            s.sort_unstable();
            s
        };
        assert_eq!(names, sorted, "HEADERS must stay sorted");
        for f in SourceFile::ALL {
            names.push(f.name());
        }
        let texts = HEADERS
            .iter()
            .map(|(_, t)| *t)
            .chain(SourceFile::ALL.iter().map(|f| f.text()));
        for t in texts {
            for line in t.lines() {
                if let Some(rest) = line.trim().strip_prefix("#include \"") {
                    let inc = rest.trim_end_matches('"');
                    assert!(names.contains(&inc), "{inc} is included but not embedded");
                }
            }
        }
        // The cuda/ folder holds exactly the embedded files.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut on_disk = Vec::new();
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            for ent in std::fs::read_dir(&d).unwrap() {
                let p = ent.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if matches!(p.extension().and_then(|e| e.to_str()), Some("cu" | "cuh")) {
                    on_disk.push(
                        p.strip_prefix(&dir)
                            .unwrap()
                            .to_string_lossy()
                            .replace('\\', "/"),
                    );
                }
            }
        }
        on_disk.sort();
        let mut embedded: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded, "every file under cuda/ must be embedded");
    }

    /// The `extern "C"` entry names a source defines, directly or through an entry macro
    /// (`XYZ_ENTRY(name, ...)` at the start of a line; every `afdep_` argument of it is an
    /// entry: `ROWS_ENTRY(classic, warp_specialised, paired, ...)` defines three).
    fn entries_defined(text: &str) -> Vec<String> {
        let ident = |s: &str| -> String {
            s.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(p) = rest.find("extern \"C\"") {
            rest = &rest[p + "extern \"C\"".len()..];
            let mut s = rest.trim_start();
            s = s.strip_prefix("__global__").unwrap_or(s).trim_start();
            s = s.strip_prefix("void").unwrap_or(s).trim_start();
            for attr in ["__cluster_dims__(", "__launch_bounds__("] {
                if let Some(after) = s.strip_prefix(attr) {
                    s = after.split_once(')').map_or("", |(_, r)| r).trim_start();
                }
            }
            let name = ident(s);
            // `name`, `ws_name` and `ws2_name` are parameters of an entry macro's definition.
            if !["name", "ws_name", "ws2_name", ""].contains(&name.as_str()) {
                out.push(name);
            }
        }
        for line in text.lines() {
            if let Some((mac, args)) = line.split_once('(') {
                if mac.ends_with("_ENTRY") && !mac.starts_with('#') && !mac.contains(' ') {
                    out.extend(
                        args.split(',')
                            .map(|a| ident(a.trim_start()))
                            .filter(|a| a.starts_with("afdep_")),
                    );
                }
            }
        }
        out
    }

    #[test]
    fn every_entry_in_the_sources_is_registered() {
        for f in SourceFile::ALL {
            let defined = entries_defined(f.text());
            assert!(!defined.is_empty(), "no entry found in {}", f.name());
            for name in &defined {
                let k = KernelId::from_entry(name)
                    .unwrap_or_else(|| panic!("{name} in {} has no KernelId", f.name()));
                assert_eq!(k.source(), f, "{name} is registered to another file");
            }
            for k in f.kernels() {
                assert!(
                    defined.iter().any(|n| n == k.entry()),
                    "{k} is registered to {} but not defined there",
                    f.name()
                );
            }
        }
    }

    #[test]
    fn kernels_map_to_unique_entries_and_back() {
        for k in KernelId::ALL {
            assert_eq!(KernelId::from_entry(k.entry()), Some(k));
            assert!(
                // Defined directly, or through an entry macro (`ROWS_ENTRY(name, ws_name,
                // ...)`).
                k.source().text().contains(&format!("{}(", k.entry()))
                    || k.source().text().contains(&format!("({},", k.entry()))
                    || k.source().text().contains(&format!(", {},", k.entry())),
                "{k} not in {}",
                k.source().name()
            );
            assert!(k.source().kernels().any(|x| x == k));
        }
    }

    #[test]
    fn specs_keep_only_used_constants() {
        let a = ModuleSpec::of(KernelId::Permute, 64, 8);
        let b = ModuleSpec::of(KernelId::Unpermute, 128, 8);
        assert_eq!(a, b, "permute is specialised by top-k only");
        assert_eq!(
            ModuleSpec::of(KernelId::ExpertCounts, 96, 1),
            ModuleSpec::of(KernelId::ExpertScatter, 96, 8)
        );
        assert_eq!(
            ModuleSpec::of(KernelId::RouterTopk, 96, 6).label(),
            "router E=96 K=6"
        );
        assert!(ModuleSpec::new(SourceFile::Router, 4, 8).check().is_err());
        assert!(
            ModuleSpec::new(SourceFile::Layout, 2048, 1)
                .check()
                .is_err()
        );
        assert!(
            ModuleSpec::new(SourceFile::Validate, 1, 33)
                .check()
                .is_err()
        );
        let v = runtime_variants();
        // router, validate, layout, permute, gemm, moe, reference, fused combine, count-first
        // counts, dispatch, streaming epilogue, device round, fronts, NCCL round (top-k), fp8
        assert_eq!(
            v.len(),
            12 + 4 + 3 + 4 + 1 + 12 + 1 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 1
        );
        assert!(v.iter().all(|m| m.check().is_ok()));
    }

    /// The error-word class codes of the device header equal afdep-core's.
    #[test]
    fn route_error_header_matches_core() {
        use afdep_core::error::route_class as c;
        let text = HEADERS
            .iter()
            .find(|(n, _)| *n == "layout/route_error.cuh")
            .unwrap()
            .1;
        let get = |name: &str| -> u32 {
            let line = text
                .lines()
                .find(|l| l.split_whitespace().nth(1) == Some(name))
                .unwrap_or_else(|| panic!("{name} missing"));
            line.split_whitespace()
                .nth(2)
                .unwrap()
                .trim_end_matches('u')
                .parse()
                .unwrap()
        };
        assert_eq!(get("AFDEP_ROUTE_OK"), c::OK);
        assert_eq!(get("AFDEP_ROUTE_DUPLICATE"), c::DUPLICATE);
        assert_eq!(get("AFDEP_ROUTE_NEGATIVE"), c::NEGATIVE);
        assert_eq!(get("AFDEP_ROUTE_WIDE"), c::WIDE);
        assert_eq!(get("AFDEP_ROUTE_DUMMY"), c::DUMMY);
        assert_eq!(get("AFDEP_ROUTE_NON_FINITE_WEIGHT"), c::NON_FINITE_WEIGHT);
        assert_eq!(get("AFDEP_ROUTE_OVER_CAPACITY"), c::OVER_CAPACITY);
        assert_eq!(get("AFDEP_ROUTE_MALFORMED"), c::MALFORMED);
        assert_eq!(get("AFDEP_ROUTE_NON_FINITE_PAYLOAD"), c::NON_FINITE_PAYLOAD);
        assert_eq!(get("AFDEP_ROUTE_NON_FINITE_LOGIT"), c::NON_FINITE_LOGIT);
        assert_eq!(
            get("AFDEP_ROUTE_ERROR_WORDS") as usize,
            afdep_core::error::ROUTE_ERROR_WORDS
        );
        assert_eq!(
            get("AFDEP_ROUTE_STATE_WORDS") as usize,
            crate::ops::validate::STATE_WORDS
        );
    }
}
