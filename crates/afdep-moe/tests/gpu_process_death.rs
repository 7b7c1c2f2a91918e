//! Process death on the GPU: one process per rank over CUDA IPC (the fused engine over
//! `NvlinkIpc::from_bootstrap`, as `afdep launch -- afdep exchange --multi-process --transport
//! nvlink` runs it), groups of 2A:2F and 3A:1F on GPU 0, device rounds of the auto arm, eager
//! or replayed from a CUDA graph, each round checked bit for bit against the oracle on the
//! attention ranks. Once every rank has finished three rounds, one rank is killed with SIGKILL
//! in the middle of the next ones: an attention rank, or (separately) the FFN rank. Every
//! survivor must end with a typed error (`PeerGone`, a transport or device `Timeout`, or a
//! peer's failure: each names the phase or operation, the rank and the peer) within a bound of
//! its timeout, at least one of them naming the killed rank; then a new group on the same GPU
//! must run four rounds that match the oracle.
//!
//! The test starts copies of its own binary as the ranks (the environment of `afdep launch`,
//! with a job id of its own per group). Each test takes about 5–15 s on an H200 (set-up of the
//! processes, a timeout of 4 s, the new group). Without a driver or a GPU it prints
//! `SKIP: <reason>` and passes, unless `AFDEP_REQUIRE_GPU=1`.

mod exchange_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use afdep_core::ExchangeConfig;
use afdep_core::oracle::exchange as reference;
use afdep_moe::{DeviceExperts, DeviceRoundOptions, ExchangeError, FusedEngine, RoundArm};
use afdep_transport::{
    Bootstrap, ENV_JOB_ID, ENV_RANK, ENV_RENDEZVOUS, ENV_WORLD_SIZE, NvlinkIpc, NvlinkOptions,
    Transport, TransportError,
};
use exchange_common::{serial, sources};

/// The bound of every wait of a rank (bootstrap and device).
const TIMEOUT: Duration = Duration::from_secs(4);
/// How long a group may take to start and run its first rounds (the first group of a fresh
/// kernel cache compiles the kernels).
const SETUP: Duration = Duration::from_secs(90);
/// How long a survivor may take to end after the kill: its timeout, the bootstrap's grace
/// (half of it) and the verdict that follows, plus process exit.
const END_BOUND: Duration = Duration::from_secs(4 * 3);
/// A child rank's scenario: `TOPOLOGY/eager|graph/ROUNDS` (0 rounds: until an error).
const CHILD: &str = "AFDEP_TEST_DEATH_CHILD";

fn config(topo: &str) -> ExchangeConfig {
    ExchangeConfig::new(topo.parse().unwrap(), 256, 16, 4, 48).unwrap()
}

/// The inputs of round `i`: new routing and token counts each round (uneven ranks, a zero-token
/// rank every fifth round, a hot expert every other round).
fn round_input(c: &ExchangeConfig, i: usize) -> Vec<afdep_core::oracle::exchange::SourceInput> {
    let a = c.topology.attention_count();
    let tokens: Vec<usize> = (0..a)
        .map(|s| {
            if (i + s) % 5 == 0 {
                0
            } else {
                (i * 7 + s * 13) % c.capacity + 1
            }
        })
        .collect();
    let hot = (i % 2 == 0).then_some((i % c.experts) as i32);
    sources(c, &tokens, hot, 1000 + i as u64)
}

/// Whether `e` is one of the typed ends of a survivor, and the peer it names.
fn typed_end(e: &ExchangeError) -> Option<(&'static str, Option<usize>)> {
    match e {
        ExchangeError::DeviceTimeout { peer, .. } => Some(("device_timeout", Some(*peer))),
        ExchangeError::Transport(t) => match t {
            TransportError::PeerGone { peer, .. } => Some(("peer_gone", Some(*peer))),
            TransportError::Timeout { peer, .. } => Some(("timeout", *peer)),
            TransportError::PeerFailed { peer, .. } => Some(("peer_failed", Some(*peer))),
            _ => None,
        },
        _ => None,
    }
}

/// The mark of a rank process's report lines (libtest may print `test NAME ... ` before the
/// first one on the same line).
const MARK: &str = "@@ ";

fn say(line: String) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{MARK}{line}");
    let _ = o.flush();
}

/// One rank's process: rounds until `ROUNDS` (then `DONE`) or an error (then `END`, and an
/// immediate exit: a survivor's engine holds mappings of a dead peer's memory, which are not
/// this test's to tear down). A mismatch with the oracle is `MISMATCH` and exit status 2.
fn child(spec: &str) -> ! {
    let f: Vec<&str> = spec.split('/').collect();
    let (topo, graph, limit) = (f[0], f[1] == "graph", f[2].parse::<usize>().unwrap());
    let c = config(topo);
    let boot = Bootstrap::from_env(TIMEOUT).expect("the launch environment");
    let rank = boot.rank();
    let opts = NvlinkOptions {
        staging_bytes: 4 << 20,
        workspace_bytes: FusedEngine::workspace_bytes(&c).div_ceil(256) * 256,
        timeout: TIMEOUT,
    };
    let t = NvlinkIpc::from_bootstrap(boot, 0, opts).expect("NvlinkIpc over CUDA IPC");
    let mut eng = FusedEngine::new(c.clone(), t).expect("the fused engine");
    let experts = DeviceExperts::index_scale(c.experts);
    eng.prepare_device(DeviceRoundOptions {
        experts: experts.clone(),
        keep_received: false,
    })
    .expect("device buffers");
    let g = graph.then(|| eng.capture(RoundArm::Auto).expect("capture"));
    for i in 0.. {
        if limit > 0 && i == limit {
            // nobody exits (unmapping its memory) while a peer's last round may still read it
            eng.transport_mut().barrier().expect("the final barrier");
            say(format!("DONE rank {rank}"));
            std::process::exit(0);
        }
        let inp = round_input(&c, i);
        let mine = c.topology.attention_index(rank).map(|s| &inp[s]);
        let t0 = Instant::now();
        let r = match &g {
            Some(g) => eng.replay(g, mine),
            None => eng.device_round(RoundArm::Auto, mine),
        };
        match r {
            Ok(out) => {
                if let Some(s) = c.topology.attention_index(rank) {
                    let want = reference::exchange(&c, &inp, experts.host()).unwrap();
                    let bits =
                        |v: &[afdep_core::bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let got = out.combined.as_deref().unwrap_or(&[]);
                    if bits(got) != bits(&want[s]) {
                        say(format!("MISMATCH rank {rank} round {i}"));
                        std::process::exit(2);
                    }
                }
                say(format!("ROUND {i} rank {rank}"));
            }
            Err(e) => {
                let ms = t0.elapsed().as_millis();
                match typed_end(&e) {
                    Some((class, peer)) => {
                        let peer = peer.map_or("-".to_string(), |p| p.to_string());
                        say(format!(
                            "END rank {rank} round {i} {class} {peer} {ms} ms: {e}"
                        ));
                        std::process::exit(0);
                    }
                    None => {
                        say(format!("UNTYPED rank {rank} round {i} {ms} ms: {e:?}"));
                        std::process::exit(3);
                    }
                }
            }
        }
    }
    unreachable!("the round loop ends by exiting")
}

/// What the parent knows of one rank process.
#[derive(Debug, Default, Clone)]
struct Seen {
    rounds: usize,
    end: Option<String>,
    done: bool,
    bad: Option<String>,
}

/// A group of rank processes of this binary running test `test` with scenario `spec`.
struct Group {
    kids: Vec<Child>,
    rx: mpsc::Receiver<(usize, String)>,
    seen: Vec<Seen>,
}

impl Group {
    fn spawn(test: &str, spec: &str, world: usize) -> Group {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let job = format!("death-{}-{}", std::process::id(), addr.port());
        let exe = std::env::current_exe().unwrap();
        let (tx, rx) = mpsc::channel();
        let kids = (0..world)
            .map(|r| {
                let mut k = Command::new(&exe)
                    .args(["--exact", test, "--nocapture", "--test-threads=1"])
                    .env(CHILD, spec)
                    .env(ENV_RANK, r.to_string())
                    .env(ENV_WORLD_SIZE, world.to_string())
                    .env(ENV_RENDEZVOUS, addr.to_string())
                    .env(ENV_JOB_ID, &job)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .unwrap();
                let out = k.stdout.take().unwrap();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(out).lines().map_while(Result::ok) {
                        if tx.send((r, line)).is_err() {
                            break;
                        }
                    }
                });
                k
            })
            .collect();
        Group {
            kids,
            rx,
            seen: vec![Seen::default(); world],
        }
    }

    /// Takes the lines that arrived until `until` is true or `deadline` passes.
    fn watch(&mut self, deadline: Instant, until: impl Fn(&[Seen]) -> bool) -> bool {
        while !until(&self.seen) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            match self.rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok((r, line)) => {
                    let Some(at) = line.find(MARK) else { continue };
                    let line = line[at + MARK.len()..].to_string();
                    let s = &mut self.seen[r];
                    if line.starts_with("ROUND ") {
                        s.rounds += 1;
                    } else if line.starts_with("END ") {
                        println!("  [{r}] {line}");
                        s.end = Some(line);
                    } else if line.starts_with("DONE ") {
                        s.done = true;
                    } else if line.starts_with("MISMATCH") || line.starts_with("UNTYPED") {
                        println!("  [{r}] {line}");
                        s.bad = Some(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return until(&self.seen),
            }
            if let Some((r, b)) = self
                .seen
                .iter()
                .enumerate()
                .find_map(|(r, s)| s.bad.clone().map(|b| (r, b)))
            {
                self.kill_all();
                panic!("rank {r}: {b}");
            }
        }
        true
    }

    /// [`watch`](Group::watch), but failing at once when a rank process exits with an error
    /// first (a set-up failure), instead of waiting out the deadline.
    fn watch_running(&mut self, what: &str, deadline: Instant, until: impl Fn(&[Seen]) -> bool) {
        loop {
            let step = (Instant::now() + Duration::from_millis(500)).min(deadline);
            if self.watch(step, &until) {
                return;
            }
            let mut ended = 0;
            for (r, k) in self.kids.iter_mut().enumerate() {
                if let Some(st) = k.try_wait().unwrap() {
                    ended += 1;
                    if !st.success() {
                        panic!(
                            "{what}: rank {r} ended ({st}) before the rounds: {:?}",
                            self.seen
                        );
                    }
                }
            }
            let drain = Instant::now() + Duration::from_millis(500);
            if ended == self.kids.len() && !self.watch(drain, &until) {
                panic!("{what}: every rank ended, not done: {:?}", self.seen);
            }
            if Instant::now() >= deadline {
                panic!("{what}: not done within {SETUP:?}: {:?}", self.seen);
            }
        }
    }

    /// Waits for rank `r`'s exit until `deadline`; its status, or `None` if still running.
    fn wait(&mut self, r: usize, deadline: Instant) -> Option<std::process::ExitStatus> {
        loop {
            if let Some(st) = self.kids[r].try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn kill_all(&mut self) {
        for k in &mut self.kids {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Which rank dies.
#[derive(Debug, Clone, Copy)]
enum Victim {
    /// The last attention rank (not rank 0, the bootstrap's root).
    Attention,
    /// The last FFN rank.
    Ffn,
}

fn skip_without_gpu() -> bool {
    if let Err(e) = afdep_transport::nvlink::probe_driver() {
        afdep_core::testing::skip_unavailable("a GPU", e);
        return true;
    }
    false
}

/// One scenario, run by the test named `test`.
fn death(test: &str, topo: &str, mode: &str, victim: Victim) {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
    }
    if skip_without_gpu() {
        return;
    }
    let _lock = serial();
    let t_all = Instant::now();
    let c = config(topo);
    let world = c.topology.world_size();
    let dead = match victim {
        Victim::Attention => c.topology.attention_count() - 1,
        Victim::Ffn => world - 1,
    };
    assert_ne!(dead, 0);
    let mut g = Group::spawn(test, &format!("{topo}/{mode}/0"), world);
    g.watch_running(
        &format!("{topo} {mode}: the first 3 rounds"),
        Instant::now() + SETUP,
        |s| s.iter().all(|s| s.rounds >= 3),
    );
    // in the middle of the next rounds
    std::thread::sleep(Duration::from_millis(3));
    let _ = g.kids[dead].kill();
    let killed = Instant::now();
    let _ = g.kids[dead].wait();
    let mut named_victim = false;
    for r in (0..world).filter(|&r| r != dead) {
        let st = g.wait(r, killed + END_BOUND);
        g.watch(Instant::now() + Duration::from_millis(500), |s| {
            s[r].end.is_some()
        });
        let took = killed.elapsed();
        let st = st.unwrap_or_else(|| {
            panic!("{topo} {mode}: survivor rank {r} still running {END_BOUND:?} after rank {dead} was killed")
        });
        let end = g.seen[r].end.clone().unwrap_or_else(|| {
            panic!("{topo} {mode}: survivor rank {r} ended ({st}) without a typed error line")
        });
        assert!(st.success(), "{topo} {mode}: survivor rank {r}: {st}");
        // END rank R round I CLASS PEER MS ms: error
        let f: Vec<&str> = end.split(' ').collect();
        assert_eq!(f[2], r.to_string(), "{end}");
        named_victim |= f[6] == dead.to_string();
        println!("  {topo} {mode}: rank {r} ended {took:?} after the kill: {end}");
    }
    assert!(
        named_victim,
        "{topo} {mode}: no survivor's error names the killed rank {dead}: {:?}",
        g.seen
    );
    drop(g);
    // a new group on the same GPU
    let mut h = Group::spawn(test, &format!("{topo}/{mode}/4"), world);
    h.watch_running(
        &format!("{topo} {mode}: the new group"),
        Instant::now() + SETUP,
        |s| s.iter().all(|s| s.done),
    );
    for r in 0..world {
        let st = h.wait(r, Instant::now() + Duration::from_secs(10));
        assert!(
            st.is_some_and(|s| s.success()),
            "{topo} {mode}: new group rank {r}: {st:?}"
        );
        assert_eq!(h.seen[r].rounds, 4, "new group rank {r}");
    }
    println!(
        "{topo} {mode}, {victim:?} rank {dead} killed: every survivor ended typed, a new group matched the oracle ({:?})",
        t_all.elapsed()
    );
}

#[test]
fn death_2a2f_eager_attention_rank() {
    death(
        "death_2a2f_eager_attention_rank",
        "2A:2F",
        "eager",
        Victim::Attention,
    );
}

#[test]
fn death_2a2f_eager_ffn_rank() {
    death("death_2a2f_eager_ffn_rank", "2A:2F", "eager", Victim::Ffn);
}

#[test]
fn death_2a2f_graph_attention_rank() {
    death(
        "death_2a2f_graph_attention_rank",
        "2A:2F",
        "graph",
        Victim::Attention,
    );
}

#[test]
fn death_2a2f_graph_ffn_rank() {
    death("death_2a2f_graph_ffn_rank", "2A:2F", "graph", Victim::Ffn);
}

#[test]
fn death_3a1f_eager_attention_rank() {
    death(
        "death_3a1f_eager_attention_rank",
        "3A:1F",
        "eager",
        Victim::Attention,
    );
}

#[test]
fn death_3a1f_eager_ffn_rank() {
    death("death_3a1f_eager_ffn_rank", "3A:1F", "eager", Victim::Ffn);
}

#[test]
fn death_3a1f_graph_attention_rank() {
    death(
        "death_3a1f_graph_attention_rank",
        "3A:1F",
        "graph",
        Victim::Attention,
    );
}

#[test]
fn death_3a1f_graph_ffn_rank() {
    death("death_3a1f_graph_ffn_rank", "3A:1F", "graph", Victim::Ffn);
}
