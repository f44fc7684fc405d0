//! AVX2/FMA and AVX-512 kernels. Callers dispatch here only after runtime feature detection.

use std::arch::x86_64::*;

/// Dot product with four 8-wide FMA accumulators.
pub(super) fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    // SAFETY: `Isa::Avx2`/`Isa::Avx512` are only selected after `is_x86_feature_detected!("avx2")` and
    // `("fma")` returned true; the slices have equal length (asserted), and every load is below `n`.
    unsafe { dot_avx2_impl(a, b) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2_impl(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let x = _mm256_loadu_ps(pa.add(i + 8 * j));
            let y = _mm256_loadu_ps(pb.add(i + 8 * j));
            *acc_j = _mm256_fmadd_ps(x, y, *acc_j);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
        i += 8;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let lo = _mm256_castps256_ps128(s);
    let hi = _mm256_extractf128_ps(s, 1);
    let q = _mm_add_ps(lo, hi);
    let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    let q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    let mut sum = _mm_cvtss_f32(q);
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// Dot product with two 16-wide FMA accumulators.
pub(super) fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot of unequal lengths");
    // SAFETY: `Isa::Avx512` is only selected after `is_x86_feature_detected!("avx512f")` returned true; the
    // slices have equal length (asserted), and every load is below `n`.
    unsafe { dot_avx512_impl(a, b) }
}

#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512_impl(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16)), _mm512_loadu_ps(pb.add(i + 16)), acc1);
        i += 32;
    }
    if i + 16 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        i += 16;
    }
    let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// Unpacks 2-, 4- or 8-bit codes eight at a time with variable shifts.
pub(super) fn unpack_avx2(bits: u32, packed: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert!(packed.len() * 8 >= n * bits as usize, "packed row too short");
    // SAFETY: AVX2 was detected before this ISA was selected; the assert above bounds every read, and
    // every write is to `out[..n]`.
    unsafe { unpack_avx2_impl(bits, packed, out) }
}

#[target_feature(enable = "avx2")]
unsafe fn unpack_avx2_impl(bits: u32, packed: &[u8], out: &mut [f32]) {
    let n = out.len();
    let po = out.as_mut_ptr();
    let mut k = 0;
    match bits {
        8 => {
            while k + 8 <= n {
                let b = _mm_loadl_epi64(packed.as_ptr().add(k) as *const __m128i);
                _mm256_storeu_ps(po.add(k), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
                k += 8;
            }
        }
        4 => {
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let mask = _mm256_set1_epi32(0xf);
            while k + 8 <= n {
                let w = u32::from_le_bytes([packed[k / 2], packed[k / 2 + 1], packed[k / 2 + 2], packed[k / 2 + 3]]);
                let v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts), mask);
                _mm256_storeu_ps(po.add(k), _mm256_cvtepi32_ps(v));
                k += 8;
            }
        }
        2 => {
            let lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
            let hi = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
            let mask = _mm256_set1_epi32(0x3);
            while k + 16 <= n {
                let j = k / 4;
                let w = _mm256_set1_epi32(
                    u32::from_le_bytes([packed[j], packed[j + 1], packed[j + 2], packed[j + 3]]) as i32,
                );
                let a = _mm256_and_si256(_mm256_srlv_epi32(w, lo), mask);
                let b = _mm256_and_si256(_mm256_srlv_epi32(w, hi), mask);
                _mm256_storeu_ps(po.add(k), _mm256_cvtepi32_ps(a));
                _mm256_storeu_ps(po.add(k + 8), _mm256_cvtepi32_ps(b));
                k += 16;
            }
        }
        _ => {}
    }
    // Tail (and unsupported widths): the scalar bit-stream reader, starting at code k.
    if k < n {
        let start_bit = k * bits as usize;
        debug_assert_eq!(start_bit % 8, 0);
        super::scalar::unpack(bits, &packed[start_bit / 8..], &mut out[k..]);
    }
}

/// Elements of `x` per fused 4-bit step: 16 packed bytes (AVX-512) or 8 (AVX2), i.e. 32 or 16 codes.
pub(super) fn q4_chunk(avx512: bool) -> usize {
    if avx512 {
        32
    } else {
        16
    }
}

/// Reorders each chunk of `x` to the lane order the fused 4-bit kernels produce codes in: a byte's low
/// nibble is the even element, its high nibble the odd one, so a chunk becomes `[x0, x2, …, x1, x3, …]`.
pub(super) fn permute_for_q4(chunk: usize, x: &[f32], out: &mut [f32]) {
    let half = chunk / 2;
    for (src, dst) in x.chunks_exact(chunk).zip(out.chunks_exact_mut(chunk)) {
        for i in 0..half {
            dst[i] = src[2 * i];
            dst[half + i] = src[2 * i + 1];
        }
    }
}

/// What a fused row kernel needs besides the packed row: activations prepared for the width, per-group sums
/// of `x`, and this row's scales and biases as f32.
pub(super) struct RowArgs<'a> {
    pub packed: &'a [u8],
    pub xp: &'a [f32],
    pub xsum: &'a [f32],
    pub scales: &'a [f32],
    pub biases: &'a [f32],
    pub group: usize,
}

/// `Σ_g scale_g·(q_g·x_g) + bias_g·Σx_g` for one 4- or 8-bit row, unpacking codes in registers.
pub(super) fn fused_row(avx512: bool, bits: u32, a: &RowArgs<'_>) -> f32 {
    let cols = a.xp.len();
    let groups = cols / a.group.max(1);
    // The kernels below are 4-bit and 8-bit: any other width would read past a row of its own size.
    assert!(matches!(bits, 4 | 8), "4- or 8-bit codes");
    assert!(a.packed.len() * 8 >= cols * bits as usize, "row bounds");
    assert!(
        a.xsum.len() >= groups && a.scales.len() >= groups && a.biases.len() >= groups,
        "group bounds"
    );
    assert!(
        a.group.is_multiple_of(32) && cols.is_multiple_of(a.group),
        "groups of a multiple of 32"
    );
    // SAFETY: AVX2+FMA (and AVX-512F when `avx512`) were detected before these ISAs were selected; the asserts
    // above bound every packed read (cols·bits/8 bytes), every `xp` read (cols floats) and every unchecked
    // scale read (g < groups), and each chunk lies inside one group.
    unsafe {
        match (avx512, bits) {
            (true, 4) => fused_q4_avx512(a),
            (true, _) => fused_q8_avx512(a),
            (false, 4) => fused_q4_avx2(a),
            (false, _) => fused_q8_avx2(a),
        }
    }
}

/// The bias part of a row: `Σ_g bias_g·Σx_g`.
#[inline(always)]
fn bias_term(a: &RowArgs<'_>) -> f32 {
    a.biases.iter().zip(a.xsum).map(|(b, s)| b * s).sum()
}

#[target_feature(enable = "avx512f")]
unsafe fn fused_q4_avx512(a: &RowArgs<'_>) -> f32 {
    let (pp, xp) = (a.packed.as_ptr(), a.xp.as_ptr());
    let mask = _mm512_set1_epi32(0xf);
    let mut acc = _mm512_setzero_ps();
    for g in 0..a.xp.len() / a.group {
        let (mut p0, mut p1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(g * a.group / 2 + PREFETCH_AHEAD) as *const i8);
        for off in (g * a.group..(g + 1) * a.group).step_by(32) {
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(pp.add(off / 2) as *const __m128i));
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
            p0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp.add(off)), p0);
            p1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp.add(off + 16)), p1);
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(*a.scales.get_unchecked(g)), _mm512_add_ps(p0, p1), acc);
    }
    _mm512_reduce_add_ps(acc) + bias_term(a)
}

/// A run of rows of one 4-bit matrix against every token of a call, for [`fused_q4_block_avx512`].
pub(super) struct Q4Block<'a> {
    /// The rows' packed codes, `rows × row_bytes`.
    pub packed: &'a [u8],
    /// Bytes per packed row.
    pub row_bytes: usize,
    /// Per row, its scales then its biases as f32: `rows × 2·groups`.
    pub sb: &'a [f32],
    /// Activations permuted for the 4-bit lanes (see [`permute_for_q4`]), `[n, cols]`.
    pub xp: &'a [f32],
    /// Per-token group sums of `x`, `[n, groups]`.
    pub xsum: &'a [f32],
    /// Columns per group.
    pub group: usize,
}

/// `out[r·n + t] = row r · token t` for `rows` rows and `n` tokens with the fused AVX-512 4-bit kernel, two rows
/// and up to four tokens per pass: each chunk of codes is unpacked once and used for every token, and two rows'
/// loads overlap. For each (row, token) the operations and their order are exactly [`fused_row`]'s, so the
/// result is bit-identical to it whatever the blocking.
pub(super) fn fused_q4_block_avx512(b: &Q4Block<'_>, rows: usize, n: usize, out: &mut [f32]) {
    let cols = b.row_bytes * 2;
    let groups = cols / b.group.max(1);
    assert!(
        b.group.is_multiple_of(32) && cols.is_multiple_of(b.group),
        "groups of a multiple of 32"
    );
    assert!(
        b.packed.len() >= rows * b.row_bytes && b.sb.len() >= rows * 2 * groups,
        "row bounds"
    );
    assert!(
        b.xp.len() >= n * cols && b.xsum.len() >= n * groups && out.len() >= rows * n,
        "token bounds"
    );
    let mut r = 0;
    while r < rows {
        let two = rows - r >= 2;
        let mut t = 0;
        while t < n {
            let tk = (n - t).min(4);
            // SAFETY: AVX-512F was detected before `Isa::Avx512` was selected; the asserts bound every read:
            // rows r..r+2 (or r+1) < rows, tokens t..t+tk ≤ n, codes cols/2 bytes per row, activations cols per
            // token, scales/biases 2·groups per row. Prefetches past the end never fault.
            unsafe {
                match (two, tk) {
                    (true, 4) => q4_block::<2, 4>(b, r, t, n, out),
                    (true, 3) => q4_block::<2, 3>(b, r, t, n, out),
                    (true, 2) => q4_block::<2, 2>(b, r, t, n, out),
                    (true, _) => q4_block::<2, 1>(b, r, t, n, out),
                    (false, 4) => q4_block::<1, 4>(b, r, t, n, out),
                    (false, 3) => q4_block::<1, 3>(b, r, t, n, out),
                    (false, 2) => q4_block::<1, 2>(b, r, t, n, out),
                    (false, _) => q4_block::<1, 1>(b, r, t, n, out),
                }
            }
            t += tk;
        }
        r += if two { 2 } else { 1 };
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn q4_block<const R: usize, const T: usize>(b: &Q4Block<'_>, r0: usize, t0: usize, n: usize, out: &mut [f32]) {
    let cols = b.row_bytes * 2;
    let groups = cols / b.group;
    let mask = _mm512_set1_epi32(0xf);
    let pp: [*const u8; R] = std::array::from_fn(|i| b.packed.as_ptr().add((r0 + i) * b.row_bytes));
    let xp: [*const f32; T] = std::array::from_fn(|j| b.xp.as_ptr().add((t0 + j) * cols));
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for g in 0..groups {
        let mut p0 = [[_mm512_setzero_ps(); T]; R];
        let mut p1 = [[_mm512_setzero_ps(); T]; R];
        for p in pp {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(g * b.group / 2 + PREFETCH_AHEAD) as *const i8);
        }
        for off in (g * b.group..(g + 1) * b.group).step_by(32) {
            for i in 0..R {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(pp[i].add(off / 2) as *const __m128i));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                for j in 0..T {
                    p0[i][j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp[j].add(off)), p0[i][j]);
                    p1[i][j] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp[j].add(off + 16)), p1[i][j]);
                }
            }
        }
        for i in 0..R {
            let scale = _mm512_set1_ps(*b.sb.get_unchecked((r0 + i) * 2 * groups + g));
            for j in 0..T {
                acc[i][j] = _mm512_fmadd_ps(scale, _mm512_add_ps(p0[i][j], p1[i][j]), acc[i][j]);
            }
        }
    }
    for i in 0..R {
        let sb = &b.sb[(r0 + i) * 2 * groups..(r0 + i + 1) * 2 * groups];
        for j in 0..T {
            let a = RowArgs {
                packed: &[],
                xp: &[],
                xsum: &b.xsum[(t0 + j) * groups..(t0 + j + 1) * groups],
                scales: &sb[..groups],
                biases: &sb[groups..],
                group: b.group,
            };
            out[(r0 + i) * n + t0 + j] = _mm512_reduce_add_ps(acc[i][j]) + bias_term(&a);
        }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn fused_q8_avx512(a: &RowArgs<'_>) -> f32 {
    let (pp, xp) = (a.packed.as_ptr(), a.xp.as_ptr());
    let mut acc = _mm512_setzero_ps();
    for g in 0..a.xp.len() / a.group {
        let (mut p0, mut p1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(g * a.group + PREFETCH_AHEAD) as *const i8);
        for off in (g * a.group..(g + 1) * a.group).step_by(32) {
            let v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(pp.add(off) as *const __m128i));
            let v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(pp.add(off + 16) as *const __m128i));
            p0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), _mm512_loadu_ps(xp.add(off)), p0);
            p1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), _mm512_loadu_ps(xp.add(off + 16)), p1);
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(*a.scales.get_unchecked(g)), _mm512_add_ps(p0, p1), acc);
    }
    _mm512_reduce_add_ps(acc) + bias_term(a)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn hsum256(v: __m256) -> f32 {
    let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn fused_q4_avx2(a: &RowArgs<'_>) -> f32 {
    let (pp, xp) = (a.packed.as_ptr(), a.xp.as_ptr());
    let mask = _mm256_set1_epi32(0xf);
    let mut acc = _mm256_setzero_ps();
    for g in 0..a.xp.len() / a.group {
        let mut p = [_mm256_setzero_ps(); 4];
        _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(g * a.group / 2 + PREFETCH_AHEAD) as *const i8);
        for (i, off) in (g * a.group..(g + 1) * a.group).step_by(16).enumerate() {
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(pp.add(off / 2) as *const __m128i));
            let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
            let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
            let j = 2 * (i & 1);
            p[j] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp.add(off)), p[j]);
            p[j + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp.add(off + 8)), p[j + 1]);
        }
        let sum = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(*a.scales.get_unchecked(g)), sum, acc);
    }
    hsum256(acc) + bias_term(a)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn fused_q8_avx2(a: &RowArgs<'_>) -> f32 {
    let (pp, xp) = (a.packed.as_ptr(), a.xp.as_ptr());
    let mut acc = _mm256_setzero_ps();
    for g in 0..a.xp.len() / a.group {
        let mut p = [_mm256_setzero_ps(); 4];
        _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(g * a.group + PREFETCH_AHEAD) as *const i8);
        for (i, off) in (g * a.group..(g + 1) * a.group).step_by(8).enumerate() {
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(pp.add(off) as *const __m128i));
            p[i & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_loadu_ps(xp.add(off)), p[i & 3]);
        }
        let sum = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(*a.scales.get_unchecked(g)), sum, acc);
    }
    hsum256(acc) + bias_term(a)
}

/// Rows of an int8-activation kernel against `tokens` tokens: `rows` packed rows of `row_bytes` each, and the
/// tokens' quantized activations (`cols` each, back to back) in the kernel's order with per-lane block scales
/// and group sums.
#[derive(Clone, Copy)]
pub(super) struct Q8RowsArgs<'a> {
    pub packed: &'a [u8],
    pub row_bytes: usize,
    pub rows: usize,
    pub tokens: usize,
    pub cols: usize,
    pub xq: &'a [i8],
    pub lane_d: &'a [f32],
    pub xsum: &'a [f32],
    pub group: usize,
}

/// The rows' scales and biases in their stored type (`size` bytes each).
pub(super) struct RawScales<'a> {
    pub scales: &'a [u8],
    pub biases: &'a [u8],
    pub ty: super::FloatType,
    pub size: usize,
}

/// `out[r·ostride + t] = Σ scale·d·(q·xq) + Σ bias·Σx` for each row `r` and token `t`, with integer dot
/// products, reading scales and biases from `raw`. The 4-bit kernels and the AVX2 8-bit one take four tokens
/// per pass over the rows when given four (each code load serves every token); the AVX-512 8-bit one runs one
/// token at a time. A token's result is the same either way.
pub(super) fn q8_rows(
    k: super::q8::Q8Kernel,
    a: &Q8RowsArgs<'_>,
    raw: &RawScales<'_>,
    out: &mut [f32],
    ostride: usize,
) {
    let cols = a.cols;
    let groups = cols / a.group;
    let lanes = cols / k.lane_cols();
    // Row-major 4- and 8-bit kernels only: band and tiled matrices have their own entry points, whose lane
    // scales this one's bounds would not cover.
    assert!(
        matches!(k.bits, 4 | 8) && !k.band && !k.tiled,
        "a row-major 4- or 8-bit kernel"
    );
    assert!(
        cols.is_multiple_of(k.chunk()) && matches!(a.group, 32 | 64 | 128) && cols.is_multiple_of(a.group),
        "kernel shape"
    );
    assert!(
        a.row_bytes * 8 >= cols * k.bits as usize && a.packed.len() >= a.rows * a.row_bytes,
        "row bounds"
    );
    assert!((1..=4).contains(&a.tokens) && ostride >= a.tokens, "token count");
    assert!(
        a.xq.len() >= a.tokens * cols && a.lane_d.len() >= a.tokens * lanes && a.xsum.len() >= a.tokens * groups,
        "activation bounds"
    );
    assert!(
        a.rows == 0 || out.len() >= (a.rows - 1) * ostride + a.tokens,
        "output bounds"
    );
    assert!(raw.size == raw.ty.size(), "scale type");
    assert!(
        raw.scales.len() >= a.rows * groups * raw.size && raw.biases.len() >= a.rows * groups * raw.size,
        "group bounds"
    );
    // The instruction set each kernel uses, checked here too (cached): a kernel description is plain data.
    assert_int8_isa(k.avx512);
    // The 4-bit kernels and the AVX2 8-bit one take one or four tokens per pass; the AVX-512 8-bit one one at a
    // time.
    if a.tokens > 1 && !((k.bits == 4 || !k.avx512) && a.tokens == 4) {
        for t in 0..a.tokens {
            let one = Q8RowsArgs {
                tokens: 1,
                xq: &a.xq[t * cols..],
                lane_d: &a.lane_d[t * lanes..],
                xsum: &a.xsum[t * groups..],
                ..*a
            };
            q8_rows(k, &one, raw, &mut out[t..], ostride);
        }
        return;
    }
    use super::FloatType as F;
    // SAFETY: the kernel's instruction set is detected above (AVX2+FMA+F16C, or for `avx512` AVX-512
    // F/BW/VL/VNNI); the asserts bound every read: codes
    // (rows·row_bytes, cols·bits/8 per row), activations (tokens·cols), lane scales (tokens·cols/lane_cols),
    // scales and biases (rows·groups values, whole groups per row; AVX-512 loads are masked to the values
    // needed; AVX2 reads a whole four-step chunk's values unaligned, copies a short last chunk's and a row's last
    // biases into zeroed buffers, and masks a short last chunk's lane scales; the AVX2 8-bit kernel reads one
    // scale per group, each 32-column block's codes and activations as two 16-byte halves ending at most at
    // cols ≤ row_bytes, and one lane scale per block, t·blocks + b < tokens·lanes), and every write (row r, token
    // t at r·ostride + t). Prefetches past the end never fault.
    unsafe {
        match (k.bits, k.avx512, raw.ty, a.tokens) {
            (4, true, F::F32, 4) => q4_vnni_raw::<TY_F32, 4>(a, raw, out, ostride),
            (4, true, F::F16, 4) => q4_vnni_raw::<TY_F16, 4>(a, raw, out, ostride),
            (4, true, F::BF16, 4) => q4_vnni_raw::<TY_BF16, 4>(a, raw, out, ostride),
            (4, true, F::F32, _) => q4_vnni_raw::<TY_F32, 1>(a, raw, out, ostride),
            (4, true, F::F16, _) => q4_vnni_raw::<TY_F16, 1>(a, raw, out, ostride),
            (4, true, F::BF16, _) => q4_vnni_raw::<TY_BF16, 1>(a, raw, out, ostride),
            (4, false, F::F32, _) => q4_maddubs_for::<TY_F32>(a, raw, out, ostride),
            (4, false, F::F16, _) => q4_maddubs_for::<TY_F16>(a, raw, out, ostride),
            (4, false, F::BF16, _) => q4_maddubs_for::<TY_BF16>(a, raw, out, ostride),
            (_, false, F::F32, 4) => q8_madd_avx2::<TY_F32, 1, 4>(a, raw, out, ostride),
            (_, false, F::F16, 4) => q8_madd_avx2::<TY_F16, 1, 4>(a, raw, out, ostride),
            (_, false, F::BF16, 4) => q8_madd_avx2::<TY_BF16, 1, 4>(a, raw, out, ostride),
            (_, false, F::F32, _) => q8_madd_avx2::<TY_F32, 2, 1>(a, raw, out, ostride),
            (_, false, F::F16, _) => q8_madd_avx2::<TY_F16, 2, 1>(a, raw, out, ostride),
            (_, false, F::BF16, _) => q8_madd_avx2::<TY_BF16, 2, 1>(a, raw, out, ostride),
            (_, _, F::F32, _) => q8_vnni_raw::<TY_F32>(a, raw, out, ostride),
            (_, _, F::F16, _) => q8_vnni_raw::<TY_F16>(a, raw, out, ostride),
            (_, _, F::BF16, _) => q8_vnni_raw::<TY_BF16>(a, raw, out, ostride),
        }
    }
}

/// How far ahead of the current code bytes the int8 kernels prefetch. A prefetch address past the end of the
/// matrix is harmless (prefetches never fault).
const PREFETCH_AHEAD: usize = 4096;

/// Lane → group index pattern: lane `i` covers columns `lane_cols·i ..`, in group `lane_cols·i / group`
/// relative to the step's first group.
fn group_lanes<const N: usize>(lane_cols: usize, group: usize) -> [i32; N] {
    std::array::from_fn(|i| (lane_cols * i / group) as i32)
}

/// Scale/bias storage the int8 kernels read directly: f32, f16 or bf16.
const TY_F32: u8 = 0;
const TY_F16: u8 = 1;
const TY_BF16: u8 = 2;

/// Up to 16 scale values (`count` ≤ 16, lanes beyond are zero) of type `TY` at `p`, as f32; masked, so it
/// never reads past the `count` values.
#[inline(always)]
unsafe fn load_scales<const TY: u8>(p: *const u8, count: usize) -> __m512 {
    let k = ((1u32 << count) - 1) as u16;
    match TY {
        TY_F32 => _mm512_maskz_loadu_ps(k, p as *const f32),
        TY_F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p as *const i16)),
        _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(k, p as *const i16),
        ))),
    }
}

/// `Σ_g bias_g·xsum_g` with biases of type `TY` at `b`.
#[inline(always)]
unsafe fn bias_dot_raw<const TY: u8>(b: *const u8, xsum: *const f32, groups: usize, size: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    let mut g = 0;
    while g < groups {
        let count = (groups - g).min(16);
        let k = ((1u32 << count) - 1) as u16;
        acc = _mm512_fmadd_ps(
            load_scales::<TY>(b.add(g * size), count),
            _mm512_maskz_loadu_ps(k, xsum.add(g)),
            acc,
        );
        g += 16;
    }
    _mm512_reduce_add_ps(acc)
}

/// The block of `ROWS` rows from `r` that an int8 kernel takes per pass: each row's index (a short last
/// block repeats its final row, computed twice and stored once), its codes, and where the block's prefetch
/// stream starts. The block's rows are contiguous, so the kernels prefetch the bytes `PREFETCH_AHEAD` past
/// them in address order, as fast as the rows consume theirs: prefetching each row's own stream instead was
/// 30% slower from DRAM (the hardware prefetcher follows one linear stream better than interleaved ones).
///
/// Safety: `r < a.rows` and `a.packed` holds `a.rows · a.row_bytes` bytes.
#[inline(always)]
unsafe fn row_block<const ROWS: usize>(a: &Q8RowsArgs<'_>, r: usize) -> ([usize; ROWS], [*const u8; ROWS], *const u8) {
    let rs: [usize; ROWS] = std::array::from_fn(|j| (r + j).min(a.rows - 1));
    let pp = std::array::from_fn(|j| a.packed.as_ptr().add(rs[j] * a.row_bytes));
    (rs, pp, a.packed.as_ptr().wrapping_add(r * a.row_bytes + PREFETCH_AHEAD))
}

/// The AVX-512 4-bit kernel reading scales and biases in their stored type (no conversion pass), against
/// `T` tokens at once: each row's codes and scales are loaded and unpacked once for all of them. Every
/// (row, token) result takes the same operations in the same order whatever `T` is.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_vnni_raw<const TY: u8, const T: usize>(
    a: &Q8RowsArgs<'_>,
    raw: &RawScales<'_>,
    out: &mut [f32],
    ostride: usize,
) {
    let (xq, ld, cols) = (a.xq.as_ptr(), a.lane_d.as_ptr(), a.cols);
    let groups = cols / a.group;
    let size = raw.size;
    let m = _mm512_set1_epi8(0x0f);
    let idx = _mm512_loadu_si512(group_lanes::<16>(8, a.group).as_ptr() as *const _);
    // Groups per 128-column step (group is 32, 64 or 128).
    let step = 128 / a.group;
    // ROWS rows at a time: the activation loads are shared and the accumulator chains overlap.
    const ROWS: usize = 2;
    let mut r = 0;
    while r < a.rows {
        let (rs, pp, ahead) = row_block::<ROWS>(a, r);
        let sp: [*const u8; ROWS] = std::array::from_fn(|j| raw.scales.as_ptr().add(rs[j] * groups * size));
        let mut acc = [[_mm512_setzero_ps(); T]; ROWS];
        for c in 0..cols / 128 {
            for j in 0..ROWS {
                // Keep more lines in flight than the hardware prefetcher does for this access pattern.
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * (c * ROWS + j)) as *const i8);
                let v = _mm512_loadu_si512(pp[j].add(64 * c) as *const _);
                let (lo, hi) = (_mm512_and_si512(v, m), _mm512_and_si512(_mm512_srli_epi32::<4>(v), m));
                let s = _mm512_permutexvar_ps(idx, load_scales::<TY>(sp[j].add(step * c * size), step));
                for (t, acc) in acc[j].iter_mut().enumerate() {
                    let x = xq.add(t * cols + 128 * c);
                    let xe = _mm512_loadu_si512(x as *const _);
                    let xo = _mm512_loadu_si512(x.add(64) as *const _);
                    let d = _mm512_loadu_ps(ld.add(t * cols / 8 + 16 * c));
                    let i = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(d, s), *acc);
                }
            }
        }
        let b = raw.biases.as_ptr();
        for j in 0..ROWS.min(a.rows - r) {
            for (t, acc) in acc[j].iter().enumerate() {
                let xsum = a.xsum.as_ptr().add(t * groups);
                let bias = bias_dot_raw::<TY>(b.add(rs[j] * groups * size), xsum, groups, size);
                *out.get_unchecked_mut((r + j) * ostride + t) = _mm512_reduce_add_ps(*acc) + bias;
            }
        }
        r += ROWS;
    }
}

/// The AVX-512 8-bit kernel reading scales and biases in their stored type.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_vnni_raw<const TY: u8>(a: &Q8RowsArgs<'_>, raw: &RawScales<'_>, out: &mut [f32], ostride: usize) {
    let (xq, ld) = (a.xq.as_ptr(), a.lane_d.as_ptr());
    let groups = a.cols / a.group;
    let size = raw.size;
    let idx = _mm512_loadu_si512(group_lanes::<16>(4, a.group).as_ptr() as *const _);
    for r in 0..a.rows {
        let o = out.get_unchecked_mut(r * ostride);
        let pp = a.packed.as_ptr().add(r * a.row_bytes);
        let sc = raw.scales.as_ptr().add(r * groups * size);
        let mut acc = _mm512_setzero_ps();
        for c in 0..a.cols / 64 {
            _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(64 * c + PREFETCH_AHEAD) as *const i8);
            let v = _mm512_loadu_si512(pp.add(64 * c) as *const _);
            let x = _mm512_loadu_si512(xq.add(64 * c) as *const _);
            let i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, x);
            // This step's groups: from column 64c, 64/group of them (at least one).
            let (g0, count) = (64 * c / a.group, (64 / a.group).max(1));
            let s = _mm512_permutexvar_ps(idx, load_scales::<TY>(sc.add(g0 * size), count));
            let f = _mm512_mul_ps(_mm512_loadu_ps(ld.add(16 * c)), s);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), f, acc);
        }
        let bias = bias_dot_raw::<TY>(
            raw.biases.as_ptr().add(r * groups * size),
            a.xsum.as_ptr(),
            groups,
            size,
        );
        *o = _mm512_reduce_add_ps(acc) + bias;
    }
}

/// The AVX2 8-bit kernel (no VNNI), `R` rows and `T` tokens per pass. Codes and activations are widened to
/// i16, so `vpmaddwd` sums their products exactly in i32 (`vpmaddubsw` on 8-bit codes could saturate: a pair
/// reaches 2·255·127 > 32767). Per row and token, each 32-column block's eight i32 lanes (four columns each)
/// multiply-add `scale·d` into one accumulator in block order, reduced by `hsum256` and then `Σ bias·Σx` added:
/// the same operations whatever `R` and `T` are.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_madd_avx2<const TY: u8, const R: usize, const T: usize>(
    a: &Q8RowsArgs<'_>,
    raw: &RawScales<'_>,
    out: &mut [f32],
    ostride: usize,
) {
    use super::q8::BLOCK;
    let (cols, groups, size) = (a.cols, a.cols / a.group, raw.size);
    let (blocks, per_group) = (cols / BLOCK, a.group / BLOCK);
    let (xq, ld) = (a.xq.as_ptr(), a.lane_d.as_ptr());
    let mut r = 0;
    while r < a.rows {
        let (rs, pp, ahead) = row_block::<R>(a, r);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for g in 0..groups {
            let mut s = [0f32; R];
            for j in 0..R {
                s[j] = load1::<TY>(raw.scales.as_ptr().add((rs[j] * groups + g) * size));
            }
            for b in g * per_group..(g + 1) * per_group {
                // The pass's rows consume 32·R bytes per block: prefetch as many, in address order.
                for line in (0..BLOCK * R).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(BLOCK * R * b + line) as *const i8);
                }
                let mut x = [[_mm256_setzero_si256(); 2]; T];
                let mut d = [0f32; T];
                for t in 0..T {
                    let p = xq.add(t * cols + BLOCK * b);
                    x[t][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const _));
                    x[t][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16) as *const _));
                    d[t] = *ld.add(t * blocks + b);
                }
                for j in 0..R {
                    let p = pp[j].add(BLOCK * b);
                    let c0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const _));
                    let c1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(16) as *const _));
                    for t in 0..T {
                        let i = _mm256_add_epi32(_mm256_madd_epi16(c0, x[t][0]), _mm256_madd_epi16(c1, x[t][1]));
                        let f = _mm256_set1_ps(s[j] * d[t]);
                        acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), f, acc[j][t]);
                    }
                }
            }
        }
        store_rows_avx2::<TY, R, T>(a, raw, r, &rs, &acc, out, ostride);
        r += R;
    }
}

/// The AVX2 int8 kernels' results for the pass's rows from `r` (indices `rs`, a repeated last row stored once):
/// each row's and token's accumulator reduced by `hsum256`, plus `Σ bias·Σx`.
#[inline(always)]
unsafe fn store_rows_avx2<const TY: u8, const R: usize, const T: usize>(
    a: &Q8RowsArgs<'_>,
    raw: &RawScales<'_>,
    r: usize,
    rs: &[usize; R],
    acc: &[[__m256; T]; R],
    out: &mut [f32],
    ostride: usize,
) {
    let (groups, size, b) = (a.cols / a.group, raw.size, raw.biases.as_ptr());
    for j in 0..R.min(a.rows - r) {
        for (t, acc) in acc[j].iter().enumerate() {
            let xsum = a.xsum.as_ptr().add(t * groups);
            let bias = bias_dot_raw8::<TY>(b.add(rs[j] * groups * size), xsum, groups, size);
            *out.get_unchecked_mut((r + j) * ostride + t) = hsum256(*acc) + bias;
        }
    }
}

/// One value of type `TY` at `p` as f32.
#[inline(always)]
unsafe fn load1<const TY: u8>(p: *const u8) -> f32 {
    let half = || std::ptr::read_unaligned(p as *const u16);
    match TY {
        TY_F32 => std::ptr::read_unaligned(p as *const f32),
        TY_F16 => _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(half())))),
        _ => f32::from_bits(u32::from(half()) << 16),
    }
}

/// The AVX2 4-bit kernel (no VNNI) for group size `G`: `vpmaddubsw` pairs, `R` rows and `T` tokens per pass
/// (each code load and unpack serves every token). Four 64-column steps make a chunk: two levels of `vphaddw`
/// fold their i16 lanes and one `vpmaddwd` widens them into the chunk's eight 32-column block sums (a step's
/// lane sums at most 7620 in magnitude, so four of them fit i16), which meet the blocks' `scale·d` in one
/// conversion and one multiply-add: a quarter of the widening and float work of finishing every step alone.
/// Scales and biases are read in their stored type. Every (row, token) result takes the same operations in the
/// same order whatever `R` and `T` are.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_maddubs<const TY: u8, const G: usize, const R: usize, const T: usize>(
    a: &Q8RowsArgs<'_>,
    raw: &RawScales<'_>,
    out: &mut [f32],
    ostride: usize,
) {
    let (cols, groups, size) = (a.cols, a.cols / G, raw.size);
    let steps = cols / 64;
    let mut r = 0;
    while r < a.rows {
        let (rs, pp, ahead) = row_block::<R>(a, r);
        let mut rows = ChunkRows::<R> {
            col: 0,
            pp,
            ahead,
            sp: std::array::from_fn(|j| raw.scales.as_ptr().add(rs[j] * groups * size)),
        };
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for _ in 0..steps / 4 {
            maddubs_chunk::<TY, G, R, T, 4>(a, &rows, size, &mut acc);
            rows.advance::<G>(4, size);
        }
        // A short last chunk sums zeros for its missing steps and meets zero scales there.
        match steps % 4 {
            1 => maddubs_chunk::<TY, G, R, T, 1>(a, &rows, size, &mut acc),
            2 => maddubs_chunk::<TY, G, R, T, 2>(a, &rows, size, &mut acc),
            3 => maddubs_chunk::<TY, G, R, T, 3>(a, &rows, size, &mut acc),
            _ => {}
        }
        store_rows_avx2::<TY, R, T>(a, raw, r, &rs, &acc, out, ostride);
        r += R;
    }
}

/// Where the AVX2 4-bit kernel's rows stand: the current chunk's first column, and the rows' codes, scales
/// and prefetch stream there.
struct ChunkRows<const R: usize> {
    col: usize,
    pp: [*const u8; R],
    ahead: *const u8,
    sp: [*const u8; R],
}

impl<const R: usize> ChunkRows<R> {
    /// Moves on by `steps` 64-column steps.
    #[inline(always)]
    unsafe fn advance<const G: usize>(&mut self, steps: usize, size: usize) {
        for j in 0..R {
            self.pp[j] = self.pp[j].add(32 * steps);
            self.sp[j] = self.sp[j].add(64 * steps / G * size);
        }
        self.ahead = self.ahead.wrapping_add(32 * R * steps);
        self.col += 64 * steps;
    }
}

/// One chunk of `N` ≤ 4 steps of [`q4_maddubs`] (from column `rows.col`), added into `acc`. Plain loops: closures
/// handed to `array::from_fn` here were called through `from_fn`, which lacks the caller's target features, so
/// the intrinsics inside them were not inlined.
#[inline(always)]
unsafe fn maddubs_chunk<const TY: u8, const G: usize, const R: usize, const T: usize, const N: usize>(
    a: &Q8RowsArgs<'_>,
    rows: &ChunkRows<R>,
    size: usize,
    acc: &mut [[__m256; T]; R],
) {
    let (ones, zero) = (_mm256_set1_epi16(1), _mm256_setzero_si256());
    // The tree leaves the chunk's blocks 0, 2, 4, 6 in i32 lanes 0–3 and 1, 3, 5, 7 in lanes 4–7, each the sum
    // of at most four lanes of 7620, so no i16 lane overflows on the way.
    let mut low = [[zero; T]; R];
    let mut high = [[zero; T]; R];
    maddubs_pair::<R, T>(a, rows, 0, N.min(2), &mut low);
    if N > 2 {
        maddubs_pair::<R, T>(a, rows, 2, N - 2, &mut high);
    }
    let order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let blocks = a.cols / super::q8::BLOCK;
    let mut d = [_mm256_setzero_ps(); T];
    for (t, d) in d.iter_mut().enumerate() {
        let p = a.lane_d.as_ptr().add(t * blocks + rows.col / super::q8::BLOCK);
        let v = if N == 4 {
            _mm256_loadu_ps(p)
        } else {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * N as i32), lanes))
        };
        *d = _mm256_permutevar8x32_ps(v, order);
    }
    for j in 0..R {
        let sc = chunk_scales::<TY, G>(rows.sp[j], size, N);
        for t in 0..T {
            let sums = _mm256_madd_epi16(_mm256_hadd_epi16(low[j][t], high[j][t]), ones);
            acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(sc, d[t]), acc[j][t]);
        }
    }
}

/// Steps `first` and `first + 1` of the chunk at `rows` (only the first when `n` is 1), each row's and token's
/// i16 lanes folded pairwise (`vphaddw`) into `out`; a missing second step adds zeros.
#[inline(always)]
unsafe fn maddubs_pair<const R: usize, const T: usize>(
    a: &Q8RowsArgs<'_>,
    rows: &ChunkRows<R>,
    first: usize,
    n: usize,
    out: &mut [[__m256i; T]; R],
) {
    let zero = _mm256_setzero_si256();
    let (mut even, mut odd) = ([[zero; T]; R], [[zero; T]; R]);
    maddubs_step(a, rows, first, &mut even);
    if n > 1 {
        maddubs_step(a, rows, first + 1, &mut odd);
    }
    for ((o, e), d) in out.iter_mut().zip(&even).zip(&odd) {
        for ((o, e), d) in o.iter_mut().zip(e).zip(d) {
            *o = _mm256_hadd_epi16(*e, *d);
        }
    }
}

/// Step `s` of the chunk at `rows`: each row's and token's i16 lanes (lane `i`: columns 4i..4i+4 of the step).
#[inline(always)]
unsafe fn maddubs_step<const R: usize, const T: usize>(
    a: &Q8RowsArgs<'_>,
    rows: &ChunkRows<R>,
    s: usize,
    out: &mut [[__m256i; T]; R],
) {
    let m = _mm256_set1_epi8(0x0f);
    // The block's rows consume 32·R bytes per step: at least one prefetched line per step.
    _mm_prefetch::<_MM_HINT_T0>(rows.ahead.wrapping_add(32 * R * s) as *const i8);
    for (p, out) in rows.pp.iter().zip(out.iter_mut()) {
        let v = _mm256_loadu_si256(p.add(32 * s) as *const _);
        let lo = _mm256_and_si256(v, m);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
        for (t, o) in out.iter_mut().enumerate() {
            let x = a.xq.as_ptr().add(t * a.cols + rows.col + 64 * s);
            let xe = _mm256_loadu_si256(x as *const _);
            let xo = _mm256_loadu_si256(x.add(32) as *const _);
            // u8 codes ≤ 15 times i8 ≤ 127: pair sums ≤ 3810, two of them ≤ 7620, no i16 saturation.
            *o = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
        }
    }
}

/// The scales of one chunk (`steps` ≤ 4 steps of 64 columns) of the AVX2 4-bit kernel, one per 32-column
/// block in the chunk's lane order (even blocks in lanes 0–3, odd ones in 4–7), read in type `TY` at `p`:
/// exactly the chunk's `⌈64·steps/G⌉` values (a short chunk's missing blocks get zero).
#[inline(always)]
unsafe fn chunk_scales<const TY: u8, const G: usize>(p: *const u8, size: usize, steps: usize) -> __m256 {
    if steps < 4 {
        let mut tmp = [0u8; 32];
        std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), (64 * steps).div_ceil(G) * size);
        return chunk_scales_whole::<TY, G>(tmp.as_ptr());
    }
    chunk_scales_whole::<TY, G>(p)
}

/// [`chunk_scales`] for a whole chunk: 256/`G` values at `p`.
#[inline(always)]
unsafe fn chunk_scales_whole<const TY: u8, const G: usize>(p: *const u8) -> __m256 {
    // Block b of the chunk lies in group b·32/G; lanes hold blocks 0, 2, 4, 6, 1, 3, 5, 7.
    let (v, idx) = match G {
        32 => (load8::<TY>(p), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)),
        64 => (
            _mm256_castps128_ps256(load4::<TY>(p)),
            _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3),
        ),
        _ => (
            _mm256_castps128_ps256(load2::<TY>(p)),
            _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1),
        ),
    };
    _mm256_permutevar8x32_ps(v, idx)
}

/// Four values of type `TY` at `p` as f32.
#[inline(always)]
unsafe fn load4<const TY: u8>(p: *const u8) -> __m128 {
    match TY {
        TY_F32 => _mm_loadu_ps(p as *const f32),
        TY_F16 => _mm_cvtph_ps(_mm_loadl_epi64(p as *const _)),
        _ => _mm_castsi128_ps(_mm_slli_epi32::<16>(_mm_cvtepu16_epi32(_mm_loadl_epi64(p as *const _)))),
    }
}

/// Two values of type `TY` at `p` as f32 (lanes 0 and 1).
#[inline(always)]
unsafe fn load2<const TY: u8>(p: *const u8) -> __m128 {
    match TY {
        // Scales need not be aligned: read as plain unaligned integers.
        TY_F32 => _mm_castsi128_ps(_mm_cvtsi64_si128(std::ptr::read_unaligned(p as *const i64))),
        _ => {
            let h = _mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const u32) as i32);
            if TY == TY_F16 {
                _mm_cvtph_ps(h)
            } else {
                _mm_castsi128_ps(_mm_slli_epi32::<16>(_mm_cvtepu16_epi32(h)))
            }
        }
    }
}

/// Eight values of type `TY` at `p` as f32.
#[inline(always)]
unsafe fn load8<const TY: u8>(p: *const u8) -> __m256 {
    match TY {
        TY_F32 => _mm256_loadu_ps(p as *const f32),
        TY_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const _)),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
            p as *const _,
        )))),
    }
}

/// `Σ_g bias_g·xsum_g` with biases of type `TY` at `b`, eight groups at a time; reads exactly `groups`
/// values of each.
#[inline(always)]
unsafe fn bias_dot_raw8<const TY: u8>(b: *const u8, xsum: *const f32, groups: usize, size: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut g = 0;
    while g + 8 <= groups {
        acc = _mm256_fmadd_ps(load8::<TY>(b.add(g * size)), _mm256_loadu_ps(xsum.add(g)), acc);
        g += 8;
    }
    if g < groups {
        // The last few through zeroed copies, so nothing past either array is read.
        let (mut bt, mut xt) = ([0u8; 32], [0f32; 8]);
        std::ptr::copy_nonoverlapping(b.add(g * size), bt.as_mut_ptr(), (groups - g) * size);
        std::ptr::copy_nonoverlapping(xsum.add(g), xt.as_mut_ptr(), groups - g);
        acc = _mm256_fmadd_ps(load8::<TY>(bt.as_ptr()), _mm256_loadu_ps(xt.as_ptr()), acc);
    }
    hsum256(acc)
}

/// [`q4_maddubs`] for the group size and token count of `a` (one or four tokens per pass).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_maddubs_for<const TY: u8>(a: &Q8RowsArgs<'_>, raw: &RawScales<'_>, out: &mut [f32], ostride: usize) {
    match (a.group, a.tokens) {
        (32, 4) => q4_maddubs::<TY, 32, 1, 4>(a, raw, out, ostride),
        (64, 4) => q4_maddubs::<TY, 64, 1, 4>(a, raw, out, ostride),
        (128, 4) => q4_maddubs::<TY, 128, 1, 4>(a, raw, out, ostride),
        (32, _) => q4_maddubs::<TY, 32, 2, 1>(a, raw, out, ostride),
        (64, _) => q4_maddubs::<TY, 64, 2, 1>(a, raw, out, ostride),
        (128, _) => q4_maddubs::<TY, 128, 2, 1>(a, raw, out, ostride),
        (g, _) => unreachable!("the AVX2 4-bit kernel takes groups of 32, 64 or 128, not {g}"),
    }
}

/// Whether the CPU converts f16 in hardware (F16C, with AVX2 for the wide loads).
/// Panics unless this CPU runs the int8 kernels' instructions: AVX-512 F/BW/VL/VNNI (`avx512`), else AVX2, FMA
/// and F16C.
fn assert_int8_isa(avx512: bool) {
    if avx512 {
        assert!(super::q8::vnni_available(), "AVX-512 VNNI");
    } else {
        assert!(
            f16c_available() && is_x86_feature_detected!("fma"),
            "AVX2, FMA and F16C"
        );
    }
}

pub(super) fn f16c_available() -> bool {
    is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx2")
}

/// Converts little-endian f16 values to f32 (`src.len() == 2 * out.len()`), 8 at a time.
pub(super) fn f16_to_f32(src: &[u8], out: &mut [f32]) {
    assert_eq!(src.len(), 2 * out.len(), "f16 conversion bounds");
    // SAFETY: called only after `f16c_available()`; the assert bounds every 16-byte load and 8-float store.
    unsafe { f16_to_f32_impl(src, out) }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_to_f32_impl(src: &[u8], out: &mut [f32]) {
    let n = out.len();
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i);
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    for j in i..n {
        out[j] = half::f16::from_bits(u16::from_le_bytes([src[2 * j], src[2 * j + 1]])).to_f32();
    }
}

/// Converts little-endian bf16 values to f32 (`src.len() == 2 * out.len()`), 8 at a time.
pub(super) fn bf16_to_f32(src: &[u8], out: &mut [f32]) {
    assert_eq!(src.len(), 2 * out.len(), "bf16 conversion bounds");
    // SAFETY: called only after `f16c_available()` (which includes AVX2); the assert bounds every 16-byte
    // load and 8-float store.
    unsafe { bf16_to_f32_impl(src, out) }
}

#[target_feature(enable = "avx2")]
unsafe fn bf16_to_f32_impl(src: &[u8], out: &mut [f32]) {
    let n = out.len();
    let mut i = 0;
    while i + 8 <= n {
        let h = _mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i);
        let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
        i += 8;
    }
    for j in i..n {
        out[j] = f32::from_bits((u16::from_le_bytes([src[2 * j], src[2 * j + 1]]) as u32) << 16);
    }
}

/// [`super::q8::quantize_block`] over every 32-value block of `x` (`x.len()` a multiple of 32): codes to `q`,
/// block scales to `d`, with the same results (AVX-512's max keeps the accumulator when a value is NaN, as
/// `f32::max` ignores NaN; NaN values quantize to 0).
pub(super) fn quantize_blocks_avx512(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    assert!(
        x.len().is_multiple_of(32) && q.len() == x.len() && d.len() == x.len() / 32,
        "quantize bounds"
    );
    assert!(
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"),
        "AVX-512 F/BW"
    );
    // SAFETY: AVX-512 F/BW detected above; the assert bounds every 16-float load, 16-byte store and scale.
    unsafe { quantize_blocks_avx512_impl(x, q, d) }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_blocks_avx512_impl(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    let sign = _mm512_set1_ps(-0.0);
    let half = _mm512_set1_ps(0.5);
    let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
    for (b, db) in d.iter_mut().enumerate() {
        let p = x.as_ptr().add(32 * b);
        let v = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
        let m = _mm512_max_ps(
            _mm512_andnot_ps(sign, v[1]),
            _mm512_max_ps(_mm512_andnot_ps(sign, v[0]), _mm512_setzero_ps()),
        );
        let amax = _mm512_reduce_max_ps(m);
        let out = q.as_mut_ptr().add(32 * b);
        let Some(scale) = block_scale(amax, out, db) else {
            continue;
        };
        let inv = _mm512_set1_ps(1.0 / scale);
        for (j, v) in v.into_iter().enumerate() {
            let s = _mm512_mul_ps(v, inv);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(s);
            let rem = _mm512_sub_ps(s, t);
            let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(rem, half);
            let down = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(rem, _mm512_sub_ps(_mm512_setzero_ps(), half));
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(s, s);
            let mut r = _mm512_maskz_cvttps_epi32(ordered, t);
            r = _mm512_mask_add_epi32(r, up, r, _mm512_set1_epi32(1));
            r = _mm512_mask_sub_epi32(r, down, r, _mm512_set1_epi32(1));
            r = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
            _mm_storeu_si128(out.add(16 * j) as *mut __m128i, _mm512_cvtepi32_epi8(r));
        }
        *db = scale;
    }
}

/// [`super::q8::block_scale`] for a block whose 32 codes are at `out`: `None` after zeroing them and storing the
/// block's scale in `d` when the block quantizes to all zeros.
///
/// Safety: `out` is valid for 32 bytes.
#[inline(always)]
unsafe fn block_scale(amax: f32, out: *mut i8, d: &mut f32) -> Option<f32> {
    super::q8::block_scale(amax)
        .map_err(|zero_scale| {
            std::ptr::write_bytes(out, 0, 32);
            *d = zero_scale;
        })
        .ok()
}

/// [`super::q8::quantize_block`] for each 32-float block of `x` with AVX2, bit for bit: codes to `q`, scales to
/// `d`.
pub(super) fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    assert!(
        x.len().is_multiple_of(32) && q.len() == x.len() && d.len() == x.len() / 32,
        "quantize bounds"
    );
    assert!(is_x86_feature_detected!("avx2"), "AVX2");
    // SAFETY: AVX2 detected above; the assert bounds every 8-float load, 32-byte store and scale.
    unsafe { quantize_blocks_avx2_impl(x, q, d) }
}

#[target_feature(enable = "avx2")]
unsafe fn quantize_blocks_avx2_impl(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    let sign = _mm256_set1_ps(-0.0);
    let (half, neg_half) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    // `vpacks*` interleave 128-bit halves; this puts the 32 codes back in column order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, db) in d.iter_mut().enumerate() {
        let p = x.as_ptr().add(32 * b);
        let v: [__m256; 4] = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(p.add(o)));
        // `vmaxps` returns its second operand when either is NaN, so NaN elements drop out, as in `f32::max`.
        let mut m = _mm256_setzero_ps();
        for v in v {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let out = q.as_mut_ptr().add(32 * b);
        let Some(scale) = block_scale(amax, out, db) else {
            continue;
        };
        let inv = _mm256_set1_ps(1.0 / scale);
        let r = v.map(|v| {
            let s = _mm256_mul_ps(v, inv);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(s);
            let rem = _mm256_sub_ps(s, t);
            // Compare masks are all ones (-1) where true: subtracting one steps up, adding one steps down.
            let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(rem, half));
            let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(rem, neg_half));
            let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(s, s));
            let r = _mm256_and_si256(_mm256_cvttps_epi32(t), ordered);
            let r = _mm256_add_epi32(_mm256_sub_epi32(r, up), down);
            _mm256_min_epi32(_mm256_max_epi32(r, lo), hi)
        });
        let w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_storeu_si256(out as *mut __m256i, _mm256_permutevar8x32_epi32(w, order));
        *db = scale;
    }
}

/// The bounds both 4-bit int8 kernels ([`q4_tiled_rows`], [`q4_band_rows`]) check: 1–4 `tokens` rows of
/// activations, block scales and group sums, and `rows` outputs per token at `row·ostride + token`.
fn check_token_bounds(
    tokens: usize,
    cols: usize,
    (xq, block_d, xsum): (&[i8], &[f32], &[f32]),
    (groups, blocks): (usize, usize),
    (out, ostride, rows): (&[f32], usize, usize),
) {
    assert!(
        (1..=4).contains(&tokens)
            && xq.len() >= tokens * cols
            && block_d.len() >= tokens * blocks
            && xsum.len() >= tokens * groups,
        "activation bounds"
    );
    assert!(
        ostride >= tokens && (rows == 0 || out.len() >= (rows - 1) * ostride + tokens),
        "output bounds"
    );
}

/// What the tiled 4-bit int8 kernel reads: tiles (see `super::tiled`), int8 activations in natural order with
/// one scale per 32-column block, and per-token group sums.
pub(super) struct TiledArgs<'a> {
    /// The AVX-512 VNNI kernel (else the AVX2 one), as the activations were laid out for.
    pub avx512: bool,
    pub data: &'a [u8],
    pub ty: super::FloatType,
    pub group: usize,
    /// Rows to compute (from the first tile of `data`); the last tile may be partial.
    pub rows: usize,
    pub cols: usize,
    /// Tiles per panel (`super::tiled::TiledMatrix::panel`).
    pub panel: usize,
    pub tokens: usize,
    pub xq: &'a [i8],
    pub block_d: &'a [f32],
    pub xsum: &'a [f32],
}

/// `out[r·ostride + t]` for each row `r < a.rows` and token `t < a.tokens`, on tiled codes: per tile, group and
/// 32-column block, each lane of `vpdpbusd` sums one row's block (eight dot products of 4 bytes), then one
/// multiply-add per 16 rows applies group scale × block scale; `Σ bias·Σx` is added at the end. Up to four
/// tokens share each code load; a (row, token) result takes the same operations whatever the token count.
/// Without AVX-512 VNNI, [`q4_tiles_avx2`] computes what the AVX2 row-major kernel computes.
pub(super) fn q4_tiled_rows(a: &TiledArgs<'_>, out: &mut [f32], ostride: usize) {
    use super::tiled::tiled_len;
    let (groups, blocks) = (a.cols / a.group, a.cols / 32);
    assert!(
        a.group.is_multiple_of(32) && a.cols.is_multiple_of(a.group),
        "tile shape"
    );
    assert!(a.data.len() >= tiled_len(a.rows, a.cols, a.group, a.ty), "tile bounds");
    assert!(super::tiled::valid_panel(a.panel), "panels of 1 or 4 tiles");
    check_token_bounds(
        a.tokens,
        a.cols,
        (a.xq, a.block_d, a.xsum),
        (groups, blocks),
        (out, ostride, a.rows),
    );
    assert_int8_isa(a.avx512);
    use super::tiled::PASS_TILES;
    use super::FloatType as F;
    // SAFETY: the kernel's instruction set (AVX-512 F/BW/VL/VNNI, or AVX2, FMA and F16C) detected above; the
    // asserts bound every read (tiles of `rows`, `tokens` rows of activations, block scales and group sums) and
    // every write (row < rows, token < tokens at row·ostride + token), given a panel width of 1 or 4 (asserted),
    // which gives every tile of a pass the same stride; tile addresses and prefetches are formed by wrapping
    // arithmetic (with no columns they lie past an empty matrix, unread), and a prefetch never faults.
    unsafe {
        match (a.avx512, a.ty, a.tokens) {
            (true, F::F32, 4) => q4_tiled::<TY_F32, 4, 1>(a, out, ostride),
            (true, F::F16, 4) => q4_tiled::<TY_F16, 4, 1>(a, out, ostride),
            (true, F::BF16, 4) => q4_tiled::<TY_BF16, 4, 1>(a, out, ostride),
            (false, F::F32, 4) => q4_tiled_avx2::<TY_F32, 4>(a, out, ostride),
            (false, F::F16, 4) => q4_tiled_avx2::<TY_F16, 4>(a, out, ostride),
            (false, F::BF16, 4) => q4_tiled_avx2::<TY_BF16, 4>(a, out, ostride),
            // Other counts one token at a time.
            (avx512, ty, t) => {
                for t in 0..t {
                    let one = TiledArgs {
                        tokens: 1,
                        xq: &a.xq[t * a.cols..],
                        block_d: &a.block_d[t * blocks..],
                        xsum: &a.xsum[t * groups..],
                        ..*a
                    };
                    let out = &mut out[t..];
                    match (avx512, ty) {
                        (true, F::F32) => q4_tiled::<TY_F32, 1, PASS_TILES>(&one, out, ostride),
                        (true, F::F16) => q4_tiled::<TY_F16, 1, PASS_TILES>(&one, out, ostride),
                        (true, F::BF16) => q4_tiled::<TY_BF16, 1, PASS_TILES>(&one, out, ostride),
                        (false, F::F32) => q4_tiled_avx2::<TY_F32, 1>(&one, out, ostride),
                        (false, F::F16) => q4_tiled_avx2::<TY_F16, 1>(&one, out, ostride),
                        (false, F::BF16) => q4_tiled_avx2::<TY_BF16, 1>(&one, out, ostride),
                    }
                }
            }
        }
    }
}

/// `cpuid` leaf `leaf`.
fn cpuid(leaf: u32) -> CpuidResult {
    // SAFETY: `cpuid` exists on every x86-64 CPU (the intrinsic is safe from Rust 1.94 on, unsafe before).
    #[allow(unused_unsafe)]
    unsafe {
        __cpuid(leaf)
    }
}

/// The vendor string (`cpuid` leaf 0) as its three registers in string order: EBX, EDX, ECX.
fn vendor() -> [u32; 3] {
    let r = cpuid(0);
    [r.ebx, r.edx, r.ecx]
}

/// This CPU's family when its vendor string is AMD's ("Auth" "enti" "cAMD"): `cpuid` leaf 1's base family, plus
/// its extended family when the base is 0xF (as AMD documents it: Zen 4 is 25, Zen 5 is 26).
pub(super) fn amd_family() -> Option<u32> {
    (vendor() == [0x6874_7541, 0x6974_6e65, 0x444d_4163]).then(|| family_of(cpuid(1).eax))
}

/// The displayed family in `cpuid` leaf 1's EAX: bits 8–11, plus bits 20–27 when those are 0xF.
pub(super) fn family_of(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xf;
    if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    }
}

/// Whether this CPU's vendor string (`cpuid` leaf 0) is Intel's.
pub(super) fn intel_cpu() -> bool {
    // "Genu" "ineI" "ntel".
    vendor() == [0x756e_6547, 0x4965_6e69, 0x6c65_746e]
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_tiled<const TY: u8, const T: usize, const P: usize>(a: &TiledArgs<'_>, out: &mut [f32], ostride: usize) {
    let prefetch = T > 1 || super::decode_prefetch();
    for (tile, n, stride, at) in passes(a) {
        // One pass: its tiles P at a time, then the rest two, then one (P = 4 leaves up to three in the last
        // pass).
        let base = |j: usize| a.data.as_ptr().wrapping_add(at[j]);
        let mut j = 0;
        while j + P <= n {
            let bases = std::array::from_fn(|p| base(j + p));
            q4_tiles::<TY, T, P>(a, out, ostride, bases, stride, tile + j, prefetch);
            j += P;
        }
        if P > 2 && j + 2 <= n {
            let bases = [base(j), base(j + 1)];
            q4_tiles::<TY, T, 2>(a, out, ostride, bases, stride, tile + j, prefetch);
            j += 2;
        }
        while j < n {
            q4_tiles::<TY, T, 1>(a, out, ostride, [base(j)], stride, tile + j, prefetch);
            j += 1;
        }
    }
}

/// Tiles `first..first + P` of one pass, side by side (group `g` of tile `first + p` at
/// `bases[p] + g·stride`). Within a group the tiles are read one after another, each whole, so in panels of
/// four the reads walk the panel in address order: the hardware prefetcher then streams it at the core's
/// full DRAM rate (one thread from DRAM on the AMD EPYC host, `qmatmul`: 25–28 GB/s, against 9–14 when each
/// block visited all P tiles in turn, jumping 576 bytes back and forth); in panels of one they are P
/// streams. With `prefetch` the next group is also prefetched here (see [`super::decode_prefetch`]). Each
/// tile's sums run in the same order whatever P is, so the bits do not depend on it.
#[inline(always)]
unsafe fn q4_tiles<const TY: u8, const T: usize, const P: usize>(
    a: &TiledArgs<'_>,
    out: &mut [f32],
    ostride: usize,
    bases: [*const u8; P],
    stride: usize,
    first: usize,
    prefetch: bool,
) {
    use super::tiled::{group_bytes, TILE_ROWS};
    let size = a.ty.size();
    let (groups, blocks, per_group) = (a.cols / a.group, a.cols / 32, a.group / 32);
    let gb = group_bytes(a.group, a.ty);
    let m = _mm512_set1_epi8(0x0f);
    let (xq, bd, xs) = (a.xq.as_ptr(), a.block_d.as_ptr(), a.xsum.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    let mut bacc = [[_mm512_setzero_ps(); T]; P];
    for g in 0..groups {
        // The next group, one cache line at a time. Prompts (T > 1, one tile, compute-bound) always do it
        // (prefill +17% over none on medium on the Sapphire Rapids host, 4–25% on the AMD EPYC one); decode
        // (T = 1) only where it helps the hardware prefetcher (`prefetch`, by CPU vendor). After the last group
        // this is the next panel's or tile's first, or past the matrix: `wrapping_add`, and a prefetch never
        // faults.
        if prefetch {
            for base in bases {
                let next = base.wrapping_add((g + 1) * stride);
                for line in (0..gb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line) as *const i8);
                }
            }
        }
        for p in 0..P {
            let gp = bases[p].add(g * stride);
            let b = load_scales::<TY>(gp.add(TILE_ROWS * size), TILE_ROWS);
            for (t, ba) in bacc[p].iter_mut().enumerate() {
                *ba = _mm512_fmadd_ps(b, _mm512_set1_ps(*xs.add(t * groups + g)), *ba);
            }
            let codes = gp.add(2 * TILE_ROWS * size);
            for kb in 0..per_group {
                let blk = g * per_group + kb;
                // Two chains per token (low and high nibbles), so consecutive `vpdpbusd`s do not wait on each
                // other; integer sums, so the order does not change the result.
                let mut il = [_mm512_setzero_si512(); T];
                let mut ih = [_mm512_setzero_si512(); T];
                for k in 0..4 {
                    let v = _mm512_loadu_si512(codes.add(kb * 256 + 64 * k) as *const _);
                    // High nibbles stay in place (16·code, at most 240, still a u8): one op instead of two,
                    // and the chain's sum is divided by 16 once per block, exactly.
                    let (lo, hi) = (_mm512_and_si512(v, m), _mm512_andnot_si512(m, v));
                    for t in 0..T {
                        let x = xq.add(t * a.cols + 32 * blk + 4 * k);
                        let xl = _mm512_set1_epi32((x as *const i32).read_unaligned());
                        let xh = _mm512_set1_epi32((x.add(16) as *const i32).read_unaligned());
                        il[t] = _mm512_dpbusd_epi32(il[t], lo, xl);
                        ih[t] = _mm512_dpbusd_epi32(ih[t], hi, xh);
                    }
                }
                let s = load_scales::<TY>(gp, TILE_ROWS);
                let i: [__m512i; T] = std::array::from_fn(|t| _mm512_add_epi32(il[t], _mm512_srai_epi32::<4>(ih[t])));
                for (t, (ac, it)) in acc[p].iter_mut().zip(i).enumerate() {
                    let f = _mm512_mul_ps(s, _mm512_set1_ps(*bd.add(t * blocks + blk)));
                    *ac = _mm512_fmadd_ps(_mm512_cvtepi32_ps(it), f, *ac);
                }
            }
        }
    }
    for p in 0..P {
        let tile = first + p;
        let rows = (a.rows - tile * TILE_ROWS).min(TILE_ROWS);
        for (t, (ac, ba)) in acc[p].iter().zip(&bacc[p]).enumerate() {
            let mut lanes = [0f32; TILE_ROWS];
            _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_add_ps(*ac, *ba));
            for (l, v) in lanes.iter().take(rows).enumerate() {
                *out.get_unchecked_mut((tile * TILE_ROWS + l) * ostride + t) = *v;
            }
        }
    }
}

/// The AVX2 tiled kernel for `T` tokens: each pass's tiles side by side (one token, lines prefetched
/// `PREFETCH_AHEAD` on along each tile's stream, and the next group too where [`super::decode_prefetch`]
/// says) or one at a time (four tokens, the next group prefetched as in [`q4_tiled`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_tiled_avx2<const TY: u8, const T: usize>(a: &TiledArgs<'_>, out: &mut [f32], ostride: usize) {
    let prefetch = T > 1 || super::decode_prefetch();
    for (tile, n, stride, at) in passes(a) {
        // The pass's tiles, side by side: where each one's first group starts, and its index.
        let list = |j: usize| (a.data.as_ptr().wrapping_add(at[j]), tile + j);
        match (T, n) {
            (1, 4) => q4_tiles_avx2::<TY, T, 4>(a, out, ostride, std::array::from_fn(list), stride, prefetch),
            (1, 3) => q4_tiles_avx2::<TY, T, 3>(a, out, ostride, std::array::from_fn(list), stride, prefetch),
            (1, 2) => q4_tiles_avx2::<TY, T, 2>(a, out, ostride, std::array::from_fn(list), stride, prefetch),
            _ => {
                for j in 0..n {
                    q4_tiles_avx2::<TY, T, 1>(a, out, ostride, [list(j)], stride, prefetch);
                }
            }
        }
    }
}

/// The passes over `a`'s tiles, in order: up to four tiles read side by side (a panel of four, or four panels
/// of one), as their first tile's index, their count, the distance from one group of a tile to its next
/// (the same for each), and where each one's first group starts in `a.data`.
fn passes(a: &TiledArgs<'_>) -> impl Iterator<Item = (usize, usize, usize, [usize; super::tiled::PASS_TILES])> {
    use super::tiled::{group_bytes, tile_group_at, PASS_TILES, TILE_ROWS};
    let tiles = a.rows.div_ceil(TILE_ROWS);
    let (groups, gb) = (a.cols / a.group, group_bytes(a.group, a.ty));
    let panel = a.panel;
    let at = move |t: usize| tile_group_at(tiles, groups, gb, panel, t, 0);
    (0..tiles).step_by(PASS_TILES).map(move |first| {
        let n = (tiles - first).min(PASS_TILES);
        (
            first,
            n,
            at(first).1,
            std::array::from_fn(|j| at((first + j).min(tiles - 1)).0),
        )
    })
}

/// The lane of the AVX2 row-major 4-bit kernel ([`q4_maddubs`]) that sums block `b` of a row: a chunk's even
/// blocks go to lanes 0–3, its odd ones to lanes 4–7.
#[inline(always)]
fn maddubs_lane(b: usize) -> usize {
    let j = b % 8;
    j / 2 + 4 * (j % 2)
}

/// `hsum256`'s tree, lane by lane over eight vectors: lane `l` of the result is `hsum256` of the vector of
/// every `v[i]`'s lane `l`.
#[inline(always)]
unsafe fn hsum_lanes(v: &[__m256; 8]) -> __m256 {
    let (a, b) = (_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6]));
    let (c, d) = (_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7]));
    _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d))
}

/// `P` tiles of one pass (each tile's first group and index in `tiles`, a group `stride` bytes from the next,
/// as in [`q4_tiles`]), eight rows per vector: each 32-bit lane of a tile half's `vpmaddubsw`/`vpmaddwd` sums
/// one row's four columns of a 32-column block, and the block's four vectors sum in i16 (at most 4 × 7620)
/// before one `vpmaddwd` widens them into the rows' block sums. The float work then runs lane by lane as the
/// row-major kernel [`q4_maddubs`] runs it for one row: block `b` multiply-adds into accumulator
/// [`maddubs_lane`]`(b)`, the bias `Σ bias·xsum` into accumulator `g mod 8`, missing blocks and groups of a last
/// chunk add zero, and both reduce by `hsum256`'s tree. So a tiled record gives the bits its row-major layout
/// gives, and streamed decode equals resident decode. `prefetch` as in [`q4_tiles`].
#[inline(always)]
unsafe fn q4_tiles_avx2<const TY: u8, const T: usize, const P: usize>(
    a: &TiledArgs<'_>,
    out: &mut [f32],
    ostride: usize,
    tiles: [(*const u8, usize); P],
    stride: usize,
    prefetch: bool,
) {
    use super::tiled::TILE_ROWS;
    let size = a.ty.size();
    let (groups, blocks, per_group) = (a.cols / a.group, a.cols / 32, a.group / 32);
    let gb = super::tiled::group_bytes(a.group, a.ty);
    let (m, ones, zero) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1), _mm256_setzero_ps());
    let (xq, bd, xs) = (a.xq.as_ptr(), a.block_d.as_ptr(), a.xsum.as_ptr());
    // Per tile, half (rows 0–7, 8–15) and token: the row-major kernel's eight block lanes and eight bias lanes.
    let mut acc = [[[[zero; 8]; T]; 2]; P];
    let mut bacc = [[[[zero; 8]; T]; 2]; P];
    for g in 0..groups {
        if prefetch {
            for (base, _) in tiles {
                let next = base.wrapping_add((g + 1) * stride);
                for line in (0..gb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line) as *const i8);
                }
            }
        }
        for p in 0..P {
            let gp = tiles[p].0.add(g * stride);
            let mut s = [zero; 2];
            for (h, (s, bacc)) in s.iter_mut().zip(&mut bacc[p]).enumerate() {
                *s = load8::<TY>(gp.add(8 * h * size));
                let b = load8::<TY>(gp.add((TILE_ROWS + 8 * h) * size));
                for (t, ba) in bacc.iter_mut().enumerate() {
                    ba[g % 8] = _mm256_fmadd_ps(b, _mm256_set1_ps(*xs.add(t * groups + g)), ba[g % 8]);
                }
            }
            let codes = gp.add(2 * TILE_ROWS * size);
            for kb in 0..per_group {
                let blk = g * per_group + kb;
                let lane = maddubs_lane(blk);
                if T == 1 {
                    // One token streams from DRAM: the block's four lines `PREFETCH_AHEAD` on along the tile's stream
                    // (one thread from DRAM on the AMD EPYC Zen 3 host: 12.1 → 14.6 GB/s, as fast as a plain
                    // sum of the same bytes; into L2 instead, or 16 KiB ahead, was slower).
                    let ahead = codes.wrapping_add(kb * 256 + PREFETCH_AHEAD);
                    for line in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
                    }
                }
                for h in 0..2 {
                    let mut isum = [_mm256_setzero_si256(); T];
                    for k in 0..4 {
                        let v = _mm256_loadu_si256(codes.add(kb * 256 + 64 * k + 32 * h) as *const _);
                        let lo = _mm256_and_si256(v, m);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
                        for (t, is) in isum.iter_mut().enumerate() {
                            let x = xq.add(t * a.cols + 32 * blk + 4 * k);
                            let xl = _mm256_set1_epi32((x as *const i32).read_unaligned());
                            let xh = _mm256_set1_epi32((x.add(16) as *const i32).read_unaligned());
                            // Codes ≤ 15 times activations in ±127: each i16 lane ≤ 7620 per vector.
                            let pr = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                            *is = _mm256_add_epi16(*is, pr);
                        }
                    }
                    for (t, is) in isum.iter().enumerate() {
                        let f = _mm256_mul_ps(s[h], _mm256_set1_ps(*bd.add(t * blocks + blk)));
                        let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(*is, ones));
                        let ac = &mut acc[p][h][t][lane];
                        *ac = _mm256_fmadd_ps(sums, f, *ac);
                    }
                }
            }
        }
    }
    // The row-major kernel's last chunk multiply-adds zeros for its missing blocks, and its bias loop zeros
    // for its last batch's missing groups: x + 0, which turns −0 into +0.
    for p in 0..P {
        for h in 0..2 {
            for t in 0..T {
                if blocks % 8 != 0 {
                    for b in blocks % 8..8 {
                        let ac = &mut acc[p][h][t][maddubs_lane(b)];
                        *ac = _mm256_add_ps(*ac, zero);
                    }
                }
                if groups % 8 != 0 {
                    for ba in &mut bacc[p][h][t][groups % 8..] {
                        *ba = _mm256_add_ps(*ba, zero);
                    }
                }
            }
        }
    }
    for p in 0..P {
        let tile = tiles[p].1;
        let rows = (a.rows - tile * TILE_ROWS).min(TILE_ROWS);
        for h in 0..2 {
            for t in 0..T {
                let mut lanes = [0f32; 8];
                let v = _mm256_add_ps(hsum_lanes(&acc[p][h][t]), hsum_lanes(&bacc[p][h][t]));
                _mm256_storeu_ps(lanes.as_mut_ptr(), v);
                for (l, v) in lanes.iter().enumerate().take(rows.saturating_sub(8 * h)) {
                    *out.get_unchecked_mut((tile * TILE_ROWS + 8 * h + l) * ostride + t) = *v;
                }
            }
        }
    }
}

/// Asks for every 64-byte line of `bytes` to be brought into the caches, without waiting for them.
pub(super) fn prefetch_lines(bytes: &[u8]) {
    for line in (0..bytes.len()).step_by(64) {
        // SAFETY: SSE is baseline on x86-64, and a prefetch never faults; the address is inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(line) as *const i8) };
    }
}

/// `tiled::tile_blocks`: per row, low nibbles of bytes `i` and `8+i` pair into byte `2i` and high nibbles into
/// `2i+1`; then 4×4 transposes of 32-bit words put word `k` of rows `4j..4j+4` at vector `k`, lanes
/// `4j..4j+4`. Loads come straight from the rows (a record being tiled has just landed from disk, and
/// gathering each block into a buffer first cost as much as the transform). With AVX2, two blocks at a time
/// (one per 128-bit lane: every step works within lanes) wherever all 16 rows have both.
pub(super) fn tile_blocks(rows: &[&[u8]; 16], at: usize, dst: &mut [u8]) {
    let blocks = dst.len() / 256;
    // Blocks each row has from `at` on; a row without block `b` tiles as zeros there.
    let avail: [usize; 16] = std::array::from_fn(|l| rows[l].len().saturating_sub(at) / 16);
    let pairs = match std::arch::is_x86_feature_detected!("avx2") {
        true => avail.iter().copied().min().unwrap_or(0).min(blocks) / 2,
        false => 0,
    };
    // SAFETY: AVX2 was detected when `pairs > 0`; blocks `< 2 · pairs` are within every row's `avail`, and
    // `dst` holds `256 · blocks` bytes (see `tile_blocks_pairs` and `tile_block_sse`).
    unsafe {
        if pairs > 0 {
            tile_blocks_pairs(rows, at, pairs, dst.as_mut_ptr());
        }
        for b in 2 * pairs..blocks {
            tile_block_sse(rows, at, b, &avail, dst.as_mut_ptr().add(256 * b));
        }
    }
}

/// Row `l`'s 16 code bytes `v` of a block, nibbles paired in tiled order (`tile_blocks_pairs` does the same
/// in each 128-bit lane).
#[inline(always)]
unsafe fn pair_nibbles(v: __m128i) -> __m128i {
    let m = _mm_set1_epi8(0x0f);
    let hi = _mm_srli_si128::<8>(v);
    let even = _mm_or_si128(_mm_and_si128(v, m), _mm_slli_epi16::<4>(_mm_and_si128(hi, m)));
    let odd = _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(v), m), _mm_andnot_si128(m, hi));
    _mm_unpacklo_epi8(even, odd)
}

/// Block `b` of a tile into `out` (256 bytes) with SSE2 (part of x86-64).
///
/// # Safety
/// `out` must be valid for 256 bytes' writes; `avail[l]` must not exceed the 16-byte blocks `rows[l]` has
/// from `at` on.
unsafe fn tile_block_sse(rows: &[&[u8]; 16], at: usize, b: usize, avail: &[usize; 16], out: *mut u8) {
    // Four rows at a time, so the 16 registers hold them without spilling.
    for j in 0..4 {
        let r: [__m128i; 4] = std::array::from_fn(|i| {
            let l = 4 * j + i;
            match b < avail[l] {
                true => pair_nibbles(_mm_loadu_si128(rows[l].as_ptr().add(at + 16 * b) as *const __m128i)),
                false => _mm_setzero_si128(),
            }
        });
        let (ab_lo, ab_hi) = (_mm_unpacklo_epi32(r[0], r[1]), _mm_unpackhi_epi32(r[0], r[1]));
        let (cd_lo, cd_hi) = (_mm_unpacklo_epi32(r[2], r[3]), _mm_unpackhi_epi32(r[2], r[3]));
        let words = [
            _mm_unpacklo_epi64(ab_lo, cd_lo),
            _mm_unpackhi_epi64(ab_lo, cd_lo),
            _mm_unpacklo_epi64(ab_hi, cd_hi),
            _mm_unpackhi_epi64(ab_hi, cd_hi),
        ];
        for (k, w) in words.into_iter().enumerate() {
            _mm_storeu_si128(out.add(64 * k + 16 * j) as *mut __m128i, w);
        }
    }
}

/// Blocks `0 .. 2 · pairs` of a tile into `out` (256 bytes each), two at a time.
///
/// # Safety
/// AVX2 must be available; every row must have `2 · pairs` 16-byte blocks from `at` on, and `out` must be
/// valid for `512 · pairs` bytes' writes.
#[target_feature(enable = "avx2")]
unsafe fn tile_blocks_pairs(rows: &[&[u8]; 16], at: usize, pairs: usize, out: *mut u8) {
    let rows: [*const u8; 16] = std::array::from_fn(|l| rows[l].as_ptr().add(at));
    for p in 0..pairs {
        tile_pair(&rows, 32 * p, out.add(512 * p));
    }
}

/// Blocks at bytes `at .. at + 32` of each of a tile's 16 rows into `out` (512 bytes: the first block, then
/// the second).
///
/// # Safety
/// AVX2 must be available; each `rows[l] + at` must be valid for 32 bytes' reads and `out` for 512 bytes'
/// writes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn tile_pair(rows: &[*const u8; 16], at: usize, out: *mut u8) {
    let m = _mm256_set1_epi8(0x0f);
    for j in 0..4 {
        let r: [__m256i; 4] = std::array::from_fn(|i| {
            let v = _mm256_loadu_si256(rows[4 * j + i].add(at) as *const __m256i);
            let hi = _mm256_srli_si256::<8>(v);
            let even = _mm256_or_si256(_mm256_and_si256(v, m), _mm256_slli_epi16::<4>(_mm256_and_si256(hi, m)));
            let odd = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m),
                _mm256_andnot_si256(m, hi),
            );
            _mm256_unpacklo_epi8(even, odd)
        });
        let (ab_lo, ab_hi) = (_mm256_unpacklo_epi32(r[0], r[1]), _mm256_unpackhi_epi32(r[0], r[1]));
        let (cd_lo, cd_hi) = (_mm256_unpacklo_epi32(r[2], r[3]), _mm256_unpackhi_epi32(r[2], r[3]));
        let words = [
            _mm256_unpacklo_epi64(ab_lo, cd_lo),
            _mm256_unpackhi_epi64(ab_lo, cd_lo),
            _mm256_unpacklo_epi64(ab_hi, cd_hi),
            _mm256_unpackhi_epi64(ab_hi, cd_hi),
        ];
        // The low lane is the first block, the high lane the second.
        for (k, w) in words.into_iter().enumerate() {
            _mm_storeu_si128(out.add(64 * k + 16 * j) as *mut __m128i, _mm256_castsi256_si128(w));
            _mm_storeu_si128(
                out.add(256 + 64 * k + 16 * j) as *mut __m128i,
                _mm256_extracti128_si256::<1>(w),
            );
        }
    }
}

/// One pass of [`super::tiled::tile_into`] over tiles whose 16 rows all exist: for every group `g` (outer)
/// and tile `i` (inner, so the writes run through a panel in its stored order), the tile's scales, biases
/// and code blocks of group `g` at `places[i].0 + g · places[i].1` in `out`. `rows[i]` holds tile `i`'s rows of
/// codes, scales and biases (floats of `scale_type`). While it works, the next pass's codes (`next`) are
/// fetched `share` bytes per group. Returns false, having written nothing, without AVX2
/// or when a row is shorter than the matrix's or a group lies outside `out`; the caller then takes the
/// general path. In one call per pass rather than one per tile and group, the per-call checks and the
/// scalar parameter copies no longer cost as much as the transform (they did: ~55% of a cache-hot record's
/// tiling in `perf`).
pub(super) fn tile_pass_full(
    rows: &[[[&[u8]; 16]; 3]],
    scale_type: super::FloatType,
    group: usize,
    places: &[(usize, usize)],
    out: &mut [u8],
    next: (&[u8], usize),
) -> bool {
    let (size, gb) = (scale_type.size(), super::tiled::group_bytes(group, scale_type));
    let cols_bytes = rows.first().map_or(0, |r| r[0][0].len());
    let groups = 2 * cols_bytes / group.max(1);
    let fits = rows.iter().all(|[c, s, b]| {
        c.iter().all(|r| r.len() == cols_bytes) && s.iter().chain(b).all(|r| r.len() == groups * size)
    });
    let inside = places
        .iter()
        .all(|&(at, stride)| groups == 0 || at + (groups - 1) * stride + gb <= out.len());
    if !is_x86_feature_detected!("avx2") || !fits || !inside || !group.is_multiple_of(32) || rows.len() != places.len()
    {
        return false;
    }
    // SAFETY: AVX2 was detected; every row has `groups` groups' codes (`group / 2` bytes each) and params
    // (`size` bytes each), and every group's `gb` bytes at `at + g · stride` lie inside `out` (checked above).
    unsafe { tile_pass_full_avx2(rows, size, group, groups, places, out.as_mut_ptr(), next) };
    true
}

/// [`tile_pass_full`] once checked.
///
/// # Safety
/// As [`tile_pass_full`] checks: AVX2, whole rows, every group inside `out`.
#[target_feature(enable = "avx2")]
unsafe fn tile_pass_full_avx2(
    rows: &[[[&[u8]; 16]; 3]],
    size: usize,
    group: usize,
    groups: usize,
    places: &[(usize, usize)],
    out: *mut u8,
    (next, share): (&[u8], usize),
) {
    let code_bytes = group / 2;
    for g in 0..groups {
        // Into L2, not L1: a pass's 64 rows are more lines than L1 holds, and from DRAM this tiled a record
        // ~10% faster than prefetching into L1 (alternated runs; cache-hot, no difference).
        for line in next.chunks(share.max(64)).nth(g).unwrap_or_default().chunks(64) {
            _mm_prefetch::<_MM_HINT_T1>(line.as_ptr() as *const i8);
        }
        for (&(at, stride), [codes, scales, biases]) in places.iter().zip(rows) {
            let o = out.add(at + g * stride);
            // Scales then biases, one per row; then the codes.
            match size {
                2 => copy_params::<u16>(scales, biases, g, o),
                _ => copy_params::<u32>(scales, biases, g, o),
            }
            let o = o.add(32 * size);
            let src: [*const u8; 16] = std::array::from_fn(|l| codes[l].as_ptr().add(g * code_bytes));
            for p in 0..code_bytes / 32 {
                tile_pair(&src, 32 * p, o.add(512 * p));
            }
            if !code_bytes.is_multiple_of(32) {
                // An odd block (groups of 32 columns): rows are whole, so every row has it.
                let rows: [&[u8]; 16] = std::array::from_fn(|l| &codes[l][g * code_bytes..]);
                let avail = std::array::from_fn(|l| rows[l].len() / 16);
                let b = code_bytes / 32 * 2;
                tile_block_sse(&rows, 0, b, &avail, o.add(256 * b));
            }
        }
    }
}

/// Group `g`'s scale and bias (`T`: one stored float) of each of a tile's 16 rows to `out`: the 16 scales,
/// then the 16 biases.
///
/// # Safety
/// Every row must hold at least `g + 1` values of `T`, and `out` must be valid for `32` of them.
#[inline(always)]
unsafe fn copy_params<T: Copy>(scales: &[&[u8]; 16], biases: &[&[u8]; 16], g: usize, out: *mut u8) {
    let out = out as *mut T;
    for l in 0..16 {
        out.add(l)
            .write_unaligned((scales[l].as_ptr() as *const T).add(g).read_unaligned());
        out.add(16 + l)
            .write_unaligned((biases[l].as_ptr() as *const T).add(g).read_unaligned());
    }
}

/// [`super::scalar::softmax`] with 16-wide registers: the same exp polynomial, lane sums and division, so
/// the same bits.
pub(super) fn softmax_avx512(x: &mut [f32]) {
    // SAFETY: `Isa::Avx512` is only selected after `is_x86_feature_detected!("avx512f")` (and avx2/fma)
    // returned true; every load and store below is within `i + 16 <= x.len()`.
    unsafe { softmax_avx512_impl(x) }
}

#[target_feature(enable = "avx512f")]
unsafe fn softmax_avx512_impl(x: &mut [f32]) {
    use super::scalar::{self, SUM_LANES};
    let (n, p) = (x.len(), x.as_mut_ptr());
    let whole = n - n % 16;
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < whole {
        mx = _mm512_max_ps(mx, _mm512_loadu_ps(p.add(i)));
        i += 16;
    }
    let m = x[whole..].iter().copied().fold(_mm512_reduce_max_ps(mx), f32::max);
    let vm = _mm512_set1_ps(m);
    let mut acc = _mm512_setzero_ps();
    i = 0;
    while i < whole {
        let e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vm));
        _mm512_storeu_ps(p.add(i), e);
        acc = _mm512_add_ps(acc, e);
        i += 16;
    }
    let mut lanes = [0f32; SUM_LANES];
    _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
    for (j, v) in x[whole..].iter_mut().enumerate() {
        *v = scalar::exp(*v - m);
        lanes[j] += *v;
    }
    let sum = scalar::reduce_lanes(lanes);
    let s = _mm512_set1_ps(sum);
    i = 0;
    while i < whole {
        _mm512_storeu_ps(p.add(i), _mm512_div_ps(_mm512_loadu_ps(p.add(i)), s));
        i += 16;
    }
    scalar::divide_all(&mut x[whole..], sum);
}

/// [`super::scalar::exp`] of sixteen lanes, operation for operation.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512(v: __m512) -> __m512 {
    use super::scalar::{EXP_HI, EXP_LO, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2_E};
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(v, _mm512_set1_ps(EXP_LO));
    // min(hi, v) in this order: NaN takes the second operand, so NaN stays NaN.
    let v = _mm512_min_ps(_mm512_set1_ps(EXP_HI), v);
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        v,
        _mm512_set1_ps(LOG2_E),
    ));
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_HI), v);
    let r = _mm512_fmadd_ps(k, _mm512_set1_ps(-LN2_LO), r);
    let mut q = _mm512_set1_ps(EXP_TAYLOR[0]);
    for c in &EXP_TAYLOR[1..] {
        q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(*c));
    }
    let one = _mm512_set1_ps(1.0);
    let q = _mm512_fmadd_ps(_mm512_fmadd_ps(q, r, one), r, one);
    let two_k = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(k),
        _mm512_set1_epi32(127),
    )));
    _mm512_maskz_mov_ps(!under, _mm512_mul_ps(q, two_k))
}

/// [`softmax_avx512`] with 8-wide registers: two of them hold the 16 lane sums.
pub(super) fn softmax_avx2(x: &mut [f32]) {
    // SAFETY: `Isa::Avx2`/`Isa::Avx512` are only selected after `is_x86_feature_detected!("avx2")` and
    // `("fma")` returned true; every load and store below is within `i + 16 <= x.len()`.
    unsafe { softmax_avx2_impl(x) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2_impl(x: &mut [f32]) {
    use super::scalar::{self, SUM_LANES};
    let (n, p) = (x.len(), x.as_mut_ptr());
    let whole = n - n % 16;
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < whole {
        mx = _mm256_max_ps(
            mx,
            _mm256_max_ps(_mm256_loadu_ps(p.add(i)), _mm256_loadu_ps(p.add(i + 8))),
        );
        i += 16;
    }
    let mut lanes = [0f32; SUM_LANES];
    _mm256_storeu_ps(lanes.as_mut_ptr(), mx);
    let m = lanes[..8]
        .iter()
        .chain(&x[whole..])
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let vm = _mm256_set1_ps(m);
    let mut acc = [_mm256_setzero_ps(); 2];
    i = 0;
    while i < whole {
        for (h, acc) in acc.iter_mut().enumerate() {
            let e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(i + 8 * h)), vm));
            _mm256_storeu_ps(p.add(i + 8 * h), e);
            *acc = _mm256_add_ps(*acc, e);
        }
        i += 16;
    }
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
    for (j, v) in x[whole..].iter_mut().enumerate() {
        *v = scalar::exp(*v - m);
        lanes[j] += *v;
    }
    let sum = scalar::reduce_lanes(lanes);
    let s = _mm256_set1_ps(sum);
    i = 0;
    while i < whole {
        _mm256_storeu_ps(p.add(i), _mm256_div_ps(_mm256_loadu_ps(p.add(i)), s));
        i += 8;
    }
    scalar::divide_all(&mut x[whole..], sum);
}

/// [`super::scalar::swiglu`] eight lanes at a time, operation for operation (the same bits).
pub(super) fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
    // SAFETY: `Isa::Avx2`/`Isa::Avx512` are only selected after `is_x86_feature_detected!("avx2")` and
    // `("fma")` returned true; every load and store below is within `i + 8 <= n <= len` of both slices.
    unsafe { swiglu_avx2_impl(gate, up) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2_impl(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let whole = n - n % 8;
    let (g, u, one) = (gate.as_mut_ptr(), up.as_ptr(), _mm256_set1_ps(1.0));
    for i in (0..whole).step_by(8) {
        let x = _mm256_loadu_ps(g.add(i));
        let neg = _mm256_xor_ps(x, _mm256_set1_ps(-0.0));
        let past = _mm256_cmp_ps::<_CMP_GT_OQ>(neg, _mm256_set1_ps(super::scalar::EXP_HI));
        let e = _mm256_blendv_ps(exp_avx2(neg), _mm256_set1_ps(f32::INFINITY), past);
        let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(g.add(i), _mm256_mul_ps(silu, _mm256_loadu_ps(u.add(i))));
    }
    super::scalar::swiglu(&mut gate[whole..n], &up[whole..n]);
}

/// [`super::scalar::exp`] of eight lanes, operation for operation.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_avx2(v: __m256) -> __m256 {
    use super::scalar::{EXP_HI, EXP_LO, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2_E};
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(v, _mm256_set1_ps(EXP_LO));
    // min(hi, v) in this order: NaN takes the second operand, so NaN stays NaN.
    let v = _mm256_min_ps(_mm256_set1_ps(EXP_HI), v);
    let k =
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v, _mm256_set1_ps(LOG2_E)));
    let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_HI), v);
    let r = _mm256_fmadd_ps(k, _mm256_set1_ps(-LN2_LO), r);
    let mut q = _mm256_set1_ps(EXP_TAYLOR[0]);
    for c in &EXP_TAYLOR[1..] {
        q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(*c));
    }
    let one = _mm256_set1_ps(1.0);
    let q = _mm256_fmadd_ps(_mm256_fmadd_ps(q, r, one), r, one);
    let two_k = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(k),
        _mm256_set1_epi32(127),
    )));
    _mm256_andnot_ps(under, _mm256_mul_ps(q, two_k))
}

/// What [`q4_band_rows`] reads: a row-major 4-bit matrix (MLX's layout) from the task's first row.
pub(super) struct BandArgs<'a> {
    /// `rows` rows of `cols / 2` code bytes (byte `i`: column `2i` low nibble, `2i + 1` high).
    pub packed: &'a [u8],
    /// `rows × cols / group` scales and biases of type `ty`, row-major.
    pub scales: &'a [u8],
    pub biases: &'a [u8],
    pub ty: super::FloatType,
    pub group: usize,
    /// A multiple of 16.
    pub rows: usize,
    /// A multiple of 32.
    pub cols: usize,
    pub tokens: usize,
    /// Per token, each 128-column chunk's activations (and the last, shorter one's) as its even columns then
    /// its odd ones.
    pub xq: &'a [i8],
    pub block_d: &'a [f32],
    pub xsum: &'a [f32],
}

/// [`q4_tiled_rows`]' arithmetic on a row-major matrix, so both give the same bits: 16 rows at a time, each
/// row's 64 code bytes of a 128-column step meet `vpdpbusd` whole and runs of four lanes are summed into that
/// row's 32-column block sums (see `band_step_sums`); then, per row, the same multiply-add chain over blocks
/// (group scale × block scale) and over groups (bias × Σx) in the same order. Records read from disk are computed
/// this way as stored, without a pass that rewrites them into tiles.
pub(super) fn q4_band_rows(a: &BandArgs<'_>, out: &mut [f32], ostride: usize) {
    let (groups, blocks) = (a.cols / a.group, a.cols / 32);
    let size = a.ty.size();
    assert!(
        a.group.is_multiple_of(32) && a.cols.is_multiple_of(a.group),
        "band shape"
    );
    assert!(a.rows.is_multiple_of(16), "whole bands");
    assert!(
        a.packed.len() >= a.rows * a.cols / 2
            && a.scales.len() >= a.rows * groups * size
            && a.biases.len() >= a.rows * groups * size,
        "band bounds"
    );
    check_token_bounds(
        a.tokens,
        a.cols,
        (a.xq, a.block_d, a.xsum),
        (groups, blocks),
        (out, ostride, a.rows),
    );
    assert!(super::q8::vnni_available(), "AVX-512 VNNI");
    // SAFETY: AVX-512 F/BW/VL/VNNI detected above; the asserts bound every read (whole bands of `rows` rows
    // of codes, scales and biases; `tokens` rows of activations, block scales and group sums) and every
    // write (row < rows, token < tokens at row·ostride + token); prefetches never fault.
    unsafe {
        use super::FloatType as F;
        match (a.ty, a.tokens) {
            (F::F32, 4) => q4_band::<TY_F32, 4>(a, out, ostride),
            (F::F16, 4) => q4_band::<TY_F16, 4>(a, out, ostride),
            (F::BF16, 4) => q4_band::<TY_BF16, 4>(a, out, ostride),
            (ty, t) => {
                for t in 0..t {
                    let one = BandArgs {
                        tokens: 1,
                        xq: &a.xq[t * a.cols..],
                        block_d: &a.block_d[t * blocks..],
                        xsum: &a.xsum[t * groups..],
                        ..*a
                    };
                    match ty {
                        F::F32 => q4_band::<TY_F32, 1>(&one, &mut out[t..], ostride),
                        F::F16 => q4_band::<TY_F16, 1>(&one, &mut out[t..], ostride),
                        F::BF16 => q4_band::<TY_BF16, 1>(&one, &mut out[t..], ostride),
                    }
                }
            }
        }
    }
}

/// Band `r0 .. r0 + 16`'s scales and biases as f32, group `g` at `params[32g ..]` (16 scales, one per row,
/// then 16 biases): 16 groups at a time, transposed from rows into one vector per group.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn band_params<const TY: u8>(a: &BandArgs<'_>, r0: usize, params: &mut [f32]) {
    if TY == TY_F32 {
        return band_params_f32(a, r0, params);
    }
    // Two-byte scales: each row's scale and bias of a group share a dword (scale low, bias high), so one
    // transpose serves both (a third fewer shuffles than converting first and transposing each), and each
    // group's pair of vectors is converted after it. Unpacking interleaves per 128-bit lane, so dword `j` of
    // a row holds group `PAIR_GROUP[j]`.
    const PAIR_GROUP: [usize; 16] = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15];
    let groups = a.cols / a.group;
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let mut g = 0;
    while g < groups {
        let count = (groups - g).min(16);
        let k = ((1u32 << count) - 1) as u16;
        let mut r = [_mm512_setzero_si512(); 16];
        for (l, v) in r.iter_mut().enumerate() {
            let at = ((r0 + l) * groups + g) * 2;
            let sc = _mm256_maskz_loadu_epi16(k, a.scales.as_ptr().add(at) as *const i16);
            let bi = _mm256_maskz_loadu_epi16(k, a.biases.as_ptr().add(at) as *const i16);
            let (lo, hi) = (_mm256_unpacklo_epi16(sc, bi), _mm256_unpackhi_epi16(sc, bi));
            *v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        }
        transpose_16x16(&mut r);
        for (v, &j) in r.iter().zip(&PAIR_GROUP) {
            if j >= count {
                continue;
            }
            let (sc, bi) = if TY == TY_F16 {
                (
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(*v)),
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(*v))),
                )
            } else {
                (
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(*v)),
                    _mm512_castsi512_ps(_mm512_and_si512(*v, high)),
                )
            };
            let at = params.as_mut_ptr().add(32 * (g + j));
            _mm512_storeu_ps(at, sc);
            _mm512_storeu_ps(at.add(16), bi);
        }
        g += count;
    }
}

/// [`band_params`] for f32 scales and biases: each row's 16 groups loaded, then scales and biases transposed
/// apart.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn band_params_f32(a: &BandArgs<'_>, r0: usize, params: &mut [f32]) {
    let groups = a.cols / a.group;
    for (half, src) in [a.scales, a.biases].into_iter().enumerate() {
        let mut g = 0;
        while g < groups {
            let count = (groups - g).min(16);
            let mut r = [_mm512_setzero_si512(); 16];
            for (l, v) in r.iter_mut().enumerate() {
                *v = _mm512_castps_si512(load_scales::<TY_F32>(
                    src.as_ptr().add(((r0 + l) * groups + g) * 4),
                    count,
                ));
            }
            transpose_16x16(&mut r);
            for (j, v) in r.iter().take(count).enumerate() {
                _mm512_storeu_ps(
                    params.as_mut_ptr().add(32 * (g + j) + 16 * half),
                    _mm512_castsi512_ps(*v),
                );
            }
            g += count;
        }
    }
}

/// Transposes 16 rows of 16 dwords: `r[l]` dword `j` goes to `r[j]` lane `l`.
#[target_feature(enable = "avx512f")]
unsafe fn transpose_16x16(r: &mut [__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4q + k], per 128-bit lane c: dword 4c + k of rows 4q .. 4q + 4.
    let mut u = [_mm512_setzero_si512(); 16];
    for q in 0..4 {
        let (a, b, c, d) = (t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
        u[4 * q] = _mm512_unpacklo_epi64(a, c);
        u[4 * q + 1] = _mm512_unpackhi_epi64(a, c);
        u[4 * q + 2] = _mm512_unpacklo_epi64(b, d);
        u[4 * q + 3] = _mm512_unpackhi_epi64(b, d);
    }
    for k in 0..4 {
        let v = _mm512_shuffle_i32x4::<0x88>(u[k], u[4 + k]);
        let w = _mm512_shuffle_i32x4::<0xdd>(u[k], u[4 + k]);
        let v2 = _mm512_shuffle_i32x4::<0x88>(u[8 + k], u[12 + k]);
        let w2 = _mm512_shuffle_i32x4::<0xdd>(u[8 + k], u[12 + k]);
        r[k] = _mm512_shuffle_i32x4::<0x88>(v, v2);
        r[8 + k] = _mm512_shuffle_i32x4::<0xdd>(v, v2);
        r[4 + k] = _mm512_shuffle_i32x4::<0x88>(w, w2);
        r[12 + k] = _mm512_shuffle_i32x4::<0xdd>(w, w2);
    }
}

/// One step's block sums for 16 rows against each of `T` tokens' activations (`xs[t]`: the step's even
/// columns, then its odd ones `half` bytes on; `bytes`: the mask of each row's code bytes in the step, all 64
/// but in a last, shorter step), one vector per token and block with lane `l` for row `l`. Each row's code
/// bytes, split into nibbles once for all tokens, meet `vpdpbusd` whole (lane `4b + k`: 8 columns of block
/// `b`); runs of four lanes are then summed (exact: two stages of packing rows' lanes to i16 and adding
/// neighbours with `vpmaddwd`, three ops per four rows where unpacking and adding took nine) and the quads'
/// 128-bit lanes transposed 4×4.
// Index loops over fixed arrays: see the note on closures inside.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn band_step_sums<const T: usize>(
    rows: *const u8,
    row_bytes: usize,
    bytes: u64,
    xs: [*const i8; T],
    half: usize,
) -> [[__m512i; 4]; T] {
    // Plain loops, no closures: a closure handed to `array::map`/`from_fn` (which lack this function's target
    // features) is not inlined, and every intrinsic in it became a call (5× slower, measured).
    let (m, zero, ones) = (_mm512_set1_epi8(0x0f), _mm512_setzero_si512(), _mm512_set1_epi16(1));
    let (mut xl, mut xh) = ([zero; T], [zero; T]);
    for t in 0..T {
        xl[t] = _mm512_maskz_loadu_epi8(bytes, xs[t]);
        xh[t] = _mm512_maskz_loadu_epi8(bytes, xs[t].add(half));
    }
    // quads[t][q], lane c: block c of rows 4q .. 4q + 4 against token t.
    let mut quads = [[zero; 4]; T];
    for q in 0..4 {
        let (mut lo, mut hi) = ([zero; 4], [zero; 4]);
        for i in 0..4 {
            // A plain load where the step is whole: a masked one costs a shuffle-port µop besides the load
            // (cache-resident, 4–5% of the kernel's time).
            let at = rows.add((4 * q + i) * row_bytes) as *const i8;
            let v = match bytes {
                u64::MAX => _mm512_loadu_si512(at as *const _),
                _ => _mm512_maskz_loadu_epi8(bytes, at),
            };
            lo[i] = _mm512_and_si512(v, m);
            hi[i] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m);
        }
        for t in 0..T {
            let mut d = [zero; 4];
            for i in 0..4 {
                d[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo[i], xl[t]), hi[i], xh[t]);
            }
            // Each lane is 8 codes (≤ 15) times 8 activations (≥ -128): |lane| ≤ 15,360, and a pair's sum
            // ≤ 30,720, so packing to i16 never saturates and `madd` by ones adds neighbours exactly. Per
            // 128-bit lane, `packs` puts its two sources' four dwords side by side, so two stages leave rows
            // in order: [d0 pair sums, d1 pair sums] then [d0, d1, d2, d3] whole.
            let p0 = _mm512_madd_epi16(_mm512_packs_epi32(d[0], d[1]), ones);
            let p1 = _mm512_madd_epi16(_mm512_packs_epi32(d[2], d[3]), ones);
            quads[t][q] = _mm512_madd_epi16(_mm512_packs_epi32(p0, p1), ones);
        }
    }
    let mut sums = [[zero; 4]; T];
    for t in 0..T {
        let q = &quads[t];
        let v = _mm512_shuffle_i32x4::<0x88>(q[0], q[1]);
        let w = _mm512_shuffle_i32x4::<0xdd>(q[0], q[1]);
        let v2 = _mm512_shuffle_i32x4::<0x88>(q[2], q[3]);
        let w2 = _mm512_shuffle_i32x4::<0xdd>(q[2], q[3]);
        sums[t] = [
            _mm512_shuffle_i32x4::<0x88>(v, v2),
            _mm512_shuffle_i32x4::<0x88>(w, w2),
            _mm512_shuffle_i32x4::<0xdd>(v, v2),
            _mm512_shuffle_i32x4::<0xdd>(w, w2),
        ];
    }
    sums
}

/// Prefetches what [`q4_band`]'s first two bands read: its own prefetch runs two bands ahead, so a task's
/// first bands (every matrix's, and each thread's share of a split one) started from a cold memory system,
/// one 64-byte step of 16 rows at a time. One token's matmul split across two threads (768×2048, 4-bit,
/// 96 matrices from DRAM; a scratch harness alternating with and without 38 times in one process, five
/// runs) read 3.8–4.9% faster with it.
#[target_feature(enable = "avx512f")]
unsafe fn band_start_prefetch(a: &BandArgs<'_>, param_lines: usize) {
    let row_bytes = a.cols / 2;
    let bands = (a.rows / 16).min(2);
    // The scales and biases are read first (`band_params`), so they go to L1; the codes to L2, as the
    // kernel's own prefetch sends them.
    for line in 0..bands * param_lines {
        _mm_prefetch::<_MM_HINT_T0>(a.scales.as_ptr().wrapping_add(64 * line) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(a.biases.as_ptr().wrapping_add(64 * line) as *const i8);
    }
    for row in 0..16 * bands {
        let at = a.packed.as_ptr().wrapping_add(row * row_bytes);
        for line in 0..row_bytes.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(64 * line) as *const i8);
        }
    }
}

// Index loops over fixed arrays, no closures (see `band_step_sums`).
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_band<const TY: u8, const T: usize>(a: &BandArgs<'_>, out: &mut [f32], ostride: usize) {
    let (groups, blocks, per_group) = (a.cols / a.group, a.cols / 32, a.group / 32);
    let row_bytes = a.cols / 2;
    let (xq, bd, xs) = (a.xq.as_ptr(), a.block_d.as_ptr(), a.xsum.as_ptr());
    // One band's scales and biases as 16-row vectors, group by group.
    let mut params = vec![0f32; 2 * 16 * groups];
    let steps = a.cols.div_ceil(128);
    // A band's scales (and as many bytes of biases) span this many cache lines, one more if unaligned.
    let param_lines = (16 * groups * a.ty.size()).div_ceil(64) + 1;
    band_start_prefetch(a, param_lines);
    for band in 0..a.rows / 16 {
        let r0 = band * 16;
        band_params::<TY>(a, r0, &mut params);
        let mut acc = [_mm512_setzero_ps(); T];
        let mut bacc = [_mm512_setzero_ps(); T];
        let base = a.packed.as_ptr().add(r0 * row_bytes);
        let mut s = _mm512_setzero_ps();
        for step in 0..a.cols.div_ceil(128) {
            // Columns in this step: 128, or 32, 64 or 96 in a last one.
            let width = (a.cols - 128 * step).min(128);
            let bytes = u64::MAX >> (64 - width / 2);
            // The bytes two bands ahead (16 streams are more than the hardware prefetcher follows); into L2:
            // into L1 was 30-40% slower.
            let next = base.wrapping_add(32 * row_bytes + 64 * step);
            for l in 0..16 {
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(l * row_bytes) as *const i8);
            }
            // The next band's scales and biases, a share of their lines per step: between a band's 16 KiB of
            // codes their 1 KiB each is no stream the hardware prefetcher follows, and `band_params` stalled on
            // their first load (two thirds of its samples in a profile of streamed decode). From DRAM this
            // gave whole matrices per thread 17.9 → 19.7 GB/s (`qmatmul`, means of seven alternations).
            let next_params = (r0 + 16) * groups * a.ty.size();
            for line in step * param_lines / steps..(step + 1) * param_lines / steps {
                let at = next_params + 64 * line;
                _mm_prefetch::<_MM_HINT_T1>(a.scales.as_ptr().wrapping_add(at) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(a.biases.as_ptr().wrapping_add(at) as *const i8);
            }
            let mut tokens = [xq; T];
            for (t, p) in tokens.iter_mut().enumerate() {
                *p = xq.add(t * a.cols + 128 * step);
            }
            let isums = band_step_sums::<T>(base.add(64 * step), row_bytes, bytes, tokens, width / 2);
            // Block `b` of the step: a group's scale and bias when it starts one, then the block's sums.
            macro_rules! block {
                ($b:expr) => {{
                    let blk = 4 * step + $b;
                    if blk.is_multiple_of(per_group) {
                        let g = blk / per_group;
                        s = _mm512_loadu_ps(params.as_ptr().add(32 * g));
                        let bias = _mm512_loadu_ps(params.as_ptr().add(32 * g + 16));
                        for t in 0..T {
                            bacc[t] = _mm512_fmadd_ps(bias, _mm512_set1_ps(*xs.add(t * groups + g)), bacc[t]);
                        }
                    }
                    for t in 0..T {
                        let f = _mm512_mul_ps(s, _mm512_set1_ps(*bd.add(t * blocks + blk)));
                        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isums[t][$b]), f, acc[t]);
                    }
                }};
            }
            // A whole step's four blocks unrolled, so the sums and accumulators stay in registers.
            if width == 128 {
                block!(0);
                block!(1);
                block!(2);
                block!(3);
            } else {
                for b in 0..width / 32 {
                    block!(b);
                }
            }
        }
        for (t, (ac, ba)) in acc.iter().zip(&bacc).enumerate() {
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_add_ps(*ac, *ba));
            for (l, v) in lanes.iter().enumerate() {
                *out.get_unchecked_mut((r0 + l) * ostride + t) = *v;
            }
        }
    }
}
