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

/// `out[c] += Σ_j w[j]·v[j·stride + c]`, each element's terms added in `j` order, multiply then add.
pub(super) fn weighted_rows(out: &mut [f32], w: &[f32], v: &[f32], stride: usize) {
    for (j, &p) in w.iter().enumerate() {
        for (acc, x) in out.iter_mut().zip(&v[j * stride..]) {
            *acc += p * x;
        }
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
