//! The status + counts phase the staged and NCCL device engines start with: validation, the error word
//! and every source's counts in one all-gather over the transport's control plane.

use afdep_core::error::ROUTE_ERROR_WORDS;
use afdep_core::layout::SourceCounts;
use afdep_core::oracle::exchange::{SourceInput, check_payload, check_rows};
use afdep_core::route::{RouteRules, validate};
use afdep_core::{ExchangeConfig, RouteError};
use afdep_transport::Transport;
use tracing::debug;

use crate::error::ExchangeError;

/// The status + counts phase of the staged and NCCL device engines, collective: each attention rank
/// validates its input and routes and publishes its error word and its [`SourceCounts`] in one
/// all-gather. Returns every source's counts, or [`ExchangeError::Route`] on every rank with the
/// error of the lowest-numbered rejecting rank. (The fused engine runs the same validation on
/// the device, `afdep_round_begin`, with the same errors.)
pub(crate) fn count_phase<T: Transport>(
    cfg: &ExchangeConfig,
    transport: &mut T,
    input: Option<&SourceInput>,
) -> Result<Vec<SourceCounts>, ExchangeError> {
    let rank = transport.rank();
    let topo = cfg.topology;
    let p = cfg.placement();
    let nf = p.ffn_ranks;
    let world = topo.world_size();
    let src_index = topo.attention_index(rank);
    let local: Result<Option<SourceCounts>, RouteError> = match (src_index, input) {
        (Some(s), Some(inp)) => check_rows(cfg, s, inp)
            .and_then(|_| validate(&inp.routes, &RouteRules::exchange(cfg), s))
            .and_then(|_| check_payload(cfg, s, inp))
            .map(|_| Some(SourceCounts::build(&inp.routes, &p))),
        (Some(s), None) => Err(RouteError::Malformed {
            rank: s,
            what: "an attention rank was given no input".into(),
        }),
        (None, Some(_)) => Err(RouteError::Malformed {
            rank,
            what: "an FFN-only rank was given input".into(),
        }),
        (None, None) => Ok(None),
    };
    let count_words = p.owned() + 2 * nf;
    let mut msg = vec![0u64; ROUTE_ERROR_WORDS.div_ceil(2) + count_words];
    match &local {
        Err(e) => {
            let w = e.to_word();
            let w32: &mut [u32] =
                bytemuck::cast_slice_mut(&mut msg[..ROUTE_ERROR_WORDS.div_ceil(2)]);
            w32[..ROUTE_ERROR_WORDS].copy_from_slice(&w);
        }
        Ok(Some(c)) => {
            let at = ROUTE_ERROR_WORDS.div_ceil(2);
            msg[at..at + count_words].copy_from_slice(&c.to_words());
        }
        Ok(None) => {}
    }
    let gathered = transport.all_gather(bytemuck::cast_slice(&msg))?;
    let per = msg.len() * 8;
    let mut sources: Vec<SourceCounts> = Vec::with_capacity(topo.attention_count());
    for r in 0..world {
        let blob = &gathered[r * per..(r + 1) * per];
        let words: Vec<u64> = bytemuck::pod_collect_to_vec(blob);
        let w32: Vec<u32> =
            bytemuck::pod_collect_to_vec(&blob[..ROUTE_ERROR_WORDS.div_ceil(2) * 8]);
        let word: [u32; ROUTE_ERROR_WORDS] = w32[..ROUTE_ERROR_WORDS].try_into().expect("sized");
        if word[0] != 0 {
            let error = match (&local, r == rank) {
                (Err(e), true) => e.clone(),
                _ => RouteError::from_word(word).unwrap_or(RouteError::Malformed {
                    rank: r,
                    what: format!("unknown error class {}", word[0]),
                }),
            };
            debug!(rank, from = r, %error, "round rejected");
            return Err(ExchangeError::Route {
                reporter: rank,
                error,
            });
        }
        if topo.attention_index(r).is_some() {
            let at = ROUTE_ERROR_WORDS.div_ceil(2);
            let c =
                SourceCounts::from_words(&words[at..at + count_words], &p).ok_or_else(|| {
                    ExchangeError::Input {
                        rank,
                        what: format!("malformed counts from rank {r}"),
                    }
                })?;
            sources.push(c);
        }
    }
    Ok(sources)
}
