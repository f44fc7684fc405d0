//! AVX2/FMA and AVX-512 kernels. Callers dispatch here only after runtime feature detection.

use std::arch::x86_64::*;

/// Dot product with four 8-wide FMA accumulators.
pub(super) fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: `Isa::Avx2`/`Isa::Avx512` are only selected after `is_x86_feature_detected!("avx2")` and
    // `("fma")` returned true; the slices have equal length (checked by the caller).
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
    // SAFETY: `Isa::Avx512` is only selected after `is_x86_feature_detected!("avx512f")` returned true; the
    // slices have equal length (checked by the caller).
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

#[target_feature(enable = "avx512f")]
unsafe fn fused_q8_avx512(a: &RowArgs<'_>) -> f32 {
    let (pp, xp) = (a.packed.as_ptr(), a.xp.as_ptr());
    let mut acc = _mm512_setzero_ps();
    for g in 0..a.xp.len() / a.group {
        let (mut p0, mut p1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
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
        for (i, off) in (g * a.group..(g + 1) * a.group).step_by(8).enumerate() {
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(pp.add(off) as *const __m128i));
            p[i & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_loadu_ps(xp.add(off)), p[i & 3]);
        }
        let sum = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(*a.scales.get_unchecked(g)), sum, acc);
    }
    hsum256(acc) + bias_term(a)
}
