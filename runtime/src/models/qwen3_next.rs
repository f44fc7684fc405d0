//! Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe`): Qwen3-Next-80B-A3B, Qwen3.5-122B-A10B,
//! Qwen3.5-397B-A17B.
//!
//! A hybrid stack: three Gated DeltaNet (linear attention) layers, then one gated full-attention layer
//! (q/k RMSNorm, partial NeoX RoPE, `sigmoid(gate)` on the output), repeating; `layer_types` decides when
//! present. Every MoE block adds a shared expert scaled by `sigmoid(shared_expert_gate · x)`. The two model
//! types differ only in the linear-attention projections (grouped `in_proj_qkvz`/`in_proj_ba` vs split
//! `in_proj_qkv/z/b/a`), which the layer detects from the weight names.
//!
//! Norm convention: Hugging Face checkpoints store `input_layernorm`, `post_attention_layernorm`, the final
//! norm and q/k norms zero-centred and apply `1 + w`; MLX conversions store `1 + w` already. As in mlx-lm,
//! the conv1d layout tells them apart: PyTorch `[C, 1, K]` means Hugging Face.

use serde::Deserialize;

use super::{Architecture, DecoderDims, FfnPlan, Hybrid};
use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;
use crate::gated_delta::DeltaShape;
use crate::moe::RouterKind;
use crate::ops::{AttnShape, Rope};
use crate::weights::Weights;

/// `config.json` (or `text_config`) fields, with the checkpoint's names.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3NextConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    #[serde(default = "four")]
    pub linear_conv_kernel_dim: usize,
    #[serde(default = "four")]
    pub full_attention_interval: usize,
    /// `linear_attention` / `full_attention` per layer (transformers ≥ 5 writes this instead of the interval).
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "quarter")]
    pub partial_rotary_factor: f64,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_ctx")]
    pub max_position_embeddings: usize,
    /// Qwen3.5 always renormalizes (the field was removed); mlx-lm defaults Qwen3-Next to false.
    pub norm_topk_prob: Option<bool>,
}

fn one() -> usize {
    1
}
fn four() -> usize {
    4
}
fn quarter() -> f64 {
    0.25
}
fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f64 {
    100000.0
}
fn default_ctx() -> usize {
    262144
}

impl Qwen3NextConfig {
    fn is_qwen3_5(&self) -> bool {
        self.model_type.starts_with("qwen3_5")
    }

    /// Whether layer `i` is Gated DeltaNet (else gated full attention).
    pub fn is_linear(&self, i: usize) -> bool {
        match &self.layer_types {
            Some(t) => t.get(i).is_some_and(|k| k == "linear_attention"),
            None => !(i + 1).is_multiple_of(self.full_attention_interval.max(1)),
        }
    }

    /// Whether layer `i` routes to experts (else it is a dense MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.num_experts > 0
            && (self.is_qwen3_5()
                || (!self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step.max(1))))
    }
}

/// Describes a `qwen3_next` or `qwen3_5_moe` checkpoint from its config (and its tensors' shapes, when loading).
pub fn describe(config: &ModelConfig, tensors: Option<&Weights>) -> Result<Architecture> {
    // The MoE kinds always have a shared expert beside the routed ones, as in Hugging Face's and mlx-lm's
    // blocks: without its size it would be dropped, and the model would load and answer wrong. (Checked first,
    // so that a missing or null one is named.)
    if config.model_type == "qwen3_next" || config.model_type.starts_with("qwen3_5_moe") {
        config.require(&[
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ])?;
    }
    let c: Qwen3NextConfig = config.typed()?;
    if let Some(t) = &c.layer_types {
        if t.len() != c.num_hidden_layers || t.iter().any(|k| k != "linear_attention" && k != "full_attention") {
            return Err(config.error(format!(
                "layer_types must list `linear_attention` or `full_attention` for each of the {} layers",
                c.num_hidden_layers
            )));
        }
    }
    let attn = AttnShape::from_config(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let rot = (attn.head_dim as f64 * c.partial_rotary_factor) as usize;
    if rot == 0 || !rot.is_multiple_of(2) || rot > attn.head_dim {
        return Err(config.error(format!(
            "partial_rotary_factor {} gives {rot} rotated dims of head_dim {}; need an even number in 2..=head_dim",
            c.partial_rotary_factor, attn.head_dim
        )));
    }
    let delta = DeltaShape {
        k_heads: c.linear_num_key_heads,
        v_heads: c.linear_num_value_heads,
        k_dim: c.linear_key_head_dim,
        v_dim: c.linear_value_head_dim,
        kernel: c.linear_conv_kernel_dim,
    };
    let linear: Vec<bool> = (0..c.num_hidden_layers).map(|i| c.is_linear(i)).collect();
    // Hugging Face layout (PyTorch conv [C, 1, K]) stores zero-centred norms: add the 1 here. (Without the
    // tensors, for sizing only, the convention does not matter.)
    let hf = linear.iter().position(|&l| l).is_some_and(|i| {
        let conv = tensors.and_then(|w| w.shape(&format!("model.layers.{i}.linear_attn.conv1d.weight")));
        conv.is_some_and(|s| s.len() == 3 && s[1] == 1 && s[2] != 1)
    });
    let renormalize = c.norm_topk_prob.unwrap_or(c.is_qwen3_5());
    let dims = DecoderDims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        attn,
        vocab: c.vocab_size,
        context_length: crate::config::context_length(c.max_position_embeddings, c.rope_scaling.as_ref()),
        eps: c.rms_norm_eps,
        tie_embeddings: c.tie_word_embeddings,
        qk_norm: true,
        rope: Rope::new(rot, c.rope_theta, false, c.rope_scaling.as_ref())?,
        router: RouterKind::SoftmaxTopK { renormalize },
        top_k: c.num_experts_per_tok,
        hybrid: Some(Hybrid {
            linear,
            delta,
            norm_offset: if hf { 1.0 } else { 0.0 },
        }),
    };
    Ok(Architecture::new(dims, |i| {
        let prefix = format!("model.layers.{i}.mlp");
        if c.is_moe_layer(i) {
            FfnPlan::Moe {
                prefix,
                num_experts: c.num_experts,
                inter: c.moe_intermediate_size,
                shared: (c.shared_expert_intermediate_size > 0).then_some(c.shared_expert_intermediate_size),
            }
        } else {
            FfnPlan::Dense {
                prefix,
                inter: c.intermediate_size,
            }
        }
    }))
}
