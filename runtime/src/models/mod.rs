//! Architectures, one file each, and the `model_type` registry.

mod mixtral;
mod qwen3_moe;
mod qwen3_next;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use expert_store::{ExpertSource, PackedStore, StackedExperts};

use crate::attention::{Attention, AttnSpec};
use crate::backend::cpu::CpuBackend;
use crate::backend::reference::ReferenceBackend;
use crate::backend::tiled_experts::{stored_panel, tiled_formats, tiled_parts, TiledExperts};
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::expert_source::open_source;
use crate::gated_delta::{DeltaShape, GatedDeltaNet};
use crate::location::ModelLocation;
use crate::memory_plan::{ExpertPlacement, ModelFootprint};
use crate::model::{next_model_id, DecoderLayer, DecoderModel, Ffn, Mixer, Model, ModelInfo, PrefetchMode, Runner};
use crate::moe::{Mlp, RouterKind, SharedExpert, SparseMoe};
use crate::ops::{AttnShape, Rope};
use crate::options::{BackendKind, ExpertOptions};
use crate::prefetch::AUTO_MIN_PRECISION;
use crate::weights::{ExpertLayout, Weights};

type Describe = fn(&ModelConfig, Option<&Weights>) -> Result<Architecture>;

/// `model_type` → the architecture's description of a checkpoint.
const REGISTRY: &[(&str, Describe)] = &[
    ("qwen3_moe", qwen3_moe::describe),
    ("qwen3", qwen3_moe::describe),
    ("mixtral", mixtral::describe),
    ("qwen3_next", qwen3_next::describe),
    ("qwen3_5_moe", qwen3_next::describe),
    ("qwen3_5_moe_text", qwen3_next::describe),
    ("qwen3_5", qwen3_next::describe),
    ("qwen3_5_text", qwen3_next::describe),
];

/// The `model_type`s this build can load.
pub fn supported_model_types() -> Vec<&'static str> {
    REGISTRY.iter().map(|(n, _)| *n).collect()
}

/// Loads the model at `path` (an MLX model directory or a packed store) with default expert options.
pub fn load_model(path: &Path) -> Result<DecoderModel> {
    let loc = ModelLocation::resolve(path)?;
    let config = ModelConfig::load(loc.model_dir())?;
    load_located(&loc, config, &ExpertOptions::default())
}

/// Loads the model at `path` (an MLX model directory or a packed store) with `config.json` already parsed.
pub fn load_model_with(path: &Path, config: ModelConfig, opts: &ExpertOptions) -> Result<DecoderModel> {
    load_located(&ModelLocation::resolve(path)?, config, opts)
}

/// [`load_model_with`] for an already resolved location (the store's manifest is read once).
pub(crate) fn load_located(loc: &ModelLocation, config: ModelConfig, opts: &ExpertOptions) -> Result<DecoderModel> {
    let weights = Weights::open(loc.model_dir(), config)?;
    let arch = describe(&weights)?;
    let num_experts = arch.num_experts();
    // Expert layouts of every MoE layer first: one expert source serves them all.
    let (layouts, stacks) = arch.expert_layouts(&weights)?;
    let store = match loc {
        ModelLocation::Store(store, _) => Some(store.as_ref()),
        ModelLocation::Dir(_) => None,
    };
    let stored_tiled = store.is_some_and(|s| s.manifest().layers.iter().any(|l| l.layout.is_some()));
    let layouts = match store {
        Some(s) => {
            // A store of another model is told so before its layouts are read.
            s.check_against(weights.checkpoint(), &stacks)?;
            store_layouts(s, &arch, layouts, opts)?
        }
        None => layouts,
    };
    let tiles = expert_tiles(&arch, &layouts, opts);
    let rewrite = tiles.clone().map(|t| t as Arc<dyn expert_store::RecordTransform>);
    let opened = open_source(&weights, &stacks, store, opts, footprint(&arch, opts), rewrite)?;
    let (source, memory_plan) = (opened.source, opened.plan);
    let tiles = tiles.filter(|_| opened.rewritten);
    let rewritten = (arch.moe_layers())
        .map(|(l, _)| tiles.as_ref().and_then(|t| t.layout(l)))
        .collect();
    let d = &arch.dims;
    let record_bytes = crate::expert_source::record_bytes_by_layer(weights.checkpoint(), &stacks, store, d.layers);
    let info = ModelInfo {
        model_type: weights.config().model_type.clone(),
        vocab_size: d.vocab,
        context_length: d.context_length,
        num_experts: num_experts.unwrap_or(0),
        default_top_k: d.top_k,
        router: d.router,
        num_layers: d.layers,
        moe_layers: stacks.len(),
        expert_record_bytes: record_bytes.iter().copied().max().unwrap_or(0),
        expert_record_bytes_by_layer: record_bytes,
        tiled_experts: tiles.is_some() || stored_tiled,
    };
    let parts = Parts {
        w: &weights,
        arch,
        layouts,
        rewritten,
        source,
        info: info.clone(),
        prefetch: match opts.prefetch {
            PrefetchMode::Auto if memory_plan.placement == ExpertPlacement::Stream => PrefetchMode::NextLayer,
            PrefetchMode::Auto => PrefetchMode::None,
            mode => mode,
        },
        prefetch_min_precision: (opts.prefetch == PrefetchMode::Auto).then_some(AUTO_MIN_PRECISION),
        prefetch_ahead: opts.prefetch_ahead,
        awake_steps: memory_plan.placement == ExpertPlacement::Resident,
    };
    let runner: Box<dyn Runner> = match opts.backend {
        BackendKind::Cpu => Box::new(build_decoder(
            CpuBackend {
                kv: opts.kv_cache,
                ..CpuBackend::default()
            },
            parts,
        )?),
        BackendKind::Reference => Box::new(build_decoder(ReferenceBackend, parts)?),
        #[cfg(feature = "mlx")]
        BackendKind::Mlx => {
            // MLX keeps freed buffers for reuse, by default up to its whole memory limit: outside every budget
            // of the plan. They are allocator slack, which the margin is for; half of it is theirs.
            crate::backend::mlx::limit_buffer_cache(memory_plan.margin / 2);
            Box::new(build_decoder(crate::backend::mlx::MlxBackend, parts)?)
        }
        #[cfg(not(feature = "mlx"))]
        BackendKind::Mlx => {
            return Err(ModelError::InvalidArgument(
                "this build has no mlx backend: rebuild with `--features mlx` (see the README)".into(),
            ))
        }
    };
    Ok(DecoderModel {
        info,
        memory_plan,
        runner,
    })
}

/// The rewrite into the int8 kernels' tiles, for the cpu backend where that kernel runs and for the MoE layers
/// whose records can be tiled (`None`: records stay as stored).
fn expert_tiles(arch: &Architecture, layouts: &[ExpertLayout], opts: &ExpertOptions) -> Option<Arc<TiledExperts>> {
    let isa = crate::cpu::Isa::detect();
    let on = opts.backend == BackendKind::Cpu && crate::cpu::q8::tiled_kernel_on(isa);
    Some(Arc::new(tiled_experts(arch, layouts, isa, false))).filter(|t| on && !t.is_empty())
}

/// The tiling of `layouts` (one per MoE layer) for `isa`'s kernels, in the panels this CPU reads fastest; for
/// a packed store (`for_store`) only where the result is the same on every x86-64 CPU with the tiled kernel.
pub(crate) fn tiled_experts(
    arch: &Architecture,
    layouts: &[ExpertLayout],
    isa: crate::cpu::Isa,
    for_store: bool,
) -> TiledExperts {
    let layers = (arch.moe_layers().zip(layouts)).map(|((l, inter), f)| (l, *f, inter, arch.dims.hidden));
    match for_store {
        true => TiledExperts::for_store(isa, crate::cpu::panel_tiles(), layers),
        false => TiledExperts::new(isa, crate::cpu::panel_tiles(), layers),
    }
}

/// How `store`'s records form each MoE layer's matrices: as the checkpoint's (`layouts`) for layers stored as
/// they are, in tiles for layers the store holds tiled, which only the cpu backend's int8 kernels and the
/// reference backend read (elsewhere: a clear error naming the way out).
fn store_layouts(
    store: &PackedStore,
    arch: &Architecture,
    layouts: Vec<ExpertLayout>,
    opts: &ExpertOptions,
) -> Result<Vec<ExpertLayout>> {
    let by_layer: HashMap<usize, &expert_store::LayerManifest> =
        store.manifest().layers.iter().map(|l| (l.layer, l)).collect();
    let isa = crate::cpu::Isa::detect();
    let what = || format!("{}", store.dir().display());
    (arch.moe_layers().zip(layouts))
        .map(|((layer, inter), stored)| {
            let Some(m) = by_layer.get(&layer).filter(|m| m.layout.is_some()) else {
                return Ok(stored);
            };
            let name = m.layout.as_deref().unwrap_or_default();
            let tiled = (stored_panel(name))
                .and_then(|panel| tiled_formats(panel, &stored, inter, arch.dims.hidden, |_, _, _| true))
                .ok_or_else(|| {
                    ModelError::InvalidArgument(format!(
                        "{}: layer {layer}'s expert records are stored as `{name}`, which this build cannot read for \
                         this model; convert the model directory again",
                        what()
                    ))
                })?;
            // Where the tiling puts gate, up and down: an offset edited in the manifest would read one matrix as
            // another while the checksums still matched.
            let want: Vec<(u64, u64)> = (tiled_parts(&tiled, inter, arch.dims.hidden).into_iter())
                .map(|(at, len)| (at as u64, len as u64))
                .collect();
            let got: Vec<(u64, u64)> = m.stored_parts.iter().flatten().copied().collect();
            if got != want {
                return Err(ModelError::InvalidArgument(format!(
                    "{}: layer {layer}'s tiled records have parts at {got:?} (offset, bytes), the model's matrices \
                     need {want:?}",
                    what()
                )));
            }
            let refused = match opts.backend {
                BackendKind::Reference => None,
                BackendKind::Mlx => Some("the mlx backend".to_string()),
                BackendKind::Cpu if !crate::cpu::q8::q8_activations() => Some("--kernels exact".into()),
                BackendKind::Cpu if !crate::cpu::q8::tiled_kernel_here(isa) => Some(format!("this CPU's {isa:?} kernels")),
                BackendKind::Cpu => None,
            };
            if let Some(reader) = refused {
                return Err(ModelError::InvalidArgument(format!(
                    "{}: its expert records are stored in the cpu backend's int8 tiles (`{name}`), which only the int8 \
                     kernels (--kernels q8, x86-64 with AVX2 or AVX-512) read, not {reader}; serve the model directory, \
                     or a store converted with --layout mlx",
                    what(),
                )));
            }
            Ok(tiled)
        })
        .collect()
}

/// The architecture's description function for a `model_type`.
fn describer(config: &ModelConfig) -> Result<Describe> {
    REGISTRY
        .iter()
        .find(|(n, _)| *n == config.model_type)
        .map(|(_, d)| *d)
        .ok_or_else(|| ModelError::UnknownModelType(config.model_type.clone(), supported_model_types().join(", ")))
}

/// What a `config.json` alone says the model's layers are (for sizing a model before it is downloaded).
pub(crate) fn describe_config(config: &ModelConfig) -> Result<Architecture> {
    described(config, None)
}

/// The architecture's description of `config` (and of the tensors' shapes, when given), its sizes checked.
fn described(config: &ModelConfig, tensors: Option<&Weights>) -> Result<Architecture> {
    let arch = describer(config)?(config, tensors)?;
    arch.dims.validate(config, arch.num_experts().unwrap_or(0))?;
    // Only the sizes a layer uses: a MoE model's dense `intermediate_size` may be anything when no layer is dense.
    for (i, plan) in arch.ffn.iter().enumerate() {
        let (what, inter) = match plan {
            FfnPlan::Dense { inter, .. } => ("dense FFN", *inter),
            FfnPlan::Moe { inter, .. } => ("experts'", *inter),
        };
        if inter == 0 {
            return Err(config.error(format!("layer {i}'s {what} intermediate size must be non-zero")));
        }
        // Weights the config says are not there would be skipped, and the model would answer wrong.
        if let (
            FfnPlan::Moe {
                prefix, shared: None, ..
            },
            Some(w),
        ) = (plan, tensors)
        {
            if w.has(&format!("{prefix}.shared_expert.down_proj.weight")) {
                return Err(config.error(format!(
                    "the checkpoint has a shared expert at `{prefix}.shared_expert`, but the config gives it no size \
                     (shared_expert_intermediate_size)"
                )));
            }
        }
    }
    // Fewer layers than the checkpoint holds run (a deliberate cut is possible), but say so.
    let next_layer = format!("model.layers.{}.input_layernorm.weight", arch.dims.layers);
    if tensors.is_some_and(|w| w.has(&next_layer)) {
        tracing::warn!(
            "the checkpoint has more layers than num_hidden_layers {}; layers {} and on are not used",
            arch.dims.layers,
            arch.dims.layers
        );
    }
    Ok(arch)
}

/// What the checkpoint's `model_type` says its layers are, its sizes checked, and checked against its tensors'
/// names.
pub(crate) fn describe(w: &Weights) -> Result<Architecture> {
    // An architecture sluice does not run is named first: converting its per-expert tensors would not help.
    describer(w.config())?;
    // Only what is read: the multi-token-prediction head keeps its experts one by one even in checkpoints whose
    // decoder stacks them (Hugging Face's Qwen3.5 and Qwen3-Next).
    if (w.checkpoint().names()).any(|n| w.is_text_model(n) && n.contains(".experts.0.")) {
        return Err(ModelError::BadTensor {
            name: "*.experts.0.*".into(),
            message: "per-expert (Hugging Face) layout is not supported yet; convert with `mlx_lm.convert`".into(),
        });
    }
    described(w.config(), Some(w))
}

/// A decoder described from its config: the shapes shared by every layer, and each layer's FFN.
pub(crate) struct Architecture {
    pub dims: DecoderDims,
    pub ffn: Vec<FfnPlan>,
}

impl Architecture {
    /// `plan(i)` says what layer `i`'s FFN is.
    pub fn new(dims: DecoderDims, plan: impl Fn(usize) -> FfnPlan) -> Self {
        let ffn = (0..dims.layers).map(plan).collect();
        Self { dims, ffn }
    }

    /// Each MoE layer's index and intermediate size, in order.
    fn moe_layers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (self.ffn.iter().enumerate()).filter_map(|(i, p)| match p {
            FfnPlan::Moe { inter, .. } => Some((i, *inter)),
            FfnPlan::Dense { .. } => None,
        })
    }

    /// Experts per MoE layer (`None` for a dense model).
    fn num_experts(&self) -> Option<usize> {
        self.ffn.iter().find_map(|p| match p {
            FfnPlan::Moe { num_experts, .. } => Some(*num_experts),
            FfnPlan::Dense { .. } => None,
        })
    }

    /// How each MoE layer's expert records are laid out, and where their stacked tensors are (what the
    /// expert store serves and `sluice convert` packs), checked against the checkpoint's tensors.
    pub fn expert_layouts(&self, w: &Weights) -> Result<(Vec<ExpertLayout>, Vec<StackedExperts>)> {
        let mut formats = Vec::new();
        let mut stacks = Vec::new();
        for (i, p) in self.ffn.iter().enumerate() {
            if let FfnPlan::Moe {
                prefix,
                num_experts,
                inter,
                ..
            } = p
            {
                let (f, s) = w.stacked_experts(prefix, i, *num_experts, self.dims.hidden, *inter)?;
                formats.push(f);
                stacks.push(s);
            }
        }
        Ok((formats, stacks))
    }
}

/// What sits in a layer's FFN slot.
pub(crate) enum FfnPlan {
    /// Dense SwiGLU at `prefix` with this intermediate size.
    Dense { prefix: String, inter: usize },
    /// Routed experts: router at `{prefix}.gate`, stacked experts at `{prefix}.switch_mlp`.
    Moe {
        prefix: String,
        num_experts: usize,
        inter: usize,
        /// A shared expert at `{prefix}.shared_expert` with this intermediate size, gated by
        /// `{prefix}.shared_expert_gate` when that exists.
        shared: Option<usize>,
    },
}

/// The Qwen3-Next / Qwen3.5 hybrid: which layers are Gated DeltaNet, their shape, and the norm convention.
pub(crate) struct Hybrid {
    /// Per layer: linear attention (else gated full attention).
    pub linear: Vec<bool>,
    /// Gated DeltaNet shape.
    pub delta: DeltaShape,
    /// Added to every (1 + w) norm: 1 for Hugging Face checkpoints (zero-centred), 0 for MLX ones.
    pub norm_offset: f32,
}

/// The shape facts every decoder-only MoE here shares.
pub(crate) struct DecoderDims {
    pub hidden: usize,
    pub layers: usize,
    pub attn: AttnShape,
    pub vocab: usize,
    pub context_length: usize,
    pub eps: f32,
    pub tie_embeddings: bool,
    pub qk_norm: bool,
    pub rope: Rope,
    pub router: RouterKind,
    pub top_k: usize,
    pub hybrid: Option<Hybrid>,
}

impl DecoderDims {
    /// Rejects shapes the math cannot run, naming config.json.
    pub fn validate(&self, c: &ModelConfig, num_experts: usize) -> Result<()> {
        let a = &self.attn;
        let zero = [self.hidden, self.layers, a.heads, a.kv_heads, a.head_dim, self.vocab].contains(&0);
        if zero {
            return Err(c.error("hidden size, layers, heads, head_dim and vocab_size must all be non-zero"));
        }
        if !a.heads.is_multiple_of(a.kv_heads) {
            return Err(c.error(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                a.heads, a.kv_heads
            )));
        }
        if !a.head_dim.is_multiple_of(2) {
            return Err(c.error(format!("head_dim {} must be even for RoPE", a.head_dim)));
        }
        // A negative epsilon takes the square root of a negative mean square (NaN) on quiet inputs.
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(c.error(format!("rms_norm_eps {} must be a finite number ≥ 0", self.eps)));
        }
        if num_experts > 0 && (self.top_k == 0 || self.top_k > num_experts) {
            return Err(c.error(format!(
                "num_experts_per_tok {} must be in 1..={num_experts}",
                self.top_k
            )));
        }
        Ok(())
    }
}

/// The per-sequence memory a model of this architecture needs as `opts` runs it: K and V of the backend's
/// element type for every full-attention layer, the f32 state and conv history of every linear-attention layer
/// (the current and the next), a prompt token's activations in a prefill pass routed to `--top-k` experts, and
/// the attention scores a compute thread of the cpu backends keeps (MLX computes attention its own way).
pub(crate) fn footprint(arch: &Architecture, opts: &ExpertOptions) -> ModelFootprint {
    let (kv_bytes, top_k) = (opts.kv_element_bytes(), opts.top_k);
    let d = &arch.dims;
    let f32s = 4u64;
    let linear = d.hybrid.as_ref().map_or(0, |h| h.linear.iter().filter(|&&l| l).count());
    let kv_layers = (d.layers - linear) as u64;
    let kv = kv_layers * 2 * (d.attn.kv_heads * d.attn.head_dim) as u64 * kv_bytes;
    // Twice: a forward writes the next state beside the current one (out of place, so a failed step leaves
    // the sequence as it was), and the cpu backend keeps the older buffers for the next forward.
    let state = d
        .hybrid
        .as_ref()
        .map_or(0, |h| 2 * linear as u64 * h.delta.state_floats() as u64 * f32s);
    ModelFootprint {
        kv_bytes_per_token: kv,
        state_bytes: state,
        logit_bytes_per_row: d.vocab as u64 * f32s,
        context_length: d.context_length,
        activation_bytes_per_token: activation_floats(arch, top_k.unwrap_or(d.top_k)) as u64 * f32s,
        score_bytes_per_position: match opts.backend {
            BackendKind::Mlx => 0,
            BackendKind::Cpu | BackendKind::Reference => {
                (crate::ops::POSITIONS_PER_TASK * d.attn.heads / d.attn.kv_heads.max(1)) as u64 * f32s
            }
        },
        score_bytes_bounded: match opts.backend {
            BackendKind::Mlx => crate::backend::MLX_SCORE_COPIES * crate::backend::MLX_SCORE_BLOCK_BYTES,
            BackendKind::Cpu | BackendKind::Reference => 0,
        },
        ..ModelFootprint::default()
    }
}

/// f32s one prompt token holds at the peak of a layer pass, taking every buffer of the layer's widest
/// stage as alive at once: the residual stream, its norm and the stage's output (3 hidden vectors), plus
/// attention's projections, their roped copies and its output, or linear attention's projections, conv
/// output and per-head outputs, or the FFN's: the router's logits, the token's routed experts' gathered
/// inputs and outputs (`top_k` hidden vectors each), their gate and up outputs, and a shared expert's or a
/// dense FFN's intermediate vectors. A matmul's own scratch is per token block (`cpu::token_block`), so it
/// is not per token: the margin holds it.
fn activation_floats(arch: &Architecture, top_k: usize) -> usize {
    let d = &arch.dims;
    let a = &d.attn;
    let gate = if d.hybrid.is_some() { 2 } else { 1 };
    let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let attention = q * gate + 2 * kv + (q + kv) + q;
    let linear = d.hybrid.as_ref().map_or(0, |h| {
        let x = &h.delta;
        3 * x.conv_dim() + 3 * x.value_dim() + 4 * x.v_heads
    });
    let ffn = (arch.ffn.iter())
        .map(|p| match p {
            FfnPlan::Dense { inter, .. } => 3 * inter,
            FfnPlan::Moe {
                num_experts,
                inter,
                shared,
                ..
            } => num_experts + top_k.min(*num_experts) * (2 * d.hidden + 2 * inter) + shared.map_or(0, |s| 3 * s + 1),
        })
        .max()
        .unwrap_or(0);
    3 * d.hidden + attention.max(linear).max(ffn)
}

/// Everything a backend's model is built from.
struct Parts<'a> {
    w: &'a Weights,
    arch: Architecture,
    /// One per MoE layer, in layer order: records as stored, and as the store rewrites them (if it does).
    layouts: Vec<ExpertLayout>,
    rewritten: Vec<Option<ExpertLayout>>,
    source: Arc<dyn ExpertSource>,
    info: ModelInfo,
    prefetch: PrefetchMode,
    prefetch_ahead: usize,
    prefetch_min_precision: Option<f64>,
    awake_steps: bool,
}

/// Assembles embedding, layers (attention at `model.layers.N.self_attn`, or for hybrids linear attention at
/// `model.layers.N.linear_attn`; FFN per the architecture's plan), norm and head, on backend `be`.
fn build_decoder<B: Backend>(be: B, p: Parts<'_>) -> Result<Model<B>> {
    let Parts {
        w,
        arch,
        layouts,
        rewritten,
        source,
        info,
        prefetch,
        prefetch_ahead,
        prefetch_min_precision,
        awake_steps,
    } = p;
    let Architecture { dims: d, ffn: plans } = arch;
    let offset = d.hybrid.as_ref().map_or(0.0, |h| h.norm_offset);
    let norm = |path: &str| -> Result<B::Vector> {
        let mut v = w.vector(path, d.hidden)?;
        v.iter_mut().for_each(|x| *x += offset);
        be.vector(&v)
    };
    let attn_spec = AttnSpec {
        shape: d.attn,
        rope: d.rope.clone(),
        eps: d.eps,
        qk_norm: d.qk_norm,
        output_gate: d.hybrid.is_some(),
        norm_offset: offset,
    };
    let mut layouts = layouts.into_iter().zip(rewritten);
    let mut layers = Vec::with_capacity(d.layers);
    for (i, p) in plans.iter().enumerate() {
        let base = format!("model.layers.{i}");
        let ffn = match p {
            FfnPlan::Dense { prefix, inter } => Ffn::Dense(Mlp::load(&be, w, prefix, d.hidden, *inter)?),
            FfnPlan::Moe {
                prefix,
                num_experts,
                inter,
                shared,
            } => {
                let (stored, rewritten) = layouts.next().expect("one layout per MoE layer");
                // Rewritten records are told apart by their part count (tiles: one part per matrix): equal
                // counts would read one layout as the other.
                if rewritten.is_some_and(|r| r.record_parts() == stored.record_parts()) {
                    return Err(crate::error::ModelError::Internal(format!(
                        "layer {i}: its rewritten records have as many parts as its stored ones ({}), so the two \
                         cannot be told apart",
                        stored.record_parts()
                    )));
                }
                Ffn::Moe(SparseMoe {
                    router: be.matrix(&w.linear(&format!("{prefix}.gate"), *num_experts, d.hidden)?)?,
                    kind: d.router,
                    layer: i,
                    num_experts: *num_experts,
                    hidden: d.hidden,
                    inter: *inter,
                    layout: stored,
                    rewritten,
                    experts: Arc::clone(&source),
                    shared: match shared {
                        Some(si) => Some(SharedExpert {
                            mlp: Mlp::load(&be, w, &format!("{prefix}.shared_expert"), d.hidden, *si)?,
                            // Every architecture with a shared expert here gates it (Qwen3-Next, Qwen3.5); one left
                            // out would add the expert unscaled, so its absence is an error naming it.
                            gate: be.matrix(&w.linear(&format!("{prefix}.shared_expert_gate"), 1, d.hidden)?)?,
                        }),
                        None => None,
                    },
                })
            }
        };
        let mixer = match &d.hybrid {
            Some(h) if h.linear[i] => Mixer::Linear(GatedDeltaNet::load(
                &be,
                w,
                &format!("{base}.linear_attn"),
                d.hidden,
                h.delta,
                d.eps,
            )?),
            _ => Mixer::Attention(Attention::load(
                &be,
                w,
                &format!("{base}.self_attn"),
                d.hidden,
                &attn_spec,
            )?),
        };
        layers.push(DecoderLayer {
            input_norm: norm(&format!("{base}.input_layernorm.weight"))?,
            mixer,
            post_norm: norm(&format!("{base}.post_attention_layernorm.weight"))?,
            ffn,
        });
    }
    let embed = w.linear("model.embed_tokens", d.vocab, d.hidden)?;
    let lm_head = if d.tie_embeddings {
        be.matrix(&embed)?
    } else {
        be.matrix(&w.linear("lm_head", d.vocab, d.hidden)?)?
    };
    Ok(Model {
        id: next_model_id(),
        info,
        embed,
        layers,
        norm: norm("model.norm.weight")?,
        lm_head,
        eps: d.eps,
        hidden: d.hidden,
        prefetch,
        prefetch_ahead,
        prefetch_min_precision,
        awake_steps,
        guesses: Default::default(),
        profile: Default::default(),
        be,
    })
}
