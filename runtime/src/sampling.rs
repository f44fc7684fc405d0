//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, seeded sampling.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{ModelError, Result};

/// Sampling settings (OpenAI / llama.cpp meanings; `top_k` here is the *sampling* top-k, not experts).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass to keep, in [0, 1] (0: the likeliest token only).
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Drop tokens below `min_p × p(best)`; 0 disables.
    pub min_p: f32,
    /// Multiplicative penalty on tokens seen in the last `repeat_last_n` (1 disables; HF semantics).
    pub repetition_penalty: f32,
    /// Window for the repetition penalty (0: the whole history).
    pub repeat_last_n: usize,
    /// Subtracted per occurrence in the generated text (OpenAI).
    pub frequency_penalty: f32,
    /// Subtracted once for any token in the generated text (OpenAI).
    pub presence_penalty: f32,
    /// RNG seed (random when `None`).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Rejects values outside their meaningful ranges.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidArgument(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!("temperature must be ≥ 0, got {}", self.temperature));
        }
        // 0 keeps only the likeliest token (OpenAI takes 0 to 1).
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad(format!("top_p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad(format!(
                "frequency_penalty must be in [-2, 2], got {}",
                self.frequency_penalty
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad(format!(
                "presence_penalty must be in [-2, 2], got {}",
                self.presence_penalty
            ));
        }
        Ok(())
    }
}

/// A seeded sampler.
///
/// ```
/// use sluice_runtime::sampling::{Sampler, SamplingParams};
/// let logits = [0.1, 2.0, 1.9];
/// let mut greedy = Sampler::new(SamplingParams::default()).unwrap();
/// assert_eq!(greedy.sample(&logits, &[], &[]), 1);
/// // A repetition penalty on token 1 (seen in the prompt) hands the argmax to token 2.
/// let mut p = Sampler::new(SamplingParams { repetition_penalty: 1.2, ..Default::default() }).unwrap();
/// assert_eq!(p.sample(&logits, &[1], &[]), 2);
/// ```
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// The prompt's distinct tokens, sorted, once a whole-history repetition penalty asked for them (the
    /// prompt does not change between steps; sorting a 100k-token one at every step would cost milliseconds).
    prompt_seen: Option<(usize, Vec<u32>)>,
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Ok(Self {
            params,
            rng,
            prompt_seen: None,
        })
    }

    /// Picks the next token from `logits` given the `prompt` and the `generated` tokens so far.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> u32 {
        let mut l = logits.to_vec();
        if self.params.repetition_penalty != 1.0 {
            // Each token once: the prompt's (cached) and the output's others, or those of the window.
            let (from_prompt, rest) = if self.params.repeat_last_n == 0 {
                let cached = self.prompt_seen.take().filter(|(len, _)| *len == prompt.len());
                let seen = cached.unwrap_or_else(|| (prompt.len(), distinct(prompt.iter().copied())));
                let from_prompt = &self.prompt_seen.insert(seen).1;
                let rest = distinct(
                    generated
                        .iter()
                        .copied()
                        .filter(|t| from_prompt.binary_search(t).is_err()),
                );
                (from_prompt.as_slice(), rest)
            } else {
                let all = prompt.iter().chain(generated);
                let skip = (prompt.len() + generated.len()).saturating_sub(self.params.repeat_last_n);
                (&[][..], distinct(all.skip(skip).copied()))
            };
            let penalty = self.params.repetition_penalty;
            for &t in from_prompt.iter().chain(&rest) {
                if let Some(v) = l.get_mut(t as usize) {
                    // Kept finite: a tiny penalty would overflow a logit to ±inf, and inf − inf is NaN below.
                    *v = if *v > 0.0 { *v / penalty } else { *v * penalty }.clamp(f32::MIN, f32::MAX);
                }
            }
        }
        let p = &self.params;
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            let mut counts = std::collections::HashMap::<u32, f32>::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1.0;
            }
            for (t, c) in counts {
                if let Some(v) = l.get_mut(t as usize) {
                    *v -= c * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(&l);
        }
        match support(l, p) {
            Support::All(w) => {
                // Whole blocks are skipped by their sums, so the walk is not one long chain of dependent adds;
                // the total is theirs, so each weight is summed once.
                const BLOCK: usize = 256;
                let sums: Vec<f64> = w.chunks(BLOCK).map(sum).collect();
                let mut r = self.rng.gen::<f64>() * sums.iter().sum::<f64>();
                for (b, (block, &s)) in w.chunks(BLOCK).zip(&sums).enumerate() {
                    if r > s {
                        r -= s;
                        continue;
                    }
                    for (i, x) in block.iter().enumerate() {
                        r -= *x as f64;
                        if r <= 0.0 && *x > 0.0 {
                            return (b * BLOCK + i) as u32;
                        }
                    }
                }
                // Rounding left a sliver of `r`: the last token that could be drawn.
                w.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
            }
            Support::Ranked(kept) => {
                let total: f64 = kept.iter().map(|c| c.1 as f64).sum();
                let mut r = self.rng.gen::<f64>() * total;
                for &(t, x) in &kept {
                    r -= x as f64;
                    if r <= 0.0 {
                        return t;
                    }
                }
                // Rounding left a sliver of `r`: the last kept token that could be drawn.
                kept.iter()
                    .rev()
                    .find(|c| c.1 > 0.0)
                    .or(kept.first())
                    .map_or(0, |c| c.0)
            }
        }
    }
}

/// The tokens a draw picks from, with unnormalized weights.
#[derive(Debug)]
enum Support {
    /// Every token, `w[token]` (no filter asked for).
    All(Vec<f32>),
    /// The tokens the filters keep, most likely first (ties: lower id first).
    Ranked(Vec<(u32, f32)>),
}

/// Temperature first, then the filters (as Hugging Face transformers and vLLM order them): top-k, then top-p
/// of what top-k kept, then min-p. Without a filter nothing is sorted; with one, only the tokens a filter can
/// keep are (sorting a 152k vocabulary every token cost 3.5–4 ms).
fn support(mut w: Vec<f32>, p: &SamplingParams) -> Support {
    // The largest logit comes off before the division: a tiny temperature would otherwise overflow the logits
    // to ±inf and every weight would be NaN (and +inf − +inf is NaN too). NaN logits weigh 0. Then the
    // vectorized softmax: a libm `exp` per token took ~0.3 ms a token on a 152k vocabulary.
    let top = w.iter().copied().fold(f32::MIN, f32::max);
    let top_at = w.iter().position(|&v| v == top);
    for v in w.iter_mut() {
        *v = if *v == top {
            0.0
        } else if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            (*v - top) / p.temperature
        };
    }
    crate::ops::softmax(&mut w);
    // Filters measure against the top token's weight (min-p's floor, the thresholds below).
    let w_top = top_at.map_or(1.0, |i| w[i]);
    let top_k = (p.top_k > 0 && p.top_k < w.len()).then_some(p.top_k);
    if top_k.is_none() && p.top_p >= 1.0 && p.min_p <= 0.0 {
        return Support::All(w);
    }
    // Sums in f64: a 152k vocabulary's f32 sum drifts by ~10⁻⁴, enough to move a top-p edge by hundreds of
    // tail tokens.
    let total_all = sum(&w);
    // The kept tokens are a prefix of the ranking, so they lie among the tokens of weight ≥ t for a t low
    // enough to hold the k best, or min-p's floor, or enough mass for top-p. Falling thresholds (relative to
    // the top weight) are tried with a counting pass each, the first that is enough gathers its tokens, and only
    // they are ranked.
    let enough = |t: f32| {
        let (n, mass) = above(&w, t * w_top);
        match top_k {
            Some(k) => n >= k,
            // A margin for the rounding of the f32 lanes' mass.
            None => (p.min_p > 0.0 && t <= p.min_p) || (p.top_p < 1.0 && mass >= p.top_p as f64 * total_all * 1.001),
        }
    };
    let t = THRESHOLDS.into_iter().find(|&t| t == 0.0 || enough(t)).unwrap_or(0.0) * w_top;
    let mut cand: Vec<(u32, f32)> = (w.iter().enumerate())
        .filter(|&(_, &x)| x >= t)
        .map(|(i, &x)| (i as u32, x))
        .collect();
    let rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    // The k best picked before ranking: a confident step's k-th token can weigh ~10⁻¹⁰ of the top one, and
    // everything above that could be much of the vocabulary.
    if let Some(k) = top_k.filter(|&k| k < cand.len()) {
        cand.select_nth_unstable_by(k - 1, rank);
        cand.truncate(k);
    }
    cand.sort_unstable_by(rank);
    let total = match top_k {
        Some(_) => cand.iter().map(|c| c.1 as f64).sum(),
        None => total_all,
    };
    let mut keep = cand.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, c) in cand.iter().enumerate() {
            acc += c.1 as f64;
            if acc >= p.top_p as f64 * total {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        keep = keep.min(cand.iter().take_while(|c| c.1 >= p.min_p * w_top).count().max(1));
    }
    cand.truncate(keep);
    Support::Ranked(cand)
}

/// How many of `w` are at least `t`, and roughly their sum (in f32 lanes, ~10⁻⁴ off on a 152k vocabulary):
/// lanes the compiler vectorizes.
fn above(w: &[f32], t: f32) -> (usize, f64) {
    const LANES: usize = 16;
    let (mut n, mut m) = ([0u32; LANES], [0f32; LANES]);
    let chunks = w.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let yes = c[l] >= t;
            n[l] += u32::from(yes);
            m[l] += if yes { c[l] } else { 0.0 };
        }
    }
    let tail = rest.iter().filter(|&&x| x >= t);
    let count = n.iter().map(|&x| x as usize).sum::<usize>() + tail.clone().count();
    let mass = m.iter().map(|&x| x as f64).sum::<f64>() + tail.map(|&x| x as f64).sum::<f64>();
    (count, mass)
}

/// The sum of `w` in f64, in lanes the compiler vectorizes.
fn sum(w: &[f32]) -> f64 {
    const LANES: usize = 8;
    let mut m = [0f64; LANES];
    let chunks = w.chunks_exact(LANES);
    let rest = chunks.remainder().iter().map(|&x| x as f64).sum::<f64>();
    for c in chunks {
        for l in 0..LANES {
            m[l] += c[l] as f64;
        }
    }
    m.iter().sum::<f64>() + rest
}

/// Weight floors tried in turn by [`support`]; the last, 0, takes every token.
const THRESHOLDS: [f32; 8] = [1e-1, 1e-2, 1e-3, 1e-4, 1e-6, 1e-9, 1e-15, 0.0];

/// `tokens` sorted, each once.
fn distinct(tokens: impl Iterator<Item = u32>) -> Vec<u32> {
    let mut v: Vec<u32> = tokens.collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Index of the largest value (first on ties; NaN never wins unless all are NaN).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, v) in x.iter().enumerate() {
        if best.is_none_or(|b| *v > x[b]) && !v.is_nan() {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(SamplingParams { seed: Some(7), ..p }).unwrap()
    }

    #[test]
    fn greedy_takes_argmax_and_penalty_can_change_it() {
        let logits = [1.0, 3.0, 2.9];
        assert_eq!(sampler(SamplingParams::default()).sample(&logits, &[], &[]), 1);
        let p = SamplingParams {
            repetition_penalty: 1.5,
            ..Default::default()
        };
        assert_eq!(sampler(p).sample(&logits, &[1], &[]), 2);
        let p = SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        };
        assert_eq!(sampler(p).sample(&logits, &[], &[1]), 2);
    }

    #[test]
    fn a_whole_history_penalty_reaches_the_prompt_start_and_its_cache_changes_nothing() {
        let mut logits = vec![0.0f32; 10];
        (logits[5], logits[6], logits[7]) = (3.0, 2.9, 2.8);
        let prompt: Vec<u32> = std::iter::once(5).chain([1; 99]).collect();
        let with = |repeat_last_n| SamplingParams {
            repetition_penalty: 2.0,
            repeat_last_n,
            ..Default::default()
        };
        // Token 5 is 100 tokens back: outside a 64-token window, inside the whole history.
        assert_eq!(sampler(with(64)).sample(&logits, &prompt, &[]), 5);
        let mut whole = sampler(with(0));
        assert_eq!(whole.sample(&logits, &prompt, &[]), 6);
        // Later steps (the prompt's tokens cached) as a fresh sampler's.
        for generated in [&[6u32][..], &[6, 7], &[6, 7, 6]] {
            let fresh = sampler(with(0)).sample(&logits, &prompt, generated);
            assert_eq!(whole.sample(&logits, &prompt, generated), fresh, "{generated:?}");
        }
        // 5, 6 and 7 all halved: 5 leads again.
        assert_eq!(whole.sample(&logits, &prompt, &[6, 7]), 5);
    }

    #[test]
    fn greedy_never_picks_a_nan() {
        let greedy = |l: &[f32]| sampler(SamplingParams::default()).sample(l, &[], &[]);
        assert_eq!(greedy(&[f32::NAN, 0.0, 1.0]), 2);
        assert_eq!(greedy(&[1.0, f32::NAN, 3.0, 3.0]), 2);
        assert_eq!(greedy(&[f32::NAN, f32::NEG_INFINITY]), 1);
        assert_eq!(greedy(&[f32::NAN, f32::NAN]), 0);
    }

    #[test]
    fn a_bad_penalty_is_named() {
        for (p, field) in [
            (
                SamplingParams {
                    presence_penalty: 3.0,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..Default::default()
                },
                "frequency_penalty",
            ),
        ] {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains(&format!("{field} must be in [-2, 2]")), "{e}");
        }
    }

    #[test]
    fn filters_restrict_the_support() {
        let logits = [0.0, 1.0, 2.0, 3.0];
        for _ in 0..50 {
            let t = sampler(SamplingParams {
                temperature: 1.0,
                top_k: 2,
                ..Default::default()
            })
            .sample(&logits, &[], &[]);
            assert!(t == 2 || t == 3);
        }
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits, &[], &[]) == 3));
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            min_p: 0.9,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits, &[], &[]) == 3));
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25 / 0.75
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = sampler(p.clone());
            (0..100).map(|_| s.sample(&logits, &[], &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = sampler(p.clone());
            (0..100).map(|_| s.sample(&logits, &[], &[])).collect()
        };
        assert_eq!(a, b);
        let mut s = sampler(p);
        let ones = (0..4000).filter(|_| s.sample(&logits, &[], &[]) == 1).count();
        assert!((2800..3200).contains(&ones), "{ones}");
    }

    #[test]
    fn extreme_temperatures_and_penalties_still_draw_from_the_distribution() {
        let logits = [0.5f32, 2.0, 1.9, -1.0];
        // So small a temperature overflows the logits divided by it: in effect greedy, not the least likely token.
        let mut s = sampler(SamplingParams {
            temperature: 1e-40,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits, &[], &[]) == 1));
        // So small a penalty overflows a seen token's positive logit: that token wins, instead of NaN everywhere.
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            repetition_penalty: 1e-45,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits, &[0, 3], &[]) == 0));
    }

    /// The filters computed the slow, plain way, in f64: the whole vocabulary ranked (by scaled logit, ties
    /// by id), then top-k, top-p and min-p; the kept tokens, most likely first, with their weights.
    fn reference_support(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
        let top = logits.iter().copied().fold(f32::MIN, f32::max);
        let mut cand: Vec<(u32, f32)> = (logits.iter().enumerate())
            .map(|(i, &v)| (i as u32, (v - top) / p.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let w: Vec<f64> = cand.iter().map(|&(_, v)| (v as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut keep = w.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, x) in w.iter().enumerate() {
                acc += x;
                if acc >= p.top_p as f64 * total {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            keep = keep.min(w.iter().take_while(|&&x| x >= p.min_p as f64 * w[0]).count().max(1));
        }
        (0..keep).map(|i| (cand[i].0, w[i])).collect()
    }

    #[test]
    fn filters_keep_what_ranking_the_whole_vocabulary_keeps() {
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(11);
        let (mut cases, mut edges) = (0, 0);
        for vocab in [1usize, 2, 5, 64, 1000, 20_000] {
            for round in 0..12 {
                // Spread logits, and some with ties (integers), so ranks tie at the filters' edges.
                let logits: Vec<f32> = (0..vocab)
                    .map(|_| match round % 3 {
                        0 => rng.gen_range(-8.0f32..8.0),
                        1 => rng.gen_range(-4i32..4) as f32,
                        _ => rng.gen_range(-30.0f32..2.0),
                    })
                    .collect();
                for (temperature, top_k, top_p, min_p) in [
                    (1.0, 0, 1.0, 0.0),
                    (0.7, 40, 1.0, 0.0),
                    (1.0, 0, 0.9, 0.0),
                    (1.3, 0, 0.999, 0.0),
                    (1.0, 0, 1.0, 0.05),
                    (1.0, 0, 1.0, 1e-12),
                    (0.6, 20, 0.95, 0.0),
                    (1.0, 50, 0.8, 0.1),
                    (2.0, 0, 0.5, 0.01),
                    (1.0, vocab, 0.3, 0.0),
                    (1.0, 1, 1.0, 0.0),
                ] {
                    let p = SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        ..Default::default()
                    };
                    let want = reference_support(&logits, &p);
                    let (got, ranked): (Vec<(u32, f32)>, bool) = match support(logits.clone(), &p) {
                        Support::All(w) => (w.into_iter().enumerate().map(|(i, x)| (i as u32, x)).collect(), false),
                        Support::Ranked(r) => (r, true),
                    };
                    let at = format!("vocab {vocab} round {round} {p:?}");
                    // The same tokens (in the same ranking, when ranked). The weights differ in rounding (exp
                    // in f32 or f64), so at a top-p edge whose mass before it is within 10⁻⁶ of top-p the two
                    // may keep one token more or less.
                    let n = got.len().min(want.len());
                    if got.len() != want.len() {
                        let total: f64 = reference_support(
                            &logits,
                            &SamplingParams {
                                top_p: 1.0,
                                min_p: 0.0,
                                ..p.clone()
                            },
                        )
                        .iter()
                        .map(|c| c.1)
                        .sum();
                        let before: f64 = want[..n].iter().map(|c| c.1).sum::<f64>() / total;
                        assert!(
                            p.top_p < 1.0
                                && got.len().abs_diff(want.len()) == 1
                                && (before - p.top_p as f64).abs() < 1e-6,
                            "kept {} tokens, the reference {}: {at}",
                            got.len(),
                            want.len()
                        );
                        edges += 1;
                    }
                    // Each as probabilities within the tokens both keep.
                    let norm = |v: Vec<(u32, f64)>| {
                        let t: f64 = v.iter().map(|c| c.1).sum();
                        v.into_iter().map(|(i, x)| (i, x / t)).collect::<Vec<_>>()
                    };
                    let mut g = norm(got[..n].iter().map(|&(i, x)| (i, x as f64)).collect());
                    let mut w = norm(want[..n].to_vec());
                    if !ranked {
                        g.sort_by_key(|c| c.0);
                        w.sort_by_key(|c| c.0);
                    }
                    let ids = |v: &[(u32, f64)]| v.iter().map(|c| c.0).collect::<Vec<_>>();
                    assert_eq!(ids(&g), ids(&w), "{at}");
                    for (a, b) in g.iter().zip(&w) {
                        assert!((a.1 - b.1).abs() <= 1e-30 + 1e-6 * b.1, "{a:?} vs {b:?}, {at}");
                    }
                    cases += 1;
                }
            }
        }
        assert_eq!(cases, 6 * 12 * 11);
        assert!(edges * 100 < cases, "{edges} of {cases} cases differ at a top-p edge");
    }

    #[test]
    fn draws_over_a_large_vocabulary_follow_the_distribution() {
        // Two likely tokens in different blocks of the draw's walk (p = 0.25 / 0.75), the rest ~e⁻³⁰ each.
        let mut logits = vec![-30.0f32; 5000];
        logits[5] = 0.0;
        logits[2900] = 3f32.ln();
        for p in [
            SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_p: 0.99,
                ..Default::default()
            },
        ] {
            let mut s = sampler(p);
            let draws: Vec<u32> = (0..4000).map(|_| s.sample(&logits, &[], &[])).collect();
            assert!(draws.iter().all(|&t| t == 5 || t == 2900));
            let late = draws.iter().filter(|&&t| t == 2900).count();
            assert!((2800..3200).contains(&late), "{late}");
        }
    }

    #[test]
    fn odd_logits_draw_a_token_that_can_win() {
        // An infinite logit wins outright; a NaN one is never drawn; no logits at all give token 0.
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&[0.0, f32::INFINITY, 1.0], &[], &[]) == 1));
        assert!((0..50).all(|_| s.sample(&[f32::NAN, 0.0, f32::NAN], &[], &[]) == 1));
        assert_eq!(s.sample(&[], &[], &[]), 0);
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&[f32::NAN, 0.0, f32::NAN], &[], &[]) == 1));
    }

    #[test]
    fn invalid_params_are_rejected() {
        assert!(Sampler::new(SamplingParams {
            top_p: -0.1,
            ..Default::default()
        })
        .is_err());
        // top-p 0 keeps the likeliest token alone.
        let mut s = sampler(SamplingParams {
            temperature: 1.0,
            top_p: 0.0,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&[0.0, 1.0, 0.9], &[], &[]) == 1));
        assert!(Sampler::new(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            min_p: 2.0,
            ..Default::default()
        })
        .is_err());
    }
}
