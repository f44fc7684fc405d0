//! Element-wise and attention ops of the `cpu` backend, on row-major f32 activations.

use std::cell::RefCell;

use crate::config::RopeScaling;
use crate::cpu::kv::KvHead;
use crate::cpu::Isa;
use crate::error::{ModelError, Result};

/// RMSNorm of each `w.len()`-wide row of `x`, in place: `x · rsqrt(mean(x²) + eps) · w` (an empty `w` leaves `x`
/// as it is).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    if d == 0 {
        return;
    }
    // Eight rows at a time (a token's 32 query heads are 32 rows): each row's sum of squares is still one
    // chain in column order, the bits of a row alone, but eight chains side by side do not each wait on the
    // last add's latency.
    for rows in x.chunks_mut(8 * d) {
        let mut ss = [0f32; 8];
        if rows.len() == 8 * d {
            let r: [&[f32]; 8] = std::array::from_fn(|h| &rows[h * d..(h + 1) * d]);
            #[allow(clippy::needless_range_loop)] // column `i` of eight rows at once
            for i in 0..d {
                for h in 0..8 {
                    ss[h] += r[h][i] * r[h][i];
                }
            }
        } else {
            for (s, row) in ss.iter_mut().zip(rows.chunks(d)) {
                *s = row.iter().map(|v| v * v).sum::<f32>();
            }
        }
        for (row, s) in rows.chunks_mut(d).zip(ss) {
            let r = 1.0 / (s / d as f32 + eps).sqrt();
            for (v, g) in row.iter_mut().zip(w) {
                *v = *v * r * g;
            }
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
    let k = k.min(x.len());
    // One pass, keeping the best `k` in order (a router picks 8 of 64..512: sorting them all cost more than
    // the pick). A later index ranks after an equal value already kept, so it enters only when strictly
    // greater than the last kept, and lands after every kept value it does not beat: the order of a full
    // sort by (value descending, index ascending).
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (i, v) in x.iter().enumerate() {
        if best.len() == k && v.total_cmp(&x[best[k - 1]]).is_le() {
            continue;
        }
        let at = best.partition_point(|&j| x[j].total_cmp(v).is_ge());
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

/// Rotary position embedding over the first `dims` of each head.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Angular frequency per rotated pair; never changed after [`Rope::new`] (the per-thread angle tables rely on it).
    pub(crate) inv_freq: Vec<f64>,
    /// Rotated dimensions per head.
    pub(crate) dims: usize,
    /// Pairs `(2i, 2i+1)` instead of `(i, i + dims/2)`.
    pub(crate) traditional: bool,
    /// YaRN magnitude scale applied to the rotated part.
    pub(crate) mscale: f32,
    /// Names this frequency table (clones share it) for the angle tables cached per thread.
    id: u64,
}

thread_local! {
    /// The last angle table this thread built: (rope id, position, sines, cosines). Every layer of a decode
    /// step rotates its queries and keys at the same position, so one table serves all of them.
    static ANGLES: RefCell<(u64, usize, Vec<f32>, Vec<f32>)> =
        const { RefCell::new((u64::MAX, 0, Vec::new(), Vec::new())) };
}

impl Rope {
    /// Builds the frequency table for `dims` rotated dims, `theta`, and optional HF-style scaling.
    pub fn new(dims: usize, theta: f64, traditional: bool, scaling: Option<&RopeScaling>) -> Result<Self> {
        // Checked here, where they are used: a theta of 0 or less or not finite, a zero or negative factor, or yarn
        // with theta 1 (its ln θ divides) gives infinite or NaN frequencies, and then every logit is NaN, with no
        // error. No model rotates with a theta of 1 or less, so those are refused too.
        if !(theta.is_finite() && theta > 1.0) {
            return Err(ModelError::InvalidArgument(format!(
                "rope_theta must be finite and > 1, got {theta}"
            )));
        }
        if let Some(f) = scaling.and_then(|s| s.factor).filter(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(ModelError::InvalidArgument(format!(
                "rope_scaling factor must be finite and > 0, got {f}"
            )));
        }
        let half = dims / 2;
        let base: Vec<f64> = (0..half).map(|i| theta.powf(-2.0 * i as f64 / dims as f64)).collect();
        let kind = scaling.map_or("default", RopeScaling::kind);
        let factor = scaling.and_then(|s| s.factor).unwrap_or(1.0);
        let (inv_freq, mscale) = match kind {
            "default" | "mrope" => (base, 1.0),
            "linear" => (base.iter().map(|f| f / factor).collect(), 1.0),
            "yarn" => {
                let s = scaling.expect("kind came from scaling");
                let orig = s.original_max_position_embeddings.unwrap_or(4096.0);
                let (bf, bs) = (s.beta_fast.unwrap_or(32.0), s.beta_slow.unwrap_or(1.0));
                if ![orig, bf, bs].iter().all(|v| v.is_finite() && *v > 0.0) {
                    return Err(ModelError::InvalidArgument(format!(
                        "yarn rope_scaling needs original_max_position_embeddings, beta_fast and beta_slow finite and \
                         > 0, got {orig}, {bf}, {bs}"
                    )));
                }
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
                let ms = match s.attention_factor {
                    Some(a) if !(a.is_finite() && a > 0.0) => {
                        return Err(ModelError::InvalidArgument(format!(
                            "yarn rope_scaling attention_factor must be finite and > 0, got {a}"
                        )))
                    }
                    Some(a) => a,
                    None => m(s.mscale.unwrap_or(1.0)) / m(s.mscale_all_dim.unwrap_or(0.0)),
                };
                (inv, ms as f32)
            }
            other => {
                return Err(ModelError::InvalidArgument(format!(
                    "rope scaling type `{other}` is not supported"
                )))
            }
        };
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Self {
            inv_freq,
            dims,
            traditional,
            mscale,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Rotates each `head_dim`-wide head in `x` (`[heads, head_dim]` for one token) at position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        ANGLES.with(|cell| {
            let mut cache = cell.borrow_mut();
            let (id, at, sin, cos) = &mut *cache;
            if (*id, *at) != (self.id, pos) {
                sin.clear();
                cos.clear();
                for f in &self.inv_freq {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    sin.push(s as f32);
                    cos.push(c as f32);
                }
                (*id, *at) = (self.id, pos);
            }
            self.rotate(x, head_dim, sin, cos);
        })
    }

    /// [`Rope::apply`] with the position's angles given.
    fn rotate(&self, x: &mut [f32], head_dim: usize, sin: &[f32], cos: &[f32]) {
        let half = self.dims / 2;
        let m = self.mscale;
        for head in x.chunks_mut(head_dim) {
            if self.traditional {
                for ((pair, &s), &c) in head[..2 * half].chunks_exact_mut(2).zip(sin).zip(cos) {
                    let (x0, x1) = (pair[0], pair[1]);
                    pair[0] = (x0 * c - x1 * s) * m;
                    pair[1] = (x0 * s + x1 * c) * m;
                }
            } else {
                let (lo, hi) = head[..2 * half].split_at_mut(half);
                for (((a, b), &s), &c) in lo.iter_mut().zip(hi).zip(sin).zip(cos) {
                    let (x0, x1) = (*a, *b);
                    *a = (x0 * c - x1 * s) * m;
                    *b = (x0 * s + x1 * c) * m;
                }
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
pub(crate) const POSITIONS_PER_TASK: usize = 4;

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

    #[test]
    fn yarn_attention_factor_replaces_the_computed_scale() {
        let yarn = |attention_factor: Option<f64>| RopeScaling {
            rope_type: Some("yarn".into()),
            factor: Some(4.0),
            attention_factor,
            ..Default::default()
        };
        let computed = Rope::new(64, 1e6, false, Some(&yarn(None))).unwrap().mscale;
        assert!((computed - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6, "{computed}");
        assert_eq!(Rope::new(64, 1e6, false, Some(&yarn(Some(1.0)))).unwrap().mscale, 1.0);
        assert_eq!(Rope::new(64, 1e6, false, Some(&yarn(Some(1.25)))).unwrap().mscale, 1.25);
        assert!(Rope::new(64, 1e6, false, Some(&yarn(Some(f64::NAN)))).is_err());
    }

    #[test]
    fn rope_settings_that_give_nan_frequencies_are_errors() {
        let scaled = |kind: &str, factor: f64, beta_fast: f64| RopeScaling {
            rope_type: Some(kind.into()),
            factor: Some(factor),
            beta_fast: Some(beta_fast),
            ..Default::default()
        };
        for theta in [1.0, 0.0, -1e4, f64::NAN, f64::INFINITY] {
            assert!(Rope::new(4, theta, false, None).is_err(), "theta {theta}");
        }
        for bad in [
            scaled("linear", 0.0, 32.0),
            scaled("yarn", -2.0, 32.0),
            scaled("yarn", 4.0, 0.0),
        ] {
            assert!(Rope::new(4, 1e4, false, Some(&bad)).is_err(), "{bad:?}");
        }
        for good in [scaled("linear", 2.0, 32.0), scaled("yarn", 4.0, 32.0)] {
            let r = Rope::new(4, 1e4, false, Some(&good)).unwrap();
            assert!(r.inv_freq.iter().all(|f| f.is_finite() && *f > 0.0), "{good:?}");
        }
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

    #[test]
    fn rope_angles_cached_per_position_give_the_bits_of_fresh_ones() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let scaling = RopeScaling {
            rope_type: Some("yarn".into()),
            factor: Some(4.0),
            ..Default::default()
        };
        let ropes = [
            Rope::new(16, 1e4, false, None).unwrap(),
            Rope::new(16, 1e6, true, None).unwrap(),
            Rope::new(8, 5e5, false, Some(&scaling)).unwrap(),
        ];
        let (hd, heads) = (16, 3);
        let x: Vec<f32> = (0..hd * heads).map(|_| rng.gen_range(-2f32..2.0)).collect();
        // Positions revisited and ropes interleaved, as layers and sequences do.
        for (r, pos) in [(0, 5), (0, 5), (1, 5), (0, 7), (2, 7), (0, 5), (2, 0), (1, 9)] {
            let rope = &ropes[r];
            let mut got = x.clone();
            rope.apply(&mut got, hd, pos);
            // The oracle: every pair rotated by its own angle, as written in the papers.
            let mut want = x.clone();
            let half = rope.dims / 2;
            for head in want.chunks_mut(hd) {
                for (i, f) in rope.inv_freq.iter().enumerate() {
                    let (s, c) = (pos as f64 * f).sin_cos();
                    let (s, c) = (s as f32, c as f32);
                    let (a, b) = if rope.traditional {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + half)
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = (x0 * c - x1 * s) * rope.mscale;
                    head[b] = (x0 * s + x1 * c) * rope.mscale;
                }
            }
            assert_eq!(got, want, "rope {r} at {pos}");
        }
    }

    /// A full sort by (value descending, index ascending), truncated: the oracle for [`top_k`].
    fn top_k_by_sorting(x: &[f32], k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        idx.truncate(k);
        idx
    }

    proptest::proptest! {
        #[test]
        fn top_k_picks_what_a_full_sort_picks(
            // Few distinct values, so ties are common; NaNs and signed zeros among them.
            codes in proptest::collection::vec(0u8..12, 0..80),
            k in 0usize..90,
        ) {
            let x: Vec<f32> = codes
                .iter()
                .map(|&c| match c {
                    0 => f32::NAN,
                    1 => -0.0,
                    2 => 0.0,
                    3 => f32::NEG_INFINITY,
                    c => (c as f32 - 7.0) * 0.25,
                })
                .collect();
            proptest::prop_assert_eq!(top_k(&x, k), top_k_by_sorting(&x, k));
        }

        #[test]
        fn rms_norm_of_rows_together_equals_each_row_alone(
            rows in 1usize..20,
            d in 1usize..40,
            seed in 0u64..1000,
        ) {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let x: Vec<f32> = (0..rows * d).map(|_| rng.gen_range(-3f32..3.0)).collect();
            let w: Vec<f32> = (0..d).map(|_| rng.gen_range(-2f32..2.0)).collect();
            let mut together = x.clone();
            rms_norm(&mut together, &w, 1e-6);
            for (r, row) in x.chunks(d).enumerate() {
                // The textbook form: one row, its sum of squares in column order.
                let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                for (c, (v, g)) in row.iter().zip(&w).enumerate() {
                    proptest::prop_assert_eq!(together[r * d + c].to_bits(), (v * inv * g).to_bits());
                }
            }
        }
    }
}
