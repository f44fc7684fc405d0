//! `sluice eval` and `sluice doctor` as a user runs them: the report's fields, the plot, bad input failing
//! cleanly. (Their numbers are checked against mlx-lm in runtime/tests/trained.rs, and the size model against
//! every fixture in runtime's forecast tests.)

mod common;

use common::{fixture, ok, sluice};
use serde_json::{json, Value};

fn fails(args: &[&str]) -> String {
    let out = sluice(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!err.contains("panicked"), "panic: {err}");
    err
}

#[test]
fn eval_reports_every_k_with_quality_and_speed_and_draws_the_plot() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("topk.svg");
    let model = fixture("brown-qwen3_moe-q4g64");
    let text = fixture("brown-heldout.txt");
    let (out, _) = ok(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--ctx",
        "128",
        "--windows",
        "3",
        "--top-k",
        "1,2,4,16",
        "--decode-tokens",
        "8",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["windows"], 3);
    assert_eq!(r["own_top_k"], 4);
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(
        rows.iter().map(|x| x["top_k"].as_u64().unwrap()).collect::<Vec<_>>(),
        [1, 2, 4, 16]
    );
    for row in rows {
        assert_eq!(row["tokens"], 3 * 127);
        assert!(row["perplexity"].as_f64().unwrap() > 1.0);
        assert!(row["decode_tok_s"].as_f64().unwrap() > 0.0);
        let k = row["top_k"].as_u64().unwrap();
        let own = k == 4;
        assert_eq!(row["kl"].as_f64().unwrap() == 0.0, own, "{row}");
        assert_eq!(row["top1_agreement"].as_f64().unwrap() == 1.0, own, "{row}");
    }
    // Expert bytes per token grow with k in proportion.
    let bytes = |i: usize| rows[i]["expert_bytes_per_token"].as_u64().unwrap();
    assert_eq!(bytes(3), 16 * bytes(0));
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("perplexity") && plot.contains("decode tok/s"));

    // The table form names the model's own k.
    let (table, _) = ok(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--ctx",
        "64",
        "--windows",
        "1",
        "--decode-tokens",
        "0",
    ]);
    assert!(table.contains("| 4 (own) |"), "{table}");
    let rows = table
        .lines()
        .filter(|l| l.starts_with("| ") && l.as_bytes()[2].is_ascii_digit());
    assert_eq!(rows.count(), 6, "default ladder 1,2,3,4,8,16: {table}");
}

#[test]
fn eval_rejects_bad_input_cleanly() {
    let model = fixture("brown-qwen3_moe-q4g64");
    let dense = fixture("brown-qwen3-q4g64");
    let text = fixture("brown-heldout.txt");
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    let err = fails(&["eval", "--model", m, "--text", t, "--top-k", "17"]);
    assert!(err.contains("outside 1..=16"), "{err}");
    let err = fails(&["eval", "--model", m, "--text", t, "--ctx", "4096"]);
    assert!(err.contains("longer than the model's context"), "{err}");
    let err = fails(&["eval", "--model", dense.to_str().unwrap(), "--text", t]);
    assert!(err.contains("no routed experts"), "{err}");
    let short = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(short.path(), "Too short.").unwrap();
    let err = fails(&["eval", "--model", m, "--text", short.path().to_str().unwrap()]);
    assert!(err.contains("fewer than one window"), "{err}");
    let err = fails(&["eval", "--model", m, "--text", t, "--windows", "0"]);
    assert!(err.contains("--windows must be at least 1"), "{err}");
    let err = fails(&["eval", "--model", m, "--text", "/nonexistent/text.txt"]);
    assert!(err.contains("/nonexistent/text.txt"), "{err}");
    // A window shorter than the decode measurement's prompt still measures decode (it failed the whole run).
    let (out, _) = ok(&[
        "eval",
        "--model",
        m,
        "--text",
        t,
        "--ctx",
        "8",
        "--windows",
        "1",
        "--top-k",
        "4",
        "--decode-tokens",
        "2",
        "--json",
    ]);
    let r: Value = serde_json::from_str(&out).unwrap();
    assert!(r["rows"][0]["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
}

/// Streamed, each k's speed is measured from the same empty caches: a k run after others reads what it reads
/// alone (it read less, finding the records the quality pass and the k before it left).
#[test]
fn eval_measures_each_streamed_k_from_empty_caches() {
    let model = fixture("brown-qwen3_moe-q4g64");
    let text = fixture("brown-heldout.txt");
    let read_at_4 = |ks: &str| {
        let (out, _) = ok(&[
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--text",
            text.to_str().unwrap(),
            "--ctx",
            "64",
            "--windows",
            "2",
            "--top-k",
            ks,
            "--decode-tokens",
            "16",
            "--experts",
            "stream",
            "--expert-cache",
            "64M",
            "--prefetch",
            "none",
            "--json",
        ]);
        let r: Value = serde_json::from_str(&out).unwrap();
        let rows = r["rows"].as_array().unwrap().clone();
        let row = rows.iter().find(|x| x["top_k"] == 4).unwrap().clone();
        row["read_bytes_per_token"].as_f64().unwrap()
    };
    let alone = read_at_4("4");
    assert!(alone > 0.0);
    assert_eq!(read_at_4("2,4"), alone);
}

#[test]
fn doctor_sizes_plans_and_forecasts_from_a_config() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("qwen3_moe-q4g64");
    let args = |extra: &[&str]| {
        let mut v = vec![
            "doctor".to_string(),
            "--config".into(),
            model.join("config.json").to_string_lossy().into_owned(),
            "--disk".into(),
            dir.path().to_string_lossy().into_owned(),
            "--probe-size".into(),
            "8M".into(),
            "--probe-seconds".into(),
            "0.2".into(),
            "--json".into(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let run = |extra: &[&str]| -> Value {
        let a = args(extra);
        let (out, _) = ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
        serde_json::from_str(&out).unwrap()
    };
    let r = run(&[]);
    assert_eq!(r["fits"], true);
    assert_eq!(r["placement"], "resident");
    assert_eq!(r["size"]["num_experts"], 8);
    // The index beside the config gives the exact total; the config alone gives an estimate close to it.
    assert_eq!(r["size"]["exact"], true);
    let alone = tempfile::tempdir().unwrap();
    std::fs::copy(model.join("config.json"), alone.path().join("config.json")).unwrap();
    let (out, _) = ok(&[
        "doctor",
        "--config",
        alone.path().to_str().unwrap(),
        "--disk",
        dir.path().to_str().unwrap(),
        "--probe-size",
        "8M",
        "--probe-seconds",
        "0.2",
        "--json",
    ]);
    let est: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(est["size"]["exact"], false);
    let (a, b) = (
        est["size"]["expert_bytes"].as_f64().unwrap(),
        r["size"]["expert_bytes"].as_f64().unwrap(),
    );
    assert!((a / b - 1.0).abs() < 0.03, "{a} vs {b}");
    // The huge page setting the slots and resident weights will get, as the OS reports it.
    let thp = serde_json::to_value(expert_store::platform::huge_pages()).unwrap();
    assert_eq!(r["huge_pages"], thp, "{r}");
    assert_eq!(r["kernels"], sluice_runtime::cpu::kernel_summary(), "{r}");
    if cfg!(target_os = "linux") {
        assert!(
            thp.is_string(),
            "Linux reports its transparent huge page setting: {thp}"
        );
    }
    for p in ["dram_gbps", "matvec_gbps", "call_seconds"] {
        assert!(r["probes"][p].as_f64().unwrap() > 0.0, "{p}: {r}");
    }
    // The disk at 1, 2, 4 and 8 reads in flight (the default --io-depth).
    let disk = r["probes"]["disk_gbps_by_depth"].as_array().unwrap();
    let depths: Vec<u64> = disk.iter().map(|d| d[0].as_u64().unwrap()).collect();
    assert_eq!(depths, [1, 2, 4, 8]);
    assert!(disk.iter().all(|d| d[1].as_f64().unwrap() > 0.0), "{r}");
    let warm = r["warm"].as_array().unwrap();
    assert_eq!(warm.len(), 5, "default ladder 1,2,3,6,8");
    for w in warm.windows(2) {
        assert!(w[1]["tok_s"].as_f64() < w[0]["tok_s"].as_f64());
    }
    // No probe file left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // Streamed through a cache of 4 records with direct I/O: hits below 1, a cold forecast below the warm one.
    let r = run(&[
        "--experts",
        "stream",
        "--expert-cache",
        "64K",
        "--direct-io",
        "--top-k",
        "3",
    ]);
    assert_eq!(r["placement"], "stream");
    let (w, c) = (&r["warm"][0], &r["cold"][0]);
    assert!(w["hit_rate"].as_f64().unwrap() < 1.0, "{w}");
    assert_eq!(c["hit_rate"], 0.0);
    assert!(c["tok_s"].as_f64() <= w["tok_s"].as_f64());

    // A model far bigger than memory, its experts forced resident or mapped: resident does not fit, and mapped
    // ones are cached only as far as the page cache has room.
    let big = tempfile::tempdir().unwrap();
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    for (k, n) in [
        ("num_hidden_layers", 500),
        ("num_experts", 128),
        ("hidden_size", 4096),
        ("moe_intermediate_size", 1536),
    ] {
        v[k] = n.into();
    }
    std::fs::write(big.path().join("config.json"), v.to_string()).unwrap();
    let big_args = |mode: &str| {
        let mut a = args(&["--experts", mode]);
        a[2] = big.path().to_string_lossy().into_owned();
        a
    };
    let (out, _) = ok(&big_args("resident").iter().map(String::as_str).collect::<Vec<_>>());
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&r["placement"], &r["fits"]),
        (&json!("resident"), &json!(false)),
        "{r}"
    );
    let (out, _) = ok(&big_args("mmap").iter().map(String::as_str).collect::<Vec<_>>());
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["placement"], "mmap", "{r}");
    assert!(r["warm"][0]["hit_rate"].as_f64().unwrap() < 0.5, "{r}");

    let err = fails(&["doctor", "--config", "/nonexistent/config.json"]);
    assert!(err.contains("/nonexistent/config.json"), "{err}");
    let bad = tempfile::tempdir().unwrap();
    std::fs::write(
        bad.path().join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 8}"#,
    )
    .unwrap();
    let err = fails(&["doctor", "--config", bad.path().to_str().unwrap()]);
    assert!(err.contains("llama"), "{err}");
    // Code widths the kernels do not take are refused before any probe (a 0-bit probe matrix panicked).
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe-q4g64").join("config.json")).unwrap())
            .unwrap();
    v["quantization"]["bits"] = 0.into();
    std::fs::write(bad.path().join("config.json"), v.to_string()).unwrap();
    let err = fails(&[
        "doctor",
        "--config",
        bad.path().to_str().unwrap(),
        "--probe-seconds",
        "0.2",
    ]);
    assert!(err.contains("0-bit codes in groups of 64 are not supported"), "{err}");
    // A probe time that is not a finite number of seconds is refused by the flag.
    let model = fixture("qwen3_moe-q4g64");
    for cmd in ["doctor", "bench"] {
        let flag = if cmd == "doctor" { "--config" } else { "--model" };
        let err = fails(&[cmd, flag, model.to_str().unwrap(), "--probe-seconds", "inf"]);
        assert!(err.contains("between 0 and 3600 seconds"), "{cmd}: {err}");
    }
    // A reader that leaves early (`| head`) ends the report quietly, not with a panic on the failed write.
    let out = common::with_reader_gone(&[
        "doctor",
        "--config",
        model.to_str().unwrap(),
        "--probe-seconds",
        "0.1",
        "--probe-size",
        "8M",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    // It got as far as its report (the probes ran), and the failed write did not panic.
    assert!(
        err.contains("probing") && !err.contains("panicked") && !err.contains("Error"),
        "{err}"
    );
    // A bench whose prompt and generation cannot fit the context says so before building them.
    let err = fails(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "18446744073709551615",
        "-n",
        "1",
    ]);
    assert!(err.contains("exceed the context limit"), "{err}");
    // The limit is bench's own `--ctx-size`, as the message says (the flag was only generate's, serve's and
    // doctor's, so following the hint failed to parse).
    let err = fails(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "--ctx-size",
        "10",
        "--probe-seconds",
        "0",
    ]);
    assert!(err.contains("context limit of 10 tokens (--ctx-size)"), "{err}");
}

/// `bench --text` asks for as many tokens as its runs are fed: one run's for `cold`, two for a warm run (a
/// warm-up or the cold run before it, then the measured run).
#[test]
fn bench_on_a_text_needs_the_tokens_its_runs_use() {
    let model = fixture("brown-qwen3_moe-q4g64");
    // A short text, so that two runs of it fit the fixture's context.
    let full = std::fs::read_to_string(fixture("brown-heldout.txt")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("short.txt");
    std::fs::write(&text, full.chars().take(400).collect::<String>()).unwrap();
    let (m, t) = (model.to_str().unwrap(), text.to_str().unwrap());
    let args = |p: usize, runs: &'static str| -> Vec<String> {
        let p = p.to_string();
        [
            "bench",
            "-m",
            m,
            "--text",
            t,
            "-p",
            &p,
            "-n",
            "1",
            "--runs",
            runs,
            "--probe-seconds",
            "0",
        ]
        .map(String::from)
        .to_vec()
    };
    fn borrow(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    // The text's own length, from the refusal of a bench far longer than it.
    let err = fails(&borrow(&args(200, "cold")));
    let have: usize = (err.split(" has ").nth(1))
        .and_then(|r| r.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("the text's token count in: {err}"));
    // One token less than the text is a whole cold run; a warm run of that length needs twice as many.
    let p = have - 2;
    ok(&borrow(&args(p, "cold")));
    let err = fails(&borrow(&args(p, "both")));
    assert!(err.contains(&format!("bench needs {}", 2 * (p + 1))), "{err}");
}
