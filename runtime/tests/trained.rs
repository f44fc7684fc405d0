//! The trained demo models (scripts/train_demo_models.py) against mlx-lm: the demo's greedy text, and the
//! held-out perplexity at each experts-per-token value (`eval.json`, mlx-lm in float32 over the same windows).
//! The generic checks (logits, greedy ids, chat template, streamed == resident) run on them in golden.rs and
//! the other suites, like on every fixture.

mod common;

use std::path::Path;

use common::{EvalGolden, TRAINED_TARGETS};
use serde::Deserialize;
use sluice_runtime::eval::evaluate;
use sluice_runtime::{GenerateParams, Pipeline, Prompt};

#[derive(Deserialize)]
struct Demo {
    prompt: String,
    greedy: Vec<u32>,
    text: String,
}

#[derive(Deserialize)]
struct DemoGolden {
    demo: Demo,
}

const TRAINED: [&str; 3] = ["brown-qwen3_moe-q4g64", "brown-qwen3_moe-q8g32", "brown-qwen3-q4g64"];

fn read<T: for<'de> Deserialize<'de>>(path: &Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn demo_text_matches_mlx_lm() {
    for name in TRAINED {
        let dir = common::fixture(name);
        let g: DemoGolden = read(&dir.join("golden.json"));
        let p = Pipeline::load(&dir).unwrap();
        let params = GenerateParams {
            max_tokens: g.demo.greedy.len(),
            ignore_eos: true,
            ..GenerateParams::default()
        };
        let mut text = String::new();
        p.generate(&Prompt::Raw(g.demo.prompt.clone()), &params, |t| {
            text.push_str(t);
            true
        })
        .unwrap();
        assert_eq!(text, g.demo.text, "{name}: greedy text after {:?}", g.demo.prompt);
        // Readable English, not bytes: the demo's point.
        let words = text.split_whitespace().filter(|w| w.is_ascii()).count();
        assert!(words >= 20, "{name}: {text:?}");
    }
}

#[test]
fn eval_perplexity_matches_mlx_lm_at_each_top_k() {
    for name in TRAINED_TARGETS {
        let dir = common::fixture(name);
        let g = EvalGolden::load(&dir);
        let p = Pipeline::load(&dir).unwrap();
        let own = p.model.info.default_top_k;
        let rows = evaluate(&p.model, &g.token_ids(&p), &g.options(), |_, _| {}).unwrap();
        for (ours, want) in rows.iter().zip(&g.rows) {
            let rel = (ours.perplexity / want.perplexity - 1.0).abs();
            eprintln!(
                "{name}: k={} perplexity {:.4} (mlx-lm {:.4}, {:.2e}) KL {:.4} agreement {:.3}",
                ours.top_k, ours.perplexity, want.perplexity, rel, ours.kl, ours.top1_agreement
            );
            assert!(
                rel < 1e-3,
                "{name}: k={} perplexity {} vs mlx-lm {}",
                ours.top_k,
                ours.perplexity,
                want.perplexity
            );
            assert_eq!(ours.tokens, g.windows * (g.ctx - 1));
        }
        let at = |k: usize| rows.iter().find(|r| r.top_k == k).unwrap();
        // The model's own k against itself: identical distributions.
        assert_eq!((at(own).kl, at(own).top1_agreement), (0.0, 1.0), "{name}");
        // Fewer experts cost quality: from 1 up to the model's own k, no step raises perplexity by over 1%.
        for k in 1..own {
            assert!(
                at(k + 1).perplexity <= at(k).perplexity * 1.01,
                "{name}: k={} {} > k={k} {}",
                k + 1,
                at(k + 1).perplexity,
                at(k).perplexity
            );
            assert!(at(k).kl > 0.0 && at(k).top1_agreement < 1.0, "{name}: k={k}");
        }
        // Well below token bigram models on the same windows: a quarter of the add-one bigram's perplexity,
        // and 20% under one interpolated with unigrams (its weight tuned on the held-out text itself).
        let own_ppl = at(own).perplexity;
        let b = &g.bigram;
        assert!(
            own_ppl < 0.25 * b.add_one_eval_windows,
            "{name}: {own_ppl} vs {}",
            b.add_one_eval_windows
        );
        assert!(
            own_ppl < 0.8 * b.interpolated_eval_windows,
            "{name}: {own_ppl} vs {}",
            b.interpolated_eval_windows
        );
    }
}

/// A token past the vocabulary where only a target reads it (a window's last token) is an error, not a panic.
#[test]
fn eval_refuses_a_target_outside_the_vocabulary() {
    let p = Pipeline::load(&common::fixture(TRAINED_TARGETS[0])).unwrap();
    let v = p.model.info.vocab_size as u32;
    let opts = sluice_runtime::eval::EvalOptions {
        ctx: 8,
        top_ks: vec![p.model.info.default_top_k],
        max_windows: None,
    };
    let mut ids = vec![1u32; 16];
    assert!(evaluate(&p.model, &ids, &opts, |_, _| {}).is_ok());
    ids[15] = v;
    let err = evaluate(&p.model, &ids, &opts, |_, _| {}).unwrap_err().to_string();
    assert!(
        err.contains(&format!("token id {v} is outside the vocabulary")),
        "{err}"
    );
}
