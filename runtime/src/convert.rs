//! `sluice convert`: pack a model directory's experts into a store, streaming one record at a time.

use std::path::Path;

use expert_store::PackedStore;

use crate::cpu::Isa;
use crate::error::{ModelError, Result};

/// How a packed store holds its expert records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StoreLayout {
    /// `tiled` where the cpu backend's tiled int8 kernel runs (x86-64 with AVX2 or AVX-512, not macOS), else
    /// `mlx`.
    #[default]
    Auto,
    /// As the checkpoint holds them (MLX's layout): every backend, kernel and machine reads it.
    Mlx,
    /// In the int8 kernels' tiles, panels as this CPU reads them fastest: no record is rewritten as it loads,
    /// and decode reads tiles too; only the cpu backend's int8 kernels (and the reference backend) read it.
    Tiled,
}

impl std::str::FromStr for StoreLayout {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "mlx" => Ok(Self::Mlx),
            "tiled" => Ok(Self::Tiled),
            _ => Err(format!("unknown store layout `{s}` (auto, mlx, tiled)")),
        }
    }
}

impl StoreLayout {
    /// `Mlx` or `Tiled`: what `Auto` means on this machine.
    pub fn resolve(self) -> Self {
        match self {
            Self::Auto if !cfg!(target_os = "macos") && crate::cpu::q8::tiled_kernel_here(Isa::detect()) => Self::Tiled,
            Self::Auto => Self::Mlx,
            l => l,
        }
    }
}

/// Packs the experts of the model directory `dir` into a store at `out` (see [`expert_store::convert`]),
/// their records in `layout`.
pub fn convert_model(
    dir: &Path,
    out: &Path,
    force: bool,
    layout: StoreLayout,
    progress: &dyn Fn(u64, u64),
) -> Result<PackedStore> {
    if expert_store::is_store(dir) {
        return Err(ModelError::InvalidArgument(format!(
            "{} is already a packed store; convert the original model directory",
            dir.display()
        )));
    }
    // The expert stacks come from the config and the checkpoint's tensor index alone: no model is built and
    // nothing is read before `convert` streams each record from the checkpoint to the store.
    let config = crate::config::ModelConfig::load(dir)?;
    let weights = crate::weights::Weights::open(dir, config)?;
    let arch = crate::models::describe(&weights)?;
    let (layouts, stacks) = arch.expert_layouts(&weights)?;
    if stacks.is_empty() {
        return Err(ModelError::InvalidArgument(format!(
            "{} has no routed experts to pack",
            dir.display()
        )));
    }
    let tiles = match layout.resolve() {
        StoreLayout::Tiled => {
            let isa = Isa::detect();
            if !crate::cpu::q8::tiled_kernel_here(isa) {
                return Err(ModelError::InvalidArgument(format!(
                    "--layout tiled is the int8 kernels' layout on x86-64 with AVX2 or AVX-512; this machine's kernels \
                     ({isa:?}) do not read it: convert with --layout mlx"
                )));
            }
            Some(crate::models::tiled_experts(&arch, &layouts, isa, true))
        }
        _ => None,
    };
    let name = tiles.as_ref().map(|t| t.store_layout_name());
    let rewrite = (tiles.as_ref())
        .zip(name.as_deref())
        .map(|(t, n)| (t as &dyn expert_store::RecordTransform, n));
    Ok(expert_store::convert(
        weights.checkpoint(),
        &stacks,
        out,
        &expert_store::ConvertOptions {
            force,
            progress,
            rewrite,
        },
    )?)
}
