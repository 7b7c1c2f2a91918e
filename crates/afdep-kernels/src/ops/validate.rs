//! Route validation on the device, reproducing `afdep_core::route::validate` in the error word.
//!
//! The host checks what it knows without reading the table (top-k and buffer sizes, as
//! [`RouteError::Malformed`]); the device checks capacity first, then every slot in (token,
//! slot) order with the within-slot order negative, wide, dummy, non-finite weight, duplicate,
//! and writes the error word ([`RouteError::to_word`] layout) of the first offence. Nothing
//! traps: after a rejected table the context, the stream and the validator stay usable.

use afdep_core::RouteError;
use afdep_core::error::ROUTE_ERROR_WORDS;
use afdep_core::route::RouteRules;
use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{DeviceRoutes, as_u32, download, grid, zeros};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// Words of the device validation state: the error word, the 64-bit key of the first
/// offence, and the 64-bit key of the router's first non-finite logit
/// (`layout/route_error.cuh`).
pub const STATE_WORDS: usize = 10;

/// Most blocks of the scan (a grid-stride loop covers the rest).
const MAX_SCAN_BLOCKS: u64 = 4096;

/// The device state of route validation: reusable for any number of validations on one
/// context (the word kernel leaves it ready for the next).
#[derive(Debug)]
pub struct RouteValidator {
    state: CudaSlice<u32>,
}

impl RouteValidator {
    /// Bytes on the device (its state words).
    pub fn device_bytes(&self) -> usize {
        self.state.len() * 4
    }

    /// A validator with zeroed state.
    pub fn new(ctx: &GpuContext) -> Result<RouteValidator, KernelError> {
        Ok(RouteValidator {
            state: zeros(ctx, STATE_WORDS)?,
        })
    }

    /// The device state; its first [`ROUTE_ERROR_WORDS`] words are the error word of the last
    /// validation once it has run (all zero: no error), e.g. to publish to peers.
    pub fn state(&self) -> &CudaSlice<u32> {
        &self.state
    }

    /// Queues the validation of the routes `routes` (`tokens × top_k` ids and weights) of
    /// attention rank `rank` without waiting. Size and top-k problems are found on the host and
    /// returned as [`KernelError::Route`] with [`RouteError::Malformed`], before any launch.
    pub fn launch(
        &mut self,
        ctx: &GpuContext,
        routes: &DeviceRoutes,
        rules: &RouteRules,
        rank: usize,
    ) -> Result<(), KernelError> {
        self.launch_inner(ctx, routes, rules, rank, None)
    }

    /// [`RouteValidator::launch`] for routes that the router's top-k
    /// ([`crate::router_topk`] with this validator) just made from `logits` (`tokens × rules.experts` f32)
    /// with this validator's state: a non-finite logit it found is reported as
    /// [`RouteError::NonFiniteLogit`] (the first token, its lowest such expert, the logit),
    /// ahead of any route offence.
    pub fn launch_routed(
        &mut self,
        ctx: &GpuContext,
        logits: &CudaSlice<f32>,
        routes: &DeviceRoutes,
        rules: &RouteRules,
        rank: usize,
    ) -> Result<(), KernelError> {
        let tokens = routes.tokens;
        if logits.len() < tokens * rules.experts {
            return Err(KernelError::Shape(format!(
                "logits hold {} values, {tokens} tokens × {} experts need more",
                logits.len(),
                rules.experts
            )));
        }
        self.launch_inner(ctx, routes, rules, rank, Some(logits))
    }

    /// The device state, writable (the router's top-k records its non-finite key there).
    pub(crate) fn state_mut(&mut self) -> &mut CudaSlice<u32> {
        &mut self.state
    }

    fn launch_inner(
        &mut self,
        ctx: &GpuContext,
        routes: &DeviceRoutes,
        rules: &RouteRules,
        rank: usize,
        logits: Option<&CudaSlice<f32>>,
    ) -> Result<(), KernelError> {
        let (idx, weights) = (&routes.idx, &routes.weights);
        let (tokens, top_k) = (routes.tokens, routes.top_k);
        if top_k != rules.top_k {
            return Err(RouteError::Malformed {
                rank,
                what: format!(
                    "routes have {top_k} slots per token, the config says {}",
                    rules.top_k
                ),
            }
            .into());
        }
        let n = tokens * top_k;
        if idx.len() < n || weights.len() < n {
            return Err(RouteError::Malformed {
                rank,
                what: format!(
                    "{tokens} tokens × {top_k} slots need {n} ids and weights, got {} and {}",
                    idx.len(),
                    weights.len()
                ),
            }
            .into());
        }
        let k = as_u32("top_k", top_k)?;
        let rank32 = u32::try_from(rank).unwrap_or(u32::MAX);
        let (t, e, o, c) = (
            tokens as u64,
            rules.experts as u64,
            rules.owned as u64,
            rules.capacity as u64,
        );
        let scan = ctx.function(KernelId::ValidateRoutes, 0, k)?;
        let word = ctx.function(KernelId::ValidateWord, 0, k)?;
        let cfg = grid(t.div_ceil(u64::from(BLOCK)).clamp(1, MAX_SCAN_BLOCKS))?;
        let stream = ctx.stream();
        // both kernels start with (idx, w, state, tokens, experts, owned, capacity)
        let scalars = [t, e, o, c];
        let mut b = stream.launch_builder(&scan);
        b.arg(idx).arg(weights).arg(&mut self.state);
        for v in &scalars {
            b.arg(v);
        }
        // SAFETY: afdep_validate_scan(const i32* idx, const float* w, u32* state, u64 tokens,
        // u64 experts, u64 owned, u64 capacity) with K = top_k compiled in. idx and weights
        // hold tokens × K elements (checked above); state holds STATE_WORDS u32, allocated
        // with 256-byte alignment, so its 64-bit key at word 6 is aligned.
        unsafe { b.launch(cfg) }.map_err(launch_err(KernelId::ValidateRoutes))?;
        let mut b = stream.launch_builder(&word);
        b.arg(idx).arg(weights).arg(&mut self.state);
        for v in &scalars {
            b.arg(v);
        }
        b.arg(&rank32);
        let null: u64 = 0;
        match logits {
            Some(l) => b.arg(l),
            None => b.arg(&null),
        };
        b.arg(&e);
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: afdep_validate_word has the scan's parameters plus u32 rank, const float*
        // logits (may be null) and u64 logit_experts (= experts); one thread re-reads one
        // token's K slots (in bounds by the key's construction), or, when the router left its
        // key, one logit of a token below `tokens` (logits hold tokens × experts, checked by
        // `launch_routed`; the router key is only ever set by `router_topk` (given a validator) on a layer
        // whose logits are these), writes the state's first 6 words and clears both keys.
        unsafe { b.launch(one) }.map_err(launch_err(KernelId::ValidateWord))?;
        Ok(())
    }

    /// Fills the error word (the state's first [`ROUTE_ERROR_WORDS`] words) with `0xFF` bytes,
    /// without waiting and without touching the key the next validation starts from: poison it
    /// before a correctness run (e.g. a graph replay), so that a validation that did not run
    /// reads as an undecodable word ([`KernelError::BadErrorWord`]), never as "valid".
    pub fn poison_word(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        let stream = ctx.stream();
        let mut word = self.state.slice_mut(..ROUTE_ERROR_WORDS);
        let (ptr, _record) = word.device_ptr_mut(stream);
        // SAFETY: `ptr` addresses the state's first ROUTE_ERROR_WORDS u32 (STATE_WORDS are
        // allocated by `new`), borrowed mutably for the call; the key at word 6 is not touched.
        // Every bit pattern is a valid u32.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                ptr,
                0xFF,
                ROUTE_ERROR_WORDS * std::mem::size_of::<u32>(),
                stream.cu_stream(),
            )
        }
        .map_err(KernelError::driver("poisoning the route error word"))
    }

    /// Waits for the last validation and reads its error word.
    pub fn word(&self, ctx: &GpuContext) -> Result<[u32; ROUTE_ERROR_WORDS], KernelError> {
        let s = download(ctx, &self.state)?;
        let mut w = [0u32; ROUTE_ERROR_WORDS];
        w.copy_from_slice(&s[..ROUTE_ERROR_WORDS]);
        Ok(w)
    }

    /// Waits for the last validation and decodes its word: `Ok(Ok(()))` when the routes are
    /// valid, `Ok(Err(route error))` when they are rejected.
    pub fn result(&self, ctx: &GpuContext) -> Result<Result<(), RouteError>, KernelError> {
        let w = self.word(ctx)?;
        if w[0] == afdep_core::error::route_class::OK {
            return Ok(Ok(()));
        }
        RouteError::from_word(w)
            .map(Err)
            .ok_or(KernelError::BadErrorWord(w))
    }
}

/// Validates device routes against `rules` for attention rank `rank` and waits for the
/// answer. A rejected table is [`KernelError::Route`] holding exactly the error
/// `afdep_core::route::validate` gives for the same table (compare with
/// [`RouteError::to_word`]: NaN weights make `==` fail).
pub fn validate_routes(
    ctx: &GpuContext,
    routes: &DeviceRoutes,
    rules: &RouteRules,
    rank: usize,
) -> Result<(), KernelError> {
    let mut v = RouteValidator::new(ctx)?;
    validate_routes_with(ctx, &mut v, routes, rules, rank)
}

/// [`validate_routes`] with a validator that is reused across calls (no allocation).
pub fn validate_routes_with(
    ctx: &GpuContext,
    validator: &mut RouteValidator,
    routes: &DeviceRoutes,
    rules: &RouteRules,
    rank: usize,
) -> Result<(), KernelError> {
    validator.launch(ctx, routes, rules, rank)?;
    validator.result(ctx)?.map_err(KernelError::Route)
}
