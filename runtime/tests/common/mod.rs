//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};

/// Every committed fixture directory (those with a `golden.json`), sorted.
#[allow(dead_code)] // not every test binary uses it
pub fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("fixtures/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("golden.json").exists())
        .collect();
    v.sort();
    assert!(v.len() >= 25, "expected the committed fixtures, found {}", v.len());
    v
}

/// One fixture directory by name.
#[allow(dead_code)] // not every test binary uses it
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

/// Checks `got` against `want` logit by logit within the golden tolerance (1e-3 + 1e-3·|want|; f32 on both
/// sides, the gap is summation order and transcendental functions); names both sides in the failure. Returns
/// the largest difference.
#[allow(dead_code)] // not every test binary uses it
pub fn assert_close(what: &str, got: &[f32], want: &[f32], names: (&str, &str)) -> f32 {
    sluice_runtime::golden::compare_logits(got, want)
        .unwrap_or_else(|e| panic!("{what} ({} vs {}): {e}", names.0, names.1))
}
