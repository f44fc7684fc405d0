//! Qwen3-MoE (`qwen3_moe`): Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B; and dense Qwen3 (`qwen3`,
//! the draft models' family), which is the same decoder with a dense MLP in every layer.
//!
//! Llama-style GQA with per-head q/k RMSNorm before NeoX RoPE; softmax router over all experts, top-k,
//! optional renormalisation (`norm_topk_prob`); layers in `mlp_only_layers` (or off the
//! `decoder_sparse_step` grid) use a dense SwiGLU MLP.

use serde::Deserialize;

use super::{Architecture, DecoderDims, FfnPlan};
use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;
use crate::moe::RouterKind;
use crate::ops::{AttnShape, Rope};
use crate::weights::Weights;

/// `config.json` fields, with Hugging Face names.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3MoeConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    /// Absent (0) in dense `qwen3` checkpoints.
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
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_ctx")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
}

fn one() -> usize {
    1
}
fn default_theta() -> f64 {
    10000.0
}
fn default_ctx() -> usize {
    32768
}

impl Qwen3MoeConfig {
    /// Whether layer `i` routes to experts (else it is a dense MLP).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && (i + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }
}

/// Describes a `qwen3_moe` or `qwen3` checkpoint.
pub fn describe(config: &ModelConfig, _tensors: Option<&Weights>) -> Result<Architecture> {
    let c: Qwen3MoeConfig = config.typed()?;
    // Dense `qwen3` has no experts; a `qwen3_moe` config must say how many it has.
    if config.model_type == "qwen3_moe" {
        config.require(&["num_experts", "num_experts_per_tok", "moe_intermediate_size"])?;
    }
    let attn = AttnShape::from_config(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let dims = DecoderDims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        attn,
        vocab: c.vocab_size,
        context_length: crate::config::context_length(c.max_position_embeddings, c.rope_scaling.as_ref()),
        eps: c.rms_norm_eps,
        tie_embeddings: c.tie_word_embeddings,
        qk_norm: true,
        rope: Rope::new(attn.head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?,
        router: RouterKind::SoftmaxTopK {
            renormalize: c.norm_topk_prob,
        },
        top_k: c.num_experts_per_tok,
        hybrid: None,
    };
    Ok(Architecture::new(dims, |i| {
        let prefix = format!("model.layers.{i}.mlp");
        if c.is_moe_layer(i) {
            FfnPlan::Moe {
                prefix,
                num_experts: c.num_experts,
                inter: c.moe_intermediate_size,
                shared: None,
            }
        } else {
            FfnPlan::Dense {
                prefix,
                inter: c.intermediate_size,
            }
        }
    }))
}
