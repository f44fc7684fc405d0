//! Weight matrices as the model sees them: a storage format plus zero-copy byte handles.

use expert_store::{OwnedBytes, ResidentArena};

use crate::cpu::{matmul_many, tiled, DenseMatrix, FloatType, Isa, MatRef, QuantMatrix, TiledMatrix};

/// How a weight matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Unquantized floats.
    Dense(FloatType),
    /// MLX affine quantization.
    Affine {
        /// Bits per code.
        bits: u32,
        /// Columns per group.
        group: usize,
        /// Element type of scales and biases.
        scale_type: FloatType,
    },
    /// 4-bit MLX affine repacked into 16-row tiles for the cpu backend's int8 kernels (`crate::cpu::tiled`);
    /// made at load from `Affine`, or stored so in a packed store converted with `--layout tiled`.
    Tiled {
        /// Columns per group.
        group: usize,
        /// Element type of scales and biases.
        scale_type: FloatType,
        /// Tiles per panel (`crate::cpu::tiled::TiledMatrix::panel`; a byte keeps the format small).
        panel: u8,
    },
}

impl WeightFormat {
    /// Number of tensors that make up one matrix (weight [+ scales + biases]).
    pub fn parts(self) -> usize {
        match self {
            WeightFormat::Dense(_) | WeightFormat::Tiled { .. } => 1,
            WeightFormat::Affine { .. } => 3,
        }
    }

    /// Views `parts` (as counted by [`Self::parts`]) as a `[rows, cols]` matrix.
    pub fn view<'a>(self, rows: usize, cols: usize, parts: &[&'a [u8]]) -> MatRef<'a> {
        match self {
            WeightFormat::Dense(dtype) => MatRef::Dense(DenseMatrix {
                data: parts[0],
                dtype,
                rows,
                cols,
            }),
            WeightFormat::Affine {
                bits,
                group,
                scale_type,
            } => MatRef::Quant(QuantMatrix {
                packed: parts[0],
                scales: parts[1],
                biases: parts[2],
                scale_type,
                bits,
                group,
                rows,
                cols,
            }),
            WeightFormat::Tiled {
                group,
                scale_type,
                panel,
            } => MatRef::Tiled(TiledMatrix {
                data: parts[0],
                scale_type,
                group,
                rows,
                cols,
                panel: panel.into(),
            }),
        }
    }

    /// Bytes one `[rows, cols]` matrix occupies in each part, in part order.
    pub fn part_bytes(self, rows: usize, cols: usize) -> Vec<usize> {
        match self {
            WeightFormat::Dense(t) => vec![rows * cols * t.size()],
            WeightFormat::Affine {
                bits,
                group,
                scale_type,
            } => {
                let sb = rows * (cols / group) * scale_type.size();
                vec![rows * cols * bits as usize / 8, sb, sb]
            }
            WeightFormat::Tiled { group, scale_type, .. } => vec![tiled::tiled_len(rows, cols, group, scale_type)],
        }
    }
}

/// A resident weight matrix `[rows, cols]` (output features × input features).
#[derive(Debug, Clone)]
pub struct Linear {
    /// Storage format.
    pub format: WeightFormat,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Weight [, scales, biases] bytes.
    pub parts: Vec<OwnedBytes>,
    /// Additive output bias (`<module>.bias`), when the checkpoint has one.
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// A 4-bit matrix of arbitrary bytes from `seed` with small bf16 scales and biases, for tests and
    /// benchmarks that need a matrix's shape and cost, not trained values.
    #[doc(hidden)]
    pub fn arbitrary_q4(rows: usize, cols: usize, group: usize, seed: usize) -> Linear {
        let groups = rows * cols / group;
        // Low byte arbitrary, high byte 0x3c / 0xbc: bf16 values of magnitude 0.008 to 0.031 (scales positive,
        // biases negative).
        let params = |mul: usize, high: u8| -> Vec<u8> {
            (0..2 * groups)
                .map(|i| if i % 2 == 1 { high } else { (i * mul + seed) as u8 })
                .collect()
        };
        let codes = (0..rows * cols / 2)
            .map(|i| ((i * 131 + seed * 7) >> 3) as u8)
            .collect();
        Linear {
            format: WeightFormat::Affine {
                bits: 4,
                group,
                scale_type: FloatType::BF16,
            },
            rows,
            cols,
            parts: vec![
                OwnedBytes::from_vec(codes),
                OwnedBytes::from_vec(params(13, 0x3c)),
                OwnedBytes::from_vec(params(7, 0xbc)),
            ],
            bias: None,
        }
    }

    /// This matrix in the tiled layout, placed in `arena`, when it is 4-bit affine with whole 32-column blocks
    /// per group.
    pub fn tiled(&self, arena: &ResidentArena) -> Option<Linear> {
        let MatRef::Quant(q) = self.mat() else {
            return None;
        };
        let len = tiled::tiled_len(q.rows, q.cols, q.group, q.scale_type);
        let panel = crate::cpu::panel_tiles();
        let data = arena.place(len, |out| tiled::tile_into(&q, panel.into(), out))?;
        Some(Linear {
            format: WeightFormat::Tiled {
                group: q.group,
                scale_type: q.scale_type,
                panel,
            },
            rows: self.rows,
            cols: self.cols,
            parts: vec![data],
            bias: self.bias.clone(),
        })
    }

    /// A kernel view of the matrix.
    pub fn mat(&self) -> MatRef<'_> {
        let parts: Vec<&[u8]> = self.parts.iter().map(|p| p.as_slice()).collect();
        self.format.view(self.rows, self.cols, &parts)
    }

    /// `x` is `[n, cols]`; returns `[n, rows]`.
    pub fn forward(&self, isa: Isa, x: &[f32], n: usize) -> Vec<f32> {
        self.forward_with(isa, x, n, true)
    }

    /// [`Linear::forward`], with rows split across threads only when `parallel` (the result is the same).
    pub fn forward_with(&self, isa: Isa, x: &[f32], n: usize, parallel: bool) -> Vec<f32> {
        Self::forward_many(&[self], isa, x, n, parallel)
            .pop()
            .expect("one matrix, one output")
    }

    /// [`Linear::forward_with`] of each matrix in `ls` by the same `x`, in one pass (see [`matmul_many`]).
    pub fn forward_many(ls: &[&Linear], isa: Isa, x: &[f32], n: usize, parallel: bool) -> Vec<Vec<f32>> {
        let mut ys: Vec<Vec<f32>> = ls.iter().map(|l| vec![0f32; n * l.rows]).collect();
        let mats: Vec<MatRef<'_>> = ls.iter().map(|l| l.mat()).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        matmul_many(isa, &mats, x, n, &mut outs, parallel);
        for (y, l) in ys.iter_mut().zip(ls) {
            if let Some(b) = &l.bias {
                for row in y.chunks_mut(l.rows) {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            }
        }
        ys
    }
}
