//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, seeded sampling.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{ModelError, Result};

/// Sampling settings (OpenAI / llama.cpp meanings; `top_k` here is the *sampling* top-k, not experts).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass to keep, in (0, 1].
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
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
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
        if !(-2.0..=2.0).contains(&self.frequency_penalty) || !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("frequency_penalty and presence_penalty must be in [-2, 2]".into());
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
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Ok(Self { params, rng })
    }

    /// Picks the next token from `logits` given the `prompt` and the `generated` tokens so far.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> u32 {
        let p = &self.params;
        let mut l = logits.to_vec();
        if p.repetition_penalty != 1.0 {
            let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
            let start = if p.repeat_last_n == 0 {
                0
            } else {
                all.len().saturating_sub(p.repeat_last_n)
            };
            let mut seen = all[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(v) = l.get_mut(t as usize) {
                    // Kept finite: a tiny penalty would overflow a logit to ±inf, and inf − inf is NaN below.
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    }
                    .clamp(f32::MIN, f32::MAX);
                }
            }
        }
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
        // Temperature first, then the filters (as Hugging Face transformers and vLLM order them). The largest
        // logit comes off before the division: a tiny temperature would otherwise overflow the logits to ±inf,
        // every probability would be NaN and the draw would fall through to the least likely candidate.
        let top = l.iter().copied().fold(f32::MIN, f32::max);
        let mut cand: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, (v - top) / p.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, v)| (v - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
        }
        let kept: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.gen::<f32>() * kept;
        for i in 0..keep {
            r -= probs[i];
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
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

    #[test]
    fn invalid_params_are_rejected() {
        assert!(Sampler::new(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        })
        .is_err());
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
