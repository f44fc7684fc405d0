//! The `sluice` binary: the demo command, and bad input failing cleanly (message, non-zero exit, no panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sluice_runtime::{GenerateParams, Pipeline, Prompt};

mod common;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice")).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A copy of a fixture to damage.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    d
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

/// Runs generate on `dir` and returns stderr, asserting a clean failure.
fn fails(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec!["generate", "--model", dir.to_str().unwrap(), "--prompt", "hello"];
    args.extend_from_slice(extra);
    let out = sluice(&args);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(out.stdout.is_empty(), "no text on failure: {}", text(&out.stdout));
    err
}

#[test]
fn generate_prints_the_same_text_as_the_library_and_one_summary_line() {
    let dir = fixture("qwen3_moe-q4g64");
    let out = sluice(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "The quick brown fox",
        "-n",
        "12",
        // The library's kernels (the command line defaults to q8).
        "--kernels",
        "exact",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let p = Pipeline::load(&dir).unwrap();
    let mut want = String::new();
    p.generate(
        &Prompt::Raw("The quick brown fox".into()),
        &GenerateParams {
            max_tokens: 12,
            ..Default::default()
        },
        |t| {
            want.push_str(t);
            true
        },
    )
    .unwrap();
    assert_eq!(text(&out.stdout), want + "\n");
    // The text on stdout; on stderr its one-line summary, and nothing else but the host's warnings (a
    // machine with transparent huge pages off gets one).
    let err = text(&out.stderr);
    let (summary, rest): (Vec<&str>, Vec<&str>) = err.lines().partition(|l| l.contains("prompt: "));
    assert_eq!(summary.len(), 1, "{err}");
    let s = summary[0];
    assert!(
        s.contains("tok/s") && s.contains("generated: ") && s.contains("peak RSS"),
        "{err}"
    );
    assert!(rest.iter().all(|l| l.contains(" WARN ")), "{err}");
}

#[test]
fn chat_sampling_and_top_k_flags_run() {
    let dir = fixture("mixtral-q4g64");
    let d = dir.to_str().unwrap();
    let args = [
        "generate",
        "--model",
        d,
        "--chat",
        "Hi there",
        "--system",
        "Be brief",
        "-n",
        "8",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--sample-top-k",
        "20",
        "--min-p",
        "0.05",
        "--repetition-penalty",
        "1.1",
        "--seed",
        "42",
        "--top-k",
        "1",
        "--threads",
        "1",
    ];
    let a = sluice(&args);
    assert!(a.status.success(), "{}", text(&a.stderr));
    let b = sluice(&args);
    assert_eq!(a.stdout, b.stdout, "a seed makes sampling reproducible");
}

#[test]
fn missing_model_dir_is_named() {
    let err = fails(Path::new("/nonexistent/model"), &[]);
    assert!(err.contains("/nonexistent/model"), "{err}");
}

#[test]
fn garbled_config_is_named() {
    let d = copy_fixture("qwen3_moe-q4g64");
    std::fs::write(d.path().join("config.json"), "{ this is not json").unwrap();
    let err = fails(d.path(), &[]);
    assert!(err.contains("config.json") && err.contains("not valid JSON"), "{err}");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(fails(d.path(), &[]).contains("config.json"));
}

#[test]
fn missing_config_field_is_named() {
    let d = copy_fixture("qwen3_moe-q4g64");
    edit_config(d.path(), |v| {
        v.as_object_mut().unwrap().remove("num_experts");
    });
    let err = fails(d.path(), &[]);
    assert!(err.contains("config.json") && err.contains("num_experts"), "{err}");
}

#[test]
fn unknown_model_type_is_named() {
    let d = copy_fixture("qwen3_moe-q4g64");
    edit_config(d.path(), |v| v["model_type"] = "llama4_moe".into());
    let err = fails(d.path(), &[]);
    assert!(
        err.contains("unsupported model_type `llama4_moe`") && err.contains("qwen3_moe"),
        "{err}"
    );
}

#[test]
fn unknown_quantization_mode_is_named() {
    let d = copy_fixture("qwen3_moe-q4g64");
    edit_config(d.path(), |v| v["quantization"]["mode"] = "q4_k".into());
    let err = fails(d.path(), &[]);
    assert!(err.contains("unknown quantization mode `q4_k`"), "{err}");
    edit_config(d.path(), |v| v["quantization"]["mode"] = "mxfp4".into());
    let err = fails(d.path(), &[]);
    assert!(err.contains("Mxfp4") && err.contains("not implemented"), "{err}");
}

#[test]
fn tensor_shape_contradicting_the_config_is_named() {
    let d = copy_fixture("qwen3_moe-q4g64");
    edit_config(d.path(), |v| v["moe_intermediate_size"] = 128.into());
    let err = fails(d.path(), &[]);
    assert!(
        err.contains("switch_mlp.gate_proj.weight") && err.contains("expected shape"),
        "{err}"
    );
    let d = copy_fixture("qwen3_moe-q4g64");
    edit_config(d.path(), |v| v["quantization"]["bits"] = 8.into());
    let err = fails(d.path(), &[]);
    assert!(err.contains("tensor `model.") && err.contains("8-bit"), "{err}");
}

#[test]
fn tensor_dtype_contradicting_the_config_is_named() {
    // Relabel the first U32 (packed) tensor as I32 in the safetensors header: same size, wrong dtype.
    let d = copy_fixture("qwen3_moe-q4g64");
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + hlen].to_vec()).unwrap();
    let at = header.find("\"U32\"").expect("a packed tensor");
    bytes[8 + at + 1] = b'I';
    std::fs::write(&p, bytes).unwrap();
    let err = fails(d.path(), &[]);
    assert!(
        err.contains("tensor `") && err.contains(".weight`") && err.contains("must be U32, got I32"),
        "{err}"
    );
}

#[test]
fn quantized_weights_without_a_quantization_block_are_named() {
    let d = copy_fixture("qwen3_moe-q4g64");
    edit_config(d.path(), |v| {
        let o = v.as_object_mut().unwrap();
        o.remove("quantization");
        o.remove("quantization_config");
    });
    let err = fails(d.path(), &[]);
    assert!(
        err.contains("not quantized") && err.contains("`.scales` exists"),
        "{err}"
    );
}

#[test]
fn truncated_weights_file_is_named() {
    let d = copy_fixture("mixtral-q4g64");
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(d.path(), &[]);
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );
}

#[test]
fn a_tokenizer_the_library_panics_on_is_named_without_a_panic_message() {
    let d = copy_fixture("qwen3_5_moe-q4g64");
    let p = d.path().join("tokenizer.json");
    let mut t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    // A BPE prefix its merges do not carry: the tokenizers crate slices a token mid-character and panics.
    t["model"]["continuing_subword_prefix"] = "x".into();
    std::fs::write(&p, t.to_string()).unwrap();
    let err = fails(d.path(), &[]);
    assert!(
        err.contains("tokenizer.json") && err.contains("the tokenizers library could not build it"),
        "{err}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let d = copy_fixture("qwen3_moe-q4g64-overrides-vlm-sharded");
    std::fs::remove_file(d.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = fails(d.path(), &[]);
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
}

#[test]
fn prompt_longer_than_the_context_names_the_limit() {
    let err = fails(&fixture("qwen3_moe-q4g64"), &["--ctx-size", "1"]);
    assert!(err.contains("context limit is 1 tokens"), "{err}");
}

#[test]
#[cfg(target_os = "linux")]
fn a_failed_write_of_the_text_is_an_error_and_a_closed_pipe_is_not() {
    let dir = fixture("qwen3_moe-q4g64");
    let args = [
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hi",
        "-n",
        "4",
    ];
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdout(full)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("writing the generated text"),
        "{err}"
    );
    // A reader that leaves (`| head`) ends the text quietly, also when it read the summary too (`2>&1 | head`).
    let out = common::with_reader_gone(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(common::with_shared_reader_gone(&args).success());
}

#[test]
fn bad_flags_are_rejected() {
    let dir = fixture("qwen3_moe-q4g64");
    // Each bad flag gets its own message, naming the flag and its limit.
    for (extra, want) in [
        (&["--top-p", "1.5"][..], "top_p must be in [0, 1], got 1.5"),
        (&["--top-k", "99"], "top-k 99 must be between 1 and the model's"),
        (&["--temperature=-1"], "temperature must be ≥ 0, got -1"),
        (&["--threads", "0"], "--threads must be at least 1"),
        // Found by the flag walk below: it spent minutes starting a million threads.
        (
            &["--threads", "1000003"],
            "--threads asks for 1000003 compute threads on a machine with",
        ),
        (&["--ctx-size", "0"], "--ctx-size <CTX_SIZE>': must be at least 1 token"),
        // Flags that would be dropped without a word.
        (
            &["--experts", "resident", "--expert-cache", "1G"],
            "--experts resident has none",
        ),
        (
            &["--experts", "mmap", "--expert-cache", "1G"],
            "--experts mmap has none",
        ),
        (
            &["--experts", "mmap", "--direct-io"],
            "mmap reads through the page cache",
        ),
        (&["--expert-cache", "99999999999T"], "more bytes than there are"),
    ] {
        let err = fails(&dir, extra);
        assert!(err.contains(want), "{extra:?}: expected `{want}` in: {err}");
    }
    // A dense model has no experts per token to set.
    let err = fails(&fixture("brown-qwen3-q4g64"), &["--top-k", "2"]);
    assert!(err.contains("no routed experts"), "{err}");
    let out = sluice(&["generate", "--model", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "clap usage error");
    let err = fails(&dir, &["--backend", "gpu"]);
    assert!(err.contains("unknown backend `gpu` (cpu, mlx, reference)"), "{err}");
    // `doctor` shares the context flag, and its check.
    let out = sluice(&["doctor", "--config", dir.to_str().unwrap(), "--ctx-size", "0"]);
    assert_eq!(out.status.code(), Some(2), "clap usage error");
    assert!(
        text(&out.stderr).contains("must be at least 1 token"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn backend_flag_selects_cpu_and_explains_a_build_without_mlx() {
    let dir = fixture("qwen3_moe-q4g64");
    let d = dir.to_str().unwrap();
    let out = sluice(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "hi",
        "-n",
        "2",
        "--backend",
        "cpu",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = sluice(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "hi",
        "-n",
        "2",
        "--backend",
        "mlx",
    ]);
    if cfg!(feature = "mlx") {
        assert!(out.status.success(), "{}", text(&out.stderr));
    } else {
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains("rebuild with `--features mlx`"),
            "{}",
            text(&out.stderr)
        );
    }
}

/// Every option of `generate`, `bench` and `eval` that takes a value (read from each command's `--help`, so a new
/// one is walked too), given values a typo or a script bug passes (0, −1, 1000003, 2.5, `x`, empty): each run
/// exits 0, or 1 or 2 with a message, within a minute, and never panics. (The walk found `--threads 1000003`
/// starting threads for minutes.)
#[test]
fn every_option_given_a_bad_value_exits_cleanly() {
    let model = fixture("qwen3_moe-q4g64");
    let trained = fixture("brown-qwen3_moe-q4g64");
    let heldout = fixture("brown-heldout.txt");
    let (model, trained, heldout) = (
        model.to_str().unwrap(),
        trained.to_str().unwrap(),
        heldout.to_str().unwrap(),
    );
    // Each command's base: a quick run on a fixture. Its own options are not varied (a huge prompt length or
    // probe time would be a long run, not a fault).
    let commands: [&[&str]; 3] = [
        &["generate", "--model", model, "--prompt", "It was", "--max-tokens", "3"],
        &[
            "bench",
            "--model",
            model,
            "-p",
            "4",
            "-n",
            "3",
            "--probe-seconds",
            "0",
            "--runs",
            "warm",
        ],
        &[
            "eval",
            "--model",
            trained,
            "--text",
            heldout,
            "--windows",
            "1",
            "--ctx",
            "32",
            "--decode-tokens",
            "0",
        ],
    ];
    // Options that name a file to write (`--trace-out x`, `--plot 0`) write it here, not into the checkout.
    let cwd = tempfile::tempdir().unwrap();
    let mut runs = 0;
    let mut faults = Vec::new();
    for base in commands {
        let help = text(&sluice(&[base[0], "--help"]).stdout);
        let options: Vec<&str> = (help.lines())
            .filter_map(|l| {
                let l = l.trim_start();
                let l = l
                    .split_once(", ")
                    .filter(|(short, _)| short.len() == 2)
                    .map_or(l, |(_, long)| long);
                let (name, rest) = l.split_once(' ')?;
                (name.starts_with("--") && rest.starts_with('<')).then_some(name)
            })
            .filter(|o| !base.contains(o))
            .collect();
        assert!(options.len() >= 10, "{}: only {options:?} in its --help", base[0]);
        for option in options {
            for value in ["0", "-1", "1000003", "2.5", "x", ""] {
                let mut args = base.to_vec();
                args.extend([option, value]);
                runs += 1;
                let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
                    .args(&args)
                    .current_dir(cwd.path())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                let mut stderr = child.stderr.take().unwrap();
                let reader = std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
                    s
                });
                let start = std::time::Instant::now();
                let status = loop {
                    if let Some(status) = child.try_wait().unwrap() {
                        break Some(status);
                    }
                    if start.elapsed() > std::time::Duration::from_secs(60) {
                        let _ = child.kill();
                        let _ = child.wait();
                        break None;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                };
                let err = reader.join().unwrap();
                let fine = status.is_some_and(|s| matches!(s.code(), Some(0..=2)))
                    && !err.contains("panicked")
                    && (status.is_some_and(|s| s.success()) || !err.trim().is_empty());
                if !fine {
                    let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
                    faults.push(format!("{} {option} {value:?}: {status:?}: {last}", base[0]));
                }
            }
        }
    }
    assert!(
        faults.is_empty(),
        "{} of {runs} runs:\n{}",
        faults.len(),
        faults.join("\n")
    );
}
