//! Grouped-query self-attention with optional per-head q/k RMSNorm (before RoPE) and output gate
//! (Qwen3-Next / Qwen3.5), over each sequence's KV cache.

use crate::backend::{Backend, SeqSpan};
use crate::error::Result;
use crate::ops::{AttnShape, Rope};
use crate::weights::Weights;

/// How an attention block is built (from config.json).
#[derive(Debug, Clone)]
pub struct AttnSpec {
    /// Head counts and width.
    pub shape: AttnShape,
    /// Rotary embedding (possibly partial: it rotates its own `dims` of each head).
    pub rope: Rope,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Per-head q/k RMSNorm before RoPE.
    pub qk_norm: bool,
    /// Qwen3-Next gating: `q_proj` yields `[heads, 2·head_dim]` (query, gate) and the output is multiplied
    /// by `sigmoid(gate)` before `o_proj`.
    pub output_gate: bool,
    /// Added to stored norm weights (1 for checkpoints that store zero-centred `(1 + w)` norms).
    pub norm_offset: f32,
}

/// One attention block's weights.
pub struct Attention<B: Backend> {
    q: B::Matrix,
    k: B::Matrix,
    v: B::Matrix,
    o: B::Matrix,
    qk_norm: Option<(B::Vector, B::Vector)>,
    /// With an output gate: the columns of `q_proj`'s output holding the queries and the gates.
    gate_columns: Option<(Vec<usize>, Vec<usize>)>,
    /// Head counts and width.
    pub shape: AttnShape,
    /// The rotary embedding.
    pub rope: Rope,
    eps: f32,
}

impl<B: Backend> Attention<B> {
    /// Loads `{prefix}.{q,k,v,o}_proj` (and `{q,k}_norm` when `qk_norm`).
    pub fn load(be: &B, w: &Weights, prefix: &str, hidden: usize, spec: &AttnSpec) -> Result<Self> {
        let (h, kv, d) = (spec.shape.heads, spec.shape.kv_heads, spec.shape.head_dim);
        let norm = |n: &str| -> Result<B::Vector> {
            let mut v = w.vector(&format!("{prefix}.{n}.weight"), d)?;
            v.iter_mut().for_each(|x| *x += spec.norm_offset);
            be.vector(&v)
        };
        let qk_norm = if spec.qk_norm {
            Some((norm("q_norm")?, norm("k_norm")?))
        } else {
            None
        };
        let m = |name: &str, rows: usize, cols: usize| be.matrix(&w.linear(&format!("{prefix}.{name}"), rows, cols)?);
        // Gated: each head's projection is [query | gate]; split per head, not down the middle.
        let gate_columns = spec.output_gate.then(|| {
            let part = |off: usize| (0..h).flat_map(|i| i * 2 * d + off..i * 2 * d + off + d).collect();
            (part(0), part(d))
        });
        let q_rows = if spec.output_gate { 2 * h * d } else { h * d };
        Ok(Self {
            q: m("q_proj", q_rows, hidden)?,
            k: m("k_proj", kv * d, hidden)?,
            v: m("v_proj", kv * d, hidden)?,
            o: m("o_proj", hidden, h * d)?,
            qk_norm,
            gate_columns,
            shape: spec.shape,
            rope: spec.rope.clone(),
            eps: spec.eps,
        })
    }

    /// `[n, hidden]` normalized input → `[n, hidden]`; appends each sequence's keys and values to its cache.
    pub fn forward(&self, be: &B, x: &B::Tensor, spans: &[SeqSpan], kv: &mut [&mut B::Kv]) -> Result<B::Tensor> {
        let [mut q, mut k, v] = be.matmul_each([&self.q, &self.k, &self.v], x)?;
        let gate = match &self.gate_columns {
            Some((query, gate)) => {
                let g = be.take_columns(&q, gate)?;
                q = be.take_columns(&q, query)?;
                Some(g)
            }
            None => None,
        };
        if let Some((qn, kn)) = &self.qk_norm {
            q = be.rms_norm(&q, qn, self.eps)?;
            k = be.rms_norm(&k, kn, self.eps)?;
        }
        let d = self.shape.head_dim;
        let q = be.rope(&q, &self.rope, d, spans)?;
        let k = be.rope(&k, &self.rope, d, spans)?;
        let mut a = be.attention(&q, &k, &v, self.shape, spans, kv)?;
        if let Some(g) = gate {
            a = be.mul_sigmoid(&a, &g)?;
        }
        be.matmul(&self.o, &a)
    }
}
