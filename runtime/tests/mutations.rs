//! Damaged inputs, systematically: every scalar of a fixture's `config.json`, `tokenizer_config.json`,
//! `tokenizer.json` settings, shard index, a `generation_config.json` and a packed-store manifest replaced by values a broken or hand-edited
//! file carries (zero, one, negative, odd, large, a float, a string, null, or the field removed); every tensor of
//! the first layers re-declared with the same bytes under another shape or dtype; every file cut short. Each
//! damaged copy must load and generate, or fail with an error that says something; none may panic. (The targeted
//! tests in `pipeline.rs` and `streaming.rs` check the messages of the common cases; this one covers the fields
//! nobody thought of.)

mod common;

use common::fixture;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use serde_json::Value;
use sluice_runtime::{
    convert_model, ExpertMode, ExpertOptions, GenerateParams, IoMode, Pipeline, PrefetchMode, Prompt, StoreLayout,
};

/// One fixture per architecture and config shape: dense-attention MoE, Mixtral's names, a hybrid with its own
/// fields, and a VLM-style config whose text model sits under `text_config`.
const FIXTURES: &[&str] = &[
    "qwen3_moe-q4g64",
    "mixtral-q8g32",
    "qwen3_next-q4g64",
    "qwen3_5_moe-q4g64",
];

/// A copy of `src`'s files (the index too: a shard list naming a file that is still there).
fn copy_of(src: &Path) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    d
}

thread_local! {
    /// Set while this thread runs damaged cases: its panics are recorded here instead of printed.
    static CAUGHT: std::cell::RefCell<Option<Option<String>>> = const { std::cell::RefCell::new(None) };
}

/// Installs (once) a panic hook that records a panic on a thread running damaged cases (hundreds of expected
/// errors, and a panic's message with its location, go to the report) and prints any other as usual.
fn install_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let recorded = CAUGHT.with(|c| match c.borrow_mut().as_mut() {
                Some(slot) => {
                    *slot = Some(info.to_string());
                    true
                }
                None => false,
            });
            if !recorded {
                default(info);
            }
        }));
    });
}

/// One damaged copy: its label, and the change made to a fresh copy of the model's directory.
type Case = (String, Box<dyn Fn(&Path)>);

/// What a damaged copy did.
#[derive(Debug)]
enum Outcome {
    /// Loaded and generated.
    Ran,
    /// Failed with this error.
    Refused(String),
    /// Panicked: the message and its location.
    Panicked(String),
}

/// What `sluice doctor` computes from a config alone (no tensors): the model's sizes, the memory plan, and the
/// forecast at each `--top-k` it lists, warm and cold, against fixed machine probes.
fn size_and_forecast(dir: &Path, opts: &ExpertOptions) -> Result<(), sluice_runtime::ModelError> {
    use sluice_runtime::forecast::{check_top_k, forecast, size_from_config, MachineProbes};
    use sluice_runtime::memory_plan::{MachineMemory, MemoryPlan, PlanRequest};
    let config = sluice_runtime::config::ModelConfig::load(dir)?;
    let size = size_from_config(&config, None, opts)?;
    let probes = MachineProbes {
        disk_gbps_by_depth: vec![(1, 0.5), (2, 0.9), (4, 1.6), (8, 2.0)],
        dram_gbps: 30.0,
        matvec_gbps: 20.0,
        call_seconds: 1e-5,
    };
    // The machine's memory, read once for every case (it is the same machine).
    static MACHINE: std::sync::OnceLock<MachineMemory> = std::sync::OnceLock::new();
    let machine = *MACHINE.get_or_init(|| MachineMemory::probe_for(opts.backend));
    let plan = MemoryPlan::new(machine, size.footprint, &PlanRequest::from_options(opts));
    for k in sluice_runtime::eval::default_top_ks(size.top_k, size.num_experts) {
        check_top_k(&size, k)?;
        for cold in [false, true] {
            forecast(&size, &plan, &probes, opts.io_depth, k.max(1), cold, 0);
        }
    }
    Ok(())
}

/// Sizes `dir` from its config as `sluice doctor` does, packs it into a store as `sluice convert` does (with
/// `convert`), then loads it with `opts` and generates two tokens after `prompt`. A panic in any of them fails
/// the case; the outcome is the load's (a config doctor refuses may still load, and the other way round).
fn load_and_generate(dir: &Path, opts: &ExpertOptions, prompt: &Prompt, convert: bool) -> Outcome {
    let run = || -> Result<(), sluice_runtime::ModelError> {
        let _ = size_and_forecast(dir, opts);
        if convert {
            let out = tempfile::tempdir().unwrap();
            let _ = convert_model(dir, &out.path().join("store"), false, StoreLayout::Auto, &|_, _| {});
        }
        let p = Pipeline::load_with(dir, opts)?;
        let params = GenerateParams {
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        };
        p.generate(prompt, &params, |_| true)?;
        Ok(())
    };
    install_hook();
    CAUGHT.with(|c| *c.borrow_mut() = Some(None));
    let outcome = catch_unwind(AssertUnwindSafe(run));
    let message = CAUGHT.with(|c| c.borrow_mut().take().flatten());
    match outcome {
        Ok(Ok(())) => Outcome::Ran,
        Ok(Err(e)) => Outcome::Refused(e.to_string()),
        Err(_) => Outcome::Panicked(message.unwrap_or_else(|| "a panic the hook did not see".into())),
    }
}

/// The JSON pointer of every scalar in `v` (numbers, strings, booleans, nulls), arrays' elements included.
fn scalar_paths(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => m
            .iter()
            .for_each(|(k, v)| scalar_paths(v, format!("{at}/{}", escape(k)), out)),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| scalar_paths(v, format!("{at}/{i}"), out)),
        _ => out.push(at),
    }
}

/// A key as a JSON pointer token (RFC 6901).
fn escape(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}

/// What replaces a scalar: `None` removes it (from its object; an array element is set to null instead).
fn replacements(v: &Value) -> Vec<Option<Value>> {
    use serde_json::json;
    let mut out: Vec<Option<Value>> = match v {
        Value::Number(_) => [
            json!(0),
            json!(1),
            json!(3),
            json!(-1),
            json!(1_000_003),
            json!(2.5),
            json!("7"),
        ]
        .into_iter()
        .map(Some)
        .collect(),
        Value::String(_) => vec![Some(json!("x")), Some(json!("")), Some(json!(5))],
        Value::Bool(b) => vec![Some(json!(!b)), Some(json!("true"))],
        Value::Null => vec![Some(json!(4))],
        _ => vec![],
    };
    out.push(Some(Value::Null));
    out.push(None);
    out
}

/// `c` with the scalar at `path` replaced by `with` (or removed).
fn mutated(c: &Value, path: &str, with: &Option<Value>) -> Value {
    let mut c = c.clone();
    let (parent, key) = path.rsplit_once('/').unwrap();
    let slot = c.pointer_mut(parent).unwrap();
    match (slot, with) {
        (Value::Object(m), None) => {
            m.remove(&key.replace("~1", "/").replace("~0", "~"));
        }
        (Value::Array(a), None) => a[key.parse::<usize>().unwrap()] = Value::Null,
        (parent, Some(v)) => *parent.pointer_mut(&format!("/{key}")).unwrap() = v.clone(),
        _ => unreachable!("scalars sit in objects and arrays"),
    }
    c
}

/// Runs every case (a label and a change to a fresh copy of `src`, a fixture or a store), loads the copy as
/// `run` says, and returns each one's label and outcome. `SLUICE_SHOW_MUTATIONS=1` prints them.
fn outcomes_of(name: &str, src: &Path, cases: Vec<Case>, run: &dyn Fn(&Path) -> Outcome) -> Vec<(String, Outcome)> {
    let show = std::env::var_os("SLUICE_SHOW_MUTATIONS").is_some();
    let mut out = Vec::new();
    for (label, apply) in cases {
        let copy = copy_of(src);
        apply(copy.path());
        let outcome = run(copy.path());
        if show {
            eprintln!("{name}: {label}: {outcome:?}");
        }
        out.push((format!("{name}: {label}"), outcome));
    }
    out
}

/// The faults among `outcomes`, one line each: panics, and errors that say nothing.
fn faults(outcomes: &[(String, Outcome)]) -> Vec<String> {
    (outcomes.iter())
        .filter_map(|(label, o)| match o {
            Outcome::Panicked(m) => Some(format!("{label}: {m}")),
            Outcome::Refused(m) if m.trim().is_empty() => Some(format!("{label}: an error with no message")),
            _ => None,
        })
        .collect()
}

/// Every case of one JSON file in `src` (a fixture or a store): each scalar kept by `keep` (a JSON pointer)
/// replaced or removed.
fn json_cases(src: &Path, file: &'static str, keep: impl Fn(&str) -> bool) -> Vec<Case> {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(src.join(file)).unwrap()).unwrap();
    edits_of(&json, file, keep)
}

/// Every case of `json` written as `file`: each scalar kept by `keep` replaced or removed.
fn edits_of(json: &Value, file: &'static str, keep: impl Fn(&str) -> bool) -> Vec<Case> {
    let mut paths = Vec::new();
    scalar_paths(json, String::new(), &mut paths);
    let mut cases: Vec<Case> = Vec::new();
    for path in paths.into_iter().filter(|p| keep(p)) {
        for with in replacements(json.pointer(&path).unwrap()) {
            let edited = mutated(json, &path, &with);
            let label = match &with {
                Some(v) => format!("{file} {path} = {v}"),
                None => format!("{file} {path} removed"),
            };
            cases.push((
                label,
                Box::new(move |dir: &Path| std::fs::write(dir.join(file), edited.to_string()).unwrap()),
            ));
        }
    }
    cases
}

/// Runs `cases` of each fixture (loaded, and with `convert` packed too) and fails on any fault, after checking the
/// walk made at least `min` cases.
fn no_faults(what: &str, min: usize, convert: bool, cases: impl Fn(&str) -> Vec<Case>) {
    let mut all = Vec::new();
    let raw = Prompt::Raw("It was a".into());
    for name in FIXTURES {
        let run = |dir: &Path| load_and_generate(dir, &ExpertOptions::default(), &raw, convert);
        all.extend(intact_then_damaged(name, &fixture(name), cases(name), &run));
    }
    assert_no_faults(what, min, &all);
}

/// [`outcomes_of`] the cases, after checking that `src` undamaged runs: so a case is refused for its damage,
/// not for something every case shares.
fn intact_then_damaged(
    name: &str,
    src: &Path,
    cases: Vec<Case>,
    run: &dyn Fn(&Path) -> Outcome,
) -> Vec<(String, Outcome)> {
    let intact = outcomes_of(name, src, vec![("intact".into(), Box::new(|_: &Path| {}))], run);
    assert!(matches!(intact[0].1, Outcome::Ran), "{name}: {:?}", intact[0].1);
    outcomes_of(name, src, cases, run)
}

/// Fails on any fault among `all` (the damaged `what`), or when the walk made fewer than `min` cases.
fn assert_no_faults(what: &str, min: usize, all: &[(String, Outcome)]) {
    assert!(
        all.len() >= min,
        "only {} cases: the walk found too few {what}",
        all.len()
    );
    let found = faults(all);
    assert!(
        found.is_empty(),
        "{} of {} damaged {what} panicked or failed without a message:\n{}",
        found.len(),
        all.len(),
        found.join("\n")
    );
}

#[test]
fn every_config_field_damaged_loads_or_fails_cleanly() {
    // Per-layer quantization overrides repeat one shape many times: the first layer's stand for the rest.
    let first_layer = |p: &str| !p.contains("layers.") || p.contains("layers.0.");
    no_faults("config fields", 1000, false, |name| {
        json_cases(&fixture(name), "config.json", first_layer)
    });
}

#[test]
fn every_tokenizer_and_index_field_damaged_loads_or_fails_cleanly() {
    no_faults("tokenizer and index fields", 300, false, |name| {
        let mut cases = json_cases(&fixture(name), "tokenizer_config.json", |_| true);
        // The tokenizer's own settings and first added tokens, not every vocabulary entry and merge.
        cases.extend(json_cases(&fixture(name), "tokenizer.json", |p| {
            !p.starts_with("/model/vocab/") && !p.starts_with("/model/merges/") && !p.starts_with("/added_tokens/")
                || p.starts_with("/added_tokens/0/")
        }));
        // A shard map naming other files (or none) for the first layers' tensors and everything outside them.
        cases.extend(json_cases(&fixture(name), "model.safetensors.index.json", |p| {
            !p.contains("layers.") || p.contains("layers.0.")
        }));
        // The fixtures have no generation_config.json: Qwen3's, with this fixture's token ids.
        let generation = serde_json::json!({
            "bos_token_id": 0, "do_sample": true, "eos_token_id": [1, 2], "pad_token_id": 1,
            "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.05,
        });
        cases.extend(edits_of(&generation, "generation_config.json", |_| true));
        cases
    });
}

#[test]
fn truncated_files_load_or_fail_cleanly() {
    no_faults("files cut short", 100, true, |name| {
        let mut cases: Vec<Case> = Vec::new();
        for file in [
            "config.json",
            "tokenizer_config.json",
            "tokenizer.json",
            "chat_template.jinja",
            "model.safetensors",
        ] {
            let len = std::fs::metadata(fixture(name).join(file)).unwrap().len();
            // The start, inside the first bytes (a header's length, a JSON's first key), and through the body.
            let cuts = [0, 1, 7, 9, 40].into_iter().chain((1..8).map(|i| len * i / 8));
            for cut in cuts.filter(|&c| c < len) {
                cases.push((
                    format!("{file} cut to {cut} of {len} bytes"),
                    Box::new(move |dir: &Path| {
                        let f = std::fs::OpenOptions::new().write(true).open(dir.join(file)).unwrap();
                        f.set_len(cut).unwrap();
                    }),
                ));
            }
        }
        cases
    });
}

/// The safetensors header of `file`, and the bytes after it.
fn split_safetensors(bytes: &[u8]) -> (Value, &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), &bytes[8 + n..])
}

fn join_safetensors(header: &Value, data: &[u8]) -> Vec<u8> {
    let h = header.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(data);
    out
}

/// The same bytes declared otherwise: the shape reversed, flattened, or with a dimension moved to a new leading
/// one; the dtype swapped for another of the same width.
fn redeclarations(info: &Value) -> Vec<(String, Value)> {
    let shape: Vec<u64> = info["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap())
        .collect();
    let mut out = Vec::new();
    let mut with_shape = |label: &str, s: Vec<u64>| {
        let mut i = info.clone();
        i["shape"] = serde_json::json!(s);
        out.push((label.to_string(), i));
    };
    if shape.len() > 1 {
        let mut r = shape.clone();
        r.reverse();
        with_shape("shape reversed", r);
        with_shape("shape flattened", vec![shape.iter().product()]);
    }
    if shape.first().is_some_and(|&d| d % 2 == 0) {
        let mut s = shape.clone();
        s[0] /= 2;
        s.insert(0, 2);
        with_shape("first dimension split", s);
    }
    let swapped = match info["dtype"].as_str().unwrap() {
        "U32" => "F32",
        "F32" => "I32",
        "BF16" => "F16",
        "F16" => "BF16",
        "U8" => "I8",
        _ => "U8",
    };
    // A dtype of another width no longer covers the bytes: the safetensors check must refuse it, not us panic.
    let mut i = info.clone();
    i["dtype"] = swapped.into();
    out.push((format!("dtype {swapped}"), i));
    out
}

#[test]
fn every_tensor_redeclared_loads_or_fails_cleanly() {
    no_faults("tensor declarations", 200, true, |name| {
        let bytes = std::fs::read(fixture(name).join("model.safetensors")).unwrap();
        let (header, _) = split_safetensors(&bytes);
        let mut cases: Vec<Case> = Vec::new();
        let tensors: Vec<&String> = header
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "__metadata__")
            .collect();
        // The first two layers' tensors and every tensor outside the layers: the rest repeat their shapes.
        for tensor in tensors
            .into_iter()
            .filter(|t| !t.contains("layers.") || t.contains("layers.0.") || t.contains("layers.1."))
        {
            for (label, info) in redeclarations(&header[tensor.as_str()]) {
                let mut h = header.clone();
                h[tensor.as_str()] = info;
                let bytes = bytes.clone();
                cases.push((
                    format!("tensor {tensor}: {label}"),
                    Box::new(move |dir: &Path| {
                        let (_, data) = split_safetensors(&bytes);
                        std::fs::write(dir.join("model.safetensors"), join_safetensors(&h, data)).unwrap()
                    }),
                ));
            }
        }
        cases
    });
}

#[test]
fn every_store_manifest_field_damaged_loads_or_fails_cleanly() {
    // A packed store of this machine's default layout (tiled where the int8 kernels run), streamed through a
    // cache smaller than the experts, every expert of every layer asked for, so each record is read.
    let name = "qwen3_moe-q4g64";
    // The int8 kernels, which a tiled store needs (the default layout on x86-64). A process-wide switch: the
    // other tests here only look for panics, whichever kernels run.
    sluice_runtime::cpu::q8::set_q8_activations(true);
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    convert_model(&fixture(name), &store, false, StoreLayout::Auto, &|_, _| {}).unwrap();
    // The store's own fields, the first layer's parts and layout, and its first two records.
    let cases = json_cases(&store, expert_store::MANIFEST_FILE, |p| {
        !p.starts_with("/layers/")
            || (p.starts_with("/layers/0/") && !p.contains("/records/"))
            || p.starts_with("/layers/0/records/0/")
            || p.starts_with("/layers/0/records/1/")
    });
    let opts = ExpertOptions {
        mode: ExpertMode::Stream,
        cache_bytes: Some(64 << 10),
        io_depth: 2,
        io: IoMode::Buffered,
        verify: true,
        prefetch: PrefetchMode::None,
        ..ExpertOptions::default()
    };
    let every_expert = Prompt::Tokens((0..24).collect());
    let run = |dir: &Path| load_and_generate(dir, &opts, &every_expert, false);
    assert_no_faults("manifest fields", 150, &intact_then_damaged(name, &store, cases, &run));
}
