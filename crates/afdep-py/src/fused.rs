//! The AFD exchange from Python on the fused engine: one [`FusedRank`] per process, afdep-moe's
//! [`FusedEngine`] over an [`NvlinkIpc`](afdep_transport::NvlinkIpc) rank rendezvoused from the
//! environment (as under `afdep launch`; ranks of one GPU share it through CUDA IPC), running
//! device rounds ([`FusedEngine::device_round_on_stream`]) or replays of one round captured in
//! a CUDA graph at construction ([`FusedEngine::replay_on_stream`]) on torch CUDA tensors.
//!
//! Each round reads the caller's rows and routes and writes the combined rows straight from
//! and into the torch tensors' device memory (device-to-device copies into and out of the
//! round's capacity-sized buffers, which a captured graph keeps), ordered on PyTorch's current
//! stream by events: no row crosses the host and the caller's stream is never waited for by
//! the host. By default the host then waits once per round for the engine's own stream, to
//! read the round's verdict, so that a rejected route raises `afdep.RouteError` (rank, token,
//! slot, value) on every rank, as the staged engine's rounds do; with `wait=False` that read is
//! deferred to the next round or `finish` (no host wait in the round at all). The experts run on the device
//! ([`DeviceExperts`]): afdep's SwiGLU, per-expert scales or the identity, fixed at
//! construction (a device round has no host step in which a Python callable could run).

use afdep_core::ExchangeConfig;
use afdep_kernels::cudarc::driver::sys as cu;
use afdep_moe::external::is_capturing;
use afdep_moe::{
    BorrowedRound, DeviceExperts, DeviceRoundOptions, DispatchArm, FusedEngine, FusedGraph,
    RoundArm,
};
use afdep_transport::{AnyTransport, TransportConfig, TransportKind};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::dlpack::{DType, Device, View};
use crate::errors::{AfdepError, CaptureError, ConfigError};
use crate::exchange::{Experts, exchange_error, experts_of, parse_config, transport_error};

/// The arm names Python passes: `auto` or a [`DispatchArm`]'s name with `-` or `_`.
fn parse_arm(arm: &str) -> PyResult<RoundArm> {
    if arm == "auto" {
        return Ok(RoundArm::Auto);
    }
    let norm = arm.replace('-', "_");
    DispatchArm::ALL
        .into_iter()
        .find(|a| a.name() == norm)
        .map(RoundArm::Fixed)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "arm `{arm}`: expected auto, payload-first, count-first or count-first-source"
            ))
        })
}

/// The fused engine's device experts of `experts` (a Python callable is refused).
fn device_experts(cfg: &ExchangeConfig, experts: &Bound<'_, PyAny>) -> PyResult<DeviceExperts> {
    Ok(match experts_of(cfg, experts)? {
        Experts::Callable(_) => {
            return Err(PyTypeError::new_err(
                "engine=\"fused\" runs its experts on the device inside the round: a Python \
                 callable cannot be one; pass afdep.SwiGLU, afdep.ScaleExperts or \"identity\"",
            ));
        }
        Experts::SwiGlu(p) => DeviceExperts::SwiGlu(std::sync::Arc::new(*p)),
        Experts::Device(d) => d,
    })
}

/// A checked source input of one round: the views of x, topk_idx, topk_weights and out.
struct Tensors {
    tokens: usize,
    x: View,
    idx: View,
    w: View,
    out: View,
}

/// One rank of the AFD exchange over the fused engine (see the module documentation).
#[pyclass(unsendable, module = "afdep._native")]
pub struct FusedRank {
    /// The captured round (`rounds="graph"`); declared before the engine, so dropped first.
    graph: Option<FusedGraph>,
    engine: FusedEngine,
    arm: RoundArm,
    device: usize,
}

impl FusedRank {
    /// Checks an attention rank's tensors: CUDA on this rank's device, dtypes, shapes
    /// (T × hidden, T × top-k, T × top-k, T × hidden), contiguity, `out` overlapping no input.
    fn check(
        &self,
        x: &Bound<'_, PyAny>,
        idx: &Bound<'_, PyAny>,
        w: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<Tensors> {
        let cfg = self.engine.config();
        let dev = Device::Cuda(self.device);
        let x = View::new("x", x)?;
        let idx = View::new("topk_idx", idx)?;
        let w = View::new("topk_weights", w)?;
        let out = View::new("out", out)?;
        let t = x.shape.first().copied().unwrap_or(0);
        for (v, dtype, cols) in [
            (&x, DType::Bf16, cfg.hidden),
            (&idx, DType::I32, cfg.top_k),
            (&w, DType::F32, cfg.top_k),
            (&out, DType::Bf16, cfg.hidden),
        ] {
            if v.device != dev {
                return Err(PyValueError::new_err(format!(
                    "`{}` is on {:?}: this exchange rank's GPU is CUDA device {} (the fused \
                     engine takes CUDA tensors of that device)",
                    v.name, v.device, self.device
                )));
            }
            v.expect_dtype(&[dtype])?;
            v.expect_shape(&[t, cols])?;
        }
        for v in [&x, &idx, &w] {
            if out.overlaps(v) {
                return Err(PyValueError::new_err(format!(
                    "`out` shares memory with `{}`",
                    v.name
                )));
            }
        }
        Ok(Tensors {
            tokens: t,
            x,
            idx,
            w,
            out,
        })
    }
}

#[pymethods]
impl FusedRank {
    /// Checks the arguments (before any connection), connects this process's rank
    /// (AFDEP_RANK, AFDEP_WORLD_SIZE, AFDEP_RENDEZVOUS) over the nvlink transport, sets up the
    /// fused engine and its device rounds with `experts` and, for `rounds="graph"`, captures
    /// one round of `arm` (collective: every rank constructs together, with the same config,
    /// rounds, arm and experts).
    #[new]
    #[pyo3(signature = (config_json, rounds, experts, arm="auto"))]
    fn new(
        py: Python<'_>,
        config_json: &str,
        rounds: &str,
        experts: Bound<'_, PyAny>,
        arm: &str,
    ) -> PyResult<Self> {
        let (cfg, tcfg) = parse_config(py, config_json)?;
        let graph = match rounds {
            "device" => false,
            "graph" => true,
            other => {
                return Err(PyValueError::new_err(format!(
                    "rounds `{other}`: the fused engine runs \"device\" rounds or \"graph\" \
                     replays"
                )));
            }
        };
        let arm = parse_arm(arm)?;
        if tcfg.kind() != TransportKind::NvlinkIpc {
            let err = ConfigError::new_err(format!(
                "engine=\"fused\" needs the nvlink transport (its kernels store into the peers' \
                 device memory); the config's transport is {}",
                tcfg.kind()
            ));
            let _ = err.value(py).setattr("field", "transport");
            let _ = err.value(py).setattr("value", tcfg.kind().to_string());
            return Err(err);
        }
        let experts = device_experts(&cfg, &experts)?;
        let mut options = tcfg.options();
        let ws_given = matches!(&tcfg, TransportConfig::Table(t) if t.workspace_bytes.is_some());
        if !ws_given {
            options.workspace_bytes = FusedEngine::workspace_bytes(&cfg).div_ceil(256) * 256;
        }
        let transport = AnyTransport::from_env(TransportKind::NvlinkIpc, &options)
            .map_err(|e| transport_error(py, &e))?
            .into_nvlink()
            .map_err(|_| AfdepError::new_err("the nvlink transport built another kind"))?;
        let device = transport.device();
        let mut engine = FusedEngine::new(cfg, transport).map_err(|e| exchange_error(py, &e))?;
        engine
            .prepare_device(DeviceRoundOptions {
                experts,
                keep_received: false,
            })
            .map_err(|e| exchange_error(py, &e))?;
        let graph = if graph {
            Some(engine.capture(arm).map_err(|e| exchange_error(py, &e))?)
        } else {
            None
        };
        Ok(FusedRank {
            graph,
            engine,
            arm,
            device,
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.engine.rank()
    }

    /// The role of this rank: `attention` or `ffn`.
    #[getter]
    fn role(&self) -> &'static str {
        let topo = self.engine.config().topology;
        if topo.attention_index(self.engine.rank()).is_some() {
            "attention"
        } else {
            "ffn"
        }
    }

    /// The config as JSON (every field, defaults filled in).
    #[getter]
    fn config_json(&self) -> String {
        serde_json::to_string(self.engine.config()).expect("the config serialises")
    }

    /// This rank's CUDA device.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// `device` or `graph`.
    #[getter]
    fn rounds(&self) -> &'static str {
        if self.graph.is_some() {
            "graph"
        } else {
            "device"
        }
    }

    /// The arm asked for at construction (`auto` or an arm's name).
    #[getter]
    fn arm(&self) -> String {
        self.arm.to_string()
    }

    /// The arm the last round took (chosen on the device under `auto`).
    #[getter]
    fn last_arm(&self) -> &'static str {
        self.engine.last_arm().name()
    }

    /// One round (collective), queued on `stream` (a `cudaStream_t` as an int). Attention
    /// ranks pass capsules of `x`, `topk_idx`, `topk_weights` and `out`; FFN ranks pass None.
    /// A tensor that fails the checks still takes part in the round, as a rank without input
    /// (so every rank's round is rejected instead of waiting), then raises here. With `wait`
    /// false the verdict is read later (the next round, or `finish`), which raise its error.
    #[pyo3(signature = (x, topk_idx, topk_weights, out, stream, wait=true))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn round(
        &mut self,
        py: Python<'_>,
        x: Option<Bound<'_, PyAny>>,
        topk_idx: Option<Bound<'_, PyAny>>,
        topk_weights: Option<Bound<'_, PyAny>>,
        out: Option<Bound<'_, PyAny>>,
        stream: usize,
        wait: bool,
    ) -> PyResult<()> {
        let attention = self.role() == "attention";
        let checked: PyResult<Option<Tensors>> = match (x, topk_idx, topk_weights, out) {
            (Some(x), Some(i), Some(w), Some(o)) if attention => {
                self.check(&x, &i, &w, &o).map(Some)
            }
            (None, None, None, None) if !attention => Ok(None),
            (None, None, None, None) => Err(PyValueError::new_err(format!(
                "rank {} is an attention rank: it passes x, topk_idx and topk_weights",
                self.rank()
            ))),
            _ if attention => Err(PyValueError::new_err(
                "x, topk_idx, topk_weights and out are given together on an attention rank",
            )),
            _ => Err(PyValueError::new_err(format!(
                "rank {} is an FFN rank: it passes no tensors",
                self.rank()
            ))),
        };
        let cu_stream = stream as cu::CUstream;
        if !cu_stream.is_null() {
            // SAFETY: `stream` is PyTorch's current stream of this rank's device (the Python
            // side passes it), a live stream.
            let capturing = unsafe { is_capturing(cu_stream) }
                .map_err(|e| AfdepError::new_err(e.to_string()))?;
            if capturing {
                return Err(CaptureError::new_err(
                    "afdep.Exchange rounds cannot be captured by torch.cuda.graph: each round \
                     reads its verdict on the host; use rounds=\"graph\" (a round captured by \
                     afdep and replayed each call) instead",
                ));
            }
        }
        let borrowed = match &checked {
            Ok(Some(t)) => Some(BorrowedRound {
                tokens: t.tokens,
                x: t.x.ptr as u64,
                idx: t.idx.ptr as u64,
                weights: t.w.ptr as u64,
                out: t.out.ptr as u64,
            }),
            _ => None,
        };
        // a rank whose tensors failed the checks reads the round's verdict now: its own error
        // is raised here, and no deferred one is left for its next round
        let wait = wait || checked.is_err();
        // SAFETY: the views were checked (CUDA device of this rank, dtype, shape, contiguity,
        // `out` overlapping no input); the Python side keeps the tensors alive for the call and
        // they are used on `stream` only, which the round joins before returning; `stream` is
        // PyTorch's current stream of this device and not capturing (checked above). A rank
        // whose tensors failed the checks passes none.
        let r = unsafe {
            match &self.graph {
                Some(g) => self
                    .engine
                    .replay_on_stream(g, borrowed.as_ref(), cu_stream, wait),
                None => {
                    self.engine
                        .device_round_on_stream(self.arm, borrowed.as_ref(), cu_stream, wait)
                }
            }
        };
        // the caller's mistake first: it is why the round was rejected everywhere
        checked?;
        r.map_err(|e| exchange_error(py, &e))
    }

    /// Reads the verdict of the round queued by `round(..., wait=False)`, if any (one host
    /// wait for the engine's stream), raising its error.
    fn finish(&mut self, py: Python<'_>) -> PyResult<()> {
        self.engine
            .finish_queued()
            .map_err(|e| exchange_error(py, &e))
    }
}
