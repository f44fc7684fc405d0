//! `sluice convert` and `sluice inspect`: make a packed expert store and look inside one.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use expert_store::PackedStore;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_runtime::cpu::kv::KvType;
use sluice_runtime::{convert_model, BackendKind, ExpertMode, ExpertOptions, IoMode, PrefetchMode, StoreLayout};

/// Flags that choose how experts are served (generate, bench, serve).
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Where experts live: `auto` (resident when they fit beside everything else in available memory, else
    /// streamed), `resident`, `stream` or `mmap` (read in place through the page cache). Setting
    /// --expert-cache implies `stream` under `auto`.
    #[arg(long, default_value = "auto", env = "SLUICE_EXPERTS")]
    pub experts: ExpertMode,
    /// Budget of the expert slot cache when streaming: bytes or a size like 512M, 1MB, 4GiB
    /// (default: all the memory left for experts once resident weights, KV, activations and a margin are
    /// counted; `-v` prints that plan).
    #[arg(long, value_parser = sluice_runtime::parse_size, env = "SLUICE_EXPERT_CACHE")]
    pub expert_cache: Option<u64>,
    /// Expert records read at once (I/O threads); a record read in place from a checkpoint reads its tensors
    /// side by side on twice as many part-read threads.
    #[arg(long, default_value_t = 8, env = "SLUICE_IO_DEPTH")]
    pub io_depth: usize,
    /// Guessed (prefetched) expert reads in flight at once after a decode step's fetch (more than --io-depth
    /// acts as --io-depth): the others wait, where a layer's real routes can still cancel them, and reads a
    /// step waits for share the disk with fewer.
    #[arg(long, default_value_t = expert_store::DEFAULT_GUESS_DEPTH, env = "SLUICE_GUESS_DEPTH")]
    pub guess_depth: usize,
    /// How streamed expert records are read: `auto` (direct when the slot cache takes at least half the
    /// memory left for experts, as the default cache does; through the page cache when a smaller
    /// --expert-cache leaves it more room), `direct` (O_DIRECT on Linux, F_NOCACHE on macOS) or `buffered`.
    #[arg(long, default_value = "auto", env = "SLUICE_IO")]
    pub io: IoMode,
    /// Same as `--io direct`.
    #[arg(long, env = "SLUICE_DIRECT_IO", conflicts_with = "io")]
    pub direct_io: bool,
    /// Skip the checksum check of each packed record read from disk.
    #[arg(long, env = "SLUICE_NO_VERIFY")]
    pub no_verify: bool,
    /// Speculative reads of the layers ahead: `next-layer` (their routers applied to the current residual
    /// stream), `prev-token` (the experts the previous token used there), `none`, or `auto` (next-layer
    /// when experts stream from disk, else none).
    #[arg(long, default_value = "auto", env = "SLUICE_PREFETCH")]
    pub prefetch: PrefetchMode,
    /// How many MoE layers ahead each layer's prefetch guess reaches.
    #[arg(long, default_value_t = sluice_runtime::DEFAULT_PREFETCH_AHEAD, env = "SLUICE_PREFETCH_AHEAD")]
    pub prefetch_ahead: usize,
    /// Matmul kernels: `q8` (activations quantized to int8 per 32 values for integer dot products, as
    /// llama.cpp does; faster; held-out perplexity within 0.5% of exact) or `exact` (f32 activations; matches
    /// mlx-lm to ~1e-5). Where no int8 kernel exists (other than 4/8-bit on x86-64), q8 runs the exact ones.
    #[arg(long, default_value = "q8", env = "SLUICE_KERNELS")]
    pub kernels: Kernels,
    /// Element type of the cpu backend's KV cache: `f16` (half the memory, so twice the context in the same
    /// budget, and half the bytes attention reads per token; held-out perplexity within 0.02% of f32 on the
    /// trained fixture), `f32`, or `auto` (f16 with `--kernels q8`, f32 with `exact`, which then matches mlx-lm
    /// to ~1e-5).
    #[arg(long, default_value = "auto", env = "SLUICE_KV_CACHE")]
    pub kv_cache: KvCacheArg,
    /// Compute backend: `cpu` (sluice's kernels), `mlx` (MLX: Metal on macOS; needs a build with
    /// `--features mlx`) or `reference` (naive f64, the tests' oracle: slow). Default: mlx on macOS when compiled
    /// in, else cpu.
    #[arg(long, env = "SLUICE_BACKEND")]
    pub backend: Option<BackendKind>,
    /// Print the memory plan (every budget, from the machine's memory and these flags) when the model loads.
    #[arg(short = 'v', long, env = "SLUICE_VERBOSE")]
    pub verbose: bool,
}

/// `--kv-cache` choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheArg {
    /// Follow `--kernels`.
    Auto,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

/// Matmul kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kernels {
    /// f32 activations.
    Exact,
    /// int8 activations.
    Q8,
}

impl EngineArgs {
    /// The runtime's options for these flags (and the process-wide kernel choice).
    pub fn options(&self) -> Result<ExpertOptions> {
        sluice_runtime::cpu::q8::set_q8_activations(self.kernels == Kernels::Q8);
        if self.io_depth == 0 || self.io_depth > 256 {
            bail!("--io-depth must be between 1 and 256");
        }
        if self.guess_depth == 0 {
            bail!("--guess-depth must be at least 1");
        }
        let mode = match (self.experts, self.expert_cache) {
            (ExpertMode::Auto, Some(_)) => ExpertMode::Stream,
            (m @ (ExpertMode::Resident | ExpertMode::Mmap), Some(_)) => {
                let m = format!("{m:?}").to_lowercase();
                bail!("--expert-cache sizes the streamed cache; --experts {m} has none (drop one of the two)")
            }
            (m, _) => m,
        };
        let io = if self.direct_io { IoMode::Direct } else { self.io };
        if mode == ExpertMode::Mmap && io == IoMode::Direct {
            bail!("--experts mmap reads through the page cache; direct reads are for streamed or resident experts");
        }
        Ok(ExpertOptions {
            mode,
            cache_bytes: self.expert_cache,
            io_depth: self.io_depth,
            guess_depth: self.guess_depth,
            io,
            verify: !self.no_verify,
            prefetch: self.prefetch,
            prefetch_ahead: self.prefetch_ahead,
            backend: self.backend.unwrap_or_else(BackendKind::default_for_build),
            context: None,
            prefill_chunk: None,
            kv_cache: match (self.kv_cache, self.kernels) {
                (KvCacheArg::F16, _) | (KvCacheArg::Auto, Kernels::Q8) => KvType::F16,
                (KvCacheArg::F32, _) | (KvCacheArg::Auto, Kernels::Exact) => KvType::F32,
            },
            top_k: None,
            threads: None,
            logit_rows: 0,
        })
    }
}

/// Arguments of `sluice convert`.
#[derive(Args)]
pub struct ConvertArgs {
    /// MLX model directory to pack.
    #[arg(short = 'm', long)]
    model: PathBuf,
    /// Store directory to create (config, tokenizer and non-expert weights stay in the model directory).
    #[arg(short = 'o', long)]
    out: PathBuf,
    /// Replace a store that already exists at --out.
    #[arg(long)]
    force: bool,
    /// How records are stored: `tiled` (the int8 kernels' tiles: no record is rewritten as it loads, and decode
    /// reads tiles too, but only `--kernels q8` on x86-64 with AVX2 or AVX-512 reads the store), `mlx` (as the
    /// checkpoint holds them: every backend and machine reads it), or `auto` (`tiled` where that kernel runs,
    /// not on macOS; else `mlx`).
    #[arg(long, default_value = "auto")]
    layout: StoreLayout,
}

/// A byte progress bar on stderr (hidden when stderr is not a terminal).
pub fn byte_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}

/// Runs `sluice convert`.
pub fn convert(a: ConvertArgs) -> Result<()> {
    let bar = byte_bar(0, "packing experts");
    let started = std::time::Instant::now();
    let store = convert_model(&a.model, &a.out, a.force, a.layout, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("converting {} into {}", a.model.display(), a.out.display()))?;
    bar.finish_and_clear();
    let m = store.manifest();
    let records: usize = m.layers.iter().map(|l| l.records.len()).sum();
    eprintln!(
        "wrote {} records ({:.2} GB, {}) to {} in {:.1} s and verified every checksum",
        records,
        m.data_len as f64 / 1e9,
        layouts(m),
        store.data_path().display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// How a store's layers hold their records, e.g. `records stored as tiled-p1 in 48 of 48 layers`.
fn layouts(m: &expert_store::Manifest) -> String {
    let tiled: Vec<&str> = m.layers.iter().filter_map(|l| l.layout.as_deref()).collect();
    match tiled.first() {
        None => "records as the checkpoint holds them".into(),
        Some(name) => format!(
            "records stored as {name} in {} of {} layers",
            tiled.len(),
            m.layers.len()
        ),
    }
}

/// Arguments of `sluice inspect`.
#[derive(Args)]
pub struct InspectArgs {
    /// Store directory.
    store: PathBuf,
    /// Read every record and check its checksum.
    #[arg(long)]
    verify: bool,
}

/// Runs `sluice inspect`.
pub fn inspect(a: InspectArgs) -> Result<()> {
    let store = PackedStore::open(&a.store).with_context(|| format!("opening store {}", a.store.display()))?;
    let m = store.manifest();
    let records: usize = m.layers.iter().map(|l| l.records.len()).sum();
    println!("store:        {} (format version {})", a.store.display(), m.version);
    println!("model:        {}", m.model_dir.display());
    println!("data:         {} ({} bytes)", store.data_path().display(), m.data_len);
    println!(
        "records:      {records} in {} MoE layers, aligned to {} bytes, checksum {}",
        m.layers.len(),
        m.record_align,
        m.checksum
    );
    println!("layout:       {}", layouts(m));
    let mut sizes: Vec<(u64, usize)> = Vec::new();
    for l in &m.layers {
        match sizes.iter_mut().find(|(s, _)| *s == l.record_len) {
            Some((_, n)) => *n += 1,
            None => sizes.push((l.record_len, 1)),
        }
    }
    for (size, layers) in sizes {
        println!(
            "record size:  {size} bytes ({:.2} MiB) in {layers} layers",
            size as f64 / 1048576.0
        );
    }
    if let Some(l) = m.layers.first() {
        let from = if l.layout.is_some() { ", written from" } else { "" };
        println!("parts (layer {}, {} experts{from}):", l.layer, l.records.len());
        for p in &l.parts {
            println!(
                "  {:<60} {:>5} {:?} +{} ({} bytes)",
                p.tensor, p.dtype, p.shape, p.offset, p.len
            );
        }
        if let (Some(name), Some(stored)) = (&l.layout, &l.stored_parts) {
            println!("stored as {name} (gate, up, down):");
            for (off, len) in stored {
                println!("  +{off} ({len} bytes)");
            }
        }
    }
    if a.verify {
        let bar = byte_bar(m.data_len, "verifying");
        let started = std::time::Instant::now();
        let bad = store.verify(&|n| bar.inc(n))?;
        bar.finish_and_clear();
        let secs = started.elapsed().as_secs_f64();
        if !bad.is_empty() {
            for b in &bad {
                eprintln!("corrupt record: {b}");
            }
            bail!("{} of {records} records failed their checksum", bad.len());
        }
        println!(
            "verified:     all {records} checksums match ({:.2} GB in {secs:.1} s, {:.2} GB/s)",
            m.data_len as f64 / 1e9,
            m.data_len as f64 / 1e9 / secs.max(1e-9)
        );
    }
    Ok(())
}
