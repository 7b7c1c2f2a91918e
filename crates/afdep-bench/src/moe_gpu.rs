//! `afdep moe --backend cuda`: [`afdep_moe::MoeLayer`] timed and checked, one row per
//! (tokens, dispatch).
//!
//! Per configuration: the layer is built (every buffer it uses is allocated here, once), the
//! parameters, x and dy are uploaded, and the forward and then the train step (the layer's
//! own router) are timed with [`afdep_moe::timing`] (events created once, before any run; 3
//! warm-ups; the median of `--iters` runs; a step is only queued). Then, on the same data, the
//! outputs are poisoned, one more step runs, and the GPU reference path
//! ([`afdep_moe::reference::ReferenceLayer`], f32 throughout) recomputes it from the layer's
//! own parameters, inputs and routes; the error columns are `max |a − b| / max |b|` against
//! it ([`afdep_moe::reference::compare`], on the device), and `status` is `ok` when every one
//! is within [`afdep_moe::accuracy`]'s tolerances, `error_too_large` otherwise
//! (`routes_rejected` when the checked step's routes were rejected; `topk_mismatch` when the
//! reference's independent check of the router's choice finds a token whose chosen experts
//! are provably not its top-k, see [`ReferenceLayer::topk_check`]: both rows keep their times).
//!
//! A layer that does not fit in device memory is a row with status `oom` and no times; a
//! shape the kernels do not support, `unsupported`. When only the reference does not fit next
//! to the layer, the row keeps its measured times, has no errors, status `oom` and a `note`
//! saying so. Any other failure stops the sweep with its error.
//!
//! `peak_gib` is [`MoeLayer::device_bytes`]: every buffer of the configuration (nothing else
//! is allocated for it, and nothing during a step). `mem_used_gib` is the device's own view,
//! `cuMemGetInfo` before building the layer minus after the timed runs: it adds the
//! allocator's rounding and, for the first configuration, the kernel modules loaded by the
//! warm-ups. The reference path's memory, allocated after the timing, is in neither.

use afdep_core::bf16;
use afdep_kernels::cudarc::driver::sys::cudaError_enum;
use afdep_kernels::ops::download;
use afdep_kernels::{GpuContext, KernelError};
use afdep_moe::accuracy::{DX_TOL, GRAD_TOL, OUT_TOL};
use afdep_moe::reference::{ReferenceLayer, compare};
use afdep_moe::timing::{EventTimer, WARMUPS};
use afdep_moe::{Dispatch, LayerGpuError, LayerRouting, MoeLayer};
use tracing::info;

use crate::moe_cmd::{Inputs, LayerOutputs, MoeRow};

const GIB: f64 = (1u64 << 30) as f64;

/// The `impl` of the GPU rows.
pub const IMPL: &str = "afdep";

/// Whether `e` is the driver's out-of-memory error.
pub fn is_oom(e: &LayerGpuError) -> bool {
    matches!(
        e,
        LayerGpuError::Kernel(KernelError::Driver { source, .. })
            if source.0 == cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
    )
}

/// The errors of one configuration against the reference path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Errors {
    /// Output.
    pub out: f64,
    /// dx (train step).
    pub gx: Option<f64>,
    /// Max over the weight gradients (train step).
    pub gw: Option<f64>,
}

impl Errors {
    /// Whether every error is within its tolerance (NaN never is).
    pub fn within_tolerance(&self) -> bool {
        let le = |v: f64, tol: f64| v <= tol;
        le(self.out, OUT_TOL)
            && self.gx.is_none_or(|v| le(v, DX_TOL))
            && self.gw.is_none_or(|v| le(v, GRAD_TOL))
    }

    /// The row status these errors give.
    pub fn status(&self) -> &'static str {
        if self.within_tolerance() {
            "ok"
        } else {
            "error_too_large"
        }
    }
}

/// What the error check of one configuration gave.
#[derive(Debug)]
enum Check {
    Done(Errors),
    /// The reference did not fit next to the layer (the times are still valid).
    Oom(String),
    Unsupported(String),
    /// The step's routes were rejected (by the layer or by the reference): the layer's own
    /// router produced an invalid table, a defect the row reports instead of ending the sweep.
    Rejected(String),
    /// The independent top-k check found tokens whose chosen experts are provably not their
    /// top-k: the router is wrong, whatever the error columns say.
    TopkWrong(String),
}

/// The GPU, opened once for a sweep.
#[derive(Debug)]
pub struct GpuSweep {
    ctx: GpuContext,
    device: String,
    timer: EventTimer,
}

/// One configuration's row and, when asked for, its outputs.
#[derive(Debug)]
pub struct Outcome {
    /// The row.
    pub row: MoeRow,
    /// Outputs of the checked step (when `want_outputs` and the layer ran).
    pub outputs: Option<LayerOutputs>,
}

fn mem_free(ctx: &GpuContext) -> Result<usize, KernelError> {
    ctx.synchronize()?;
    ctx.cuda()
        .mem_get_info()
        .map(|(free, _)| free)
        .map_err(KernelError::driver(
            "reading free device memory (cuMemGetInfo)",
        ))
}

impl GpuSweep {
    /// Opens GPU 0 and creates the timing events (`iters` pairs).
    pub fn open(iters: usize) -> Result<Self, LayerGpuError> {
        let ctx = GpuContext::new(0)?;
        // SAFETY: every buffer of the sweep lives on the context's one stream, whose order is
        // all the synchronisation needed; no buffer exists yet. Without this, cudarc records
        // and waits on events around every launch.
        unsafe { ctx.cuda().disable_event_tracking() };
        let device = ctx.device_name()?;
        let timer = EventTimer::new(&ctx, iters)?;
        Ok(GpuSweep { ctx, device, timer })
    }

    /// Times `iters` runs per measurement from now on (new events when that changes).
    pub fn set_iters(&mut self, iters: usize) -> Result<(), LayerGpuError> {
        if iters != self.timer.iters() {
            self.timer = EventTimer::new(&self.ctx, iters)?;
        }
        Ok(())
    }

    /// The GPU's name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Builds, times and checks one configuration. `progress` is told what runs now.
    pub fn run(
        &self,
        inp: &Inputs,
        dispatch: Dispatch,
        train: bool,
        want_outputs: bool,
        progress: &dyn Fn(&str),
    ) -> Result<Outcome, LayerGpuError> {
        let ctx = &self.ctx;
        let shape = inp.params.shape;
        let t = inp.tokens;
        let mut row = MoeRow::new(&shape, t, IMPL, dispatch.name(), self.timer.iters());
        row.device = Some(self.device.clone());
        let free_before = mem_free(ctx)?;
        progress("allocating");
        let mut layer = match MoeLayer::new(ctx, shape, t, dispatch, train) {
            Ok(l) => l,
            Err(e) if is_oom(&e) => {
                row.status = "oom".into();
                row.note = Some(format!("building the layer: {e}"));
                return Ok(Outcome { row, outputs: None });
            }
            Err(LayerGpuError::Unsupported(why)) => {
                row.status = "unsupported".into();
                row.note = Some(why);
                return Ok(Outcome { row, outputs: None });
            }
            Err(e) => return Err(e),
        };
        row.peak_gib = Some(layer.device_bytes() as f64 / GIB);
        progress("uploading");
        layer.upload_params(ctx, &inp.params)?;
        layer.upload_x(ctx, &inp.x)?;
        if train {
            layer.upload_dy(ctx, &inp.dy)?;
        }
        progress("timing forward");
        let fwd = self.timer.time(ctx, WARMUPS, || {
            layer.enqueue_forward(ctx, LayerRouting::Router)
        })?;
        layer.finish(ctx)?;
        row.fwd_ms = Some(fwd.median_ms);
        if train {
            progress("timing train step");
            let tr = self.timer.time(ctx, WARMUPS, || {
                layer.enqueue_train_step(ctx, LayerRouting::Router)
            })?;
            layer.finish(ctx)?;
            row.train_ms = Some(tr.median_ms);
        }
        let free_after = mem_free(ctx)?;
        row.mem_used_gib = Some(free_before.saturating_sub(free_after) as f64 / GIB);

        // correctness, on the data just timed: poisoned outputs, one more step
        progress("checking against the reference");
        layer.poison_outputs(ctx)?;
        if train {
            layer.enqueue_train_step(ctx, LayerRouting::Router)?;
        } else {
            layer.enqueue_forward(ctx, LayerRouting::Router)?;
        }
        let checked = match layer.finish(ctx) {
            Err(LayerGpuError::Route(e)) => Check::Rejected(e.to_string()),
            Err(e) => return Err(e),
            Ok(()) => check(ctx, &layer, train)?,
        };
        match checked {
            Check::Done(e) => {
                row.out_err = Some(e.out);
                row.gx_err = e.gx;
                row.gw_err = e.gw;
                row.status = e.status().into();
            }
            Check::Oom(why) => {
                row.status = "oom".into();
                row.note = Some(format!(
                    "the reference path ran out of memory next to the layer ({why}); the times \
                     are measured, the errors are not"
                ));
            }
            Check::Rejected(why) => {
                row.status = "routes_rejected".into();
                row.note = Some(format!(
                    "the routes of the checked step were rejected ({why}); the times are \
                     measured, the errors are not"
                ));
            }
            Check::TopkWrong(why) => {
                row.status = "topk_mismatch".into();
                row.note = Some(format!(
                    "the independent top-k check failed: {why}; the times are measured, the \
                     errors are not"
                ));
            }
            Check::Unsupported(why) => {
                row.status = "unsupported".into();
                row.note = Some(format!(
                    "the reference path does not support this configuration ({why}); the \
                     times are measured, the errors are not"
                ));
            }
        }
        info!(
            tokens = t,
            dispatch = dispatch.name(),
            fwd_ms = row.fwd_ms,
            train_ms = row.train_ms,
            status = row.status,
            "configuration done"
        );
        let outputs = if want_outputs {
            progress("downloading outputs");
            Some(outputs_of(ctx, &layer, train)?)
        } else {
            None
        };
        Ok(Outcome { row, outputs })
    }
}

fn outputs_of(
    ctx: &GpuContext,
    layer: &MoeLayer,
    train: bool,
) -> Result<LayerOutputs, LayerGpuError> {
    let y: Vec<bf16> = download(ctx, layer.out())?;
    let (dx, dparams) = match (train, layer.grads()) {
        (true, Some(g)) => {
            let mut ps = Vec::with_capacity(7);
            for t in g.tensors() {
                ps.push(download(ctx, t)?);
            }
            (Some(download(ctx, layer.dx())?), Some(ps))
        }
        _ => (None, None),
    };
    let routes = layer.routes().download(ctx)?;
    Ok(LayerOutputs {
        y,
        dx,
        dparams,
        topk_idx: Some(routes.idx),
        implementation: IMPL.into(),
        dispatch: layer.dispatch().name().into(),
    })
}

/// Runs the GPU reference path on the layer's parameters, inputs and routes, and compares.
fn check(ctx: &GpuContext, layer: &MoeLayer, train: bool) -> Result<Check, LayerGpuError> {
    let mut r = match ReferenceLayer::new(ctx, layer.shape(), layer.tokens(), train) {
        Ok(r) => r,
        Err(e) if is_oom(&e) => return Ok(Check::Oom(e.to_string())),
        Err(LayerGpuError::Unsupported(why)) => return Ok(Check::Unsupported(why)),
        Err(e) => return Err(e),
    };
    match r.run_like(ctx, layer, train) {
        Err(LayerGpuError::Route(e)) => return Ok(Check::Rejected(e.to_string())),
        other => other?,
    }
    if let Some(t) = r.topk_check() {
        info!(
            near_ties = t.near_ties,
            wrong = t.wrong,
            "independent top-k check of the router's choice"
        );
        if t.wrong > 0 {
            return Ok(Check::TopkWrong(format!(
                "{} tokens choose experts that are provably not their top-{} (first: token {})",
                t.wrong,
                layer.shape().top_k,
                t.first_wrong.unwrap_or(0)
            )));
        }
    }
    let e = compare(ctx, layer, &r)?;
    Ok(Check::Done(Errors {
        out: e.out,
        gx: e.gx,
        gw: e.gw,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use afdep_kernels::cudarc::driver::DriverError;

    #[test]
    fn statuses_follow_the_tolerances() {
        let ok = Errors {
            out: OUT_TOL,
            gx: Some(DX_TOL / 2.0),
            gw: Some(0.0),
        };
        assert_eq!(ok.status(), "ok");
        let fwd_only = Errors {
            out: 1e-3,
            gx: None,
            gw: None,
        };
        assert_eq!(fwd_only.status(), "ok");
        for bad in [
            Errors {
                out: OUT_TOL * 1.01,
                ..ok
            },
            Errors {
                gx: Some(DX_TOL * 2.0),
                ..ok
            },
            Errors {
                gw: Some(f64::INFINITY),
                ..ok
            },
            Errors {
                out: f64::NAN,
                ..ok
            },
        ] {
            assert_eq!(bad.status(), "error_too_large", "{bad:?}");
        }
    }

    #[test]
    fn oom_is_recognised() {
        let oom = LayerGpuError::Kernel(KernelError::Driver {
            what: "allocating".into(),
            source: DriverError(cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY),
        });
        assert!(is_oom(&oom));
        let other = LayerGpuError::Kernel(KernelError::Driver {
            what: "launching".into(),
            source: DriverError(cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS),
        });
        assert!(!is_oom(&other));
        assert!(!is_oom(&LayerGpuError::Unsupported("x".into())));
    }
}
