//! `Bootstrap::from_env`: its own test binary, with a single test, because it sets environment
//! variables of the process.

use std::time::Duration;

use afdep_transport::{Bootstrap, ENV_RANK, ENV_RENDEZVOUS, ENV_WORLD_SIZE, TransportError};

#[test]
fn from_env_reads_the_rendezvous() {
    // SAFETY: this is the only test of this binary, and no other thread runs while the
    // environment is modified.
    unsafe {
        std::env::remove_var(ENV_RANK);
        std::env::set_var(ENV_WORLD_SIZE, "1");
        std::env::set_var(ENV_RENDEZVOUS, "127.0.0.1:0");
    }
    let e = Bootstrap::from_env(Duration::from_secs(1)).unwrap_err();
    assert!(
        matches!(e, TransportError::Env { var: ENV_RANK, .. }),
        "{e}"
    );
    // SAFETY: as above.
    unsafe { std::env::set_var(ENV_RANK, "0") };
    let mut b = Bootstrap::from_env(Duration::from_secs(1)).unwrap();
    assert_eq!((b.rank(), b.world_size()), (0, 1));
    b.barrier().unwrap();
}
