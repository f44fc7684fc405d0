//! Named weights of a checkpoint, checked against the shapes the config implies.

use std::path::Path;
use std::sync::Arc;

use expert_store::{Checkpoint, Dtype, OwnedBytes, StackedExperts, TensorInfo};

use crate::config::ModelConfig;
use crate::cpu::FloatType;
use crate::error::{ModelError, Result};
use crate::linear::{Linear, WeightFormat};
use crate::quant::QuantMode;

/// Prefix MLX VLM-style checkpoints put before the language model's weights.
const VLM_PREFIX: &str = "language_model.";

/// Where Hugging Face VLM checkpoints (Qwen3.5) keep the text model's `model.*` weights.
const HF_VLM_MODEL: &str = "model.language_model.";

/// How this checkpoint names the text model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Naming {
    /// `model.layers.N...`, `lm_head.weight`.
    Plain,
    /// MLX VLM: everything under `language_model.`.
    MlxVlm,
    /// Hugging Face VLM: `model.*` under `model.language_model.*`, `lm_head.weight` at the top.
    HfVlm,
}
/// A checkpoint plus the config that says how to read it.
pub struct Weights {
    ckpt: Arc<Checkpoint>,
    config: ModelConfig,
    naming: Naming,
}

fn float_type(d: Dtype) -> Option<FloatType> {
    match d {
        Dtype::F32 => Some(FloatType::F32),
        Dtype::F16 => Some(FloatType::F16),
        Dtype::BF16 => Some(FloatType::BF16),
        _ => None,
    }
}

fn bad(name: &str, message: String) -> ModelError {
    ModelError::BadTensor {
        name: name.to_string(),
        message,
    }
}

impl Weights {
    /// Opens the safetensors of `dir`, detecting VLM-style name prefixes (vision weights are never read).
    pub fn open(dir: &Path, config: ModelConfig) -> Result<Self> {
        let ckpt = Arc::new(Checkpoint::open(dir)?);
        let naming = if ckpt.names().any(|n| n.starts_with(VLM_PREFIX)) {
            Naming::MlxVlm
        } else if ckpt.names().any(|n| n.starts_with(HF_VLM_MODEL)) {
            Naming::HfVlm
        } else {
            Naming::Plain
        };
        Ok(Self { ckpt, config, naming })
    }

    /// The parsed config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The underlying checkpoint.
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.ckpt
    }

    /// Full tensor name of `path` (an MLX text-model name such as `model.layers.0.mlp.gate.weight`) in this
    /// checkpoint.
    pub fn name(&self, path: &str) -> String {
        match self.naming {
            Naming::Plain => path.to_string(),
            Naming::MlxVlm => format!("{VLM_PREFIX}{path}"),
            Naming::HfVlm => match path.strip_prefix("model.") {
                Some(rest) => format!("{HF_VLM_MODEL}{rest}"),
                None => path.to_string(),
            },
        }
    }

    /// Whether the checkpoint's tensor `full_name` is the text model's (what a backend reads): not a vision
    /// tower's, nor a multi-token-prediction head's (`mtp.*`, wherever it sits), which VLM and Hugging Face
    /// checkpoints keep beside it.
    pub fn is_text_model(&self, full_name: &str) -> bool {
        let under = |p: &str| full_name.starts_with(p);
        let text = match self.naming {
            Naming::Plain => (under("model.") && !under("model.visual.")) || under("lm_head."),
            Naming::MlxVlm => under(VLM_PREFIX),
            Naming::HfVlm => under(HF_VLM_MODEL) || under("lm_head."),
        };
        text && !full_name.contains(".mtp.")
    }

    /// Whether tensor `path` exists.
    pub fn has(&self, path: &str) -> bool {
        self.ckpt.get(&self.name(path)).is_some()
    }

    fn tensor(&self, path: &str) -> Result<&TensorInfo> {
        Ok(self.ckpt.require(&self.name(path))?)
    }

    /// A float vector (norm weights, biases), copied to f32.
    pub fn vector(&self, path: &str, len: usize) -> Result<Vec<f32>> {
        let name = self.name(path);
        let t = self.tensor(path)?;
        let ft =
            float_type(t.dtype).ok_or_else(|| bad(&name, format!("expected a float tensor, got {:?}", t.dtype)))?;
        if t.shape != [len] {
            return Err(bad(&name, format!("expected shape [{len}], got {:?}", t.shape)));
        }
        let mut out = vec![0f32; len];
        ft.to_f32(t.bytes(), 0, &mut out);
        Ok(out)
    }

    /// A small float tensor of one of the `shapes` (e.g. a conv kernel), copied to f32 in storage order.
    pub fn array(&self, path: &str, shapes: &[&[usize]]) -> Result<Vec<f32>> {
        let name = self.name(path);
        let t = self.tensor(path)?;
        let ft =
            float_type(t.dtype).ok_or_else(|| bad(&name, format!("expected a float tensor, got {:?}", t.dtype)))?;
        if !shapes.contains(&t.shape.as_slice()) {
            return Err(bad(&name, format!("expected shape {shapes:?}, got {:?}", t.shape)));
        }
        let mut out = vec![0f32; t.shape.iter().product()];
        ft.to_f32(t.bytes(), 0, &mut out);
        Ok(out)
    }

    /// The shape of tensor `path`, if present.
    pub fn shape(&self, path: &str) -> Option<&[usize]> {
        self.ckpt.get(&self.name(path)).map(|t| t.shape.as_slice())
    }

    /// The storage format of module `module` (its `.weight`, and `.scales`/`.biases` when quantized), checking
    /// every tensor's dtype and shape: `lead` leading dims (e.g. `[num_experts]`), then `[rows, cols]`.
    fn format_of(&self, module: &str, lead: &[usize], rows: usize, cols: usize) -> Result<(WeightFormat, Vec<String>)> {
        // Hugging Face's fused expert tensors (`experts.gate_up_proj`) are bare tensors without `.weight`.
        let wpath = if !self.has(&format!("{module}.weight")) && self.has(module) {
            module.to_string()
        } else {
            format!("{module}.weight")
        };
        let wname = self.name(&wpath);
        let w = self.tensor(&wpath)?;
        let scales = format!("{module}.scales");
        let shape_of = |tail: &[usize]| -> Vec<usize> { lead.iter().chain(tail).copied().collect() };
        if !self.has(&scales) {
            let ft = float_type(w.dtype).ok_or_else(|| {
                bad(
                    &wname,
                    format!(
                        "dtype {:?} without `.scales`: neither a float nor a quantized weight",
                        w.dtype
                    ),
                )
            })?;
            let want = shape_of(&[rows, cols]);
            if w.shape != want {
                return Err(bad(
                    &wname,
                    format!("expected shape {want:?} from config.json, got {:?}", w.shape),
                ));
            }
            return Ok((WeightFormat::Dense(ft), vec![wname]));
        }
        let alt = self.name(module);
        let spec = self
            .config
            .quant
            .spec_for(module, Some(&alt))
            .ok_or_else(|| ModelError::UnsupportedQuant {
                path: module.to_string(),
                message: "config.json says it is not quantized (or has no `quantization` block) but `.scales` exists"
                    .into(),
            })?;
        if spec.mode != QuantMode::Affine {
            return Err(ModelError::UnsupportedQuant {
                path: module.to_string(),
                message: format!("mode {:?} is not implemented yet (affine only)", spec.mode),
            });
        }
        let (bits, group) = (spec.bits, spec.group_size);
        spec.check_widths().map_err(|message| ModelError::UnsupportedQuant {
            path: module.to_string(),
            message,
        })?;
        if !cols.is_multiple_of(group) {
            return Err(bad(
                &wname,
                format!("input dim {cols} is not a multiple of group size {group}"),
            ));
        }
        if w.dtype != Dtype::U32 {
            return Err(bad(&wname, format!("quantized weight must be U32, got {:?}", w.dtype)));
        }
        let want = shape_of(&[rows, cols * bits as usize / 32]);
        if w.shape != want {
            return Err(bad(
                &wname,
                format!(
                    "expected shape {want:?} ({bits}-bit, {rows}×{cols} from config.json), got {:?}",
                    w.shape
                ),
            ));
        }
        let sname = self.name(&scales);
        let s = self.tensor(&scales)?;
        let scale_type =
            float_type(s.dtype).ok_or_else(|| bad(&sname, format!("scales must be float, got {:?}", s.dtype)))?;
        let mut names = vec![wname];
        for part in ["scales", "biases"] {
            let pname = self.name(&format!("{module}.{part}"));
            let p = self.tensor(&format!("{module}.{part}"))?;
            let want = shape_of(&[rows, cols / group]);
            if p.shape != want || p.dtype != s.dtype {
                return Err(bad(
                    &pname,
                    format!(
                        "expected {:?} {want:?} (group {group}), got {:?} {:?}",
                        s.dtype, p.dtype, p.shape
                    ),
                ));
            }
            names.push(pname);
        }
        Ok((
            WeightFormat::Affine {
                bits,
                group,
                scale_type,
            },
            names,
        ))
    }

    /// A resident `[rows, cols]` matrix at module path `module` (e.g. `model.layers.0.self_attn.q_proj`).
    pub fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear> {
        let (format, names) = self.format_of(module, &[], rows, cols)?;
        let parts = names
            .iter()
            .map(|n| Ok(self.ckpt.require(n)?.bytes().clone()))
            .collect::<Result<Vec<_>>>()?;
        // Biases (e.g. `attention_bias: true` configs) are applied when present, never silently dropped.
        let bias_path = format!("{module}.bias");
        let bias = if self.has(&bias_path) {
            Some(self.vector(&bias_path, rows)?)
        } else {
            None
        };
        Ok(Linear {
            format,
            rows,
            cols,
            parts,
            bias,
        })
    }

    /// The stacked experts of the MoE block at `moe` (e.g. `model.layers.3.mlp`), in any layout:
    /// MLX `switch_mlp.{gate,up,down}_proj` (`[num_experts, rows, cols]` each), a fused
    /// `switch_mlp.gate_up_proj` (`[num_experts, 2·inter, hidden]`, gate rows first), or Hugging Face's bare
    /// `experts.gate_up_proj` / `experts.down_proj`. Returns how to read a record and the record layout for
    /// the expert store.
    pub fn stacked_experts(
        &self,
        moe: &str,
        layer: usize,
        num_experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<(ExpertLayout, StackedExperts)> {
        let fused_in = ["switch_mlp", "experts"]
            .into_iter()
            .map(|m| format!("{moe}.{m}"))
            .find(|m| self.has(&format!("{m}.gate_up_proj.weight")) || self.has(&format!("{m}.gate_up_proj")));
        let (projections, fused) = match &fused_in {
            Some(m) => (
                vec![
                    (format!("{m}.gate_up_proj"), 2 * inter, hidden),
                    (format!("{m}.down_proj"), hidden, inter),
                ],
                true,
            ),
            None => (
                vec![
                    (format!("{moe}.switch_mlp.gate_proj"), inter, hidden),
                    (format!("{moe}.switch_mlp.up_proj"), inter, hidden),
                    (format!("{moe}.switch_mlp.down_proj"), hidden, inter),
                ],
                false,
            ),
        };
        let mut tensors = Vec::new();
        let mut formats = Vec::new();
        for (module, rows, cols) in &projections {
            let (f, names) = self.format_of(module, &[num_experts], *rows, *cols)?;
            formats.push(f);
            tensors.extend(names);
        }
        let formats = if fused {
            [formats[0], formats[0], formats[1]]
        } else {
            [formats[0], formats[1], formats[2]]
        };
        Ok((
            ExpertLayout { formats, fused },
            StackedExperts {
                layer,
                num_experts,
                tensors,
            },
        ))
    }
}

/// How one expert record's parts form its gate, up and down matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Storage of the gate, up and down projections.
    pub formats: [WeightFormat; 3],
    /// Gate and up share one `[2·inter, hidden]` matrix (gate rows first), stored as one set of parts.
    pub fused: bool,
}

impl ExpertLayout {
    /// Gate, up and down matrices over one record's parts (no copy: each holds its part's bytes, and so the
    /// record's slot, while it lives).
    pub fn linears(&self, inter: usize, hidden: usize, parts: &[OwnedBytes]) -> Result<[Linear; 3]> {
        let [gate, up, down] = self.split(parts, |p, r| p.slice(r))?;
        let linear = |format, (rows, cols), parts| Linear {
            format,
            rows,
            cols,
            parts,
            bias: None,
        };
        let [(fg, gs), (fu, us), (fd, ds)] = self.matrices(inter, hidden);
        Ok([linear(fg, gs, gate), linear(fu, us, up), linear(fd, ds, down)])
    }

    /// Gate, up and down: each one's format and (rows, cols).
    pub fn matrices(&self, inter: usize, hidden: usize) -> [(WeightFormat, (usize, usize)); 3] {
        let [g, u, d] = self.formats;
        [(g, (inter, hidden)), (u, (inter, hidden)), (d, (hidden, inter))]
    }

    /// Parts in one record (a fused gate/up shares one set).
    pub fn record_parts(&self) -> usize {
        let [pg, pu, pd] = self.formats.map(WeightFormat::parts);
        if self.fused {
            pg + pd
        } else {
            pg + pu + pd
        }
    }

    /// One record's parts grouped into the gate's, the up's and the down's; `slice(p, range)` takes a byte
    /// range of a part (a fused part's first half holds the gate's rows).
    pub fn split<P: Clone + AsRef<[u8]>>(
        &self,
        parts: &[P],
        slice: impl Fn(&P, std::ops::Range<usize>) -> Option<P>,
    ) -> Result<[Vec<P>; 3]> {
        let [pg, pu, _] = self.formats.map(WeightFormat::parts);
        let need = self.record_parts();
        if parts.len() != need {
            return Err(ModelError::InvalidArgument(format!(
                "an expert record has {} parts; its layout needs {need}",
                parts.len()
            )));
        }
        if !self.fused {
            return Ok([
                parts[..pg].to_vec(),
                parts[pg..pg + pu].to_vec(),
                parts[pg + pu..].to_vec(),
            ]);
        }
        // Row-major `[2·inter, ·]` parts: the first half of each part's bytes is the gate's rows.
        let half = |p: &P, first: bool| {
            let (len, mid) = (p.as_ref().len(), p.as_ref().len() / 2);
            slice(p, if first { 0..mid } else { mid..len })
                .ok_or_else(|| ModelError::InvalidArgument("a fused expert part cannot be halved".into()))
        };
        Ok([
            parts[..pg].iter().map(|p| half(p, true)).collect::<Result<Vec<_>>>()?,
            parts[..pg].iter().map(|p| half(p, false)).collect::<Result<Vec<_>>>()?,
            parts[pg..].to_vec(),
        ])
    }
}
