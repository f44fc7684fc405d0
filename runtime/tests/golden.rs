//! Every committed fixture against mlx-lm's own outputs (made by scripts/make_fixtures.py in float32).
//!
//! Tolerance: |ours − mlx| ≤ 1e-3 + 1e-3·|mlx| per logit. Both sides compute in f32 from the same packed
//! codes and scales; the gap is summation order and f64 vs f32 RoPE angles (observed max ≈ 1e-5).
//! Greedy tokens must be identical.

mod common;

use common::fixtures;

use std::path::Path;

use sluice_runtime::golden::Golden;
use sluice_runtime::sampling::argmax;
use sluice_runtime::{load_model, ForwardOptions};

fn golden(dir: &Path) -> Golden {
    Golden::load(dir).unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) -> f32 {
    common::assert_close(what, got, want, ("ours", "mlx-lm"))
}

#[test]
fn prefill_logits_match_mlx_lm() {
    for dir in fixtures() {
        let g = golden(&dir);
        let m = load_model(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let mut cache = m.new_cache();
        let v = m.info.vocab_size;
        let all = m
            .forward(
                &g.prompt_ids,
                &mut cache,
                &ForwardOptions {
                    all_logits: true,
                    ..Default::default()
                },
            )
            .unwrap();
        let mut worst = 0f32;
        for (p, want) in g.logit_positions.iter().zip(&g.logits) {
            worst = worst.max(assert_close(
                &format!("{} pos {p}", dir.display()),
                &all[p * v..(p + 1) * v],
                want,
            ));
        }
        eprintln!(
            "{}: max |Δlogit| {worst:.2e}",
            dir.file_name().unwrap().to_string_lossy()
        );
    }
}

#[test]
fn greedy_decode_matches_mlx_lm_tokens() {
    for dir in fixtures() {
        let g = golden(&dir);
        let m = load_model(&dir).unwrap();
        let mut cache = m.new_cache();
        let opts = ForwardOptions::default();
        let mut logits = m.forward(&g.prompt_ids, &mut cache, &opts).unwrap();
        let mut out = Vec::new();
        for _ in 0..g.greedy.len() {
            let t = argmax(&logits);
            out.push(t);
            logits = m.forward(&[t], &mut cache, &opts).unwrap();
        }
        assert_eq!(out, g.greedy, "{}", dir.display());
    }
}

#[test]
fn reduced_top_k_matches_mlx_lm_with_one_expert() {
    for dir in fixtures() {
        let g = golden(&dir);
        let m = load_model(&dir).unwrap();
        let mut cache = m.new_cache();
        let got = m
            .forward(
                &g.prompt_ids,
                &mut cache,
                &ForwardOptions {
                    top_k: Some(1),
                    all_logits: false,
                },
            )
            .unwrap();
        assert_close(&format!("{} top-1", dir.display()), &got, &g.logits_top1);
    }
}

#[test]
fn decode_step_equals_prefill_position_bit_for_bit() {
    // Token-by-token decode and one batched prefill compute the same numbers in the same order.
    for dir in fixtures() {
        let g = golden(&dir);
        let m = load_model(&dir).unwrap();
        let n = g.prompt_ids.len();
        let mut c1 = m.new_cache();
        let batched = m.forward(&g.prompt_ids, &mut c1, &ForwardOptions::default()).unwrap();
        let mut c2 = m.new_cache();
        let mut last = Vec::new();
        for t in &g.prompt_ids {
            last = m.forward(&[*t], &mut c2, &ForwardOptions::default()).unwrap();
        }
        assert_eq!(c2.len(), n);
        assert_eq!(batched, last, "{}", dir.display());
    }
}

#[test]
fn hybrid_prompts_of_every_length_match_mlx_lm() {
    // One token, a few tokens, and a prompt longer than any chunk (the recurrence runs token by token over
    // the whole prompt; Pipeline prefill chunks of 512 never split these).
    let mut checked = 0;
    for dir in fixtures() {
        let g = golden(&dir);
        if g.extra_prompts.is_empty() {
            continue;
        }
        let m = load_model(&dir).unwrap();
        let v = m.info.vocab_size;
        for p in &g.extra_prompts {
            let what = format!("{} ({} tokens)", dir.display(), p.ids.len());
            let mut cache = m.new_cache();
            let all = m
                .forward(
                    &p.ids,
                    &mut cache,
                    &ForwardOptions {
                        all_logits: true,
                        ..Default::default()
                    },
                )
                .unwrap();
            for (pos, want) in p.logit_positions.iter().zip(&p.logits) {
                assert_close(&format!("{what} pos {pos}"), &all[pos * v..(pos + 1) * v], want);
            }
            let mut logits = all[(p.ids.len() - 1) * v..].to_vec();
            let mut out = Vec::new();
            for _ in 0..p.greedy.len() {
                let t = argmax(&logits);
                out.push(t);
                logits = m.forward(&[t], &mut cache, &ForwardOptions::default()).unwrap();
            }
            assert_eq!(out, p.greedy, "{what}");
            checked += 1;
        }
    }
    assert!(
        checked >= 24,
        "expected 3 prompts on each of the 8 hybrid fixtures, checked {checked}"
    );
}
