//! [`run_group`]: one engine per rank of an in-process group, each on its own thread.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Barrier;

/// How one rank's thread of [`run_group`] ended: `Err` with the panic's payload when it
/// panicked, else what its set-up or its work returned.
pub type RankOutcome<R, E> = std::thread::Result<Result<R, E>>;

/// Runs one engine per rank of an in-process group, one thread per rank: rank `r`'s thread
/// builds its engine with `make(r, group[r])`, then runs `work(r, &mut engine)`. Returns each
/// rank's outcome, by rank.
///
/// No engine is dropped before every rank's thread has finished its work (or failed): a rank
/// that frees device memory (which may synchronise the device) while another rank's kernel
/// still waits for its peers on the same GPU could stall that kernel until its bound. Each
/// engine is dropped on its own thread. A panic in `make` or `work` is caught and returned, so
/// it cannot leave the other ranks waiting for it at the final barrier.
pub fn run_group<T, E, R, Er>(
    group: Vec<T>,
    make: impl Fn(usize, T) -> Result<E, Er> + Sync,
    work: impl Fn(usize, &mut E) -> Result<R, Er> + Sync,
) -> Vec<RankOutcome<R, Er>>
where
    T: Send,
    R: Send,
    Er: Send,
{
    let done = Barrier::new(group.len());
    let (make, work, done) = (&make, &work, &done);
    std::thread::scope(|sc| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                sc.spawn(move || {
                    let mut engine = None;
                    let outcome = catch_unwind(AssertUnwindSafe(|| {
                        let e = engine.insert(make(rank, t)?);
                        work(rank, e)
                    }));
                    // every rank has finished before any engine is dropped
                    done.wait();
                    drop(engine);
                    outcome
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(Err))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_runs_and_outcomes_come_back_by_rank() {
        let out = run_group(
            vec![10, 20, 30],
            |rank, t| {
                if rank == 1 {
                    Err("no engine")
                } else {
                    Ok(t + rank)
                }
            },
            |rank, e| {
                if rank == 2 {
                    panic!("rank 2 fails in its work");
                }
                *e += 1;
                Ok(*e)
            },
        );
        assert_eq!(out.len(), 3);
        assert_eq!(*out[0].as_ref().expect("no panic"), Ok(11));
        assert_eq!(*out[1].as_ref().expect("no panic"), Err("no engine"));
        assert!(out[2].is_err(), "rank 2's panic is returned");
    }

    #[test]
    fn engines_are_dropped_only_after_every_rank_is_done() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static WORKED: AtomicUsize = AtomicUsize::new(0);
        struct Engine;
        impl Drop for Engine {
            fn drop(&mut self) {
                assert_eq!(
                    WORKED.load(Ordering::SeqCst),
                    4,
                    "dropped before every rank worked"
                );
            }
        }
        let out = run_group(
            vec![(); 4],
            |_, ()| Ok::<_, ()>(Engine),
            |rank, _| {
                std::thread::sleep(std::time::Duration::from_millis(5 * rank as u64));
                WORKED.fetch_add(1, Ordering::SeqCst);
                Ok(())
            },
        );
        assert!(out.iter().all(|o| matches!(o, Ok(Ok(())))));
    }
}
