//! The host experts of one FFN rank over its expanded rows.

use afdep_core::layout::FfnPlan;
use afdep_core::{ExchangeConfig, bf16};

use super::ExpertFn;
use crate::error::ExchangeError;

/// The experts of FFN rank `f` (global rank `rank`) on the host: `expert` applied to each local
/// expert's rows of `expanded` (the plan's expert offsets; an expert with no rows is not
/// called), outputs concatenated in expanded-row order. An expert that returns the wrong number
/// of values is an [`ExchangeError::Input`].
pub(crate) fn apply_experts(
    cfg: &ExchangeConfig,
    rank: usize,
    f: usize,
    plan: &FfnPlan,
    expanded: &[bf16],
    expert: &dyn ExpertFn,
) -> Result<Vec<bf16>, ExchangeError> {
    let p = cfg.placement();
    let h = cfg.hidden;
    let mut y_rows = Vec::with_capacity(expanded.len());
    for l in 0..p.experts_per_rank {
        let (a, b) = (
            plan.expert_offsets[l] as usize,
            plan.expert_offsets[l + 1] as usize,
        );
        if a == b {
            continue; // an expert with no rows this round costs nothing
        }
        let e = p.experts_of(f).start + l;
        let ye = expert(e, &expanded[a * h..b * h], b - a);
        if ye.len() != (b - a) * h {
            return Err(ExchangeError::Input {
                rank,
                what: format!("expert {e} returned {} values for {} rows", ye.len(), b - a),
            });
        }
        y_rows.extend(ye);
    }
    Ok(y_rows)
}
