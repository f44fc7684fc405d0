//! The catalogue of real shapes `synth` copies: each model family's config values (hidden size, layers,
//! experts, heads, vocabulary; the hybrids' linear-attention facts).

/// The shape facts of a model family (Hugging Face config values).
#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub(super) model_type: &'static str,
    pub(super) hidden: usize,
    pub(super) layers: usize,
    pub(super) experts: usize,
    pub(super) top_k: usize,
    pub(super) moe_inter: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) vocab: usize,
    pub(super) max_pos: usize,
    pub(super) rms_eps: f64,
    /// Qwen3-Next / Qwen3.5 hybrid layers.
    pub(super) hybrid: Option<HybridShape>,
}

/// The linear-attention and shared-expert facts of a Qwen3-Next / Qwen3.5 shape.
#[derive(Clone, Copy)]
pub(super) struct HybridShape {
    pub(super) k_heads: usize,
    pub(super) v_heads: usize,
    pub(super) k_dim: usize,
    pub(super) v_dim: usize,
    pub(super) shared_inter: usize,
    /// Every `interval`-th layer is full attention.
    pub(super) interval: usize,
    pub(super) rope_theta: f64,
}

impl HybridShape {
    pub(super) const fn qwen(k_heads: usize, v_heads: usize, shared_inter: usize, rope_theta: f64) -> Self {
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
pub(super) const fn hybrid(
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

pub(super) const SHAPES: &[(&str, Shape)] = &[
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
    pub(super) const fn qwen(
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
    pub(super) fn prefix(&self) -> &'static str {
        if self.model_type == "qwen3_5_moe" {
            "language_model."
        } else {
            ""
        }
    }

    pub(super) fn moe_prefix(&self, l: usize) -> String {
        match self.model_type {
            "mixtral" => format!("model.layers.{l}.block_sparse_moe"),
            _ => format!("{}model.layers.{l}.mlp", self.prefix()),
        }
    }

    /// Layers in one repeat of the layer pattern.
    pub(super) fn period(&self) -> usize {
        self.hybrid.map_or(1, |h| h.interval)
    }
}
