//! Picking a transport at run time: [`TransportKind::check_available`] and
//! [`TransportKind::check_placement`] say whether a kind can be used in this build and on this
//! machine (and why not), and [`AnyTransport`] is one [`Transport`] type over every kind, built
//! from a [`TransportKind`] value or a [`TransportConfig`] (the `transport` field of a config
//! file), so that swapping transports is a config value and not a code change.
//!
//! Ranks are threads of one process ([`AnyTransport::group`]: Loopback, and NvlinkIpc ranks
//! sharing one GPU or spread over several) or processes ([`AnyTransport::connect`] over a formed
//! [`Bootstrap`], or [`AnyTransport::from_env`] under `afdep launch`: TCP, UCX, NCCL, and
//! NvlinkIpc over CUDA IPC).
//!
//! # Devices of the GPU transports
//!
//! NCCL, NvlinkIpc and device buffers put rank r on device [`TransportOptions::device`] when it
//! is set, else on device `r % device count`. NvlinkIpc ranks may share a GPU (the single-GPU
//! rank emulation); [`TransportOptions::one_gpu_per_rank`] asks for one GPU each and makes too
//! few GPUs an [`Unavailable`](TransportError::Unavailable) error. NCCL always needs one GPU
//! per rank.
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

use serde::{Deserialize, Serialize};

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
    /// (`DeviceStaged`, cargo feature `cuda`) instead of host buffers.
    pub device_buffers: bool,
    /// NvlinkIpc: rank r on device r, and [`Unavailable`](TransportError::Unavailable) when the
    /// machine has fewer GPUs than ranks (without it, ranks may share a GPU).
    pub one_gpu_per_rank: bool,
    /// NvlinkIpc: bytes of the staging area of `all_to_all_v` in every rank's window (the most
    /// one rank receives in one operation).
    pub staging_bytes: usize,
    /// NvlinkIpc: bytes of the workspace of the fused kernels in every rank's window (at least
    /// `FusedEngine::workspace_bytes` of the exchange config for the fused engine).
    pub workspace_bytes: usize,
}

/// [`TransportOptions::staging_bytes`] and [`TransportOptions::workspace_bytes`] unless set:
/// 64 MiB each.
pub const DEFAULT_WINDOW_BYTES: usize = 64 << 20;

impl Default for TransportOptions {
    fn default() -> TransportOptions {
        TransportOptions {
            timeout: DEFAULT_TIMEOUT,
            ucx_tls: None,
            device: None,
            device_buffers: false,
            one_gpu_per_rank: false,
            staging_bytes: DEFAULT_WINDOW_BYTES,
            workspace_bytes: DEFAULT_WINDOW_BYTES,
        }
    }
}

impl TransportOptions {
    /// The device of `rank` of `world` ranks on a machine with `devices` GPUs (see the
    /// module docs), or [`Unavailable`](TransportError::Unavailable) naming what is
    /// missing.
    pub fn device_of(
        &self,
        kind: TransportKind,
        rank: usize,
        world: usize,
        devices: usize,
    ) -> Result<usize, TransportError> {
        let no = |why: String| Err(TransportError::Unavailable { kind, why });
        if devices == 0 {
            return no("the NVIDIA driver sees no CUDA device".into());
        }
        if self.one_gpu_per_rank {
            if world > devices {
                return no(format!(
                    "too few GPUs: {world} ranks with one GPU per rank need {world}, the driver \
                     sees {devices}"
                ));
            }
            if let Some(d) = self.device {
                return no(format!(
                    "one GPU per rank and device {d} for every rank were both requested"
                ));
            }
            return Ok(rank);
        }
        match self.device {
            Some(d) if d >= devices => no(format!(
                "too few GPUs: device {d} requested, the driver sees {devices}"
            )),
            Some(d) => Ok(d),
            None => Ok(rank % devices),
        }
    }
}

/// The `transport` field of a config file: a kind alone (`"nvlink"`), or a table with the kind
/// and its options. Deserialized with serde (TOML, JSON, ...); turned into a transport by
/// [`AnyTransport::group_from_config`] (ranks as threads) or [`AnyTransport::from_config_env`]
/// (one process per rank under `afdep launch`).
///
/// ```toml
/// [transport]
/// kind = "nvlink"        # loopback | tcp | nvlink | nccl | ucx
/// one_gpu_per_rank = false
/// timeout_ms = 30000
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TransportConfig {
    /// Only the kind; every option at its default.
    Kind(TransportKind),
    /// The kind and options.
    Table(TransportTable),
}

/// The table form of [`TransportConfig`]; absent fields take [`TransportOptions::default`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportTable {
    /// The transport.
    pub kind: TransportKind,
    /// [`TransportOptions::timeout`], in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// [`TransportOptions::ucx_tls`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ucx_tls: Option<String>,
    /// [`TransportOptions::device`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<usize>,
    /// [`TransportOptions::device_buffers`].
    #[serde(default)]
    pub device_buffers: bool,
    /// [`TransportOptions::one_gpu_per_rank`].
    #[serde(default)]
    pub one_gpu_per_rank: bool,
    /// [`TransportOptions::staging_bytes`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_bytes: Option<usize>,
    /// [`TransportOptions::workspace_bytes`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_bytes: Option<usize>,
}

impl TransportConfig {
    /// The transport kind.
    pub fn kind(&self) -> TransportKind {
        match self {
            TransportConfig::Kind(k) => *k,
            TransportConfig::Table(t) => t.kind,
        }
    }

    /// The options it sets, the others at their defaults.
    pub fn options(&self) -> TransportOptions {
        let d = TransportOptions::default();
        match self {
            TransportConfig::Kind(_) => d,
            TransportConfig::Table(t) => TransportOptions {
                timeout: t.timeout_ms.map_or(d.timeout, Duration::from_millis),
                ucx_tls: t.ucx_tls.clone(),
                device: t.device,
                device_buffers: t.device_buffers,
                one_gpu_per_rank: t.one_gpu_per_rank,
                staging_bytes: t.staging_bytes.unwrap_or(d.staging_bytes),
                workspace_bytes: t.workspace_bytes.unwrap_or(d.workspace_bytes),
            },
        }
    }
}

impl Serialize for TransportKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for TransportKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
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
    /// NVLink-IPC needs the cargo feature `nvlink` (the afdep tool has it: afdep-moe's fused
    /// engine needs it), the NVIDIA driver and a GPU; its ranks may share one GPU, so the
    /// number of GPUs it needs depends on the placement: see
    /// [`check_placement`](TransportKind::check_placement).
    pub fn check_available(self, world_size: usize) -> Result<(), TransportError> {
        let no = |why: String| Err(TransportError::Unavailable { kind: self, why });
        match self {
            TransportKind::Loopback | TransportKind::HostTcp => Ok(()),
            TransportKind::NvlinkIpc => {
                #[cfg(feature = "nvlink")]
                {
                    crate::nvlink::probe_driver().map(|_| ())
                }
                #[cfg(not(feature = "nvlink"))]
                {
                    no(
                        "this build does not include it: rebuild with the cargo feature \
                        `afdep-transport/nvlink` (the afdep tool always has it)"
                            .into(),
                    )
                }
            }
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

impl TransportKind {
    /// [`check_available`](TransportKind::check_available), then, for NvlinkIpc, whether the
    /// machine has the GPUs that `options` place `world_size` ranks on
    /// ([`TransportOptions::device_of`]): [`Unavailable`](TransportError::Unavailable) with
    /// "too few GPUs" otherwise.
    pub fn check_placement(
        self,
        world_size: usize,
        options: &TransportOptions,
    ) -> Result<(), TransportError> {
        self.check_available(world_size)?;
        #[cfg(feature = "nvlink")]
        if self == TransportKind::NvlinkIpc {
            let devices = crate::nvlink::probe_driver()?;
            for r in 0..world_size {
                options.device_of(self, r, world_size, devices)?;
            }
        }
        let _ = options;
        Ok(())
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
    /// NVLink-IPC: device memory, peer stores (feature `nvlink`; boxed, it is the largest). The
    /// fused engine takes the [`NvlinkIpc`](crate::NvlinkIpc) itself:
    /// [`AnyTransport::into_nvlink`].
    #[cfg(feature = "nvlink")]
    Nvlink(Box<crate::NvlinkIpc>),
}

/// The buffer of an [`AnyTransport`]: host memory, or (NCCL) device memory.
#[derive(Debug)]
pub enum AnyBuffer {
    /// Host memory (Loopback, TCP, UCX).
    Host(HostBuffer),
    /// Device memory (NCCL, and host transports with device buffers).
    #[cfg(feature = "cuda")]
    Device(crate::DeviceBuffer),
    /// Device memory of an NvlinkIpc rank.
    #[cfg(feature = "nvlink")]
    Nvlink(crate::NvlinkBuffer),
}

impl TransportBuffer for AnyBuffer {
    fn len(&self) -> usize {
        match self {
            AnyBuffer::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            AnyBuffer::Device(b) => b.len(),
            #[cfg(feature = "nvlink")]
            AnyBuffer::Nvlink(b) => b.len(),
        }
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        match self {
            AnyBuffer::Host(b) => b.write(offset, src),
            #[cfg(feature = "cuda")]
            AnyBuffer::Device(b) => b.write(offset, src),
            #[cfg(feature = "nvlink")]
            AnyBuffer::Nvlink(b) => b.write(offset, src),
        }
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        match self {
            AnyBuffer::Host(b) => b.read(offset, dst),
            #[cfg(feature = "cuda")]
            AnyBuffer::Device(b) => b.read(offset, dst),
            #[cfg(feature = "nvlink")]
            AnyBuffer::Nvlink(b) => b.read(offset, dst),
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
        kind.check_placement(boot.world_size(), options)?;
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
            #[cfg(feature = "nvlink")]
            TransportKind::NvlinkIpc => {
                let devices = crate::nvlink::probe_driver()?;
                let ordinal = options.device_of(kind, rank, boot.world_size(), devices)?;
                Ok(AnyTransport::Nvlink(Box::new(
                    crate::NvlinkIpc::from_bootstrap(boot, ordinal, nvlink_options(options))?,
                )))
            }
            TransportKind::Loopback => Err(TransportError::InvalidArgument {
                op: "connect",
                rank,
                why: "loopback ranks are threads of one process: build them with Loopback::group"
                    .into(),
            }),
            // unavailable kinds were refused by check_available above
            #[allow(unreachable_patterns)]
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
        kind.check_placement(env.world_size, options)?;
        let boot = Bootstrap::from_rendezvous(&env, options.timeout)?;
        AnyTransport::connect(kind, boot, options)
    }

    /// [`from_env`](AnyTransport::from_env) with the kind and options of a config file's
    /// `transport` field.
    pub fn from_config_env(config: &TransportConfig) -> Result<AnyTransport, TransportError> {
        AnyTransport::from_env(config.kind(), &config.options())
    }

    /// A group of `world_size` ranks as threads of this process (element r is rank r, to be
    /// moved into the thread that plays it): [`Loopback::group`], or an in-process
    /// [`NvlinkIpc`](crate::NvlinkIpc) group (devices per [`TransportOptions::device_of`];
    /// ranks sharing a GPU get one stream each). Other kinds connect per rank over a
    /// [`Bootstrap`] ([`AnyTransport::connect`]); for them this is an
    /// [`InvalidArgument`](TransportError::InvalidArgument).
    pub fn group(
        kind: TransportKind,
        world_size: usize,
        options: &TransportOptions,
    ) -> Result<Vec<AnyTransport>, TransportError> {
        kind.check_placement(world_size, options)?;
        match kind {
            TransportKind::Loopback => Ok(Loopback::group(world_size, options.timeout)
                .into_iter()
                .map(AnyTransport::Loopback)
                .collect()),
            #[cfg(feature = "nvlink")]
            TransportKind::NvlinkIpc => {
                let devices = crate::nvlink::probe_driver()?;
                let ordinals = (0..world_size)
                    .map(|r| options.device_of(kind, r, world_size, devices))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(crate::NvlinkIpc::group(&ordinals, nvlink_options(options))?
                    .into_iter()
                    .map(|t| AnyTransport::Nvlink(Box::new(t)))
                    .collect())
            }
            other => Err(TransportError::InvalidArgument {
                op: "group",
                rank: 0,
                why: format!(
                    "{other} ranks connect over a bootstrap (AnyTransport::connect), not as an \
                     in-process group"
                ),
            }),
        }
    }

    /// [`group`](AnyTransport::group) with the kind and options of a config file's `transport`
    /// field.
    pub fn group_from_config(
        config: &TransportConfig,
        world_size: usize,
    ) -> Result<Vec<AnyTransport>, TransportError> {
        AnyTransport::group(config.kind(), world_size, &config.options())
    }

    /// The NvlinkIpc rank inside (what the fused engine takes), or `self` back (boxed) for any
    /// other kind.
    #[cfg(feature = "nvlink")]
    pub fn into_nvlink(self) -> Result<crate::NvlinkIpc, Box<AnyTransport>> {
        match self {
            AnyTransport::Nvlink(t) => Ok(*t),
            other => Err(Box::new(other)),
        }
    }
}

/// The window sizes and timeout of NvlinkIpc ranks built from `options`.
#[cfg(feature = "nvlink")]
pub fn nvlink_options(options: &TransportOptions) -> crate::NvlinkOptions {
    crate::NvlinkOptions {
        staging_bytes: options.staging_bytes,
        workspace_bytes: options.workspace_bytes,
        timeout: options.timeout,
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
            #[cfg(feature = "nvlink")]
            AnyTransport::Nvlink($t) => $body,
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
            #[cfg(feature = "nvlink")]
            AnyTransport::Nvlink(t) => t.alloc(bytes).map(AnyBuffer::Nvlink),
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
            #[cfg(feature = "nvlink")]
            (AnyTransport::Nvlink(t), AnyBuffer::Nvlink(s), AnyBuffer::Nvlink(r)) => {
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
        // NvlinkIpc: available on a GPU machine; otherwise the feature or the driver is named
        match TransportKind::NvlinkIpc.check_available(2) {
            Ok(()) => {}
            Err(e) => {
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
                let text = e.to_string();
                if cfg!(feature = "nvlink") {
                    assert!(
                        text.contains("driver") || text.contains("libcuda"),
                        "{text}"
                    );
                } else {
                    assert!(text.contains("afdep-transport/nvlink"), "{text}");
                }
            }
        }
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
    fn devices_follow_the_placement_and_too_few_gpus_say_so() {
        let k = TransportKind::NvlinkIpc;
        let d = TransportOptions::default();
        // ranks share GPUs round-robin by default
        let got: Vec<usize> = (0..4).map(|r| d.device_of(k, r, 4, 1).unwrap()).collect();
        assert_eq!(got, vec![0, 0, 0, 0]);
        let got: Vec<usize> = (0..4).map(|r| d.device_of(k, r, 4, 2).unwrap()).collect();
        assert_eq!(got, vec![0, 1, 0, 1]);
        let on3 = TransportOptions {
            device: Some(3),
            ..TransportOptions::default()
        };
        assert_eq!(on3.device_of(k, 1, 4, 4).unwrap(), 3);
        let e = on3.device_of(k, 1, 4, 2).unwrap_err();
        assert!(
            e.to_string().contains("too few GPUs") && e.to_string().contains("device 3"),
            "{e}"
        );
        let each = TransportOptions {
            one_gpu_per_rank: true,
            ..TransportOptions::default()
        };
        assert_eq!(each.device_of(k, 2, 4, 8).unwrap(), 2);
        let e = each.device_of(k, 0, 4, 1).unwrap_err();
        assert!(
            matches!(e, TransportError::Unavailable { kind, .. } if kind == k),
            "{e}"
        );
        assert!(e.to_string().contains("too few GPUs: 4 ranks"), "{e}");
        assert!(d.device_of(k, 0, 1, 0).is_err());
    }

    #[test]
    fn transport_config_reads_a_kind_or_a_table() {
        let c: TransportConfig = serde_json::from_str(r#""nvlink""#).unwrap();
        assert_eq!(c.kind(), TransportKind::NvlinkIpc);
        assert_eq!(c.options(), TransportOptions::default());
        let c: TransportConfig = serde_json::from_str(
            r#"{"kind": "ucx", "ucx_tls": "tcp", "timeout_ms": 500, "workspace_bytes": 4096}"#,
        )
        .unwrap();
        assert_eq!(c.kind(), TransportKind::Ucx);
        let o = c.options();
        assert_eq!(o.ucx_tls.as_deref(), Some("tcp"));
        assert_eq!(o.timeout, Duration::from_millis(500));
        assert_eq!(o.workspace_bytes, 4096);
        assert_eq!(o.staging_bytes, DEFAULT_WINDOW_BYTES);
        let back: TransportConfig =
            serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(serde_json::from_str::<TransportConfig>(r#""mpi""#).is_err());
        assert!(
            serde_json::from_str::<TransportConfig>(r#"{"kind": "tcp", "colour": 1}"#).is_err()
        );
    }

    #[test]
    fn groups_are_for_in_process_kinds() {
        let o = TransportOptions::default();
        let g = AnyTransport::group(TransportKind::Loopback, 3, &o).unwrap();
        assert_eq!(g.len(), 3);
        assert_eq!(g[2].rank(), 2);
        let e = AnyTransport::group(TransportKind::HostTcp, 2, &o).unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
        let g = AnyTransport::group_from_config(&TransportConfig::Kind(TransportKind::Loopback), 2)
            .unwrap();
        assert_eq!(g[1].world_size(), 2);
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
