//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};

/// Every committed fixture directory (those with a `golden.json`), sorted.
#[allow(dead_code)] // not every test binary uses it
pub fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("fixtures/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("golden.json").exists())
        .collect();
    v.sort();
    assert!(v.len() >= 25, "expected the committed fixtures, found {}", v.len());
    v
}

/// One fixture directory by name.
#[allow(dead_code)] // not every test binary uses it
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
}

/// Every position's logits for a fixed 9-token prompt.
#[allow(dead_code)] // not every test binary uses it
pub fn prompt_logits(m: &sluice_runtime::DecoderModel) -> Vec<f32> {
    let mut cache = m.new_cache();
    let vocab = m.info.vocab_size as u32;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % vocab).collect();
    let opts = sluice_runtime::ForwardOptions {
        all_logits: true,
        ..Default::default()
    };
    m.forward(&prompt, &mut cache, &opts).unwrap()
}

/// Checks `got` against `want` logit by logit within the golden tolerance (1e-3 + 1e-3·|want|; f32 on both
/// sides, the gap is summation order and transcendental functions); names both sides in the failure. Returns
/// the largest difference.
#[allow(dead_code)] // not every test binary uses it
pub fn assert_close(what: &str, got: &[f32], want: &[f32], names: (&str, &str)) -> f32 {
    sluice_runtime::golden::compare_logits(got, want)
        .unwrap_or_else(|e| panic!("{what} ({} vs {}): {e}", names.0, names.1))
}

/// The trained targets: the mixture-of-experts demo models with held-out perplexity goldens (`eval.json`).
#[allow(dead_code)] // not every test binary uses it
pub const TRAINED_TARGETS: [&str; 2] = ["brown-qwen3_moe-q4g64", "brown-qwen3_moe-q8g32"];

/// One row of `eval.json`: mlx-lm's perplexity at one experts-per-token value.
#[derive(serde::Deserialize)]
#[allow(dead_code)] // not every test binary uses it
pub struct EvalRow {
    pub top_k: usize,
    pub perplexity: f64,
}

/// Bigram baselines on the golden's windows.
#[derive(serde::Deserialize)]
#[allow(dead_code)] // not every test binary uses it
pub struct Bigram {
    pub interpolated_eval_windows: f64,
    pub add_one_eval_windows: f64,
}

/// A trained target's `eval.json`: mlx-lm's held-out perplexity over `windows` windows of `ctx` tokens.
#[derive(serde::Deserialize)]
#[allow(dead_code)] // not every test binary uses it
pub struct EvalGolden {
    pub text: String,
    pub ctx: usize,
    pub windows: usize,
    pub rows: Vec<EvalRow>,
    pub bigram: Bigram,
}

#[allow(dead_code)] // not every test binary uses it
impl EvalGolden {
    /// Reads `eval.json` of the fixture directory `dir`.
    pub fn load(dir: &Path) -> Self {
        let path = dir.join("eval.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The golden's windows and experts-per-token values, as `sluice eval` options.
    pub fn options(&self) -> sluice_runtime::eval::EvalOptions {
        sluice_runtime::eval::EvalOptions {
            ctx: self.ctx,
            top_ks: self.rows.iter().map(|r| r.top_k).collect(),
            max_windows: Some(self.windows),
        }
    }

    /// The held-out text, tokenized by `p`'s tokenizer.
    pub fn token_ids(&self, p: &sluice_runtime::Pipeline) -> Vec<u32> {
        let text = std::fs::read_to_string(fixture(&self.text)).unwrap();
        p.tokenize(&sluice_runtime::Prompt::Raw(text)).unwrap()
    }
}

/// `matmul_many` over matrices of several layouts (4- and 8-bit of two group sizes, bf16 and f16 scales, a dense one,
/// two tiled ones (panels of one tile and of four), one big enough to split into several tasks) equals each matrix's
/// `matmul` alone, bit for bit, for 1 to 5 tokens, in parallel and not: with whichever kernels the process has switched
/// on.
#[allow(dead_code)] // not every test binary uses it
pub fn assert_matmul_many_equals_each_alone() {
    use rand::{Rng, SeedableRng};
    use sluice_runtime::cpu::{matmul_many, pack_codes, DenseMatrix, FloatType, Isa, MatRef, QuantMatrix};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let cols = 256;
    struct Owned {
        packed: Vec<u8>,
        scales: Vec<u8>,
        biases: Vec<u8>,
        bits: u32,
        group: usize,
        rows: usize,
        ty: FloatType,
    }
    let half = |v: f32, ty: FloatType| match ty {
        FloatType::F16 => half::f16::from_f32(v).to_bits().to_le_bytes(),
        _ => half::bf16::from_f32(v).to_bits().to_le_bytes(),
    };
    let mut owned: Vec<Owned> = Vec::new();
    for &(bits, group, rows, ty) in &[
        (4u32, 64usize, 300usize, FloatType::BF16),
        (4, 32, 37, FloatType::F16),
        (8, 64, 5, FloatType::BF16),
        (8, 128, 64, FloatType::F16),
        (4, 64, 1, FloatType::BF16),
    ] {
        let gpr = cols / group;
        let codes: Vec<u32> = (0..rows * cols).map(|_| rng.gen_range(0..(1u32 << bits))).collect();
        owned.push(Owned {
            packed: pack_codes(bits, &codes),
            scales: (0..rows * gpr)
                .flat_map(|_| half(rng.gen_range(-0.1f32..0.1), ty))
                .collect(),
            biases: (0..rows * gpr)
                .flat_map(|_| half(rng.gen_range(-1f32..1.0), ty))
                .collect(),
            bits,
            group,
            rows,
            ty,
        });
    }
    let dense: Vec<u8> = (0..9 * cols)
        .flat_map(|_| half(rng.gen_range(-0.5f32..0.5), FloatType::BF16))
        .collect();
    let mut mats: Vec<MatRef<'_>> = owned
        .iter()
        .map(|o| {
            MatRef::Quant(QuantMatrix {
                packed: &o.packed,
                scales: &o.scales,
                biases: &o.biases,
                scale_type: o.ty,
                bits: o.bits,
                group: o.group,
                rows: o.rows,
                cols,
            })
        })
        .collect();
    mats.insert(
        2,
        MatRef::Dense(DenseMatrix {
            data: &dense,
            dtype: FloatType::BF16,
            rows: 9,
            cols,
        }),
    );
    // The first matrix again, tiled (the layout resident 4-bit matrices take under the int8 kernels), in
    // panels of one tile and of four.
    let MatRef::Quant(first) = mats[0] else { unreachable!() };
    let panels = [1, sluice_runtime::cpu::tiled::PASS_TILES];
    let tiles = panels.map(|p| sluice_runtime::cpu::tiled::tile(&first, p).expect("4-bit g64 tiles"));
    for (tiles, panel) in tiles.iter().zip(panels) {
        mats.push(MatRef::Tiled(sluice_runtime::cpu::TiledMatrix {
            data: tiles,
            scale_type: first.scale_type,
            group: first.group,
            rows: first.rows,
            cols,
            panel,
        }));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for isa in Isa::available() {
        for n in 1..=5 {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-3f32..3.0)).collect();
            for parallel in [true, false] {
                let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; n * m.rows()]).collect();
                let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
                matmul_many(isa, &mats, &x, n, &mut outs, parallel);
                for (i, (m, y)) in mats.iter().zip(&ys).enumerate() {
                    let mut alone = vec![0f32; n * m.rows()];
                    m.matmul(isa, &x, n, &mut alone);
                    assert_eq!(
                        bits(y),
                        bits(&alone),
                        "matrix {i}, {isa:?}, {n} tokens, parallel {parallel}"
                    );
                }
            }
        }
    }
}

/// A prompt longer than [`matmul_many`](sluice_runtime::cpu::matmul_many)'s token block (run in blocks) gives
/// each token what it gets alone, bit for bit, on every instruction set, for 4-bit (as stored and tiled) and
/// 8-bit matrices: with the exact kernels or the int8 ones, whichever the process has on.
#[allow(dead_code)] // not every test binary uses it
pub fn assert_long_prompts_equal_their_tokens_alone() {
    use rand::{Rng, SeedableRng};
    use sluice_runtime::cpu::{matmul_many, pack_codes, tiled, token_block, FloatType, Isa, MatRef, QuantMatrix};
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (cols, group) = (4096, 64);
    let gpr = cols / group;
    let bf16 = |v: f32| half::bf16::from_f32(v).to_bits().to_le_bytes();
    let owned: Vec<Owned> = [(4u32, 64usize), (8, 5)]
        .iter()
        .map(|&(bits, rows)| {
            let codes: Vec<u32> = (0..rows * cols).map(|_| rng.gen_range(0..(1u32 << bits))).collect();
            let scales = (0..rows * gpr)
                .flat_map(|_| bf16(rng.gen_range(-0.1f32..0.1)))
                .collect();
            let biases = (0..rows * gpr).flat_map(|_| bf16(rng.gen_range(-1f32..1.0))).collect();
            (bits, rows, pack_codes(bits, &codes), scales, biases)
        })
        .collect();
    type Owned = (u32, usize, Vec<u8>, Vec<u8>, Vec<u8>);
    fn quant((bits, rows, packed, scales, biases): &Owned, group: usize, cols: usize) -> QuantMatrix<'_> {
        QuantMatrix {
            packed,
            scales,
            biases,
            scale_type: FloatType::BF16,
            bits: *bits,
            group,
            rows: *rows,
            cols,
        }
    }
    let four = quant(&owned[0], group, cols);
    let tiles = tiled::tile(&four, tiled::PASS_TILES).expect("4-bit g64 tiles");
    let mats = [
        MatRef::Quant(four),
        MatRef::Quant(quant(&owned[1], group, cols)),
        MatRef::Tiled(sluice_runtime::cpu::TiledMatrix {
            data: &tiles,
            scale_type: FloatType::BF16,
            group,
            rows: four.rows,
            cols,
            panel: tiled::PASS_TILES,
        }),
    ];
    // Two whole blocks and a short one.
    let n = 2 * token_block(cols) + 5;
    let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-3f32..3.0)).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for isa in Isa::available() {
        for parallel in [true, false] {
            let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; n * m.rows()]).collect();
            let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
            matmul_many(isa, &mats, &x, n, &mut outs, parallel);
            for (i, (m, y)) in mats.iter().zip(&ys).enumerate() {
                for t in 0..n {
                    let mut alone = vec![0f32; m.rows()];
                    m.matmul(isa, &x[t * cols..(t + 1) * cols], 1, &mut alone);
                    assert_eq!(
                        bits(&y[t * m.rows()..(t + 1) * m.rows()]),
                        bits(&alone),
                        "matrix {i}, {isa:?}, token {t} of {n}, parallel {parallel}"
                    );
                }
            }
        }
    }
}
