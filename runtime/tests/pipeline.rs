//! Tokenizer, chat template, streaming text, stop conditions and limits on the committed fixtures.

use std::path::{Path, PathBuf};

use sluice_runtime::{
    ChatMessage, ExpertOptions, FinishReason, GenerateParams, ModelError, Pipeline, Progress, Prompt,
};

#[derive(serde::Deserialize)]
struct Golden {
    prompt: String,
    prompt_ids: Vec<u32>,
    chat: Vec<Msg>,
    chat_ids: Vec<u32>,
    greedy: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct Msg {
    role: String,
    content: String,
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

fn golden(dir: &Path) -> Golden {
    serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap()
}

fn run(p: &Pipeline, prompt: &Prompt, params: &GenerateParams) -> (String, sluice_runtime::GenerationStats) {
    let mut text = String::new();
    let stats = p
        .generate(prompt, params, |t| {
            text.push_str(t);
            true
        })
        .unwrap();
    (text, stats)
}

const FIXTURES: &[&str] = &[
    "qwen3_moe-q4g64",
    "qwen3_moe-q4g64-overrides-vlm-sharded",
    "qwen3_moe_tied-q8g32",
    "mixtral-q8g32",
    "qwen3_5_moe-q4g64",
    "qwen3_5_moe-hf-bf16",
    "qwen3_next-q4g64",
];

#[test]
fn tokenizer_and_chat_template_match_hugging_face() {
    for name in FIXTURES {
        let dir = fixture(name);
        let g = golden(&dir);
        let p = Pipeline::load(&dir).unwrap();
        assert_eq!(
            p.tokenize(&Prompt::Raw(g.prompt.clone())).unwrap(),
            g.prompt_ids,
            "{name}"
        );
        let msgs: Vec<ChatMessage> = g.chat.iter().map(|m| ChatMessage::new(&m.role, &m.content)).collect();
        assert_eq!(p.tokenize(&Prompt::Chat(msgs)).unwrap(), g.chat_ids, "{name}");
    }
}

#[test]
fn generate_reproduces_mlx_lm_greedy_tokens_and_streams_their_text() {
    for name in FIXTURES {
        let dir = fixture(name);
        let g = golden(&dir);
        let p = Pipeline::load(&dir).unwrap();
        let params = GenerateParams {
            max_tokens: g.greedy.len(),
            ignore_eos: true,
            ..Default::default()
        };
        let (text, stats) = run(&p, &Prompt::Raw(g.prompt.clone()), &params);
        assert_eq!(stats.tokens, g.greedy, "{name}");
        assert_eq!(stats.finish, FinishReason::Length);
        assert_eq!(stats.prompt_tokens, g.prompt_ids.len());
        // The streamed chunks add up to the one-shot decode of the same tokens.
        assert_eq!(text, p.codec.decode(&g.greedy).unwrap(), "{name}");
    }
}

#[test]
fn chunked_prefill_gives_the_same_tokens() {
    // Hybrids carry conv and recurrent state across chunk boundaries.
    for name in ["qwen3_moe-q4g64", "qwen3_5_moe-q4g64", "qwen3_next-q4g64"] {
        let dir = fixture(name);
        let g = golden(&dir);
        let p = Pipeline::load(&dir).unwrap();
        for chunk in [1, 2, 5, 37] {
            let params = GenerateParams {
                max_tokens: 8,
                ignore_eos: true,
                prefill_chunk: Some(chunk),
                ..Default::default()
            };
            let (_, stats) = run(&p, &Prompt::Raw(g.prompt.clone()), &params);
            assert_eq!(stats.tokens, g.greedy[..8], "{name}: prefill chunk {chunk}");
        }
    }
}

/// A copy of `name` with its config.json edited by `edit`, loaded; returns the error text.
fn load_error_with(name: &str, edit: impl Fn(&mut serde_json::Value), drop_tensor: Option<&str>) -> String {
    let tmp = copy_of(&fixture(name));
    let path = tmp.path().join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(&path, c.to_string()).unwrap();
    if let Some(t) = drop_tensor {
        // Rename the tensor in the header (same length, so the file stays valid).
        let f = tmp.path().join("model.safetensors");
        let mut bytes = std::fs::read(&f).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
        let renamed = header.replace(t, &"x".repeat(t.len()));
        assert_ne!(header, renamed, "{t} not found");
        bytes[8..8 + n].copy_from_slice(renamed.as_bytes());
        std::fs::write(&f, bytes).unwrap();
    }
    match Pipeline::load(tmp.path()) {
        Ok(_) => panic!("{name}: loaded despite the damage"),
        Err(e) => e.to_string(),
    }
}

/// A corrupt size is refused before anything is sized from it (it used to overflow a product, or abort on an
/// allocation too large to make); a hybrid model's shared expert cannot be dropped for want of its size.
#[test]
fn corrupt_or_missing_sizes_are_clear_errors() {
    for (field, value) in [
        ("vocab_size", 1u64 << 62),
        ("head_dim", 1 << 62),
        ("hidden_size", 1 << 40),
    ] {
        let e = load_error_with("qwen3_moe-q4g64", |c| c[field] = value.into(), None);
        assert!(e.contains(&format!("{field} {value} is more than")), "{e}");
    }
    let e = load_error_with(
        "qwen3_next-q4g64",
        |c| {
            c.as_object_mut().unwrap().remove("shared_expert_intermediate_size");
        },
        None,
    );
    assert!(e.contains("missing field `shared_expert_intermediate_size`"), "{e}");
    let e = load_error_with(
        "qwen3_next-q4g64",
        |c| c["shared_expert_intermediate_size"] = serde_json::Value::Null,
        None,
    );
    assert!(e.contains("missing field `shared_expert_intermediate_size`"), "{e}");
    // Found by `mutations.rs`: both loaded and ran. A negative epsilon gives NaN on quiet inputs; a zero shared
    // expert size skipped the checkpoint's shared expert, and the model answered wrong.
    let e = load_error_with("qwen3_moe-q4g64", |c| c["rms_norm_eps"] = (-1).into(), None);
    assert!(e.contains("rms_norm_eps -1 must be a finite number ≥ 0"), "{e}");
    let e = load_error_with(
        "qwen3_next-q4g64",
        |c| c["shared_expert_intermediate_size"] = 0.into(),
        None,
    );
    assert!(
        e.contains("has a shared expert at `model.layers.0.mlp.shared_expert`"),
        "{e}"
    );
    // A zero expert width made zero-length expert reads (a division by zero when streamed in place).
    let e = load_error_with("qwen3_moe-q4g64", |c| c["moe_intermediate_size"] = 0.into(), None);
    assert!(
        e.contains("layer 0's experts' intermediate size must be non-zero"),
        "{e}"
    );
}

/// A prompt token's routes hold their experts' inputs and outputs: the plan sizes them for the experts per
/// token asked for (`--top-k`), up to all of them, not for the model's own.
#[test]
fn the_plan_sizes_a_pass_for_the_experts_per_token_asked_for() {
    let dir = fixture("qwen3_moe-q4g64");
    let per_token = |top_k| {
        let opts = ExpertOptions {
            top_k,
            ..Default::default()
        };
        let p = Pipeline::load_with(&dir, &opts).unwrap();
        p.model.memory_plan.model.activation_bytes_per_token
    };
    // hidden 128, expert width 64: a route holds 2 × 128 + 2 × 64 floats.
    let route = (2 * 128 + 2 * 64) * 4;
    let own = per_token(None);
    assert_eq!(per_token(Some(3)), own, "3 is the model's own");
    assert_eq!(per_token(Some(6)), own + 3 * route);
    assert_eq!(per_token(Some(100)), own + 5 * route, "8 experts at most");
}

#[test]
fn broken_hybrid_checkpoints_are_clear_errors() {
    let e = load_error_with(
        "qwen3_5_moe-q4g64",
        |c| c["text_config"]["layer_types"] = serde_json::json!(["linear_attention", "full_attention"]),
        None,
    );
    assert!(e.contains("layer_types") && e.contains("config.json"), "{e}");
    let e = load_error_with(
        "qwen3_next-q4g64",
        |c| c["linear_num_value_heads"] = serde_json::json!(3),
        None,
    );
    assert!(e.contains("linear_num_value_heads"), "{e}");
    let e = load_error_with(
        "qwen3_next-q4g64",
        |c| c["partial_rotary_factor"] = serde_json::json!(0.0),
        None,
    );
    assert!(e.contains("partial_rotary_factor"), "{e}");
    // Shapes disagreeing with the config name the tensor.
    let e = load_error_with(
        "qwen3_next-q4g64",
        |c| c["linear_key_head_dim"] = serde_json::json!(16),
        None,
    );
    assert!(e.contains("linear_attn"), "{e}");
    let e = load_error_with("qwen3_5_moe-q4g64", |_| {}, Some("layers.1.linear_attn.conv1d.weight"));
    assert!(e.contains("layers.1.linear_attn.conv1d.weight"), "{e}");
    // A shared expert's gate left out would add the expert unscaled: an error naming it.
    let e = load_error_with(
        "qwen3_next-bf16",
        |_| {},
        Some("layers.0.mlp.shared_expert_gate.weight"),
    );
    assert!(e.contains("shared_expert_gate"), "{e}");
}

/// A copy of a one-file fixture without its shard index, so that every `*.safetensors` added is read.
fn copy_of(src: &std::path::Path) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "model.safetensors.index.json" {
            std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
        }
    }
    d
}

/// Hugging Face's Qwen3.5 keeps its multi-token-prediction head's experts one by one beside a decoder whose
/// experts are stacked: the head is not read, so it must not make the checkpoint look unsupported.
#[test]
fn a_per_expert_mtp_head_beside_stacked_experts_loads() {
    let src = fixture("qwen3_5_moe-hf-bf16");
    let d = copy_of(&src);
    let bytes = vec![0u8; 2 * 4 * 2];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![2, 4], &bytes).unwrap();
    let name = "mtp.layers.0.mlp.experts.0.gate_proj.weight";
    safetensors::serialize_to_file([(name, view.clone())], None, &d.path().join("mtp.safetensors")).unwrap();
    let g = golden(&src);
    let opts = sluice_runtime::ForwardOptions::default();
    let base = sluice_runtime::load_model(&src).unwrap();
    let want = base.forward(&g.prompt_ids, &mut base.new_cache(), &opts).unwrap();
    let with_mtp = sluice_runtime::load_model(d.path()).unwrap();
    let got = with_mtp
        .forward(&g.prompt_ids, &mut with_mtp.new_cache(), &opts)
        .unwrap();
    assert_eq!(got, want);
    // Nor is it planned for: the resident weights are the text model's.
    let resident = |m: &sluice_runtime::DecoderModel| m.memory_plan.model.resident_weights;
    assert_eq!(resident(&with_mtp), resident(&base));
    // The same name in the decoder is still a per-expert layout, and refused.
    let d = copy_of(&src);
    let name = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight";
    safetensors::serialize_to_file([(name, view)], None, &d.path().join("extra.safetensors")).unwrap();
    let e = sluice_runtime::load_model(d.path()).err().unwrap().to_string();
    assert!(e.contains("per-expert"), "{e}");
    // ... unless the architecture is one sluice does not run: that is named first (converting would not help).
    let cpath = d.path().join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
    c["model_type"] = "deepseek_v3".into();
    if let Some(t) = c.get_mut("text_config") {
        t["model_type"] = "deepseek_v3".into();
    }
    std::fs::write(&cpath, c.to_string()).unwrap();
    let e = sluice_runtime::load_model(d.path()).err().unwrap().to_string();
    assert!(e.contains("deepseek_v3") && !e.contains("per-expert"), "{e}");
}

#[test]
fn linear_biases_in_the_checkpoint_are_applied() {
    // Add `lm_head.bias` (one-hot 5.0 at token 7) as an extra shard: that logit moves by 5, no other does.
    let src = fixture("qwen3_moe-q4g64");
    let d = copy_of(&src);
    let vocab = 384;
    let mut bias = vec![0f32; vocab];
    bias[7] = 5.0;
    let bytes: Vec<u8> = bias.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![vocab], &bytes).unwrap();
    safetensors::serialize_to_file([("lm_head.bias", view)], None, &d.path().join("extra.safetensors")).unwrap();
    let g = golden(&src);
    let opts = sluice_runtime::ForwardOptions::default();
    let base = sluice_runtime::load_model(&src).unwrap();
    let want = base.forward(&g.prompt_ids, &mut base.new_cache(), &opts).unwrap();
    let biased = sluice_runtime::load_model(d.path()).unwrap();
    let got = biased.forward(&g.prompt_ids, &mut biased.new_cache(), &opts).unwrap();
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        if i == 7 {
            assert!((a - b - 5.0).abs() < 1e-5, "{a} vs {b}");
        } else {
            assert_eq!(a, b, "logit {i}");
        }
    }
}

#[test]
fn streamed_multibyte_text_is_never_split_mid_character() {
    let p = Pipeline::load(&fixture("qwen3_moe-q4g64")).unwrap();
    let text = "Café crème 日本語のテキスト 🚀🦊✨ naïve";
    let ids = p.codec.encode(text, false).unwrap();
    let mut dec = sluice_runtime::text::StreamDecoder::new();
    let mut out = String::new();
    let mut held_back = 0;
    for id in ids {
        let chunk = dec.push(&p.codec, id).unwrap();
        assert!(
            !chunk.contains('\u{FFFD}'),
            "chunk {chunk:?} carries a broken character"
        );
        held_back += usize::from(chunk.is_empty());
        out.push_str(&chunk);
    }
    out.push_str(&dec.finish(&p.codec).unwrap());
    assert_eq!(out, text);
    assert!(
        held_back > 0,
        "this text should need at least one token held back (multi-token characters)"
    );
}

#[test]
fn stops_at_eos_without_printing_it() {
    // mlx-lm's greedy continuation of this fixture emits token 2 (<|im_end|>, the EOS) at step 6.
    let dir = fixture("qwen3_moe-mixed36");
    let g = golden(&dir);
    let at = g
        .greedy
        .iter()
        .position(|&t| t == 2)
        .expect("the committed golden contains EOS");
    let p = Pipeline::load(&dir).unwrap();
    let (text, stats) = run(
        &p,
        &Prompt::Raw(g.prompt.clone()),
        &GenerateParams {
            max_tokens: 32,
            ..Default::default()
        },
    );
    assert_eq!(stats.finish, FinishReason::Stop);
    assert_eq!(stats.tokens, g.greedy[..=at]);
    assert_eq!(text, p.codec.decode(&g.greedy[..at]).unwrap());
}

#[test]
fn stops_at_a_stop_string_and_drops_it() {
    let dir = fixture("mixtral-q8g32");
    let g = golden(&dir);
    let p = Pipeline::load(&dir).unwrap();
    let full = p.codec.decode(&g.greedy).unwrap();
    let chars: Vec<char> = full.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = full.find(&stop).unwrap();
    let params = GenerateParams {
        max_tokens: 32,
        ignore_eos: true,
        stop: vec![stop.clone()],
        ..Default::default()
    };
    let (text, stats) = run(&p, &Prompt::Raw(g.prompt.clone()), &params);
    assert_eq!(stats.finish, FinishReason::Stop);
    assert_eq!(text, full[..cut], "stop {stop:?}");
}

#[test]
fn cancellation_stops_at_the_next_token() {
    let p = Pipeline::load(&fixture("qwen3_moe-q4g64")).unwrap();
    let mut calls = 0;
    let stats = p
        .generate(
            &Prompt::Raw("hello".into()),
            &GenerateParams {
                max_tokens: 50,
                ignore_eos: true,
                ..Default::default()
            },
            |_| {
                calls += 1;
                false
            },
        )
        .unwrap();
    assert_eq!(stats.finish, FinishReason::Cancelled);
    assert_eq!(calls, 1);
    assert!(stats.generated_tokens < 50);
}

/// A long prompt's prefill stops at the next chunk once the receiver cancels, before any token is sampled.
#[test]
fn cancellation_stops_a_prefill_between_its_chunks() {
    let p = Pipeline::load(&fixture("qwen3_moe-q4g64")).unwrap();
    let mut calls = 0;
    let stats = p
        .generate_tokens(
            &(1..=40).collect::<Vec<u32>>(),
            false,
            &GenerateParams {
                max_tokens: 5,
                prefill_chunk: Some(8),
                ..Default::default()
            },
            |progress| {
                calls += 1;
                assert_eq!(progress, Progress::Prefill, "no token before the prompt is read");
                false
            },
        )
        .unwrap();
    assert_eq!(stats.finish, FinishReason::Cancelled);
    assert_eq!((calls, stats.generated_tokens), (1, 0));
    assert_eq!(stats.prompt_tokens, 40);
}

#[test]
fn prompt_longer_than_the_context_is_a_clear_error_and_context_end_finishes() {
    let dir = fixture("qwen3_moe-q4g64");
    let g = golden(&dir);
    let p = Pipeline::load(&dir).unwrap();
    let params = GenerateParams {
        context_limit: Some(10),
        ..Default::default()
    };
    let e = p
        .generate(&Prompt::Raw(g.prompt.clone()), &params, |_| true)
        .unwrap_err();
    assert!(matches!(e, ModelError::Limit(_)), "{e}");
    assert!(
        e.to_string().contains("38 tokens") && e.to_string().contains("context limit is 10"),
        "{e}"
    );

    let params = GenerateParams {
        context_limit: Some(40),
        max_tokens: 100,
        ignore_eos: true,
        ..Default::default()
    };
    let (_, stats) = run(&p, &Prompt::Raw(g.prompt.clone()), &params);
    assert_eq!(stats.finish, FinishReason::Length);
    assert_eq!(
        stats.tokens,
        g.greedy[..3],
        "two decode steps fill 40 positions; the third token is sampled last"
    );
}

#[test]
fn the_context_limit_is_the_one_the_kv_budget_is_planned_for() {
    let dir = fixture("qwen3_moe-q4g64");
    let g = golden(&dir);
    // With no limit asked for, the plan's: the model's own context (512 here), at most 32768 tokens.
    let p = Pipeline::load(&dir).unwrap();
    assert_eq!((p.model.context_limit(), p.model.memory_plan.kv_tokens), (512, 512));
    // A plan for 20 tokens refuses a longer prompt without any limit in the request (a request may otherwise
    // grow the KV cache past its budget, into the room planned for the experts).
    let opts = ExpertOptions {
        context: Some(20),
        ..Default::default()
    };
    let p = Pipeline::load_with(&dir, &opts).unwrap();
    assert_eq!(p.model.context_limit(), 20);
    let e = p
        .generate(&Prompt::Raw(g.prompt.clone()), &GenerateParams::default(), |_| true)
        .unwrap_err();
    assert!(matches!(e, ModelError::Limit(_)), "{e}");
    assert!(e.to_string().contains("context limit is 20"), "{e}");
    // And a plan for 40 ends a generation at 40 positions, as an explicit limit of 40 does.
    let opts = ExpertOptions {
        context: Some(40),
        ..Default::default()
    };
    let p = Pipeline::load_with(&dir, &opts).unwrap();
    let params = GenerateParams {
        max_tokens: 100,
        ignore_eos: true,
        ..Default::default()
    };
    let (_, stats) = run(&p, &Prompt::Raw(g.prompt.clone()), &params);
    assert_eq!(stats.finish, FinishReason::Length);
    assert_eq!(stats.tokens, g.greedy[..3]);
}

#[test]
fn expert_top_k_out_of_range_and_empty_prompt_are_errors() {
    let p = Pipeline::load(&fixture("mixtral-q4g64")).unwrap();
    for k in [0, 5] {
        let params = GenerateParams {
            expert_top_k: Some(k),
            ..Default::default()
        };
        let e = p
            .generate(&Prompt::Raw("hi".into()), &params, |_| true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("top-k") && e.contains("4 experts"), "{e}");
    }
    let e = p
        .generate(&Prompt::Tokens(vec![]), &GenerateParams::default(), |_| true)
        .unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    let e = p
        .generate(&Prompt::Tokens(vec![9999]), &GenerateParams::default(), |_| true)
        .unwrap_err();
    assert!(matches!(e, ModelError::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
}

/// Found by `mutations.rs`: a BPE tokenizer whose `continuing_subword_prefix` its merges do not carry made the
/// tokenizers library panic while building it (slicing a token mid-character). Loading fails with an error
/// naming the file instead.
#[test]
fn a_tokenizer_the_library_panics_on_is_a_clear_error() {
    let tmp = copy_of(&fixture("qwen3_5_moe-q4g64"));
    let path = tmp.path().join("tokenizer.json");
    let mut t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    t["model"]["continuing_subword_prefix"] = "x".into();
    std::fs::write(&path, t.to_string()).unwrap();
    let e = match Pipeline::load(tmp.path()) {
        Ok(_) => panic!("loaded a tokenizer its library cannot build"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("tokenizer.json") && e.contains("the tokenizers library could not build it"),
        "{e}"
    );
}
