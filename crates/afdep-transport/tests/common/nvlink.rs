//! The NvlinkIpc group of the GPU tests, with their skip convention. Also included by the
//! exchange tests of afdep-moe (`crates/afdep-moe/tests/exchange_common`), so that both crates'
//! GPU tests skip and fail alike.

use afdep_transport::{NvlinkIpc, NvlinkOptions, TransportError};

/// `n` in-process NvlinkIpc ranks on device 0 with `opts`, or `None` after printing
/// `SKIP: <reason>` when there is no usable GPU (a panic instead with `AFDEP_REQUIRE_GPU`).
pub fn nvlink_group(n: usize, opts: NvlinkOptions) -> Option<Vec<NvlinkIpc>> {
    match NvlinkIpc::group_on_device(n, 0, opts) {
        Ok(g) => Some(g),
        Err(TransportError::Unavailable { why, .. }) => {
            if std::env::var("AFDEP_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0") {
                panic!("AFDEP_REQUIRE_GPU is set, but NvlinkIpc is unavailable: {why}");
            }
            println!("SKIP: {why}");
            None
        }
        Err(e) => panic!("creating the NvlinkIpc group failed: {e}"),
    }
}
