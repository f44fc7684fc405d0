//! `sluice`: serve Mixture-of-Experts models bigger than memory.

#![warn(missing_docs)]

mod bench;
mod doctor;
mod eval;
mod selftest;
mod serve;
mod store_cmds;
mod synth;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use sluice_runtime::{ChatMessage, GenerateParams, GenerationStats, Pipeline, Prompt, SamplingParams};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Serve MoE models bigger than memory by streaming experts from the SSD"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt; the text goes to stdout, a summary line to stderr.
    Generate(GenerateArgs),
    /// Serve the OpenAI-compatible API (chat and text completions, SSE) with Prometheus metrics.
    Serve(serve::ServeArgs),
    /// Pack a model's experts into a store: one aligned, checksummed record per (layer, expert).
    Convert(store_cmds::ConvertArgs),
    /// Summarise a packed store; `--verify` checks every record's checksum.
    Inspect(store_cmds::InspectArgs),
    /// Measure prefill and decode speed, expert I/O and the disk's own limit, cold and warm.
    Bench(bench::BenchArgs),
    /// Write a random-weight model with the exact shapes of a real one (any size, streamed to disk).
    Synth(synth::SynthArgs),
    /// What each --top-k costs in quality (perplexity, KL, top-1 agreement against the model's own k) and
    /// buys in speed (decode tok/s, expert bytes per token) on a text.
    Eval(eval::EvalArgs),
    /// Before a download: does a model (its config.json) fit this machine, its memory plan, and the decode
    /// speed this machine's disk, DRAM and kernel probes forecast at each --top-k.
    Doctor(doctor::DoctorArgs),
    /// Check this machine: the committed mlx-lm goldens on its backend (resident and streamed), then a short
    /// bench with its disk and DRAM probes; prints one report to paste into an issue.
    Selftest(selftest::SelftestArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// Model directory (MLX safetensors: config.json, *.safetensors, tokenizer.json) or packed store.
    #[arg(short = 'm', long, env = "SLUICE_MODEL")]
    model: PathBuf,
    /// Raw prompt text, tokenized as is (no chat template).
    #[arg(short = 'p', long, conflicts_with = "chat", required_unless_present = "chat")]
    prompt: Option<String>,
    /// A user message, wrapped in the model's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// A system message placed before `--chat`.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 256, env = "SLUICE_MAX_TOKENS")]
    max_tokens: usize,
    /// Experts per token (default: the model's `num_experts_per_tok`).
    #[arg(long, env = "SLUICE_TOP_K")]
    top_k: Option<usize>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens with this much probability.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sampling top-k: keep the k most likely tokens (0: off). Not the expert count; that is `--top-k`.
    #[arg(long, default_value_t = 0)]
    sample_top_k: usize,
    /// Drop tokens less likely than min-p × the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalty on recently seen tokens (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// How many recent tokens the repetition penalty looks at (0: all).
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// RNG seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    context: ContextArgs,
    #[command(flatten)]
    prefill: PrefillArgs,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long, env = "SLUICE_THREADS")]
    threads: Option<usize>,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[command(flatten)]
    engine: store_cmds::EngineArgs,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let command = Cli::parse().command;
    // Report commands end quietly when their reader leaves (`| head`); `generate` stops its text itself, and a
    // server must outlive its clients.
    if !matches!(command, Command::Generate(_) | Command::Serve(_)) {
        expert_store::platform::exit_quietly_on_closed_pipe();
    }
    match command {
        Command::Generate(args) => generate(args),
        Command::Serve(args) => serve::run(args),
        Command::Convert(args) => store_cmds::convert(args),
        Command::Inspect(args) => store_cmds::inspect(args),
        Command::Bench(args) => bench::run(args),
        Command::Synth(args) => synth::run(args),
        Command::Selftest(args) => selftest::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Doctor(args) => doctor::run(args),
    }
}

/// The context limit (generate, serve, doctor, bench).
#[derive(clap::Args, Clone, Copy, Debug)]
pub(crate) struct ContextArgs {
    /// Context limit in tokens, prompt and completion together; the KV budget is planned for it (default: the
    /// model's max_position_embeddings, at most 32768).
    #[arg(short = 'c', long, env = "SLUICE_CTX_SIZE", value_parser = parse_ctx_size)]
    pub(crate) ctx_size: Option<usize>,
}

/// A `--probe-seconds` value: finite, from 0 to an hour.
pub(crate) fn parse_probe_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if (0.0..=3600.0).contains(&x) => Ok(x),
        Ok(x) => Err(format!("must be between 0 and 3600 seconds, got {x}")),
        Err(e) => Err(e.to_string()),
    }
}

/// A `--ctx-size` value: a whole number of tokens, at least 1.
/// `b` bytes as GiB with one decimal, as the reports print sizes.
pub(crate) fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

fn parse_ctx_size(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1 token".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// How prompts are cut into prefill passes (generate, bench).
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct PrefillArgs {
    /// Prompt tokens per prefill pass (default: the memory plan's, 512 with resident experts and up to 2048
    /// streamed or mmapped, which then read fewer records per token; results do not depend on it).
    #[arg(short = 'b', long, alias = "batch-size", env = "SLUICE_PREFILL_CHUNK")]
    prefill_chunk: Option<usize>,
}

impl PrefillArgs {
    /// The chunk size asked for, checked (`None`: the memory plan's).
    pub(crate) fn chunk(&self) -> Result<Option<usize>> {
        if self.prefill_chunk == Some(0) {
            bail!("--prefill-chunk must be at least 1");
        }
        Ok(self.prefill_chunk)
    }
}

fn generate(a: GenerateArgs) -> Result<()> {
    let prefill_chunk = a.prefill.chunk()?;
    let _pool = compute_pool(a.threads)?;
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.sample_top_k,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            repeat_last_n: a.repeat_last_n,
            seed: a.seed,
            ..SamplingParams::default()
        },
        stop: a.stop.clone(),
        expert_top_k: a.top_k,
        ignore_eos: a.ignore_eos,
        context_limit: a.context.ctx_size,
        // The plan's pass, which is `-b` when given.
        prefill_chunk: None,
    };
    // Cheap checks before a load that may take minutes.
    params.sampling.validate()?;
    let mut opts = a.engine.options()?;
    opts.context = a.context.ctx_size;
    opts.prefill_chunk = prefill_chunk;
    opts.top_k = a.top_k;
    opts.threads = a.threads;
    let pipeline =
        Pipeline::load_with(&a.model, &opts).with_context(|| format!("loading the model in {}", a.model.display()))?;
    pipeline.model.check_top_k(a.top_k)?;
    if a.engine.verbose {
        note(&pipeline.model.memory_plan);
    }
    let prompt = match (&a.prompt, &a.chat) {
        (Some(p), _) => Prompt::Raw(p.clone()),
        (None, Some(c)) => {
            let mut msgs = Vec::new();
            if let Some(s) = &a.system {
                msgs.push(ChatMessage::new("system", s));
            }
            msgs.push(ChatMessage::new("user", c));
            Prompt::Chat(msgs)
        }
        (None, None) => bail!("give --prompt or --chat"),
    };
    let io_before = pipeline.model.expert_counters().map(|c| c.snapshot());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_failed = None;
    let stats = pipeline.generate(&prompt, &params, |text| {
        if text.is_empty() {
            return true;
        }
        match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
            Ok(()) => true,
            Err(e) => {
                // A closed pipe (e.g. `| head`) ends generation quietly.
                write_failed = Some(e);
                false
            }
        }
    })?;
    if write_failed.is_none() {
        let _ = writeln!(out);
    }
    note(&summary(&stats));
    // The expert I/O line, when this generation had to read experts (streaming).
    if let (Some(c), Some(before)) = (pipeline.model.expert_counters(), io_before) {
        let d = c.snapshot().since(&before);
        if d.misses > 0 {
            note(&d.summary());
        }
    }
    // A closed pipe ended the text on purpose; any other failure to write it (a full disk) is an error.
    match write_failed {
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing the generated text"),
        _ => Ok(()),
    }
}

/// A line on stderr for `generate`, which may have lost its reader: `2>&1 | head` closes stderr with the text,
/// where `eprintln!` would panic.
fn note(line: &dyn std::fmt::Display) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Compute threads per core beyond which a count is refused: more only take turns on the same cores, and a
/// count like 1000003 would spend minutes starting threads.
const MAX_THREADS_PER_CORE: usize = 4;

/// Refuses `--threads 0` (rayon would read it as "all cores") and more threads, from `--threads` or
/// `RAYON_NUM_THREADS`, than [`MAX_THREADS_PER_CORE`] per core.
fn check_threads(threads: Option<usize>) -> Result<()> {
    if threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    let cores = sluice_runtime::threads::machine_cores();
    let n = sluice_runtime::threads::compute_threads(threads);
    if n > MAX_THREADS_PER_CORE * cores {
        let from = if threads.is_some() {
            "--threads"
        } else {
            "RAYON_NUM_THREADS"
        };
        bail!(
            "{from} asks for {n} compute threads on a machine with {cores} cores; at most {} ({MAX_THREADS_PER_CORE} per core)",
            MAX_THREADS_PER_CORE * cores
        );
    }
    Ok(())
}

/// Makes this thread the first of a compute pool of `threads` (`None`: all cores), kept while the command runs.
fn compute_pool(threads: Option<usize>) -> Result<rayon::ThreadPool> {
    check_threads(threads)?;
    sluice_runtime::threads::join_compute_pool(threads).context("setting up the compute threads")
}

fn rate(n: usize, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        n as f64 / t.as_secs_f64()
    }
}

/// One line: prompt tokens and tok/s, generated tokens and tok/s, peak RSS.
fn summary(s: &GenerationStats) -> String {
    format!(
        "prompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | peak RSS: {} | finish: {:?}",
        s.prompt_tokens,
        rate(s.prompt_tokens, s.prefill_time),
        s.generated_tokens,
        rate(s.decode_steps, s.decode_time),
        expert_store::platform::peak_resident_bytes()
            .map_or("unknown".into(), |b| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))),
        s.finish,
    )
}
