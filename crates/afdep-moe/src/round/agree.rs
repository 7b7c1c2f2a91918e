//! The set-up agreement of every engine: config fingerprints, the config's validity and the
//! transport's world size, checked collectively.

use afdep_core::ExchangeConfig;
use afdep_core::fingerprint::Fingerprint;
use afdep_transport::Transport;

use crate::error::ExchangeError;

/// Set-up common to the engines, collective: compares config fingerprints with every rank
/// (the error names the first field that differs and the lowest rank that differs), validates
/// the config and checks that the transport's world matches the topology.
pub(crate) fn agree<T: Transport>(
    cfg: &ExchangeConfig,
    transport: &mut T,
) -> Result<(), ExchangeError> {
    let rank = transport.rank();
    // Agree first, so that a rank with a broken config still takes part in the
    // collective and every rank learns about it.
    let mine = Fingerprint::of_exchange(cfg).to_bytes();
    let lens = transport.all_gather(&(mine.len() as u64).to_ne_bytes())?;
    let lens: Vec<usize> = lens
        .chunks(8)
        .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")) as usize)
        .collect();
    let max = lens.iter().copied().max().unwrap_or(0);
    let mut padded = mine.clone();
    padded.resize(max, 0);
    let all = transport.all_gather(&padded)?;
    let local = Fingerprint::of_exchange(cfg);
    for (r, (blob, &len)) in all.chunks(max.max(1)).zip(&lens).enumerate() {
        if r == rank {
            continue;
        }
        let remote = Fingerprint::from_bytes(&blob[..len])?;
        local.compare(rank, &remote, r)?;
    }
    cfg.validate()?;
    if transport.world_size() != cfg.topology.world_size() {
        return Err(ExchangeError::Input {
            rank,
            what: format!(
                "the transport has {} ranks, topology {} needs {}",
                transport.world_size(),
                cfg.topology,
                cfg.topology.world_size()
            ),
        });
    }
    Ok(())
}
