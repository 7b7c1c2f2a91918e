//! The skip rule of the GPU tests, one copy for every crate.
//!
//! A GPU test on a machine without a GPU (no driver, no NCCL, no peer access) prints
//! `SKIP: <reason>` and passes; the test runners count those lines. On the GPU machine the run
//! scripts set `AFDEP_REQUIRE_GPU=1`, which turns every such skip into a failure, so a broken
//! setup cannot pass as skipped.

use std::fmt::Display;

/// The environment variable that turns a missing GPU into a test failure.
pub const REQUIRE_GPU: &str = "AFDEP_REQUIRE_GPU";

/// Whether [`REQUIRE_GPU`] is set to anything but empty or `0`.
pub fn gpu_required() -> bool {
    std::env::var(REQUIRE_GPU).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Skips the calling test because `what` is unavailable (`why`): prints `SKIP: <why>`, or
/// panics when [`gpu_required`].
///
/// # Panics
/// When [`REQUIRE_GPU`] is set.
pub fn skip_unavailable(what: &str, why: impl Display) {
    if gpu_required() {
        panic!("{REQUIRE_GPU} is set, but {what} is unavailable: {why}");
    }
    println!("SKIP: {why}");
}
