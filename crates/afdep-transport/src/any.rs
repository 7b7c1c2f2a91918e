//! Picking a transport at run time: [`TransportKind::check_available`] says whether a kind can be
//! used in this build and on this machine (and why not), and [`AnyTransport`] is one
//! [`Transport`] type over every kind, built from a [`TransportKind`] value, so that swapping
//! transports is a config value and not a code change.
//!
//! ```no_run
//! use afdep_transport::{AnyTransport, Transport, TransportKind, TransportOptions};
//! # fn main() -> Result<(), afdep_transport::TransportError> {
//! let kind: TransportKind = "tcp".parse().expect("a transport name");
//! kind.check_available(2)?; // a typed `Unavailable { kind, why }` if it cannot be used
//! // rank, world size and rendezvous from the environment (`afdep launch` sets them)
//! let mut t = AnyTransport::from_env(kind, &TransportOptions::default())?;
//! t.barrier()?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use crate::{
    Bootstrap, DEFAULT_TIMEOUT, HostBuffer, HostTcp, Loopback, Span, Transport, TransportBuffer,
    TransportError, TransportKind,
};

/// Settings of [`AnyTransport::connect`] / [`AnyTransport::from_env`]. Fields that do not apply
/// to the chosen kind are ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportOptions {
    /// The bound of every wait (bootstrap and transport).
    pub timeout: Duration,
    /// UCX: the UCX transports to use (`UCX_TLS` syntax: `tcp`, `shm`, `tcp,shm`); `None` leaves
    /// UCX's choice (and the `UCX_TLS` environment variable) alone.
    pub ucx_tls: Option<String>,
    /// NCCL, and device buffers: the CUDA device of this rank; `None` picks
    /// `rank % device count`.
    pub device: Option<usize>,
    /// TCP and UCX: device buffers staged through host memory
    /// ([`DeviceStaged`](crate::DeviceStaged), cargo feature `cuda`) instead of host buffers.
    pub device_buffers: bool,
}

impl Default for TransportOptions {
    fn default() -> TransportOptions {
        TransportOptions {
            timeout: DEFAULT_TIMEOUT,
            ucx_tls: None,
            device: None,
            device_buffers: false,
        }
    }
}

impl TransportKind {
    /// Whether this kind can be used for a group of `world_size` ranks in this build and on this
    /// machine; the error is [`Unavailable`](TransportError::Unavailable) with the reason
    /// (feature not built in, library missing, no GPU, too few GPUs, not implemented yet).
    ///
    /// Loopback and TCP are always available. UCX needs the cargo feature `ucx`. NCCL needs the
    /// cargo feature `nccl`, a loadable NCCL library (`libnccl.so` or `libnccl.so.2`), the NVIDIA
    /// driver and one GPU per rank of this machine (NCCL refuses two ranks on one GPU).
    /// NVLink-IPC is not implemented on this branch.
    pub fn check_available(self, world_size: usize) -> Result<(), TransportError> {
        let no = |why: String| Err(TransportError::Unavailable { kind: self, why });
        match self {
            TransportKind::Loopback | TransportKind::HostTcp => Ok(()),
            TransportKind::NvlinkIpc => no(
                "not built yet: the NVLink-IPC transport (CUDA IPC / peer access) is being \
                 implemented on another branch; use nccl, ucx or tcp"
                    .into(),
            ),
            TransportKind::Ucx => {
                if cfg!(feature = "ucx") {
                    Ok(())
                } else {
                    no(
                        "this build does not include it: rebuild with the cargo feature \
                        `afdep-transport/ucx` (for the afdep tool: `--features ucx`)"
                            .into(),
                    )
                }
            }
            TransportKind::Nccl => {
                #[cfg(feature = "nccl")]
                {
                    crate::nccl::probe(world_size).map(|_| ())
                }
                #[cfg(not(feature = "nccl"))]
                {
                    let _ = world_size;
                    no(
                        "this build does not include it: rebuild with the cargo feature \
                        `afdep-transport/nccl` (for the afdep tool: `--features nccl`)"
                            .into(),
                    )
                }
            }
        }
    }
}

/// Every transport behind one type: the [`Transport`] to use when the kind is a run-time value.
/// Built by [`AnyTransport::connect`] (over a formed [`Bootstrap`]) or
/// [`AnyTransport::from_env`]; [`Loopback`] ranks are threads of one process and come from
/// [`Loopback::group`], wrapped with `AnyTransport::Loopback`.
#[derive(Debug)]
pub enum AnyTransport {
    /// In-process ranks.
    Loopback(Loopback),
    /// Processes over TCP through the bootstrap.
    HostTcp(HostTcp),
    /// UCX tagged messages (feature `ucx`).
    #[cfg(feature = "ucx")]
    Ucx(crate::Ucx),
    /// NCCL on device memory (feature `nccl`).
    #[cfg(feature = "nccl")]
    Nccl(crate::Nccl),
    /// TCP with device buffers staged through host memory (feature `cuda`).
    #[cfg(feature = "cuda")]
    HostTcpDevice(crate::DeviceStaged<HostTcp>),
    /// UCX with device buffers staged through host memory (features `ucx` and `cuda`).
    #[cfg(all(feature = "ucx", feature = "cuda"))]
    UcxDevice(crate::DeviceStaged<crate::Ucx>),
}

/// The buffer of an [`AnyTransport`]: host memory, or (NCCL) device memory.
#[derive(Debug)]
pub enum AnyBuffer {
    /// Host memory (Loopback, TCP, UCX).
    Host(HostBuffer),
    /// Device memory (NCCL, and host transports with device buffers).
    #[cfg(feature = "cuda")]
    Device(crate::DeviceBuffer),
}

impl TransportBuffer for AnyBuffer {
    fn len(&self) -> usize {
        match self {
            AnyBuffer::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            AnyBuffer::Device(b) => b.len(),
        }
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        match self {
            AnyBuffer::Host(b) => b.write(offset, src),
            #[cfg(feature = "cuda")]
            AnyBuffer::Device(b) => b.write(offset, src),
        }
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        match self {
            AnyBuffer::Host(b) => b.read(offset, dst),
            #[cfg(feature = "cuda")]
            AnyBuffer::Device(b) => b.read(offset, dst),
        }
    }
}

impl AnyTransport {
    /// Builds a transport of `kind` over a formed bootstrap (which it keeps). Checks
    /// [`TransportKind::check_available`] first; Loopback is not built this way (its ranks
    /// share a process: use [`Loopback::group`]), which is an
    /// [`InvalidArgument`](TransportError::InvalidArgument).
    pub fn connect(
        kind: TransportKind,
        boot: Bootstrap,
        options: &TransportOptions,
    ) -> Result<AnyTransport, TransportError> {
        let rank = boot.rank();
        kind.check_available(boot.world_size())?;
        if options.device_buffers && !matches!(kind, TransportKind::HostTcp | TransportKind::Ucx) {
            return Err(TransportError::InvalidArgument {
                op: "connect",
                rank,
                why: format!("device_buffers is for tcp and ucx; {kind} has its own memory"),
            });
        }
        if options.device_buffers && !cfg!(feature = "cuda") {
            return Err(TransportError::Unavailable {
                kind,
                why: "device buffers need the cargo feature `afdep-transport/cuda` (implied by \
                      `nccl`)"
                    .into(),
            });
        }
        match kind {
            #[cfg(feature = "cuda")]
            TransportKind::HostTcp if options.device_buffers => Ok(AnyTransport::HostTcpDevice(
                crate::DeviceStaged::new(HostTcp::new(boot), options.device)?,
            )),
            TransportKind::HostTcp => Ok(AnyTransport::HostTcp(HostTcp::new(boot))),
            #[cfg(feature = "ucx")]
            TransportKind::Ucx => {
                let o = match &options.ucx_tls {
                    Some(tls) => crate::UcxOptions::with_tls(tls),
                    None => crate::UcxOptions::default(),
                };
                let t = crate::Ucx::new(boot, &o)?;
                #[cfg(feature = "cuda")]
                if options.device_buffers {
                    return Ok(AnyTransport::UcxDevice(crate::DeviceStaged::new(
                        t,
                        options.device,
                    )?));
                }
                Ok(AnyTransport::Ucx(t))
            }
            #[cfg(feature = "nccl")]
            TransportKind::Nccl => Ok(AnyTransport::Nccl(crate::Nccl::new(boot, options.device)?)),
            TransportKind::Loopback => Err(TransportError::InvalidArgument {
                op: "connect",
                rank,
                why: "loopback ranks are threads of one process: build them with Loopback::group"
                    .into(),
            }),
            // unavailable kinds were refused by check_available above
            other => Err(TransportError::Unavailable {
                kind: other,
                why: format!("not available in this build (rank {rank}, {options:?})"),
            }),
        }
    }

    /// [`connect`](AnyTransport::connect) over [`Bootstrap::from_env`] (rank, world size and
    /// rendezvous address from the environment that `afdep launch` sets), with
    /// `options.timeout`.
    pub fn from_env(
        kind: TransportKind,
        options: &TransportOptions,
    ) -> Result<AnyTransport, TransportError> {
        let env = crate::RendezvousEnv::from_env()?;
        kind.check_available(env.world_size)?;
        let boot = Bootstrap::connect(env.addr, env.rank, env.world_size, options.timeout)?;
        AnyTransport::connect(kind, boot, options)
    }
}

/// Applies `$body` to the inner transport, whatever its kind.
macro_rules! each {
    ($self:expr, $t:ident => $body:expr) => {
        match $self {
            AnyTransport::Loopback($t) => $body,
            AnyTransport::HostTcp($t) => $body,
            #[cfg(feature = "ucx")]
            AnyTransport::Ucx($t) => $body,
            #[cfg(feature = "nccl")]
            AnyTransport::Nccl($t) => $body,
            #[cfg(feature = "cuda")]
            AnyTransport::HostTcpDevice($t) => $body,
            #[cfg(all(feature = "ucx", feature = "cuda"))]
            AnyTransport::UcxDevice($t) => $body,
        }
    };
}

fn wrong_buffer(rank: usize) -> TransportError {
    TransportError::InvalidArgument {
        op: "all_to_all_v",
        rank,
        why: "the buffers were not allocated by this transport (host and device buffers mixed)"
            .into(),
    }
}

impl Transport for AnyTransport {
    type Buffer = AnyBuffer;

    fn rank(&self) -> usize {
        each!(self, t => t.rank())
    }

    fn world_size(&self) -> usize {
        each!(self, t => t.world_size())
    }

    fn kind(&self) -> TransportKind {
        each!(self, t => t.kind())
    }

    fn timeout(&self) -> Duration {
        each!(self, t => t.timeout())
    }

    fn set_timeout(&mut self, timeout: Duration) {
        each!(self, t => t.set_timeout(timeout))
    }

    fn alloc(&mut self, bytes: usize) -> Result<AnyBuffer, TransportError> {
        match self {
            AnyTransport::Loopback(t) => t.alloc(bytes).map(AnyBuffer::Host),
            AnyTransport::HostTcp(t) => t.alloc(bytes).map(AnyBuffer::Host),
            #[cfg(feature = "ucx")]
            AnyTransport::Ucx(t) => t.alloc(bytes).map(AnyBuffer::Host),
            #[cfg(feature = "nccl")]
            AnyTransport::Nccl(t) => t.alloc(bytes).map(AnyBuffer::Device),
            #[cfg(feature = "cuda")]
            AnyTransport::HostTcpDevice(t) => t.alloc(bytes).map(AnyBuffer::Device),
            #[cfg(all(feature = "ucx", feature = "cuda"))]
            AnyTransport::UcxDevice(t) => t.alloc(bytes).map(AnyBuffer::Device),
        }
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        each!(self, t => t.all_gather(mine))
    }

    fn all_to_all_v(
        &mut self,
        send: &AnyBuffer,
        send_spans: &[Span],
        recv: &mut AnyBuffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        let rank = self.rank();
        match (self, send, recv) {
            (AnyTransport::Loopback(t), AnyBuffer::Host(s), AnyBuffer::Host(r)) => {
                t.all_to_all_v(s, send_spans, r, recv_spans)
            }
            (AnyTransport::HostTcp(t), AnyBuffer::Host(s), AnyBuffer::Host(r)) => {
                t.all_to_all_v(s, send_spans, r, recv_spans)
            }
            #[cfg(feature = "ucx")]
            (AnyTransport::Ucx(t), AnyBuffer::Host(s), AnyBuffer::Host(r)) => {
                t.all_to_all_v(s, send_spans, r, recv_spans)
            }
            #[cfg(feature = "nccl")]
            (AnyTransport::Nccl(t), AnyBuffer::Device(s), AnyBuffer::Device(r)) => {
                t.all_to_all_v(s, send_spans, r, recv_spans)
            }
            #[cfg(feature = "cuda")]
            (AnyTransport::HostTcpDevice(t), AnyBuffer::Device(s), AnyBuffer::Device(r)) => {
                t.all_to_all_v(s, send_spans, r, recv_spans)
            }
            #[cfg(all(feature = "ucx", feature = "cuda"))]
            (AnyTransport::UcxDevice(t), AnyBuffer::Device(s), AnyBuffer::Device(r)) => {
                t.all_to_all_v(s, send_spans, r, recv_spans)
            }
            #[allow(unreachable_patterns)]
            _ => Err(wrong_buffer(rank)),
        }
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        each!(self, t => t.barrier())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_kinds_are_available_and_nvlink_says_why_not() {
        TransportKind::Loopback.check_available(4).unwrap();
        TransportKind::HostTcp.check_available(4).unwrap();
        let e = TransportKind::NvlinkIpc.check_available(2).unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::Unavailable {
                    kind: TransportKind::NvlinkIpc,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("not built yet"), "{e}");
        #[cfg(not(feature = "ucx"))]
        {
            let e = TransportKind::Ucx.check_available(2).unwrap_err();
            assert!(e.to_string().contains("feature"), "{e}");
        }
        #[cfg(not(feature = "nccl"))]
        {
            let e = TransportKind::Nccl.check_available(1).unwrap_err();
            assert!(e.to_string().contains("afdep-transport/nccl"), "{e}");
        }
    }

    #[test]
    fn loopback_wrapped_runs_a_collective_and_refuses_foreign_buffers() {
        let group = Loopback::group(2, Duration::from_secs(10));
        let outs: Vec<Result<Vec<u8>, TransportError>> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .into_iter()
                .map(|l| {
                    s.spawn(move || {
                        let mut t = AnyTransport::Loopback(l);
                        let me = t.rank() as u8;
                        let send = AnyBuffer::Host(HostBuffer::from_vec(me.into(), vec![me; 2]));
                        let mut recv = t.alloc(2)?;
                        let spans = [Span::new(0, 1), Span::new(1, 1)];
                        t.all_to_all_v(&send, &spans, &mut recv, &spans)?;
                        let mut got = vec![0; 2];
                        recv.read(0, &mut got)?;
                        Ok(got)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in outs {
            assert_eq!(o.unwrap(), vec![0, 1]);
        }
    }

    #[test]
    fn loopback_cannot_be_connected_over_a_bootstrap() {
        let l =
            Bootstrap::listen("127.0.0.1:0".parse().unwrap(), 1, Duration::from_secs(5)).unwrap();
        let boot = l.accept().unwrap();
        let e = AnyTransport::connect(TransportKind::Loopback, boot, &TransportOptions::default())
            .unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    }
}
