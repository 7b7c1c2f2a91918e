//! Fault injection into the fused engine's kernels (cargo feature `fault-injection`; tests
//! only): [`FusedEngine::set_fault`] turns one [`Fault`] of `afdep_kernels::ops::fault` on or
//! off on a rank, [`FusedEngine::fault_hits`] says how often its points fired.
//!
//! A fault delays a store or a flag (the reference record's P1–P4b, docs/design.md, "The reference
//! record", and their payload-first and combine counterparts: every round must stay bit-identical
//! to the oracle) or skips a bounded wait together with a delay that opens the race the wait closes
//! (the record's N2, N3 and the counterparts of the combine's and the FFN rank's dispatch flag
//! waits: the oracle comparison must catch it). Every rank of the group sets the same fault between rounds; rounds with host
//! experts, device rounds and graphs captured afterwards all run the fault-built kernels (a graph captured
//! before keeps the kernels it captured). `docs/gpu.md` lists the faults and their expected
//! outcomes; `tests/gpu_nvlink_faults.rs` runs them.

use afdep_kernels::ops::fault::Fault;
use afdep_kernels::ops::fused as fk;
use afdep_transport::Transport;

use super::FusedEngine;
use crate::error::ExchangeError;

impl FusedEngine {
    /// Injects `fault` into this rank's fused kernels from the next round on (`None`: the
    /// production kernels again). Waits for every rank (a barrier: no kernel of the group is in
    /// flight after it, since every round ends with its stream), selects the fault on the
    /// rank's GPU context, loads every fused kernel of the fault-built modules now (compiled at
    /// their first use; a module load may synchronise the device, so none may happen while a
    /// peer's kernel waits, see [`FusedEngine::new`]), then waits for every rank again.
    /// Collective: every rank calls it with the same fault, between rounds.
    pub fn set_fault(&mut self, fault: Option<Fault>) -> Result<(), ExchangeError> {
        self.transport.barrier()?;
        self.gpu.set_fault(fault);
        fk::preload(&self.gpu, self.cfg.top_k)?;
        self.transport.barrier()?;
        Ok(())
    }

    /// The fault injected into this rank's kernels ([`FusedEngine::set_fault`]).
    pub fn fault(&self) -> Option<Fault> {
        self.gpu.fault()
    }

    /// How often the fault points of this rank's fault-built kernels fired since the engine was
    /// made (every fault it ran, summed): a delay counts once per thread that spins, a skip once
    /// per thread that passes its point, which stands before the wait's statement and so also
    /// counts where that wait would not have run (a streaming dispatch with the gate off, the
    /// lanes of a warp whose lane 0 waits). A skip's count therefore shows that its modules ran,
    /// not how many waits it removed; whether a skip mattered is what the comparison with the
    /// oracle shows. Waits for the rank's stream: call it between rounds once every rank
    /// finished its round (after a barrier), when no kernel of a peer on the same device still
    /// waits for this rank.
    pub fn fault_hits(&self) -> Result<u64, ExchangeError> {
        Ok(self.gpu.fault_hits()?)
    }
}
