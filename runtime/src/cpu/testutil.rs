//! Helpers for tests that build quantized matrices by hand.

use super::FloatType;

/// Packs codes into MLX's little-endian bit stream.
pub(crate) fn pack(bits: u32, codes: &[u32]) -> Vec<u8> {
    let mut out = vec![0u8; codes.len() * bits as usize / 8];
    for (k, &c) in codes.iter().enumerate() {
        for j in 0..bits as usize {
            let pos = k * bits as usize + j;
            out[pos / 8] |= (((c >> j) & 1) as u8) << (pos % 8);
        }
    }
    out
}

/// Encodes floats as little-endian bytes of type `t`.
pub(crate) fn encode(t: FloatType, v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match t {
            FloatType::F32 => x.to_le_bytes().to_vec(),
            FloatType::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
            FloatType::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
        })
        .collect()
}
