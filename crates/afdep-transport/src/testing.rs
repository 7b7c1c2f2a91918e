//! Test support for the GPU tests of afdep-transport and of the crates built on it: the
//! in-process [`NvlinkIpc`] group with the skip rule of [`afdep_core::testing`].

use crate::{NvlinkIpc, NvlinkOptions, TransportError};

/// `n` in-process NvlinkIpc ranks on device 0 with `opts`, or `None` after printing
/// `SKIP: <reason>` when NvlinkIpc is unavailable (no driver, no peer access); with
/// `AFDEP_REQUIRE_GPU` set that is a panic instead.
///
/// # Panics
/// When the group cannot be made for another reason than [`TransportError::Unavailable`], or
/// when it is unavailable and `AFDEP_REQUIRE_GPU` is set.
pub fn nvlink_group(n: usize, opts: NvlinkOptions) -> Option<Vec<NvlinkIpc>> {
    match NvlinkIpc::group_on_device(n, 0, opts) {
        Ok(g) => Some(g),
        Err(TransportError::Unavailable { why, .. }) => {
            afdep_core::testing::skip_unavailable("NvlinkIpc", why);
            None
        }
        Err(e) => panic!("creating the NvlinkIpc group failed: {e}"),
    }
}
