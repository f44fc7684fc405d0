//! What to write for a shape: the tensors (names, dtypes, shapes, fills), the layer count `--size` picks, and
//! the config.json that describes the result.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::shapes::{HybridShape, Shape, SHAPES};
use super::tokenizer::EOS_ID;
use super::SynthArgs;

/// Router gates are stored at 8 bits, as mlx-lm's quantization predicate for MoE models does.
pub(super) const GATE_BITS: usize = 8;

/// A resolved model to write: the shape plus its quantization.
pub(super) struct Plan {
    pub(super) s: Shape,
    pub(super) bits: usize,
    pub(super) group: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Dtype {
    U32,
    Bf16,
}

impl Dtype {
    pub(super) fn name(self) -> &'static str {
        match self {
            Dtype::U32 => "U32",
            Dtype::Bf16 => "BF16",
        }
    }
}

/// One tensor to write: name, dtype, shape, how to fill it, and how many model parameters it stands for.
pub(super) struct Tensor {
    pub(super) name: String,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) fill: Fill,
    pub(super) params: u64,
    pub(super) expert: bool,
}

#[derive(Clone, Copy)]
pub(super) enum Fill {
    /// Uniform random bits.
    Random,
    /// Every element this bf16 value.
    Bf16(f32),
}

impl Tensor {
    pub(super) fn bytes(&self) -> u64 {
        let elems: usize = self.shape.iter().product();
        (elems * if self.dtype == Dtype::U32 { 4 } else { 2 }) as u64
    }

    /// The largest power of two (up to 4 KiB) dividing the size: laid out in decreasing order of this,
    /// every tensor starts at a multiple of its own.
    pub(super) fn align(&self) -> u64 {
        1 << self.bytes().trailing_zeros().min(12)
    }
}

impl Plan {
    /// The tensors of an affine-quantized linear `[lead.., rows, cols]` at `bits`, with scales that give
    /// zero-mean weights of standard deviation `gain`/√cols.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quantized(
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

    pub(super) fn norm(&self, out: &mut Vec<Tensor>, name: &str, len: usize) {
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
    pub(super) fn floats(&self, out: &mut Vec<Tensor>, name: &str, shape: &[usize], value: f32) {
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
    pub(super) fn hybrid_layer_tensors(&self, l: usize, hy: HybridShape) -> Vec<Tensor> {
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

    pub(super) fn layer_tensors(&self, l: usize) -> Vec<Tensor> {
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
    pub(super) fn tensors(&self) -> Vec<Tensor> {
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

pub(super) fn total_bytes(t: &[Tensor]) -> u64 {
    t.iter().map(Tensor::bytes).sum()
}

/// The resolved plan: the named shape with overrides, layers chosen by `--size` (counting `extra` bytes of
/// other files) or `--scale`.
pub(super) fn resolve(a: &SynthArgs, extra: u64) -> Result<Plan> {
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

/// config.json with the checkpoint's own Hugging Face field names and an mlx-lm quantization block.
pub(super) fn config(p: &Plan) -> Value {
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
