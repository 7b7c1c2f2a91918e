//! Permute (token rows into expert order) and the weighted un-permute back into token order.
//!
//! The un-permute computes `out[t] = Σ_{k ascending, unmasked} w_k · y[row(t, k)]` in f32 as
//! `acc = acc + (w · y)` with each operation rounded (no FMA contraction), then casts to bf16
//! once: bit-identical to `afdep_core::oracle::exchange::combine_source` for one FFN rank.
//! With [`CombineOrder::ByOwner`] the slots are summed per owner rank first, ranks ascending,
//! which is afdep-core's combine order across FFN ranks.

use afdep_core::bf16;
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::layout::ExpertLayout;
use super::{DeviceRoutes, as_u32, grid, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// The order of the un-permute's sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CombineOrder {
    /// Slots ascending (one FFN rank, or one GPU).
    #[default]
    Slots,
    /// Grouped by owner `e / experts_per_rank`, owners ascending; within an owner, slots
    /// ascending; each owner's partial sum is added to the total.
    ByOwner {
        /// Experts per FFN rank (contiguous placement).
        experts_per_rank: usize,
    },
}

/// `xs[row] = x[token of row]` for every row of `layout` (`x`: `tokens × hidden`, `xs`: at
/// least `slots × hidden`, since the number of rows is only known on the device). Rows past
/// the layout's total are not written.
pub fn permute(
    ctx: &GpuContext,
    x: &CudaSlice<bf16>,
    hidden: usize,
    layout: &ExpertLayout,
    xs: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let slots = layout.slots();
    if slots == 0 {
        return Ok(());
    }
    need("x", x, layout.tokens * hidden)?;
    need("xs", xs, slots * hidden)?;
    let h = as_u32("hidden", hidden)?;
    let k = as_u32("top_k", layout.top_k)?;
    let max_rows = slots as u64;
    let total = layout.offsets.slice(layout.experts..);
    let f = ctx.function(KernelId::Permute, 0, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x)
        .arg(&layout.row_slot)
        .arg(&total)
        .arg(xs)
        .arg(&max_rows)
        .arg(&h);
    // SAFETY: afdep_permute(const u16* x, const u32* row_slot, const u64* total_rows, u16* xs,
    // u64 max_rows, u32 hidden) with K compiled in: warp `row` (< min(max_rows, *total_rows))
    // reads row_slot[row] (a slot < tokens·K, so token < tokens) and copies x[token] (x holds
    // tokens × hidden) to xs[row] (xs holds slots × hidden); `total` is offsets[E].
    unsafe { b.launch(grid(max_rows.div_ceil(u64::from(BLOCK / 32)))?) }
        .map_err(launch_err(KernelId::Permute))?;
    Ok(())
}

/// `out[t] = Σ_k w_k · y[row(t, k)]` (see the module): `y` holds the expert outputs in the
/// layout's row order (at least `slots × hidden`), `routes` are the routes `layout` was built
/// from, `out` is `tokens × hidden`. A token whose slots are all masked gets zeros.
pub fn unpermute(
    ctx: &GpuContext,
    y: &CudaSlice<bf16>,
    hidden: usize,
    layout: &ExpertLayout,
    routes: &DeviceRoutes,
    order: CombineOrder,
    out: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    if routes.tokens != layout.tokens || routes.top_k != layout.top_k {
        return Err(KernelError::Shape(format!(
            "routes are {} × {}, the layout {} × {}",
            routes.tokens, routes.top_k, layout.tokens, layout.top_k
        )));
    }
    let tokens = layout.tokens;
    if tokens == 0 {
        return Ok(());
    }
    let slots = layout.slots();
    need("y", y, slots * hidden)?;
    need("out", out, tokens * hidden)?;
    need("route ids", &routes.idx, slots)?;
    need("route weights", &routes.weights, slots)?;
    let h = as_u32("hidden", hidden)?;
    let k = as_u32("top_k", layout.top_k)?;
    let group = match order {
        CombineOrder::Slots => 0,
        CombineOrder::ByOwner {
            experts_per_rank: 0,
        } => {
            return Err(KernelError::Unsupported("zero experts per rank".into()));
        }
        CombineOrder::ByOwner { experts_per_rank } => as_u32("experts_per_rank", experts_per_rank)?,
    };
    let t = tokens as u64;
    let f = ctx.function(KernelId::Unpermute, 0, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(y)
        .arg(&layout.slot_row)
        .arg(&routes.idx)
        .arg(&routes.weights)
        .arg(out)
        .arg(&t)
        .arg(&h)
        .arg(&group);
    // SAFETY: afdep_unpermute(const u16* y, const u32* slot_row, const i32* idx, const float*
    // weights, u16* out, u64 tokens, u32 hidden, u32 experts_per_group) with K compiled in:
    // warp t reads K entries of slot_row, idx and weights (each holds tokens × K), the rows
    // they name (< slots, y holds slots × hidden) and writes out[t] (out holds tokens × hidden).
    unsafe { b.launch(grid(t.div_ceil(u64::from(BLOCK / 32)))?) }
        .map_err(launch_err(KernelId::Unpermute))?;
    Ok(())
}
