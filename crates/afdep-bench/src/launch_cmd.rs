//! `afdep launch -n N [--rendezvous ADDR] [--job-id ID] [--timeout S] [--grace S] -- CMD ARGS...`:
//! starts N processes of one multi-process group, torchrun-like.
//!
//! Each child gets the bootstrap's environment ([`ENV_RANK`], [`ENV_WORLD_SIZE`],
//! [`ENV_RENDEZVOUS`], [`ENV_JOB_ID`]; rank 0 listens on the rendezvous address, 127.0.0.1 and
//! a free port unless `--rendezvous` says otherwise, and drops connections of another job, see
//! [`afdep_transport::Bootstrap`]). The job identity is `--job-id`, else the launcher's own
//! [`ENV_JOB_ID`], else a random one made for this launch. Its stderr lines are forwarded prefixed with `[rank] `; its
//! stdout lines are forwarded whole (unprefixed unless `--tag-stdout`, so that rank 0's JSON rows
//! stay parseable), one line at a time so that the ranks' lines never interleave.
//!
//! The launcher waits for every child. When one exits with a non-zero status or is killed by a
//! signal, the others get `--grace` seconds to finish on their own (so their typed errors, a
//! peer gone or a timeout, reach the log), then are killed; when `--timeout` passes, all are
//! killed. Either way the launcher exits non-zero naming the first rank that failed and how.
//!
//! The children stay in the launcher's process group, so a Ctrl-C at the terminal reaches all of
//! them. What a rank started itself (a shell's background children) is not the launcher's to
//! kill; if such a process keeps a rank's output pipe open, the launcher stops forwarding it
//! [`DRAIN`] after the last rank ended instead of waiting for it.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use afdep_transport::{ENV_JOB_ID, ENV_RANK, ENV_RENDEZVOUS, ENV_WORLD_SIZE, JobId};
use anyhow::{Context, Result, bail};
use clap::Args;
use tracing::{debug, warn};

/// How often the launcher polls its children.
const POLL: Duration = Duration::from_millis(10);
/// How long the output of ended ranks is still forwarded (see the module docs).
const DRAIN: Duration = Duration::from_secs(2);

/// Arguments of `afdep launch`.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Number of processes (ranks `0..N`).
    #[arg(short = 'n', long = "nprocs")]
    pub nprocs: usize,
    /// Rank 0's rendezvous address `host:port` (default: 127.0.0.1 and a free port; give an
    /// address other hosts reach only for a multi-host group).
    #[arg(long)]
    pub rendezvous: Option<String>,
    /// The job identity the ranks carry in their handshake (default: `AFDEP_JOB_ID` if set,
    /// else a random one).
    #[arg(long)]
    pub job_id: Option<String>,
    /// Kill every process and fail after this many seconds (0: no limit).
    #[arg(long, default_value_t = 0.0)]
    pub timeout: f64,
    /// After a process fails, the others get this many seconds to end on their own before they
    /// are killed.
    #[arg(long, default_value_t = 5.0)]
    pub grace: f64,
    /// Prefix stdout lines with `[rank] ` too (stderr lines always are).
    #[arg(long)]
    pub tag_stdout: bool,
    /// The command each process runs, after `--`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub cmd: Vec<String>,
}

/// How one rank ended.
#[derive(Debug, Clone, Copy)]
enum End {
    /// It exited (status).
    Exited(ExitStatus),
    /// The launcher killed it.
    Killed,
}

fn describe(s: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    match s.code() {
        Some(c) => format!("exited with status {c}"),
        None => "ended without a status".into(),
    }
}

/// Kills `c` (SIGKILL) and reaps it.
fn kill(c: &mut Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// A free port on 127.0.0.1 (bound, read, released: another process may take it in between,
/// which the bootstrap then reports as a failed listen).
fn free_addr() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a free port for the rendezvous")?;
    Ok(l.local_addr()?)
}

/// A random job identity: 128 bits from the standard library's randomly keyed hasher, the
/// time and the process id, as 32 hex digits.
fn random_job() -> JobId {
    use std::hash::{BuildHasher, Hasher};
    let mut hex = String::with_capacity(32);
    for half in 0..2u8 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u8(half);
        h.write_u32(std::process::id());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        h.write_u128(now);
        hex.push_str(&format!("{:016x}", h.finish()));
    }
    JobId::new(hex).expect("32 hex digits are a valid job id")
}

/// The job of this launch: `--job-id`, else [`ENV_JOB_ID`], else [`random_job`].
fn job_of(arg: Option<&str>) -> Result<JobId> {
    let given = arg
        .map(|s| (s.to_string(), "--job-id"))
        .or_else(|| std::env::var(ENV_JOB_ID).ok().map(|s| (s, ENV_JOB_ID)));
    match given {
        Some((s, from)) => JobId::new(s.trim()).context(from),
        None => Ok(random_job()),
    }
}

fn forward(
    rank: usize,
    src: impl std::io::Read + Send + 'static,
    stderr: bool,
    tag: bool,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            let mut out = Vec::with_capacity(line.len() + 8);
            if tag {
                out.extend_from_slice(format!("[{rank}] ").as_bytes());
            }
            out.extend_from_slice(&line);
            // one write per line, under the stream's lock: lines never interleave
            let res = if stderr {
                std::io::stderr().lock().write_all(&out)
            } else {
                let mut o = std::io::stdout().lock();
                o.write_all(&out).and_then(|_| o.flush())
            };
            if res.is_err() {
                break;
            }
        }
    })
}

/// Runs `afdep launch`.
pub fn run(a: LaunchArgs) -> Result<()> {
    if a.nprocs == 0 {
        bail!("-n must be at least 1");
    }
    if !(a.timeout >= 0.0 && a.timeout.is_finite()) {
        bail!(
            "--timeout must be a non-negative number of seconds, got {}",
            a.timeout
        );
    }
    if !(a.grace >= 0.0 && a.grace.is_finite()) {
        bail!(
            "--grace must be a non-negative number of seconds, got {}",
            a.grace
        );
    }
    let addr = match &a.rendezvous {
        Some(s) => s.clone(),
        None => free_addr()?.to_string(),
    };
    let job = job_of(a.job_id.as_deref())?;
    debug!(%job, %addr, "launch: job");
    let (prog, args) = a.cmd.split_first().context("no command after --")?;
    let mut children: Vec<Child> = Vec::with_capacity(a.nprocs);
    let mut pumps = Vec::new();
    for rank in 0..a.nprocs {
        let spawned = Command::new(prog)
            .args(args)
            .env(ENV_RANK, rank.to_string())
            .env(ENV_WORLD_SIZE, a.nprocs.to_string())
            .env(ENV_RENDEZVOUS, &addr)
            .env(ENV_JOB_ID, job.as_str())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                for c in &mut children {
                    kill(c);
                }
                return Err(e).with_context(|| format!("starting rank {rank}: {prog:?}"));
            }
        };
        debug!(rank, pid = child.id(), %addr, "launch: started");
        pumps.push(forward(
            rank,
            child.stdout.take().expect("piped"),
            false,
            a.tag_stdout,
        ));
        pumps.push(forward(
            rank,
            child.stderr.take().expect("piped"),
            true,
            true,
        ));
        children.push(child);
    }
    let start = Instant::now();
    let limit = (a.timeout > 0.0).then(|| Duration::from_secs_f64(a.timeout));
    let grace = Duration::from_secs_f64(a.grace);
    let mut ends: Vec<Option<End>> = vec![None; a.nprocs];
    // the first failure: (rank, what happened), and when the grace ends
    let mut failed: Option<(usize, String)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut timed_out = false;
    loop {
        for (rank, c) in children.iter_mut().enumerate() {
            if ends[rank].is_some() {
                continue;
            }
            match c.try_wait() {
                Ok(Some(s)) => {
                    ends[rank] = Some(End::Exited(s));
                    if !s.success() && failed.is_none() {
                        warn!(rank, status = %describe(s), "launch: a rank failed");
                        failed = Some((rank, describe(s)));
                        kill_at = Some(Instant::now() + grace);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    // cannot observe it any more: treat as failed and stop it
                    kill(c);
                    ends[rank] = Some(End::Killed);
                    if failed.is_none() {
                        failed = Some((rank, format!("could not be waited for: {e}")));
                        kill_at = Some(Instant::now());
                    }
                }
            }
        }
        if ends.iter().all(Option::is_some) {
            break;
        }
        let now = Instant::now();
        let over = limit.is_some_and(|l| now.duration_since(start) >= l);
        if over || kill_at.is_some_and(|k| now >= k) {
            timed_out |= over && failed.is_none();
            for (rank, c) in children.iter_mut().enumerate() {
                if ends[rank].is_none() {
                    kill(c);
                    ends[rank] = Some(End::Killed);
                }
            }
            break;
        }
        std::thread::sleep(POLL);
    }
    let drained = Instant::now() + DRAIN;
    while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < drained {
        std::thread::sleep(POLL);
    }
    for p in pumps {
        if p.is_finished() {
            let _ = p.join();
        }
    }
    let killed: Vec<usize> = (0..a.nprocs)
        .filter(|&r| matches!(ends[r], Some(End::Killed)))
        .collect();
    let others: Vec<String> = (0..a.nprocs)
        .filter_map(|r| match ends[r] {
            Some(End::Exited(s)) if !s.success() => Some(format!("rank {r} {}", describe(s))),
            _ => None,
        })
        .collect();
    if timed_out {
        bail!(
            "timed out after {:.1} s; killed ranks {killed:?}",
            start.elapsed().as_secs_f64()
        );
    }
    if let Some((rank, what)) = failed {
        bail!(
            "rank {rank} {what}; failed: [{}]; killed after the {:.1} s grace: {killed:?}",
            others.join(", "),
            a.grace
        );
    }
    Ok(())
}
