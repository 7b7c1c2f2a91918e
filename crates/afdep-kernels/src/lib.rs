//! afdep-kernels: the CUDA C++ kernels of afdep, their JIT compilation, and typed launchers.
//!
//! - [`sources`]: the embedded CUDA sources (`cuda/`: `common/` PTX wrappers and bounded
//!   waits, `layout/` structs shared with the host, one file per kernel phase), the
//!   [`KernelId`]s, the specialisations ([`ModuleSpec`]) and the [`source_digest`];
//! - [`jit`]: NVRTC compilation to a cubin for the device's architecture (`sm_90a` on
//!   Hopper), specialised by `-D` constants, through the on-disk [`cache`];
//! - [`resources`]: registers, shared memory and spills from the ptxas report;
//! - [`context`]: [`GpuContext`], one device and stream with its lazily loaded modules;
//! - [`ops`]: one typed launcher per kernel: the router, route validation, the dispatch
//!   layout, permute and un-permute; with the cargo feature `fault-injection` (tests only),
//!   `ops::fault`: faults injected into the fused exchange kernels (`GpuContext::set_fault`).
//!
//! Every kernel reproduces `afdep_core`'s semantics: route validation and the layout bit for
//! bit, the un-permute's weighted sum bit for bit, the router within the tolerance documented
//! in [`ops::router`].
//!
//! Nothing here needs a GPU to build or to compile kernels (`cargo xtask kernels`); CUDA
//! libraries are loaded at run time, and their absence is a typed error
//! ([`KernelError::NoDriver`], [`KernelError::NoNvrtc`]), never a panic.

pub mod cache;
pub mod context;
pub mod error;
pub mod jit;
pub mod ops;
pub mod resources;
pub mod sources;

pub use cache::{CacheSetting, KernelCache};
pub use context::{GpuContext, quiet_stream};
pub use error::KernelError;
pub use jit::{Arch, CompiledModule, Jit, JitOptions};
pub use ops::DeviceRoutes;
pub use ops::layout::{ExpertLayout, expert_layout};
pub use ops::permute::{CombineOrder, permute, unpermute};
pub use ops::router::{LogitsDims, LogitsKernel, TopkDims, router, router_logits, router_topk};
pub use ops::validate::{RouteValidator, validate_routes};
pub use resources::KernelResources;
pub use sources::{KernelId, ModuleSpec, SourceFile, source_digest};

/// Re-export of cudarc, so users name the same versions of its types.
pub use cudarc;
