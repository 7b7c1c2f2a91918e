//! Fuzzing the bootstrap's messages with proptest, bounded so that CI runs it in seconds: the
//! decoders (handshake reader, hello, welcome, frame header, blob list, abort verdict) on
//! arbitrary and on near-valid bytes (`afdep_transport::fuzzing::bootstrap_decoders` panics only
//! when an invariant breaks: a decoder panicking, asking for more bytes than a handshake holds,
//! or not round-tripping), and rank 0 over a real socket: whatever a stray peer sends, it is
//! dropped with a typed error and the group still forms. A seed corpus (`tests/fuzz_corpus/`)
//! is replayed too; the same entry point suits a coverage-guided fuzzer (cargo-fuzz) over it.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use afdep_transport::fuzzing::bootstrap_decoders;
use afdep_transport::{Bootstrap, JobId, TransportError};
use proptest::prelude::*;

const MAGIC: &[u8; 4] = b"AFDP";

/// A frame whose header is valid but for what the strategy changes: kind, operation number,
/// announced length (sometimes a lie), payload.
fn near_frame() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![Just(1u32), Just(2), Just(3), 0u32..20, any::<u32>()],
        prop_oneof![4 => Just(0u64), 1 => any::<u64>()],
        proptest::collection::vec(any::<u8>(), 0..120),
        prop_oneof![4 => Just(None), 1 => any::<u64>().prop_map(Some)],
        any::<bool>(),
    )
        .prop_map(|(kind, seq, payload, lie, versioned)| {
            let mut body = Vec::new();
            if versioned {
                // most handshake payloads start with the version
                body.extend_from_slice(&2u32.to_le_bytes());
            }
            body.extend_from_slice(&payload);
            let mut f = MAGIC.to_vec();
            f.extend_from_slice(&kind.to_le_bytes());
            f.extend_from_slice(&seq.to_le_bytes());
            f.extend_from_slice(&lie.unwrap_or(body.len() as u64).to_le_bytes());
            f.extend_from_slice(&body);
            f
        })
}

/// A hello of version 2 whose fields the strategy picks (job length possibly a lie).
fn near_hello() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u64>(),
        any::<u64>(),
        prop_oneof![
            Just(None),
            any::<u32>().prop_map(Some),
            (0u32..80).prop_map(Some)
        ],
        proptest::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(|(rank, world, job_len, job)| {
            let mut p = 2u32.to_le_bytes().to_vec();
            p.extend_from_slice(&rank.to_le_bytes());
            p.extend_from_slice(&world.to_le_bytes());
            p.extend_from_slice(&job_len.unwrap_or(job.len() as u32).to_le_bytes());
            p.extend_from_slice(&job);
            p
        })
}

/// A list `[u64 count] ([u64 len] bytes)*` with lengths that may lie.
fn near_list() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(
        (
            proptest::collection::vec(any::<u8>(), 0..20),
            prop_oneof![6 => Just(None), 1 => any::<u64>().prop_map(Some)],
        ),
        0..5,
    )
    .prop_map(|items| {
        let mut out = (items.len() as u64).to_le_bytes().to_vec();
        for (b, lie) in items {
            out.extend_from_slice(&lie.unwrap_or(b.len() as u64).to_le_bytes());
            out.extend_from_slice(&b);
        }
        out
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn decoders_survive_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..700)) {
        bootstrap_decoders(&data);
    }

    #[test]
    fn decoders_survive_near_valid_messages(
        data in prop_oneof![near_frame(), near_hello(), near_list()],
        cut in any::<prop::sample::Index>(),
    ) {
        bootstrap_decoders(&data);
        // and every prefix a socket could have delivered so far
        let at = cut.index(data.len() + 1);
        bootstrap_decoders(&data[..at]);
    }
}

proptest! {
    // each case forms a group over a real socket: fewer cases
    #![proptest_config(ProptestConfig { cases: 40, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn rank_0_drops_whatever_a_stray_sends_and_forms_its_group(
        data in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..300),
            near_frame(),
        ],
        close in any::<bool>(),
    ) {
        let timeout = Duration::from_secs(5);
        let job = JobId::new("fuzz").unwrap();
        let listener = Bootstrap::listen("127.0.0.1:0".parse().unwrap(), 2, timeout)
            .unwrap()
            .with_job(job.clone());
        let addr = listener.local_addr();
        let (root, leaf) = std::thread::scope(|sc| {
            let root = sc.spawn(move || listener.accept());
            let mut stray = TcpStream::connect(addr).unwrap();
            let _ = stray.write_all(&data);
            if close {
                let _ = stray.shutdown(std::net::Shutdown::Write);
            }
            // give rank 0 the time to judge what was complete
            std::thread::sleep(Duration::from_millis(5));
            let leaf = Bootstrap::connect_as(addr, 1, 2, timeout, job.clone());
            let root = root.join().unwrap();
            drop(stray);
            (root, leaf)
        });
        let root = root.map_err(|e| TestCaseError::fail(format!("rank 0: {e}")))?;
        leaf.map_err(|e| TestCaseError::fail(format!("rank 1: {e}")))?;
        prop_assert!(root.rejected().len() <= 1);
        for e in root.rejected() {
            prop_assert!(matches!(e, TransportError::Handshake { rank: 0, .. }), "{}", e);
        }
    }
}

/// The committed corpus (`tests/fuzz_corpus/`: well-formed handshake frames and payloads,
/// and the malformed cases the stray-peer tests use), replayed through the decoders whole and
/// in every prefix.
#[test]
fn the_corpus_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        for cut in 0..=data.len() {
            bootstrap_decoders(&data[..cut]);
        }
        n += 1;
    }
    assert!(n >= 10, "only {n} corpus files in {}", dir.display());
}
