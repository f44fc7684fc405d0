//! AArch64 NEON kernels.

use std::arch::aarch64::*;
use std::ops::Range;

use super::kv::{KvElem, KEY_BLOCK};

/// Dot product with four 4-wide FMA accumulators.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    // SAFETY: `Isa::Neon` is only selected after `is_aarch64_feature_detected!("neon")` returned true; the
    // slices have equal length (asserted), and every load below is within `i + 4 <= n`.
    unsafe { dot_impl(a, b) }
}

#[target_feature(enable = "neon")]
unsafe fn dot_impl(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            *acc_j = vfmaq_f32(*acc_j, vld1q_f32(pa.add(i + 4 * j)), vld1q_f32(pb.add(i + 4 * j)));
        }
        i += 16;
    }
    while i + 4 <= n {
        acc[0] = vfmaq_f32(acc[0], vld1q_f32(pa.add(i)), vld1q_f32(pb.add(i)));
        i += 4;
    }
    let s = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
    let mut sum = vaddvq_f32(s);
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// What the attention kernels read and write (bounds checked by `Isa::key_scores` / `Isa::weighted_values`).
struct Attend {
    hd: usize,
    /// Scores per head row: the visible keys, or the weights' row stride.
    visible: usize,
}

/// `Isa::key_scores` in 4-wide registers: a block's 16 keys are four registers per dim; up to four heads share
/// each load. f16 blocks are widened into a buffer first. The same chains as the scalar oracle, lane by lane.
pub(super) fn key_scores<T: KvElem>(q: &[f32], keys: &[T], hd: usize, visible: usize, scale: f32, out: &mut [f32]) {
    let a = Attend { hd, visible };
    let heads = q.len() / hd;
    let mut wide = Vec::new();
    for b in 0..visible.div_ceil(KEY_BLOCK) {
        let block = widen(&keys[b * KEY_BLOCK * hd..(b + 1) * KEY_BLOCK * hd], &mut wide);
        let mut g = 0;
        while g < heads {
            let h = (heads - g).min(4);
            // SAFETY: `Isa::Neon` is only selected after NEON was detected; `block` holds `hd × 16` values, `q`
            // whole heads of `hd` (g + h ≤ heads), and `out` a row of `visible` per head, of which the block's
            // visible lanes are written.
            unsafe {
                match h {
                    4 => block_scores::<4>(&a, q, g, block, b, scale, out),
                    3 => block_scores::<3>(&a, q, g, block, b, scale, out),
                    2 => block_scores::<2>(&a, q, g, block, b, scale, out),
                    _ => block_scores::<1>(&a, q, g, block, b, scale, out),
                }
            }
            g += h;
        }
    }
}

/// `src` as f32: itself, or widened into `buf`.
fn widen<'a, T: KvElem>(src: &'a [T], buf: &'a mut Vec<f32>) -> &'a [f32] {
    if let Some(f) = T::as_f32(src) {
        return f;
    }
    buf.clear();
    buf.extend(src.iter().map(|x| x.to_f32()));
    buf
}

#[target_feature(enable = "neon")]
unsafe fn block_scores<const H: usize>(
    a: &Attend,
    q: &[f32],
    g0: usize,
    block: &[f32],
    b: usize,
    scale: f32,
    out: &mut [f32],
) {
    let (pq, pk) = (q.as_ptr(), block.as_ptr());
    let mut acc = [[vdupq_n_f32(0.0); 4]; H];
    for d in 0..a.hd {
        let k: [float32x4_t; 4] = std::array::from_fn(|i| vld1q_f32(pk.add(d * KEY_BLOCK + 4 * i)));
        for (g, acc) in acc.iter_mut().enumerate() {
            let x = vdupq_n_f32(*pq.add((g0 + g) * a.hd + d));
            for (acc, k) in acc.iter_mut().zip(k) {
                *acc = vfmaq_f32(*acc, x, k);
            }
        }
    }
    let j0 = b * KEY_BLOCK;
    let lanes = (a.visible - j0).min(KEY_BLOCK);
    for (g, acc) in acc.iter().enumerate() {
        let mut tmp = [0f32; KEY_BLOCK];
        for (i, v) in acc.iter().enumerate() {
            vst1q_f32(tmp.as_mut_ptr().add(4 * i), vmulq_n_f32(*v, scale));
        }
        out[(g0 + g) * a.visible + j0..][..lanes].copy_from_slice(&tmp[..lanes]);
    }
}

/// `Isa::weighted_values` in 4-wide registers: up to four heads × 16 columns per pass over a block of value
/// rows (f16 rows widened into a buffer first); columns past the last 16 go element by element.
pub(super) fn weighted_values<T: KvElem>(
    out: &mut [f32],
    w: &[f32],
    stride: usize,
    rows: Range<usize>,
    values: &[T],
    hd: usize,
) {
    const ROWS: usize = 64;
    let heads = out.len() / hd;
    let a = Attend { hd, visible: stride };
    let wide_cols = hd - hd % 16;
    let mut wide = Vec::new();
    for j0 in rows.clone().step_by(ROWS) {
        let j1 = (j0 + ROWS).min(rows.end);
        let block = widen(&values[j0 * hd..j1 * hd], &mut wide);
        let mut g = 0;
        while g < heads {
            let h = (heads - g).min(4);
            for c in (0..wide_cols).step_by(16) {
                // SAFETY: `Isa::Neon` is only selected after NEON was detected; `block` holds rows `j0..j1` of
                // `hd`, `w` a row of `stride ≥ j1` weights per head, `out` `heads` rows of `hd`, and the columns
                // `c..c + 16` lie below `hd`.
                unsafe {
                    match h {
                        4 => value_cols::<4>(&a, out, w, block, g, c, j0, j1),
                        3 => value_cols::<3>(&a, out, w, block, g, c, j0, j1),
                        2 => value_cols::<2>(&a, out, w, block, g, c, j0, j1),
                        _ => value_cols::<1>(&a, out, w, block, g, c, j0, j1),
                    }
                }
            }
            g += h;
        }
    }
    if wide_cols < hd {
        super::kv::weighted_values_scalar(out, w, stride, rows, values, hd, wide_cols);
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
unsafe fn value_cols<const H: usize>(
    a: &Attend,
    out: &mut [f32],
    w: &[f32],
    rows: &[f32],
    g0: usize,
    c0: usize,
    j0: usize,
    j1: usize,
) {
    let (po, pw, pv) = (out.as_mut_ptr(), w.as_ptr(), rows.as_ptr());
    let at = |g: usize, i: usize| po.add((g0 + g) * a.hd + c0 + 4 * i);
    let mut acc: [[float32x4_t; 4]; H] = std::array::from_fn(|g| std::array::from_fn(|i| vld1q_f32(at(g, i))));
    for j in j0..j1 {
        let row = pv.add((j - j0) * a.hd + c0);
        let x: [float32x4_t; 4] = std::array::from_fn(|i| vld1q_f32(row.add(4 * i)));
        for (g, acc) in acc.iter_mut().enumerate() {
            let p = vdupq_n_f32(*pw.add((g0 + g) * a.visible + j));
            for (acc, x) in acc.iter_mut().zip(x) {
                *acc = vfmaq_f32(*acc, p, x);
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (i, v) in acc.iter().enumerate() {
            vst1q_f32(at(g, i), *v);
        }
    }
}
