//! The decoder, written once over [`Backend`]: embedding → layers (attention or Gated DeltaNet, then a dense or
//! routed-experts FFN) → final norm → output head, for a batch of sequences at different positions, each with
//! its own experts per token. [`DecoderModel`] is the backend-independent handle everything else uses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use expert_store::ExpertSource;

use crate::attention::Attention;
use crate::backend::{Backend, SeqSpan};
use crate::cpu::Isa;
use crate::error::{ModelError, Result};
use crate::gated_delta::GatedDeltaNet;
use crate::linear::Linear;
use crate::memory_plan::MemoryPlan;
use crate::moe::{Mlp, RouterKind, SparseMoe};
pub use crate::prefetch::PrefetchMode;
use crate::prefetch::{merge_ranked, GuessBook, RankedGuess};
use crate::profile::{Part, StepProfile};
use crate::sequence::{KvCache, LayerState, Sequence};

/// What a forward pass should produce.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardOptions {
    /// Experts per token (`None`: the model's own).
    pub top_k: Option<usize>,
    /// Logits for every input position instead of only the last.
    pub all_logits: bool,
}

/// One sequence's part of a batched forward.
pub struct SeqRequest<'a> {
    /// Its new tokens.
    pub tokens: &'a [u32],
    /// Its state (advanced by the forward).
    pub cache: &'a mut KvCache,
    /// Its experts per token, and which logits it wants.
    pub opts: ForwardOptions,
}

/// Static facts about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `model_type` from config.json.
    pub model_type: String,
    /// Vocabulary size (rows of the output head).
    pub vocab_size: usize,
    /// Context limit (`max_position_embeddings`, or what rope scaling extends it to).
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
    /// Bytes of the largest expert record (the most one miss reads; what a slot holds).
    pub expert_record_bytes: u64,
    /// Bytes of each layer's expert records, by layer index (0 for a layer without experts): what a miss in
    /// that layer reads (layers of a mixed-precision model differ).
    pub expert_record_bytes_by_layer: Vec<u64>,
    /// Expert records reach the kernels in the int8 kernels' tiles: rewritten as they load (cpu backend, 4-bit
    /// records), or stored so (a store converted with `--layout tiled`).
    pub tiled_experts: bool,
}

/// The token mixer of a decoder layer.
pub(crate) enum Mixer<B: Backend> {
    /// Softmax self-attention over a KV cache.
    Attention(Attention<B>),
    /// Gated DeltaNet linear attention over a recurrent state.
    Linear(GatedDeltaNet<B>),
}

/// The feed-forward half of a decoder layer.
pub(crate) enum Ffn<B: Backend> {
    /// Dense SwiGLU.
    Dense(Mlp<B>),
    /// Routed experts.
    Moe(SparseMoe<B>),
}

/// Pre-norm decoder layer: `h = x + mixer(norm(x)); out = h + ffn(norm(h))`.
pub(crate) struct DecoderLayer<B: Backend> {
    pub input_norm: B::Vector,
    pub mixer: Mixer<B>,
    pub post_norm: B::Vector,
    pub ffn: Ffn<B>,
}

/// The decoder's weights on backend `B`.
pub(crate) struct Model<B: Backend> {
    pub be: B,
    pub id: u64,
    pub info: ModelInfo,
    /// Token embedding `[vocab, hidden]`, on the host (a lookup is a row copy).
    pub embed: Linear,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: B::Vector,
    /// Output head `[vocab, hidden]` (the embedding itself when tied).
    pub lm_head: B::Matrix,
    pub eps: f32,
    pub hidden: usize,
    /// How layers ahead are guessed (resolved: never `Auto`).
    pub prefetch: PrefetchMode,
    /// How many MoE layers ahead each layer's guess reaches.
    pub prefetch_ahead: usize,
    /// Guesses are read only while their precision is at least this (`None`: always).
    pub prefetch_min_precision: Option<f64>,
    /// The guesses made and how right they were.
    pub guesses: std::sync::Mutex<GuessBook>,
    /// Whether every step keeps the compute threads awake ([`Backend::step`]), prompts too: only when no step
    /// reads experts from disk, where a prompt's I/O threads tile records on the cores a polling worker would
    /// take. Decode steps always do (see `forward_batch`).
    pub awake_steps: bool,
    pub profile: StepProfile,
}

/// Per MoE layer: the layer and, per sequence, its last token's experts.
type LastExperts = Vec<(usize, Vec<Vec<usize>>)>;

/// Predicted experts of the layers ahead, nearest first: (store layer, experts likeliest first).
pub(crate) type Prediction = Vec<(usize, Vec<usize>)>;

/// Guesses the next MoE layer's experts again from the residual stream plus a layer's output so far.
pub(crate) type Refine<'a, T> = &'a mut dyn FnMut(&T) -> Result<Prediction>;

/// A fresh id for each model, so a cache is only ever run by the model that made it.
pub(crate) fn next_model_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What [`DecoderModel`] needs of a model, whatever its backend.
pub(crate) trait Runner: Send {
    fn forward(&self, reqs: &mut [SeqRequest<'_>]) -> Result<Vec<Vec<f32>>>;
    fn new_cache(&self) -> KvCache;
    fn expert_source(&self) -> Option<&Arc<dyn ExpertSource>>;
    fn set_expert_source(&mut self, s: Arc<dyn ExpertSource>);
    fn awake_steps(&self) -> bool;
    fn set_awake_steps(&mut self, awake: bool);
    fn profile(&self) -> &StepProfile;
    fn backend_name(&self) -> &'static str;
    fn prefetch(&self) -> (PrefetchMode, usize);
    fn guess_precision(&self) -> Option<f64>;
    fn guess_precision_by_rank(&self) -> Vec<Vec<Option<f64>>>;
}

impl<B: Backend> Model<B> {
    /// Rejects a forward call the model cannot run (no tokens, bad top-k, token ids outside the vocabulary);
    /// returns the experts per token to use. (The context is checked by [`DecoderModel::forward_batch`],
    /// against the memory plan's limit, which is at most the model's own.)
    fn check(&self, tokens: &[u32], opts: &ForwardOptions) -> Result<usize> {
        let info = &self.info;
        if tokens.is_empty() {
            return Err(ModelError::InvalidArgument("forward called with no tokens".into()));
        }
        let k = opts.top_k.unwrap_or(info.default_top_k);
        if info.num_experts > 0 {
            check_top_k_range(k, info.num_experts)?;
        }
        check_vocabulary(tokens, info.vocab_size)?;
        Ok(k)
    }

    /// The experts the next `prefetch_ahead` MoE layers after layer `i` will probably need, nearest layer first
    /// and likeliest first within a layer, from `x` (the residual stream after layer `i`'s mixer): per layer,
    /// the union over the batch's rows. A decode step always guesses, to score every distance and rank, and
    /// returns the guesses whose distance and rank have proved right; a prompt's chunk guesses only while the
    /// nearest guesses as a whole do.
    fn predict_ahead(
        &self,
        i: usize,
        x: &B::Tensor,
        ks: &[usize],
        seqs: &[&mut Sequence<B>],
        decode: bool,
    ) -> Result<Prediction> {
        if matches!(self.prefetch, PrefetchMode::None | PrefetchMode::Auto) {
            return Ok(Vec::new());
        }
        let min = self.prefetch_min_precision;
        if !decode && !self.guess_book().open(min) {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        // `prefetch_ahead` MoE layers, dense ones between not counted: the distance is in MoE layers.
        for (distance, (j, layer, moe)) in (1..).zip(self.moe_layers_after(i).take(self.prefetch_ahead)) {
            let rows = match self.prefetch {
                PrefetchMode::None | PrefetchMode::Auto => Vec::new(),
                PrefetchMode::PrevToken => seqs.iter().map(|s| s.last_experts[j].clone()).collect(),
                PrefetchMode::NextLayer => {
                    moe.predict(&self.be, &self.be.rms_norm(x, &layer.post_norm, self.eps)?, ks)?
                }
            };
            let guess = merge_ranked(&rows, moe.num_experts);
            let experts: Vec<usize> = if decode {
                self.record_and_gate(j, distance, &guess)
            } else {
                guess.iter().map(|&(e, _)| e).collect()
            };
            if !experts.is_empty() {
                out.push((moe.layer, experts));
            }
        }
        Ok(out)
    }

    /// The MoE layers after decoder layer `i`, nearest first: (decoder layer, layer, its MoE block).
    fn moe_layers_after(&self, i: usize) -> impl Iterator<Item = (usize, &DecoderLayer<B>, &SparseMoe<B>)> {
        (self.layers.iter().enumerate().skip(i + 1)).filter_map(|(j, l)| match &l.ffn {
            Ffn::Moe(m) => Some((j, l, m)),
            Ffn::Dense(_) => None,
        })
    }

    /// The next MoE layer's experts, guessed again in a decode step from `x`, the residual stream with layer
    /// `i`'s output so far: right more often than the guess from before it (this layer's output is what moves
    /// the next router's choice most). Scored and gated as distance 0; none when no rank passes the gate, as
    /// a guess of nothing would drop the queued guesses that do.
    fn predict_refined(&self, i: usize, x: &B::Tensor, ks: &[usize]) -> Result<Prediction> {
        let next = self.moe_layers_after(i).next().filter(|_| self.prefetch_ahead > 0);
        let Some((j, layer, moe)) = next else {
            return Ok(Vec::new());
        };
        let rows = moe.predict(&self.be, &self.be.rms_norm(x, &layer.post_norm, self.eps)?, ks)?;
        let guess = merge_ranked(&rows, moe.num_experts);
        let experts = self.record_and_gate(j, 0, &guess);
        Ok(if experts.is_empty() {
            Vec::new()
        } else {
            vec![(moe.layer, experts)]
        })
    }

    /// Records a decode step's `guess` for decoder layer `j`, made `distance` layers ahead (0: refined), for
    /// scoring once `j` routes, and returns its experts whose distance and rank have proved right.
    fn record_and_gate(&self, j: usize, distance: usize, guess: &[RankedGuess]) -> Vec<usize> {
        let mut book = self.guess_book();
        book.record(j, distance, guess);
        let min = self.prefetch_min_precision;
        (guess.iter().filter(|&&(_, rank)| book.wanted(distance, rank, min)))
            .map(|&(e, _)| e)
            .collect()
    }

    fn guess_book(&self) -> std::sync::MutexGuard<'_, GuessBook> {
        self.guesses.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every layer over the batch; returns the residual stream and, per MoE layer, each sequence's last-token
    /// experts.
    fn layers_forward(
        &self,
        mut x: B::Tensor,
        spans: &[SeqSpan],
        ks: &[usize],
        seqs: &mut [&mut Sequence<B>],
    ) -> Result<(B::Tensor, LastExperts)> {
        let be = &self.be;
        let mut last_experts = Vec::new();
        let decode = SeqSpan::all_decode(spans);
        for (i, layer) in self.layers.iter().enumerate() {
            // The norm and the mixer's output are dropped before the FFN: a long prompt's pass holds two
            // fewer hidden vectors per token through it.
            x = {
                let normed = be.rms_norm(&x, &layer.input_norm, self.eps)?;
                let mixed = match &layer.mixer {
                    Mixer::Attention(attn) => {
                        let start = Instant::now();
                        let mut kv = seqs
                            .iter_mut()
                            .map(|s| match &mut s.layers[i] {
                                LayerState::Kv(k) => Ok(k),
                                LayerState::Recurrent(_) => {
                                    Err(ModelError::Backend("layer state kind mismatch".into()))
                                }
                            })
                            .collect::<Result<Vec<_>>>()?;
                        let y = attn.forward(be, &normed, spans, &mut kv)?;
                        self.profile.add(Part::FullAttention, start.elapsed());
                        y
                    }
                    Mixer::Linear(delta) => {
                        let mut st = seqs
                            .iter_mut()
                            .map(|s| match &mut s.layers[i] {
                                LayerState::Recurrent(r) => Ok(r),
                                LayerState::Kv(_) => Err(ModelError::Backend("layer state kind mismatch".into())),
                            })
                            .collect::<Result<Vec<_>>>()?;
                        delta.forward(be, &normed, spans, &mut st, &self.profile)?
                    }
                };
                be.add(&x, &mixed)?
            };
            let b = be.rms_norm(&x, &layer.post_norm, self.eps)?;
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => {
                    // The dense layer right before the first MoE layer guesses the MoE layers ahead: no MoE layer
                    // before them would. (Later MoE layers are guessed by the MoE layers before them, whose
                    // guesses a dense layer's must not replace in the book.)
                    let is_moe = |l: &DecoderLayer<B>| matches!(l.ffn, Ffn::Moe(_));
                    let first_moe = match self.layers.get(i + 1).map(|l| &l.ffn) {
                        Some(Ffn::Moe(m)) if !self.layers[..i].iter().any(is_moe) => Some(m),
                        _ => None,
                    };
                    if let Some(m) = first_moe {
                        for (layer, experts) in self.predict_ahead(i, &x, ks, seqs, decode)? {
                            m.experts.prefetch(layer, &experts);
                        }
                    }
                    let start = Instant::now();
                    let f = mlp.forward(be, &b)?;
                    self.profile.add(Part::DenseMlp, start.elapsed());
                    f
                }
                Ffn::Moe(moe) => {
                    let seqs = &*seqs;
                    let mut predict = || self.predict_ahead(i, &x, ks, seqs, decode);
                    let mut refine = |so_far: &B::Tensor| self.predict_refined(i, &be.add(&x, so_far)?, ks);
                    let refine = (decode && self.prefetch == PrefetchMode::NextLayer)
                        .then_some(&mut refine as Refine<'_, B::Tensor>);
                    let (f, plan) = moe.forward(be, &b, ks, &mut predict, refine, &self.profile)?;
                    if decode && self.prefetch != PrefetchMode::None {
                        let (guessed, used) = self.guess_book().score(i, &plan.used);
                        if let Some(c) = (guessed > 0).then(|| moe.experts.counters()).flatten() {
                            c.guessed
                                .fetch_add(guessed as u64, std::sync::atomic::Ordering::Relaxed);
                            c.guessed_used
                                .fetch_add(used as u64, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                    let lasts = spans.iter().map(|s| plan.routes[s.rows.end - 1].0.clone()).collect();
                    last_experts.push((i, lasts));
                    f
                }
            };
            x = be.add(&x, &f)?;
            be.layer_done(&x)?;
        }
        Ok((x, last_experts))
    }

    /// The logits each sequence asked for: all its rows, or its last.
    fn head(&self, x: &B::Tensor, spans: &[SeqSpan], all: &[bool]) -> Result<Vec<Vec<f32>>> {
        let rows: Vec<usize> = spans
            .iter()
            .zip(all)
            .flat_map(|(s, &all)| {
                if all {
                    s.rows.clone()
                } else {
                    s.rows.end - 1..s.rows.end
                }
            })
            .collect();
        let be = &self.be;
        let h = be.rms_norm(&be.gather_rows(x, &rows)?, &self.norm, self.eps)?;
        let logits = be.to_host(&be.matmul(&self.lm_head, &h)?)?;
        let v = self.info.vocab_size;
        let mut out = Vec::with_capacity(spans.len());
        let mut at = 0;
        for (s, &all) in spans.iter().zip(all) {
            let m = if all { s.len() } else { 1 };
            out.push(logits[at * v..(at + m) * v].to_vec());
            at += m;
        }
        Ok(out)
    }
}

impl<B: Backend> Runner for Model<B> {
    fn forward(&self, reqs: &mut [SeqRequest<'_>]) -> Result<Vec<Vec<f32>>> {
        let (isa, h) = (Isa::detect(), self.hidden);
        let mut spans = Vec::with_capacity(reqs.len());
        let mut ks = Vec::new();
        let mut all = Vec::with_capacity(reqs.len());
        let mut ids = Vec::new();
        let mut seqs = Vec::with_capacity(reqs.len());
        for r in reqs.iter_mut() {
            let seq = r
                .cache
                .inner
                .as_any_mut()
                .downcast_mut::<Sequence<B>>()
                .filter(|s| s.model_id == self.id)
                .ok_or_else(|| ModelError::InvalidArgument("this cache was made by another model".into()))?;
            let k = self.check(r.tokens, &r.opts)?;
            let start = ids.len();
            ids.extend_from_slice(r.tokens);
            spans.push(SeqSpan {
                rows: start..ids.len(),
                pos0: seq.positions(),
            });
            ks.extend(std::iter::repeat_n(k, r.tokens.len()));
            all.push(r.opts.all_logits);
            seqs.push(seq);
        }
        let embed_start = Instant::now();
        let mut x0 = vec![0f32; ids.len() * h];
        let embed = self.embed.mat();
        for (row, &id) in x0.chunks_mut(h).zip(&ids) {
            embed.row(isa, id as usize, row);
        }
        let x = self.be.upload(x0, h)?;
        self.profile.add(Part::Head, embed_start.elapsed());
        let lens: Vec<usize> = seqs.iter().map(|s| s.positions()).collect();
        let compute = || {
            self.layers_forward(x, &spans, &ks, &mut seqs).and_then(|(x, lasts)| {
                let head_start = Instant::now();
                let logits = self.head(&x, &spans, &all)?;
                self.profile.add(Part::Head, head_start.elapsed());
                Ok((logits, lasts))
            })
        };
        // A decode step keeps the workers awake even when experts stream: its reads cost the I/O threads little
        // CPU (nothing is rewritten), while the workers' sleeps and wake-ups cost ~15% of its compute. A prompt's
        // chunk read from disk does not: its I/O threads tile what they read, on the cores a poller would take.
        let decode = SeqSpan::all_decode(&spans);
        let run = if self.awake_steps || decode {
            self.be.step(compute)
        } else {
            compute()
        };
        match run {
            Ok((logits, lasts)) => {
                for (j, seq) in seqs.iter_mut().enumerate() {
                    for (layer, per_seq) in &lasts {
                        if let Some(slot) = seq.last_experts.get_mut(*layer) {
                            slot.clone_from(&per_seq[j]);
                        }
                    }
                    seq.commit(&ids[spans[j].rows.clone()], ks[spans[j].rows.start]);
                }
                Ok(logits)
            }
            Err(e) => {
                // Leave every sequence as it was: KV appends cut back, written recurrent states dropped.
                for (seq, len) in seqs.iter_mut().zip(lens) {
                    seq.roll_back(len);
                }
                Err(e)
            }
        }
    }

    fn new_cache(&self) -> KvCache {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => LayerState::Kv(self.be.new_kv(a.shape)),
                Mixer::Linear(d) => LayerState::Recurrent(self.be.new_recurrent(d.shape)),
            })
            .collect();
        KvCache::new(Sequence::<B> {
            model_id: self.id,
            layers,
            last_experts: vec![Vec::new(); self.layers.len()],
            prefixes: vec![0],
        })
    }

    fn expert_source(&self) -> Option<&Arc<dyn ExpertSource>> {
        self.layers.iter().find_map(|l| match &l.ffn {
            Ffn::Moe(moe) => Some(&moe.experts),
            Ffn::Dense(_) => None,
        })
    }

    fn set_expert_source(&mut self, s: Arc<dyn ExpertSource>) {
        for l in &mut self.layers {
            if let Ffn::Moe(moe) = &mut l.ffn {
                moe.experts = Arc::clone(&s);
            }
        }
    }

    fn awake_steps(&self) -> bool {
        self.awake_steps
    }

    fn set_awake_steps(&mut self, awake: bool) {
        self.awake_steps = awake;
    }

    fn profile(&self) -> &StepProfile {
        &self.profile
    }

    fn backend_name(&self) -> &'static str {
        self.be.name()
    }

    fn prefetch(&self) -> (PrefetchMode, usize) {
        (self.prefetch, self.prefetch_ahead)
    }

    fn guess_precision(&self) -> Option<f64> {
        self.guess_book().precision()
    }

    fn guess_precision_by_rank(&self) -> Vec<Vec<Option<f64>>> {
        self.guess_book().precision_by_rank()
    }
}

/// Refuses `k` experts per token outside 1..=`experts`.
fn check_top_k_range(k: usize, experts: usize) -> Result<()> {
    if k == 0 || k > experts {
        return Err(ModelError::InvalidArgument(format!(
            "--top-k {k} must be between 1 and the model's {experts} experts"
        )));
    }
    Ok(())
}

/// Refuses a token id outside a vocabulary of `vocab`: a bad argument, not a limit (a server answers it as a bad
/// prompt, not as a context overflow).
pub(crate) fn check_vocabulary(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(ModelError::InvalidArgument(format!(
            "token id {id} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

/// A loaded model on its backend: what generate, serve and bench run.
pub struct DecoderModel {
    /// Model facts.
    pub info: ModelInfo,
    /// The memory budgets this model was loaded with.
    pub memory_plan: MemoryPlan,
    pub(crate) runner: Box<dyn Runner>,
}

impl DecoderModel {
    /// The longest sequence a request may reach: the context the memory plan's KV budget covers, at most the
    /// model's own (a longer one would grow the KV cache into the room planned for experts).
    pub fn context_limit(&self) -> usize {
        self.memory_plan.kv_tokens.min(self.info.context_length)
    }

    /// A fresh state for one sequence.
    pub fn new_cache(&self) -> KvCache {
        self.runner.new_cache()
    }

    /// Refuses a `--top-k` (experts per token) this model cannot take: outside 1..=its experts, or any on a
    /// model without routed experts (where it would change nothing).
    pub fn check_top_k(&self, top_k: Option<usize>) -> Result<()> {
        match top_k {
            Some(_) if self.info.num_experts == 0 => Err(ModelError::InvalidArgument(
                "--top-k sets experts per token, and this model has no routed experts".into(),
            )),
            Some(k) => check_top_k_range(k, self.info.num_experts),
            None => Ok(()),
        }
    }

    /// Runs `tokens` after the cached positions; returns logits `[m, vocab]`, m = tokens or 1. On error the
    /// cache is as it was.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, opts: &ForwardOptions) -> Result<Vec<f32>> {
        let mut reqs = [SeqRequest {
            tokens,
            cache,
            opts: *opts,
        }];
        self.forward_batch(&mut reqs)?
            .pop()
            .ok_or_else(|| ModelError::InvalidArgument("no logits".into()))
    }

    /// One forward over several sequences at their own positions, each with its own experts per token; returns
    /// each one's logits. The same numbers as running each alone (bit for bit on `cpu`). On error every
    /// sequence is as it was.
    pub fn forward_batch(&self, reqs: &mut [SeqRequest<'_>]) -> Result<Vec<Vec<f32>>> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        // The memory plan's KV budget, not only the model's own context: past it the KV cache would grow into
        // the room planned for experts.
        let limit = self.context_limit();
        if let Some(r) = reqs.iter().find(|r| r.cache.len() + r.tokens.len() > limit) {
            return Err(ModelError::Limit(format!(
                "{} tokens exceed the context limit of {limit} tokens (the KV budget of the memory plan; --ctx-size)",
                r.cache.len() + r.tokens.len()
            )));
        }
        self.runner.forward(reqs)
    }

    /// Where forward time goes, accumulated over every call.
    pub fn profile(&self) -> &StepProfile {
        self.runner.profile()
    }

    /// How this model guesses the layers ahead (`Auto` resolved) and how many MoE layers ahead it guesses.
    pub fn prefetch(&self) -> (PrefetchMode, usize) {
        self.runner.prefetch()
    }

    /// Recent share of the experts guessed for the layers ahead that those layers then used (decode steps;
    /// `None` before any guess was scored).
    pub fn guess_precision(&self) -> Option<f64> {
        self.runner.guess_precision()
    }

    /// The same share per distance (`[0]`: guesses for the next layer) and rank (`[d][0]`: the router's first
    /// choice): which of them `--prefetch auto` reads.
    pub fn guess_precision_by_rank(&self) -> Vec<Vec<Option<f64>>> {
        self.runner.guess_precision_by_rank()
    }

    /// The backend computing this model (`cpu`, `mlx`, `reference`).
    pub fn backend(&self) -> &'static str {
        self.runner.backend_name()
    }

    /// The expert store's I/O counters, when experts go through the engine.
    pub fn expert_counters(&self) -> Option<Arc<expert_store::StoreCounters>> {
        self.runner.expert_source().and_then(|s| s.counters())
    }

    /// Slots of the expert cache when experts go through the engine.
    pub fn expert_slots(&self) -> Option<usize> {
        self.runner.expert_source().and_then(|s| s.slots())
    }

    /// Bytes of one expert slot (the largest record, page-aligned) when experts go through the engine.
    pub fn expert_slot_len(&self) -> Option<usize> {
        self.runner.expert_source().and_then(|s| s.slot_len())
    }

    /// Empties the expert slot cache and the OS page cache of the expert files, so the next reads come from
    /// the disk (for cold benchmarks).
    pub fn drop_expert_caches(&self) -> Result<()> {
        match self.runner.expert_source() {
            Some(s) => Ok(s.drop_caches()?),
            None => Ok(()),
        }
    }

    /// Where the routed experts come from (`None` for a dense model).
    pub fn expert_source(&self) -> Option<Arc<dyn ExpertSource>> {
        self.runner.expert_source().cloned()
    }

    /// Serves the routed experts from `source` from now on (e.g. a store over a fault-injecting file).
    pub fn set_expert_source(&mut self, source: Arc<dyn ExpertSource>) {
        self.runner.set_expert_source(source);
    }

    /// Whether steps keep the compute threads polling between parallel calls (set at load: when experts are
    /// resident, so no step waits on the disk).
    pub fn awake_steps(&self) -> bool {
        self.runner.awake_steps()
    }

    /// Keeps the compute threads polling through each step, or not (e.g. while a streamed model's experts are
    /// all served from RAM).
    pub fn set_awake_steps(&mut self, awake: bool) {
        self.runner.set_awake_steps(awake);
    }
}
