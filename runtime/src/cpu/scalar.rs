//! Portable scalar kernels, and the reference matmul every SIMD path is tested against.

use super::MatRef;

/// `Σ a[i]·b[i]`, sequential.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Unpacks codes from an MLX little-endian bit stream: code `k` occupies bits `[k·bits, (k+1)·bits)`.
pub(super) fn unpack(bits: u32, packed: &[u8], out: &mut [f32]) {
    let b = bits as usize;
    let mask = (1u32 << bits) - 1;
    for (k, o) in out.iter_mut().enumerate() {
        let bit = k * b;
        let byte = bit / 8;
        // A code spans at most two bytes (bits ≤ 8); read two when the second exists.
        let lo = packed[byte] as u32;
        let hi = packed.get(byte + 1).copied().unwrap_or(0) as u32;
        *o = (((lo | (hi << 8)) >> (bit % 8)) & mask) as f32;
    }
}

/// Below this, `exp` returns 0 (the true value is under 1.2e-38; above it, `2^n` stays a normal float).
pub(super) const EXP_LO: f32 = -87.33;
/// Above this, `exp` saturates at `exp(EXP_HI)` (≈ 2.6e38, the largest `n` whose `2^n` is finite).
pub(super) const EXP_HI: f32 = 88.37;
pub(super) const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two: the high part has few mantissa bits, so `n·LN2_HI` is exact and the low part
/// carries the rest.
pub(super) const LN2_HI: f32 = 355.0 / 512.0;
pub(super) const LN2_LO: f32 = -2.121_944_4e-4;
/// `1/k!` for k = 7 down to 2: `exp(r)` on `|r| ≤ ln2/2` by its Taylor series (the next term is below
/// half an ulp), evaluated by Horner's rule then `·r + 1`, `·r + 1`.
pub(super) const EXP_TAYLOR: [f32; 6] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5];
/// Lanes of softmax's running sum: element `i` adds into lane `i % 16` on every instruction set.
pub(super) const SUM_LANES: usize = 16;

/// `e^x` within about 1 ulp, by the operations every SIMD softmax repeats lane by lane (fused multiply-adds
/// included), so all give the same bits: `x = n·ln2 + r` with `n = round(x·log2 e)`, then `2^n · e^r`.
pub(super) fn exp(x: f32) -> f32 {
    if x < EXP_LO {
        return 0.0;
    }
    // NaN fails both comparisons and stays NaN.
    let x = if x > EXP_HI { EXP_HI } else { x };
    let n = (x * LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_TAYLOR[0];
    for c in &EXP_TAYLOR[1..] {
        p = p.mul_add(r, *c);
    }
    let p = p.mul_add(r, 1.0).mul_add(r, 1.0);
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `gate = silu(gate) · up` elementwise, with [`exp`]: `g / (1 + exp(−g)) · u`, where `−g` past `EXP_HI` (a
/// little below where libm's `exp` overflows, 88.72) counts as +∞: a very negative gate gives −0 (within ~3e-37
/// of the exact value), not the tiny quotient of `exp`'s clamped value. Only the first `min(len)` elements.
pub(super) fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let e = if -*g > EXP_HI { f32::INFINITY } else { exp(-*g) };
        *g = *g / (1.0 + e) * u;
    }
}

/// Adds softmax's 16 lane sums in a fixed tree: lane `l` takes lane `l + w` for w = 8, 4, 2, 1.
pub(super) fn reduce_lanes(mut acc: [f32; SUM_LANES]) -> f32 {
    let mut w = SUM_LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Softmax in place: `e^(x - max)` by [`exp`], summed in [`SUM_LANES`] lanes, then divided by the sum.
pub(super) fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut acc = [0f32; SUM_LANES];
    for (i, v) in x.iter_mut().enumerate() {
        *v = exp(*v - m);
        acc[i % SUM_LANES] += *v;
    }
    divide_all(x, reduce_lanes(acc));
}

/// `x[i] /= s` for every element.
pub(super) fn divide_all(x: &mut [f32], s: f32) {
    for v in x {
        *v /= s;
    }
}

/// The oracle: dequantize each weight `w = scale·q + bias` and sum `w·x` in order, one token at a time.
pub fn reference_matmul(w: &MatRef<'_>, x: &[f32], n: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        match w {
            MatRef::Dense(d) => d.dtype.to_f32(d.data, r * cols, &mut row),
            MatRef::Tiled(t) => t.row(r, &mut row),
            MatRef::Quant(q) => {
                let row_bytes = cols * q.bits as usize / 8;
                let gpr = cols / q.group;
                for (k, v) in row.iter_mut().enumerate() {
                    let bit = k * q.bits as usize;
                    let mut code = 0u32;
                    for j in 0..q.bits as usize {
                        let pos = bit + j;
                        let byte = q.packed[r * row_bytes + pos / 8];
                        code |= (((byte >> (pos % 8)) & 1) as u32) << j;
                    }
                    let s = q.scale_type.get(q.scales, r * gpr + k / q.group);
                    let b = q.scale_type.get(q.biases, r * gpr + k / q.group);
                    *v = s * code as f32 + b;
                }
            }
        }
        for t in 0..n {
            y[t * rows + r] = row.iter().zip(&x[t * cols..(t + 1) * cols]).map(|(a, b)| a * b).sum();
        }
    }
}
