//! The AFD exchange from Python: one [`ExchangeRank`] per process over the staged engine
//! ([`afdep_moe::StagedEngine`]) and a transport rendezvoused from the environment (as under
//! `afdep launch`), and [`exchange_oracle`], afdep-core's reference of the same round.
//!
//! Every use of the engine's round vocabulary (`StagedEngine`, `RoundOutput`, `ExpertFn`,
//! `SourceInput`, `FfnReceived`) is in this file, so that it can be re-pointed at a new round
//! API in one place.
//!
//! The config is a JSON object with the fields of `afdep exchange --config FILE`
//! (`topology`, `hidden`, `experts`, `experts_per_rank`, `top_k`, `capacity`, `payload`,
//! `partials`, `knobs`, `transport`), deserialised into the library types the CLI's file ends in
//! ([`ExchangeConfig`], [`TransportConfig`]); absent knobs keep their defaults.

use std::cell::RefCell;

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::{FfnReceived, SourceInput, exchange};
use afdep_core::oracle::layer::expert_rows;
use afdep_core::{ExchangeConfig, ExchangeKnobs, LayerShape, Routes, bf16};
use afdep_moe::{DeviceExperts, ExchangeError, StagedEngine};
use afdep_transport::{AnyTransport, TransportConfig, TransportError};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::dlpack::{DType, Device, View};
use crate::errors::{
    AfdepError, TimeoutError, TransportFailure, config_error, layer_error, route_error,
};

/// Parses the config JSON: the exchange config (knobs and `experts_per_rank` defaulted) and
/// the transport (default `tcp`).
pub(crate) fn parse_config(
    py: Python<'_>,
    json: &str,
) -> PyResult<(ExchangeConfig, TransportConfig)> {
    let bad = |what: String| PyValueError::new_err(format!("exchange config: {what}"));
    let mut v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| bad(format!("not JSON: {e}")))?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    let transport = obj
        .remove("transport")
        .unwrap_or_else(|| serde_json::Value::String("tcp".into()));
    let transport: TransportConfig =
        serde_json::from_value(transport).map_err(|e| bad(format!("field `transport`: {e}")))?;
    let mut knobs = serde_json::to_value(ExchangeKnobs::default()).expect("knobs serialise");
    if let Some(given) = obj.remove("knobs") {
        let given = given
            .as_object()
            .ok_or_else(|| bad("field `knobs` is not an object".into()))?;
        for (k, val) in given {
            if knobs.get(k).is_none() {
                return Err(bad(format!("unknown knob `{k}`")));
            }
            knobs[k] = val.clone();
        }
    }
    obj.insert("knobs".into(), knobs);
    obj.entry("payload").or_insert("bf16".into());
    if !obj.contains_key("experts_per_rank") {
        let topo: afdep_core::Topology = obj
            .get("topology")
            .and_then(|t| t.as_str())
            .ok_or_else(|| bad("field `topology` is missing".into()))?
            .parse()
            .map_err(|e| config_error(py, &e))?;
        let experts = obj
            .get("experts")
            .and_then(|e| e.as_u64())
            .ok_or_else(|| bad("field `experts` is missing".into()))?;
        let per = experts / topo.ffn_count().max(1) as u64;
        obj.insert("experts_per_rank".into(), per.into());
    }
    let cfg: ExchangeConfig = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
    cfg.validate().map_err(|e| config_error(py, &e))?;
    Ok((cfg, transport))
}

/// The exchange's errors as Python exceptions.
pub(crate) fn exchange_error(py: Python<'_>, e: &ExchangeError) -> PyErr {
    match e {
        ExchangeError::Route { reporter, error } => {
            let err = route_error(py, error);
            let _ = err.value(py).setattr("reporter", *reporter);
            err
        }
        ExchangeError::Config(c) => config_error(py, c),
        ExchangeError::Transport(t) => transport_error(py, t),
        ExchangeError::DeviceTimeout {
            rank,
            phase,
            peer,
            round,
        } => {
            let err = TimeoutError::new_err(e.to_string());
            let v = err.value(py);
            let _ = v.setattr("phase", *phase);
            let _ = v.setattr("rank", *rank);
            let _ = v.setattr("peer", *peer);
            let _ = v.setattr("round", *round);
            err
        }
        other => AfdepError::new_err(other.to_string()),
    }
}

pub(crate) fn transport_error(py: Python<'_>, t: &TransportError) -> PyErr {
    let err = if let TransportError::Timeout { op, waited, .. } = t {
        let err = TimeoutError::new_err(t.to_string());
        let _ = err.value(py).setattr("phase", *op);
        let _ = err.value(py).setattr("waited_s", waited.as_secs_f64());
        let _ = err.value(py).setattr("round", py.None());
        err
    } else {
        TransportFailure::new_err(t.to_string())
    };
    let _ = err.value(py).setattr("rank", t.rank());
    let _ = err.value(py).setattr("peer", t.peer());
    err
}

/// The experts of an FFN rank: a Python callable `(expert, rows_bytes, n) -> bytes` (the
/// Python side converts to and from torch tensors), afdep's SwiGLU on given weights, or one of
/// the fused engine's other device experts (scales, identity) through their host twin.
pub(crate) enum Experts {
    Callable(Py<PyAny>),
    SwiGlu(Box<LayerParams>),
    Device(DeviceExperts),
}

/// Reads `experts`: a callable, a tuple `("swiglu", w1, w3, w2)` of DLPack capsules of bf16
/// CPU tensors (E × H × W, E × H × W, E × W × H), `("scale", [s_0, ..., s_{E-1}])` (expert e
/// maps a row to `bf16(f32(x) * s_e)`) or `("identity",)`.
pub(crate) fn experts_of(cfg: &ExchangeConfig, experts: &Bound<'_, PyAny>) -> PyResult<Experts> {
    if experts.is_callable() {
        return Ok(Experts::Callable(experts.clone().unbind()));
    }
    let bad = |what: String| {
        PyValueError::new_err(format!(
            "experts: {what}: expected a callable, (\"swiglu\", w1, w3, w2), (\"scale\", \
             scales) or (\"identity\",)"
        ))
    };
    let items: Vec<Bound<'_, PyAny>> = experts
        .extract()
        .map_err(|_| bad(format!("a {}", experts.get_type())))?;
    let tag: String = items
        .first()
        .ok_or_else(|| bad("an empty tuple".into()))?
        .extract()
        .map_err(|_| bad("the first item is not a string".into()))?;
    match (tag.as_str(), items.len()) {
        ("identity", 1) => return Ok(Experts::Device(DeviceExperts::Identity)),
        ("scale", 2) => {
            let scales: Vec<f32> = items[1].extract()?;
            if scales.len() != cfg.experts {
                return Err(PyValueError::new_err(format!(
                    "experts: {} scales for {} experts",
                    scales.len(),
                    cfg.experts
                )));
            }
            if let Some((e, v)) = scales.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(PyValueError::new_err(format!(
                    "experts: the scale of expert {e} is {v}, not finite"
                )));
            }
            return Ok(Experts::Device(DeviceExperts::Scale(scales)));
        }
        ("swiglu", 4) => {}
        (t, n) => return Err(bad(format!("`{t}` with {n} items"))),
    }
    let w1 = View::new("w1", &items[1])?;
    let w3 = View::new("w3", &items[2])?;
    let w2 = View::new("w2", &items[3])?;
    let (e, h) = (cfg.experts, cfg.hidden);
    let width = w1.shape.get(2).copied().unwrap_or(0);
    for (v, dims) in [
        (&w1, [e, h, width]),
        (&w3, [e, h, width]),
        (&w2, [e, width, h]),
    ] {
        v.expect_device(Device::Cpu)?;
        v.expect_dtype(&[DType::Bf16])?;
        v.expect_shape(&dims)?;
    }
    let shape = LayerShape {
        d_model: h,
        width,
        experts: e,
        top_k: cfg.top_k,
        shared: 0,
        renormalize: true,
    };
    // SAFETY: the views' capsules are this function's arguments, alive for the call; torch
    // does not touch the tensors while the GIL is held.
    let bf = |v: &View| -> PyResult<Vec<bf16>> {
        Ok(unsafe { v.read_f32() }?
            .into_iter()
            .map(bf16::from_f32)
            .collect())
    };
    Ok(Experts::SwiGlu(Box::new(LayerParams {
        shape,
        wr: vec![bf16::ZERO; h * e],
        w1: bf(&w1)?,
        w3: bf(&w3)?,
        w2: bf(&w2)?,
        s1: Vec::new(),
        s3: Vec::new(),
        s2: Vec::new(),
    })))
}

/// Runs `f` with an expert function over `experts`; the first Python or oracle error inside
/// an expert call is kept (the call returns NaN rows, so the round completes on every rank and
/// the attention ranks' rows that needed this expert read NaN, never a plausible value) and
/// returned after `f`.
fn with_expert<R>(
    py: Python<'_>,
    hidden: usize,
    experts: &Experts,
    f: impl FnOnce(&dyn Fn(usize, &[bf16], usize) -> Vec<bf16>) -> R,
) -> (R, Option<PyErr>) {
    let failed: RefCell<Option<PyErr>> = RefCell::new(None);
    let call = |e: usize, rows: &[bf16], n: usize| -> Vec<bf16> {
        let r: PyResult<Vec<bf16>> = match experts {
            Experts::SwiGlu(p) => expert_rows(p, e, rows, n).map_err(|err| layer_error(py, &err)),
            Experts::Device(d) => Ok(d.host()(e, rows, n)),
            Experts::Callable(cb) => (|| {
                let bytes = PyBytes::new(py, bytemuck_bytes(rows));
                let out = cb.call1(py, (e, bytes, n))?;
                let out: Vec<u8> = out.extract(py)?;
                if out.len() != n * hidden * 2 {
                    return Err(PyValueError::new_err(format!(
                        "expert {e}: returned {} bytes for {n} rows of {hidden} bf16 (want {})",
                        out.len(),
                        n * hidden * 2
                    )));
                }
                Ok(out
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect())
            })(),
        };
        r.unwrap_or_else(|err| {
            failed.borrow_mut().get_or_insert(err);
            vec![bf16::NAN; n * hidden]
        })
    };
    let r = f(&call);
    (r, failed.into_inner())
}

fn bytemuck_bytes(v: &[bf16]) -> &[u8] {
    // SAFETY: bf16 is a plain 2-byte value; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Reads one attention rank's input from capsules of CPU tensors: x bf16 T × H, topk_idx
/// i32 T × K, topk_weights f32 T × K.
fn source_input(
    cfg: &ExchangeConfig,
    x: &Bound<'_, PyAny>,
    idx: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
) -> PyResult<SourceInput> {
    let x = View::new("x", x)?;
    x.expect_device(Device::Cpu)?;
    x.expect_dtype(&[DType::Bf16])?;
    let t = x.shape.first().copied().unwrap_or(0);
    x.expect_shape(&[t, cfg.hidden])?;
    let idx = View::new("topk_idx", idx)?;
    idx.expect_device(Device::Cpu)?;
    idx.expect_dtype(&[DType::I32])?;
    idx.expect_shape(&[t, cfg.top_k])?;
    let w = View::new("topk_weights", w)?;
    w.expect_device(Device::Cpu)?;
    w.expect_dtype(&[DType::F32])?;
    w.expect_shape(&[t, cfg.top_k])?;
    Ok(SourceInput {
        // SAFETY: the capsules are this function's arguments, alive for the call; torch does
        // not touch the tensors while the GIL is held.
        x: unsafe { x.read_f32() }?
            .into_iter()
            .map(bf16::from_f32)
            .collect(),
        routes: Routes {
            tokens: t,
            top_k: cfg.top_k,
            idx: unsafe { idx.read_i32() }?,
            weights: unsafe { w.read_f32() }?,
        },
    })
}

fn bf16_bytes<'py>(py: Python<'py>, v: &[bf16]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, bytemuck_bytes(v))
}

fn received_dict<'py>(py: Python<'py>, r: &FfnReceived) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("expanded", bf16_bytes(py, &r.expanded))?;
    d.set_item("expert_offsets", r.plan.expert_offsets.clone())?;
    d.set_item("compact_tokens", r.compact_tokens.clone())?;
    d.set_item("compact_x", bf16_bytes(py, &r.compact_x))?;
    d.set_item("compact_ids", r.compact_ids.clone())?;
    d.set_item("compact_weights", r.compact_weights.clone())?;
    Ok(d)
}

/// A round's result: the combined rows (attention ranks) or what was received (FFN ranks).
type RoundResult<'py> = (Option<Bound<'py, PyBytes>>, Option<Bound<'py, PyDict>>);

/// One rank of the AFD exchange (see the module documentation).
#[pyclass(unsendable, module = "afdep._native")]
pub struct ExchangeRank {
    engine: StagedEngine<AnyTransport>,
}

#[pymethods]
impl ExchangeRank {
    /// Connects this process's rank (AFDEP_RANK, AFDEP_WORLD_SIZE, AFDEP_RENDEZVOUS) and sets
    /// up the staged engine (collective: every rank constructs together).
    #[new]
    fn new(py: Python<'_>, config_json: &str) -> PyResult<Self> {
        let (cfg, tcfg) = parse_config(py, config_json)?;
        let transport =
            AnyTransport::from_config_env(&tcfg).map_err(|e| transport_error(py, &e))?;
        let engine = StagedEngine::new(cfg, transport).map_err(|e| exchange_error(py, &e))?;
        Ok(ExchangeRank { engine })
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

    /// One round (collective). Attention ranks pass `x`, `topk_idx`, `topk_weights`
    /// capsules and get `(combined_bytes, None)`; FFN ranks pass None and get
    /// `(None, received)`, a dict of the expanded rows and the compact view.
    #[pyo3(signature = (x, topk_idx, topk_weights, experts))]
    fn round<'py>(
        &mut self,
        py: Python<'py>,
        x: Option<Bound<'py, PyAny>>,
        topk_idx: Option<Bound<'py, PyAny>>,
        topk_weights: Option<Bound<'py, PyAny>>,
        experts: Bound<'py, PyAny>,
    ) -> PyResult<RoundResult<'py>> {
        let cfg = self.engine.config().clone();
        let input = match (x, topk_idx, topk_weights) {
            (Some(x), Some(i), Some(w)) => Some(source_input(&cfg, &x, &i, &w)?),
            (None, None, None) => None,
            _ => {
                return Err(PyValueError::new_err(
                    "x, topk_idx and topk_weights are given together (attention ranks) or \
                     not at all (FFN ranks)",
                ));
            }
        };
        let experts = experts_of(&cfg, &experts)?;
        let engine = &mut self.engine;
        let (r, failed) = with_expert(py, cfg.hidden, &experts, |f| {
            engine.round(input.as_ref(), &|e, rows: &[bf16], n| f(e, rows, n))
        });
        let out = r.map_err(|e| exchange_error(py, &e))?;
        if let Some(err) = failed {
            return Err(err);
        }
        let combined = out.combined.as_deref().map(|c| bf16_bytes(py, c));
        let received = out
            .received
            .as_ref()
            .map(|r| received_dict(py, r))
            .transpose()?;
        Ok((combined, received))
    }
}

/// afdep-core's exchange oracle: the combined rows of every attention rank, as bytes.
#[pyfunction]
pub fn exchange_oracle<'py>(
    py: Python<'py>,
    config_json: &str,
    inputs: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    experts: Bound<'py, PyAny>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let (cfg, _) = parse_config(py, config_json)?;
    let inputs: Vec<SourceInput> = inputs
        .iter()
        .map(|(x, i, w)| source_input(&cfg, x, i, w))
        .collect::<PyResult<_>>()?;
    let experts = experts_of(&cfg, &experts)?;
    let (r, failed) = with_expert(py, cfg.hidden, &experts, |f| exchange(&cfg, &inputs, f));
    let out = r.map_err(|e| route_error(py, &e))?;
    if let Some(err) = failed {
        return Err(err);
    }
    Ok(out.iter().map(|c| bf16_bytes(py, c)).collect())
}
