//! `sluice selftest`: passes on this machine's backends, and fails naming the fixture when a golden is
//! tampered with.

mod common;

use std::path::Path;

use common::{fixture, ok, sluice};

/// Copies fixture `name` into `root/name`.
fn copy_fixture(name: &str, root: &Path) -> std::path::PathBuf {
    let to = root.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
    to
}

fn selftest_passes(backend: &str) {
    let bench_dir = tempfile::tempdir().unwrap();
    let (out, _) = ok(&[
        "selftest",
        "--backend",
        backend,
        "--only",
        "q4g64",
        "--bench-size",
        "1G",
        "--probe-seconds",
        "0.3",
        "--bench-dir",
        &bench_dir.path().to_string_lossy(),
    ]);
    assert!(out.contains(&format!("- backend: {backend}")), "{out}");
    for f in [
        "qwen3_moe-q4g64",
        "mixtral-q4g64",
        "qwen3_5_moe-q4g64",
        "qwen3_next-q4g64",
        "brown-qwen3_moe-q4g64",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("| {f} | pass (")) && l.contains("| pass (")),
            "{f} not reported passing: {out}"
        );
    }
    assert!(
        out.contains("| qwen3_5-q4g64 | pass (15 checks) | no experts |"),
        "{out}"
    );
    assert!(out.contains("goldens: 10 of 10 fixtures passed"), "{out}");
    for line in ["- cold: prefill", "- warm: prefill", "- disk probe:", "- DRAM probe:"] {
        assert!(out.contains(line), "no `{line}` in {out}");
    }
    assert!(out.trim_end().ends_with("selftest: PASS"), "{out}");
    // The bench model is gone afterwards.
    assert_eq!(std::fs::read_dir(bench_dir.path()).unwrap().count(), 0);
}

#[test]
fn selftest_passes_on_the_cpu_backend() {
    selftest_passes("cpu");
}

#[cfg(feature = "mlx")]
#[test]
fn selftest_passes_on_the_mlx_backend() {
    selftest_passes("mlx");
}

#[test]
fn a_tampered_golden_fails_naming_the_fixture() {
    let root = tempfile::tempdir().unwrap();
    copy_fixture("qwen3_moe-q8g32", root.path());
    let bad = copy_fixture("qwen3_moe-q4g64", root.path());
    let path = bad.join("golden.json");
    let mut g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // One greedy token moved by one.
    let t = g["greedy"][5].as_u64().unwrap();
    g["greedy"][5] = serde_json::json!(t + 1);
    std::fs::write(&path, g.to_string()).unwrap();
    let root_arg = root.path().to_string_lossy().into_owned();
    let out = sluice(&["selftest", "--fixtures", &root_arg, "--bench-size", "0"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "passed with a tampered golden: {stdout}");
    assert!(
        stdout.contains("FAIL qwen3_moe-q4g64: resident: prompt: greedy tokens differ from mlx-lm's at step 5"),
        "{stdout}"
    );
    assert!(stdout.contains("| qwen3_moe-q8g32 | pass ("), "{stdout}");
    assert!(stdout.contains("bench: skipped (--bench-size 0)"), "{stdout}");
    assert!(stderr.contains("selftest failed: qwen3_moe-q4g64"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    // A logit moved past the tolerance fails too, naming the position.
    let mut g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    g["greedy"][5] = serde_json::json!(t);
    let x = g["logits"][0][3].as_f64().unwrap();
    g["logits"][0][3] = serde_json::json!(x + 0.01);
    std::fs::write(&path, g.to_string()).unwrap();
    let out = sluice(&[
        "selftest",
        "--fixtures",
        &root_arg,
        "--only",
        "q4g64",
        "--bench-size",
        "0",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("FAIL qwen3_moe-q4g64: resident: prompt, position"),
        "{stdout}"
    );
    assert!(stdout.contains(": logit 3: "), "{stdout}");

    // No fixtures at all is an error, not a pass.
    let empty = tempfile::tempdir().unwrap();
    let out = sluice(&[
        "selftest",
        "--fixtures",
        &empty.path().to_string_lossy(),
        "--bench-size",
        "0",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no fixtures"));
}

/// The report names the `SLUICE_*` variables in effect: its bench honours them as `sluice bench` does.
#[test]
fn the_report_names_the_environment_it_ran_in() {
    let root = tempfile::tempdir().unwrap();
    copy_fixture("qwen3_moe-q8g32", root.path());
    let root_arg = root.path().to_string_lossy().into_owned();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["selftest", "--fixtures", &root_arg, "--bench-size", "0"])
        .env("SLUICE_IO_DEPTH", "3")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("- environment (the bench honours it): ") && stdout.contains("SLUICE_IO_DEPTH=3"),
        "{stdout}"
    );
}
