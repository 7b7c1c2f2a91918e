//! afdep-moe: roles and exchange engines.
//!
//! - [`staged`]: the **staged exchange engine**, host-driven over any
//!   [`afdep_transport::Transport`]: attention ranks validate and route, counts go first (one
//!   all-gather), token rows go by all-to-all-v in the compact layout, FFN ranks expand them
//!   (the payload-first copy epilogue) and run their experts, results come back by a second
//!   all-to-all-v and are combined in the fixed order of docs/design.md, "Specification: AFD
//!   exchange". Its results are bit-identical to [`afdep_core::oracle::exchange`].
//! - [`fused`]: the **fused exchange engine** over [`afdep_transport::NvlinkIpc`]: every round
//!   is a device round (validation, arm, counts, plan, rows, epilogue and combine are GPU
//!   kernels that store into the peers' symmetric workspaces and wait on flags with a bound),
//!   with device experts or, in `FusedEngine::round`, the caller's host experts between the
//!   epilogue and the combine; bit-identical to the staged engine and the oracle.
//! - `nccl_device` (cargo feature `nccl`): the **NCCL device engine**, the exchange round over
//!   NCCL with packing, expansion, experts and combine on the GPU and grouped
//!   `ncclSend`/`ncclRecv` of capacity-padded slabs (capturable in a CUDA graph); bit-identical
//!   to the oracle.
//! - [`layer`]: [`MoeLayer`], the dropless MoE layer on one GPU (forward and train step, four
//!   dispatch strategies) on the grouped GEMMs of afdep-kernels.
//! - [`reference`](mod@reference): [`reference::ReferenceLayer`], the simple GPU reference of the
//!   layer (untuned f32 kernels, checked against the oracle) and [`reference::compare`], the
//!   benchmark's error columns computed on the device.
//! - [`round`]: the vocabulary of a round shared by the engines ([`ExpertFn`], [`RoundOutput`],
//!   [`DispatchArm`], ...), the [`ExchangeEngine`] trait both engines implement, and
//!   [`run_group`], one engine per rank of an in-process group on threads.
//! - [`pipeline`]: the microbatch pipeline ([`PipelineRank`]): a layer step's exchange as M
//!   microbatches over K fused engines per rank, microbatch i+1's dispatch overlapping
//!   microbatch i's experts on the GPU, bit-identical to one device round per microbatch.
//! - [`error`]: the engine's typed errors.
//! - [`external`]: a [`MoeLayer`] step on buffers owned by the caller, ordered on the caller's
//!   CUDA stream (the Python bindings).
//! - [`timing`]: CUDA-event timing (pre-created events, warm-ups, medians) shared by the
//!   `afdep` tool and the `bench_layer` program.

pub mod accuracy;
pub mod error;
pub mod external;
pub mod fused;
pub mod layer;
#[cfg(feature = "nccl")]
pub mod nccl_device;
pub mod pipeline;
pub mod reference;
pub mod round;
pub mod staged;
pub mod timing;

/// The faults of [`FusedEngine::set_fault`] (feature `fault-injection`, tests only).
#[cfg(feature = "fault-injection")]
pub use afdep_kernels::ops::fault::Fault;
pub use error::ExchangeError;
pub use fused::{
    BorrowedRound, DeviceExperts, DeviceRoundOptions, FusedEngine, FusedGraph, StartGate,
};
pub use layer::{DeviceParams, Dispatch, LayerGpuError, LayerRouting, MoeLayer};
#[cfg(feature = "nccl")]
pub use nccl_device::NcclDeviceEngine;
pub use pipeline::{PipelineConfig, PipelineError, PipelineOutput, PipelineRank};
pub use round::{
    DevicePhaseTimes, DispatchArm, ExchangeEngine, ExpertFn, PhaseSpan, PhaseTimes, RankOutcome,
    RoundArm, RoundOutput, RoundTrace, TracePhase, run_group,
};
pub use staged::StagedEngine;
