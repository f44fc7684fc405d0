//! Named weights of a checkpoint, checked against the shapes the config implies.

use std::path::Path;
use std::sync::Arc;

use expert_store::{Checkpoint, Dtype, PackedStore, StackedExperts, TensorInfo};

use crate::config::ModelConfig;
use crate::cpu::FloatType;
use crate::error::{ModelError, Result};
use crate::experts::ExpertOptions;
use crate::linear::{Linear, WeightFormat};
use crate::quant::QuantMode;

/// Prefix VLM-style checkpoints put before the language model's weights.
const VLM_PREFIX: &str = "language_model.";

/// A checkpoint plus the config that says how to read it.
pub struct Weights {
    ckpt: Arc<Checkpoint>,
    config: ModelConfig,
    prefix: &'static str,
    /// How expert records are served.
    pub(crate) expert_opts: ExpertOptions,
    /// The packed store the experts come from, if any.
    pub(crate) store: Option<Arc<PackedStore>>,
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
    /// Opens the safetensors of `dir`, detecting a `language_model.` prefix.
    pub fn open(dir: &Path, config: ModelConfig) -> Result<Self> {
        let ckpt = Arc::new(Checkpoint::open(dir)?);
        let prefix = if ckpt.names().any(|n| n.starts_with(VLM_PREFIX)) {
            VLM_PREFIX
        } else {
            ""
        };
        Ok(Self {
            ckpt,
            config,
            prefix,
            expert_opts: ExpertOptions::default(),
            store: None,
        })
    }

    /// The parsed config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The underlying checkpoint.
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.ckpt
    }

    /// Full tensor name of `path` in this checkpoint.
    pub fn name(&self, path: &str) -> String {
        format!("{}{path}", self.prefix)
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

    /// The storage format of module `module` (its `.weight`, and `.scales`/`.biases` when quantized), checking
    /// every tensor's dtype and shape: `lead` leading dims (e.g. `[num_experts]`), then `[rows, cols]`.
    fn format_of(&self, module: &str, lead: &[usize], rows: usize, cols: usize) -> Result<(WeightFormat, Vec<String>)> {
        let wname = self.name(&format!("{module}.weight"));
        let w = self.tensor(&format!("{module}.weight"))?;
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
        let alt = format!("{}{module}", self.prefix);
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
        if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) || group == 0 || !(group * bits as usize).is_multiple_of(32) {
            return Err(ModelError::UnsupportedQuant {
                path: module.to_string(),
                message: format!("{bits}-bit codes in groups of {group} are not supported"),
            });
        }
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

    /// Stacked experts under `module` (`gate_proj`, `up_proj`, `down_proj` of `[num_experts, rows, cols]`):
    /// the format of each projection and the record layout for the expert store.
    pub fn stacked_experts(
        &self,
        module: &str,
        layer: usize,
        num_experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<([WeightFormat; 3], StackedExperts)> {
        let mut tensors = Vec::new();
        let mut formats = [WeightFormat::Dense(FloatType::F32); 3];
        for (i, (proj, rows, cols)) in [
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        ]
        .iter()
        .enumerate()
        {
            let (f, names) = self.format_of(&format!("{module}.{proj}"), &[num_experts], *rows, *cols)?;
            formats[i] = f;
            tensors.extend(names);
        }
        Ok((
            formats,
            StackedExperts {
                layer,
                num_experts,
                tensors,
            },
        ))
    }
}
