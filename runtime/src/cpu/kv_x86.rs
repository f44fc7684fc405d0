//! AVX-512 and AVX2 attention kernels over [`super::kv`]'s layout: the same fused multiply-add chains as
//! `kv::key_scores_scalar` and `kv::weighted_values_scalar`, lane by lane, so the same bits.

use std::arch::x86_64::*;
use std::ops::Range;

use half::f16;

use super::kv::{KvElem, KEY_BLOCK};

/// Value rows per pass over a head's output columns: the block stays in L1/L2 while each column chunk reads
/// it (every output element still sums its rows in order).
const VALUE_ROWS: usize = 64;

/// Key blocks ahead that the score kernels prefetch.
const PREFETCH_BLOCKS: usize = 4;

/// An element type the vector kernels widen to f32 on load.
pub(super) trait Lanes: KvElem {
    /// Sixteen elements at `p` as f32.
    unsafe fn load16(p: *const Self) -> __m512;
    /// Eight elements at `p` as f32.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl Lanes for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// What a score kernel reads and writes (bounds checked by `Isa::key_scores`).
struct Scores<T> {
    q: *const f32,
    keys: *const T,
    hd: usize,
    visible: usize,
    scale: f32,
    out: *mut f32,
}

impl<T> Scores<T> {
    fn new(q: &[f32], keys: &[T], hd: usize, visible: usize, scale: f32, out: &mut [f32]) -> Self {
        Self {
            q: q.as_ptr(),
            keys: keys.as_ptr(),
            hd,
            visible,
            scale,
            out: out.as_mut_ptr(),
        }
    }
}

/// How many of the `left` heads still to do a pass takes: `most`, or the largest power of two below it that fits.
fn heads_in_pass(left: usize, most: usize) -> usize {
    let mut h = most;
    while h > left {
        h /= 2;
    }
    h
}

/// `Isa::key_scores` with 16-wide registers: a block's 16 keys are one register per dim.
pub(super) fn key_scores_avx512<T: Lanes>(
    q: &[f32],
    keys: &[T],
    hd: usize,
    visible: usize,
    scale: f32,
    out: &mut [f32],
) {
    let a = Scores::new(q, keys, hd, visible, scale, out);
    // SAFETY: `Isa::Avx512` is only selected after avx512f, avx2, fma and f16c were detected;
    // `Isa::key_scores` checked `q` holds whole heads of `hd`, `out` one row of `visible` per head, and `keys`
    // every block a visible position is in. Stores to a partial block are masked to its visible lanes.
    unsafe { scores_avx512(&a, q.len() / hd) }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn scores_avx512<T: Lanes>(a: &Scores<T>, heads: usize) {
    let blocks = a.visible.div_ceil(KEY_BLOCK);
    // Blocks outside, heads inside: a prefill task's many heads (several positions' groups) each read the two
    // blocks while they are in L1, so the cache streams from memory once per task.
    let mut b = 0;
    while b < blocks {
        let mut g = 0;
        while g < heads {
            // Eight heads × two blocks: sixteen independent chains hide the multiply-add latency.
            let h = heads_in_pass(heads - g, 8);
            if b + 2 <= blocks {
                let bs = [b, b + 1];
                match h {
                    8 => blocks_avx512::<T, 8, 2>(a, g, bs),
                    4 => blocks_avx512::<T, 4, 2>(a, g, bs),
                    2 => blocks_avx512::<T, 2, 2>(a, g, bs),
                    _ => blocks_avx512::<T, 1, 2>(a, g, bs),
                }
            } else {
                let bs = [b];
                match h {
                    8 => blocks_avx512::<T, 8, 1>(a, g, bs),
                    4 => blocks_avx512::<T, 4, 1>(a, g, bs),
                    2 => blocks_avx512::<T, 2, 1>(a, g, bs),
                    _ => blocks_avx512::<T, 1, 1>(a, g, bs),
                }
            }
            g += h;
        }
        b += 2;
    }
}

/// Heads `g0..g0 + H` against blocks `bs`.
#[inline(always)]
unsafe fn blocks_avx512<T: Lanes, const H: usize, const B: usize>(a: &Scores<T>, g0: usize, bs: [usize; B]) {
    let mut acc = [[_mm512_setzero_ps(); B]; H];
    for d in 0..a.hd {
        // The blocks `PREFETCH_BLOCKS` ahead, a line per dim (at depth 8192 in the `attention` bench, 1.41 →
        // 1.24 ms per layer with f16). Past the last block this points beyond the keys: `wrapping_add`, and a
        // prefetch never faults.
        if g0 == 0 {
            for b in bs {
                let ahead = a.keys.wrapping_add(((b + PREFETCH_BLOCKS) * a.hd + d) * KEY_BLOCK);
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
            }
        }
        let k: [__m512; B] = bs.map(|b| T::load16(a.keys.add((b * a.hd + d) * KEY_BLOCK)));
        for (g, acc) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_ps(*a.q.add((g0 + g) * a.hd + d));
            for (acc, k) in acc.iter_mut().zip(k) {
                *acc = _mm512_fmadd_ps(x, k, *acc);
            }
        }
    }
    let s = _mm512_set1_ps(a.scale);
    for (i, b) in bs.iter().enumerate() {
        let j0 = b * KEY_BLOCK;
        let lanes = (a.visible - j0).min(KEY_BLOCK);
        let mask = (((1u32 << lanes) - 1) & 0xffff) as __mmask16;
        for (g, acc) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(a.out.add((g0 + g) * a.visible + j0), mask, _mm512_mul_ps(acc[i], s));
        }
    }
}

/// `Isa::key_scores` with 8-wide registers: a block's 16 keys are two registers per dim.
pub(super) fn key_scores_avx2<T: Lanes>(q: &[f32], keys: &[T], hd: usize, visible: usize, scale: f32, out: &mut [f32]) {
    let a = Scores::new(q, keys, hd, visible, scale, out);
    // SAFETY: `Isa::Avx2` is only selected after avx2, fma and f16c were detected; `Isa::key_scores` checked
    // the bounds as for `key_scores_avx512`. A partial block's scores go through a local array.
    unsafe { scores_avx2(&a, q.len() / hd) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_avx2<T: Lanes>(a: &Scores<T>, heads: usize) {
    // Blocks outside, heads inside, as in `scores_avx512`.
    for b in 0..a.visible.div_ceil(KEY_BLOCK) {
        let mut g = 0;
        while g < heads {
            // Four heads × two halves of a block: eight chains, and room in sixteen registers for the loads.
            let h = heads_in_pass(heads - g, 4);
            match h {
                4 => block_avx2::<T, 4>(a, g, b),
                2 => block_avx2::<T, 2>(a, g, b),
                _ => block_avx2::<T, 1>(a, g, b),
            }
            g += h;
        }
    }
}

#[inline(always)]
unsafe fn block_avx2<T: Lanes, const H: usize>(a: &Scores<T>, g0: usize, b: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; H];
    let base = a.keys.add(b * a.hd * KEY_BLOCK);
    for d in 0..a.hd {
        // As in `blocks_avx512`.
        if g0 == 0 {
            let ahead = base.wrapping_add((PREFETCH_BLOCKS * a.hd + d) * KEY_BLOCK);
            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
        }
        let k = [T::load8(base.add(d * KEY_BLOCK)), T::load8(base.add(d * KEY_BLOCK + 8))];
        for (g, acc) in acc.iter_mut().enumerate() {
            let x = _mm256_set1_ps(*a.q.add((g0 + g) * a.hd + d));
            for (acc, k) in acc.iter_mut().zip(k) {
                *acc = _mm256_fmadd_ps(x, k, *acc);
            }
        }
    }
    let s = _mm256_set1_ps(a.scale);
    let j0 = b * KEY_BLOCK;
    let lanes = (a.visible - j0).min(KEY_BLOCK);
    for (g, acc) in acc.iter().enumerate() {
        let row = a.out.add((g0 + g) * a.visible + j0);
        let v = acc.map(|v| _mm256_mul_ps(v, s));
        if lanes == KEY_BLOCK {
            _mm256_storeu_ps(row, v[0]);
            _mm256_storeu_ps(row.add(8), v[1]);
        } else {
            let mut tmp = [0f32; KEY_BLOCK];
            _mm256_storeu_ps(tmp.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(tmp.as_mut_ptr().add(8), v[1]);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), row, lanes);
        }
    }
}

/// What a weighted-sum kernel reads and writes (bounds checked by `Isa::weighted_values`).
struct Weighted<T> {
    out: *mut f32,
    w: *const f32,
    stride: usize,
    rows: Range<usize>,
    values: *const T,
    hd: usize,
}

impl<T> Weighted<T> {
    fn new(out: &mut [f32], w: &[f32], stride: usize, rows: Range<usize>, values: &[T], hd: usize) -> Self {
        Self {
            out: out.as_mut_ptr(),
            w: w.as_ptr(),
            stride,
            rows,
            values: values.as_ptr(),
            hd,
        }
    }
}

/// Value row `j`, whole: the first column pass over a block of rows fetches the next block's (measured at depth
/// 8192 in the `attention` bench: 1.24 → 1.02 ms per layer with f16). Past the last row this points beyond the
/// values: `wrapping_add`, and a prefetch never faults.
#[inline(always)]
unsafe fn prefetch_row<T>(a: &Weighted<T>, j: usize) {
    let row = a.values.wrapping_add(j * a.hd) as *const i8;
    for line in (0..a.hd * std::mem::size_of::<T>()).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(line));
    }
}

/// `Isa::weighted_values` with 16-wide registers.
pub(super) fn weighted_values_avx512<T: Lanes>(
    out: &mut [f32],
    w: &[f32],
    stride: usize,
    rows: Range<usize>,
    values: &[T],
    hd: usize,
) {
    let heads = out.len() / hd;
    let a = Weighted::new(out, w, stride, rows.clone(), values, hd);
    // SAFETY: `Isa::Avx512` is only selected after avx512f, avx2, fma and f16c were detected;
    // `Isa::weighted_values` checked `out` holds `heads` rows of `hd`, `w` a row of `stride ≥ rows.end`
    // weights per head, and `values` `rows.end` rows of `hd`. Column chunks stay below `hd`; the rest goes
    // element by element.
    unsafe { values_avx512(&a, heads) };
    let wide = hd - hd % 16;
    if wide < hd {
        super::kv::weighted_values_scalar(out, w, stride, rows, values, hd, wide);
    }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn values_avx512<T: Lanes>(a: &Weighted<T>, heads: usize) {
    let (pairs, wide) = (a.hd - a.hd % 32, a.hd - a.hd % 16);
    for j0 in a.rows.clone().step_by(VALUE_ROWS) {
        let j1 = (j0 + VALUE_ROWS).min(a.rows.end);
        let mut g = 0;
        while g < heads {
            // Eight heads × two registers of columns: sixteen chains.
            let h = heads_in_pass(heads - g, 8);
            for c in (0..pairs).step_by(32) {
                match h {
                    8 => cols_avx512::<T, 8, 2>(a, g, c, j0, j1),
                    4 => cols_avx512::<T, 4, 2>(a, g, c, j0, j1),
                    2 => cols_avx512::<T, 2, 2>(a, g, c, j0, j1),
                    _ => cols_avx512::<T, 1, 2>(a, g, c, j0, j1),
                }
            }
            if pairs < wide {
                match h {
                    8 => cols_avx512::<T, 8, 1>(a, g, pairs, j0, j1),
                    4 => cols_avx512::<T, 4, 1>(a, g, pairs, j0, j1),
                    2 => cols_avx512::<T, 2, 1>(a, g, pairs, j0, j1),
                    _ => cols_avx512::<T, 1, 1>(a, g, pairs, j0, j1),
                }
            }
            g += h;
        }
    }
}

/// Heads `g0..g0 + H`, columns `c0..c0 + 16·C`, rows `j0..j1`.
#[inline(always)]
unsafe fn cols_avx512<T: Lanes, const H: usize, const C: usize>(
    a: &Weighted<T>,
    g0: usize,
    c0: usize,
    j0: usize,
    j1: usize,
) {
    let at = |g: usize, i: usize| a.out.add((g0 + g) * a.hd + c0 + 16 * i);
    let mut acc: [[__m512; C]; H] = std::array::from_fn(|g| std::array::from_fn(|i| _mm512_loadu_ps(at(g, i))));
    for j in j0..j1 {
        let row = a.values.add(j * a.hd + c0);
        if g0 == 0 && c0 == 0 {
            prefetch_row(a, j + VALUE_ROWS);
        }
        let x: [__m512; C] = std::array::from_fn(|i| T::load16(row.add(16 * i)));
        for (g, acc) in acc.iter_mut().enumerate() {
            let p = _mm512_set1_ps(*a.w.add((g0 + g) * a.stride + j));
            for (acc, x) in acc.iter_mut().zip(x) {
                *acc = _mm512_fmadd_ps(p, x, *acc);
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (i, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(at(g, i), *v);
        }
    }
}

/// `Isa::weighted_values` with 8-wide registers.
pub(super) fn weighted_values_avx2<T: Lanes>(
    out: &mut [f32],
    w: &[f32],
    stride: usize,
    rows: Range<usize>,
    values: &[T],
    hd: usize,
) {
    let heads = out.len() / hd;
    let a = Weighted::new(out, w, stride, rows.clone(), values, hd);
    // SAFETY: `Isa::Avx2` is only selected after avx2, fma and f16c were detected; bounds as for
    // `weighted_values_avx512`.
    unsafe { values_avx2(&a, heads) };
    let wide = hd - hd % 16;
    if wide < hd {
        super::kv::weighted_values_scalar(out, w, stride, rows, values, hd, wide);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_avx2<T: Lanes>(a: &Weighted<T>, heads: usize) {
    let wide = a.hd - a.hd % 16;
    for j0 in a.rows.clone().step_by(VALUE_ROWS) {
        let j1 = (j0 + VALUE_ROWS).min(a.rows.end);
        let mut g = 0;
        while g < heads {
            // Four heads × two registers of columns: eight chains.
            let h = heads_in_pass(heads - g, 4);
            for c in (0..wide).step_by(16) {
                match h {
                    4 => cols_avx2::<T, 4>(a, g, c, j0, j1),
                    2 => cols_avx2::<T, 2>(a, g, c, j0, j1),
                    _ => cols_avx2::<T, 1>(a, g, c, j0, j1),
                }
            }
            g += h;
        }
    }
}

#[inline(always)]
unsafe fn cols_avx2<T: Lanes, const H: usize>(a: &Weighted<T>, g0: usize, c0: usize, j0: usize, j1: usize) {
    let at = |g: usize, i: usize| a.out.add((g0 + g) * a.hd + c0 + 8 * i);
    let mut acc: [[__m256; 2]; H] = std::array::from_fn(|g| std::array::from_fn(|i| _mm256_loadu_ps(at(g, i))));
    for j in j0..j1 {
        let row = a.values.add(j * a.hd + c0);
        if g0 == 0 && c0 == 0 {
            prefetch_row(a, j + VALUE_ROWS);
        }
        let x = [T::load8(row), T::load8(row.add(8))];
        for (g, acc) in acc.iter_mut().enumerate() {
            let p = _mm256_set1_ps(*a.w.add((g0 + g) * a.stride + j));
            for (acc, x) in acc.iter_mut().zip(x) {
                *acc = _mm256_fmadd_ps(p, x, *acc);
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (i, v) in acc.iter().enumerate() {
            _mm256_storeu_ps(at(g, i), *v);
        }
    }
}
