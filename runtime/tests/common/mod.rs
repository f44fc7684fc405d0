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

/// A random quantized matrix that owns its bytes (codes, scales and biases of `scale_type`).
#[allow(dead_code)] // not every test binary uses it
pub struct RandomQuant {
    packed: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
    bits: u32,
    group: usize,
    rows: usize,
    cols: usize,
    scale_type: sluice_runtime::cpu::FloatType,
}

#[allow(dead_code)] // not every test binary uses it
impl RandomQuant {
    /// Draws codes uniformly, scales in ±0.1 and biases in ±1, stored as `scale_type`.
    pub fn new(
        rng: &mut impl rand::Rng,
        (bits, group, rows, cols): (u32, usize, usize, usize),
        scale_type: sluice_runtime::cpu::FloatType,
    ) -> Self {
        let gpr = cols / group;
        let codes: Vec<u32> = (0..rows * cols).map(|_| rng.gen_range(0..(1u32 << bits))).collect();
        let mut floats = |n: usize, range: f32| -> Vec<u8> {
            (0..n)
                .flat_map(|_| half_bytes(rng.gen_range(-range..range), scale_type))
                .collect()
        };
        let scales = floats(rows * gpr, 0.1);
        let biases = floats(rows * gpr, 1.0);
        RandomQuant {
            packed: sluice_runtime::cpu::pack_codes(bits, &codes),
            scales,
            biases,
            bits,
            group,
            rows,
            cols,
            scale_type,
        }
    }

    /// The matrix as the kernels take it.
    pub fn view(&self) -> sluice_runtime::cpu::QuantMatrix<'_> {
        sluice_runtime::cpu::QuantMatrix {
            packed: &self.packed,
            scales: &self.scales,
            biases: &self.biases,
            scale_type: self.scale_type,
            bits: self.bits,
            group: self.group,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// `v` as the two little-endian bytes of an f16, or else of a bf16.
#[allow(dead_code)] // not every test binary uses it
pub fn half_bytes(v: f32, ty: sluice_runtime::cpu::FloatType) -> [u8; 2] {
    match ty {
        sluice_runtime::cpu::FloatType::F16 => half::f16::from_f32(v).to_bits().to_le_bytes(),
        _ => half::bf16::from_f32(v).to_bits().to_le_bytes(),
    }
}

/// `m` tiled in panels of `panel` tiles (the layout resident 4-bit matrices take under the int8 kernels), and its view.
#[allow(dead_code)] // not every test binary uses it
pub fn tiled_view<'a>(
    m: &sluice_runtime::cpu::QuantMatrix<'_>,
    tiles: &'a [u8],
    panel: usize,
) -> sluice_runtime::cpu::MatRef<'a> {
    sluice_runtime::cpu::MatRef::Tiled(sluice_runtime::cpu::TiledMatrix {
        data: tiles,
        scale_type: m.scale_type,
        group: m.group,
        rows: m.rows,
        cols: m.cols,
        panel,
    })
}

/// `matmul_many` over matrices of several layouts (4- and 8-bit of two group sizes, bf16 and f16 scales, a dense one,
/// two tiled ones (panels of one tile and of four), one big enough to split into several tasks) equals each matrix's
/// `matmul` alone, bit for bit, for 1 to 5 tokens, in parallel and not: with whichever kernels the process has switched
/// on.
#[allow(dead_code)] // not every test binary uses it
pub fn assert_matmul_many_equals_each_alone() {
    use rand::{Rng, SeedableRng};
    use sluice_runtime::cpu::{matmul_many, tiled, DenseMatrix, FloatType, Isa, MatRef};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let cols = 256;
    let owned: Vec<RandomQuant> = [
        (4u32, 64usize, 300usize, FloatType::BF16),
        (4, 32, 37, FloatType::F16),
        (8, 64, 5, FloatType::BF16),
        (8, 128, 64, FloatType::F16),
        (4, 64, 1, FloatType::BF16),
    ]
    .iter()
    .map(|&(bits, group, rows, ty)| RandomQuant::new(&mut rng, (bits, group, rows, cols), ty))
    .collect();
    let dense: Vec<u8> = (0..9 * cols)
        .flat_map(|_| half_bytes(rng.gen_range(-0.5f32..0.5), FloatType::BF16))
        .collect();
    let mut mats: Vec<MatRef<'_>> = owned.iter().map(|o| MatRef::Quant(o.view())).collect();
    mats.insert(
        2,
        MatRef::Dense(DenseMatrix {
            data: &dense,
            dtype: FloatType::BF16,
            rows: 9,
            cols,
        }),
    );
    // The first matrix again, tiled, in panels of one tile and of four.
    let first = owned[0].view();
    let panels = [1, tiled::PASS_TILES];
    let tiles = panels.map(|p| tiled::tile(&first, p).expect("4-bit g64 tiles"));
    for (tiles, panel) in tiles.iter().zip(panels) {
        mats.push(tiled_view(&first, tiles, panel));
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
    use sluice_runtime::cpu::{matmul_many, tiled, token_block, FloatType, Isa, MatRef};
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (cols, group) = (4096, 64);
    let four = RandomQuant::new(&mut rng, (4, group, 64, cols), FloatType::BF16);
    let eight = RandomQuant::new(&mut rng, (8, group, 5, cols), FloatType::BF16);
    let tiles = tiled::tile(&four.view(), tiled::PASS_TILES).expect("4-bit g64 tiles");
    let mats = [
        MatRef::Quant(four.view()),
        MatRef::Quant(eight.view()),
        tiled_view(&four.view(), &tiles, tiled::PASS_TILES),
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
