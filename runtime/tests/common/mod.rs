//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};

/// Every committed fixture directory (those with a `golden.json`), sorted.
#[allow(dead_code)] // not every test binary uses it
pub fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("fixtures/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("golden.json").exists())
        .collect();
    v.sort();
    assert!(v.len() >= 25, "expected the committed fixtures, found {}", v.len());
    v
}

/// One fixture directory by name.
#[allow(dead_code)] // not every test binary uses it
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

/// Checks `got` against `want` logit by logit within the golden tolerance (1e-3 + 1e-3·|want|; f32 on both
/// sides, the gap is summation order and transcendental functions); names both sides in the failure. Returns
/// the largest difference.
#[allow(dead_code)] // not every test binary uses it
pub fn assert_close(what: &str, got: &[f32], want: &[f32], names: (&str, &str)) -> f32 {
    sluice_runtime::golden::compare_logits(got, want)
        .unwrap_or_else(|e| panic!("{what} ({} vs {}): {e}", names.0, names.1))
}

/// The trained targets: the mixture-of-experts demo models with held-out perplexity goldens (`eval.json`).
#[allow(dead_code)] // not every test binary uses it
pub const TRAINED_TARGETS: [&str; 2] = ["brown-qwen3_moe-q4g64", "brown-qwen3_moe-q8g32"];

/// One row of `eval.json`: mlx-lm's perplexity at one experts-per-token value.
#[derive(serde::Deserialize)]
#[allow(dead_code)] // not every test binary uses it
pub struct EvalRow {
    pub top_k: usize,
    pub perplexity: f64,
}

/// Bigram baselines on the golden's windows.
#[derive(serde::Deserialize)]
#[allow(dead_code)] // not every test binary uses it
pub struct Bigram {
    pub interpolated_eval_windows: f64,
    pub add_one_eval_windows: f64,
}

/// A trained target's `eval.json`: mlx-lm's held-out perplexity over `windows` windows of `ctx` tokens.
#[derive(serde::Deserialize)]
#[allow(dead_code)] // not every test binary uses it
pub struct EvalGolden {
    pub text: String,
    pub ctx: usize,
    pub windows: usize,
    pub rows: Vec<EvalRow>,
    pub bigram: Bigram,
}

#[allow(dead_code)] // not every test binary uses it
impl EvalGolden {
    /// Reads `eval.json` of the fixture directory `dir`.
    pub fn load(dir: &Path) -> Self {
        let path = dir.join("eval.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The golden's windows and experts-per-token values, as `sluice eval` options.
    pub fn options(&self) -> sluice_runtime::eval::EvalOptions {
        sluice_runtime::eval::EvalOptions {
            ctx: self.ctx,
            top_ks: self.rows.iter().map(|r| r.top_k).collect(),
            max_windows: Some(self.windows),
        }
    }

    /// The held-out text, tokenized by `p`'s tokenizer.
    pub fn token_ids(&self, p: &sluice_runtime::Pipeline) -> Vec<u32> {
        let text = std::fs::read_to_string(fixture(&self.text)).unwrap();
        p.tokenize(&sluice_runtime::Prompt::Raw(text)).unwrap()
    }
}
