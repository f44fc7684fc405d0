//! The sampler's time per token on a real vocabulary, beside the floor of one pass over the logits.
//!
//! `cargo bench -p sluice-runtime --bench sampling` (add `-- --quick` for a shorter run). The vocabulary is
//! Qwen3's (151,936 tokens) with logits spread like a language model's (a few likely tokens, a long tail). Rows:
//! greedy; OpenAI's defaults (temperature 1, no filter, what a chat request without sampling fields gets);
//! Qwen3's recommended settings (temperature 0.7, top-p 0.8, top-k 20; and 0.6 / 0.95 / 20); top-p alone;
//! min-p alone; and Qwen3's settings on a confident step (one token far ahead). The floor is one copy of the logits, which any sampler that edits them pays.

use std::hint::black_box;
use std::time::{Duration, Instant};

use sluice_runtime::sampling::{Sampler, SamplingParams};

const VOCAB: usize = 151_936;

/// Median time of `f` over runs filling `budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> Duration {
    let mut times = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || times.len() < 5 {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 300 } else { 1500 });
    // A deterministic spread: a Gumbel-like tail from a simple generator, a handful of tokens well above it.
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut logits: Vec<f32> = (0..VOCAB).map(|_| -(-(next().max(1e-7)).ln()).ln() * 1.5).collect();
    for i in 0..8 {
        logits[i * 977] += 12.0 - i as f32;
    }
    let floor = time(budget, || {
        black_box(black_box(&logits).to_vec());
    });
    println!(
        "vocabulary {VOCAB}   one copy of the logits (the floor): {:.1} µs",
        floor.as_secs_f64() * 1e6
    );
    let rows: [(&str, f32, f32, usize, f32); 6] = [
        ("greedy", 0.0, 1.0, 0, 0.0),
        ("temperature 1, no filter", 1.0, 1.0, 0, 0.0),
        ("0.7, top-p 0.8, top-k 20", 0.7, 0.8, 20, 0.0),
        ("0.6, top-p 0.95, top-k 20", 0.6, 0.95, 20, 0.0),
        ("1.0, top-p 0.95", 1.0, 0.95, 0, 0.0),
        ("1.0, min-p 0.05", 1.0, 1.0, 0, 0.05),
    ];
    // A confident step: one token far above the rest, so the 20th best weighs ~10⁻²⁰ of it.
    let mut confident = logits.clone();
    confident[4242] += 40.0;
    let confident_rows = [("confident, 0.7 / 0.8 / 20", 0.7, 0.8, 20, 0.0)];
    let all = rows
        .iter()
        .map(|r| (r, &logits))
        .chain(confident_rows.iter().map(|r| (r, &confident)));
    for (&(name, temperature, top_p, top_k, min_p), logits) in all {
        let mut sampler = Sampler::new(SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed: Some(1),
            ..SamplingParams::default()
        })
        .expect("valid sampling params");
        let t = time(budget, || {
            black_box(sampler.sample(black_box(logits), &[], &[]));
        });
        println!(
            "{name:<28} {:>9.1} µs per token   {:>6.1}× the floor",
            t.as_secs_f64() * 1e6,
            t.as_secs_f64() / floor.as_secs_f64()
        );
    }
}
