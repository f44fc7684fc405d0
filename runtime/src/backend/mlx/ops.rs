//! Small helpers of the mlx backend: uploads, the linear layer, errors.

use expert_store::OwnedBytes;
use mlx_rs::Array;

use crate::error::{ModelError, Result};
use crate::linear::WeightFormat;

/// An MLX error as a model error.
pub(super) fn err(e: mlx_rs::error::Exception) -> ModelError {
    ModelError::Backend(format!("mlx: {e}"))
}

/// A backend error with this message.
pub(super) fn bad(msg: &str) -> ModelError {
    ModelError::Backend(format!("mlx: {msg}"))
}

/// An f32 array of `shape` (copied).
pub(super) fn f32s(v: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(v, shape)
}

/// A scalar f32 array.
pub(super) fn scalar(v: f32) -> Array {
    Array::from_f32(v)
}

/// A weight matrix `[rows, cols]` on the device.
pub enum MlxLinear {
    /// MLX affine-quantized: packed codes `[rows, cols·bits/32]` (u32), f32 scales and biases `[rows, groups]`.
    Quant {
        w: Array,
        scales: Array,
        biases: Array,
        group: i32,
        bits: i32,
        bias: Option<Array>,
    },
    /// f32, stored transposed (`[cols, rows]`) for `x · Wᵀ`.
    Dense { wt: Array, bias: Option<Array> },
}

impl MlxLinear {
    /// `x [n, cols]` → `[n, rows]`.
    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
        let (y, bias) = match self {
            MlxLinear::Quant {
                w,
                scales,
                biases,
                group,
                bits,
                bias,
            } => (
                mlx_rs::ops::quantized_matmul(x, w, scales, biases, true, *group, *bits).map_err(err)?,
                bias,
            ),
            MlxLinear::Dense { wt, bias } => (x.matmul(wt).map_err(err)?, bias),
        };
        match bias {
            Some(b) => y.add(b).map_err(err),
            None => Ok(y),
        }
    }
}

/// Uploads a `[rows, cols]` matrix stored as `format` in `parts` (as the cpu backend reads them). Packed
/// codes are wrapped in place where MLX can (see `zero_copy`); floats are converted to f32 copies.
pub(super) fn upload_linear(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    parts: &[OwnedBytes],
    bias: Option<&[f32]>,
) -> Result<MlxLinear> {
    let bias = bias.map(|b| f32s(b, &[b.len() as i32]));
    let (r, c) = (rows as i32, cols as i32);
    match format {
        WeightFormat::Tiled { .. } => Err(bad("a tiled matrix is the cpu backend's layout, not MLX's")),
        WeightFormat::Dense(ft) => {
            let mut v = vec![0f32; rows * cols];
            ft.to_f32(&parts[0], 0, &mut v);
            // Transposed here, not by MLX: a lazy op would belong to the loading thread's stream, and the
            // server computes on its engine thread (MLX: "no Stream(…) in current thread").
            let mut t = vec![0f32; rows * cols];
            for (i, row) in v.chunks_exact(cols.max(1)).enumerate() {
                for (j, &x) in row.iter().enumerate() {
                    t[j * rows + i] = x;
                }
            }
            // Only the transposed copy beside MLX's while it copies (a bf16 head is a gigabyte of f32).
            drop(v);
            let wt = f32s(&t, &[c, r]);
            Ok(MlxLinear::Dense { wt, bias })
        }
        WeightFormat::Affine {
            bits,
            group,
            scale_type,
        } => {
            let words = cols * bits as usize / 32;
            if parts[0].len() != rows * words * 4 {
                return Err(bad("packed weight size disagrees with its shape"));
            }
            let w = super::zero_copy::u32_array(&parts[0], rows, words).unwrap_or_else(|| {
                let codes: Vec<u32> = parts[0]
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                Array::from_slice(&codes, &[r, words as i32])
            });
            let groups = rows * (cols / group);
            let (mut s, mut b) = (vec![0f32; groups], vec![0f32; groups]);
            scale_type.to_f32(&parts[1], 0, &mut s);
            scale_type.to_f32(&parts[2], 0, &mut b);
            let g = (cols / group) as i32;
            Ok(MlxLinear::Quant {
                w,
                scales: f32s(&s, &[r, g]),
                biases: f32s(&b, &[r, g]),
                group: group as i32,
                bits: bits as i32,
                bias,
            })
        }
    }
}
