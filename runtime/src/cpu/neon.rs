//! AArch64 NEON kernels.

use std::arch::aarch64::*;

/// Dot product with four 4-wide FMA accumulators.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: `Isa::Neon` is only selected after `is_aarch64_feature_detected!("neon")` returned true; the
    // slices have equal length (checked by the caller), and every load below is within `i + 4 <= n`.
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
