//! The handshake messages of the bootstrap (operation 0): the job identity, `hello`, `welcome`,
//! and [`scan`], the incremental reader that decides, from the bytes received so far, whether a
//! handshake frame is complete, needs more bytes (how many, never more than
//! [`MAX_HANDSHAKE`]) or is to be refused ([`HandshakeFault`]).
//!
//! Everything here is a pure function of bytes: the socket code in the parent module reads
//! at most what [`scan`] asks for, so a peer can make this rank hold at most
//! `HEADER + MAX_HANDSHAKE` bytes per connection, and [`fuzz_decoders`] exercises every decoder
//! on arbitrary input.

use std::fmt;

use thiserror::Error;

use super::{HEADER, MAGIC, VERSION, kind};
use crate::error::HandshakeFault;

/// Largest payload of a handshake frame (hello, welcome, abort during the handshake).
pub(super) const MAX_HANDSHAKE: u64 = 4096;

/// The identity of a job: every rank of a group must carry the same one, and rank 0 drops a
/// connection that carries another (see [`ENV_JOB_ID`](super::ENV_JOB_ID)). 1 to
/// [`MAX_LEN`](JobId::MAX_LEN) printable ASCII characters without spaces.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JobId(String);

/// A job identity that is empty, too long, or holds a character outside printable ASCII.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid job id {got:?}: {why}")]
pub struct InvalidJobId {
    /// The text given.
    pub got: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl JobId {
    /// The longest job identity, in bytes.
    pub const MAX_LEN: usize = 64;

    /// The job of ranks started without [`ENV_JOB_ID`](super::ENV_JOB_ID): they only meet
    /// ranks started the same way.
    pub const UNNAMED: &'static str = "unnamed";

    /// Checks `id`.
    pub fn new(id: impl Into<String>) -> Result<JobId, InvalidJobId> {
        let id = id.into();
        let why = if id.is_empty() {
            Some("empty")
        } else if id.len() > JobId::MAX_LEN {
            Some("longer than 64 bytes")
        } else if !id.bytes().all(|b| b.is_ascii_graphic()) {
            Some("only printable ASCII characters without spaces are allowed")
        } else {
            None
        };
        match why {
            Some(why) => Err(InvalidJobId { got: id, why }),
            None => Ok(JobId(id)),
        }
    }

    /// [`UNNAMED`](JobId::UNNAMED).
    pub fn unnamed() -> JobId {
        JobId(JobId::UNNAMED.to_string())
    }

    /// The identity as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the bytes received so far hold.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Scan<'a> {
    /// The frame is incomplete: read at most this many more bytes (always at least 1).
    More(usize),
    /// A complete frame of one of the expected kinds (operation 0); `used` bytes of the buffer.
    Frame {
        kind: u32,
        payload: &'a [u8],
        used: usize,
    },
    /// Refuse the connection.
    Bad(HandshakeFault),
}

/// Scans `buf`, the bytes received so far on a connection, for a handshake frame of one of
/// `kinds` (described as `expected` in errors) with operation number 0.
pub(super) fn scan<'a>(buf: &'a [u8], expected: &'static str, kinds: &[u32]) -> Scan<'a> {
    if buf.len() >= 4 {
        let magic = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
        if magic != MAGIC {
            return Scan::Bad(HandshakeFault::Magic {
                expected: MAGIC,
                got: magic,
            });
        }
    }
    if buf.len() < HEADER {
        return Scan::More(HEADER - buf.len());
    }
    let k = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&buf[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let (seq, len) = (word(8), word(16));
    if !kinds.contains(&k) || seq != 0 {
        return Scan::Bad(HandshakeFault::Kind {
            expected,
            got: format!("{} #{seq}", kind::name(k)),
        });
    }
    if len > MAX_HANDSHAKE {
        return Scan::Bad(HandshakeFault::Oversized {
            limit: MAX_HANDSHAKE,
            got: len,
        });
    }
    // len <= MAX_HANDSHAKE: no overflow
    let total = HEADER + len as usize;
    if buf.len() < total {
        return Scan::More(total - buf.len());
    }
    Scan::Frame {
        kind: k,
        payload: &buf[HEADER..total],
        used: total,
    }
}

/// Reads the fields of a handshake payload in order, each failure a `Malformed` fault.
struct Fields<'a> {
    what: &'static str,
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    fn bytes(&mut self, n: usize, field: &str) -> Result<&'a [u8], HandshakeFault> {
        if self.rest.len() < n {
            return Err(HandshakeFault::Malformed {
                what: self.what,
                why: format!(
                    "{field}: {n} bytes expected, {} left of the payload",
                    self.rest.len()
                ),
            });
        }
        let (a, b) = self.rest.split_at(n);
        self.rest = b;
        Ok(a)
    }

    fn u32(&mut self, field: &str) -> Result<u32, HandshakeFault> {
        let b = self.bytes(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &str) -> Result<u64, HandshakeFault> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.bytes(8, field)?);
        Ok(u64::from_le_bytes(w))
    }

    fn job(&mut self) -> Result<String, HandshakeFault> {
        let n = self.u32("job length")? as usize;
        if n > JobId::MAX_LEN {
            return Err(HandshakeFault::Malformed {
                what: self.what,
                why: format!("job id of {n} bytes, at most {} expected", JobId::MAX_LEN),
            });
        }
        let b = self.bytes(n, "job id")?;
        // shown in errors whatever it holds; compared byte for byte with this rank's
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    fn end(self) -> Result<(), HandshakeFault> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(HandshakeFault::Malformed {
                what: self.what,
                why: format!("{} trailing bytes", self.rest.len()),
            })
        }
    }
}

/// The version every handshake payload starts with; another one is a `Version` fault, whatever
/// follows (a later version may lay out the rest differently).
fn version(f: &mut Fields<'_>) -> Result<(), HandshakeFault> {
    let v = f.u32("version")?;
    if v != VERSION {
        return Err(HandshakeFault::Version {
            expected: VERSION,
            got: v,
        });
    }
    Ok(())
}

fn put_job(out: &mut Vec<u8>, job: &JobId) {
    out.extend_from_slice(&(job.as_str().len() as u32).to_le_bytes());
    out.extend_from_slice(job.as_str().as_bytes());
}

/// A non-root rank's first message: `version u32 | rank u64 | world u64 | job_len u32 | job`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hello {
    pub rank: u64,
    pub world: u64,
    pub job: String,
}

impl Hello {
    pub fn encode(rank: usize, world: usize, job: &JobId) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + job.as_str().len());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(rank as u64).to_le_bytes());
        out.extend_from_slice(&(world as u64).to_le_bytes());
        put_job(&mut out, job);
        out
    }

    pub fn decode(p: &[u8]) -> Result<Hello, HandshakeFault> {
        let mut f = Fields {
            what: "hello",
            rest: p,
        };
        version(&mut f)?;
        let rank = f.u64("rank")?;
        let world = f.u64("world size")?;
        let job = f.job()?;
        f.end()?;
        Ok(Hello { rank, world, job })
    }
}

/// Rank 0's answer once the group is formed: `version u32 | world u64 | job_len u32 | job`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Welcome {
    pub world: u64,
    pub job: String,
}

impl Welcome {
    pub fn encode(world: usize, job: &JobId) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + job.as_str().len());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(world as u64).to_le_bytes());
        put_job(&mut out, job);
        out
    }

    pub fn decode(p: &[u8]) -> Result<Welcome, HandshakeFault> {
        let mut f = Fields {
            what: "welcome",
            rest: p,
        };
        version(&mut f)?;
        let world = f.u64("world size")?;
        let job = f.job()?;
        f.end()?;
        Ok(Welcome { world, job })
    }
}

/// Runs every decoder of the bootstrap's messages on `data` and checks their invariants; panics
/// only when one is violated (a fuzzing finding). Used by the proptest fuzz tests
/// (`tests/fuzz_bootstrap.rs`).
#[doc(hidden)]
pub fn fuzz_decoders(data: &[u8]) {
    // the handshake reader, fed the bytes in two pieces as a socket might deliver them
    let kinds = [kind::HELLO, kind::WELCOME, kind::ABORT];
    for cut in [0, data.len() / 2, data.len()] {
        let buf = &data[..cut];
        match scan(buf, "a handshake", &kinds) {
            Scan::More(n) => {
                assert!(n >= 1, "More(0) on {} bytes", buf.len());
                assert!(
                    buf.len() + n <= HEADER + MAX_HANDSHAKE as usize,
                    "asks for {n} more bytes after {}",
                    buf.len()
                );
            }
            Scan::Frame { payload, used, .. } => {
                assert!(used <= buf.len() && payload.len() as u64 <= MAX_HANDSHAKE);
            }
            Scan::Bad(_) => {}
        }
    }
    if let Ok(h) = Hello::decode(data) {
        if let (Ok(job), Ok(rank), Ok(world)) = (
            JobId::new(h.job.clone()),
            usize::try_from(h.rank),
            usize::try_from(h.world),
        ) {
            assert_eq!(
                Hello::encode(rank, world, &job),
                data,
                "hello does not round-trip"
            );
        }
    }
    if let Ok(w) = Welcome::decode(data) {
        if let (Ok(job), Ok(world)) = (JobId::new(w.job.clone()), usize::try_from(w.world)) {
            assert_eq!(
                Welcome::encode(world, &job),
                data,
                "welcome does not round-trip"
            );
        }
    }
    super::fuzz_frames(data);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(k: u32, seq: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&k.to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn scan_reads_a_hello_in_pieces_and_refuses_the_rest() {
        let job = JobId::new("job-7").unwrap();
        let f = frame(kind::HELLO, 0, &Hello::encode(2, 4, &job));
        for cut in 0..f.len() {
            assert_eq!(
                scan(&f[..cut], "hello", &[kind::HELLO]),
                Scan::More(if cut < HEADER {
                    HEADER - cut
                } else {
                    f.len() - cut
                }),
                "cut {cut}"
            );
        }
        let Scan::Frame { payload, used, .. } = scan(&f, "hello", &[kind::HELLO]) else {
            panic!("complete hello not read");
        };
        assert_eq!(used, f.len());
        assert_eq!(
            Hello::decode(payload).unwrap(),
            Hello {
                rank: 2,
                world: 4,
                job: "job-7".into()
            }
        );
        assert!(matches!(
            scan(b"GET / HTTP/1.1\r\n", "hello", &[kind::HELLO]),
            Scan::Bad(HandshakeFault::Magic { .. })
        ));
        assert!(matches!(
            scan(&frame(kind::BARRIER, 0, &[]), "hello", &[kind::HELLO]),
            Scan::Bad(HandshakeFault::Kind { .. })
        ));
        assert!(matches!(
            scan(&frame(kind::HELLO, 3, &[]), "hello", &[kind::HELLO]),
            Scan::Bad(HandshakeFault::Kind { .. })
        ));
        let mut big = frame(kind::HELLO, 0, &[]);
        big[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            scan(&big, "hello", &[kind::HELLO]),
            Scan::Bad(HandshakeFault::Oversized {
                limit: MAX_HANDSHAKE,
                got: u64::MAX
            })
        );
    }

    #[test]
    fn hello_faults_name_what_was_expected() {
        let job = JobId::new("a").unwrap();
        let mut h = Hello::encode(1, 2, &job);
        h[0] = 9;
        assert_eq!(
            Hello::decode(&h),
            Err(HandshakeFault::Version {
                expected: VERSION,
                got: 9
            })
        );
        let h = Hello::encode(1, 2, &job);
        assert!(matches!(
            Hello::decode(&h[..h.len() - 1]),
            Err(HandshakeFault::Malformed { what: "hello", .. })
        ));
        let mut long = h.clone();
        long.push(0);
        assert!(Hello::decode(&long).is_err());
        let mut huge_job = h[..20].to_vec();
        huge_job.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Hello::decode(&huge_job),
            Err(HandshakeFault::Malformed { .. })
        ));
    }

    #[test]
    fn job_ids_are_checked() {
        assert!(JobId::new("").is_err());
        assert!(JobId::new("a b").is_err());
        assert!(JobId::new("x".repeat(65)).is_err());
        assert!(JobId::new("é").is_err());
        assert_eq!(JobId::new("x".repeat(64)).unwrap().as_str().len(), 64);
        assert_eq!(JobId::unnamed().as_str(), JobId::UNNAMED);
    }
}
