//! `sluice synth`: random-weight models in the MLX format with the exact tensor shapes of real models, of any
//! size (streamed to disk, never held in memory), with a tokenizer so they can be served and benchmarked.
//!
//! The weights are uniform random 4-bit (or `--bits`) codes with scales and biases chosen so every linear
//! layer has zero-mean weights of a sensible spread: activations stay finite and routing spreads over the
//! experts. The bytes come from a counter-based SplitMix64 stream per tensor (so they depend only on the seed,
//! not on how they are cut into buffers), generated in parallel into a few 16 MiB buffers that a writer thread
//! appends to the file with O_DIRECT on Linux, so generation overlaps the writes and the disk sets the pace.
//! Within each shard the header is padded to 4 KiB and the tensors are ordered so each starts on a boundary
//! as large as its size allows (up to 4 KiB; expert matrices always reach it), as O_DIRECT expert reads like.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use serde_json::{json, Value};

/// Arguments of `sluice synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// Shape to copy: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, bench-7b, qwen3.5-122b-a10b,
    /// qwen3.5-397b-a17b, qwen3-next-80b-a3b.
    #[arg(long)]
    shape: String,
    /// Output model directory.
    #[arg(short = 'o', long)]
    out: PathBuf,
    /// Override the layer count.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the experts per layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Override the hidden size.
    #[arg(long)]
    hidden: Option<usize>,
    /// Override the expert intermediate size (Mixtral's `intermediate_size`).
    #[arg(long)]
    moe_inter: Option<usize>,
    /// Override the vocabulary size.
    #[arg(long)]
    vocab: Option<usize>,
    /// Override the experts per token.
    #[arg(long)]
    top_k: Option<usize>,
    /// Multiply the layer count by this factor.
    #[arg(long, conflicts_with = "size")]
    scale: Option<f64>,
    /// Pick the layer count so the weights come to about this many bytes (e.g. 32G, 512M, 4GiB).
    #[arg(long, value_parser = sluice_runtime::parse_size)]
    size: Option<u64>,
    /// Bits per weight (2, 3, 4, 5, 6 or 8); router gates are always 8-bit, as mlx-lm writes them.
    #[arg(long, default_value_t = 4, value_parser = parse_bits)]
    bits: usize,
    /// Columns per quantization group (32, 64 or 128).
    #[arg(long, default_value_t = 64, value_parser = parse_group)]
    group_size: usize,
    /// Largest safetensors shard (as mlx-lm's 5 GB default).
    #[arg(long, default_value = "5G", value_parser = sluice_runtime::parse_size)]
    shard_size: u64,
    /// Seed of the random weights (the output depends only on the shape, the seed and the flags).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write into a non-empty directory (replacing the model*.safetensors files there).
    #[arg(long)]
    force: bool,
}

fn parse_bits(s: &str) -> Result<usize, String> {
    match s.parse() {
        Ok(b @ (2 | 3 | 4 | 5 | 6 | 8)) => Ok(b),
        _ => Err(format!("`{s}`: bits must be 2, 3, 4, 5, 6 or 8")),
    }
}

fn parse_group(s: &str) -> Result<usize, String> {
    match s.parse() {
        Ok(g @ (32 | 64 | 128)) => Ok(g),
        _ => Err(format!("`{s}`: the group size must be 32, 64 or 128")),
    }
}

/// The shape facts of a model family (Hugging Face config values).
#[derive(Clone, Copy)]
struct Shape {
    model_type: &'static str,
    hidden: usize,
    layers: usize,
    experts: usize,
    top_k: usize,
    moe_inter: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    max_pos: usize,
    rms_eps: f64,
    /// Qwen3-Next / Qwen3.5 hybrid layers.
    hybrid: Option<HybridShape>,
}

/// The linear-attention and shared-expert facts of a Qwen3-Next / Qwen3.5 shape.
#[derive(Clone, Copy)]
struct HybridShape {
    k_heads: usize,
    v_heads: usize,
    k_dim: usize,
    v_dim: usize,
    shared_inter: usize,
    /// Every `interval`-th layer is full attention.
    interval: usize,
    rope_theta: f64,
}

impl HybridShape {
    const fn qwen(k_heads: usize, v_heads: usize, shared_inter: usize, rope_theta: f64) -> Self {
        HybridShape {
            k_heads,
            v_heads,
            k_dim: 128,
            v_dim: 128,
            shared_inter,
            interval: 4,
            rope_theta,
        }
    }
}

/// Qwen3-Next / Qwen3.5 (architectures.md §9.1): 2 KV heads of 256, conv kernel 4.
#[allow(clippy::too_many_arguments)]
const fn hybrid(
    model_type: &'static str,
    hidden: usize,
    layers: usize,
    experts: usize,
    top_k: usize,
    moe_inter: usize,
    heads: usize,
    vocab: usize,
    h: HybridShape,
) -> Shape {
    Shape {
        model_type,
        hidden,
        layers,
        experts,
        top_k,
        moe_inter,
        heads,
        kv_heads: 2,
        head_dim: 256,
        vocab,
        max_pos: 262144,
        rms_eps: 1e-6,
        hybrid: Some(h),
    }
}

const SHAPES: &[(&str, Shape)] = &[
    // Qwen/Qwen3-30B-A3B.
    ("qwen3-30b-a3b", Shape::qwen(2048, 48, 128, 8, 768, 32, 4, 151936)),
    // Qwen/Qwen3-235B-A22B.
    ("qwen3-235b-a22b", Shape::qwen(4096, 94, 128, 8, 1536, 64, 4, 151936)),
    // The in-RAM benchmark shape: Qwen3-30B-A3B's layers, half the depth and experts, a small vocabulary.
    ("bench-7b", Shape::qwen(2048, 24, 64, 8, 768, 32, 4, 4096)),
    // mistralai/Mixtral-8x7B-v0.1.
    (
        "mixtral-8x7b",
        Shape {
            model_type: "mixtral",
            hidden: 4096,
            layers: 32,
            experts: 8,
            top_k: 2,
            moe_inter: 14336,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 32000,
            max_pos: 32768,
            rms_eps: 1e-5,
            hybrid: None,
        },
    ),
    // Qwen/Qwen3.5-122B-A10B: 69 GB at 4 bits, 2.0 GB of experts per token.
    (
        "qwen3.5-122b-a10b",
        hybrid(
            "qwen3_5_moe",
            3072,
            48,
            256,
            8,
            1024,
            32,
            248320,
            HybridShape::qwen(16, 64, 1024, 1e7),
        ),
    ),
    // Qwen/Qwen3.5-397B-A17B: 223 GB at 4 bits, 4.25 GB of experts per token.
    (
        "qwen3.5-397b-a17b",
        hybrid(
            "qwen3_5_moe",
            4096,
            60,
            512,
            10,
            1024,
            32,
            248320,
            HybridShape::qwen(16, 64, 1024, 1e7),
        ),
    ),
    // Qwen/Qwen3-Next-80B-A3B.
    (
        "qwen3-next-80b-a3b",
        hybrid(
            "qwen3_next",
            2048,
            48,
            512,
            10,
            512,
            16,
            151936,
            HybridShape::qwen(16, 32, 512, 5e6),
        ),
    ),
];

impl Shape {
    #[allow(clippy::too_many_arguments)]
    const fn qwen(
        hidden: usize,
        layers: usize,
        experts: usize,
        top_k: usize,
        moe_inter: usize,
        heads: usize,
        kv_heads: usize,
        vocab: usize,
    ) -> Self {
        Shape {
            model_type: "qwen3_moe",
            hidden,
            layers,
            experts,
            top_k,
            moe_inter,
            heads,
            kv_heads,
            head_dim: 128,
            vocab,
            max_pos: 40960,
            rms_eps: 1e-6,
            hybrid: None,
        }
    }

    /// Qwen3.5 checkpoints are VLM-style: the text model's tensors live under `language_model.`.
    fn prefix(&self) -> &'static str {
        if self.model_type == "qwen3_5_moe" {
            "language_model."
        } else {
            ""
        }
    }

    fn moe_prefix(&self, l: usize) -> String {
        match self.model_type {
            "mixtral" => format!("model.layers.{l}.block_sparse_moe"),
            _ => format!("{}model.layers.{l}.mlp", self.prefix()),
        }
    }

    /// Layers in one repeat of the layer pattern.
    fn period(&self) -> usize {
        self.hybrid.map_or(1, |h| h.interval)
    }
}

/// Router gates are stored at 8 bits, as mlx-lm's quantization predicate for MoE models does.
const GATE_BITS: usize = 8;

/// A resolved model to write: the shape plus its quantization.
struct Plan {
    s: Shape,
    bits: usize,
    group: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dtype {
    U32,
    Bf16,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::U32 => "U32",
            Dtype::Bf16 => "BF16",
        }
    }
}

/// One tensor to write: name, dtype, shape, how to fill it, and how many model parameters it stands for.
struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    fill: Fill,
    params: u64,
    expert: bool,
}

#[derive(Clone, Copy)]
enum Fill {
    /// Uniform random bits.
    Random,
    /// Every element this bf16 value.
    Bf16(f32),
}

impl Tensor {
    fn bytes(&self) -> u64 {
        let elems: usize = self.shape.iter().product();
        (elems * if self.dtype == Dtype::U32 { 4 } else { 2 }) as u64
    }

    /// The largest power of two (up to 4 KiB) dividing the size: laid out in decreasing order of this,
    /// every tensor starts at a multiple of its own.
    fn align(&self) -> u64 {
        1 << self.bytes().trailing_zeros().min(12)
    }
}

impl Plan {
    /// The tensors of an affine-quantized linear `[lead.., rows, cols]` at `bits`, with scales that give
    /// zero-mean weights of standard deviation `gain`/√cols.
    #[allow(clippy::too_many_arguments)]
    fn quantized(
        &self,
        out: &mut Vec<Tensor>,
        name: &str,
        lead: &[usize],
        rows: usize,
        cols: usize,
        bits: usize,
        gain: f32,
    ) {
        let levels = (1u64 << bits) as f32;
        // Uniform codes in 0..levels have mean (levels-1)/2 and standard deviation √((levels²-1)/12).
        let code_std = ((levels * levels - 1.0) / 12.0).sqrt();
        let scale = gain / ((cols as f32).sqrt() * code_std);
        let bias = -scale * (levels - 1.0) / 2.0;
        let shape = |last: usize| lead.iter().copied().chain([rows, last]).collect::<Vec<_>>();
        let expert = !lead.is_empty();
        let params = (lead.iter().product::<usize>() * rows * cols) as u64;
        out.push(Tensor {
            name: format!("{name}.weight"),
            dtype: Dtype::U32,
            shape: shape(cols * bits / 32),
            fill: Fill::Random,
            params,
            expert,
        });
        for (part, v) in [("scales", scale), ("biases", bias)] {
            out.push(Tensor {
                name: format!("{name}.{part}"),
                dtype: Dtype::Bf16,
                shape: shape(cols / self.group),
                fill: Fill::Bf16(v),
                params: 0,
                expert,
            });
        }
    }

    fn norm(&self, out: &mut Vec<Tensor>, name: &str, len: usize) {
        out.push(Tensor {
            name: format!("{name}.weight"),
            dtype: Dtype::Bf16,
            shape: vec![len],
            fill: Fill::Bf16(1.0),
            params: len as u64,
            expert: false,
        });
    }

    /// A small bf16 tensor (conv taps, per-head decay parameters) of one constant value.
    fn floats(&self, out: &mut Vec<Tensor>, name: &str, shape: &[usize], value: f32) {
        out.push(Tensor {
            name: name.to_string(),
            dtype: Dtype::Bf16,
            shape: shape.to_vec(),
            fill: Fill::Bf16(value),
            params: shape.iter().product::<usize>() as u64,
            expert: false,
        });
    }

    /// A Qwen3-Next / Qwen3.5 layer: Gated DeltaNet or gated attention, then routed plus shared experts.
    fn hybrid_layer_tensors(&self, l: usize, hy: HybridShape) -> Vec<Tensor> {
        let s = &self.s;
        let bits = self.bits;
        let out_gain = 0.1 / (s.layers.max(1) as f32).sqrt();
        let mut t = Vec::new();
        let h = s.hidden;
        let base = format!("{}model.layers.{l}", s.prefix());
        if !(l + 1).is_multiple_of(hy.interval) {
            let a = format!("{base}.linear_attn");
            let (kd, vd) = (hy.k_heads * hy.k_dim, hy.v_heads * hy.v_dim);
            let conv = 2 * kd + vd;
            if s.model_type == "qwen3_next" {
                self.quantized(&mut t, &format!("{a}.in_proj_qkvz"), &[], conv + vd, h, bits, 1.0);
                self.quantized(&mut t, &format!("{a}.in_proj_ba"), &[], 2 * hy.v_heads, h, bits, 1.0);
            } else {
                self.quantized(&mut t, &format!("{a}.in_proj_qkv"), &[], conv, h, bits, 1.0);
                self.quantized(&mut t, &format!("{a}.in_proj_z"), &[], vd, h, bits, 1.0);
                self.quantized(&mut t, &format!("{a}.in_proj_b"), &[], hy.v_heads, h, bits, 1.0);
                self.quantized(&mut t, &format!("{a}.in_proj_a"), &[], hy.v_heads, h, bits, 1.0);
            }
            // Conv taps averaging the last 4 inputs; decay exp(-softplus(a - 2)) ≈ 0.88 per token.
            self.floats(&mut t, &format!("{a}.conv1d.weight"), &[conv, 4, 1], 0.25);
            self.floats(&mut t, &format!("{a}.A_log"), &[hy.v_heads], 0.0);
            self.floats(&mut t, &format!("{a}.dt_bias"), &[hy.v_heads], -2.0);
            self.norm(&mut t, &format!("{a}.norm"), hy.v_dim);
            self.quantized(&mut t, &format!("{a}.out_proj"), &[], h, vd, bits, out_gain);
        } else {
            let a = format!("{base}.self_attn");
            let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
            self.quantized(&mut t, &format!("{a}.q_proj"), &[], 2 * q, h, bits, 1.0);
            self.quantized(&mut t, &format!("{a}.k_proj"), &[], kv, h, bits, 1.0);
            self.quantized(&mut t, &format!("{a}.v_proj"), &[], kv, h, bits, 1.0);
            self.quantized(&mut t, &format!("{a}.o_proj"), &[], h, q, bits, out_gain);
            self.norm(&mut t, &format!("{a}.q_norm"), s.head_dim);
            self.norm(&mut t, &format!("{a}.k_norm"), s.head_dim);
        }
        self.norm(&mut t, &format!("{base}.input_layernorm"), h);
        self.norm(&mut t, &format!("{base}.post_attention_layernorm"), h);
        let m = s.moe_prefix(l);
        self.quantized(&mut t, &format!("{m}.gate"), &[], s.experts, h, GATE_BITS, 1.0);
        let (e, i) = ([s.experts], s.moe_inter);
        self.quantized(&mut t, &format!("{m}.switch_mlp.gate_proj"), &e, i, h, bits, 1.0);
        self.quantized(&mut t, &format!("{m}.switch_mlp.up_proj"), &e, i, h, bits, 1.0);
        self.quantized(&mut t, &format!("{m}.switch_mlp.down_proj"), &e, h, i, bits, out_gain);
        let (se, si) = (format!("{m}.shared_expert"), hy.shared_inter);
        self.quantized(&mut t, &format!("{se}.gate_proj"), &[], si, h, bits, 1.0);
        self.quantized(&mut t, &format!("{se}.up_proj"), &[], si, h, bits, 1.0);
        self.quantized(&mut t, &format!("{se}.down_proj"), &[], h, si, bits, out_gain);
        self.quantized(&mut t, &format!("{m}.shared_expert_gate"), &[], 1, h, GATE_BITS, 1.0);
        t
    }

    fn layer_tensors(&self, l: usize) -> Vec<Tensor> {
        let s = &self.s;
        if let Some(hy) = s.hybrid {
            return self.hybrid_layer_tensors(l, hy);
        }
        let bits = self.bits;
        // Residual branches kept small (0.1/√layers in total): the residual stream stays dominated by the
        // token, so routing spreads over the experts from token to token as in trained, load-balanced models.
        // With unit-gain random layers, attention averaging pulls every token towards the same experts (14 of
        // 64 per layer over 24 tokens, measured) and flatters every cache.
        let out_gain = 0.1 / (s.layers as f32).sqrt();
        let mut t = Vec::new();
        let (h, q, kv) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let a = format!("model.layers.{l}.self_attn");
        self.quantized(&mut t, &format!("{a}.q_proj"), &[], q, h, bits, 1.0);
        self.quantized(&mut t, &format!("{a}.k_proj"), &[], kv, h, bits, 1.0);
        self.quantized(&mut t, &format!("{a}.v_proj"), &[], kv, h, bits, 1.0);
        self.quantized(&mut t, &format!("{a}.o_proj"), &[], h, q, bits, out_gain);
        if s.model_type == "qwen3_moe" {
            self.norm(&mut t, &format!("{a}.q_norm"), s.head_dim);
            self.norm(&mut t, &format!("{a}.k_norm"), s.head_dim);
        }
        self.norm(&mut t, &format!("model.layers.{l}.input_layernorm"), h);
        self.norm(&mut t, &format!("model.layers.{l}.post_attention_layernorm"), h);
        let m = s.moe_prefix(l);
        self.quantized(&mut t, &format!("{m}.gate"), &[], s.experts, h, GATE_BITS, 1.0);
        let e = [s.experts];
        let i = s.moe_inter;
        self.quantized(&mut t, &format!("{m}.switch_mlp.gate_proj"), &e, i, h, bits, 1.0);
        self.quantized(&mut t, &format!("{m}.switch_mlp.up_proj"), &e, i, h, bits, 1.0);
        self.quantized(&mut t, &format!("{m}.switch_mlp.down_proj"), &e, h, i, bits, out_gain);
        t
    }

    /// All tensors in checkpoint order: embeddings, the layers, the final norm and the head.
    fn tensors(&self) -> Vec<Tensor> {
        let s = &self.s;
        let mut t = Vec::new();
        // Unit-variance embeddings: the residual stream is O(1) and the layers' small branches stay small.
        let emb_gain = (s.hidden as f32).sqrt();
        let pre = s.prefix();
        self.quantized(
            &mut t,
            &format!("{pre}model.embed_tokens"),
            &[],
            s.vocab,
            s.hidden,
            self.bits,
            emb_gain,
        );
        for l in 0..s.layers {
            t.extend(self.layer_tensors(l));
        }
        self.norm(&mut t, &format!("{pre}model.norm"), s.hidden);
        self.quantized(&mut t, &format!("{pre}lm_head"), &[], s.vocab, s.hidden, self.bits, 1.0);
        t
    }
}

fn total_bytes(t: &[Tensor]) -> u64 {
    t.iter().map(Tensor::bytes).sum()
}

/// The resolved plan: the named shape with overrides, layers chosen by `--size` (counting `extra` bytes of
/// other files) or `--scale`.
fn resolve(a: &SynthArgs, extra: u64) -> Result<Plan> {
    let Some(&(_, mut s)) = SHAPES.iter().find(|(n, _)| *n == a.shape) else {
        let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
        bail!("unknown shape `{}` (one of: {})", a.shape, names.join(", "));
    };
    s.layers = a.layers.unwrap_or(s.layers);
    s.experts = a.experts.unwrap_or(s.experts);
    s.hidden = a.hidden.unwrap_or(s.hidden);
    s.moe_inter = a.moe_inter.unwrap_or(s.moe_inter);
    s.vocab = a.vocab.unwrap_or(s.vocab);
    s.top_k = a.top_k.unwrap_or(s.top_k.min(s.experts));
    let group = a.group_size;
    for (flag, v) in [("--hidden", s.hidden), ("--moe-inter", s.moe_inter)] {
        if v == 0 || !v.is_multiple_of(group) {
            bail!("{flag} {v} must be a positive multiple of the group size {group}");
        }
    }
    if s.experts == 0 {
        bail!("--experts must be at least 1");
    }
    if s.vocab < 16 {
        bail!("--vocab must be at least 16");
    }
    if s.top_k == 0 || s.top_k > s.experts {
        bail!("--top-k must be between 1 and the number of experts ({})", s.experts);
    }
    if a.shard_size == 0 {
        bail!("--shard-size must be positive");
    }
    if let Some(f) = a.scale {
        if !(f.is_finite() && f > 0.0) {
            bail!("--scale must be a positive number");
        }
        s.layers = ((s.layers as f64 * f).round() as usize).max(1);
    }
    if s.layers == 0 {
        bail!("--layers must be at least 1");
    }
    let mut plan = Plan { s, bits: a.bits, group };
    if let Some(target) = a.size {
        // Whole repeats of the layer pattern (3 linear + 1 full attention for the hybrids) when at least one
        // fits, so the mix of layer kinds stays the model's.
        let period = plan.s.period();
        plan.s.layers = period;
        let per_period: u64 = (0..period).map(|l| total_bytes(&plan.layer_tensors(l))).sum();
        plan.s.layers = 0;
        let fixed = total_bytes(&plan.tensors()) + extra;
        let room = target.saturating_sub(fixed) as f64;
        let layers = (room / (per_period as f64 / period as f64)).round() as usize;
        plan.s.layers = if layers >= period {
            (room / per_period as f64).round() as usize * period
        } else {
            layers.max(1)
        };
    }
    Ok(plan)
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// Runs `sluice synth`.
pub fn run(a: SynthArgs) -> Result<()> {
    let vocab = SHAPES
        .iter()
        .find(|(n, _)| *n == a.shape)
        .map(|(_, s)| a.vocab.unwrap_or(s.vocab));
    let (tokenizer, tokenizer_config) = tokenizer_files(vocab.unwrap_or(16).max(16));
    let plan = resolve(&a, (tokenizer.len() + tokenizer_config.len()) as u64)?;
    prepare_dir(&a.out, a.force)?;
    let s = &plan.s;
    let tensors = plan.tensors();
    let total = total_bytes(&tensors);
    let shards = plan_shards(&tensors, a.shard_size);
    let params: u64 = tensors.iter().map(|t| t.params).sum();
    let expert_params: u64 = tensors.iter().filter(|t| t.expert).map(|t| t.params).sum();
    let expert_bytes: u64 = tensors.iter().filter(|t| t.expert).map(Tensor::bytes).sum();
    let active = params - expert_params + expert_params / s.experts as u64 * s.top_k as u64;
    eprintln!(
        "{} ({}): {} layers × {} experts (top-{}), hidden {}, expert intermediate {}, vocab {}, {}-bit g{}",
        a.shape, s.model_type, s.layers, s.experts, s.top_k, s.hidden, s.moe_inter, s.vocab, plan.bits, plan.group
    );
    eprintln!(
        "{:.2} B parameters ({:.2} B active), {} bytes ({}) in {} shard(s); one expert {}, resident {}",
        params as f64 / 1e9,
        active as f64 / 1e9,
        total,
        human(total),
        shards.len(),
        human(expert_bytes / (s.experts * s.layers) as u64),
        human(total - expert_bytes),
    );
    write_file(
        &a.out.join("config.json"),
        &serde_json::to_string_pretty(&config(&plan))?,
    )?;
    write_file(&a.out.join("tokenizer.json"), &tokenizer)?;
    write_file(&a.out.join("tokenizer_config.json"), &tokenizer_config)?;
    write_file(
        &a.out.join("generation_config.json"),
        &serde_json::to_string_pretty(&json!({"eos_token_id": [EOS_ID], "bos_token_id": null}))?,
    )?;
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("writing weights [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let started = Instant::now();
    write_shards(&a.out, &tensors, &shards, a.seed, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    sync_dir(&a.out)?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} in {secs:.1} s ({:.2} GB/s, synced)",
        a.out.display(),
        total as f64 / 1e9 / secs.max(1e-9)
    );
    Ok(())
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Creates `dir`, refusing a non-empty one without `force`; with it, removes old weight files so no stale
/// shard outlives the new index.
fn prepare_dir(dir: &Path, force: bool) -> Result<()> {
    if dir.exists() {
        let entries: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .collect::<std::io::Result<_>>()
            .with_context(|| format!("reading {}", dir.display()))?;
        if !entries.is_empty() && !force {
            bail!(
                "{} exists and is not empty; pass --force to write into it",
                dir.display()
            );
        }
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("model")
                && (name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json"))
            {
                std::fs::remove_file(e.path()).with_context(|| format!("removing {}", e.path().display()))?;
            }
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))
}

/// config.json with the checkpoint's own Hugging Face field names and an mlx-lm quantization block.
fn config(p: &Plan) -> Value {
    let s = &p.s;
    let mut quant = json!({"group_size": p.group, "bits": p.bits, "mode": "affine"});
    for l in 0..s.layers {
        quant[format!("{}.gate", s.moe_prefix(l))] = json!({"group_size": p.group, "bits": GATE_BITS});
        if s.hybrid.is_some() {
            quant[format!("{}.shared_expert_gate", s.moe_prefix(l))] =
                json!({"group_size": p.group, "bits": GATE_BITS});
        }
    }
    let mut c = json!({
        "model_type": s.model_type,
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "num_experts_per_tok": s.top_k,
        "vocab_size": s.vocab,
        "hidden_act": "silu",
        "rms_norm_eps": s.rms_eps,
        "rope_theta": 1000000.0,
        "max_position_embeddings": s.max_pos,
        "sliding_window": null,
        "tie_word_embeddings": false,
        "bos_token_id": null,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        "quantization": quant.clone(),
        "quantization_config": quant,
    });
    if let Some(hy) = s.hybrid {
        c["num_experts"] = json!(s.experts);
        c["moe_intermediate_size"] = json!(s.moe_inter);
        c["shared_expert_intermediate_size"] = json!(hy.shared_inter);
        c["linear_num_key_heads"] = json!(hy.k_heads);
        c["linear_num_value_heads"] = json!(hy.v_heads);
        c["linear_key_head_dim"] = json!(hy.k_dim);
        c["linear_value_head_dim"] = json!(hy.v_dim);
        c["linear_conv_kernel_dim"] = json!(4);
        c["full_attention_interval"] = json!(hy.interval);
        c["partial_rotary_factor"] = json!(0.25);
        c["rope_theta"] = json!(hy.rope_theta);
        c["norm_topk_prob"] = json!(true);
        c["decoder_sparse_step"] = json!(1);
        c["mlp_only_layers"] = json!([]);
        c["intermediate_size"] = json!(s.hidden * 3);
        if s.model_type == "qwen3_5_moe" {
            // VLM-style: the text model's fields under `text_config`, quantization at the top.
            c["model_type"] = json!("qwen3_5_moe_text");
            let quant = c["quantization"].take();
            if let Value::Object(text) = &mut c {
                text.remove("quantization");
                text.remove("quantization_config");
            }
            return json!({
                "model_type": "qwen3_5_moe",
                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "text_config": c,
                "tie_word_embeddings": false,
                "eos_token_id": EOS_ID,
                "quantization": quant.clone(),
                "quantization_config": quant,
            });
        }
        c["architectures"] = json!(["Qwen3NextForCausalLM"]);
    } else if s.model_type == "mixtral" {
        c["architectures"] = json!(["MixtralForCausalLM"]);
        c["num_local_experts"] = json!(s.experts);
        c["intermediate_size"] = json!(s.moe_inter);
    } else {
        c["architectures"] = json!(["Qwen3MoeForCausalLM"]);
        c["num_experts"] = json!(s.experts);
        c["moe_intermediate_size"] = json!(s.moe_inter);
        // Qwen3-MoE's (unused) dense width: 6144 for a 2048 hidden size.
        c["intermediate_size"] = json!(s.hidden * 3);
        c["norm_topk_prob"] = json!(true);
        c["decoder_sparse_step"] = json!(1);
        c["mlp_only_layers"] = json!([]);
        c["attention_bias"] = json!(false);
        c["use_sliding_window"] = json!(false);
    }
    c
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// `<|im_end|>`: the end of an assistant turn.
const EOS_ID: usize = 2;

/// The `k`-th generated word: bijective base-80 over consonant-vowel syllables ("ba", "be", …, "zu", "baba", …).
fn word(k: usize) -> String {
    const C: &[u8] = b"bdfghjklmnprstvz";
    const V: &[u8] = b"aeiou";
    let mut n = k + 1;
    let mut w = String::new();
    while n > 0 {
        n -= 1;
        let d = n % (C.len() * V.len());
        w.push(C[d / V.len()] as char);
        w.push(V[d % V.len()] as char);
        n /= C.len() * V.len();
    }
    w
}

/// tokenizer.json and tokenizer_config.json: a WordPiece tokenizer with exactly `vocab` ids (three ChatML
/// special tokens, every printable ASCII character as a word start and as a `##` continuation, then generated
/// words), so ASCII text encodes without unknowns and every id decodes to text; and a ChatML template.
fn tokenizer_files(vocab: usize) -> (String, String) {
    let chars = (33u8..=126).map(|c| (c as char).to_string());
    let pieces = SPECIALS
        .iter()
        .map(|s| s.to_string())
        .chain(chars.clone())
        .chain(chars.map(|c| format!("##{c}")))
        .chain((0..).map(word));
    let map: serde_json::Map<String, Value> = pieces.take(vocab).enumerate().map(|(i, p)| (p, json!(i))).collect();
    let added: Vec<_> = (SPECIALS.iter().enumerate())
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {
            "type": "WordPiece",
            "unk_token": SPECIALS[0],
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": map,
        },
    });
    let template = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] \
                    + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}\
                    {% endif %}";
    let cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": SPECIALS[EOS_ID],
        "pad_token": SPECIALS[0],
        "unk_token": SPECIALS[0],
        "model_max_length": 131072,
        "chat_template": template,
    });
    (
        tok.to_string(),
        serde_json::to_string_pretty(&cfg).expect("a JSON value serializes"),
    )
}

/// One shard: its file name and the indices of its tensors, in data order.
struct Shard {
    name: String,
    tensors: Vec<usize>,
}

/// Splits the tensors, in order, into shards of at most `limit` bytes (a bigger tensor gets a shard of its
/// own); within a shard they are ordered by decreasing alignment so each starts aligned.
fn plan_shards(tensors: &[Tensor], limit: u64) -> Vec<Shard> {
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if size > 0 && size + t.bytes() > limit {
            groups.push(Vec::new());
            size = 0;
        }
        size += t.bytes();
        groups.last_mut().expect("one shard").push(i);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, mut g)| {
            g.sort_by_key(|&t| std::cmp::Reverse(tensors[t].align()));
            let name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", i + 1)
            };
            Shard { name, tensors: g }
        })
        .collect()
}

/// The safetensors header of a shard, padded with spaces so the data starts on a 4 KiB boundary.
fn shard_header(tensors: &[Tensor], shard: &Shard) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "mlx"}));
    let mut off = 0u64;
    for &i in &shard.tensors {
        let t = &tensors[i];
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [off, off + t.bytes()]}),
        );
        off += t.bytes();
    }
    let json = serde_json::to_vec(&header)?;
    let len = (8 + json.len()).div_ceil(4096) * 4096 - 8;
    let mut out = Vec::with_capacity(8 + len);
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.resize(8 + len, b' ');
    Ok(out)
}

/// Size of the buffers handed from the generator to the writer thread.
const CHUNK: usize = 16 << 20;
/// Buffers in flight: one being filled, the rest queued or being written.
const BUFFERS: usize = 4;
/// Alignment of O_DIRECT writes (offset, length and memory).
const DIRECT_ALIGN: usize = 4096;

/// A `CHUNK`-byte buffer whose start is `DIRECT_ALIGN`-aligned in memory.
struct Buf {
    mem: Vec<u8>,
    start: usize,
}

impl Buf {
    fn new() -> Self {
        let mem = vec![0u8; CHUNK + DIRECT_ALIGN];
        let start = mem.as_ptr().align_offset(DIRECT_ALIGN);
        // Unaligned memory only costs the O_DIRECT path (the writer then falls back to buffered writes).
        let start = if start < DIRECT_ALIGN { start } else { 0 };
        Buf { mem, start }
    }

    fn bytes(&mut self) -> &mut [u8] {
        &mut self.mem[self.start..self.start + CHUNK]
    }
}

/// What the generator sends the writer thread, in file order.
enum Msg {
    /// Create this file.
    Open(PathBuf),
    /// Append the first `len` bytes of the buffer (then hand it back).
    Data(Buf, usize),
    /// Fsync the open file.
    Close,
}

/// Writes the shards and `model.safetensors.index.json`: the generator fills buffers in parallel while a
/// writer thread appends full ones to the file, so memory stays at `BUFFERS × CHUNK` for any model size.
fn write_shards(
    dir: &Path,
    tensors: &[Tensor],
    shards: &[Shard],
    seed: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<()> {
    let (full_tx, full_rx) = mpsc::sync_channel::<Msg>(BUFFERS);
    let (empty_tx, empty_rx) = mpsc::channel::<Buf>();
    for _ in 0..BUFFERS {
        empty_tx.send(Buf::new()).expect("the receiver is alive");
    }
    std::thread::scope(|scope| {
        let writer = scope.spawn(move || write_loop(full_rx, empty_tx, progress));
        let generated = generate(dir, tensors, shards, seed, &full_tx, &empty_rx);
        drop(full_tx);
        // A writer error explains a generator that stopped because the writer went away.
        writer.join().expect("the writer thread does not panic")?;
        generated
    })?;
    let mut weight_map = serde_json::Map::new();
    for shard in shards {
        for &i in &shard.tensors {
            weight_map.insert(tensors[i].name.clone(), json!(shard.name));
        }
    }
    let index = json!({"metadata": {"total_size": total_bytes(tensors)}, "weight_map": weight_map});
    write_file(
        &dir.join("model.safetensors.index.json"),
        &serde_json::to_string_pretty(&index)?,
    )
}

/// One output file, written around the page cache where the OS allows (O_DIRECT on Linux, F_NOCACHE on macOS:
/// disk speed, and no cached copy to flatter a later cold benchmark). O_DIRECT writes whole blocks, so a tail
/// shorter than a block is written padded and cut off at close.
struct OutFile {
    path: PathBuf,
    file: File,
    direct: bool,
    /// Bytes of real content written so far.
    len: u64,
}

impl OutFile {
    fn create(path: PathBuf) -> Result<Self> {
        let (file, direct) =
            expert_store::platform::create_uncached(&path).with_context(|| format!("creating {}", path.display()))?;
        // Only Linux's O_DIRECT needs whole aligned blocks; macOS's F_NOCACHE writes take any length.
        let direct = direct && expert_store::platform::UNCACHED_WRITES_NEED_ALIGNMENT;
        Ok(OutFile {
            path,
            file,
            direct,
            len: 0,
        })
    }

    fn append(&mut self, buf: &[u8], len: usize) -> Result<()> {
        let io = |p: &Path| format!("writing {}", p.display());
        if self.direct {
            let padded = len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
            match self.file.write_all(&buf[..padded]) {
                Ok(()) => {
                    self.len += len as u64;
                    return Ok(());
                }
                // Some filesystems accept O_DIRECT at open and refuse the write: go on buffered from here.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => self.buffered()?,
                Err(e) => return Err(e).with_context(|| io(&self.path)),
            }
        }
        self.file.write_all(&buf[..len]).with_context(|| io(&self.path))?;
        self.len += len as u64;
        Ok(())
    }

    /// Turns O_DIRECT off and goes back to the end of the real content.
    fn buffered(&mut self) -> Result<()> {
        use std::io::{Seek, SeekFrom};
        expert_store::platform::set_cached(&self.file)
            .with_context(|| format!("turning off O_DIRECT on {}", self.path.display()))?;
        self.direct = false;
        self.file
            .seek(SeekFrom::Start(self.len))
            .with_context(|| format!("seeking in {}", self.path.display()))?;
        Ok(())
    }

    /// Cuts off the padding of the last block and fsyncs.
    fn close(self) -> Result<()> {
        if self.direct {
            self.file
                .set_len(self.len)
                .with_context(|| format!("truncating {}", self.path.display()))?;
        }
        self.file
            .sync_all()
            .with_context(|| format!("syncing {}", self.path.display()))
    }
}

/// The writer thread: appends what it receives, returns emptied buffers, fsyncs each file at its end.
fn write_loop(rx: mpsc::Receiver<Msg>, back: mpsc::Sender<Buf>, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
    let mut open: Option<OutFile> = None;
    for msg in rx {
        match msg {
            Msg::Open(path) => open = Some(OutFile::create(path)?),
            Msg::Data(mut buf, len) => {
                let f = open.as_mut().context("data before a file was opened")?;
                f.append(buf.bytes(), len)?;
                progress(len as u64);
                // The generator may already be done and gone; then the buffer is simply dropped.
                let _ = back.send(buf);
            }
            Msg::Close => open.take().context("close before a file was opened")?.close()?,
        }
    }
    Ok(())
}

/// Fills buffers in file order and passes full ones to the writer thread.
struct Sink<'a> {
    tx: &'a mpsc::SyncSender<Msg>,
    empty: &'a mpsc::Receiver<Buf>,
    buf: Option<Buf>,
    len: usize,
}

impl Sink<'_> {
    fn gone() -> anyhow::Error {
        anyhow::anyhow!("the writer thread stopped")
    }

    fn send(&self, msg: Msg) -> Result<()> {
        self.tx.send(msg).map_err(|_| Self::gone())
    }

    /// Appends `n` bytes; `fill(dst, offset)` writes bytes `offset..offset + dst.len()` of them into `dst`.
    fn put(&mut self, n: u64, fill: impl Fn(&mut [u8], u64)) -> Result<()> {
        let mut done = 0u64;
        while done < n {
            let mut buf = match self.buf.take() {
                Some(b) => b,
                None => self.empty.recv().map_err(|_| Self::gone())?,
            };
            let k = (CHUNK - self.len).min((n - done) as usize);
            fill(&mut buf.bytes()[self.len..self.len + k], done);
            self.len += k;
            done += k as u64;
            if self.len == CHUNK {
                self.send(Msg::Data(buf, CHUNK))?;
                self.len = 0;
            } else {
                self.buf = Some(buf);
            }
        }
        Ok(())
    }

    /// Sends the partly filled buffer, if any.
    fn flush(&mut self) -> Result<()> {
        if let Some(buf) = self.buf.take() {
            self.send(Msg::Data(buf, self.len))?;
        }
        self.len = 0;
        Ok(())
    }
}

/// The generator: each shard's header and tensor data in order.
fn generate(
    dir: &Path,
    tensors: &[Tensor],
    shards: &[Shard],
    seed: u64,
    tx: &mpsc::SyncSender<Msg>,
    empty: &mpsc::Receiver<Buf>,
) -> Result<()> {
    let mut sink = Sink {
        tx,
        empty,
        buf: None,
        len: 0,
    };
    for shard in shards {
        sink.send(Msg::Open(dir.join(&shard.name)))?;
        let header = shard_header(tensors, shard)?;
        sink.put(header.len() as u64, |dst, off| {
            dst.copy_from_slice(&header[off as usize..off as usize + dst.len()])
        })?;
        for &i in &shard.tensors {
            let t = &tensors[i];
            let key = splitmix(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ splitmix(i as u64));
            sink.put(t.bytes(), |dst, off| fill(dst, t.fill, key, off))?;
        }
        sink.flush()?;
        sink.send(Msg::Close)?;
    }
    Ok(())
}

/// SplitMix64's output function.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with bytes `start..start + buf.len()` of a tensor filled per `how`. Random bytes are the
/// SplitMix64 stream of `key` (word `k` is `splitmix(key + k·φ)`), so the content does not depend on how the
/// tensor is cut into buffers; big buffers are generated in parallel.
fn fill(buf: &mut [u8], how: Fill, key: u64, start: u64) {
    match how {
        Fill::Random => {
            let word = |k: u64| splitmix(key.wrapping_add(k.wrapping_mul(0x9e37_79b9_7f4a_7c15))).to_le_bytes();
            // An unaligned head up to the next 8-byte boundary of the tensor.
            let head = (((8 - start % 8) % 8) as usize).min(buf.len());
            let (first, rest) = buf.split_at_mut(head);
            let skip = (start % 8) as usize;
            first.copy_from_slice(&word(start / 8)[skip..skip + head]);
            let base = (start + head as u64) / 8;
            const BLOCK: usize = 1 << 16;
            rest.par_chunks_mut(BLOCK).enumerate().for_each(|(b, c)| {
                let k0 = base + (b * BLOCK / 8) as u64;
                for (j, w) in c.chunks_mut(8).enumerate() {
                    w.copy_from_slice(&word(k0 + j as u64)[..w.len()]);
                }
            });
        }
        Fill::Bf16(v) => {
            let bits = v.to_bits();
            // Round to nearest even.
            let b = ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            let [lo, hi] = b.to_le_bytes();
            let pattern = if start.is_multiple_of(2) { [lo, hi] } else { [hi, lo] };
            for w in buf.chunks_mut(2) {
                w.copy_from_slice(&pattern[..w.len()]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bytes_do_not_depend_on_how_a_tensor_is_cut() {
        let mut whole = vec![0u8; 300_001];
        fill(&mut whole, Fill::Random, 7, 0);
        let mut pieces = vec![0u8; whole.len()];
        let cuts = [0, 3, 8, 13, 70_000, 200_001, whole.len()];
        for w in cuts.windows(2) {
            fill(&mut pieces[w[0]..w[1]], Fill::Random, 7, w[0] as u64);
        }
        assert_eq!(whole, pieces);
        let mut other = vec![0u8; 64];
        fill(&mut other, Fill::Random, 8, 0);
        assert_ne!(&whole[..64], &other[..]);
    }

    #[test]
    fn words_are_distinct_and_bf16_rounds() {
        let words: std::collections::HashSet<String> = (0..200_000).map(word).collect();
        assert_eq!(words.len(), 200_000);
        assert_eq!(word(0), "ba");
        let mut b = [0u8; 4];
        fill(&mut b, Fill::Bf16(1.0), 0, 0);
        assert_eq!(b, [0x80, 0x3f, 0x80, 0x3f]);
    }
}
