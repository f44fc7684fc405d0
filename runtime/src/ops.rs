//! Element-wise and attention ops of the `cpu` backend, on row-major f32 activations.

use crate::config::RopeScaling;
use crate::cpu::Isa;
use crate::error::{ModelError, Result};

/// RMSNorm of each `w.len()`-wide row of `x`, in place: `x · rsqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * r * g;
        }
    }
}

/// `silu(gate) · up`, written into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Softmax in place (max-subtracted, f32): [`Isa::softmax`], the same bits on every instruction set.
pub fn softmax(x: &mut [f32]) {
    Isa::detect().softmax(x);
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Rotary position embedding over the first `dims` of each head.
#[derive(Debug, Clone)]
pub struct Rope {
    pub(crate) inv_freq: Vec<f64>,
    /// Rotated dimensions per head.
    pub(crate) dims: usize,
    /// Pairs `(2i, 2i+1)` instead of `(i, i + dims/2)`.
    pub(crate) traditional: bool,
    /// YaRN magnitude scale applied to the rotated part.
    pub(crate) mscale: f32,
}

impl Rope {
    /// Builds the frequency table for `dims` rotated dims, `theta`, and optional HF-style scaling.
    pub fn new(dims: usize, theta: f64, traditional: bool, scaling: Option<&RopeScaling>) -> Result<Self> {
        let half = dims / 2;
        let base: Vec<f64> = (0..half).map(|i| theta.powf(-2.0 * i as f64 / dims as f64)).collect();
        let kind = scaling.and_then(|s| s.rope_type.as_deref()).unwrap_or("default");
        let factor = scaling.and_then(|s| s.factor).unwrap_or(1.0);
        let (inv_freq, mscale) = match kind {
            "default" | "mrope" => (base, 1.0),
            "linear" => (base.iter().map(|f| f / factor).collect(), 1.0),
            "yarn" => {
                let s = scaling.expect("kind came from scaling");
                let orig = s.original_max_position_embeddings.unwrap_or(4096.0);
                let (bf, bs) = (s.beta_fast.unwrap_or(32.0), s.beta_slow.unwrap_or(1.0));
                let corr =
                    |beta: f64| dims as f64 * (orig / (beta * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
                let (mut low, mut high) = (corr(bf), corr(bs));
                if s.truncate.unwrap_or(true) {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, high) = (low.max(0.0), high.min(dims as f64 - 1.0));
                let span = if high == low { high - low + 0.001 } else { high - low };
                let inv = base
                    .iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0);
                        (1.0 - ramp) * f + ramp * f / factor
                    })
                    .collect();
                let m = |a: f64| {
                    if factor <= 1.0 {
                        1.0
                    } else {
                        0.1 * a * factor.ln() + 1.0
                    }
                };
                let ms = m(s.mscale.unwrap_or(1.0)) / m(s.mscale_all_dim.unwrap_or(0.0));
                (inv, ms as f32)
            }
            other => {
                return Err(ModelError::InvalidArgument(format!(
                    "rope scaling type `{other}` is not supported"
                )))
            }
        };
        Ok(Self {
            inv_freq,
            dims,
            traditional,
            mscale,
        })
    }

    /// Rotates each `head_dim`-wide head in `x` (`[heads, head_dim]` for one token) at position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.dims / 2;
        // One angle table for every head at this position (computing it per head cost more than the rotation).
        let angles: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|f| {
                let (s, c) = (pos as f64 * f).sin_cos();
                (s as f32, c as f32)
            })
            .collect();
        for head in x.chunks_mut(head_dim) {
            for (i, &(s, c)) in angles.iter().enumerate() {
                let (a, b) = if self.traditional {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = (x0 * c - x1 * s) * self.mscale;
                head[b] = (x0 * s + x1 * c) * self.mscale;
            }
        }
    }
}

/// Shape of a grouped-query attention.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
}

impl AttnShape {
    /// From HF config fields: `num_key_value_heads` defaults to the query heads, `head_dim` to
    /// `hidden_size / num_attention_heads`.
    pub fn from_config(hidden: usize, heads: usize, kv_heads: Option<usize>, head_dim: Option<usize>) -> Self {
        Self {
            heads,
            kv_heads: kv_heads.unwrap_or(heads),
            head_dim: head_dim.unwrap_or(hidden / heads.max(1)),
        }
    }
}

/// Causal GQA for the last `n` positions of a sequence whose keys and values are `kc`, `vc`: one
/// `[positions, head_dim]` array per key/value head, those `n` positions included; `q` is `[n, heads·head_dim]`.
/// Returns `[n, heads·head_dim]`.
///
/// Each head's cache is contiguous because a task reads one head: in a `[positions, kv_heads·head_dim]` layout
/// its rows are 512 of every 2,048 bytes, and the hardware prefetchers fetch the rest too, so a decode step
/// read its caches from DRAM at a quarter of the probe.
///
/// One task per (position, key/value head): the query heads sharing that head read each key and value row
/// once, not once each (a group of 8 read the cache 8 times before, which made depth cost up to half the
/// step). Each head's numbers are computed as if alone (same dot, softmax, accumulation order), so results
/// do not depend on the grouping, batch or threads.
pub fn attention<C: AsRef<[f32]> + Sync>(isa: Isa, s: AttnShape, q: &[f32], n: usize, kc: &[C], vc: &[C]) -> Vec<f32> {
    let hd = s.head_dim;
    assert!(
        kc.len() == s.kv_heads && vc.len() == s.kv_heads,
        "attention: one key and value cache per head"
    );
    let total = kc.first().map_or(0, |k| k.as_ref().len() / hd);
    let pos0 = total - n;
    let scale = 1.0 / (hd as f32).sqrt();
    let group = s.heads / s.kv_heads;
    let mut out = vec![0f32; n * s.heads * hd];
    let work = |(i, o): (usize, &mut [f32])| {
        let (t, kvh) = (i / s.kv_heads, i % s.kv_heads);
        let qg = &q[(t * s.heads + kvh * group) * hd..(t * s.heads + (kvh + 1) * group) * hd];
        let visible = pos0 + t + 1;
        // scores[g·visible + j]: query head g of the group against position j.
        let mut scores = vec![0f32; group * visible];
        let (kh, vh) = (kc[kvh].as_ref(), vc[kvh].as_ref());
        let key = |j: usize| &kh[j * hd..(j + 1) * hd];
        // Four positions at a time: one query against four keys overlaps four dot products' latencies.
        let whole = visible - visible % 4;
        for j in (0..whole).step_by(4) {
            let ks = [key(j), key(j + 1), key(j + 2), key(j + 3)];
            for (g, qh) in qg.chunks_exact(hd).enumerate() {
                let s = isa.dots4(qh, ks);
                for (d, s) in s.iter().enumerate() {
                    scores[g * visible + j + d] = s * scale;
                }
            }
        }
        for j in whole..visible {
            for (g, qh) in qg.chunks_exact(hd).enumerate() {
                scores[g * visible + j] = isa.dot(qh, key(j)) * scale;
            }
        }
        for row in scores.chunks_exact_mut(visible) {
            isa.softmax(row);
        }
        // All the group's heads in one pass over the values: each value row is read once per eight heads.
        isa.weighted_rows_grouped(o, hd, &scores, vh, hd);
    };
    if n * s.heads * total * hd < 1 << 16 {
        out.chunks_mut(group * hd).enumerate().for_each(work);
    } else {
        crate::threads::parallel_each(out.chunks_mut(group * hd).enumerate().collect(), work);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_preserves_norm_and_rotates_pairs() {
        let r = Rope::new(4, 10000.0, false, None).unwrap();
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        r.apply(&mut x, 4, 1);
        // pair (0, 2) with inv_freq 1: (cos 1, sin 1)
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        assert!(Rope::new(
            4,
            1e4,
            false,
            Some(&RopeScaling {
                rope_type: Some("nope".into()),
                ..Default::default()
            })
        )
        .is_err());
    }

    #[test]
    fn attention_of_one_position_returns_its_value() {
        let s = AttnShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
        };
        let o = attention(Isa::Scalar, s, &[1.0, 2.0, 3.0, 4.0], 1, &[[0.5, 0.5]], &[[7.0, 9.0]]);
        assert_eq!(o, vec![7.0, 9.0, 7.0, 9.0]);
    }

    /// `[positions, kv_heads·hd]` split into one `[positions, hd]` array per head.
    fn by_head(c: &[f32], kv_heads: usize, hd: usize) -> Vec<Vec<f32>> {
        (0..kv_heads)
            .map(|h| {
                c.chunks_exact(kv_heads * hd)
                    .flat_map(|row| &row[h * hd..(h + 1) * hd])
                    .copied()
                    .collect()
            })
            .collect()
    }

    /// One query head at a time, each reading the whole cache in `[positions, kv_heads·hd]` order: the oracle.
    fn attention_per_head(isa: Isa, s: AttnShape, q: &[f32], n: usize, kc: &[f32], vc: &[f32]) -> Vec<f32> {
        let (hd, kvw) = (s.head_dim, s.kv_heads * s.head_dim);
        let pos0 = kc.len() / kvw - n;
        let mut out = vec![0f32; n * s.heads * hd];
        for (i, o) in out.chunks_mut(hd).enumerate() {
            let (t, h) = (i / s.heads, i % s.heads);
            let kvh = h / (s.heads / s.kv_heads);
            let qh = &q[(t * s.heads + h) * hd..(t * s.heads + h + 1) * hd];
            let mut scores: Vec<f32> = (0..pos0 + t + 1)
                .map(|j| isa.dot(qh, &kc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd]) * (1.0 / (hd as f32).sqrt()))
                .collect();
            softmax(&mut scores);
            for (j, p) in scores.iter().enumerate() {
                for (acc, x) in o.iter_mut().zip(&vc[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd]) {
                    *acc += p * x;
                }
            }
        }
        out
    }

    #[test]
    fn grouped_attention_equals_one_head_at_a_time_bit_for_bit() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (heads, kv_heads, hd, n, past) in [
            (8, 2, 16, 5, 3),
            (4, 4, 8, 1, 40),
            (32, 4, 128, 3, 200),
            (6, 1, 4, 7, 0),
        ] {
            let s = AttnShape {
                heads,
                kv_heads,
                head_dim: hd,
            };
            let total = n + past;
            let mut r = |len: usize| (0..len).map(|_| rng.gen_range(-2.0f32..2.0)).collect::<Vec<f32>>();
            let (q, kc, vc) = (r(n * heads * hd), r(total * kv_heads * hd), r(total * kv_heads * hd));
            for isa in Isa::available() {
                let want = attention_per_head(isa, s, &q, n, &kc, &vc);
                let got = attention(isa, s, &q, n, &by_head(&kc, kv_heads, hd), &by_head(&vc, kv_heads, hd));
                assert!(
                    want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} heads {heads}/{kv_heads}, n {n}, past {past}"
                );
            }
        }
    }

    #[test]
    fn top_k_is_ordered_and_stable() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, 0.2], 3), vec![1, 2, 3]);
    }
}
