//! Cache checkpoints (what speculative decoding will roll back with): a snapshot taken after any position and
//! restored later reproduces the following logits bit for bit, on hybrid models whose recurrent state cannot
//! be truncated, with resident and with streamed experts.

mod common;

use common::fixtures;

use sluice_runtime::sampling::argmax;
use sluice_runtime::{load_model, load_model_with, DecoderModel, ExpertMode, ExpertOptions, ForwardOptions, KvCache};

#[derive(serde::Deserialize)]
struct Golden {
    prompt_ids: Vec<u32>,
}

fn prompt(dir: &std::path::Path) -> Vec<u32> {
    let g: Golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    g.prompt_ids
}

fn step(m: &DecoderModel, cache: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
    m.forward(tokens, cache, &ForwardOptions::default()).unwrap()
}

fn hybrid_fixtures() -> Vec<std::path::PathBuf> {
    let v: Vec<_> = fixtures()
        .into_iter()
        .filter(|d| {
            d.file_name().unwrap().to_string_lossy().starts_with("qwen3_5_moe") || d.ends_with("qwen3_next-q4g64")
        })
        .collect();
    assert!(v.len() >= 6, "hybrid fixtures missing: {v:?}");
    v
}

/// Decodes `steps` greedy tokens after a prompt split in two (so one checkpoint sits mid-prompt), keeping a
/// checkpoint and the logits after every position; then restores each checkpoint in a scrambled order, first
/// wanders off with other tokens, restores again and re-decodes: every logit must be identical.
fn check_model(m: &DecoderModel, prompt: &[u32], what: &str, hybrid: bool) {
    let steps = 8;
    let split = prompt.len() / 2;
    let mut cache = m.new_cache();
    let mut checkpoints = Vec::new();
    step(m, &mut cache, &prompt[..split]);
    checkpoints.push(cache.checkpoint());
    let mut logits = vec![step(m, &mut cache, &prompt[split..])];
    checkpoints.push(cache.checkpoint());
    let mut tokens = Vec::new();
    for _ in 0..steps {
        let t = argmax(logits.last().unwrap());
        tokens.push(t);
        logits.push(step(m, &mut cache, &[t]));
        checkpoints.push(cache.checkpoint());
    }
    assert_eq!(
        checkpoints[1].bytes() > 0,
        hybrid,
        "{what}: recurrent state saved iff hybrid"
    );
    // A checkpoint from the future is refused, and a refused restore leaves the cache alone.
    let mut fresh = m.new_cache();
    assert!(fresh.restore(&checkpoints[3]).is_err());
    assert_eq!(fresh.len(), 0);
    for &i in &[5usize, 1, 9, 0, 3, 9] {
        let cp = &checkpoints[i];
        cache.restore(cp).unwrap();
        assert_eq!(cache.len(), cp.len());
        // Wander off: other tokens change every state...
        step(m, &mut cache, &[(tokens[0] + 1) % 7, 3, 4]);
        // ...and the restore must undo all of it: everything after the checkpoint comes out the same.
        cache.restore(cp).unwrap();
        if i == 0 {
            let got = step(m, &mut cache, &prompt[split..]);
            assert_eq!(got, logits[0], "{what}: re-prefill after restoring mid-prompt");
        }
        let first = i.saturating_sub(1); // tokens[first..] follow checkpoint i
        for (j, &t) in tokens.iter().enumerate().skip(first) {
            let got = step(m, &mut cache, &[t]);
            assert_eq!(got, logits[j + 1], "{what}: token {j} after restoring checkpoint {i}");
        }
    }
    // Speculative verify: k drafted tokens in one batched pass, then a rollback to before them and the same
    // tokens one by one give the same logits row for row.
    cache.restore(&checkpoints[1]).unwrap();
    let v = m.info.vocab_size;
    let batched = m
        .forward(
            &tokens[..4],
            &mut cache,
            &ForwardOptions {
                all_logits: true,
                ..Default::default()
            },
        )
        .unwrap();
    cache.restore(&checkpoints[1]).unwrap();
    for (j, &t) in tokens[..4].iter().enumerate() {
        assert_eq!(
            step(m, &mut cache, &[t]),
            batched[j * v..(j + 1) * v],
            "{what}: verify row {j}"
        );
    }
}

#[test]
fn restored_checkpoints_reproduce_logits_bit_for_bit() {
    for dir in hybrid_fixtures() {
        let m = load_model(&dir).unwrap();
        check_model(&m, &prompt(&dir), &dir.display().to_string(), true);
    }
    // A plain attention model rolls back the same way (KV truncation only).
    let dir = common::fixture("qwen3_moe-q4g64");
    check_model(&load_model(&dir).unwrap(), &prompt(&dir), "qwen3_moe-q4g64", false);
}

#[test]
fn checkpoints_work_with_streamed_experts() {
    for name in ["qwen3_5_moe-q4g64", "qwen3_5_moe-hf-bf16", "qwen3_next-q4g64"] {
        let dir = common::fixture(name);
        let config = sluice_runtime::config::ModelConfig::load(&dir).unwrap();
        let opts = ExpertOptions {
            mode: ExpertMode::Stream,
            cache_bytes: Some(256 << 10), // a few records: experts are evicted and re-read
            ..Default::default()
        };
        let m = load_model_with(&dir, config, &opts).unwrap();
        assert!(m.expert_slots().is_some(), "{name}: experts should stream");
        check_model(&m, &prompt(&dir), &format!("{name} streamed"), true);
    }
}

#[test]
fn a_checkpoint_from_another_model_is_refused() {
    let a = load_model(&common::fixture("qwen3_next-q4g64")).unwrap(); // 8 layers
    let b = load_model(&common::fixture("qwen3_5_moe-q4g64")).unwrap(); // 4 layers
    let mut ca = a.new_cache();
    step(&a, &mut ca, &[1, 2, 3]);
    let mut cb = b.new_cache();
    step(&b, &mut cb, &[1, 2, 3, 4]);
    let e = cb.restore(&ca.checkpoint()).unwrap_err().to_string();
    assert!(e.contains("does not belong to this cache"), "{e}");
    assert_eq!(cb.len(), 4);
}

/// A checkpoint restores only onto the tokens it was taken after: once a restore to an earlier position and
/// new tokens rewrote them, a later checkpoint of the old branch is refused (it would leave the new tokens'
/// KV under the old branch's recurrent state). A fork shares its origin's prefix, so the origin's earlier
/// checkpoints restore in it.
#[test]
fn a_checkpoint_of_a_rewritten_branch_is_refused() {
    for name in ["qwen3_5_moe-q4g64", "qwen3_moe-q4g64"] {
        let m = load_model(&common::fixture(name)).unwrap();
        let mut cache = m.new_cache();
        step(&m, &mut cache, &[1, 2, 3, 4, 5]);
        let at5 = cache.checkpoint();
        step(&m, &mut cache, &[6]);
        let at6 = cache.checkpoint();
        let mut fork = cache.fork();
        cache.restore(&at5).unwrap();
        step(&m, &mut cache, &[7, 8]);
        let e = cache.restore(&at6).unwrap_err().to_string();
        assert!(e.contains("a branch since rewrote them"), "{name}: {e}");
        assert_eq!(cache.len(), 7, "{name}: a refused restore changes nothing");
        // The same token again is the same branch: allowed, and continues like the original.
        cache.restore(&at5).unwrap();
        step(&m, &mut cache, &[6]);
        cache.restore(&at6).unwrap();
        let want = step(&m, &mut fork, &[9]);
        assert!(step(&m, &mut cache, &[9]) == want, "{name}");
        fork.restore(&at5).unwrap();
        // The same token through fewer experts is another branch: its KV and state differ.
        cache.restore(&at5).unwrap();
        let two = ForwardOptions {
            top_k: Some(2),
            ..Default::default()
        };
        m.forward(&[6], &mut cache, &two).unwrap();
        let e = cache.restore(&at6).unwrap_err().to_string();
        assert!(e.contains("a branch since rewrote them"), "{name}: {e}");
    }
}

/// A forward past the memory plan's context (`--ctx-size`) is refused, as generate and serve refuse it: the KV
/// cache would grow into the room planned for experts.
#[test]
fn a_forward_past_the_planned_context_is_refused() {
    let dir = common::fixture("qwen3_moe-q4g64");
    let opts = ExpertOptions {
        context: Some(8),
        ..ExpertOptions::default()
    };
    let m = load_model_with(&dir, sluice_runtime::config::ModelConfig::load(&dir).unwrap(), &opts).unwrap();
    assert_eq!(m.context_limit(), 8);
    let mut cache = m.new_cache();
    step(&m, &mut cache, &[1, 2, 3, 4, 5, 6]);
    let e = m
        .forward(&[7, 8, 9], &mut cache, &ForwardOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("9 tokens exceed the context limit of 8"), "{e}");
    assert_eq!(cache.len(), 6, "a refused forward changes nothing");
    step(&m, &mut cache, &[7, 8]);
}
