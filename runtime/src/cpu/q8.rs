//! Int8-activation kernels (`--kernels q8`): each token's activations are quantized to int8 in blocks of
//! 32 (`x ≈ d·xq`, `d = max|x|/127`), so a 4- or 8-bit weight row meets them in integer dot products
//! (`vpdpbusd` on AVX-512 VNNI; on AVX2 `vpmaddubsw` for 4-bit codes and `vpmaddwd` on codes widened to i16
//! for 8-bit ones), as llama.cpp does with Q8 activations. Each
//! 32-column block lies inside one weight group, so
//! `y = Σ_blocks scale_g·d_b·Σ q·xq + Σ_g bias_g·Σx_g` (the bias term uses the exact float sums).
//!
//! Results differ from the float kernels by the activation rounding (about 0.4% of a block's largest
//! value per element); like them, a token's result never depends on the batch or thread count.

use std::sync::atomic::{AtomicBool, Ordering};

use super::{Isa, QuantMatrix};

/// Columns per activation quantization block.
pub const BLOCK: usize = 32;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns int8-activation kernels on or off for this process (off by default: the float kernels match
/// mlx-lm to ~1e-5).
pub fn set_q8_activations(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether int8-activation kernels are on.
pub fn q8_activations() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Whether an int8-activation kernel serves `q` on `isa` (otherwise the float kernels do, even when on).
pub fn has_kernel(q: &QuantMatrix<'_>, isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && Q8Kernel::for_matrix(q, isa).is_some()
}

/// Whether int8 activations are on and the tiled 4-bit kernel runs on `isa` (so tiling resident matrices pays).
pub fn tiled_kernel_on(isa: Isa) -> bool {
    q8_activations() && tiled_kernel_here(isa)
}

/// Whether `isa` has the tiled 4-bit kernel (it runs when int8 activations are on).
pub fn tiled_kernel_here(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && Q8Kernel::for_tiled(isa).is_some()
}

/// Whether a stored (row-major) 4-bit `[rows, cols]` matrix in groups of `group` gets, on `isa`, the bits its
/// tiles get: its row-major int8 kernel is the AVX-512 band kernel, which follows the AVX-512 tiled kernel, or
/// the AVX2 4-bit kernel, which the AVX2 tiled kernel follows (other shapes run other kernels).
pub fn stored_matches_tiled(isa: Isa, group: usize, rows: usize, cols: usize) -> bool {
    match (Q8Kernel::for_tiled(isa), Q8Kernel::for_shape(4, group, rows, cols, isa)) {
        (Some(t), Some(k)) if t.avx512 => k.band,
        (Some(_), Some(k)) => !k.avx512,
        _ => false,
    }
}

/// Which integer kernel serves a matrix, and the activation layout it wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Q8Kernel {
    /// 4 or 8.
    pub bits: u32,
    /// AVX-512 VNNI (else AVX2).
    pub avx512: bool,
    /// For a tiled matrix (`super::tiled`): activations in natural order with one scale per block.
    pub tiled: bool,
    /// For a row-major 4-bit matrix read 16 rows at a time with the tiled kernel's arithmetic: activations in
    /// the 4-bit kernel's chunk order (a last chunk of 32, 64 or 96 columns likewise), one scale per 32-column
    /// block.
    pub band: bool,
}

impl Q8Kernel {
    /// The kernel for `q` on `isa`, if one exists.
    pub fn for_matrix(q: &QuantMatrix<'_>, isa: Isa) -> Option<Self> {
        Self::for_shape(q.bits, q.group, q.rows, q.cols, isa)
    }

    /// The kernel for a `bits`-bit `[rows, cols]` matrix in groups of `group` on `isa`, if one exists.
    fn for_shape(bits: u32, group: usize, rows: usize, cols: usize, isa: Isa) -> Option<Self> {
        let vnni = vnni_available();
        let k = match (bits, isa) {
            // Whole 16-row bands: the tiled kernel's bits without tiling (records streamed from disk).
            (4, Isa::Avx512) if vnni && rows.is_multiple_of(16) => Self {
                band: true,
                ..Self::new(4, true)
            },
            (4, Isa::Avx512) if vnni => Self::new(4, true),
            (4, Isa::Avx2 | Isa::Avx512) => Self::new(4, false),
            // The VNNI kernel's steps are 64 columns; the AVX2 one takes rows of whole 32-column blocks.
            (8, Isa::Avx512) if vnni && cols.is_multiple_of(64) => Self::new(8, true),
            (8, Isa::Avx2 | Isa::Avx512) => Self::new(8, false),
            _ => return None,
        };
        // The band kernel takes a last chunk of 32, 64 or 96 columns; the others want whole chunks.
        let whole = k.band || cols.is_multiple_of(k.chunk());
        // Each row-major kernel's step holds whole groups or lies inside one, so the group divides 128 (a group
        // of 96 would straddle steps; those matrices run the exact kernels).
        (matches!(group, 32 | 64 | 128) && cols.is_multiple_of(group) && whole).then_some(k)
    }

    fn new(bits: u32, avx512: bool) -> Self {
        Self {
            bits,
            avx512,
            tiled: false,
            band: false,
        }
    }

    /// The kernel for a tiled 4-bit matrix on `isa`, if one exists (AVX-512 VNNI, or AVX2).
    pub fn for_tiled(isa: Isa) -> Option<Self> {
        let avx512 = isa == Isa::Avx512 && vnni_available();
        (avx512 || matches!(isa, Isa::Avx2 | Isa::Avx512)).then_some(Self {
            bits: 4,
            avx512,
            tiled: true,
            band: false,
        })
    }

    /// Columns per kernel step; 4-bit steps keep even elements in the first half of a chunk and odd ones
    /// in the second (a byte's low nibble is the even element). (The AVX2 4-bit kernel sums four such steps
    /// at a time, its own "chunk" of 256 columns; the AVX2 8-bit kernel steps one block at a time.)
    pub fn chunk(self) -> usize {
        match (self.bits, self.avx512) {
            (4, true) => 128,
            (4, false) => 64,
            (8, false) => BLOCK,
            _ => 64,
        }
    }

    /// Columns each `lane_d` scale covers: an i32 lane of the integer dot, or a whole block for the kernels
    /// that sum blocks before scaling them (tiled, band, the AVX2 4-bit one) or scale a block's lanes alike
    /// (the AVX2 8-bit one).
    pub fn lane_cols(self) -> usize {
        match (self.bits, self.avx512) {
            _ if self.tiled || self.band => BLOCK,
            (4, false) | (8, false) => BLOCK,
            (4, true) => 8,
            _ => 4,
        }
    }
}

pub(super) fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Quantized activations of `n` tokens laid out for one kernel.
// Only the x86-64 integer kernels read them so far.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) struct QuantActs {
    /// Per token, `cols` int8 values in the kernel's order.
    pub xq: Vec<i8>,
    /// Per token, the block scale `d` of each lane (`cols / lane_cols` values).
    pub lane_d: Vec<f32>,
}

/// Quantizes one block: `d = max|x|/127`, `q = round(x/d)` (halves away from zero; NaN elements to 0).
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    // Eight lanes so the loops vectorize; `max` ignores NaN in any order, so the result is order-free.
    let mut lanes = [0f32; 8];
    for c in x.chunks(8) {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
    let d = match block_scale(amax) {
        Ok(d) => d,
        Err(d) => {
            q.fill(0);
            return d;
        }
    };
    let inv = 1.0 / d;
    for (o, v) in q.iter_mut().zip(x) {
        *o = round_to_i8(v * inv);
    }
    d
}

/// The scale `d = amax/127` of a block whose largest magnitude is `amax`; or, for a block that quantizes to all
/// zeros, `Err` with the scale it stores: 0 for an all-zero block or one below ~4e-37 (its subnormal `d` has an
/// inverse that overflows), NaN for a non-finite one. Every ISA's quantizer takes this rule.
pub(super) fn block_scale(amax: f32) -> Result<f32, f32> {
    let d = amax / 127.0;
    if !amax.is_finite() {
        Err(f32::NAN)
    } else if amax == 0.0 || !(1.0 / d).is_finite() {
        Err(0.0)
    } else {
        Ok(d)
    }
}

/// `v.round().clamp(-127, 127)` for `|v|` well below 2²³ (NaN gives 0), without a libm call: truncation, then
/// a step away from zero when the exact remainder is a half or more.
#[inline(always)]
fn round_to_i8(v: f32) -> i8 {
    let t = v as i32;
    let rem = v - t as f32;
    let r = t + i32::from(rem >= 0.5) - i32::from(rem <= -0.5);
    r.clamp(-127, 127) as i8
}

/// Quantizes one token's `x` in natural order: codes to `q`, block scales to `d`.
fn quantize_row(k: Q8Kernel, x: &[f32], q: &mut [i8], d: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if k.avx512 {
        return super::x86::quantize_blocks_avx512(x, q, d);
    } else if super::x86::f16c_available() {
        // Every x86 int8 kernel runs on AVX2 at least (the ISA it was chosen for).
        return super::x86::quantize_blocks_avx2(x, q, d);
    }
    let _ = k;
    for (b, (xb, qb)) in x.chunks(BLOCK).zip(q.chunks_mut(BLOCK)).enumerate() {
        d[b] = quantize_block(xb, qb);
    }
}

/// Quantizes `x` (`[n, cols]`) for kernel `k`.
pub(super) fn quantize(x: &[f32], n: usize, cols: usize, k: Q8Kernel) -> QuantActs {
    let lanes = cols / k.lane_cols();
    let mut xq = vec![0i8; n * cols];
    let mut lane_d = vec![0f32; n * lanes];
    let mut natural = vec![0i8; cols];
    let mut d = vec![0f32; cols / BLOCK];
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        quantize_row(k, xt, &mut natural, &mut d);
        let out = &mut xq[t * cols..(t + 1) * cols];
        if k.bits == 4 && !k.tiled {
            // A last, shorter chunk (band kernel only) is split the same way.
            for (src, dst) in natural.chunks(k.chunk()).zip(out.chunks_mut(k.chunk())) {
                let half = src.len() / 2;
                for i in 0..half {
                    dst[i] = src[2 * i];
                    dst[half + i] = src[2 * i + 1];
                }
            }
        } else {
            out.copy_from_slice(&natural);
        }
        for (l, v) in lane_d[t * lanes..(t + 1) * lanes].iter_mut().enumerate() {
            *v = d[l * k.lane_cols() / BLOCK];
        }
    }
    QuantActs { xq, lane_d }
}

/// The oracle for one row: exact integer block sums, then `Σ scale·d·isum + Σ bias·xsum` in block order.
/// `codes` are the row's unpacked codes, `xq`/`d` the natural-order quantized activations.
pub fn reference_row(
    codes: &[u32],
    xq: &[i8],
    d: &[f32],
    scales: &[f32],
    biases: &[f32],
    xsum: &[f32],
    group: usize,
) -> f32 {
    let mut acc = 0f32;
    for (b, (cb, qb)) in codes.chunks(BLOCK).zip(xq.chunks(BLOCK)).enumerate() {
        let isum: i32 = cb.iter().zip(qb).map(|(&c, &q)| c as i32 * q as i32).sum();
        acc += scales[b * BLOCK / group] * d[b] * isum as f32;
    }
    acc + biases.iter().zip(xsum).map(|(b, s)| b * s).sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_round_half_away_from_zero() {
        let mut v = -130.0f32;
        while v <= 130.0 {
            for x in [
                v,
                v + 0.5,
                v - 0.5,
                v + 0.49999997,
                v - 0.49999997,
                v.next_up(),
                v.next_down(),
            ] {
                assert_eq!(round_to_i8(x), x.round().clamp(-127.0, 127.0) as i8, "{x}");
            }
            v += 0.25;
        }
        assert_eq!(round_to_i8(f32::NAN), 0);
    }

    #[test]
    fn every_instruction_set_quantizes_the_same() {
        let mut x: Vec<f32> = (0..32 * 40).map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 13.0).collect();
        // Halves exactly at the rounding boundary, zero and non-finite blocks, and a NaN among finite values.
        for (i, v) in x[..32].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) + 0.5;
        }
        x[31] = 127.0;
        x[32..64].fill(0.0);
        x[64] = f32::INFINITY;
        x[100] = f32::NAN;
        x[130] = -0.0;
        // A block so small that 1/d overflows.
        for (i, v) in x[160..192].iter_mut().enumerate() {
            *v = (i as f32 - 15.5) * 1e-39;
        }
        for k in [Q8Kernel::new(4, true), Q8Kernel::new(4, false)] {
            if k.avx512 && !vnni_available() {
                continue;
            }
            let (mut q, mut d) = (vec![0i8; x.len()], vec![0f32; x.len() / BLOCK]);
            quantize_row(k, &x, &mut q, &mut d);
            for (b, (xb, qb)) in x.chunks(BLOCK).zip(q.chunks(BLOCK)).enumerate() {
                let mut want = [0i8; BLOCK];
                let wd = quantize_block(xb, &mut want);
                assert_eq!(qb, want, "block {b} ({k:?})");
                assert_eq!(d[b].to_bits(), wd.to_bits(), "scale of block {b} ({k:?})");
            }
        }
    }
}
