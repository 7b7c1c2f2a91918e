//! The staged engine over Loopback against the oracle: every ratio, uneven ranks, a zero-token
//! rank, a hot expert, masked slots, rejected routes, a rank with a different config (knobs,
//! partials), bf16 combine partials, and the one-device layer. With the feature `ucx`, every ratio and the rejected routes also run over
//! UCX (ranks as threads, over tcp and over shared memory).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::SourceInput;
use afdep_core::oracle::layer;
use afdep_core::route::{MASKED, Routes};
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ConfigError, ExchangeConfig, PayloadKind, RouteError, bf16};
use afdep_moe::{ExchangeError, StagedEngine};
use afdep_transport::{Loopback, Span, Transport, TransportError, TransportKind};

mod exchange_common;
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs the given rounds on one Loopback group (one engine per rank, kept across rounds);
/// `cfgs[r]` is rank r's config. Returns `[round][rank]` results, or each rank's set-up error.
fn run(
    cfgs: &[ExchangeConfig],
    rounds: &[Vec<SourceInput>],
    p: Option<&LayerParams>,
) -> Result<Vec<Vec<RankResult>>, Vec<ExchangeError>> {
    run_on(&loopback, cfgs, rounds, p)
}

fn loopback(world: usize) -> Vec<Loopback> {
    Loopback::group(world, TIMEOUT)
}

/// [`run`] on the group that `make(world)` forms.
fn run_on<T: Transport + Send>(
    make: &dyn Fn(usize) -> Vec<T>,
    cfgs: &[ExchangeConfig],
    rounds: &[Vec<SourceInput>],
    p: Option<&LayerParams>,
) -> Result<Vec<Vec<RankResult>>, Vec<ExchangeError>> {
    let group = make(cfgs[0].topology.world_size());
    run_group(group, cfgs, rounds, p, &|_, cfg, t| {
        StagedEngine::new(cfg, t)
    })
}

#[test]
fn every_ratio_is_bit_identical_to_the_oracle() {
    every_ratio_on(&loopback);
}

fn every_ratio_on<T: Transport + Send>(make: &dyn Fn(usize) -> Vec<T>) {
    for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4"] {
        let c = cfg(topo, 24, 12, 3);
        let a = c.topology.attention_count();
        let p = params(&c, 8, 5);
        let token_sets: [&[usize]; 3] = [&[7, 0, 13, 2], &[1, 1, 1, 1], &[0, 0, 0, 0]];
        let rounds: Vec<Vec<SourceInput>> = token_sets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                sources(
                    &c,
                    &t[..a],
                    if i == 0 { Some(5) } else { None },
                    i as u64 + 1,
                )
            })
            .chain(std::iter::once(sources(
                &c,
                &[33, 5, 0, 20][..a],
                Some(11),
                9,
            )))
            .collect();
        let got = run_on(
            make,
            &vec![c.clone(); c.topology.world_size()],
            &rounds,
            Some(&p),
        )
        .unwrap();
        for (inp, g) in rounds.iter().zip(&got) {
            check_round(&c, inp, g, Some(&p));
        }
    }
}

#[test]
fn unplaced_experts_and_two_experts_per_rank_work() {
    // 1A:3F with 6 of 9 experts placed (2 per rank); the router never picks 6..9 here.
    let mut c = cfg("1A:3F", 16, 9, 2);
    c.experts_per_rank = 2;
    c.validate().unwrap();
    let inp = sources(&c, &[9], Some(1), 3);
    let got = run(&vec![c.clone(); 4], std::slice::from_ref(&inp), None).unwrap();
    check_round(&c, &inp, &got[0], None);
}

#[test]
fn a_rejected_route_fails_every_rank_and_the_next_round_works() {
    rejected_route_on(&loopback);
}

fn rejected_route_on<T: Transport + Send>(make: &dyn Fn(usize) -> Vec<T>) {
    let c = cfg("3A:1F", 16, 8, 2);
    let mut c_dummy = c.clone();
    c_dummy.experts_per_rank = 6; // experts 6, 7 unplaced
    type Corrupt = fn(&mut Vec<SourceInput>);
    let cases: Vec<(&ExchangeConfig, Corrupt, RouteError)> = vec![
        (
            &c,
            |s| s[1].routes.idx[2 * 2 + 1] = s[1].routes.idx[2 * 2],
            RouteError::Duplicate {
                rank: 1,
                token: 2,
                slot: 1,
                expert: 0,
                first_slot: 0,
            },
        ),
        (
            &c,
            |s| s[2].routes.idx[1] = -2,
            RouteError::Negative {
                rank: 2,
                token: 0,
                slot: 1,
                value: -2,
            },
        ),
        (
            &c,
            |s| s[0].routes.idx[4] = 8,
            RouteError::Wide {
                rank: 0,
                token: 2,
                slot: 0,
                value: 8,
                experts: 8,
            },
        ),
        (
            &c_dummy,
            |s| s[1].routes.idx[0] = 7,
            RouteError::Dummy {
                rank: 1,
                token: 0,
                slot: 0,
                value: 7,
                owned: 6,
            },
        ),
        (
            &c,
            |s| s[1].routes.weights[3] = f32::INFINITY,
            RouteError::NonFiniteWeight {
                rank: 1,
                token: 1,
                slot: 1,
                value: f32::INFINITY,
            },
        ),
        (
            &c,
            |s| {
                let extra = sources(&cfg("3A:1F", 16, 8, 2), &[70], None, 4).remove(0);
                s[2] = extra;
            },
            RouteError::OverCapacity {
                rank: 2,
                tokens: 70,
                capacity: 64,
            },
        ),
    ];
    for (cf, corrupt, want) in cases {
        // fixed, unmasked routes so the corruption lands where the expected error says
        let mut bad: Vec<SourceInput> = (0..3)
            .map(|s| {
                let t = 4;
                let idx: Vec<i32> = (0..t * 2)
                    .map(|i| ((i / 2 + (i % 2) * 3 + s) % 6) as i32)
                    .collect();
                SourceInput {
                    x: uniform_bf16(t * 16, 1.0, 8, s as u64),
                    routes: Routes {
                        tokens: t,
                        top_k: 2,
                        idx,
                        weights: vec![0.5; t * 2],
                    },
                }
            })
            .collect();
        // the duplicate case needs slot 0 of token 2 on rank 1 to be expert 0: set it
        bad[1].routes.idx[4] = 0;
        bad[1].routes.idx[5] = 1;
        corrupt(&mut bad);
        let good = sources(cf, &[3, 0, 5], Some(2), 12);
        let got = run_on(make, &vec![cf.clone(); 4], &[bad, good.clone()], None).unwrap();
        let expected = format!("the route error {want}");
        check_route_errors(&got[0], "", &expected, |rank, error| {
            assert_eq!(
                error.to_word(),
                want.to_word(),
                "rank {rank}: {error} (wanted {want})"
            );
        });
        check_round(cf, &good, &got[1], None);
    }
}

#[test]
fn a_rank_with_a_different_config_fails_at_set_up() {
    let c = cfg("2A:2F", 16, 8, 2);
    let mut other = c.clone();
    other.knobs.min_rows_per_unit = 3;
    let mut cfgs = vec![c.clone(); 4];
    cfgs[2] = other;
    let errs = run(&cfgs, &[], None).unwrap_err();
    for (rank, e) in errs.iter().enumerate() {
        match e {
            ExchangeError::Config(ConfigError::Mismatch {
                field,
                local_rank,
                remote_rank,
                ..
            }) => {
                assert_eq!(field, "knobs.min_rows_per_unit");
                assert_eq!(*local_rank, rank);
                assert_eq!(*remote_rank, if rank == 2 { 0 } else { 2 });
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// bf16 combine partials: every ratio bit-identical to the oracle with bf16 partials, within the
/// bound of the exact (f32-partials) oracle, the same bits as it on one FFN rank and different
/// on several; the SwiGLU experts and the cheap scaling both.
#[test]
fn bf16_partials_every_ratio_match_the_bf16_oracle_within_the_bound() {
    for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4", "EP1"] {
        let c = bf16_partials(cfg(topo, 24, 12, 3));
        let p = params(&c, 8, 5);
        let rounds = every_ratio_rounds(&c);
        for params in [Some(&p), None] {
            let got = run(&vec![c.clone(); c.topology.world_size()], &rounds, params).unwrap();
            let mut differing = 0;
            for (inp, g) in rounds.iter().zip(&got) {
                check_round(&c, inp, g, params);
                differing += check_partials_bound(&c, inp, g, expert_of(params));
            }
            check_partials_took_effect(&c, differing);
        }
    }
}

#[test]
fn a_rank_with_other_partials_fails_at_set_up() {
    let c = cfg("2A:2F", 16, 8, 2);
    let mut cfgs = vec![c.clone(); 4];
    cfgs[1] = bf16_partials(c);
    let errs = run(&cfgs, &[], None).unwrap_err();
    for (rank, e) in errs.iter().enumerate() {
        match e {
            ExchangeError::Config(ConfigError::Mismatch { field, .. }) => {
                assert_eq!(field, "partials", "rank {rank}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// The routed part of the one-device layer, from the same tokens, parameters and routes, split
/// over the attention ranks. The exchange rounds each expert output to bf16 before combining
/// and sums per FFN rank first; the layer keeps y in f32 and sums slots in order. With
/// u = 2^-8 (bf16 unit roundoff) the difference per element is at most
/// u·|a_layer| + u·|a_exchange| + u·Σ|w y| + 2K·2^-24·Σ|w y| ≤ (3u + 2K·2^-24)·Σ_k |w_k y_k|,
/// and Σ|w y| ≤ Σ|w ŷ| / (1 − u) with ŷ the bf16 rows.
#[test]
fn exchange_equals_the_one_device_layer() {
    for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4"] {
        let c = cfg(topo, 32, 12, 3);
        let p = params(&c, 16, 21);
        let a = c.topology.attention_count();
        let tokens = [9usize, 0, 14, 5];
        let total: usize = tokens[..a].iter().sum();
        let x = uniform_bf16(total * c.hidden, 1.0, 77, 0);
        let fwd = layer::forward(&p, &x, total).unwrap();
        let mut inputs = Vec::new();
        let mut start = 0;
        for &t in &tokens[..a] {
            let k = c.top_k;
            inputs.push(SourceInput {
                x: x[start * c.hidden..(start + t) * c.hidden].to_vec(),
                routes: Routes {
                    tokens: t,
                    top_k: k,
                    idx: fwd.routes.idx[start * k..(start + t) * k].to_vec(),
                    weights: fwd.routes.weights[start * k..(start + t) * k].to_vec(),
                },
            });
            start += t;
        }
        let got = run(
            &vec![c.clone(); c.topology.world_size()],
            std::slice::from_ref(&inputs),
            Some(&p),
        )
        .unwrap();
        check_round(&c, &inputs, &got[0], Some(&p));
        let u = 2f64.powi(-8);
        let bound_factor = (3.0 * u + 2.0 * c.top_k as f64 * 2f64.powi(-24)) / (1.0 - u);
        let mut start = 0;
        for (s, inp) in inputs.iter().enumerate() {
            let out = got[0][s].as_ref().unwrap().combined.as_ref().unwrap();
            for t in 0..inp.routes.tokens {
                let row = &inp.x[t * c.hidden..(t + 1) * c.hidden];
                let mut mag = vec![0f64; c.hidden];
                for (e, w) in inp.routes.slots(t) {
                    let y = layer::expert_rows(&p, e as usize, row, 1).unwrap();
                    for (m, v) in mag.iter_mut().zip(&y) {
                        *m += (w as f64 * v.to_f64()).abs();
                    }
                }
                for h in 0..c.hidden {
                    let l = fwd.out[(start + t) * c.hidden + h].to_f64();
                    let x = out[t * c.hidden + h].to_f64();
                    let bound = bound_factor * mag[h] + 1e-30;
                    assert!(
                        (l - x).abs() <= bound,
                        "{topo} source {s} token {t} ch {h}: layer {l} exchange {x} bound {bound}"
                    );
                }
            }
            start += inp.routes.tokens;
        }
    }
}

fn fp8_cfg(topo: &str, hidden: usize) -> ExchangeConfig {
    let mut c = cfg(topo, hidden, 12, 3);
    c.payload = PayloadKind::Fp8E4m3;
    c.validate().unwrap();
    c
}

/// The every-ratio rounds with fp8 edge groups in every row (zero, subnormal, huge, spiked and
/// tied groups), masked slots, a hot expert, a zero-token rank and an empty round.
fn fp8_rounds(c: &ExchangeConfig) -> Vec<Vec<SourceInput>> {
    let a = c.topology.attention_count();
    let token_sets: [&[usize]; 4] = [
        &[7, 0, 13, 2],
        &[1, 1, 1, 1],
        &[0, 0, 0, 0],
        &[33, 5, 0, 20],
    ];
    token_sets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut s = sources(c, &t[..a], [Some(5), None, None, Some(11)][i], i as u64 + 1);
            for (j, src) in s.iter_mut().enumerate() {
                afdep_core::tensor::fp8_edge_groups(&mut src.x, c.hidden, (i * 7 + j) as u64);
            }
            s
        })
        .collect()
}

#[test]
fn fp8_every_ratio_is_bit_identical_to_the_oracle() {
    fp8_every_ratio_on(&loopback);
}

fn fp8_every_ratio_on<T: Transport + Send>(make: &dyn Fn(usize) -> Vec<T>) {
    for (topo, hidden) in [("3A:1F", 384), ("2A:2F", 128), ("1A:3F", 256), ("EP4", 384)] {
        let c = fp8_cfg(topo, hidden);
        // the cheap expert (rows × (e + 1)): the SwiGLU experts would overflow on the huge
        // groups; the quantisation is what is under test
        let rounds = fp8_rounds(&c);
        let got = run_on(
            make,
            &vec![c.clone(); c.topology.world_size()],
            &rounds,
            None,
        )
        .unwrap();
        for (inp, g) in rounds.iter().zip(&got) {
            check_round(&c, inp, g, None);
            for (rank, r) in g.iter().enumerate() {
                if let Some(rx) = &r.as_ref().unwrap().received {
                    assert!(rx.fp8.is_some(), "{topo} rank {rank}: no fp8 rows");
                }
            }
        }
    }
}

/// A transport that counts the bytes each rank sends through `all_to_all_v`.
struct Counting<T> {
    inner: T,
    sent: Arc<Mutex<Vec<u64>>>,
}

impl<T: Transport> Transport for Counting<T> {
    type Buffer = T::Buffer;
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
    fn alloc(&mut self, bytes: usize) -> Result<T::Buffer, TransportError> {
        self.inner.alloc(bytes)
    }
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.inner.all_gather(mine)
    }
    fn all_to_all_v(
        &mut self,
        send: &T::Buffer,
        send_spans: &[Span],
        recv: &mut T::Buffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        self.sent
            .lock()
            .unwrap()
            .push(send_spans.iter().map(|s| s.len).sum());
        self.inner.all_to_all_v(send, send_spans, recv, recv_spans)
    }
    fn barrier(&mut self) -> Result<(), TransportError> {
        self.inner.barrier()
    }
}

/// The dispatch message of an fp8 round carries codes and scales: per token
/// `hidden + 4·hidden/128` payload bytes instead of `2·hidden`, the same metadata.
#[test]
fn fp8_dispatch_sends_codes_and_scales_not_bf16_rows() {
    let hidden = 2048;
    for payload in [PayloadKind::Bf16, PayloadKind::Fp8E4m3] {
        let mut c = cfg("3A:1F", hidden, 12, 3);
        c.payload = payload;
        let inp = sources(&c, &[9, 0, 17], Some(2), 3);
        let sent = Arc::new(Mutex::new(Vec::new()));
        let got = run_on(
            &|w| {
                Loopback::group(w, TIMEOUT)
                    .into_iter()
                    .map(|t| Counting {
                        inner: t,
                        sent: sent.clone(),
                    })
                    .collect()
            },
            &[c.clone(), c.clone(), c.clone(), c.clone()],
            std::slice::from_ref(&inp),
            None,
        )
        .unwrap();
        check_round(&c, &inp, &got[0], None);
        // the FFN rank's compact view has one row per token that travels
        let tokens = got[0][3]
            .as_ref()
            .unwrap()
            .received
            .as_ref()
            .unwrap()
            .compact_tokens
            .len();
        let payload_bytes = match payload {
            PayloadKind::Bf16 => 2 * hidden,
            PayloadKind::Fp8E4m3 => hidden + 4 * hidden / 128,
        };
        let want = (tokens * (payload_bytes + 4 + 8 * c.top_k)) as u64;
        // each rank's first all-to-all is the dispatch; sources send, the FFN rank sends nothing
        let sent = sent.lock().unwrap();
        let dispatch: u64 = sent.iter().take(4).sum();
        assert_eq!(dispatch, want, "{payload}: dispatch bytes");
    }
}

#[test]
fn fp8_non_finite_row_fails_every_rank_and_the_next_round_works() {
    let c = fp8_cfg("2A:2F", 256);
    let mut bad = sources(&c, &[4, 6], None, 3);
    // token 1 of source 1: an infinity at channel 130; token 0 of source 1 masks every slot
    // and holds a NaN, which does not travel
    bad[1].routes.idx[..3].iter_mut().for_each(|e| *e = MASKED);
    bad[1].x[5] = bf16::NAN;
    bad[1].routes.idx[3] = 1;
    bad[1].x[256 + 130] = bf16::INFINITY;
    let want = RouteError::NonFinitePayload {
        rank: 1,
        token: 1,
        channel: 130,
        value: f32::INFINITY,
    };
    let good = sources(&c, &[3, 0], Some(2), 12);
    let got = run(&vec![c.clone(); 4], &[bad, good.clone()], None).unwrap();
    check_route_errors(&got[0], "", &want, |rank, error| {
        assert_eq!(error, &want, "rank {rank}");
    });
    check_round(&c, &good, &got[1], None);
}

#[cfg(feature = "ucx")]
mod over_ucx {
    use super::*;
    use afdep_transport::{Bootstrap, Ucx, UcxOptions};

    /// A UCX group of `world` ranks formed on threads through a bootstrap on 127.0.0.1.
    fn ucx_group(world: usize, tls: &str) -> Vec<Ucx> {
        let listener = Bootstrap::listen("127.0.0.1:0".parse().unwrap(), world, TIMEOUT).unwrap();
        let addr = listener.local_addr();
        let opts = UcxOptions::with_tls(tls);
        let mut listener = Some(listener);
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let l = if r == 0 { listener.take() } else { None };
                    let opts = &opts;
                    sc.spawn(move || {
                        let boot = match l {
                            Some(l) => l.accept(),
                            None => Bootstrap::connect(addr, r, world, TIMEOUT),
                        };
                        Ucx::new(boot.unwrap(), opts).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_ratio_is_bit_identical_to_the_oracle_over_ucx() {
        for tls in ["tcp", "shm"] {
            every_ratio_on(&|w| ucx_group(w, tls));
        }
    }

    #[test]
    fn fp8_every_ratio_is_bit_identical_to_the_oracle_over_ucx() {
        fp8_every_ratio_on(&|w| ucx_group(w, "tcp"));
    }

    #[test]
    fn a_rejected_route_fails_every_rank_and_the_next_round_works_over_ucx() {
        for tls in ["tcp", "shm"] {
            rejected_route_on(&|w| ucx_group(w, tls));
        }
    }
}
