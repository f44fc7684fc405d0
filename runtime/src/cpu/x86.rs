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
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i)),
            _mm256_loadu_ps(pb.add(i)),
            acc[0],
        );
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
        acc1 = _mm512_fmadd_ps(
            _mm512_loadu_ps(pa.add(i + 16)),
            _mm512_loadu_ps(pb.add(i + 16)),
            acc1,
        );
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
    assert!(
        packed.len() * 8 >= n * bits as usize,
        "packed row too short"
    );
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
                let w = u32::from_le_bytes([
                    packed[k / 2],
                    packed[k / 2 + 1],
                    packed[k / 2 + 2],
                    packed[k / 2 + 3],
                ]);
                let v =
                    _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts), mask);
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
                let w = _mm256_set1_epi32(u32::from_le_bytes([
                    packed[j],
                    packed[j + 1],
                    packed[j + 2],
                    packed[j + 3],
                ]) as i32);
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
