//! Helpers shared by the `sluice` binary's integration tests.
#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// A committed fixture model directory.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

/// Runs the binary with `args`.
pub fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output().unwrap()
}

/// Runs `args`, asserting success; returns stdout and stderr.
pub fn ok(args: &[&str]) -> (String, String) {
    let out = sluice(args);
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{args:?} failed: {e}");
    (o, e)
}

/// Runs the binary with `args` and a stdout whose reader has already left (`sluice ... | head` once `head`
/// is done).
pub fn with_reader_gone(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

/// Runs the binary with `args`, stdout and stderr on one pipe whose reader has already left (`sluice ... 2>&1
/// | head`); returns its exit status.
pub fn with_shared_reader_gone(args: &[&str]) -> std::process::ExitStatus {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdout(writer.try_clone().unwrap())
        .stderr(writer)
        .spawn()
        .unwrap();
    child.wait().unwrap()
}
