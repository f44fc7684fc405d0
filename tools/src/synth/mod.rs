//! `sluice synth`: random-weight models in the MLX format with the exact tensor shapes of real models, of any
//! size (streamed to disk, never held in memory), with a tokenizer so they can be served and benchmarked.
//!
//! The weights are uniform random 4-bit (or `--bits`) codes with scales and biases chosen so every linear
//! layer has zero-mean weights of a sensible spread: activations stay finite and routing spreads over the
//! experts. The bytes come from a counter-based SplitMix64 stream per tensor (so they depend only on the seed,
//! not on how they are cut into buffers), generated in parallel into a few 16 MiB buffers that a writer thread
//! appends to the file with O_DIRECT on Linux, so generation overlaps the writes and the disk sets the pace.
//! Within each shard the header is padded to 4 KiB and the tensors are ordered so each starts on a boundary
//! as large as its size allows (up to 4 KiB; expert matrices always reach it), as O_DIRECT expert reads like.

//!
//! Parts: `shapes` (the catalogue of real shapes), `plan` (the tensors, sizes and config.json of one), `tokenizer` (a word-piece
//! tokenizer and chat template), `writer` (parallel generation of the bytes and the uncached shard writer).

mod plan;
mod shapes;
mod tokenizer;
mod writer;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use plan::{config, resolve, total_bytes, Tensor};
use shapes::SHAPES;
use tokenizer::{tokenizer_files, EOS_ID};
use writer::{plan_shards, write_shards};

/// Arguments of `sluice synth`.
#[derive(Args)]
pub struct SynthArgs {
    /// Shape to copy: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, bench-7b, qwen3.5-122b-a10b,
    /// qwen3.5-397b-a17b, qwen3-next-80b-a3b.
    #[arg(long)]
    shape: String,
    /// Output model directory.
    #[arg(short = 'o', long)]
    out: PathBuf,
    /// Override the layer count.
    #[arg(long, conflicts_with = "size")]
    layers: Option<usize>,
    /// Override the experts per layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Override the hidden size.
    #[arg(long)]
    hidden: Option<usize>,
    /// Override the expert intermediate size (Mixtral's `intermediate_size`).
    #[arg(long)]
    moe_inter: Option<usize>,
    /// Override the vocabulary size.
    #[arg(long)]
    vocab: Option<usize>,
    /// Override the experts per token.
    #[arg(long)]
    top_k: Option<usize>,
    /// Multiply the layer count by this factor.
    #[arg(long, conflicts_with = "size")]
    scale: Option<f64>,
    /// Pick the layer count so the weights come to about this many bytes (e.g. 32G, 512M, 4GiB).
    #[arg(long, value_parser = sluice_runtime::parse_size)]
    size: Option<u64>,
    /// Bits per weight (2, 3, 4, 5, 6 or 8); router gates are always 8-bit, as mlx-lm writes them.
    #[arg(long, default_value_t = 4, value_parser = parse_bits)]
    bits: usize,
    /// Columns per quantization group (32, 64 or 128).
    #[arg(long, default_value_t = 64, value_parser = parse_group)]
    group_size: usize,
    /// Largest safetensors shard (as mlx-lm's 5 GB default).
    #[arg(long, default_value = "5G", value_parser = sluice_runtime::parse_size)]
    shard_size: u64,
    /// Seed of the random weights (the output depends only on the shape, the seed and the flags).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write into a non-empty directory (replacing the model*.safetensors files there).
    #[arg(long)]
    force: bool,
}

fn parse_bits(s: &str) -> Result<usize, String> {
    match s.parse() {
        Ok(b @ (2 | 3 | 4 | 5 | 6 | 8)) => Ok(b),
        _ => Err(format!("`{s}`: bits must be 2, 3, 4, 5, 6 or 8")),
    }
}

fn parse_group(s: &str) -> Result<usize, String> {
    match s.parse() {
        Ok(g @ (32 | 64 | 128)) => Ok(g),
        _ => Err(format!("`{s}`: the group size must be 32, 64 or 128")),
    }
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// Runs `sluice synth`.
pub fn run(a: SynthArgs) -> Result<()> {
    let vocab = SHAPES
        .iter()
        .find(|(n, _)| *n == a.shape)
        .map(|(_, s)| a.vocab.unwrap_or(s.vocab));
    let (tokenizer, tokenizer_config) = tokenizer_files(vocab.unwrap_or(16).max(16));
    let plan = resolve(&a, (tokenizer.len() + tokenizer_config.len()) as u64)?;
    prepare_dir(&a.out, a.force)?;
    let s = &plan.s;
    let tensors = plan.tensors();
    let total = total_bytes(&tensors);
    let shards = plan_shards(&tensors, a.shard_size);
    let params: u64 = tensors.iter().map(|t| t.params).sum();
    let expert_params: u64 = tensors.iter().filter(|t| t.expert).map(|t| t.params).sum();
    let expert_bytes: u64 = tensors.iter().filter(|t| t.expert).map(Tensor::bytes).sum();
    let active = params - expert_params + expert_params / s.experts as u64 * s.top_k as u64;
    eprintln!(
        "{} ({}): {} layers × {} experts (top-{}), hidden {}, expert intermediate {}, vocab {}, {}-bit g{}",
        a.shape, s.model_type, s.layers, s.experts, s.top_k, s.hidden, s.moe_inter, s.vocab, plan.bits, plan.group
    );
    eprintln!(
        "{:.2} B parameters ({:.2} B active), {} bytes ({}) in {} shard(s); one expert {}, resident {}",
        params as f64 / 1e9,
        active as f64 / 1e9,
        total,
        human(total),
        shards.len(),
        human(expert_bytes / (s.experts * s.layers) as u64),
        human(total - expert_bytes),
    );
    write_file(
        &a.out.join("config.json"),
        &serde_json::to_string_pretty(&config(&plan))?,
    )?;
    write_file(&a.out.join("tokenizer.json"), &tokenizer)?;
    write_file(&a.out.join("tokenizer_config.json"), &tokenizer_config)?;
    write_file(
        &a.out.join("generation_config.json"),
        &serde_json::to_string_pretty(&json!({"eos_token_id": [EOS_ID], "bos_token_id": null}))?,
    )?;
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("writing weights [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let started = Instant::now();
    write_shards(&a.out, &tensors, &shards, a.seed, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    sync_dir(&a.out)?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} in {secs:.1} s ({:.2} GB/s, synced)",
        a.out.display(),
        total as f64 / 1e9 / secs.max(1e-9)
    );
    Ok(())
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Creates `dir`, refusing a non-empty one without `force`; with it, removes old weight files so no stale
/// shard outlives the new index.
fn prepare_dir(dir: &Path, force: bool) -> Result<()> {
    if dir.exists() {
        let entries: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .collect::<std::io::Result<_>>()
            .with_context(|| format!("reading {}", dir.display()))?;
        if !entries.is_empty() && !force {
            bail!(
                "{} exists and is not empty; pass --force to write into it",
                dir.display()
            );
        }
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("model")
                && (name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json"))
            {
                std::fs::remove_file(e.path()).with_context(|| format!("removing {}", e.path().display()))?;
            }
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))
}
