//! [`HostTcp`]: a [`Transport`] over the [`Bootstrap`] itself: ranks are processes, memory is
//! host memory, and everything is relayed through rank 0.
//!
//! Slow (every byte crosses rank 0 twice) but dependency-free: the multi-process fallback and the
//! test bed of multi-process code paths. Every contribution carries a status byte, so a rank with
//! invalid arguments still takes part in the operation and its peers fail it with
//! [`PeerFailed`](TransportError::PeerFailed) at once; size mismatches are detected on the
//! receiving rank after a complete exchange, so both leave the group usable. A timeout or a
//! closed connection closes the underlying bootstrap (see [its docs](crate::Bootstrap)).

use std::time::Duration;

use crate::{
    Bootstrap, HostBuffer, Span, Transport, TransportError, TransportKind, concat_framed,
    framed_all_to_all_v,
};

const OK: u8 = 0;
const FAILED: u8 = 1;

/// A [`Transport`] over a [`Bootstrap`]; see the [module docs](self).
#[derive(Debug)]
pub struct HostTcp {
    boot: Bootstrap,
}

impl HostTcp {
    /// Wraps a formed bootstrap.
    pub fn new(boot: Bootstrap) -> HostTcp {
        HostTcp { boot }
    }

    /// The bootstrap underneath (for set-up blobs of other kinds).
    pub fn bootstrap_mut(&mut self) -> &mut Bootstrap {
        &mut self.boot
    }

    /// Unwraps the bootstrap.
    pub fn into_bootstrap(self) -> Bootstrap {
        self.boot
    }
}

fn with_status(status: u8, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + body.len());
    v.push(status);
    v.extend_from_slice(body);
    v
}

/// Splits a contribution into its body, or the peer's failure.
fn body_of<'a>(
    op: &'static str,
    rank: usize,
    peer: usize,
    blob: &'a [u8],
) -> Result<&'a [u8], TransportError> {
    match blob.split_first() {
        Some((&OK, body)) => Ok(body),
        Some((&FAILED, why)) => Err(TransportError::PeerFailed {
            op,
            rank,
            peer,
            why: String::from_utf8_lossy(why).into_owned(),
        }),
        _ => Err(TransportError::Protocol {
            op,
            rank,
            peer: Some(peer),
            why: "contribution without a status byte".into(),
        }),
    }
}

impl Transport for HostTcp {
    type Buffer = HostBuffer;

    fn rank(&self) -> usize {
        self.boot.rank()
    }

    fn world_size(&self) -> usize {
        self.boot.world_size()
    }

    fn kind(&self) -> TransportKind {
        TransportKind::HostTcp
    }

    fn timeout(&self) -> Duration {
        self.boot.timeout()
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.boot.set_timeout(timeout);
    }

    fn alloc(&mut self, bytes: usize) -> Result<HostBuffer, TransportError> {
        Ok(HostBuffer::zeroed(self.rank(), bytes))
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        const OP: &str = "all_gather";
        let me = self.rank();
        let all = self.boot.all_gather(&with_status(OK, mine))?;
        concat_framed(OP, me, mine.len(), &all, |p, b| body_of(OP, me, p, b))
    }

    fn all_to_all_v(
        &mut self,
        send: &HostBuffer,
        send_spans: &[Span],
        recv: &mut HostBuffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        const OP: &str = "all_to_all_v";
        let me = self.rank();
        framed_all_to_all_v(
            self,
            send,
            send_spans,
            recv,
            recv_spans,
            |ok, b| with_status(if ok { OK } else { FAILED }, b),
            |t, out| t.boot.all_to_all(&out),
            |p, b| body_of(OP, me, p, b),
        )
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.boot.barrier()
    }
}
