//! The mlx backend against the cpu backend on every fixture (f32 activations on both sides), and streamed
//! against resident experts on mlx. Built only with `--features mlx` (see scripts/setup-mlx.sh); CI runs it as
//! its own step of `.ci/run`.

mod common;

use common::fixtures;

use std::path::Path;

use sluice_runtime::config::ModelConfig;
use sluice_runtime::sampling::argmax;
use sluice_runtime::{load_model_with, BackendKind, DecoderModel, ExpertMode, ExpertOptions, ForwardOptions};

#[derive(serde::Deserialize)]
struct Golden {
    prompt_ids: Vec<u32>,
}

fn load(dir: &Path, backend: BackendKind, mode: ExpertMode, cache_bytes: Option<u64>) -> DecoderModel {
    let opts = ExpertOptions {
        backend,
        mode,
        cache_bytes,
        ..ExpertOptions::default()
    };
    load_model_with(dir, ModelConfig::load(dir).unwrap(), &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Prefill logits at every position and the logits of `steps` greedy decode steps.
fn trace(m: &DecoderModel, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>, Vec<Vec<f32>>) {
    let mut cache = m.new_cache();
    let all = m
        .forward(
            prompt,
            &mut cache,
            &ForwardOptions {
                all_logits: true,
                ..Default::default()
            },
        )
        .unwrap();
    let v = m.info.vocab_size;
    let mut logits = all[(prompt.len() - 1) * v..].to_vec();
    let (mut tokens, mut steps_logits) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let t = argmax(&logits);
        tokens.push(t);
        logits = m.forward(&[t], &mut cache, &ForwardOptions::default()).unwrap();
        steps_logits.push(logits.clone());
    }
    (all, tokens, steps_logits)
}

/// Tolerance: both backends compute in f32 from the same codes and scales; they differ in summation order,
/// f32 vs f64 RoPE angles and MLX's own exp/rsqrt, so |mlx − cpu| ≤ 1e-3 + 1e-3·|cpu| per logit.
fn assert_close(what: &str, got: &[f32], want: &[f32]) -> f32 {
    common::assert_close(what, got, want, ("mlx", "cpu"))
}

#[test]
fn mlx_matches_cpu_on_every_fixture() {
    for dir in fixtures() {
        let g: Golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let cpu = trace(&load(&dir, BackendKind::Cpu, ExpertMode::Mmap, None), &g.prompt_ids, 16);
        let mlx = trace(&load(&dir, BackendKind::Mlx, ExpertMode::Mmap, None), &g.prompt_ids, 16);
        let mut worst = assert_close(&format!("{name} prefill"), &mlx.0, &cpu.0);
        assert_eq!(mlx.1, cpu.1, "{name}: greedy tokens");
        for (i, (a, b)) in mlx.2.iter().zip(&cpu.2).enumerate() {
            worst = worst.max(assert_close(&format!("{name} step {i}"), a, b));
        }
        eprintln!("{name}: max |mlx − cpu| {worst:.2e}");
    }
}

#[test]
fn mlx_streamed_equals_resident_bit_for_bit() {
    for dir in fixtures() {
        let g: Golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let resident = load(&dir, BackendKind::Mlx, ExpertMode::Resident, None);
        if resident.info.num_experts == 0 {
            continue;
        }
        let want = trace(&resident, &g.prompt_ids, 5);
        // A slot budget of a few records (page-aligned slots): experts are evicted and read again within a step.
        let few = (96u64 << 10).max(4 * resident.info.expert_record_bytes.next_multiple_of(16 << 10));
        let streamed = load(&dir, BackendKind::Mlx, ExpertMode::Stream, Some(few));
        assert!(streamed.expert_slots().is_some());
        let got = trace(&streamed, &g.prompt_ids, 5);
        assert!(got == want, "{}: streamed differs from resident on mlx", dir.display());
    }
}

/// The mlx KV cache grows in steps of 256 positions and writes into its buffer: a decode step across a step,
/// a chunk up to the context's end, a rewind followed by new tokens within the buffer, and a rewind followed
/// by a chunk that grows the buffer from the shorter length (keeping the rows before it) all give
/// the cpu backend's logits.
#[test]
fn mlx_kv_cache_grows_and_rewinds_like_cpu() {
    let dir = common::fixture("qwen3_moe-q4g64"); // a context of 512
    let (cpu, mlx) = (
        load(&dir, BackendKind::Cpu, ExpertMode::Mmap, None),
        load(&dir, BackendKind::Mlx, ExpertMode::Mmap, None),
    );
    let v = cpu.info.vocab_size as u32;
    let tokens: Vec<u32> = (0..512u32).map(|i| (i * 7919 + 13) % v).collect();
    let opts = ForwardOptions::default();
    let step = |what: &str, ids: &[u32], c: &mut _, m: &mut _| {
        let want = cpu.forward(ids, c, &opts).unwrap();
        let got = mlx.forward(ids, m, &opts).unwrap();
        assert_close(what, &got, &want);
    };
    let (mut c, mut m) = (cpu.new_cache(), mlx.new_cache());
    step("prompt of 250", &tokens[..250], &mut c, &mut m);
    let (at250_cpu, at250_mlx) = (c.checkpoint(), m.checkpoint());
    for (i, &t) in tokens[250..262].iter().enumerate() {
        step(&format!("decode at {}", 250 + i), &[t], &mut c, &mut m);
    }
    step("chunk to the context's end", &tokens[262..512], &mut c, &mut m);
    c.restore(&at250_cpu).unwrap();
    m.restore(&at250_mlx).unwrap();
    step("after rewinding to 250", &tokens[300..330], &mut c, &mut m);
    for &t in &tokens[330..340] {
        step("decode after the rewind", &[t], &mut c, &mut m);
    }

    let (mut c, mut m) = (cpu.new_cache(), mlx.new_cache());
    step("prompt of 100", &tokens[..100], &mut c, &mut m);
    let (at100_cpu, at100_mlx) = (c.checkpoint(), m.checkpoint());
    step("chunk to 250", &tokens[100..250], &mut c, &mut m);
    c.restore(&at100_cpu).unwrap();
    m.restore(&at100_mlx).unwrap();
    step(
        "a chunk past the buffer after a rewind",
        &tokens[300..500],
        &mut c,
        &mut m,
    );
    for &t in &tokens[500..506] {
        step("decode after it", &[t], &mut c, &mut m);
    }
}

/// The mlx backend keeps 16-bit float weights as f32 copies: its plan counts them at twice the cpu backend's
/// size, all but an untied embedding table, whose rows are looked up in the mapped file (a bf16 model's other
/// non-expert weights exactly double; a 4-bit one's grow by their scales and biases).
#[test]
fn mlx_plans_its_f32_copies_of_half_precision_weights() {
    let resident = |name: &str, backend| {
        load(&common::fixture(name), backend, ExpertMode::Mmap, None)
            .memory_plan
            .model
            .resident_weights
    };
    let (cpu, mlx) = (
        resident("qwen3_moe-bf16", BackendKind::Cpu),
        resident("qwen3_moe-bf16", BackendKind::Mlx),
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("qwen3_moe-bf16").join("config.json")).unwrap())
            .unwrap();
    let embedding = config["vocab_size"].as_u64().unwrap() * config["hidden_size"].as_u64().unwrap() * 2;
    assert_eq!(mlx, 2 * cpu - embedding);
    let (cpu, mlx) = (
        resident("qwen3_moe-q4g64", BackendKind::Cpu),
        resident("qwen3_moe-q4g64", BackendKind::Mlx),
    );
    assert!(mlx > cpu && mlx < 2 * cpu, "cpu {cpu}, mlx {mlx}");
}

#[test]
fn mlx_checkpoints_restore_exactly() {
    let dir = common::fixture("qwen3_5_moe-q4g64");
    let m = load(&dir, BackendKind::Mlx, ExpertMode::Mmap, None);
    let mut cache = m.new_cache();
    let opts = ForwardOptions::default();
    m.forward(&[5, 6, 7, 8], &mut cache, &opts).unwrap();
    let cp = cache.checkpoint();
    let a = m.forward(&[9], &mut cache, &opts).unwrap();
    let b = m.forward(&[10], &mut cache, &opts).unwrap();
    cache.restore(&cp).unwrap();
    m.forward(&[11, 12], &mut cache, &opts).unwrap();
    cache.restore(&cp).unwrap();
    assert_eq!(m.forward(&[9], &mut cache, &opts).unwrap(), a);
    assert_eq!(m.forward(&[10], &mut cache, &opts).unwrap(), b);
}

/// A prompt chunk leaves the recurrent state holding its own bytes: the conv history is not a view of the
/// chunk's whole conv input (which a checkpoint would then pin for its life). The chunk's input here is
/// ~34 MB against a state of 128 KB; the other tests of this file hold a few MB at most while they run.
#[test]
fn mlx_recurrent_state_after_a_chunk_holds_only_itself() {
    use sluice_runtime::backend::mlx::MlxBackend;
    use sluice_runtime::backend::{Backend, RecurrentState, SeqSpan};
    use sluice_runtime::gated_delta::{DeltaParams, DeltaShape};
    let (dv, n) = (4096, 2048);
    let shape = DeltaShape {
        k_heads: 1,
        v_heads: 1,
        k_dim: 8,
        v_dim: dv,
        kernel: 4,
    };
    let c = shape.conv_dim();
    let be = MlxBackend;
    let w = be
        .delta_weights(&DeltaParams {
            shape,
            eps: 1e-6,
            conv: vec![0.25; c * shape.kernel],
            decay_rate: vec![0.5],
            dt_bias: vec![0.0],
            norm: vec![1.0; dv],
        })
        .unwrap();
    let mut st = be.new_recurrent(shape);
    let active = || mlx_rs::memory::active_memory().unwrap();
    let before = active();
    {
        let rows = |cols: usize, f: fn(usize) -> f32| be.upload((0..n * cols).map(f).collect(), cols).unwrap();
        let qkv = rows(c, |i| (i % 97) as f32 / 97.0 - 0.5);
        let (z, b, a) = (rows(dv, |_| 0.5), rows(1, |_| 0.0), rows(1, |_| 0.0));
        let spans = [SeqSpan { rows: 0..n, pos0: 0 }];
        let y = be.gated_delta(&w, &qkv, &z, &b, &a, &spans, &mut [&mut st]).unwrap();
        assert!(be.to_host(&y).unwrap().iter().all(|v| v.is_finite()));
    }
    st.commit();
    let held = active().saturating_sub(before);
    let window = (n + shape.kernel - 1) * c * 4;
    assert!(
        held < st.bytes() + window / 4,
        "the state holds {held} bytes after the chunk: its own {} and part of the {window}-byte window",
        st.bytes()
    );
}

#[test]
fn metal_working_set_comes_from_mlx_where_it_has_one() {
    let w = sluice_runtime::backend::mlx::recommended_working_set();
    if cfg!(target_os = "macos") {
        assert!(w.is_some_and(|b| b > 1 << 30), "{w:?}");
    } else {
        // MLX's CPU build has no Metal device info.
        assert_eq!(w, None);
    }
}

/// MLX's cache of freed buffers is held to half the plan's margin (its default is its whole memory limit,
/// outside every budget).
#[test]
fn mlx_buffer_cache_is_held_to_half_the_margin() {
    let m = load(
        &common::fixture("qwen3_moe-q4g64"),
        BackendKind::Mlx,
        ExpertMode::Mmap,
        None,
    );
    let limit = mlx_rs::memory::set_cache_limit(1 << 20).unwrap();
    mlx_rs::memory::set_cache_limit(limit).unwrap();
    assert_eq!(limit as u64, m.memory_plan.margin / 2);
}

/// YaRN on a partial-rotary model (the qwen3_next fixture rotates 16 of its 64 head dims) scales only the
/// rotated dims on mlx, as mlx-lm's `YarnRoPE` and the cpu backend do: mlx refused every forward of such a model.
#[test]
fn mlx_yarn_on_partial_rotary_dims_matches_cpu() {
    let src = common::fixture("qwen3_next-q4g64");
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["rope_scaling"] =
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256});
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let g: Golden = serde_json::from_str(&std::fs::read_to_string(dir.path().join("golden.json")).unwrap()).unwrap();
    let cpu = trace(
        &load(dir.path(), BackendKind::Cpu, ExpertMode::Mmap, None),
        &g.prompt_ids,
        8,
    );
    let plain = trace(&load(&src, BackendKind::Cpu, ExpertMode::Mmap, None), &g.prompt_ids, 8);
    assert!(
        cpu.0 != plain.0,
        "the scaling changed nothing: the test would not see it"
    );
    let mlx = trace(
        &load(dir.path(), BackendKind::Mlx, ExpertMode::Mmap, None),
        &g.prompt_ids,
        8,
    );
    assert_close("yarn prefill", &mlx.0, &cpu.0);
    assert_eq!(mlx.1, cpu.1, "greedy tokens");
    for (i, (a, b)) in mlx.2.iter().zip(&cpu.2).enumerate() {
        assert_close(&format!("yarn step {i}"), a, b);
    }
}

/// A model loaded on one thread computes on another (the server loads on a blocking task and generates on its
/// engine thread): nothing built at load may be a lazy MLX op, whose stream belongs to the loading thread. A
/// bf16 checkpoint's dense matrices were uploaded as a lazy transpose, so every forward of one failed there.
#[test]
fn mlx_model_loaded_on_one_thread_computes_on_another() {
    for name in ["qwen3_moe-bf16", "qwen3_next-bf16", "qwen3_moe-q4g64-overrides"] {
        let dir = common::fixture(name);
        let g: Golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let want = trace(&load(&dir, BackendKind::Cpu, ExpertMode::Mmap, None), &g.prompt_ids, 4);
        let m = load(&dir, BackendKind::Mlx, ExpertMode::Mmap, None);
        let got = std::thread::spawn(move || trace(&m, &g.prompt_ids, 4))
            .join()
            .unwrap_or_else(|_| panic!("{name}: the forward on another thread failed"));
        assert_close(&format!("{name} prefill"), &got.0, &want.0);
        assert_eq!(got.1, want.1, "{name}: greedy tokens");
    }
}

/// A prompt's chunk whose attention scores would pass the block budget is computed in query blocks (each seeing
/// the keys up to its last row), with the logits of the chunk in one block, in a first chunk and in one after a
/// cached prefix; the memory plan counts the blocks' scores.
#[test]
fn mlx_prompt_attention_in_query_blocks_matches_one_block() {
    use sluice_runtime::backend::mlx::with_score_block_bytes;
    for name in ["qwen3_moe-q4g64", "qwen3_next-q4g64"] {
        let dir = common::fixture(name);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let heads = config["num_attention_heads"].as_u64().unwrap();
        let m = load(&dir, BackendKind::Mlx, ExpertMode::Mmap, None);
        let g: Golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let prompt: Vec<u32> = g.prompt_ids.iter().cycle().take(40).copied().collect();
        // Two chunks: 24 tokens, then 16 after them; all logits of both.
        let run = || {
            let mut cache = m.new_cache();
            let all = ForwardOptions {
                all_logits: true,
                ..Default::default()
            };
            let mut logits = m.forward(&prompt[..24], &mut cache, &all).unwrap();
            logits.extend(m.forward(&prompt[24..], &mut cache, &all).unwrap());
            logits
        };
        let whole = run();
        // 3 query rows a block at 40 keys (fewer keys in the first chunk: more rows, still several blocks).
        let blocked = with_score_block_bytes(3 * heads * 40 * 4, run);
        assert_close(&format!("{name} blocked prompt"), &blocked, &whole);
        let v = m.info.vocab_size;
        for (i, (a, b)) in blocked.chunks(v).zip(whole.chunks(v)).enumerate() {
            assert_eq!(argmax(a), argmax(b), "{name}: position {i}");
        }
        assert_eq!(
            m.memory_plan.attention_scores,
            sluice_runtime::backend::MLX_SCORE_COPIES * sluice_runtime::backend::MLX_SCORE_BLOCK_BYTES
        );
    }
}
