//! What the user chooses about serving: where experts live, how they are read, which backend computes, and
//! the byte sizes users write (`512M`, `4GiB`).

use crate::cpu::kv::KvType;
use crate::model::PrefetchMode;

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

/// How streamed expert records are read from disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IoMode {
    /// The memory plan decides: direct when the slot cache takes most of the room (the page cache would
    /// only duplicate it), buffered when the page cache keeps at least as much room as the slots.
    #[default]
    Auto,
    /// Bypass the OS page cache (O_DIRECT on Linux, F_NOCACHE on macOS).
    Direct,
    /// Through the OS page cache, which becomes a second cache tier.
    Buffered,
}

impl std::str::FromStr for IoMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "direct" => Ok(Self::Direct),
            "buffered" => Ok(Self::Buffered),
            _ => Err(format!("unknown I/O mode `{s}` (auto, direct, buffered)")),
        }
    }
}

/// MoE layers ahead that a layer's prefetch guess reaches by default.
pub const DEFAULT_PREFETCH_AHEAD: usize = 2;

/// Settings for serving experts.
#[derive(Debug, Clone)]
pub struct ExpertOptions {
    /// Resident or streamed.
    pub mode: ExpertMode,
    /// Slot cache budget in bytes when streaming (`None`: the [`MemoryPlan`](crate::memory_plan::MemoryPlan)'s default).
    pub cache_bytes: Option<u64>,
    /// Records read at once (I/O threads).
    pub io_depth: usize,
    /// Guessed (prefetched) reads in flight at once, at most `io_depth` (see
    /// [`expert_store::EngineOptions::guess_depth`]).
    pub guess_depth: usize,
    /// How records are read (the plan resolves `Auto`; see [`crate::MemoryPlan::direct_io`]).
    pub io: IoMode,
    /// Check packed records' checksums on every read.
    pub verify: bool,
    /// Speculative reads of the layers ahead.
    pub prefetch: PrefetchMode,
    /// How many MoE layers ahead each layer's prefetch guess reaches.
    pub prefetch_ahead: usize,
    /// Which implementation computes the forward pass.
    pub backend: BackendKind,
    /// The context limit the KV budget is planned for (`None`: the planner's default).
    pub context: Option<usize>,
    /// Prompt tokens per prefill pass the activation budget is planned for (`None`: the planner's choice).
    pub prefill_chunk: Option<usize>,
    /// Element type of the `cpu` backend's KV caches (the other backends keep f32).
    pub kv_cache: KvType,
    /// The most experts per token a forward will route to (`--top-k`; `None`: the model's own), which the
    /// plan sizes a prefill pass's activations for.
    pub top_k: Option<usize>,
    /// Compute threads (`--threads`; `None`: every core), each of which keeps its own attention scores.
    pub threads: Option<usize>,
    /// Rows of full-vocabulary logits held at once (`eval`: a window's reference, the head's output and its
    /// copy), which
    /// the plan budgets beside the pass; 0 for generation, which keeps one row.
    pub logit_rows: usize,
}

/// Which compute backend runs the model (see [`crate::backend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// sluice's own CPU kernels.
    Cpu,
    /// MLX through mlx-rs: Metal on macOS, MLX's CPU build on Linux (needs the `mlx` cargo feature).
    Mlx,
    /// Naive f64 arithmetic: the oracle the tests check `cpu` against (slow; not for serving).
    Reference,
}

impl BackendKind {
    /// `mlx` on macOS when compiled in, `cpu` elsewhere.
    pub fn default_for_build() -> Self {
        if cfg!(all(feature = "mlx", target_os = "macos")) {
            BackendKind::Mlx
        } else {
            BackendKind::Cpu
        }
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "mlx" => Ok(Self::Mlx),
            "reference" => Ok(Self::Reference),
            _ => Err(format!("unknown backend `{s}` (cpu, mlx, reference)")),
        }
    }
}

impl ExpertOptions {
    /// Element type of the KV caches the chosen backend keeps.
    pub fn kv_type(&self) -> KvType {
        match self.backend {
            BackendKind::Cpu => self.kv_cache,
            BackendKind::Mlx | BackendKind::Reference => KvType::F32,
        }
    }

    /// Bytes per K or V element the chosen backend keeps.
    pub fn kv_element_bytes(&self) -> u64 {
        self.kv_type().size() as u64
    }
}

impl Default for ExpertOptions {
    fn default() -> Self {
        Self {
            mode: ExpertMode::Auto,
            cache_bytes: None,
            io_depth: 8,
            guess_depth: expert_store::DEFAULT_GUESS_DEPTH,
            io: IoMode::Auto,
            verify: true,
            prefetch: PrefetchMode::Auto,
            prefetch_ahead: DEFAULT_PREFETCH_AHEAD,
            backend: BackendKind::default_for_build(),
            context: None,
            prefill_chunk: None,
            kv_cache: KvType::F32,
            top_k: None,
            threads: None,
            logit_rows: 0,
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
    let prefix = unit
        .strip_suffix("ib")
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(&unit);
    let mult: u64 = match (prefix, unit.as_str()) {
        // Bytes alone: no `iB`.
        ("", "" | "b") => 1,
        ("k", _) => 1 << 10,
        ("m", _) => 1 << 20,
        ("g", _) => 1 << 30,
        ("t", _) => 1 << 40,
        _ => {
            return Err(format!(
                "`{s}`: unknown size unit (use K, M, G, T, optionally with B or iB)"
            ))
        }
    };
    let not_a_size = || format!("`{s}` is not a size like 512M, 4GiB or 1048576");
    let bytes = if num.contains('.') {
        // A fraction of a unit (`1.5G`), never of a byte.
        let v: f64 = num.parse().map_err(|_| not_a_size())?;
        let bytes = v * mult as f64;
        if mult == 1 || !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(format!("`{s}` is not a valid size"));
        }
        bytes as u64
    } else {
        // Whole numbers exactly, and too large ones refused rather than saturated.
        let v: u64 = num.parse().map_err(|_| not_a_size())?;
        v.checked_mul(mult)
            .ok_or_else(|| format!("`{s}` is more bytes than there are"))?
    };
    Ok(bytes)
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
        assert_eq!(parse_size("7B"), Ok(7));
        assert_eq!(
            parse_size("9007199254740993"),
            Ok(9_007_199_254_740_993),
            "above 2^53, exactly"
        );
        for bad in [
            "",
            "M",
            "12Q",
            "-1M",
            "1.5",
            "abc",
            "1.5B",
            "1.5iB",
            "4iB",
            "4GiBiB",
            "99999999999T",
            "18446744073709551616",
            "1e3",
            ".",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
