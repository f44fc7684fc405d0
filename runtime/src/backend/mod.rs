//! What differs between compute backends, behind one trait: how weights live (f32 slices and sluice's kernels,
//! MLX arrays, or f64 copies), the per-sequence state (KV caches, Gated DeltaNet state), and the ops the model
//! is written against. The model (`crate::model`) is written once over [`Backend`]; a backend is one module
//! here: `cpu` (sluice's SIMD kernels), `reference` (naive f64, the test oracle) and `mlx` (feature `mlx`).
//!
//! Activations are row-major `[rows, cols]` f32 tensors whose rows are the tokens of a batch of sequences,
//! each at its own position: [`SeqSpan`] says which rows belong to which sequence.

pub mod cpu;
#[cfg(feature = "mlx")]
pub mod mlx;
pub mod reference;
pub(crate) mod tiled_experts;

use std::ops::Range;

use expert_store::ExpertRecord;

use crate::error::{ModelError, Result};
use crate::gated_delta::{DeltaParams, DeltaShape};
use crate::linear::Linear;
use crate::ops::{AttnShape, Rope};
use crate::weights::ExpertLayout;

/// At most this many bytes of f32 attention scores per query block of a prompt's chunk on the mlx backend. MLX
/// computes attention through a fused kernel only for some head sizes (and only on Metal); otherwise it builds
/// the whole score matrix `[heads, queries, keys]`, which for a 2048-token chunk at 32k positions of Qwen3-Next
/// (16 heads of 256) is 4 GiB. Blocks of queries keep it to this; the memory plan counts
/// [`MLX_SCORE_COPIES`] of it.
pub const MLX_SCORE_BLOCK_BYTES: u64 = 64 << 20;

/// Score matrices of a block alive at once in MLX's unfused attention (the scores, their masked copy and the
/// softmax), as the memory plan counts them.
pub const MLX_SCORE_COPIES: u64 = 3;

/// The rows of one sequence in a batch, and the position of its first row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSpan {
    /// Rows of the batch's activations.
    pub rows: Range<usize>,
    /// Position of the first row in its sequence (tokens already cached).
    pub pos0: usize,
}

impl SeqSpan {
    /// Tokens in this span.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the span has no tokens.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Whether a batch of these spans is a decode step: one token for each sequence.
    pub fn all_decode(spans: &[SeqSpan]) -> bool {
        spans.iter().all(|s| s.len() == 1)
    }
}

/// One attention layer's keys and values for one sequence. Truncation is how a rollback (a failed forward,
/// rejected draft tokens) takes it back, so a layer that keeps only a window of positions (sliding-window
/// attention) must keep enough beyond its window to honour it.
pub trait KvState: Clone + Send {
    /// Positions cached.
    fn len(&self) -> usize;
    /// Whether nothing is cached.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forgets every position from `len` on.
    fn truncate(&mut self, len: usize);
}

/// One Gated DeltaNet layer's conv history and recurrent state for one sequence. A forward writes the next
/// state beside the current one; it becomes current only when the whole forward succeeded.
pub trait RecurrentState: Clone + Send {
    /// Makes the state a forward wrote the current one.
    fn commit(&mut self);
    /// Drops the state a failed forward wrote; the current one is untouched.
    fn discard(&mut self);
    /// Bytes a snapshot of the current state holds.
    fn bytes(&self) -> usize;
}

/// One routed expert's work: its three matrices and the rows routed to it.
pub struct ExpertJob<B: Backend> {
    /// Gate, up and down projections.
    pub mats: [B::Matrix; 3],
    /// `[users, hidden]` inputs.
    pub x: B::Tensor,
}

/// Where one token's `slot`-th routed expert output is: `expert` (position in the layer's fetch list) and `row`
/// (which of that expert's output rows), with its routing weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// Index into the experts' outputs.
    pub expert: usize,
    /// Row of that output.
    pub row: usize,
    /// Routing weight.
    pub weight: f32,
}

/// A compute backend: weights, per-sequence state and the ops the model runs.
pub trait Backend: Sized + Send + 'static {
    /// `[rows, cols]` f32 activations.
    type Tensor: Clone;
    /// A weight matrix `[out, in]`, resident or over an expert record's bytes.
    type Matrix: Send;
    /// An f32 vector (norm weights).
    type Vector: Send;
    /// Gated DeltaNet parameters other than its projections.
    type DeltaWeights: Send;
    /// One attention layer's KV cache for one sequence.
    type Kv: KvState;
    /// One Gated DeltaNet layer's state for one sequence.
    type Recurrent: RecurrentState;

    /// Its name in messages (`cpu`, `mlx`, `reference`).
    fn name(&self) -> &'static str;

    // --- weights ---
    /// A resident matrix.
    fn matrix(&self, l: &Linear) -> Result<Self::Matrix>;
    /// A resident vector.
    fn vector(&self, v: &[f32]) -> Result<Self::Vector>;
    /// Gated DeltaNet parameters.
    fn delta_weights(&self, p: &DeltaParams) -> Result<Self::DeltaWeights>;
    /// The gate, up and down matrices of one expert record (`[inter, hidden]`, `[inter, hidden]`,
    /// `[hidden, inter]`); they may keep the record's slot pinned while they live.
    fn expert(
        &self,
        layout: &ExpertLayout,
        inter: usize,
        hidden: usize,
        rec: &ExpertRecord,
    ) -> Result<[Self::Matrix; 3]>;

    // --- state ---
    /// An empty KV cache.
    fn new_kv(&self, shape: AttnShape) -> Self::Kv;
    /// A zero recurrent state.
    fn new_recurrent(&self, shape: DeltaShape) -> Self::Recurrent;

    // --- data ---
    /// Host rows (`data.len() = rows · cols`) as a tensor.
    fn upload(&self, data: Vec<f32>, cols: usize) -> Result<Self::Tensor>;
    /// The tensor's values on the host, row-major (waits for the device).
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;
    /// Rows `rows` of `x`, in that order.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// Columns `cols` of `x`, in that order (layout shuffles).
    fn take_columns(&self, x: &Self::Tensor, cols: &[usize]) -> Result<Self::Tensor>;

    // --- math ---
    /// `x · Wᵀ` (+ bias): `[n, in]` → `[n, out]`.
    fn matmul(&self, w: &Self::Matrix, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// [`Backend::matmul`] of each matrix in `ws` by the same `x`, the same results; a backend may share the
    /// input's preparation and one parallel pass among them.
    fn matmuls(&self, ws: &[&Self::Matrix], x: &Self::Tensor) -> Result<Vec<Self::Tensor>> {
        ws.iter().map(|w| self.matmul(w, x)).collect()
    }
    /// [`Backend::matmuls`] of a fixed number of matrices.
    fn matmul_each<const N: usize>(&self, ws: [&Self::Matrix; N], x: &Self::Tensor) -> Result<[Self::Tensor; N]>
    where
        Self: Sized,
    {
        self.matmuls(&ws, x)?
            .try_into()
            .map_err(|_| ModelError::Backend("matmuls returned a different number of outputs".into()))
    }
    /// RMSNorm of each `w.len()`-wide chunk of every row (a row, or each head of a row).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32) -> Result<Self::Tensor>;
    /// `a + b`.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// `silu(gate) ⊙ up`.
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x ⊙ sigmoid(g)`: `g` has `x`'s shape, or one column (a scalar per row).
    fn mul_sigmoid(&self, x: &Self::Tensor, g: &Self::Tensor) -> Result<Self::Tensor>;
    /// Rotary embedding of each `head_dim`-wide head of each row at its position (`spans`).
    fn rope(&self, x: &Self::Tensor, rope: &Rope, head_dim: usize, spans: &[SeqSpan]) -> Result<Self::Tensor>;
    /// Causal grouped-query attention: appends each span's `k`, `v` rows to its sequence's cache (`kv[i]` for
    /// `spans[i]`) and attends over everything cached. `q` is `[n, heads·d]`, `k`/`v` `[n, kv_heads·d]`.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        shape: AttnShape,
        spans: &[SeqSpan],
        kv: &mut [&mut Self::Kv],
    ) -> Result<Self::Tensor>;
    /// The Gated DeltaNet core after the input projections: causal conv over each sequence's history, SiLU,
    /// q/k L2 norm, decay and β, the delta rule token by token, and the gated RMSNorm; `[n, value_dim]`.
    /// Writes each sequence's next state beside its current one (see [`RecurrentState`]).
    #[allow(clippy::too_many_arguments)]
    fn gated_delta(
        &self,
        w: &Self::DeltaWeights,
        qkv: &Self::Tensor,
        z: &Self::Tensor,
        b: &Self::Tensor,
        a: &Self::Tensor,
        spans: &[SeqSpan],
        state: &mut [&mut Self::Recurrent],
    ) -> Result<Self::Tensor>;
    /// Runs one forward pass `f` (the cpu backend keeps its compute threads awake for it).
    fn step<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }
    /// A layer's output is complete (the mlx backend starts the device on it while the host moves on).
    fn layer_done(&self, _x: &Self::Tensor) -> Result<()> {
        Ok(())
    }
    /// Each expert's SwiGLU over its rows: `down(silu(gate·x) ⊙ up·x)`, in job order.
    fn experts(&self, jobs: Vec<ExpertJob<Self>>) -> Result<Vec<Self::Tensor>> {
        jobs.into_iter()
            .map(|j| {
                let [gate, up, down] = &j.mats;
                let [g, u] = self.matmul_each([gate, up], &j.x)?;
                let h = self.swiglu(&g, &u)?;
                self.matmul(down, &h)
            })
            .collect()
    }
    /// `[tokens, hidden]`: token `t`'s row is `Σ_slot weight · outputs[expert][row]` over `picks[t]`, summed in
    /// slot order (so the result does not depend on the order experts were computed in).
    fn combine(&self, hidden: usize, outputs: &[Self::Tensor], picks: &[Vec<Pick>]) -> Result<Self::Tensor>;
}
