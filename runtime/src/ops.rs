//! Element-wise and attention ops of the `cpu` backend, on row-major f32 activations.

use std::cell::RefCell;

use crate::config::RopeScaling;
use crate::cpu::kv::KvHead;
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

/// `silu(gate) · up`, written into `gate`: [`Isa::swiglu`], the same bits on every instruction set.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    Isa::detect().swiglu(gate, up);
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

/// Query positions an attention task covers when a prefill has enough of them: each key block and value row is
/// then loaded once for all their heads, not once per position (a position's task at 8k deep streams its head's
/// whole cache, more than L2 holds).
const POSITIONS_PER_TASK: usize = 4;

thread_local! {
    /// A task's scores and outputs, kept between tasks: every score a task reads it writes first, and a deep
    /// task's fresh megabyte cost page faults and zeroing each time.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Causal GQA for the last `n` positions of a sequence whose keys and values are `cache`, one [`KvHead`] per
/// key/value head holding those `n` positions too; `q` is `[n, heads·head_dim]`. Returns `[n, heads·head_dim]`.
///
/// In a decode, one task per key/value head: the query heads that share it read each key block and value row
/// once, not once each. In a prefill, one task per run of positions, which reads each head's blocks and rows
/// once for all the run's query heads. Each head's numbers are computed as if alone (the
/// same multiply-add chains over its own visible positions), so results do not depend on the grouping, the
/// positions per task, the batch or the threads.
pub fn attention(isa: Isa, s: AttnShape, q: &[f32], n: usize, cache: &[KvHead]) -> Vec<f32> {
    // Enough tasks left to keep every thread busy, or one position each.
    let per = if n >= 8 * POSITIONS_PER_TASK * rayon::current_num_threads() {
        POSITIONS_PER_TASK
    } else {
        1
    };
    attention_in_runs(isa, s, q, n, cache, per)
}

/// [`attention`] with tasks of `per` positions (and every key/value head), or of one position and one
/// key/value head when `per` is 1.
fn attention_in_runs(isa: Isa, s: AttnShape, q: &[f32], n: usize, cache: &[KvHead], per: usize) -> Vec<f32> {
    let hd = s.head_dim;
    assert!(cache.len() == s.kv_heads, "attention: one cache per key/value head");
    let total = cache.first().map_or(0, KvHead::len);
    let pos0 = total - n;
    let scale = 1.0 / (hd as f32).sqrt();
    let group = s.heads / s.kv_heads;
    let (gw, width) = (group * hd, s.heads * hd);
    let mut out = vec![0f32; n * width];
    if out.is_empty() {
        return out;
    }
    // Positions `t0..t0 + m` against key/value head `kvh`, into `o` (`[m][group·hd]`).
    let run = |kvh: usize, t0: usize, m: usize, o: &mut [f32], scores: &mut Vec<f32>| {
        let (shortest, longest) = (pos0 + t0 + 1, pos0 + t0 + m);
        let (keys, values) = (cache[kvh].keys(), cache[kvh].values());
        // The positions' query heads in a row: `m·group` heads against the last one's visible keys.
        let mut qs = Vec::with_capacity(m * gw);
        for t in t0..t0 + m {
            qs.extend_from_slice(&q[(t * s.heads + kvh * group) * hd..][..gw]);
        }
        if scores.len() < m * group * longest {
            scores.resize(m * group * longest, 0.0);
        }
        let scores = &mut scores[..m * group * longest];
        isa.key_scores(&qs, keys, hd, longest, scale, scores);
        // Each row over its own position's keys; the scores past them are never read.
        for (r, row) in scores.chunks_exact_mut(longest).enumerate() {
            isa.softmax(&mut row[..shortest + r / group]);
        }
        // The keys every position sees, for all of them together, then each later position's own.
        isa.weighted_values(o, scores, longest, 0..shortest, values, hd);
        for i in 1..m {
            let rows = &scores[i * group * longest..(i + 1) * group * longest];
            isa.weighted_values(
                &mut o[i * gw..(i + 1) * gw],
                rows,
                longest,
                shortest..shortest + i,
                values,
                hd,
            );
        }
    };
    let work = |(i, o): (usize, &mut [f32])| {
        SCRATCH.with_borrow_mut(|(scores, tmp)| {
            if per == 1 {
                return run(i % s.kv_heads, i / s.kv_heads, 1, o, scores);
            }
            // A run's output rows interleave the heads: each head's go through `tmp`.
            let m = o.len() / width;
            for kvh in 0..s.kv_heads {
                tmp.clear();
                tmp.resize(m * gw, 0.0);
                run(kvh, i * per, m, tmp, scores);
                for (t, rows) in tmp.chunks_exact(gw).enumerate() {
                    o[t * width + kvh * gw..][..gw].copy_from_slice(rows);
                }
            }
        })
    };
    let tasks: Vec<_> = out
        .chunks_mut(if per == 1 { gw } else { per * width })
        .enumerate()
        .collect();
    if n * s.heads * total * hd < 1 << 16 {
        tasks.into_iter().for_each(work);
    } else {
        crate::threads::parallel_each(tasks, work);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kv::KvType;

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

    fn caches(ty: KvType, kv: &[f32], kv_heads: usize, hd: usize) -> Vec<KvHead> {
        (0..kv_heads)
            .map(|h| {
                let mut c = KvHead::new(ty, hd);
                for row in kv.chunks_exact(2 * kv_heads * hd) {
                    let (k, v) = row.split_at(kv_heads * hd);
                    c.push(&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
                }
                c
            })
            .collect()
    }

    #[test]
    fn attention_of_one_position_returns_its_value() {
        let s = AttnShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
        };
        let cache = caches(KvType::F32, &[0.5, 0.5, 7.0, 9.0], 1, 2);
        let o = attention(Isa::Scalar, s, &[1.0, 2.0, 3.0, 4.0], 1, &cache);
        assert_eq!(o, vec![7.0, 9.0, 7.0, 9.0]);
    }

    /// One query head at a time over rows `[positions, (k, v) × kv_heads·hd]` as written (rounded to the
    /// cache's type), with the same multiply-add chains: the oracle.
    fn attention_per_head(s: AttnShape, q: &[f32], n: usize, kv: &[f32], ty: KvType) -> Vec<f32> {
        let (hd, kvw) = (s.head_dim, s.kv_heads * s.head_dim);
        let round = |x: f32| {
            if ty == KvType::F16 {
                half::f16::from_f32(x).to_f32()
            } else {
                x
            }
        };
        let pos0 = kv.len() / (2 * kvw) - n;
        let mut out = vec![0f32; n * s.heads * hd];
        for (i, o) in out.chunks_mut(hd).enumerate() {
            let (t, h) = (i / s.heads, i % s.heads);
            let kvh = h / (s.heads / s.kv_heads);
            let qh = &q[(t * s.heads + h) * hd..(t * s.heads + h + 1) * hd];
            let row = |j: usize, part: usize| &kv[j * 2 * kvw + part * kvw + kvh * hd..][..hd];
            let mut scores: Vec<f32> = (0..pos0 + t + 1)
                .map(|j| {
                    qh.iter()
                        .zip(row(j, 0))
                        .fold(0f32, |acc, (&x, &k)| x.mul_add(round(k), acc))
                        * (1.0 / (hd as f32).sqrt())
                })
                .collect();
            softmax(&mut scores);
            for (j, p) in scores.iter().enumerate() {
                for (acc, &x) in o.iter_mut().zip(row(j, 1)) {
                    *acc = p.mul_add(round(x), *acc);
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
            (12, 1, 64, 17, 16),
            (16, 2, 40, 23, 30),
        ] {
            let s = AttnShape {
                heads,
                kv_heads,
                head_dim: hd,
            };
            let total = n + past;
            let mut r = |len: usize| (0..len).map(|_| rng.gen_range(-2.0f32..2.0)).collect::<Vec<f32>>();
            let (q, kv) = (r(n * heads * hd), r(2 * total * kv_heads * hd));
            for ty in [KvType::F32, KvType::F16] {
                let want = attention_per_head(s, &q, n, &kv, ty);
                let cache = caches(ty, &kv, kv_heads, hd);
                for isa in Isa::available() {
                    // Every run length, including ones that do not divide the positions.
                    for per in [1, 2, 3, 4, 8] {
                        let got = attention_in_runs(isa, s, &q, n, &cache, per);
                        assert!(
                            want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{isa:?} {ty:?} heads {heads}/{kv_heads}, n {n}, past {past}, {per} per task"
                        );
                    }
                    assert_eq!(attention(isa, s, &q, n, &cache), want);
                }
            }
        }
    }

    #[test]
    fn top_k_is_ordered_and_stable() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, 0.2], 3), vec![1, 2, 3]);
    }
}
