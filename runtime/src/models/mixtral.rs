//! Mixtral (`mixtral`): Mixtral-8x7B / 8x22B.
//!
//! Llama attention (no q/k norm), NeoX RoPE over the whole head; the router takes the top k of the raw
//! logits and softmaxes over those k. Every layer is MoE, under `block_sparse_moe`.

use serde::Deserialize;

use super::{Architecture, DecoderDims, FfnPlan};
use crate::config::{ModelConfig, RopeScaling};
use crate::error::Result;
use crate::moe::RouterKind;
use crate::ops::{AttnShape, Rope};
use crate::weights::Weights;

/// `config.json` fields, with Hugging Face names (`rope_traditional` is mlx-lm's).
#[derive(Debug, Clone, Deserialize)]
pub struct MixtralConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_ctx")]
    pub max_position_embeddings: usize,
}

fn default_eps() -> f32 {
    1e-5
}
fn default_theta() -> f64 {
    1e6
}
fn default_ctx() -> usize {
    32768
}

/// Describes a `mixtral` checkpoint.
pub fn describe(config: &ModelConfig, _tensors: Option<&Weights>) -> Result<Architecture> {
    let c: MixtralConfig = config.typed()?;
    let attn = AttnShape::from_config(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let dims = DecoderDims {
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        attn,
        vocab: c.vocab_size,
        context_length: crate::config::context_length(c.max_position_embeddings, c.rope_scaling.as_ref()),
        eps: c.rms_norm_eps,
        tie_embeddings: c.tie_word_embeddings,
        qk_norm: false,
        rope: Rope::new(attn.head_dim, c.rope_theta, c.rope_traditional, c.rope_scaling.as_ref())?,
        router: RouterKind::TopKSoftmax,
        top_k: c.num_experts_per_tok,
        hybrid: None,
    };
    Ok(Architecture::new(dims, |i| FfnPlan::Moe {
        prefix: format!("model.layers.{i}.block_sparse_moe"),
        num_experts: c.num_local_experts,
        inter: c.intermediate_size,
        shared: None,
    }))
}
