//! Helpers for tests that build quantized matrices by hand.

use super::FloatType;

pub(crate) use super::pack_codes as pack;

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
