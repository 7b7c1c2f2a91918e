//! Helpers shared by the CLI tests: run the `afdep` binary of this build, read its output as
//! text and its JSON rows.

#![allow(dead_code)]

use std::process::{Command, Output};

/// Runs this build's `afdep` with `args` and waits for it.
pub fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_afdep"))
        .args(args)
        .output()
        .expect("running afdep")
}

/// Output bytes as text (lossy).
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The JSON rows (lines starting with `{`) of `stdout`.
pub fn rows_of(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Runs `afdep` with `args`, asserts that it fails, and returns its stderr.
pub fn fails(args: &[&str]) -> String {
    let out = run(args);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "afdep {args:?} succeeded:\n{stderr}");
    stderr
}
