//! `sluice synth`: random models of real shapes that load, generate, and come out the size asked for.

mod common;

use common::{ok, sluice};

use std::path::Path;

use serde_json::Value;

/// The number in "generated: N tokens" of a generate summary line.
fn generated(stderr: &str) -> usize {
    let rest = stderr
        .split("generated: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no summary: {stderr}"));
    rest.split(' ').next().unwrap().parse().unwrap()
}

fn dir_bytes(d: &Path) -> u64 {
    std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// Checks every shard as a safetensors reader would (contiguous data, exact length) plus our 64-byte alignment
/// and the index; returns the tensor names.
fn check_shards(dir: &Path) -> Vec<String> {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let mut names = Vec::new();
    let mut total = 0;
    let mut files: Vec<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    files.sort_unstable();
    files.dedup();
    for f in files {
        let data = std::fs::read(dir.join(f)).unwrap();
        let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, Value> = serde_json::from_slice(&data[8..8 + n]).unwrap();
        let mut ranges: Vec<(u64, u64, &str)> = header
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(k, v)| {
                (
                    v["data_offsets"][0].as_u64().unwrap(),
                    v["data_offsets"][1].as_u64().unwrap(),
                    &k[..],
                )
            })
            .collect();
        ranges.sort_unstable();
        let mut pos = 0;
        for (s, e, name) in ranges {
            assert_eq!(s, pos, "{f}: {name} is not contiguous");
            // Aligned to 64 bytes, or as far as its size allows (a tiny router's scales may be 32 bytes).
            let align = 1u64 << (e - s).trailing_zeros().min(6);
            assert_eq!((8 + n as u64 + s) % align, 0, "{f}: {name} is not {align}-byte aligned");
            assert_eq!(map[name], f, "index entry of {name}");
            pos = e;
            names.push(name.to_string());
        }
        assert_eq!(8 + n + pos as usize, data.len(), "{f}: length");
        total += pos;
    }
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(names.len(), map.len());
    names
}

#[test]
fn synthesized_models_load_and_generate() {
    let tmp = tempfile::tempdir().unwrap();
    for (shape, extra) in [
        (
            "qwen3-30b-a3b",
            &[
                "--layers",
                "2",
                "--experts",
                "4",
                "--hidden",
                "256",
                "--moe-inter",
                "128",
            ][..],
        ),
        // Other quantizations the loader reads.
        (
            "bench-7b",
            &[
                "--layers",
                "1",
                "--experts",
                "4",
                "--hidden",
                "256",
                "--moe-inter",
                "128",
                "--bits",
                "3",
                "--group-size",
                "128",
            ][..],
        ),
        // Small shards: the model is split over several files.
        (
            "mixtral-8x7b",
            &[
                "--layers",
                "2",
                "--hidden",
                "256",
                "--moe-inter",
                "256",
                "--shard-size",
                "1M",
            ][..],
        ),
        // The hybrids: Gated DeltaNet + gated attention + shared expert; Qwen3.5 is VLM-style.
        (
            "qwen3.5-122b-a10b",
            &[
                "--layers",
                "4",
                "--experts",
                "4",
                "--hidden",
                "256",
                "--moe-inter",
                "128",
            ][..],
        ),
        (
            "qwen3-next-80b-a3b",
            &[
                "--layers",
                "4",
                "--experts",
                "4",
                "--hidden",
                "256",
                "--moe-inter",
                "128",
            ][..],
        ),
    ] {
        let out = tmp.path().join(shape);
        let o = out.to_str().unwrap();
        let mut args = vec!["synth", "--shape", shape, "-o", o, "--vocab", "512"];
        args.extend_from_slice(extra);
        ok(&args);
        let names = check_shards(&out);
        let full: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        let (config, pre) = match full.get("text_config") {
            Some(t) => (t.clone(), "language_model."),
            None => (full.clone(), ""),
        };
        assert_eq!(config["vocab_size"], 512);
        let moe = if shape.starts_with("qwen3.5") || shape.starts_with("qwen3-next") {
            assert_eq!(pre.is_empty(), shape.starts_with("qwen3-next"), "{shape}: VLM nesting");
            assert_eq!(config["num_experts"], 4);
            for n in ["layers.0.linear_attn.conv1d.weight", "layers.3.self_attn.q_norm.weight"] {
                assert!(names.contains(&format!("{pre}model.{n}")), "{shape}: {n} in {names:?}");
            }
            let gate = format!("{pre}model.layers.0.mlp.shared_expert_gate");
            assert_eq!(full["quantization"][gate]["bits"], 8);
            assert!(names.contains(&format!("{pre}model.layers.1.mlp.shared_expert.down_proj.scales")));
            "mlp"
        } else if shape == "mixtral-8x7b" {
            assert_eq!(config["num_local_experts"], 8);
            "block_sparse_moe"
        } else {
            assert_eq!(config["num_experts"], 4);
            assert_eq!(config["model_type"], "qwen3_moe");
            assert!(names.contains(&"model.layers.0.self_attn.q_norm.weight".to_string()));
            "mlp"
        };
        assert!(
            names.contains(&format!("{pre}model.layers.0.{moe}.switch_mlp.down_proj.scales")),
            "{names:?}"
        );
        assert_eq!(
            full["quantization"][format!("{pre}model.layers.0.{moe}.gate")]["bits"],
            8
        );
        if shape == "mixtral-8x7b" {
            assert!(std::fs::read_dir(&out).unwrap().count() > 8, "expected several shards");
        }

        let (text, err) = ok(&[
            "generate",
            "-m",
            o,
            "--prompt",
            "hello world",
            "-n",
            "8",
            "--ignore-eos",
        ]);
        assert_eq!(generated(&err), 8, "{shape}: {err}");
        assert!(!text.trim().is_empty(), "{shape}: no text");
        let (_, err) = ok(&["generate", "-m", o, "--chat", "Name a fox.", "-n", "4", "--ignore-eos"]);
        assert_eq!(generated(&err), 4, "{shape}: {err}");
        // The logits stay finite over a prefill and a few decode steps, experts streamed through a 1 MiB cache.
        let m = sluice_runtime::load_model_with(
            &out,
            sluice_runtime::config::ModelConfig::load(&out).unwrap(),
            &sluice_runtime::ExpertOptions {
                mode: sluice_runtime::ExpertMode::Stream,
                cache_bytes: Some(1 << 20),
                ..Default::default()
            },
        )
        .unwrap();
        let mut cache = m.new_cache();
        let vocab = m.info.vocab_size as u32;
        let prompt: Vec<u32> = (0..5).map(|i| (i * 7919 + 11) % vocab).collect();
        let mut logits = m.forward(&prompt, &mut cache, &Default::default()).unwrap();
        for step in 0..3 {
            let bad = logits.iter().filter(|x| !x.is_finite()).count();
            assert_eq!(bad, 0, "{shape}: {bad} non-finite logits at step {step}");
            assert!(logits.iter().any(|&x| x != logits[0]), "{shape}: constant logits");
            let next = sluice_runtime::sampling::argmax(&logits);
            logits = m.forward(&[next], &mut cache, &Default::default()).unwrap();
        }
        drop(m);
        // And `generate` streams it like any model.
        let (_, err) = ok(&[
            "generate",
            "-m",
            o,
            "--prompt",
            "hello world",
            "-n",
            "4",
            "--ignore-eos",
            "--expert-cache",
            "1M",
        ]);
        assert_eq!(generated(&err), 4, "{shape}: {err}");
    }
}

#[test]
fn size_picks_the_layer_count_and_existing_dirs_need_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let o = out.to_str().unwrap();
    let base = [
        "synth",
        "--shape",
        "bench-7b",
        "-o",
        o,
        "--hidden",
        "256",
        "--moe-inter",
        "128",
        "--experts",
        "8",
    ];
    let with = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        ok(&args);
        dir_bytes(&out)
    };
    let one = with(&["--layers", "1"]);
    let layer = with(&["--layers", "2", "--force"]) - one;
    for layers in [1, 5, 12] {
        let target = one + (layers - 1) * layer + layer / 3;
        let got = with(&["--size", &target.to_string(), "--force"]);
        assert!(
            got.abs_diff(target) <= layer,
            "asked {target}, got {got} (one layer is {layer})"
        );
        let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["num_hidden_layers"], layers, "for {target} bytes");
        check_shards(&out);
    }
    // Suffixes are accepted; a target below one layer still gives one layer.
    with(&["--size", "1K", "--force"]);
    assert_eq!(dir_bytes(&out), one);
    // --scale multiplies the shape's 24 layers.
    with(&["--scale", "0.25", "--force"]);
    let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_hidden_layers"], 6);

    // Without --force a non-empty directory is refused, naming it, and left alone.
    let before = dir_bytes(&out);
    let refused = sluice(&base);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("not empty") && err.contains("--force") && err.contains(o));
    assert_eq!(dir_bytes(&out), before);
    // --layers and --size both set the layer count: asking for both is an error, not one silently winning.
    let both = sluice(&[
        "synth", "--shape", "bench-7b", "-o", o, "--layers", "2", "--size", "1G", "--force",
    ]);
    assert!(!both.status.success() && String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
    let bad = sluice(&["synth", "--shape", "gpt-9", "-o", o]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown shape"));
    let bad = sluice(&["synth", "--shape", "bench-7b", "-o", o, "--hidden", "100", "--force"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("multiple of the group size"));
}
