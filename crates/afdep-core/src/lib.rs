//! afdep-core: the ground every other afdep crate stands on.
//!
//! No GPU and no I/O live here. The crate holds:
//! - [`config`]: layer shapes and exchange configuration (serde), with typed validation;
//! - [`topology`]: attention/FFN roles (`3A:1F`, classic expert parallelism) and expert placement;
//! - [`route`]: the reference router and route validation (every rejected class of docs/design.md,
//!   "Specification: Routes");
//! - [`layout`]: dispatch layout (counts, 64-bit prefix sums) and the payload-first and
//!   count-first plans;
//! - [`fingerprint`]: the configuration fingerprint that ranks compare at initialisation;
//! - [`fp8`]: the e4m3 payload format, its host encoder and decoder, and row quantisation;
//! - [`oracle`]: the CPU reference of every computation (the MoE layer forward and train step,
//!   the AFD exchange), against which every other path is checked;
//! - [`tensor`]: bf16 helpers and seeded random inputs;
//! - [`testing`]: the GPU tests' skip rule (`AFDEP_REQUIRE_GPU`), shared by every crate's tests.

pub mod config;
pub mod error;
pub mod fingerprint;
pub mod fp8;
pub mod layout;
pub mod oracle;
pub mod route;
pub mod tensor;
pub mod testing;
pub mod topology;

pub use config::{CombinePartials, ExchangeConfig, ExchangeKnobs, LayerShape, PayloadKind};
pub use error::{ConfigError, RouteError};
pub use half::bf16;
pub use route::Routes;
pub use topology::{ExpertPlacement, Role, Topology};
