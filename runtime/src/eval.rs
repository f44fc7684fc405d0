//! The quality half of `--top-k` tuning: perplexity on a text at several experts-per-token values, with the
//! KL divergence and top-1 agreement of each against the model's own k.
//!
//! The text is cut into non-overlapping windows of `ctx` tokens, each run from an empty cache; a window
//! predicts its tokens 1..ctx from 0..ctx-1, and an incomplete tail is dropped. That is `mlx_lm.perplexity`'s
//! rule, so the two tools' numbers on the same text and tokenizer are comparable.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::model::{DecoderModel, ForwardOptions};
use crate::sampling::argmax;

/// Which experts-per-token values to evaluate, and over what.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Tokens per window (each window starts from an empty cache).
    pub ctx: usize,
    /// Experts-per-token values, each evaluated on every window.
    pub top_ks: Vec<usize>,
    /// Evaluate only the first this-many windows.
    pub max_windows: Option<usize>,
}

/// One experts-per-token value's quality on the text.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct QualityRow {
    /// Experts per token.
    pub top_k: usize,
    /// Predicted tokens.
    pub tokens: usize,
    /// exp(mean negative log-likelihood of the next token).
    pub perplexity: f64,
    /// Mean KL(p_own ‖ p_k) in nats per token, p_own at the model's own k.
    pub kl: f64,
    /// Share of positions whose most likely next token equals the one at the model's own k.
    pub top1_agreement: f64,
}

/// Running sums for one k.
#[derive(Default, Clone)]
struct Sums {
    nll: f64,
    kl: f64,
    agree: usize,
    tokens: usize,
}

/// The experts-per-token ladder when the user names none: every k from 1 to the model's own, then doubling
/// up to every expert.
pub fn default_top_ks(own: usize, experts: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (1..=own).collect();
    let mut k = own.max(1) * 2;
    while k < experts {
        v.push(k);
        k *= 2;
    }
    if experts > own {
        v.push(experts);
    }
    v
}

/// Parses `--top-k`: `all` (1..=experts), or a comma-separated list; each value in 1..=experts.
pub fn parse_top_ks(spec: &str, experts: usize) -> Result<Vec<usize>> {
    let bad = |m: String| ModelError::InvalidArgument(format!("--top-k: {m}"));
    if experts == 0 {
        return Err(bad("this model has no routed experts".into()));
    }
    if spec.trim() == "all" {
        return Ok((1..=experts).collect());
    }
    let mut v = Vec::new();
    for part in spec.split(',') {
        let k: usize = part
            .trim()
            .parse()
            .map_err(|_| bad(format!("`{part}` is not a number")))?;
        if k == 0 || k > experts {
            return Err(bad(format!("{k} is outside 1..={experts}")));
        }
        if !v.contains(&k) {
            v.push(k);
        }
    }
    v.sort_unstable();
    Ok(v)
}

/// How many windows `ids` gives at `ctx`, after `max_windows`.
pub fn window_count(tokens: usize, opts: &EvalOptions) -> usize {
    let n = tokens / opts.ctx.max(1);
    opts.max_windows.map_or(n, |m| n.min(m))
}

/// Evaluates every k of `opts.top_ks` on `ids`; `progress(done, total)` is called after each forward.
pub fn evaluate(
    m: &DecoderModel,
    ids: &[u32],
    opts: &EvalOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<QualityRow>> {
    if opts.ctx < 2 {
        return Err(ModelError::InvalidArgument("--ctx must be at least 2".into()));
    }
    if opts.ctx > m.info.context_length {
        return Err(ModelError::InvalidArgument(format!(
            "--ctx {} is longer than the model's context ({})",
            opts.ctx, m.info.context_length
        )));
    }
    if opts.top_ks.is_empty() {
        return Err(ModelError::InvalidArgument(
            "no experts-per-token values to evaluate".into(),
        ));
    }
    let windows = window_count(ids.len(), opts);
    if windows == 0 {
        return Err(ModelError::InvalidArgument(format!(
            "the text has {} tokens, fewer than one window of {}",
            ids.len(),
            opts.ctx
        )));
    }
    let v = m.info.vocab_size;
    // Targets are never fed to the model, so its own check would miss the last token of each window (a
    // tokenizer's added tokens can lie past the embedding).
    crate::model::check_vocabulary(&ids[..windows * opts.ctx], v)?;
    let own = m.info.default_top_k;
    let mut sums = vec![Sums::default(); opts.top_ks.len()];
    let total = windows * (opts.top_ks.len() + 1);
    let mut done = 0;
    for w in 0..windows {
        let window = &ids[w * opts.ctx..(w + 1) * opts.ctx];
        let (inputs, targets) = (&window[..opts.ctx - 1], &window[1..]);
        // Log-probabilities kept in f32 (half the memory of f64 at a 150k vocabulary); both sides take the
        // same path, so the model's own k compares equal bit for bit.
        let mut reference = window_logits(m, inputs, own)?;
        for row in reference.chunks_exact_mut(v) {
            log_softmax(row);
        }
        done += 1;
        progress(done, total);
        for (k, s) in opts.top_ks.iter().zip(&mut sums) {
            let mut lp = window_logits(m, inputs, *k)?;
            for (t, &target) in targets.iter().enumerate() {
                let (row, want) = (&mut lp[t * v..(t + 1) * v], &reference[t * v..(t + 1) * v]);
                log_softmax(row);
                s.nll -= row[target as usize] as f64;
                s.kl += want
                    .iter()
                    .zip(row.iter())
                    // A token the reference gives no mass adds nothing (0·(−∞ − q) would be NaN).
                    .filter(|(&p, _)| p != f32::NEG_INFINITY)
                    .map(|(&p, &q)| (p as f64).exp() * (p as f64 - q as f64))
                    .sum::<f64>();
                s.agree += usize::from(argmax(row) == argmax(want));
                s.tokens += 1;
            }
            done += 1;
            progress(done, total);
        }
    }
    Ok(opts
        .top_ks
        .iter()
        .zip(sums)
        .map(|(&top_k, s)| QualityRow {
            top_k,
            tokens: s.tokens,
            perplexity: (s.nll / s.tokens as f64).exp(),
            // Rounding can leave a tiny negative sum where the two distributions are equal (a NaN stays NaN:
            // `max` would report a broken k as identical to the model's own).
            kl: clamp_rounding(s.kl / s.tokens as f64),
            top1_agreement: s.agree as f64 / s.tokens as f64,
        })
        .collect())
}

/// `x`, or 0 where rounding left it just below; NaN stays NaN.
fn clamp_rounding(x: f64) -> f64 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// All-position logits of one window from an empty cache.
fn window_logits(m: &DecoderModel, inputs: &[u32], top_k: usize) -> Result<Vec<f32>> {
    let mut cache = m.new_cache();
    m.forward(
        inputs,
        &mut cache,
        &ForwardOptions {
            top_k: Some(top_k),
            all_logits: true,
        },
    )
}

/// Log-softmax of one row in place, the normaliser summed in f64 (150k-token vocabularies need it).
fn log_softmax(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    for x in row {
        *x = (*x as f64 - lse) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladder_and_parsing() {
        assert_eq!(default_top_ks(4, 16), vec![1, 2, 3, 4, 8, 16]);
        assert_eq!(default_top_ks(8, 128), vec![1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128]);
        assert_eq!(default_top_ks(2, 2), vec![1, 2]);
        assert_eq!(parse_top_ks("8, 1,2,2", 16).unwrap(), vec![1, 2, 8]);
        assert_eq!(parse_top_ks("all", 3).unwrap(), vec![1, 2, 3]);
        for bad in ["0", "17", "x", "1,,2"] {
            assert!(parse_top_ks(bad, 16).is_err(), "{bad}");
        }
        assert!(parse_top_ks("1", 0).is_err());
    }

    #[test]
    fn a_nan_divergence_is_not_reported_as_none() {
        assert!(clamp_rounding(f64::NAN).is_nan());
        assert_eq!(clamp_rounding(-1e-12), 0.0);
        assert_eq!(clamp_rounding(0.25), 0.25);
    }

    #[test]
    fn log_softmax_is_normalised_and_shift_invariant() {
        let mut a = [1.0, 2.0, 3.0, -1.0, 0.0, 1000.0];
        let mut b = [11.0, 12.0, 13.0];
        for row in a.chunks_mut(3).chain(b.chunks_mut(3)) {
            log_softmax(row);
            let s: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
            assert!((s - 1.0).abs() < 1e-6, "{row:?}");
        }
        for (x, y) in a[..3].iter().zip(&b) {
            assert!((x - y).abs() < 1e-6);
        }
        assert_eq!(argmax(&a[3..]), 2);
    }
}
