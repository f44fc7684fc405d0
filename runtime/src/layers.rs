//! Building blocks shared by the decoder-only MoE architectures: attention, dense and sparse SwiGLU
//! FFNs, the decoder layer and the embedding → layers → head stack.

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use expert_store::ExpertSource;

use crate::cpu::{Isa, MatRef};
use crate::error::{ModelError, Result};
use crate::gated_delta::GatedDeltaNet;
use crate::linear::Linear;
use crate::ops::{self, AttnShape, KvCache, LayerKv, Rope};
use crate::profile::{Part, StepProfile};
use crate::weights::{ExpertLayout, Weights};

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

/// Grouped-query self-attention with optional per-head q/k RMSNorm (before RoPE) and output gate.
pub struct Attention {
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    pub(crate) output_gate: bool,
    pub(crate) shape: AttnShape,
    pub(crate) rope: Rope,
    pub(crate) eps: f32,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj` (and `{q,k}_norm` when `qk_norm`).
    pub fn load(w: &Weights, prefix: &str, hidden: usize, spec: &AttnSpec) -> Result<Self> {
        let (h, kv, d) = (spec.shape.heads, spec.shape.kv_heads, spec.shape.head_dim);
        let norm = |n: &str| -> Result<Vec<f32>> {
            let mut v = w.vector(&format!("{prefix}.{n}.weight"), d)?;
            v.iter_mut().for_each(|x| *x += spec.norm_offset);
            Ok(v)
        };
        let qk_norm = if spec.qk_norm {
            Some((norm("q_norm")?, norm("k_norm")?))
        } else {
            None
        };
        let q_rows = if spec.output_gate { 2 * h * d } else { h * d };
        Ok(Self {
            q: w.linear(&format!("{prefix}.q_proj"), q_rows, hidden)?,
            k: w.linear(&format!("{prefix}.k_proj"), kv * d, hidden)?,
            v: w.linear(&format!("{prefix}.v_proj"), kv * d, hidden)?,
            o: w.linear(&format!("{prefix}.o_proj"), hidden, h * d)?,
            qk_norm,
            output_gate: spec.output_gate,
            shape: spec.shape,
            rope: spec.rope.clone(),
            eps: spec.eps,
        })
    }

    fn forward(&self, isa: Isa, x: &[f32], n: usize, cache: &mut LayerKv) -> Vec<f32> {
        let (heads, hd) = (self.shape.heads, self.shape.head_dim);
        let mut q = self.q.forward(isa, x, n);
        // Gated: each head's projection is [query | gate]; split per head, not down the middle.
        let gate = self.output_gate.then(|| {
            let mut gate = vec![0f32; n * heads * hd];
            let mut query = vec![0f32; n * heads * hd];
            for (i, pair) in q.chunks(2 * hd).enumerate() {
                query[i * hd..(i + 1) * hd].copy_from_slice(&pair[..hd]);
                gate[i * hd..(i + 1) * hd].copy_from_slice(&pair[hd..]);
            }
            q = query;
            gate
        });
        let mut k = self.k.forward(isa, x, n);
        let v = self.v.forward(isa, x, n);
        if let Some((qn, kn)) = &self.qk_norm {
            ops::rms_norm(&mut q, qn, self.eps);
            ops::rms_norm(&mut k, kn, self.eps);
        }
        let pos0 = cache_len(cache, &self.shape);
        for t in 0..n {
            let qw = heads * hd;
            let kw = self.shape.kv_heads * hd;
            self.rope.apply(&mut q[t * qw..(t + 1) * qw], hd, pos0 + t);
            self.rope.apply(&mut k[t * kw..(t + 1) * kw], hd, pos0 + t);
        }
        let mut a = ops::attention(isa, self.shape, &q, &k, &v, n, cache);
        if let Some(gate) = gate {
            a.iter_mut()
                .zip(&gate)
                .for_each(|(a, g)| *a *= 1.0 / (1.0 + (-g).exp()));
        }
        self.o.forward(isa, &a, n)
    }
}

/// The token mixer of a decoder layer.
pub enum Mixer {
    /// Softmax self-attention over a KV cache.
    Attention(Attention),
    /// Gated DeltaNet linear attention over a recurrent state.
    Linear(GatedDeltaNet),
}

impl Mixer {
    /// Runs the mixer, timing it into `profile`.
    fn forward(&self, isa: Isa, x: &[f32], n: usize, cache: &mut LayerKv, profile: &StepProfile) -> Vec<f32> {
        match self {
            Mixer::Attention(a) => {
                let start = Instant::now();
                let y = a.forward(isa, x, n, cache);
                profile.add(Part::FullAttention, start.elapsed());
                y
            }
            Mixer::Linear(l) => l.forward(isa, x, n, cache, profile),
        }
    }
}

fn cache_len(cache: &LayerKv, s: &AttnShape) -> usize {
    cache.positions(s.kv_heads * s.head_dim)
}

/// A dense SwiGLU MLP: `down(silu(gate x) ⊙ up x)`.
pub struct Mlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(w: &Weights, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        Ok(Self {
            gate: w.linear(&format!("{prefix}.gate_proj"), inter, hidden)?,
            up: w.linear(&format!("{prefix}.up_proj"), inter, hidden)?,
            down: w.linear(&format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    fn forward(&self, isa: Isa, x: &[f32], n: usize) -> Vec<f32> {
        let mut g = self.gate.forward(isa, x, n);
        ops::swiglu(&mut g, &self.up.forward(isa, x, n));
        self.down.forward(isa, &g, n)
    }
}

/// How router logits become expert weights; decides what happens when `--top-k` lowers k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// Softmax over all experts, then the top k (Qwen3-MoE). With `renormalize` (`norm_topk_prob`) the k
    /// weights are divided by their sum, so they always sum to 1; without it they keep their share of the
    /// full softmax, and a smaller k drops mass.
    SoftmaxTopK {
        /// Divide the chosen weights by their sum.
        renormalize: bool,
    },
    /// Top k of the raw logits, then a softmax over those k (Mixtral): the weights always sum to 1.
    TopKSoftmax,
}

impl RouterKind {
    /// The chosen experts (best first) and their weights for one token's router logits.
    ///
    /// ```
    /// use sluice_runtime::RouterKind;
    /// let logits = [2.0, 0.5, 1.0, -1.0];
    /// // Mixtral: top-2 of the logits, softmax over those two — weights sum to 1 at any k.
    /// let (ids, w) = RouterKind::TopKSoftmax.route(&logits, 2);
    /// assert_eq!(ids, [0, 2]);
    /// assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
    /// // Qwen3-MoE without norm_topk_prob: the two keep their share of the full softmax.
    /// let (_, w) = RouterKind::SoftmaxTopK { renormalize: false }.route(&logits, 2);
    /// assert!(w[0] + w[1] < 0.95);
    /// ```
    pub fn route(self, logits: &[f32], k: usize) -> (Vec<usize>, Vec<f32>) {
        match self {
            RouterKind::SoftmaxTopK { renormalize } => {
                let mut p = logits.to_vec();
                ops::softmax(&mut p);
                let idx = ops::top_k(&p, k);
                let mut w: Vec<f32> = idx.iter().map(|&i| p[i]).collect();
                if renormalize {
                    let s: f32 = w.iter().sum();
                    w.iter_mut().for_each(|v| *v /= s);
                }
                (idx, w)
            }
            RouterKind::TopKSoftmax => {
                let idx = ops::top_k(logits, k);
                let mut w: Vec<f32> = idx.iter().map(|&i| logits[i]).collect();
                ops::softmax(&mut w);
                (idx, w)
            }
        }
    }
}

/// A routed-experts SwiGLU block whose expert weights come from an [`ExpertSource`].
pub struct SparseMoe {
    /// Router `[num_experts, hidden]`.
    pub router: Linear,
    /// How router logits become weights.
    pub kind: RouterKind,
    /// Layer index (the expert store's key).
    pub layer: usize,
    /// Experts in this layer.
    pub num_experts: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Expert intermediate size.
    pub inter: usize,
    /// How a record's parts form the gate, up and down projections.
    pub layout: ExpertLayout,
    /// Where expert records come from.
    pub experts: Arc<dyn ExpertSource>,
    /// An always-on expert added to the routed sum (Qwen3-Next, Qwen3.5), resident in RAM.
    pub shared: Option<Box<SharedExpert>>,
}

/// A dense SwiGLU expert every token uses, optionally scaled by `sigmoid(gate · x)` (a scalar per token).
pub struct SharedExpert {
    /// The expert.
    pub mlp: Mlp,
    /// `[1, hidden]` gate.
    pub gate: Option<Linear>,
}

impl SharedExpert {
    fn forward(&self, isa: Isa, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = self.mlp.forward(isa, x, n);
        if let Some(gate) = &self.gate {
            let g = gate.forward(isa, x, n);
            let h = y.len() / n.max(1);
            for (row, g) in y.chunks_mut(h).zip(g) {
                let s = 1.0 / (1.0 + (-g).exp());
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        y
    }
}

impl SparseMoe {
    /// Gate, up and down views of one expert record's parts.
    fn expert_views<'a>(&self, parts: &[&'a [u8]]) -> [MatRef<'a>; 3] {
        self.layout.views(self.inter, self.hidden, parts)
    }

    /// Routes each of the `n` tokens of `x` to `k` experts and sums their weighted outputs.
    ///
    /// Each expert runs once over all tokens routed to it; each token's outputs are then combined in its
    /// own routing order, so the result is the same bit for bit whatever the batch or arrival order.
    ///
    /// All experts of the step are requested from the store at once; each is computed as its record
    /// arrives (resident ones first) and its record released right after, so a small cache still works.
    /// `prefetch` names the next layer's predicted experts, hinted to the store once this layer's reads
    /// are queued. Also returns the last token's chosen experts.
    fn forward(
        &self,
        isa: Isa,
        x: &[f32],
        n: usize,
        k: usize,
        prefetch: Option<(usize, &[usize])>,
        profile: &StepProfile,
    ) -> Result<(Vec<f32>, Vec<usize>)> {
        let (h, k) = (self.hidden, k.min(self.num_experts));
        let routed_start = std::time::Instant::now();
        let logits = self.router.forward(isa, x, n);
        let routes: Vec<(Vec<usize>, Vec<f32>)> =
            logits.chunks(self.num_experts).map(|l| self.kind.route(l, k)).collect();
        let mut per_expert_tokens: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.num_experts];
        for (t, (ids, _)) in routes.iter().enumerate() {
            for (slot, &e) in ids.iter().enumerate() {
                per_expert_tokens[e].push((t, slot));
            }
        }
        let used: Vec<usize> = (0..self.num_experts)
            .filter(|&e| !per_expert_tokens[e].is_empty())
            .collect();
        let mut fetch = self.experts.fetch_layer(self.layer, &used)?;
        if let Some((layer, experts)) = prefetch {
            self.experts.prefetch(layer, experts);
        }
        let mut slots = vec![0f32; n * k * h];
        let threads = rayon::current_num_threads();
        while let Some(batch) = fetch.next_batch(usize::MAX) {
            let batch = batch?;
            // Enough experts at hand: one per thread, each matmul on its own thread (one fork-join per
            // batch instead of per matmul); otherwise split each matmul's rows across threads.
            let per_expert = batch.len() >= threads && threads > 1;
            let run = |(pos, rec): &(usize, expert_store::ExpertRecord)| {
                (
                    *pos,
                    self.expert_forward(
                        isa,
                        x,
                        &per_expert_users(&per_expert_tokens[used[*pos]]),
                        rec,
                        !per_expert,
                    ),
                )
            };
            let outputs: Vec<(usize, Vec<f32>)> = if per_expert {
                batch.par_iter().map(run).collect()
            } else {
                batch.iter().map(run).collect()
            };
            drop(batch);
            for (pos, y) in outputs {
                for (i, &(t, slot)) in per_expert_tokens[used[pos]].iter().enumerate() {
                    slots[(t * k + slot) * h..(t * k + slot + 1) * h].copy_from_slice(&y[i * h..(i + 1) * h]);
                }
            }
        }
        let mut out = vec![0f32; n * h];
        for (t, (_, w)) in routes.iter().enumerate() {
            let o = &mut out[t * h..(t + 1) * h];
            for (slot, wt) in w.iter().enumerate() {
                for (acc, v) in o.iter_mut().zip(&slots[(t * k + slot) * h..(t * k + slot + 1) * h]) {
                    *acc += wt * v;
                }
            }
        }
        profile.add(Part::RoutedExperts, routed_start.elapsed());
        if let Some(shared) = &self.shared {
            let start = std::time::Instant::now();
            let y = shared.forward(isa, x, n);
            out.iter_mut().zip(&y).for_each(|(o, y)| *o += y);
            profile.add(Part::SharedExpert, start.elapsed());
        }
        let last = routes.last().map(|(ids, _)| ids.clone()).unwrap_or_default();
        Ok((out, last))
    }

    /// One expert over the tokens `users` routed to it: `down(swiglu(gate·x, up·x))`, `[users, hidden]`.
    fn expert_forward(
        &self,
        isa: Isa,
        x: &[f32],
        users: &[usize],
        rec: &expert_store::ExpertRecord,
        parallel: bool,
    ) -> Vec<f32> {
        let h = self.hidden;
        let parts: Vec<&[u8]> = rec.parts.iter().map(|p| p.as_slice()).collect();
        let [gate, up, down] = self.expert_views(&parts);
        let m = users.len();
        let xs: Vec<f32> = users
            .iter()
            .flat_map(|&t| x[t * h..(t + 1) * h].iter().copied())
            .collect();
        let mut g = vec![0f32; m * self.inter];
        let mut u = vec![0f32; m * self.inter];
        gate.matmul_with(isa, &xs, m, &mut g, parallel);
        up.matmul_with(isa, &xs, m, &mut u, parallel);
        ops::swiglu(&mut g, &u);
        let mut y = vec![0f32; m * h];
        down.matmul_with(isa, &g, m, &mut y, parallel);
        y
    }

    /// The experts this layer's router would pick for the (unnormalised) residual `x` of one token.
    fn predict(&self, isa: Isa, x: &[f32], norm: &[f32], eps: f32, k: usize) -> Vec<usize> {
        let mut b = x.to_vec();
        ops::rms_norm(&mut b, norm, eps);
        let logits = self.router.forward(isa, &b, 1);
        self.kind.route(&logits, k.min(self.num_experts)).0
    }
}

/// The tokens routed to one expert.
fn per_expert_users(tokens: &[(usize, usize)]) -> Vec<usize> {
    tokens.iter().map(|&(t, _)| t).collect()
}

/// The feed-forward half of a decoder layer.
pub enum Ffn {
    /// Dense SwiGLU.
    Dense(Mlp),
    /// Routed experts.
    Moe(SparseMoe),
}

/// Pre-norm decoder layer: `h = x + mixer(norm(x)); out = h + ffn(norm(h))`.
pub struct DecoderLayer {
    /// RMSNorm before the mixer.
    pub input_norm: Vec<f32>,
    /// Self-attention or linear attention.
    pub mixer: Mixer,
    /// RMSNorm before the FFN.
    pub post_norm: Vec<f32>,
    /// Dense or MoE FFN.
    pub ffn: Ffn,
}

/// What a forward pass should produce.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardOptions {
    /// Experts per token (`None`: the model's own).
    pub top_k: Option<usize>,
    /// Logits for every input position instead of only the last.
    pub all_logits: bool,
}

/// Which records the store is asked to read ahead during decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PrefetchMode {
    /// No speculative reads.
    #[default]
    None,
    /// The next layer's experts of the previous token.
    PrevToken,
    /// The next layer's router applied to the current residual stream.
    NextLayer,
}

impl std::str::FromStr for PrefetchMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "prev-token" => Ok(Self::PrevToken),
            "next-layer" => Ok(Self::NextLayer),
            _ => Err(format!("unknown prefetch mode `{s}` (none, prev-token, next-layer)")),
        }
    }
}

/// Static facts about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `model_type` from config.json.
    pub model_type: String,
    /// Vocabulary size (rows of the output head).
    pub vocab_size: usize,
    /// Context limit (`max_position_embeddings`).
    pub context_length: usize,
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// The model's own experts per token.
    pub default_top_k: usize,
    /// How routing weights are formed.
    pub router: RouterKind,
    /// Decoder layers.
    pub num_layers: usize,
    /// Layers with routed experts.
    pub moe_layers: usize,
    /// Bytes of the largest expert record (what one miss reads).
    pub expert_record_bytes: u64,
}

/// Embedding → decoder layers → final norm → output head.
pub struct DecoderModel {
    /// Model facts.
    pub info: ModelInfo,
    /// Token embedding `[vocab, hidden]`.
    pub embed: Linear,
    /// Decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// Final RMSNorm.
    pub norm: Vec<f32>,
    /// Output head `[vocab, hidden]` (the embedding itself when tied).
    pub lm_head: Linear,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Hidden size.
    pub hidden: usize,
    /// Speculative expert reads during decode.
    pub prefetch: PrefetchMode,
    /// Where each MoE layer's stacked expert tensors are (what `sluice convert` packs).
    pub expert_stacks: Vec<expert_store::StackedExperts>,
    /// The memory budgets this model was loaded with.
    pub memory_plan: crate::memory_plan::MemoryPlan,
    /// Where forward time goes, accumulated over every call.
    pub profile: StepProfile,
    /// The mlx backend's copy of the weights, when it computes instead of the cpu backend.
    #[cfg(feature = "mlx")]
    pub(crate) mlx: Option<Box<crate::mlx::MlxModel>>,
}

impl DecoderModel {
    /// A fresh KV cache.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// The expert store's I/O counters, when experts are streamed.
    pub fn expert_counters(&self) -> Option<std::sync::Arc<expert_store::StoreCounters>> {
        self.layers.iter().find_map(|l| match &l.ffn {
            Ffn::Moe(moe) => moe.experts.counters(),
            Ffn::Dense(_) => None,
        })
    }

    /// The routed experts' source (shared by every MoE layer), if the model has any.
    fn expert_source(&self) -> Option<&std::sync::Arc<dyn expert_store::ExpertSource>> {
        self.layers.iter().find_map(|l| match &l.ffn {
            Ffn::Moe(moe) => Some(&moe.experts),
            Ffn::Dense(_) => None,
        })
    }

    /// Slots of the expert cache when streaming (`None` when resident).
    pub fn expert_slots(&self) -> Option<usize> {
        self.expert_source().and_then(|s| s.slots())
    }

    /// Bytes of one expert slot (the largest record, page-aligned) when experts go through the engine.
    pub fn expert_slot_len(&self) -> Option<usize> {
        self.expert_source().and_then(|s| s.slot_len())
    }

    /// Empties the expert slot cache and the OS page cache of the expert files, so the next reads come from
    /// the disk (for cold benchmarks).
    pub fn drop_expert_caches(&self) -> Result<()> {
        match self.expert_source() {
            Some(s) => Ok(s.drop_caches()?),
            None => Ok(()),
        }
    }

    /// During decode (one token), the experts layer `i + 1` will probably need, per the prefetch mode.
    fn predict_next(
        &self,
        isa: Isa,
        i: usize,
        x: &[f32],
        n: usize,
        k: usize,
        cache: &KvCache,
    ) -> Option<(usize, Vec<usize>)> {
        if n != 1 || self.prefetch == PrefetchMode::None {
            return None;
        }
        let next = self.layers.get(i + 1)?;
        let Ffn::Moe(moe) = &next.ffn else {
            return None;
        };
        let experts = match self.prefetch {
            PrefetchMode::PrevToken => cache.last_experts.get(i + 1)?.clone(),
            PrefetchMode::NextLayer => moe.predict(isa, x, &next.post_norm, self.eps, k),
            PrefetchMode::None => return None,
        };
        (!experts.is_empty()).then_some((moe.layer, experts))
    }

    /// Rejects a forward call the model cannot run (no tokens, past the context, bad top-k, token ids outside
    /// the vocabulary); returns the experts per token to use.
    pub(crate) fn check_forward(&self, tokens: &[u32], cache: &KvCache, opts: &ForwardOptions) -> Result<usize> {
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::InvalidArgument("forward called with no tokens".into()));
        }
        if cache.len + n > self.info.context_length {
            return Err(ModelError::Limit(format!(
                "{} tokens exceed the context limit of {} (max_position_embeddings)",
                cache.len + n,
                self.info.context_length
            )));
        }
        let k = opts.top_k.unwrap_or(self.info.default_top_k);
        if self.info.num_experts > 0 && (k == 0 || k > self.info.num_experts) {
            return Err(ModelError::InvalidArgument(format!(
                "top-k {k} must be between 1 and the model's {} experts",
                self.info.num_experts
            )));
        }
        for &id in tokens {
            if id as usize >= self.info.vocab_size {
                return Err(ModelError::Limit(format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.info.vocab_size
                )));
            }
        }
        Ok(k)
    }

    /// Runs `tokens` after the cached positions; returns logits `[m, vocab]`, m = tokens or 1.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, opts: &ForwardOptions) -> Result<Vec<f32>> {
        #[cfg(feature = "mlx")]
        if let Some(m) = &self.mlx {
            return m.forward(self, tokens, cache, opts);
        }
        let (n, h, isa) = (tokens.len(), self.hidden, Isa::detect());
        let k = self.check_forward(tokens, cache, opts)?;
        let embed_start = Instant::now();
        let mut x = vec![0f32; n * h];
        for (t, &id) in tokens.iter().enumerate() {
            self.embed.mat().row(isa, id as usize, &mut x[t * h..(t + 1) * h]);
        }
        self.profile.add(Part::Head, embed_start.elapsed());
        for (i, layer) in self.layers.iter().enumerate() {
            let kv = &mut cache.layers[i];
            let mut a = x.clone();
            ops::rms_norm(&mut a, &layer.input_norm, self.eps);
            let a = layer.mixer.forward(isa, &a, n, kv, &self.profile);
            x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
            let mut b = x.clone();
            ops::rms_norm(&mut b, &layer.post_norm, self.eps);
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => {
                    let start = Instant::now();
                    let f = mlp.forward(isa, &b, n);
                    self.profile.add(Part::DenseMlp, start.elapsed());
                    f
                }
                Ffn::Moe(moe) => {
                    let predicted = self.predict_next(isa, i, &x, n, k, cache);
                    let hint = predicted.as_ref().map(|(l, e)| (*l, e.as_slice()));
                    let (f, last) = moe.forward(isa, &b, n, k, hint, &self.profile)?;
                    if let Some(slot) = cache.last_experts.get_mut(i) {
                        *slot = last;
                    }
                    f
                }
            };
            x.iter_mut().zip(&f).for_each(|(x, f)| *x += f);
        }
        cache.len += n;
        let head_start = Instant::now();
        let rows = if opts.all_logits {
            &mut x[..]
        } else {
            &mut x[(n - 1) * h..]
        };
        ops::rms_norm(rows, &self.norm, self.eps);
        let m = rows.len() / h;
        let logits = self.lm_head.forward(isa, rows, m);
        self.profile.add(Part::Head, head_start.elapsed());
        Ok(logits)
    }
}

#[cfg(test)]
impl SparseMoe {
    /// The naive oracle: each token alone, each chosen expert dequantized by the scalar reference matmul,
    /// weighted outputs summed in routing order.
    fn forward_reference(&self, x: &[f32], n: usize, k: usize) -> Vec<f32> {
        use crate::cpu::reference_matmul;
        let h = self.hidden;
        let mut out = vec![0f32; n * h];
        for t in 0..n {
            let xt = &x[t * h..(t + 1) * h];
            let mut logits = vec![0f32; self.num_experts];
            reference_matmul(&self.router.mat(), xt, 1, &mut logits);
            let (ids, w) = self.kind.route(&logits, k);
            for (e, wt) in ids.iter().zip(w) {
                let rec = self.experts.read_expert(self.layer, *e).unwrap();
                let parts: Vec<&[u8]> = rec.parts.iter().map(|p| p.as_slice()).collect();
                let [gate, up, down] = self.layout.views(self.inter, h, &parts);
                let mut g = vec![0f32; self.inter];
                let mut u = vec![0f32; self.inter];
                reference_matmul(&gate, xt, 1, &mut g);
                reference_matmul(&up, xt, 1, &mut u);
                ops::swiglu(&mut g, &u);
                let mut y = vec![0f32; h];
                reference_matmul(&down, &g, 1, &mut y);
                for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(&y) {
                    *o += wt * v;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use expert_store::{InMemoryExpertSource, OwnedBytes};
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::cpu::testutil::{encode, pack};
    use crate::cpu::FloatType;
    use crate::linear::WeightFormat;

    /// A random affine-quantized `[rows, cols]` matrix as (weight, scales, biases) bytes.
    fn random_quant(rng: &mut impl Rng, bits: u32, group: usize, rows: usize, cols: usize) -> Vec<Vec<u8>> {
        let codes: Vec<u32> = (0..rows * cols).map(|_| rng.gen_range(0..1u32 << bits)).collect();
        let g = rows * cols / group;
        let s: Vec<f32> = (0..g).map(|_| rng.gen_range(-0.05f32..0.05)).collect();
        let b: Vec<f32> = (0..g).map(|_| rng.gen_range(-0.3f32..0.3)).collect();
        vec![
            pack(bits, &codes),
            encode(FloatType::BF16, &s),
            encode(FloatType::BF16, &b),
        ]
    }

    fn moe(kind: RouterKind, seed: u64) -> SparseMoe {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (h, inter, experts, bits, group) = (64, 96, 6, 4, 32);
        let mut src = InMemoryExpertSource::new();
        for e in 0..experts {
            let mut parts = random_quant(&mut rng, bits, group, inter, h);
            parts.extend(random_quant(&mut rng, bits, group, inter, h));
            parts.extend(random_quant(&mut rng, bits, group, h, inter));
            src.insert(3, e, parts);
        }
        let r = random_quant(&mut rng, 8, 64, experts, h);
        let router = Linear {
            format: WeightFormat::Affine {
                bits: 8,
                group: 64,
                scale_type: FloatType::BF16,
            },
            rows: experts,
            cols: h,
            parts: r.into_iter().map(OwnedBytes::from_vec).collect(),
            bias: None,
        };
        let f = WeightFormat::Affine {
            bits,
            group,
            scale_type: FloatType::BF16,
        };
        SparseMoe {
            router,
            kind,
            layer: 3,
            num_experts: experts,
            hidden: h,
            inter,
            layout: ExpertLayout {
                formats: [f; 3],
                fused: false,
            },
            experts: Arc::new(src),
            shared: None,
        }
    }

    #[test]
    fn grouped_moe_matches_the_naive_reference_at_every_k() {
        let kinds = [
            RouterKind::SoftmaxTopK { renormalize: true },
            RouterKind::SoftmaxTopK { renormalize: false },
            RouterKind::TopKSoftmax,
        ];
        for (i, kind) in kinds.into_iter().enumerate() {
            let m = moe(kind, i as u64);
            let n = 7;
            let mut rng = rand::rngs::StdRng::seed_from_u64(99);
            let x: Vec<f32> = (0..n * 64).map(|_| rng.gen_range(-1f32..1.0)).collect();
            for k in 1..=6 {
                let fast = m
                    .forward(Isa::detect(), &x, n, k, None, &StepProfile::default())
                    .unwrap()
                    .0;
                let slow = m.forward_reference(&x, n, k);
                let scale = slow.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in fast.iter().zip(&slow) {
                    assert!((a - b).abs() <= 1e-4 * scale, "{kind:?} k={k}: {a} vs {b}");
                }
                // Batched equals token-by-token bit for bit.
                for t in 0..n {
                    let one = m
                        .forward(
                            Isa::detect(),
                            &x[t * 64..(t + 1) * 64],
                            1,
                            k,
                            None,
                            &StepProfile::default(),
                        )
                        .unwrap()
                        .0;
                    assert_eq!(one, fast[t * 64..(t + 1) * 64]);
                }
            }
        }
    }

    #[test]
    fn routing_weights_follow_the_router_kind() {
        let logits = [2.0, 1.0, 0.5, -1.0];
        let (ids, w) = RouterKind::SoftmaxTopK { renormalize: true }.route(&logits, 2);
        assert_eq!(ids, vec![0, 1]);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let (_, w) = RouterKind::SoftmaxTopK { renormalize: false }.route(&logits, 2);
        assert!(
            w.iter().sum::<f32>() < 0.95,
            "un-renormalised weights keep their softmax share"
        );
        let (_, w) = RouterKind::TopKSoftmax.route(&logits, 2);
        assert!((w[0] - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn a_failing_expert_read_is_an_error_not_a_panic() {
        let mut m = moe(RouterKind::TopKSoftmax, 5);
        m.experts = Arc::new(InMemoryExpertSource::new());
        let e = m
            .forward(Isa::detect(), &[0.1; 64], 1, 2, None, &StepProfile::default())
            .unwrap_err();
        assert!(e.to_string().contains("no expert record for layer 3"), "{e}");
    }
}
