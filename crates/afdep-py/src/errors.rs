//! afdep's typed errors as Python exceptions whose attributes carry the fields.
//!
//! - `afdep.AfdepError(Exception)`: the base of every afdep exception.
//! - `afdep.ConfigError(AfdepError)`: an unusable shape or config (`field`, `value`).
//! - `afdep.RouteError(AfdepError)`: a rejected route: `kind` and `rank`, and where
//!   they apply `token`, `slot`, `value` (the expert id or weight), `expert`, `first_slot`,
//!   `experts`, `owned`, `tokens`, `capacity`, `channel`, `what` (others are None).
//! - `afdep.GpuError(AfdepError)`: the GPU layer failed (no driver, a launch,
//!   an unsupported shape); `device_fault` is set when a kernel's bounded wait ran out.
//! - `afdep.CaptureError(AfdepError)`: a step refused under CUDA graph capture (no eager
//!   warm-up step of the layer yet, or given routes, whose check needs the host).
//! - `afdep.TimeoutError(AfdepError)`: an exchange timed out: `phase`, `rank`, `peer`, and
//!   `round` (device waits) or `waited_s` (transport waits).
//! - `afdep.TransportError(AfdepError)`: the exchange's transport failed: `rank`, `peer`.

use afdep_core::oracle::layer::LayerError;
use afdep_core::{ConfigError as CoreConfigError, RouteError as CoreRouteError};
use afdep_moe::LayerGpuError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(
    afdep,
    AfdepError,
    PyException,
    "The base of every afdep exception."
);
create_exception!(
    afdep,
    ConfigError,
    AfdepError,
    "An unusable layer shape or config; attributes `field` and `value`."
);
create_exception!(
    afdep,
    RouteError,
    AfdepError,
    "A rejected route; attributes kind, rank, token, slot, value and the variant's others."
);
create_exception!(
    afdep,
    GpuError,
    AfdepError,
    "The GPU layer failed (no driver, a launch, an unsupported shape)."
);
create_exception!(
    afdep,
    CaptureError,
    AfdepError,
    "A GPU step refused under CUDA graph capture (no eager warm-up step yet, or given routes)."
);

create_exception!(
    afdep,
    TimeoutError,
    AfdepError,
    "An exchange timed out; attributes phase, rank, peer (None if unknown), round/waited_s."
);
create_exception!(
    afdep,
    TransportFailure,
    AfdepError,
    "The exchange's transport failed (a peer gone, a size mismatch...); attributes rank, peer."
);

/// Sets `name = value` on the exception object (best effort: attributes never fail here).
fn set<'py, V: IntoPyObject<'py>>(err: &PyErr, py: Python<'py>, name: &str, v: V) {
    let _ = err.value(py).setattr(name, v);
}

/// A [`CoreRouteError`] as `afdep.RouteError` with its fields as attributes.
pub fn route_error(py: Python<'_>, e: &CoreRouteError) -> PyErr {
    let err = RouteError::new_err(e.to_string());
    for a in [
        "token",
        "slot",
        "value",
        "expert",
        "first_slot",
        "experts",
        "owned",
        "tokens",
        "capacity",
        "channel",
        "what",
    ] {
        set(&err, py, a, py.None());
    }
    set(&err, py, "rank", e.rank());
    let kind = match e {
        CoreRouteError::Duplicate {
            token,
            slot,
            expert,
            first_slot,
            ..
        } => {
            set(&err, py, "token", *token);
            set(&err, py, "slot", *slot);
            set(&err, py, "value", *expert);
            set(&err, py, "expert", *expert);
            set(&err, py, "first_slot", *first_slot);
            "duplicate"
        }
        CoreRouteError::Negative {
            token, slot, value, ..
        } => {
            set(&err, py, "token", *token);
            set(&err, py, "slot", *slot);
            set(&err, py, "value", *value);
            "negative"
        }
        CoreRouteError::Wide {
            token,
            slot,
            value,
            experts,
            ..
        } => {
            set(&err, py, "token", *token);
            set(&err, py, "slot", *slot);
            set(&err, py, "value", *value);
            set(&err, py, "experts", *experts);
            "wide"
        }
        CoreRouteError::Dummy {
            token,
            slot,
            value,
            owned,
            ..
        } => {
            set(&err, py, "token", *token);
            set(&err, py, "slot", *slot);
            set(&err, py, "value", *value);
            set(&err, py, "owned", *owned);
            "dummy"
        }
        CoreRouteError::NonFiniteLogit {
            token,
            expert,
            value,
            ..
        } => {
            set(&err, py, "token", *token);
            set(&err, py, "expert", *expert);
            set(&err, py, "value", *value);
            "non_finite_logit"
        }
        CoreRouteError::NonFiniteWeight {
            token, slot, value, ..
        } => {
            set(&err, py, "token", *token);
            set(&err, py, "slot", *slot);
            set(&err, py, "value", *value);
            "non_finite_weight"
        }
        CoreRouteError::OverCapacity {
            tokens, capacity, ..
        } => {
            set(&err, py, "tokens", *tokens);
            set(&err, py, "capacity", *capacity);
            "over_capacity"
        }
        CoreRouteError::NonFinitePayload {
            token,
            channel,
            value,
            ..
        } => {
            set(&err, py, "token", *token);
            set(&err, py, "channel", *channel);
            set(&err, py, "value", *value);
            "non_finite_payload"
        }
        CoreRouteError::Malformed { what, .. } => {
            set(&err, py, "what", what.as_str());
            "malformed"
        }
    };
    set(&err, py, "kind", kind);
    err
}

/// A [`CoreConfigError`] as `afdep.ConfigError`.
pub fn config_error(py: Python<'_>, e: &CoreConfigError) -> PyErr {
    let err = ConfigError::new_err(e.to_string());
    if let CoreConfigError::Invalid { field, value, .. } = e {
        set(&err, py, "field", *field);
        set(&err, py, "value", value.as_str());
    }
    err
}

/// The CPU oracle's errors.
pub fn layer_error(py: Python<'_>, e: &LayerError) -> PyErr {
    match e {
        LayerError::Config(c) => config_error(py, c),
        LayerError::Route(r) => route_error(py, r),
        other => PyValueError::new_err(other.to_string()),
    }
}

/// The GPU layer's errors.
pub fn gpu_error(py: Python<'_>, e: &LayerGpuError) -> PyErr {
    match e {
        LayerGpuError::Route(r) => route_error(py, r),
        LayerGpuError::Kernel(k) => match k.route() {
            Some(r) => route_error(py, r),
            None => {
                let err = GpuError::new_err(k.to_string());
                set(
                    &err,
                    py,
                    "device_fault",
                    matches!(k, afdep_kernels::KernelError::DeviceFault { .. }),
                );
                err
            }
        },
        LayerGpuError::Size { .. } => PyValueError::new_err(e.to_string()),
        LayerGpuError::Unsupported(_) => GpuError::new_err(e.to_string()),
    }
}

/// Registers the exception classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("AfdepError", py.get_type::<AfdepError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("RouteError", py.get_type::<RouteError>())?;
    m.add("GpuError", py.get_type::<GpuError>())?;
    m.add("CaptureError", py.get_type::<CaptureError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("TransportError", py.get_type::<TransportFailure>())?;
    Ok(())
}
