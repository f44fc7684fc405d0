//! How expert records reach the model: viewed in place (mmap) or streamed through the expert store's
//! engine from a packed store or from the original safetensors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use expert_store::{
    Checkpoint, EngineOptions, ExpertSource, InMemoryExpertSource, MmapExpertSource, PackedStore, RecordTable,
    StackedExperts, StreamingSource,
};

use crate::error::{ModelError, Result};
use crate::layers::PrefetchMode;
use crate::memory_plan::{ExpertPlacement, MachineMemory, MemoryPlan, ModelFootprint, PlanRequest};

/// Where expert weights live while serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExpertMode {
    /// Resident when the experts fit comfortably in available memory, streamed otherwise.
    #[default]
    Auto,
    /// Every record read once at load into slots (huge-page backed where possible).
    Resident,
    /// Read on demand into the budgeted slot cache.
    Stream,
    /// Viewed in place through an mmap of the safetensors (model directories only; no copy, but the OS
    /// decides residency and 4 KiB pages slow the kernels).
    Mmap,
}

impl std::str::FromStr for ExpertMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "resident" => Ok(Self::Resident),
            "stream" => Ok(Self::Stream),
            "mmap" => Ok(Self::Mmap),
            _ => Err(format!("unknown expert mode `{s}` (auto, resident, stream, mmap)")),
        }
    }
}

/// Settings for serving experts.
#[derive(Debug, Clone)]
pub struct ExpertOptions {
    /// Resident or streamed.
    pub mode: ExpertMode,
    /// Slot cache budget in bytes when streaming (`None`: the [`MemoryPlan`]'s default).
    pub cache_bytes: Option<u64>,
    /// Reads in flight at once.
    pub io_depth: usize,
    /// Bypass the page cache (O_DIRECT / F_NOCACHE).
    pub direct_io: bool,
    /// Check packed records' checksums on every read.
    pub verify: bool,
    /// Speculative reads during decode.
    pub prefetch: PrefetchMode,
    /// Which implementation computes the forward pass.
    pub backend: Backend,
    /// The context limit the KV budget is planned for (`None`: the planner's default).
    pub context: Option<usize>,
}

/// The compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// sluice's own CPU kernels.
    Cpu,
    /// MLX through mlx-rs: Metal on macOS, MLX's CPU build on Linux (needs the `mlx` cargo feature).
    Mlx,
}

impl Backend {
    /// `mlx` on macOS when compiled in, `cpu` elsewhere.
    pub fn default_for_build() -> Self {
        if cfg!(all(feature = "mlx", target_os = "macos")) {
            Backend::Mlx
        } else {
            Backend::Cpu
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "mlx" => Ok(Self::Mlx),
            _ => Err(format!("unknown backend `{s}` (cpu, mlx)")),
        }
    }
}

impl Default for ExpertOptions {
    fn default() -> Self {
        Self {
            mode: ExpertMode::Auto,
            cache_bytes: None,
            io_depth: 8,
            direct_io: false,
            verify: true,
            prefetch: PrefetchMode::None,
            backend: Backend::default_for_build(),
            context: None,
        }
    }
}

/// Parses a byte size: `4096`, `512K`, `512M`, `1MB`, `4GiB`, `1.5G` (powers of 1024 for K/M/G/T with or
/// without `B`/`iB`).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => {
            return Err(format!(
                "`{s}`: unknown size unit (use K, M, G, T, optionally with B or iB)"
            ))
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 512M, 4GiB or 1048576"))?;
    if !v.is_finite() || v < 0.0 || (unit.is_empty() && num.contains('.')) {
        return Err(format!("`{s}` is not a valid size"));
    }
    Ok((v * mult as f64) as u64)
}

/// What `--model` pointed at.
pub(crate) enum ModelLocation {
    /// An MLX model directory.
    Dir(PathBuf),
    /// A packed store and the model directory it references.
    Store(Arc<PackedStore>, PathBuf),
}

impl ModelLocation {
    /// Detects a store (by its manifest) or a model directory.
    pub fn resolve(path: &Path) -> Result<Self> {
        if expert_store::is_store(path) {
            let store = PackedStore::open(path)?;
            let dir = store.model_dir();
            if !dir.join("config.json").is_file() {
                return Err(ModelError::Store(expert_store::StoreError::BadStore {
                    path: path.join(expert_store::MANIFEST_FILE),
                    message: format!(
                        "references model directory {} which has no config.json (moved or deleted?)",
                        dir.display()
                    ),
                }));
            }
            Ok(Self::Store(Arc::new(store), dir))
        } else {
            Ok(Self::Dir(path.to_path_buf()))
        }
    }

    /// The directory with config, tokenizer and non-expert weights.
    pub fn model_dir(&self) -> &Path {
        match self {
            Self::Dir(d) | Self::Store(_, d) => d,
        }
    }
}

/// Builds the expert source for `stacks` per `opts`, with the memory plan that sized it. `footprint` holds
/// the model's KV and state sizes; its weight sizes are filled in here from the checkpoint.
pub(crate) fn open_source(
    ckpt: &Arc<Checkpoint>,
    stacks: &[StackedExperts],
    store: Option<&PackedStore>,
    opts: &ExpertOptions,
    mut footprint: ModelFootprint,
) -> Result<(Arc<dyn ExpertSource>, MemoryPlan)> {
    let stacked: u64 = stacks
        .iter()
        .flat_map(|s| &s.tensors)
        .filter_map(|n| ckpt.get(n))
        .map(|t| t.bytes().len() as u64)
        .sum();
    footprint.resident_weights = (ckpt.total_bytes() as u64).saturating_sub(stacked);
    footprint.expert_bytes = stacked;
    let plan_for = |footprint| {
        MemoryPlan::new(
            MachineMemory::probe(),
            footprint,
            &PlanRequest {
                mode: opts.mode,
                cache_bytes: opts.cache_bytes,
                context: opts.context,
                gpu_buffers: opts.backend == Backend::Mlx && cfg!(target_os = "macos"),
            },
        )
    };
    if stacks.is_empty() {
        return Ok((Arc::new(InMemoryExpertSource::new()), plan_for(footprint)));
    }
    let table = match store {
        Some(s) => {
            if opts.mode == ExpertMode::Mmap {
                return Err(ModelError::InvalidArgument(
                    "--experts mmap views a model directory in place; a packed store is read with pread".into(),
                ));
            }
            s.check_against(ckpt, stacks)?;
            s.table(opts.direct_io)?
        }
        None if opts.mode == ExpertMode::Mmap => {
            return Ok((Arc::new(MmapExpertSource::new(ckpt, stacks)?), plan_for(footprint)))
        }
        None => RecordTable::in_place(ckpt, stacks, opts.direct_io)?,
    };
    // What the reads cost (packed records are padded): the bytes the slots must hold.
    footprint.expert_bytes = table.total_read_bytes();
    let plan = plan_for(footprint);
    let preload = plan.placement == ExpertPlacement::Resident;
    let cache_bytes = if preload {
        table.len() as u64 * (table.max_slot_len().next_multiple_of(expert_store::SLOT_ALIGN) as u64)
    } else {
        plan.expert_cache
    };
    let engine = StreamingSource::new(
        table,
        &EngineOptions {
            cache_bytes,
            io_depth: opts.io_depth,
            verify: opts.verify,
        },
    )?;
    let (slots, slot_len) = engine.slots();
    tracing::info!(
        slots,
        slot_len,
        cache_bytes = slots * slot_len,
        io_depth = opts.io_depth,
        "streaming experts"
    );
    if preload {
        engine.preload()?;
    }
    Ok((Arc::new(engine), plan))
}

/// Packs the experts of the model directory `dir` into a store at `out` (see [`expert_store::convert`]).
pub fn convert_model(dir: &Path, out: &Path, force: bool, progress: &dyn Fn(u64, u64)) -> Result<PackedStore> {
    if expert_store::is_store(dir) {
        return Err(ModelError::InvalidArgument(format!(
            "{} is already a packed store; convert the original model directory",
            dir.display()
        )));
    }
    let config = crate::config::ModelConfig::load(dir)?;
    let opts = ExpertOptions {
        mode: ExpertMode::Resident,
        backend: Backend::Cpu,
        ..ExpertOptions::default()
    };
    let model = crate::models::load_model_with(dir, config, &opts)?;
    if model.expert_stacks.is_empty() {
        return Err(ModelError::InvalidArgument(format!(
            "{} has no routed experts to pack",
            dir.display()
        )));
    }
    let ckpt = Checkpoint::open(dir)?;
    Ok(expert_store::convert(
        &ckpt,
        &model.expert_stacks,
        out,
        &expert_store::ConvertOptions { force, progress },
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_users_write_them() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1MB"), Ok(1 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size(" 2 K "), Ok(2048));
        for bad in ["", "M", "12Q", "-1M", "1.5", "abc"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
