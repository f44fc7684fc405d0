//! mlx-lm's reference outputs for a committed fixture (`golden.json`, written by `scripts/make_fixtures.py`)
//! and the check of a loaded model against them: the golden tests and `sluice selftest` run this one check.
//!
//! Tolerance: |ours − mlx| ≤ 1e-3 + 1e-3·|mlx| per logit (f32 on both sides; the gap is summation order and
//! transcendental functions). Greedy tokens must be identical.

use std::hash::{Hash, Hasher};
use std::path::Path;

use crate::error::{ModelError, Result};
use crate::model::{DecoderModel, ForwardOptions};
use crate::sampling::argmax;

/// Absolute part of the logit tolerance.
pub const ABS_TOL: f32 = 1e-3;
/// Relative part of the logit tolerance.
pub const REL_TOL: f32 = 1e-3;

/// The contents of a fixture's `golden.json`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Golden {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// Prompt positions whose logits are recorded.
    pub logit_positions: Vec<usize>,
    /// mlx-lm's logits at those positions.
    pub logits: Vec<Vec<f32>>,
    /// mlx-lm's greedy continuation of the prompt.
    pub greedy: Vec<u32>,
    /// mlx-lm's last-position logits with one expert per token.
    pub logits_top1: Vec<f32>,
    /// Hybrid fixtures: more prompts (1, 3 and 200 tokens).
    #[serde(default)]
    pub extra_prompts: Vec<ExtraPrompt>,
}

/// One more prompt with its logits and greedy continuation.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ExtraPrompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Positions whose logits are recorded.
    pub logit_positions: Vec<usize>,
    /// mlx-lm's logits there.
    pub logits: Vec<Vec<f32>>,
    /// mlx-lm's greedy continuation.
    pub greedy: Vec<u32>,
}

impl Golden {
    /// Reads `dir/golden.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("golden.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| ModelError::InvalidArgument(format!("{}: {e}", path.display())))
    }
}

/// Compares logits within the tolerance; returns the largest difference, or the first logit outside it.
pub fn compare_logits(got: &[f32], want: &[f32]) -> std::result::Result<f32, String> {
    if got.len() != want.len() {
        return Err(format!("{} logits, expected {}", got.len(), want.len()));
    }
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        // A NaN on either side fails too.
        if err.is_nan() || err > ABS_TOL + REL_TOL * w.abs() {
            return Err(format!("logit {i}: {g} vs {w}"));
        }
        worst = worst.max(err);
    }
    Ok(worst)
}

/// What checking one model against its golden found.
#[derive(Debug, Clone, Default)]
pub struct GoldenReport {
    /// Checks made (logit rows and greedy sequences).
    pub checks: usize,
    /// Largest |Δlogit| among the rows within tolerance.
    pub max_logit_diff: f32,
    /// One line per failed check.
    pub failures: Vec<String>,
    /// A hash of every logit computed, bit for bit (equal for two runs that computed the same numbers).
    pub logits_hash: u64,
}

impl GoldenReport {
    /// No check failed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    fn logits(&mut self, what: &str, got: &[f32], want: &[f32], hasher: &mut impl Hasher) {
        self.checks += 1;
        got.iter().for_each(|x| x.to_bits().hash(hasher));
        match compare_logits(got, want) {
            Ok(d) => self.max_logit_diff = self.max_logit_diff.max(d),
            Err(e) => self.failures.push(format!("{what}: {e} (ours vs mlx-lm)")),
        }
    }

    fn tokens(&mut self, what: &str, got: &[u32], want: &[u32]) {
        self.checks += 1;
        if got != want {
            let at = got.iter().zip(want).take_while(|(a, b)| a == b).count();
            self.failures.push(format!(
                "{what}: greedy tokens differ from mlx-lm's at step {at} (got {:?}, expected {:?})",
                got.get(at),
                want.get(at)
            ));
        }
    }
}

/// Greedy decode of `steps` tokens after `logits` (the prompt's last row) on `cache`.
fn greedy(m: &DecoderModel, cache: &mut crate::KvCache, mut logits: Vec<f32>, steps: usize) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = argmax(&logits);
        out.push(t);
        logits = m.forward(&[t], cache, &ForwardOptions::default())?;
    }
    Ok(out)
}

/// Runs every check of `g` on `m`: prompt logits at the recorded positions, the greedy continuation, the
/// one-expert logits, and each extra prompt's logits and continuation. Errors only when a forward fails.
pub fn check(m: &DecoderModel, g: &Golden) -> Result<GoldenReport> {
    let mut r = GoldenReport::default();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let v = m.info.vocab_size;
    let all_logits = ForwardOptions {
        all_logits: true,
        ..Default::default()
    };
    let prompts = std::iter::once((&g.prompt_ids, &g.logit_positions, &g.logits, &g.greedy)).chain(
        g.extra_prompts
            .iter()
            .map(|p| (&p.ids, &p.logit_positions, &p.logits, &p.greedy)),
    );
    for (i, (ids, positions, logits, want)) in prompts.enumerate() {
        let name = if i == 0 {
            "prompt".to_string()
        } else {
            format!("{}-token prompt", ids.len())
        };
        let mut cache = m.new_cache();
        let all = m.forward(ids, &mut cache, &all_logits)?;
        for (p, want) in positions.iter().zip(logits) {
            let row = all.get(p * v..(p + 1) * v).unwrap_or(&[]);
            r.logits(&format!("{name}, position {p}"), row, want, &mut hasher);
        }
        let last = all[all.len() - v..].to_vec();
        let got = greedy(m, &mut cache, last, want.len())?;
        r.tokens(&name, &got, want);
    }
    let mut cache = m.new_cache();
    let top1 = ForwardOptions {
        top_k: Some(1),
        all_logits: false,
    };
    let got = m.forward(&g.prompt_ids, &mut cache, &top1)?;
    r.logits("prompt with one expert per token", &got, &g.logits_top1, &mut hasher);
    r.logits_hash = hasher.finish();
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tolerance_is_absolute_plus_relative_and_rejects_nan() {
        assert_eq!(
            compare_logits(&[1.0, 100.0], &[1.0005, 100.09]).map(|d| d > 0.08),
            Ok(true)
        );
        assert!(compare_logits(&[1.0], &[1.0021]).is_err());
        assert!(compare_logits(&[f32::NAN], &[0.0]).is_err());
        assert!(compare_logits(&[0.0], &[0.0, 1.0]).is_err());
    }
}
