//! Dispatch layout on one GPU: per-expert counts, 64-bit offsets and the stable counting sort
//! of (token, slot) pairs by expert.
//!
//! For validated routes of one source with every expert on this GPU, the result equals
//! afdep-core's: `counts == SourceCounts::build(..).expert_rows`, `offsets ==
//! exclusive_prefix(counts)`, and the row of slot `i = t·K + k` is
//! `offsets[e] + block_positions(..)[i]` (within an expert: token ascending, then slot).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{DeviceRoutes, as_u32, grid, need, zeros};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId, LAYOUT_CHUNK, MAX_EXPERTS};

/// The row of a masked slot in [`ExpertLayout::slot_row`], and the filler of
/// [`ExpertLayout::row_slot`] past the last row.
pub const NO_ROW: u32 = u32::MAX;

/// The layout of one route table (`tokens × top_k` slots over `experts` experts).
#[derive(Debug)]
pub struct ExpertLayout {
    /// Tokens.
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Experts.
    pub experts: usize,
    /// Rows per expert (`experts` entries).
    pub counts: CudaSlice<u64>,
    /// Exclusive prefix of `counts` with the total appended (`experts + 1` entries): expert
    /// `e` owns rows `offsets[e] .. offsets[e + 1]`.
    pub offsets: CudaSlice<u64>,
    /// `slot_row[t·K + k]`: the row of the slot, [`NO_ROW`] when masked.
    pub slot_row: CudaSlice<u32>,
    /// `row_slot[row]`: the slot `t·K + k` of the row; [`NO_ROW`] at and past the total.
    pub row_slot: CudaSlice<u32>,
    /// Per-(expert, block) counts, then their per-expert exclusive scans (workspace).
    block_counts: CudaSlice<u32>,
}

impl ExpertLayout {
    /// Bytes on the device: counts, offsets, both slot/row maps and the block-count workspace.
    pub fn device_bytes(&self) -> usize {
        (self.counts.len() + self.offsets.len()) * 8
            + (self.slot_row.len() + self.row_slot.len() + self.block_counts.len()) * 4
    }

    /// Buffers for a table of `tokens × top_k` slots over `experts` experts (zeroed).
    pub fn new(
        ctx: &GpuContext,
        tokens: usize,
        top_k: usize,
        experts: usize,
    ) -> Result<ExpertLayout, KernelError> {
        if experts == 0 || experts > MAX_EXPERTS as usize {
            return Err(KernelError::Unsupported(format!(
                "{experts} experts: supported are 1..={MAX_EXPERTS}"
            )));
        }
        let slots = tokens * top_k;
        if slots >= NO_ROW as usize {
            return Err(KernelError::Unsupported(format!(
                "{slots} slots: the layout indexes slots with u32"
            )));
        }
        let nblocks = Self::blocks_for(slots);
        Ok(ExpertLayout {
            tokens,
            top_k,
            experts,
            counts: zeros(ctx, experts)?,
            offsets: zeros(ctx, experts + 1)?,
            slot_row: zeros(ctx, slots)?,
            row_slot: zeros(ctx, slots)?,
            block_counts: zeros(ctx, experts * nblocks)?,
        })
    }

    /// Slots (`tokens × top_k`).
    pub fn slots(&self) -> usize {
        self.tokens * self.top_k
    }

    fn blocks_for(slots: usize) -> usize {
        slots.div_ceil(LAYOUT_CHUNK as usize).max(1)
    }

    /// Builds the layout of `idx` (`tokens × top_k` expert ids of validated routes; ids outside
    /// `0..experts` are treated as masked). Four launches, no host synchronisation.
    pub fn build(&mut self, ctx: &GpuContext, idx: &CudaSlice<i32>) -> Result<(), KernelError> {
        let slots = self.slots();
        need("route ids", idx, slots)?;
        let e = as_u32("experts", self.experts)?;
        let nblocks = Self::blocks_for(slots);
        let nb = as_u32("layout blocks", nblocks)?;
        let slots64 = slots as u64;
        let stream = ctx.stream();

        let f = ctx.function(KernelId::ExpertCounts, e, 0)?;
        let mut b = stream.launch_builder(&f);
        b.arg(idx)
            .arg(&mut self.block_counts)
            .arg(&slots64)
            .arg(&nb);
        // SAFETY: afdep_layout_count(const i32* idx, u32* block_counts, u64 slots, u32 nblocks)
        // with E compiled in: block b reads idx[b·CHUNK .. min((b+1)·CHUNK, slots)] (idx holds
        // `slots`, checked) and writes block_counts[e·nblocks + b] for e < E (E × nblocks
        // allocated by `new` for this shape).
        unsafe { b.launch(grid(nblocks as u64)?) }.map_err(launch_err(KernelId::ExpertCounts))?;

        let f = ctx.function(KernelId::ExpertScanBlocks, e, 0)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&mut self.block_counts).arg(&mut self.counts).arg(&nb);
        let per_expert = LaunchConfig {
            grid_dim: (e, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: afdep_layout_scan_blocks(u32* block_counts, u64* counts, u32 nblocks): block
        // e scans block_counts[e·nblocks ..][..nblocks] in place and writes counts[e]; the grid
        // has exactly E blocks and counts holds E.
        unsafe { b.launch(per_expert) }.map_err(launch_err(KernelId::ExpertScanBlocks))?;

        let f = ctx.function(KernelId::ExpertOffsets, e, 0)?;
        let mut b = stream.launch_builder(&f);
        b.arg(&self.counts).arg(&mut self.offsets);
        // SAFETY: afdep_layout_scan_experts(const u64* counts, u64* offsets): one block reads
        // E counts and writes E + 1 offsets (both allocated for E by `new`).
        unsafe { b.launch(grid(1)?) }.map_err(launch_err(KernelId::ExpertOffsets))?;

        let f = ctx.function(KernelId::ExpertScatter, e, 0)?;
        let mut b = stream.launch_builder(&f);
        b.arg(idx)
            .arg(&self.block_counts)
            .arg(&self.offsets)
            .arg(&mut self.slot_row)
            .arg(&mut self.row_slot)
            .arg(&slots64)
            .arg(&nb);
        // SAFETY: afdep_layout_scatter(const i32* idx, const u32* block_offsets, const u64*
        // offsets, u32* slot_row, u32* row_slot, u64 slots, u32 nblocks): block b reads its
        // chunk of idx and writes slot_row[i] for its slots i < slots and row_slot[row] for
        // rows < offsets[E] <= slots (a row is offsets[e] + a rank below counts[e]); both
        // output buffers hold `slots` elements.
        unsafe { b.launch(grid(nblocks as u64)?) }.map_err(launch_err(KernelId::ExpertScatter))?;
        Ok(())
    }
}

/// The layout of device routes over `experts` experts (allocates and builds).
pub fn expert_layout(
    ctx: &GpuContext,
    routes: &DeviceRoutes,
    experts: usize,
) -> Result<ExpertLayout, KernelError> {
    let mut l = ExpertLayout::new(ctx, routes.tokens, routes.top_k, experts)?;
    l.build(ctx, &routes.idx)?;
    Ok(l)
}
