//! `sluice bench`: prefill and decode speed on a diverse token stream, expert I/O, cold and warm, with the
//! machine's own limits (disk random-read bandwidth at the record size and depth, DRAM bandwidth) measured
//! in the same run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use expert_store::{
    optimal_misses, CounterSnapshot, PosixFile, ReadAt, RecordKey, SlotBuf, TracingSource, DIRECT_ALIGN,
};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use sluice_runtime::{DecoderModel, ForwardOptions, Part, Pipeline, PrefetchMode};

use crate::store_cmds::EngineArgs;

/// Arguments of `sluice bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Model directory or packed store.
    #[arg(short = 'm', long, env = "SLUICE_MODEL")]
    model: PathBuf,
    /// Prompt tokens for the prefill test (random ids).
    #[arg(short = 'p', long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Decode steps, each fed a random token id (not the model's own output, which repeats itself and
    /// flatters every cache).
    #[arg(short = 'n', long, default_value_t = 32)]
    gen_tokens: usize,
    /// Feed the tokens of this text file instead of random ids (a replayed, realistic stream).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Experts per token (default: the model's own).
    #[arg(long, env = "SLUICE_TOP_K")]
    top_k: Option<usize>,
    /// Which runs: `cold` (page cache and slot cache dropped first), `warm` (right after another run),
    /// or `both`.
    #[arg(long, default_value = "both")]
    runs: String,
    /// Seed of the random token stream.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds spent on each bandwidth probe (0: skip the probes).
    #[arg(long, default_value_t = 3.0)]
    probe_seconds: f64,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long, env = "SLUICE_THREADS")]
    threads: Option<usize>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// One measured run.
#[derive(Serialize)]
pub(crate) struct RunReport {
    pub(crate) run: String,
    pub(crate) prompt_tokens: usize,
    pub(crate) prefill_tok_s: f64,
    pub(crate) gen_tokens: usize,
    pub(crate) decode_tok_s: f64,
    pub(crate) decode_ms_per_token: f64,
    /// Expert bytes read from disk per decoded token (demand + prefetch).
    pub(crate) read_bytes_per_token: f64,
    pub(crate) hit_rate: f64,
    /// Share of decode time spent waiting for expert reads.
    pub(crate) io_wait_share: f64,
    /// Bytes read / time with at least one read in flight.
    pub(crate) read_gb_s: f64,
    pub(crate) read_p50_ms: f64,
    pub(crate) read_p99_ms: f64,
    pub(crate) effective_queue_depth: f64,
    /// Share of issued prefetch reads that a step then used.
    pub(crate) prefetch_accuracy: f64,
    pub(crate) prefetch_wasted_bytes: u64,
    /// Recent share of the experts guessed for the layers ahead that those layers used (read or not).
    pub(crate) guess_precision: Option<f64>,
    /// Where this run's decode requests sit in the routing trace (when traced).
    #[serde(skip)]
    pub(crate) decode_requests: Option<std::ops::Range<usize>>,
    /// Misses per decoded token an optimal (Belady) cache of the same slots would have on the same trace.
    pub(crate) optimal_misses_per_token: Option<f64>,
    /// Decode speed if the optimal cache's misses were read at the disk probe's speed, overlapped with this
    /// run's compute (step time minus I/O wait): the bound this run is judged against.
    pub(crate) bound_tok_s: Option<f64>,
    /// What sets that bound: `disk` or `compute`.
    pub(crate) bound_limit: Option<String>,
    /// Where prefill time went, as shares of it (as `decode_split`).
    pub(crate) prefill_split: Vec<(String, f64)>,
    /// Where decode time went, as shares of it: each layer part (routed experts without their I/O wait),
    /// `io_wait` (waiting for expert records) and `other` (residual adds, layer norms).
    pub(crate) decode_split: Vec<(String, f64)>,
    pub(crate) decode_counters: Option<CounterSnapshot>,
}

/// Everything `bench` reports.
#[derive(Serialize)]
pub(crate) struct Report {
    pub(crate) model: String,
    pub(crate) mode: String,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    pub(crate) layers: usize,
    pub(crate) record_bytes: u64,
    pub(crate) expert_bytes_per_token: u64,
    pub(crate) cache_slots: Option<usize>,
    pub(crate) io_depth: usize,
    pub(crate) direct_io: bool,
    pub(crate) prefetch: String,
    pub(crate) threads: usize,
    pub(crate) load_seconds: f64,
    pub(crate) disk_probe_gb_s: Option<f64>,
    pub(crate) dram_probe_gb_s: Option<f64>,
    pub(crate) runs: Vec<RunReport>,
}

/// Runs `sluice bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    crate::set_threads(a.threads)?;
    let report = measure_all(&a)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Loads the model and measures what `a` asks for, probes included.
pub(crate) fn measure_all(a: &BenchArgs) -> Result<Report> {
    let (cold, warm) = match a.runs.as_str() {
        "cold" => (true, false),
        "warm" => (false, true),
        "both" => (true, true),
        other => bail!("--runs must be cold, warm or both, not `{other}`"),
    };
    if a.prompt_tokens == 0 || a.gen_tokens == 0 {
        bail!("--prompt-tokens and --gen-tokens must be at least 1");
    }
    let opts = a.engine.options()?;
    let started = Instant::now();
    let mut p = Pipeline::load_with(&a.model, &opts).with_context(|| format!("loading {}", a.model.display()))?;
    let load_seconds = started.elapsed().as_secs_f64();
    // Streaming: log the routing trace, to judge the cache against the optimal one on the same requests.
    let tracer = (p.model.expert_counters().is_some())
        .then(|| p.model.expert_source())
        .flatten()
        .map(|s| Arc::new(TracingSource::new(s)));
    if let Some(t) = &tracer {
        p.model.set_expert_source(t.clone());
    }
    let trace = tracer.as_deref();
    let m = &p.model;
    if a.engine.verbose {
        eprintln!("{}", m.memory_plan);
    }
    let top_k = a.top_k.unwrap_or(m.info.default_top_k);
    let stream = match &a.text {
        Some(f) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            let ids = p.tokenize(&sluice_runtime::Prompt::Raw(text))?;
            if ids.len() < 2 * (a.prompt_tokens + a.gen_tokens) {
                bail!(
                    "{} has {} tokens; bench needs {}",
                    f.display(),
                    ids.len(),
                    2 * (a.prompt_tokens + a.gen_tokens)
                );
            }
            ids
        }
        None => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
            let vocab = m.info.vocab_size as u32;
            (0..2 * (a.prompt_tokens + a.gen_tokens))
                .map(|_| rng.gen_range(0..vocab))
                .collect()
        }
    };
    let (record_bytes, moe_layers) = (m.info.expert_record_bytes, m.info.moe_layers);
    let counters = m.expert_counters();
    let streaming = counters.is_some();
    let mut runs = Vec::new();
    let per_run = a.prompt_tokens + a.gen_tokens;
    if cold {
        if streaming {
            m.drop_expert_caches()?;
        } else if !a.json {
            eprintln!("note: experts are resident (mmap); a cold run only drops the slot cache when streaming");
        }
        runs.push(measure(m, "cold", &stream[..per_run], a.prompt_tokens, top_k, trace)?);
    }
    if warm {
        if !cold {
            // Warm up on the first half, measure on the second.
            measure(m, "warmup", &stream[..per_run], a.prompt_tokens, top_k, trace)?;
        }
        let second = &stream[per_run..2 * per_run];
        runs.push(measure(m, "warm", second, a.prompt_tokens, top_k, trace)?);
    }
    let probe = Duration::from_secs_f64(a.probe_seconds.max(0.0));
    let disk_probe_gb_s = if probe.is_zero() {
        None
    } else {
        Some(disk_probe(&a.model, record_bytes, opts.io_depth, probe)?)
    };
    let dram_probe_gb_s = (!probe.is_zero()).then(|| sluice_runtime::cpu::dram_read_gbps(512 << 20, probe));
    let slots = p.model.expert_slots();
    if let (Some(t), Some(slots), Some(disk)) = (trace, slots, disk_probe_gb_s) {
        let requests = t.requests();
        for r in &mut runs {
            judge_against_optimal(r, &requests, slots, record_bytes, disk);
        }
    }
    let report = Report {
        model: a.model.display().to_string(),
        mode: format!("{:?}", m.memory_plan.placement).to_lowercase(),
        experts: m.info.num_experts,
        top_k,
        layers: m.info.num_layers,
        record_bytes,
        expert_bytes_per_token: record_bytes * (top_k * moe_layers) as u64,
        cache_slots: slots,
        io_depth: opts.io_depth,
        direct_io: m.memory_plan.direct_io,
        prefetch: match m.prefetch() {
            (PrefetchMode::None, _) => "none".to_string(),
            (mode, ahead) => format!("{mode:?}, {ahead} ahead"),
        },
        threads: rayon::current_num_threads(),
        load_seconds,
        disk_probe_gb_s,
        dram_probe_gb_s,
        runs,
    };
    Ok(report)
}

/// Fills in run `r`'s optimal-cache misses and the bound they set: those misses read at `disk_gb_s`,
/// overlapped with the run's own compute (its decode time minus I/O wait).
fn judge_against_optimal(r: &mut RunReport, requests: &[RecordKey], slots: usize, record_bytes: u64, disk_gb_s: f64) {
    let Some(range) = r.decode_requests.clone() else {
        return;
    };
    let gen = r.gen_tokens as f64;
    let misses = optimal_misses(&requests[..range.end], slots, range) as f64 / gen;
    let io = misses * record_bytes as f64 / (disk_gb_s * 1e9);
    let compute = r.decode_ms_per_token / 1e3 * (1.0 - r.io_wait_share);
    r.optimal_misses_per_token = Some(misses);
    r.bound_tok_s = Some(1.0 / io.max(compute));
    r.bound_limit = Some(if io > compute { "disk" } else { "compute" }.into());
}

/// Prefill `tokens[..prompt]` in one pass (chunks of 512), then decode the rest one token at a time.
pub(crate) fn measure(
    m: &DecoderModel,
    name: &str,
    tokens: &[u32],
    prompt: usize,
    top_k: usize,
    trace: Option<&TracingSource>,
) -> Result<RunReport> {
    let opts = ForwardOptions {
        top_k: Some(top_k),
        all_logits: false,
    };
    let counters = m.expert_counters();
    let mut cache = m.new_cache();
    let snap = || counters.as_ref().map(|c| c.snapshot()).unwrap_or_default();
    let (prefill_counters, prefill_parts) = (snap(), m.profile().snapshot());
    let t0 = Instant::now();
    for chunk in tokens[..prompt].chunks(512) {
        m.forward(chunk, &mut cache, &opts)?;
    }
    let prefill = t0.elapsed();
    let prefill_split = time_split(
        m,
        &prefill_parts,
        snap().since(&prefill_counters).io_wait_seconds,
        prefill.as_secs_f64(),
    );
    let before = counters.as_ref().map(|c| c.snapshot());
    let parts_before = m.profile().snapshot();
    let decode_start = trace.map_or(0, TracingSource::len);
    let t1 = Instant::now();
    for &t in &tokens[prompt..] {
        m.forward(&[t], &mut cache, &opts)?;
    }
    let decode = t1.elapsed();
    let gen = tokens.len() - prompt;
    let d = counters.map(|c| c.snapshot().since(&before.unwrap_or_default()));
    let z = CounterSnapshot::default();
    let c = d.as_ref().unwrap_or(&z);
    let secs = decode.as_secs_f64();
    let decode_split = time_split(m, &parts_before, c.io_wait_seconds, secs);
    Ok(RunReport {
        run: name.into(),
        prompt_tokens: prompt,
        prefill_tok_s: prompt as f64 / prefill.as_secs_f64(),
        gen_tokens: gen,
        decode_tok_s: gen as f64 / secs,
        decode_ms_per_token: secs * 1e3 / gen as f64,
        read_bytes_per_token: c.bytes_read() as f64 / gen as f64,
        hit_rate: c.hit_rate(),
        io_wait_share: c.io_wait_seconds / secs,
        read_gb_s: if c.read_active_seconds > 0.0 {
            c.bytes_read() as f64 / c.read_active_seconds / 1e9
        } else {
            0.0
        },
        read_p50_ms: c.read_latency.quantile(0.5) * 1e3,
        read_p99_ms: c.read_latency.quantile(0.99) * 1e3,
        effective_queue_depth: c.effective_queue_depth(),
        prefetch_accuracy: c.prefetch_accuracy(),
        prefetch_wasted_bytes: c.prefetch_wasted_bytes,
        guess_precision: m.guess_precision(),
        decode_requests: trace.map(|t| decode_start..t.len()),
        optimal_misses_per_token: None,
        bound_tok_s: None,
        bound_limit: None,
        prefill_split,
        decode_split,
        decode_counters: d,
    })
}

/// Shares of `secs` per layer part since `before`, with the I/O wait taken out of the routed experts' time
/// and the unaccounted rest as `other`.
fn time_split(m: &DecoderModel, before: &[(Part, f64)], io_wait: f64, secs: f64) -> Vec<(String, f64)> {
    let mut split = Vec::new();
    let mut accounted = 0.0;
    for ((p, after), (_, before)) in m.profile().snapshot().into_iter().zip(before) {
        let t = after - before - if p == Part::RoutedExperts { io_wait } else { 0.0 };
        accounted += t;
        split.push((p.name().to_string(), t / secs));
    }
    split.push(("io_wait".into(), io_wait / secs));
    split.push(("other".into(), (secs - accounted - io_wait).max(0.0) / secs));
    split
}

/// Random reads of `record` bytes at `depth` over the expert data, bypassing the page cache when the
/// filesystem allows O_DIRECT; returns GB/s.
fn disk_probe(path: &Path, record: u64, depth: usize, time: Duration) -> Result<f64> {
    let file = if expert_store::is_store(path) {
        expert_store::PackedStore::open(path)?.data_path()
    } else {
        largest_safetensors(path)?
    };
    disk_probe_file(&file, record, depth, time)
}

/// [`disk_probe`] over one file.
pub(crate) fn disk_probe_file(file: &Path, record: u64, depth: usize, time: Duration) -> Result<f64> {
    let file = file.to_path_buf();
    let len = std::fs::metadata(&file)?.len();
    let size = record.max(DIRECT_ALIGN).next_multiple_of(DIRECT_ALIGN);
    if len < size {
        bail!("{} is smaller than one record", file.display());
    }
    let direct = PosixFile::open(&file, true);
    let f: Box<dyn ReadAt> = match direct {
        Ok(f) => Box::new(f),
        Err(_) => {
            let f = PosixFile::open(&file, false)?;
            f.drop_os_cache()?;
            Box::new(f)
        }
    };
    let slots = (len - size) / DIRECT_ALIGN;
    let bytes = AtomicU64::new(0);
    let deadline = Instant::now() + time;
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for i in 0..depth {
            let (f, bytes) = (&f, &bytes);
            s.spawn(move || {
                // An engine slot: page-aligned, as O_DIRECT needs.
                let Some(mut slot) = SlotBuf::allocate(1, size as usize) else {
                    return;
                };
                let buf = slot[0].as_mut_slice();
                let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed + i as u64);
                while Instant::now() < deadline {
                    let off = rng.gen_range(0..=slots) * DIRECT_ALIGN;
                    match expert_store::read_full(f.as_ref(), &mut buf[..size as usize], off, 0) {
                        Ok(n) => bytes.fetch_add(n as u64, Ordering::Relaxed),
                        Err(_) => break,
                    };
                }
            });
        }
    });
    Ok(bytes.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64() / 1e9)
}

fn largest_safetensors(dir: &Path) -> Result<PathBuf> {
    let mut best: Option<(u64, PathBuf)> = None;
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let len = std::fs::metadata(&p)?.len();
            if best.as_ref().is_none_or(|(l, _)| len > *l) {
                best = Some((len, p));
            }
        }
    }
    best.map(|(_, p)| p)
        .with_context(|| format!("no safetensors in {}", dir.display()))
}

fn print_table(r: &Report) {
    println!(
        "model {} | {} experts top-{} | {} layers | record {:.2} MiB | {:.1} MB of experts per token",
        r.model,
        r.experts,
        r.top_k,
        r.layers,
        r.record_bytes as f64 / 1048576.0,
        r.expert_bytes_per_token as f64 / 1e6
    );
    println!(
        "mode {} | slots {} | io depth {} | direct {} | prefetch {} | threads {} | load {:.1} s",
        r.mode,
        r.cache_slots.map_or("-".into(), |s| s.to_string()),
        r.io_depth,
        r.direct_io,
        r.prefetch,
        r.threads,
        r.load_seconds
    );
    if let Some(d) = r.disk_probe_gb_s {
        println!(
            "disk probe: {d:.2} GB/s random reads of one record at depth {}",
            r.io_depth
        );
    }
    if let Some(d) = r.dram_probe_gb_s {
        println!("DRAM probe: {d:.1} GB/s");
    }
    println!(
        "{:<6} {:>10} {:>10} {:>9} {:>12} {:>7} {:>8} {:>9} {:>8} {:>8} {:>6} {:>9} {:>8}",
        "run",
        "prefill/s",
        "decode/s",
        "ms/tok",
        "MB read/tok",
        "hit %",
        "io wait",
        "read GB/s",
        "p50 ms",
        "p99 ms",
        "depth",
        "pf acc %",
        "guess %"
    );
    for x in &r.runs {
        println!(
            "{:<6} {:>10.2} {:>10.2} {:>9.1} {:>12.1} {:>7.1} {:>7.0}% {:>9.2} {:>8.2} {:>8.2} {:>6.1} {:>9.0} {:>8}",
            x.run,
            x.prefill_tok_s,
            x.decode_tok_s,
            x.decode_ms_per_token,
            x.read_bytes_per_token / 1e6,
            100.0 * x.hit_rate,
            100.0 * x.io_wait_share,
            x.read_gb_s,
            x.read_p50_ms,
            x.read_p99_ms,
            x.effective_queue_depth,
            100.0 * x.prefetch_accuracy,
            x.guess_precision.map_or("-".into(), |p| format!("{:.0}", 100.0 * p))
        );
    }
    for x in &r.runs {
        for (what, split) in [("prefill", &x.prefill_split), ("decode", &x.decode_split)] {
            let parts: Vec<String> = split
                .iter()
                .filter(|(_, share)| *share >= 0.0005)
                .map(|(name, share)| format!("{} {:.1}%", name.replace('_', " "), 100.0 * share))
                .collect();
            println!("{} {what} time: {}", x.run, parts.join(" | "));
        }
    }
    for x in &r.runs {
        if let (Some(b), Some(limit), Some(misses)) = (x.bound_tok_s, &x.bound_limit, x.optimal_misses_per_token) {
            println!(
                "{} bound: {b:.2} tok/s ({limit}: an optimal cache of these slots misses {misses:.1} records per token \
                 on this trace, read at the disk probe, overlapped with this run's compute); achieved {:.0}%",
                x.run,
                100.0 * x.decode_tok_s / b
            );
        }
    }
    if let (Some(disk), Some(w)) = (r.disk_probe_gb_s, r.runs.first()) {
        if w.read_gb_s > 0.0 {
            println!(
                "achieved read bandwidth / disk probe: {:.0}%",
                100.0 * w.read_gb_s / disk
            );
        }
    }
}
