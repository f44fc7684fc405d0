//! `sluice convert`, `inspect`, `bench` and the engine flags of `generate`, through the binary.

mod common;

use common::{fixture, ok, sluice};

use std::path::Path;

fn fails(args: &[&str]) -> String {
    let out = sluice(args);
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} should fail: {e}");
    assert!(!e.contains("panicked"), "panic: {e}");
    e
}

fn generate(model: &Path, extra: &[&str]) -> (String, String) {
    let mut args = vec![
        "generate",
        "-m",
        model.to_str().unwrap(),
        "--prompt",
        "The quick brown fox",
        "-n",
        "10",
    ];
    args.extend_from_slice(extra);
    ok(&args)
}

#[test]
fn convert_inspect_and_generate_from_a_store_match_the_directory() {
    let dir = fixture("mixtral-q4g64");
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let s = store.to_str().unwrap();
    let (_, err) = ok(&["convert", "-m", dir.to_str().unwrap(), "-o", s, "--layout", "mlx"]);
    assert!(err.contains("verified every checksum"), "{err}");
    let (out, _) = ok(&["inspect", s]);
    assert!(out.contains("records:") && out.contains("format version 1"), "{out}");
    assert!(out.contains("as the checkpoint holds them"), "{out}");
    let (out, _) = ok(&["inspect", "--verify", s]);
    assert!(out.contains("checksums match"), "{out}");

    let (want, _) = generate(&dir, &["--experts", "mmap"]);
    for flags in [
        vec![],
        vec!["--expert-cache", "16K", "--io-depth", "1"],
        vec!["--expert-cache", "64KiB", "--prefetch", "next-layer"],
        vec!["--expert-cache", "1M", "--prefetch", "prev-token", "--direct-io"],
        vec!["--experts", "resident", "--no-verify"],
    ] {
        let (got, err) = generate(&store, &flags);
        assert_eq!(got, want, "store with {flags:?}");
        if flags.contains(&"--expert-cache") {
            assert!(
                err.contains("experts:") && err.contains("misses"),
                "I/O summary line: {err}"
            );
        }
        let (got, _) = generate(&dir, &flags);
        assert_eq!(got, want, "in place with {flags:?}");
    }
    // The default layout: tiles where the int8 kernels read them (the default kernels), which give the
    // directory's tokens; elsewhere MLX's layout.
    let tiled = tmp.path().join("tiled");
    let t = tiled.to_str().unwrap();
    ok(&["convert", "-m", dir.to_str().unwrap(), "-o", t]);
    let (out, _) = ok(&["inspect", "--verify", t]);
    assert!(out.contains("checksums match"), "{out}");
    if out.contains("stored as tiled-p") {
        assert!(out.contains("format version 2"), "{out}");
        let e = fails(&[
            "generate",
            "-m",
            t,
            "--prompt",
            "The fox",
            "-n",
            "2",
            "--kernels",
            "exact",
        ]);
        assert!(e.contains("--layout mlx"), "{e}");
    } else {
        assert!(out.contains("format version 1"), "{out}");
    }
    for flags in [vec![], vec!["--expert-cache", "64KiB", "--direct-io"]] {
        let (got, _) = generate(&tiled, &flags);
        assert_eq!(got, want, "default-layout store with {flags:?}");
    }
    // Overwriting needs --force; a flipped byte is found by inspect --verify.
    assert!(fails(&["convert", "-m", dir.to_str().unwrap(), "-o", s]).contains("--force"));
    ok(&[
        "convert",
        "-m",
        dir.to_str().unwrap(),
        "-o",
        s,
        "--force",
        "--layout",
        "mlx",
    ]);
    let data = store.join("experts.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[20000] ^= 1;
    std::fs::write(&data, bytes).unwrap();
    let err = fails(&["inspect", "--verify", s]);
    assert!(err.contains("corrupt record: layer") && err.contains("1 of"), "{err}");
}

#[test]
fn bench_reports_runs_and_probes_as_json() {
    let dir = fixture("qwen3_moe-q4g64");
    let d = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace.txt");
    let (out, _) = ok(&[
        "bench",
        "-m",
        d,
        "-p",
        "8",
        "-n",
        "4",
        "--expert-cache",
        "128K",
        "--probe-seconds",
        "0.2",
        "-b",
        "3",
        "--json",
        "--trace-out",
        trace.to_str().unwrap(),
    ]);
    // The trace: each run's phases marked in order, then `layer expert` requests of the fixture's shape.
    let text = std::fs::read_to_string(&trace).unwrap();
    let marks: Vec<&str> = text.lines().filter(|l| l.starts_with('#')).collect();
    assert_eq!(
        marks,
        ["# cold prefill", "# cold decode", "# warm prefill", "# warm decode"]
    );
    let requests: Vec<(usize, usize)> = (text.lines().filter(|l| !l.starts_with('#')))
        .map(|l| {
            let (a, b) = l.split_once(' ').unwrap();
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect();
    assert!(requests.len() >= 2 * 4 * 2, "{}", requests.len());
    assert!(requests.iter().all(|&(_, e)| e < 8), "experts of an 8-expert model");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["mode"], "stream");
    assert!(v["slots_backed_seconds"].as_f64().unwrap() >= 0.0, "{v}");
    assert_eq!(v["prefill_chunk"], 3);
    assert_eq!(v["runs"].as_array().unwrap().len(), 2);
    // Streamed: each phase of each run is judged against the optimal cache and the in-RAM compute.
    let ram = &v["in_ram"];
    assert!(ram["prefill_tok_s"].as_f64().unwrap() > 0.0 && ram["decode_tok_s"].as_f64().unwrap() > 0.0);
    // As many twins per layer as the cache holds (up to every expert), so a chunk reads as many records as
    // the runs did.
    let (slots, layers) = (
        v["cache_slots"].as_u64().unwrap(),
        requests.iter().map(|r| r.0).max().unwrap() + 1,
    );
    let twins = ram["twins_per_layer"].as_u64().unwrap();
    assert_eq!(twins, (slots / layers as u64).min(8), "{slots} slots, {layers} layers");
    for r in v["runs"].as_array().unwrap() {
        assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0);
        assert!(r["read_bytes_per_token"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["prefill_read_bytes_per_token"].as_f64().unwrap() > 0.0, "{r}");
        // Decode read records, so the I/O threads used some CPU, at most all of it per record's read.
        let (cores, per_record) = (
            r["read_cpu_cores"].as_f64().unwrap(),
            r["read_cpu_ms_per_record"].as_f64().unwrap(),
        );
        assert!(cores > 0.0 && per_record > 0.0, "{r}");
        // The runs start once the slots are backed, so the background pass takes nothing from them.
        assert_eq!(r["prefault_cpu_cores"].as_f64(), Some(0.0), "{r}");
        for phase in ["prefill_bound", "decode_bound"] {
            let b = &r[phase];
            assert!(b["tok_s"].as_f64().unwrap() > 0.0, "{phase}: {b}");
            assert!(b["optimal_misses_per_token"].as_f64().unwrap() >= 0.0, "{phase}: {b}");
            // An LRU cache never misses less than the optimal one, so its bound is never higher.
            assert!(
                b["lru_misses_per_token"].as_f64().unwrap() >= b["optimal_misses_per_token"].as_f64().unwrap(),
                "{phase}: {b}"
            );
            assert!(
                b["lru_tok_s"].as_f64().unwrap() <= b["tok_s"].as_f64().unwrap(),
                "{phase}: {b}"
            );
            assert!(
                ["disk", "compute"].contains(&b["limit"].as_str().unwrap()),
                "{phase}: {b}"
            );
            // A buffered run's page cache holds records beyond the slots the optimal cache is given: said so.
            assert_eq!(
                b["page_cache_beyond_slots"].as_bool(),
                Some(!v["direct_io"].as_bool().unwrap()),
                "{phase}: {b}"
            );
        }
    }
    assert!(v["disk_probe_gb_s"].as_f64().unwrap() > 0.0);
    // Where the probe bypasses the page cache, each run has its own probes right before and after it: the
    // cold run's after is the warm run's before, and the warm run's after is the report's final probe.
    let probes: Vec<Option<[f64; 2]>> = (v["runs"].as_array().unwrap().iter())
        .map(|r| serde_json::from_value(r["disk_probes_gb_s"].clone()).unwrap())
        .collect();
    if let [Some([a, b]), Some([c, d])] = probes[..] {
        assert!(a > 0.0 && b > 0.0, "{probes:?}");
        assert_eq!((b, d), (c, v["disk_probe_gb_s"].as_f64().unwrap()), "{probes:?}");
    } else {
        assert_eq!(probes, [None, None], "both runs or neither");
    }
    assert!(v["dram_probe_gb_s"].as_f64().unwrap() > 0.0);
    // The probe is the faster of its two access patterns.
    let (one, four) = (
        v["dram_one_stream_gb_s"].as_f64().unwrap(),
        v["dram_four_streams_gb_s"].as_f64().unwrap(),
    );
    assert_eq!(v["dram_probe_gb_s"].as_f64().unwrap(), one.max(four));
    // A decode step reads the routed experts and, beside them, every resident matrix.
    assert!(
        v["weight_bytes_per_token"].as_u64().unwrap() > v["expert_bytes_per_token"].as_u64().unwrap(),
        "{v}"
    );
    assert!(v["fresh_memory_gb_s"].as_f64().unwrap() > 0.0);
    // Two of the eight reads in flight may be guesses by default.
    assert_eq!(
        (v["io_depth"].as_u64(), v["guess_depth"].as_u64()),
        (Some(8), Some(2)),
        "{v}"
    );
    // Short warm runs of `model` with `extra` flags (no probes unless they say).
    let warm_of = |model: &str, extra: &[&str]| -> Vec<String> {
        let base = "bench -m {} -p 2 -n 2 --runs warm".split(' ');
        let probes = if extra.contains(&"--probe-seconds") {
            &[][..]
        } else {
            &["--probe-seconds", "0"][..]
        };
        (base.map(|a| if a == "{}" { model } else { a }))
            .chain(probes.iter().copied())
            .chain(extra.iter().copied())
            .map(String::from)
            .collect()
    };
    let warm = |extra: &[&str]| warm_of(d, extra);
    let run_of =
        |model: &str, extra: &[&str]| ok(&warm_of(model, extra).iter().map(String::as_str).collect::<Vec<_>>()).0;
    let run = |extra: &[&str]| run_of(d, extra);
    let out = run(&[]);
    assert!(out.contains("decode/s") && out.contains("warm"), "{out}");
    // The label says where the experts were: auto on a tiny model keeps them resident; mmap is mmap.
    assert!(out.contains("mode resident |"), "{out}");
    // Mapped experts bypass the cache, so there is no trace to write: a clear error.
    let traced = warm(&["--experts", "mmap", "--trace-out", trace.to_str().unwrap()]);
    let err = fails(&traced.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains("--trace-out needs experts served by the expert cache"),
        "{err}"
    );
    let out = run(&["--experts", "mmap", "--json"]);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["mode"], "mmap");
    // Resident experts were all read at load: the bounds count no miss, though the warm-up did not ask for
    // every record. A warm run's warm-up is marked in the trace too.
    let out = run(&[
        "--probe-seconds",
        "0.1",
        "--json",
        "--trace-out",
        trace.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["mode"], "resident");
    let b = &v["runs"][0]["decode_bound"];
    assert_eq!(b["optimal_misses_per_token"].as_f64(), Some(0.0), "{v}");
    assert_eq!(b["lru_misses_per_token"].as_f64(), Some(0.0), "{v}");
    assert_eq!(b["page_cache_beyond_slots"].as_bool(), Some(false), "{v}");
    let text = std::fs::read_to_string(&trace).unwrap();
    let marks: Vec<&str> = text.lines().filter(|l| l.starts_with('#')).collect();
    assert_eq!(
        marks,
        ["# warmup prefill", "# warmup decode", "# warm prefill", "# warm decode"]
    );
    // Mixed precision (layer 1's down_proj 6-bit, the rest 3-bit): a token's experts read each layer's own
    // record size, less than the largest record's in every layer.
    let mixed = fixture("qwen3_moe-mixed36");
    let out = run_of(mixed.to_str().unwrap(), &["--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (record, top_k, layers) = (
        v["record_bytes"].as_u64().unwrap(),
        v["top_k"].as_u64().unwrap(),
        v["layers"].as_u64().unwrap(),
    );
    let per_token = v["expert_bytes_per_token"].as_u64().unwrap();
    assert!(per_token < record * top_k * layers && per_token > record * top_k, "{v}");
}

#[test]
fn bad_engine_flags_and_stores_are_clear_errors() {
    let dir = fixture("qwen3_moe-q4g64");
    let d = dir.to_str().unwrap();
    let bad = |extra: &[&str], want: &str| {
        let mut args = vec!["generate", "-m", d, "--prompt", "hi", "-n", "2"];
        args.extend_from_slice(extra);
        let e = fails(&args);
        assert!(e.contains(want), "{extra:?}: {e}");
    };
    bad(&["--expert-cache", "12Q"], "unknown size unit");
    bad(&["--expert-cache", "1K"], "smaller than one record slot");
    bad(&["--io-depth", "0"], "--io-depth");
    bad(&["--prefetch", "always"], "unknown prefetch mode");
    bad(&["--experts", "cloud"], "unknown expert mode");
    bad(&["--kernels", "fast"], "invalid value");
    let tmp = tempfile::tempdir().unwrap();
    let e = fails(&["inspect", tmp.path().to_str().unwrap()]);
    assert!(e.contains("sluice-store.json"), "{e}");
    let e = fails(&[
        "convert",
        "-m",
        tmp.path().to_str().unwrap(),
        "-o",
        tmp.path().join("x").to_str().unwrap(),
    ]);
    assert!(e.contains("config.json"), "{e}");
}

/// A store remembers a sample of the checkpoint it came from: once the model directory's experts change (a
/// new revision with the same shapes), the store is refused instead of mixing stale experts with new weights.
#[test]
fn a_store_refuses_a_model_directory_changed_since_convert() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in std::fs::read_dir(fixture("qwen3_moe-q4g64")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
    }
    let store = tmp.path().join("store");
    ok(&["convert", "-m", model.to_str().unwrap(), "-o", store.to_str().unwrap()]);
    let (before, _) = generate(&store, &[]);
    assert_eq!(before, generate(&model, &[]).0);

    // The same file with one byte of layer 1's first expert changed, as a new revision of the weights would.
    let path = model.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let name = "model.layers.1.mlp.switch_mlp.down_proj.weight";
    let start = header[name]["data_offsets"][0]
        .as_u64()
        .unwrap_or_else(|| panic!("{name} in {header}")) as usize;
    bytes[8 + header_len + start + 100] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();
    let e = fails(&["generate", "-m", store.to_str().unwrap(), "--prompt", "hi", "-n", "2"]);
    assert!(
        e.contains("layer 1's experts") && e.contains("changed since `sluice convert`"),
        "{e}"
    );
}
