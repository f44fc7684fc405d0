//! `sluice bench`: prefill and decode speed on a diverse token stream, expert I/O, cold and warm, with the
//! machine's own limits (disk random-read bandwidth at the record size and depth, DRAM bandwidth) measured
//! in the same run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use expert_store::{
    lru_misses, optimal_misses, piece_len, CounterSnapshot, ExpertFetch, ExpertRecord, ExpertSource, PosixFile, ReadAt,
    RecordKey, SlotBuf, StoreCounters, StoreError, TracingSource, DIRECT_ALIGN,
};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use sluice_runtime::config::ModelConfig;
use sluice_runtime::forecast::size_from_config;
use sluice_runtime::memory_plan::ExpertPlacement;
use sluice_runtime::{DecoderModel, ExpertOptions, ForwardOptions, Part, Pipeline, PrefetchMode};

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
    #[command(flatten)]
    prefill: crate::PrefillArgs,
    #[command(flatten)]
    context: crate::ContextArgs,
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
    /// Seconds spent on each bandwidth probe; the disk's then reads at its fastest depth for as long again, and
    /// re-reads those offsets for as long after the runs (0: skip the probes).
    #[arg(long, default_value_t = 3.0, value_parser = crate::parse_probe_seconds)]
    probe_seconds: f64,
    /// Write the routing trace (experts in the expert cache, not mmap) to this file: one `layer expert` line
    /// per distinct record each layer step asked for, in order, and a `# run phase` line (`# warm decode`)
    /// where each run's prefill and decode begin.
    #[arg(long)]
    trace_out: Option<PathBuf>,
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
    /// CPU the I/O threads used loading records during decode, in cores (CPU seconds ÷ decode seconds).
    pub(crate) read_cpu_cores: f64,
    /// CPU the I/O threads used per record read during decode, milliseconds.
    pub(crate) read_cpu_ms_per_record: f64,
    /// CPU the background pass used backing slots during decode, in cores.
    pub(crate) prefault_cpu_cores: f64,
    pub(crate) prefetch_wasted_bytes: u64,
    /// Recent share of the experts guessed for the layers ahead that those layers used (read or not).
    pub(crate) guess_precision: Option<f64>,
    /// The same per distance (`[d]`: d layers ahead; `[0]`: the next layer guessed again once the experts at hand
    /// are computed) and rank (`[d][0]`: the router's first choice).
    pub(crate) guess_precision_by_rank: Vec<Vec<Option<f64>>>,
    /// Expert bytes read from disk per prompt token during prefill.
    pub(crate) prefill_read_bytes_per_token: f64,
    pub(crate) prefill_hit_rate: f64,
    /// CPU the I/O threads used loading records during prefill (reads, and rewrites into the kernels'
    /// tiles), in cores.
    pub(crate) prefill_read_cpu_cores: f64,
    /// The same per record read during prefill, milliseconds.
    pub(crate) prefill_read_cpu_ms_per_record: f64,
    /// Share of prefill time spent waiting for expert reads.
    pub(crate) prefill_io_wait_share: f64,
    /// Where this run's prefill and decode requests sit in the routing trace (when traced).
    #[serde(skip)]
    pub(crate) trace_ranges: Option<[std::ops::Range<usize>; 2]>,
    /// The optimal cache's bound on prefill (when traced and probed).
    pub(crate) prefill_bound: Option<Bound>,
    /// The optimal cache's bound on decode (when traced and probed).
    pub(crate) decode_bound: Option<Bound>,
    /// Where prefill time went, as shares of it (as `decode_split`).
    pub(crate) prefill_split: Vec<(String, f64)>,
    /// Where decode time went, as shares of it: each layer part (routed experts without their I/O wait),
    /// `io_wait` (waiting for expert records) and `other` (residual adds, layer norms).
    pub(crate) decode_split: Vec<(String, f64)>,
    pub(crate) decode_counters: Option<CounterSnapshot>,
    /// Disk probes at fresh offsets right before and right after this run, GB/s (streamed runs, when the
    /// probe file bypasses the page cache): its bounds read misses at the faster of the two.
    pub(crate) disk_probes_gb_s: Option<[f64; 2]>,
}

impl RunReport {
    /// The disk bandwidth this run's bounds use: the faster of its own probes (the disk showed it could; the
    /// mean would credit a run for a slow spell it may not have met), else `fallback`.
    fn disk_gb_s(&self, fallback: f64) -> f64 {
        faster_probe(self.disk_probes_gb_s, fallback)
    }
}

/// The faster of a run's two disk probes, else `fallback`.
fn faster_probe(probes: Option<[f64; 2]>, fallback: f64) -> f64 {
    probes.map_or(fallback, |[before, after]| before.max(after))
}

/// What an optimal cache allows one phase (prefill or decode) of a run: the bound it is judged against.
#[derive(Serialize)]
pub(crate) struct Bound {
    /// Misses per token an optimal (Belady) cache of the same slots would have on the same trace, entering the
    /// phase holding the best of the records asked for before it.
    pub(crate) optimal_misses_per_token: f64,
    /// Tokens/s if those misses were read at the disk probe, overlapped with the in-RAM compute of the same
    /// shape.
    pub(crate) tok_s: f64,
    /// What sets the bound: `disk` or `compute`.
    pub(crate) limit: String,
    /// Speed achieved / `tok_s`.
    pub(crate) achieved: f64,
    /// Misses per token a least-recently-used cache of the same slots would have on the same trace.
    pub(crate) lru_misses_per_token: f64,
    /// The same bound with those misses: what a plain online cache allows.
    pub(crate) lru_tok_s: f64,
    /// Speed achieved / `lru_tok_s`.
    pub(crate) lru_achieved: f64,
    /// Reads went through the page cache, which served misses of the slots beyond their budget: the bounds
    /// give the optimal cache only the slots, so `achieved` may overstate (direct reads make them comparable).
    pub(crate) page_cache_beyond_slots: bool,
}

/// Everything `bench` reports.
#[derive(Serialize)]
pub(crate) struct Report {
    pub(crate) model: String,
    pub(crate) mode: String,
    /// Whether experts come from a packed store (one read per record), not the checkpoint's stacked tensors.
    pub(crate) packed_store: bool,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    pub(crate) layers: usize,
    pub(crate) record_bytes: u64,
    pub(crate) expert_bytes_per_token: u64,
    pub(crate) cache_slots: Option<usize>,
    pub(crate) io_depth: usize,
    /// Of those reads, how many may be guesses.
    pub(crate) guess_depth: usize,
    pub(crate) prefill_chunk: usize,
    pub(crate) direct_io: bool,
    /// Expert records rewritten into the int8 kernels' tiles as they load.
    pub(crate) tiled_experts: bool,
    pub(crate) prefetch: String,
    /// Element type of the KV cache (`f16` or `f32`).
    pub(crate) kv_cache: String,
    pub(crate) threads: usize,
    pub(crate) load_seconds: f64,
    /// Seconds the runs then waited for the expert slots to be backed with memory (`None`: no slots).
    pub(crate) slots_backed_seconds: Option<f64>,
    /// Share of the expert slots on huge pages once backed (`None`: no slots, or the OS does not say); direct
    /// reads into 4 KiB pages ran at half the speed or less on some machines.
    pub(crate) slots_on_huge_pages: Option<f64>,
    /// Random reads of one record at fresh offsets, at the best depth, after the runs, GB/s: the disk limit the
    /// bounds use where a run has no probes of its own.
    pub(crate) disk_probe_gb_s: Option<f64>,
    /// The same offsets read again right after, GB/s (faster: a cache below the OS served them).
    pub(crate) disk_reread_gb_s: Option<f64>,
    /// The probe's fastest short window while it searched for the best depth, GB/s: shown beside
    /// `disk_probe_gb_s`, never a bound ([`DiskProbe::window`]).
    pub(crate) disk_probe_window_gb_s: Option<f64>,
    /// The depth at which the probe read fastest (the one `disk_probe_gb_s` gives).
    pub(crate) disk_probe_depth: Option<usize>,
    /// Reads each record was cut into at that best (1: whole records; else the engine's pieces, `piece_len`).
    pub(crate) disk_probe_pieces: Option<usize>,
    /// The faster of the two patterns below: the machine's DRAM limit.
    pub(crate) dram_probe_gb_s: Option<f64>,
    /// DRAM probe, one sequential stream per thread.
    pub(crate) dram_one_stream_gb_s: Option<f64>,
    /// DRAM probe, four streams per thread in lockstep.
    pub(crate) dram_four_streams_gb_s: Option<f64>,
    /// Weight bytes one decode step reads: every resident matrix once (one embedding row), sized from
    /// `config.json` as `doctor` does, and `top_k` of this store's expert records per MoE layer.
    pub(crate) weight_bytes_per_token: Option<u64>,
    /// First touch of fresh anonymous memory (a cache slot filled for the first time pays it), GB/s.
    pub(crate) fresh_memory_gb_s: Option<f64>,
    /// The last run's prompt and tokens again with every record already in RAM (see [`TwinSource`]):
    /// the in-RAM compute of the same shape, which the bounds overlap with the disk.
    pub(crate) in_ram: Option<InRam>,
    pub(crate) runs: Vec<RunReport>,
}

/// The in-RAM compute pass.
#[derive(Serialize)]
pub(crate) struct InRam {
    pub(crate) prefill_tok_s: f64,
    pub(crate) decode_tok_s: f64,
    /// Records per layer kept in RAM and served for every expert asked.
    pub(crate) twins_per_layer: usize,
}

/// Serves each layer's requests from its first `twins` records, so after the first step every record is
/// a cache hit: the same computation (a request's distinct experts map to distinct records while there are
/// enough) with no reads, i.e. the in-RAM compute time of the same shape.
struct TwinSource {
    inner: Arc<dyn ExpertSource>,
    twins: usize,
}

impl TwinSource {
    /// The i-th distinct expert of `experts` becomes record i (mod `twins`).
    fn map(&self, experts: &[usize]) -> Vec<usize> {
        let mut order: Vec<usize> = Vec::with_capacity(experts.len());
        (experts.iter())
            .map(|e| {
                let i = order.iter().position(|x| x == e).unwrap_or_else(|| {
                    order.push(*e);
                    order.len() - 1
                });
                i % self.twins
            })
            .collect()
    }
}

impl ExpertSource for TwinSource {
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError> {
        self.inner.read_expert(layer, expert % self.twins)
    }

    fn fetch_layer_rewriting<'a>(
        &'a self,
        layer: usize,
        experts: &[usize],
        rewrite: bool,
    ) -> Result<Box<dyn ExpertFetch + 'a>, StoreError> {
        self.inner.fetch_layer_rewriting(layer, &self.map(experts), rewrite)
    }

    fn counters(&self) -> Option<Arc<StoreCounters>> {
        self.inner.counters()
    }

    fn slots(&self) -> Option<usize> {
        self.inner.slots()
    }

    fn slot_len(&self) -> Option<usize> {
        self.inner.slot_len()
    }
}

/// Runs `sluice bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    let _pool = crate::compute_pool(a.threads)?;
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
    let mut opts = a.engine.options()?;
    opts.prefill_chunk = a.prefill.chunk()?;
    opts.top_k = a.top_k;
    opts.threads = a.threads;
    opts.context = a.context.ctx_size;
    let started = Instant::now();
    let mut p = Pipeline::load_with(&a.model, &opts).with_context(|| format!("loading {}", a.model.display()))?;
    p.model.check_top_k(a.top_k)?;
    let load_seconds = started.elapsed().as_secs_f64();
    // The pass asked for or the plan's own, as the plan budgets it.
    let chunk = p.model.memory_plan.prefill_chunk;
    // Streaming: log the routing trace, to judge the cache against the optimal one on the same requests.
    let engine_source = (p.model.expert_counters().is_some())
        .then(|| p.model.expert_source())
        .flatten();
    let tracer = engine_source.clone().map(|s| Arc::new(TracingSource::new(s)));
    if let Some(t) = &tracer {
        p.model.set_expert_source(t.clone());
    }
    let trace = tracer.as_deref();
    // The engine backs its slots with memory in the background from load on. The runs wait for it, so that
    // they time reads and compute rather than the OS handing the process its memory, a one-time cost at start
    // (slow on VMs whose host takes freed memory back: `docs/performance-log.md`, "Why cold runs vary").
    let slots_backed_seconds = engine_source.as_ref().map(|s| {
        let backing = Instant::now();
        s.wait_backed();
        backing.elapsed().as_secs_f64()
    });
    let slots_on_huge_pages = (engine_source.as_ref())
        .and_then(|s| s.slots_on_huge_pages())
        .map(|(huge, all)| huge as f64 / all.max(1) as f64);
    let m = &p.model;
    if a.engine.verbose {
        eprintln!("{}", m.memory_plan);
    }
    let top_k = a.top_k.unwrap_or(m.info.default_top_k);
    // Each run's prompt and generation must fit the context (checked before any token stream is built).
    let limit = m.context_limit();
    match a.prompt_tokens.checked_add(a.gen_tokens) {
        Some(n) if n <= limit => {}
        _ => bail!(
            "-p {} + -n {} tokens exceed the context limit of {limit} tokens (--ctx-size)",
            a.prompt_tokens,
            a.gen_tokens
        ),
    }
    // A warm run is fed the stream's second run of tokens, after a cold run or a warm-up on the first.
    let fed = (a.prompt_tokens + a.gen_tokens) * if warm { 2 } else { 1 };
    let stream = match &a.text {
        Some(f) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            let ids = p.tokenize(&sluice_runtime::Prompt::Raw(text))?;
            if ids.len() < fed {
                bail!("{} has {} tokens; bench needs {fed}", f.display(), ids.len());
            }
            ids
        }
        None => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
            let vocab = m.info.vocab_size as u32;
            (0..fed).map(|_| rng.gen_range(0..vocab)).collect()
        }
    };
    let (record_bytes, moe_layers) = (m.info.expert_record_bytes, m.info.moe_layers);
    // What `top_k` experts of every layer read: each layer's own record size (mixed-precision layers differ).
    let expert_bytes_per_token = top_k as u64 * m.info.expert_record_bytes_by_layer.iter().sum::<u64>();
    let counters = m.expert_counters();
    let streaming = counters.is_some();
    let probe = Duration::from_secs_f64(a.probe_seconds.max(0.0));
    let probe_file = (!probe.is_zero()).then(|| disk_probe_target(&a.model)).transpose()?;
    // Probes right before and after each streamed run: the disk's speed drifts within a minute on shared
    // machines (1.5 to 2.8 GB/s between runs here), so one probe after every run misjudged the runs before it.
    // Only where the probe bypasses the page cache: a buffered probe drops the file's cache, a warm run's.
    let adjacent = (probe_file.as_deref()).filter(|f| streaming && PosixFile::open(f, true).is_ok());
    let adjacent_probe = || -> Result<Option<f64>> {
        adjacent
            .map(|f| Ok(disk_probe_best(f, record_bytes, opts.io_depth, probe, false)?.fresh))
            .transpose()
    };
    let per_run = a.prompt_tokens + a.gen_tokens;
    let first_half = |name| measure(m, name, &stream[..per_run], a.prompt_tokens, chunk, top_k, trace);
    let mut runs = Vec::new();
    // A warm run's warm-up, when no cold run came first (its part of the trace is marked too).
    let mut warmup = None;
    // The disk probes between runs: before the first, between each two, and (below) after the last.
    let mut probes = Vec::new();
    if cold {
        if streaming {
            m.drop_expert_caches()?;
        } else if !a.json {
            eprintln!("note: experts are resident (mmap); a cold run only drops the slot cache when streaming");
        }
        probes.push(adjacent_probe()?);
        runs.push(first_half("cold")?);
    }
    if warm {
        if !cold {
            // Warm up on the first half, measure on the second.
            warmup = Some(first_half("warmup")?);
        }
        let second = &stream[per_run..2 * per_run];
        probes.push(adjacent_probe()?);
        runs.push(measure(m, "warm", second, a.prompt_tokens, chunk, top_k, trace)?);
    }
    let disk = (probe_file.as_deref())
        .map(|f| disk_probe_best(f, record_bytes, opts.io_depth, probe, true))
        .transpose()?;
    let disk_probe_gb_s = disk.map(|d| d.fresh);
    // A run's probe after is the next run's before; the last run's is the probe just taken.
    probes.push(disk_probe_gb_s.filter(|_| adjacent.is_some()));
    for (r, pair) in runs.iter_mut().zip(probes.windows(2)) {
        r.disk_probes_gb_s = pair[0].zip(pair[1]).map(|(before, after)| [before, after]);
    }
    let dram = (!probe.is_zero()).then(|| sluice_runtime::cpu::dram_read_probe(512 << 20, probe));
    let fresh_memory_gb_s = (!probe.is_zero()).then(fresh_memory_probe).flatten();
    let slots = p.model.expert_slots();
    // The bounds need the in-RAM compute of the same shape: the last run's tokens again, served by twins.
    let last = if warm { per_run..2 * per_run } else { 0..per_run };
    let in_ram = match (&engine_source, slots, disk_probe_gb_s) {
        (Some(engine), Some(slots), Some(_)) => {
            // As many twins as the cache holds (up to every expert): a prompt's chunk then reads as many
            // distinct records from RAM as the real run does (with 16, a 512-token chunk's ~all experts
            // folded onto 40 MB of records per layer, which L3 served, and the prefill bound was too fast).
            let twins = (slots / moe_layers.max(1)).min(m.info.num_experts);
            if twins < top_k {
                None
            } else {
                p.model.set_expert_source(Arc::new(TwinSource {
                    inner: engine.clone(),
                    twins,
                }));
                let tokens = &stream[last];
                // Loads the twins: a prompt of up to 512 tokens routes to more distinct experts than the cache
                // holds of a layer, or to as many as the run's own prompt did.
                let warmup = tokens.len().min(512);
                measure(&p.model, "twins", &tokens[..warmup], warmup - 1, chunk, top_k, None)?;
                // No step from here waits on the disk: it runs as a resident model does, threads awake.
                let awake = p.model.awake_steps();
                p.model.set_awake_steps(true);
                let r = measure(&p.model, "in-ram", tokens, a.prompt_tokens, chunk, top_k, None);
                p.model.set_awake_steps(awake);
                let r = r?;
                if let Some(t) = &tracer {
                    p.model.set_expert_source(t.clone());
                }
                Some(InRam {
                    prefill_tok_s: r.prefill_tok_s,
                    decode_tok_s: r.decode_tok_s,
                    twins_per_layer: twins,
                })
            }
        }
        _ => None,
    };
    let m = &p.model;
    // The trace, copied out of its log once for the file and the bounds.
    let requests = trace.map(TracingSource::requests);
    if let Some(path) = &a.trace_out {
        let requests = requests.as_deref().context(
            "--trace-out needs experts served by the expert cache (resident or streamed), not --experts mmap",
        )?;
        write_trace(path, requests, warmup.iter().chain(&runs))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let (Some(requests), Some(slots), Some(disk), Some(ram)) = (&requests, slots, disk_probe_gb_s, &in_ram) {
        let cache = OptimalCache {
            slots,
            record_bytes: &m.info.expert_record_bytes_by_layer,
            // Resident records were all read at load: no phase misses any.
            resident: m.memory_plan.placement == ExpertPlacement::Resident,
            // (Nothing lies beyond slots that hold every record, as resident ones do.)
            buffered: !m.memory_plan.direct_io && m.memory_plan.expert_cache < m.memory_plan.model.expert_bytes,
        };
        for r in &mut runs {
            let disk = r.disk_gb_s(disk);
            judge_against_optimal(r, requests, &cache, disk, ram);
        }
    }
    let report = Report {
        model: a.model.display().to_string(),
        mode: format!("{:?}", m.memory_plan.placement).to_lowercase(),
        packed_store: expert_store::is_store(&a.model),
        experts: m.info.num_experts,
        top_k,
        layers: m.info.num_layers,
        record_bytes,
        expert_bytes_per_token,
        cache_slots: slots,
        io_depth: opts.io_depth,
        guess_depth: expert_store::EngineOptions {
            io_depth: opts.io_depth,
            guess_depth: opts.guess_depth,
            ..Default::default()
        }
        .effective_guess_depth(),
        prefill_chunk: chunk,
        direct_io: m.memory_plan.direct_io,
        tiled_experts: m.info.tiled_experts,
        prefetch: match m.prefetch() {
            (PrefetchMode::None, _) => "none".to_string(),
            (mode, ahead) => format!("{mode:?}, {ahead} ahead"),
        },
        kv_cache: opts.kv_type().name().into(),
        threads: rayon::current_num_threads(),
        load_seconds,
        slots_backed_seconds,
        slots_on_huge_pages,
        disk_probe_gb_s,
        disk_reread_gb_s: disk.and_then(|d| d.reread),
        disk_probe_window_gb_s: disk.map(|d| d.window),
        disk_probe_depth: disk.map(|d| d.depth),
        disk_probe_pieces: disk.map(|d| d.pieces),
        dram_probe_gb_s: dram.map(|d| d.best()),
        dram_one_stream_gb_s: dram.map(|d| d.one_stream),
        dram_four_streams_gb_s: dram.map(|d| d.four_streams),
        weight_bytes_per_token: resident_read_per_token(&a.model, &opts).map(|r| r + expert_bytes_per_token),
        fresh_memory_gb_s,
        in_ram,
        runs,
    };
    Ok(report)
}

/// What streaming from a checkpoint costs against a packed store (printed by `bench` and `doctor`).
pub(crate) const PACKED_STORE_HINT: &str = "streamed from a checkpoint, each record is one read per tensor \
     (weights, scales, biases); a packed store (`sluice convert`) reads it in one, faster on disks that pay per \
     read, and on x86-64 with AVX2 or AVX-512 holds it in the int8 kernels' tiles, which decode computes faster (README, \"Packed \
     stores\")";

/// Resident bytes one decode step reads, as `doctor` sizes them: from the model directory's `config.json` (a
/// packed store's too), rescaled to its safetensors index's `total_size` when there is one; `None` if the
/// config cannot be sized.
fn resident_read_per_token(model: &Path, opts: &ExpertOptions) -> Option<u64> {
    let dir = sluice_runtime::model_dir(model).ok()?;
    let config = ModelConfig::load(&dir).ok()?;
    let total = crate::doctor::index_total_size(&dir.join("model.safetensors.index.json")).ok();
    Some(size_from_config(&config, total, opts).ok()?.resident_read_per_token)
}

/// The routing trace as text: `layer expert` per request, a comment where each run's prefill and decode begin.
fn write_trace<'a>(
    path: &Path,
    requests: &[RecordKey],
    runs: impl Iterator<Item = &'a RunReport>,
) -> std::io::Result<()> {
    use std::io::Write;
    let mut marks: Vec<(usize, String)> = Vec::new();
    for r in runs {
        if let Some([prefill, decode]) = &r.trace_ranges {
            marks.push((prefill.start, format!("# {} prefill", r.run)));
            marks.push((decode.start, format!("# {} decode", r.run)));
        }
    }
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for (i, (layer, expert)) in requests.iter().enumerate() {
        for (_, m) in marks.iter().filter(|(at, _)| *at == i) {
            writeln!(out, "{m}")?;
        }
        writeln!(out, "{layer} {expert}")?;
    }
    out.flush()
}

/// Seconds `misses` take to read at `disk_gb_s`, each at its own layer's record size (`record_bytes`, by layer).
fn read_seconds(misses: &[RecordKey], record_bytes: &[u64], disk_gb_s: f64) -> f64 {
    let bytes: u64 = (misses.iter())
        .map(|&(l, _)| record_bytes.get(l).copied().unwrap_or(0))
        .sum();
    bytes as f64 / (disk_gb_s * 1e9)
}

/// The cache a run's bounds give the optimal replacement.
struct OptimalCache<'a> {
    /// Its slots (one record each).
    slots: usize,
    /// Bytes a miss in each layer reads, by layer index.
    record_bytes: &'a [u64],
    /// Every record was read at load (`--experts resident`): nothing misses.
    resident: bool,
    /// Reads went through the page cache (see [`Bound::page_cache_beyond_slots`]).
    buffered: bool,
}

/// Fills in run `r`'s bounds for prefill and decode: the misses an optimal cache would have on the phase's
/// part of `requests`, each read at `disk_gb_s` at its own layer's record size, overlapped with the phase's
/// in-RAM compute.
fn judge_against_optimal(r: &mut RunReport, requests: &[RecordKey], cache: &OptimalCache, disk_gb_s: f64, ram: &InRam) {
    let Some([prefill, decode]) = r.trace_ranges.clone() else {
        return;
    };
    let bound = |range: std::ops::Range<usize>, tokens: usize, tok_s: f64, ram_tok_s: f64| {
        let tokens = tokens as f64;
        let io = |misses: &[RecordKey]| read_seconds(misses, cache.record_bytes, disk_gb_s);
        let compute = tokens / ram_tok_s;
        let (misses, lru) = if cache.resident {
            (Vec::new(), Vec::new())
        } else {
            (
                optimal_misses(&requests[..range.end], cache.slots, range.clone()),
                lru_misses(&requests[..range.end], cache.slots, range),
            )
        };
        let (tok_s_bound, lru_bound) = (tokens / io(&misses).max(compute), tokens / io(&lru).max(compute));
        Bound {
            optimal_misses_per_token: misses.len() as f64 / tokens,
            tok_s: tok_s_bound,
            limit: if io(&misses) > compute { "disk" } else { "compute" }.into(),
            achieved: tok_s / tok_s_bound,
            lru_misses_per_token: lru.len() as f64 / tokens,
            lru_tok_s: lru_bound,
            lru_achieved: tok_s / lru_bound,
            page_cache_beyond_slots: cache.buffered,
        }
    };
    r.prefill_bound = Some(bound(prefill, r.prompt_tokens, r.prefill_tok_s, ram.prefill_tok_s));
    r.decode_bound = Some(bound(decode, r.gen_tokens, r.decode_tok_s, ram.decode_tok_s));
}

/// First touch of 1 GiB of fresh anonymous memory, GB/s (the kernel zeroes each page; a virtual machine
/// may also have its host back it first), or `None` if it cannot be mapped.
fn fresh_memory_probe() -> Option<f64> {
    const LEN: usize = 1 << 30;
    let mut slot = SlotBuf::allocate(1, LEN)?;
    let buf = slot[0].as_mut_slice();
    let t = Instant::now();
    for page in buf.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&buf[..]);
    Some(LEN as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Prefill `tokens[..prompt]` in passes of `chunk` tokens, then decode the rest one token at a time.
#[allow(clippy::too_many_arguments)]
pub(crate) fn measure(
    m: &DecoderModel,
    name: &str,
    tokens: &[u32],
    prompt: usize,
    chunk: usize,
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
    let prefill_start = trace.map_or(0, TracingSource::len);
    let t0 = Instant::now();
    for chunk in tokens[..prompt].chunks(chunk.max(1)) {
        m.forward(chunk, &mut cache, &opts)?;
    }
    let prefill = t0.elapsed();
    let p = snap().since(&prefill_counters);
    let prefill_split = time_split(m, &prefill_parts, p.io_wait_seconds, prefill.as_secs_f64());
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
        read_cpu_cores: c.read_cpu_seconds / secs,
        read_cpu_ms_per_record: c.read_cpu_per_record() * 1e3,
        prefault_cpu_cores: c.prefault_cpu_seconds / secs,
        prefetch_wasted_bytes: c.prefetch_wasted_bytes,
        guess_precision: m.guess_precision(),
        guess_precision_by_rank: m.guess_precision_by_rank(),
        prefill_read_bytes_per_token: p.bytes_read() as f64 / prompt as f64,
        prefill_hit_rate: p.hit_rate(),
        prefill_read_cpu_cores: p.read_cpu_seconds / prefill.as_secs_f64(),
        prefill_read_cpu_ms_per_record: p.read_cpu_per_record() * 1e3,
        prefill_io_wait_share: p.io_wait_seconds / prefill.as_secs_f64(),
        trace_ranges: trace.map(|t| [prefill_start..decode_start, decode_start..t.len()]),
        prefill_bound: None,
        decode_bound: None,
        prefill_split,
        decode_split,
        decode_counters: d,
        disk_probes_gb_s: None,
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

/// The file the disk probes read: a packed store's data file, else the model's largest safetensors file (the
/// expert data).
fn disk_probe_target(path: &Path) -> Result<PathBuf> {
    Ok(if expert_store::is_store(path) {
        expert_store::PackedStore::open(path)?.data_path()
    } else {
        largest_safetensors(path)?
    })
}

/// What [`disk_probe_file`] measured, GB/s.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DiskProbe {
    /// Reads at offsets drawn afresh for this probe: what a record the OS has not cached costs.
    pub(crate) fresh: f64,
    /// [`disk_probe_best`]: its search's fastest short window (the shape `fresh` then read at for longer).
    /// The fastest of several short windows overstates a disk whose speed swings from second to second, so no
    /// bound uses it; elsewhere the same as `fresh`.
    pub(crate) window: f64,
    /// The same offsets read again (when asked, and reads bypass the OS's cache): faster than `fresh` when a
    /// cache below the OS (a VM host's) holds what was read recently.
    pub(crate) reread: Option<f64>,
    /// Records in flight at once.
    pub(crate) depth: usize,
    /// Reads each record was cut into, read side by side (1: one read per record).
    pub(crate) pieces: usize,
}

/// Bytes of buffers a probe's reads land in, in turn. An expert cache reads each miss into a slot it has not touched
/// for a while, and on this VM's disk that costs more than reading into a buffer just read into: the same reader read
/// 2.26–2.43 GB/s into one buffer per thread and 1.67–1.95 GB/s into buffers rotating over 48 MB to 8 GB
/// (`docs/performance-log.md`, the twenty-sixth session). So the probe rotates over as many bytes as this, no cache can
/// read faster than that, and the bound it sets is one a cache can meet.
const PROBE_POOL: usize = 256 << 20;

/// The buffers a probe reads into: page-aligned (O_DIRECT), written once before any timing (first touch is
/// not the disk's cost), enough of them that reads land in memory not touched recently ([`PROBE_POOL`]).
pub(crate) struct ProbeBuffers {
    slots: Vec<SlotBuf>,
    len: usize,
}

impl ProbeBuffers {
    /// Buffers of `record` bytes (rounded up to whole blocks) for up to `threads` readers, at least two each.
    pub(crate) fn new(record: u64, threads: usize) -> Result<Self> {
        let len = record.max(DIRECT_ALIGN).next_multiple_of(DIRECT_ALIGN) as usize;
        let count = (PROBE_POOL / len).max(2 * threads.max(1));
        let mut slots = SlotBuf::allocate(count, len).context("no memory for the disk probe's buffers")?;
        for s in &mut slots {
            s.as_mut_slice().fill(1);
        }
        Ok(Self { slots, len })
    }
}

/// The disk's random-read bandwidth at the record size over `file`: a search over depths 1, 2, 4, … up to
/// `depth` and whole reads against reads in pieces (`time` split between them) picks the fastest shape, which
/// then reads fresh offsets for `time` more: that longer read is the figure (with `reread`, its offsets read
/// again for as long). The best depth is the disk's: a scratch reader on this VM's read 2.4–2.6 GB/s at depth
/// 3 and 1.4–2.1 at depth 8 in the same minute, and a probe at depth 8 alone judged runs (reading ~3 at a time)
/// against less than they read. The search's own fastest window is not the figure: the fastest of eight
/// windows of 0.4 s read 0.72 and 0.85 GB/s where `fio` sustained 0.42–0.55 over 5 to 20 s in the same half
/// hour, and 2.0–2.6 where it read 0.9–2.0 over 5 s (`docs/performance-log.md`): bounds set by such a maximum judged
/// runs against a disk they never had.
pub(crate) fn disk_probe_best(
    file: &Path,
    record: u64,
    depth: usize,
    time: Duration,
    reread: bool,
) -> Result<DiskProbe> {
    let (by_depth, mut buffers) = probe_each_depth(file, record, depth, time)?;
    let best = (by_depth.into_iter())
        .max_by(|a, b| a.fresh.total_cmp(&b.fresh))
        .context("no probe depth")?;
    let split = best.pieces > 1;
    let sustained = disk_probe_file(file, record, (best.depth, split), time, reread, &mut buffers)?;
    Ok(DiskProbe {
        window: best.fresh,
        ..sustained
    })
}

/// Fresh reads over `file` at depths 1, 2, 4, … up to `depth`, `time` split between the probes: per depth, the
/// faster of whole reads and reads in pieces.
pub(crate) fn disk_probe_depths(file: &Path, record: u64, depth: usize, time: Duration) -> Result<Vec<DiskProbe>> {
    Ok(probe_each_depth(file, record, depth, time)?.0)
}

/// Every shape of [`probe_shapes`] probed in turn: per depth the faster shape, with the buffers they read into
/// (for a longer read at the best).
fn probe_each_depth(file: &Path, record: u64, depth: usize, time: Duration) -> Result<(Vec<DiskProbe>, ProbeBuffers)> {
    let shapes = probe_shapes(record, depth);
    let each = time / shapes.len() as u32;
    let mut buffers = ProbeBuffers::new(record, max_probe_threads(record, &shapes))?;
    let mut best: Vec<DiskProbe> = Vec::new();
    for (d, split) in shapes {
        let p = disk_probe_file(file, record, (d, split), each, false, &mut buffers)?;
        match best.iter_mut().find(|b| b.depth == d) {
            Some(b) if b.fresh >= p.fresh => {}
            Some(b) => *b = p,
            None => best.push(p),
        }
    }
    Ok((best, buffers))
}

/// The (depth, split) a probe tries: each depth of [`sluice_runtime::forecast::probe_depths`] with whole reads, and
/// split into the engine's pieces ([`piece_len`]: at most [`expert_store::READ_PIECE`]) when a record is longer. On
/// this VM three ~0.9 MB reads side by side read a 2.65 MB record 9–15% faster than one read
/// (`docs/performance-log.md`, the twenty-sixth session); an in-place record's reads are pieces anyway (one per
/// tensor), so a probe of whole reads alone would set too low a bar.
fn probe_shapes(record: u64, depth: usize) -> Vec<(usize, bool)> {
    let depths = sluice_runtime::forecast::probe_depths(depth);
    let mut shapes: Vec<(usize, bool)> = depths.iter().map(|&d| (d, false)).collect();
    if pieces_of(record, true) > 1 {
        shapes.extend(depths.iter().map(|&d| (d, true)));
    }
    shapes
}

/// The reads a probe cuts a record of `record` bytes into: the engine's pieces when `split`, else one.
fn pieces_of(record: u64, split: bool) -> usize {
    let size = record.max(DIRECT_ALIGN).next_multiple_of(DIRECT_ALIGN) as usize;
    if split {
        size.div_ceil(piece_len(size))
    } else {
        1
    }
}

fn max_probe_threads(record: u64, shapes: &[(usize, bool)]) -> usize {
    (shapes.iter().map(|&(d, split)| d * pieces_of(record, split)))
        .max()
        .unwrap_or(1)
}

/// Random reads of `record` bytes over `file`, `depth` records at a time, each read whole or (`split`) as the
/// engine's pieces side by side, into `buffers` in turn; bypassing the page cache when the filesystem allows
/// O_DIRECT. `time` for the fresh reads and as long again for the re-reads when `reread`.
pub(crate) fn disk_probe_file(
    file: &Path,
    record: u64,
    shape: (usize, bool),
    time: Duration,
    reread: bool,
    buffers: &mut ProbeBuffers,
) -> Result<DiskProbe> {
    match probe_reads(file, record, shape, time, reread, buffers, true) {
        // A filesystem that opens for direct reads but refuses them (as the engine finds at its first read, and
        // then reads through the page cache): probed as the engine reads it.
        Err(ProbeFailed::DirectRefused) => probe_reads(file, record, shape, time, reread, buffers, false),
        r => r,
    }
    .map_err(|e| match e {
        ProbeFailed::DirectRefused => anyhow::anyhow!("direct reads of {} refused", file.display()),
        ProbeFailed::Other(e) => e,
    })
}

/// Why a probe failed.
enum ProbeFailed {
    /// The file opened for direct reads, which then failed as invalid.
    DirectRefused,
    Other(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for ProbeFailed {
    fn from(e: E) -> Self {
        ProbeFailed::Other(e.into())
    }
}

/// [`disk_probe_file`], direct reads allowed or not.
fn probe_reads(
    file: &Path,
    record: u64,
    (depth, split): (usize, bool),
    time: Duration,
    reread: bool,
    buffers: &mut ProbeBuffers,
    allow_direct: bool,
) -> std::result::Result<DiskProbe, ProbeFailed> {
    let file = file.to_path_buf();
    let len = std::fs::metadata(&file)?.len();
    let size = record.max(DIRECT_ALIGN).next_multiple_of(DIRECT_ALIGN);
    if len < size {
        return Err(anyhow::anyhow!("{} is smaller than one record", file.display()).into());
    }
    let (depth, pieces) = (depth.max(1), pieces_of(record, split));
    let threads = depth * pieces;
    if buffers.len < size as usize || buffers.slots.len() < threads {
        return Err(anyhow::anyhow!("the probe's buffers are smaller than {threads} records of {size} bytes").into());
    }
    let piece = if split { piece_len(size as usize) as u64 } else { size };
    let direct = match allow_direct {
        true => PosixFile::open(&file, true),
        false => Err(expert_store::StoreError::Engine("direct reads not tried".into())),
    };
    let used_direct = direct.is_ok();
    // Buffered, the re-reads would come from the guest's own page cache: no re-read then.
    let reread = reread && direct.is_ok();
    let f: Box<dyn ReadAt> = match direct {
        Ok(f) => Box::new(f),
        Err(_) => {
            let f = PosixFile::open(&file, false)?;
            f.drop_os_cache()?;
            Box::new(f)
        }
    };
    let slots = (len - size) / DIRECT_ALIGN;
    // Offsets differ from run to run: with a fixed seed every probe read the same places, which a cache below
    // the OS (a VM host's) may hold from the last run (`docs/performance-log.md`, "`sluice bench`: how its
    // probes and bounds came to be").
    let seed: u64 = rand::random();
    let (fresh, rereads) = (AtomicU64::new(0), AtomicU64::new(0));
    // A failed read ends the probe with its error: bytes not read would make the disk look slower (and the
    // bounds easier to reach), or read nothing at all.
    let failed: OnceLock<std::io::Error> = OnceLock::new();
    // Every thread's fresh reads end before any re-read starts; the last to arrive notes the time.
    let between = Barrier::new(threads);
    let mid = OnceLock::new();
    // Each thread its own buffers, every `threads`-th one: no two threads write the same bytes.
    let mut own: Vec<Vec<&mut SlotBuf>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, b) in buffers.slots.iter_mut().enumerate() {
        own[i % threads].push(b);
    }
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (i, mut bufs) in own.into_iter().enumerate() {
            let (f, fresh, rereads, between, mid, failed) = (&f, &fresh, &rereads, &between, &mid, &failed);
            s.spawn(move || {
                // Thread `i` reads piece `i % pieces` of its group's records; a group's threads draw the same
                // offsets, so a record's pieces are read side by side.
                let (group, at) = (i / pieces, (i % pieces) as u64 * piece);
                let n = piece.min(size.saturating_sub(at)) as usize;
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_add(group as u64));
                let mut turn = (0..bufs.len()).cycle();
                let mut next_buf = move || turn.next().unwrap_or(0);
                let mut read = Vec::new();
                // Each thread reads at least once: one that got no core within a short window would
                // otherwise report nothing read at all.
                let mut first = true;
                while n > 0 && (first || t0.elapsed() < time) {
                    first = false;
                    let off = rng.gen_range(0..=slots) * DIRECT_ALIGN + at;
                    let buf = &mut bufs[next_buf()].as_mut_slice()[..n];
                    match expert_store::read_full(f.as_ref(), buf, off, 0) {
                        Ok(got) => fresh.fetch_add(got as u64, Ordering::Relaxed),
                        Err(e) => {
                            let _ = failed.set(e);
                            break;
                        }
                    };
                    if reread {
                        read.push(off);
                    }
                }
                if between.wait().is_leader() {
                    let _ = mid.set(Instant::now());
                }
                if !reread || n == 0 {
                    return;
                }
                let end = Instant::now() + time;
                for &off in read.iter().cycle().take_while(|_| Instant::now() < end) {
                    let buf = &mut bufs[next_buf()].as_mut_slice()[..n];
                    let got = match expert_store::read_full(f.as_ref(), buf, off, 0) {
                        Ok(got) => got,
                        Err(e) => {
                            let _ = failed.set(e);
                            break;
                        }
                    };
                    rereads.fetch_add(got as u64, Ordering::Relaxed);
                }
            });
        }
    });
    if let Some(e) = failed.into_inner() {
        if used_direct && e.kind() == std::io::ErrorKind::InvalidInput {
            return Err(ProbeFailed::DirectRefused);
        }
        return Err(anyhow::anyhow!(
            "the disk probe could not read {}: {e} (--probe-seconds 0 skips the probes and the bounds)",
            file.display()
        )
        .into());
    }
    let mid = mid.get().copied().unwrap_or_else(Instant::now);
    let gb_s = |bytes: &AtomicU64, secs: f64| bytes.load(Ordering::Relaxed) as f64 / secs.max(1e-9) / 1e9;
    let fresh = gb_s(&fresh, (mid - t0).as_secs_f64());
    Ok(DiskProbe {
        fresh,
        window: fresh,
        reread: reread.then(|| gb_s(&rereads, mid.elapsed().as_secs_f64())),
        depth,
        pieces,
    })
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
        "mode {} | slots {} | io depth {} ({} guesses) | direct {} | tiled {} | prefetch {} | kv {} | threads {} | load {:.1} s",
        r.mode,
        r.cache_slots.map_or("-".into(), |s| s.to_string()),
        r.io_depth,
        r.guess_depth,
        r.direct_io,
        r.tiled_experts,
        r.prefetch,
        r.kv_cache,
        r.threads,
        r.load_seconds
    );
    if let Some(b) = r.slots_backed_seconds {
        let huge = r
            .slots_on_huge_pages
            .map_or(String::new(), |h| format!(", {:.0}% on huge pages", 100.0 * h));
        println!("expert slots backed with memory {b:.1} s after load, before the runs{huge}");
    }
    if let Some(d) = r.disk_probe_gb_s {
        println!(
            "disk probe: {d:.2} GB/s random reads of one record at depth {}{} (the fastest of depths up to {}, \
             whole and in pieces, in short windows{}, then read as long again), into buffers not read into lately, \
             offsets new to this probe{}",
            r.disk_probe_depth.unwrap_or(r.io_depth),
            match r.disk_probe_pieces {
                Some(p) if p > 1 => format!(" in {p} pieces side by side"),
                _ => String::new(),
            },
            r.io_depth,
            r.disk_probe_window_gb_s
                .map_or(String::new(), |w| format!(" where it read {w:.2}")),
            r.disk_reread_gb_s
                .map_or(String::new(), |re| format!(" (the same offsets re-read: {re:.2} GB/s)"))
        );
        if !r.packed_store && r.mode == "stream" {
            println!("hint: {PACKED_STORE_HINT}");
        }
    }
    if let (Some(d), Some(one), Some(four)) = (r.dram_probe_gb_s, r.dram_one_stream_gb_s, r.dram_four_streams_gb_s) {
        println!("DRAM probe: {d:.1} GB/s (one stream per thread {one:.1}, four in lockstep {four:.1})");
    }
    if let Some(f) = r.fresh_memory_gb_s {
        println!(
            "fresh memory: {f:.2} GB/s first touch ({:.2} CPU-seconds per GB of cache slots filled for the first time)",
            1.0 / f
        );
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
        for (d, ranks) in x
            .guess_precision_by_rank
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.is_empty())
        {
            let cells: Vec<String> = (ranks.iter())
                .map(|p| p.map_or("-".into(), |p| format!("{:.0}", 100.0 * p)))
                .collect();
            let when = match d {
                0 => "next layer again, once this layer's experts at hand are computed".to_string(),
                1 => "1 layer ahead".to_string(),
                d => format!("{d} layers ahead"),
            };
            println!(
                "{} guess % by rank (router's first choice first), {when}: {}",
                x.run,
                cells.join(" ")
            );
        }
        for (what, split) in [("prefill", &x.prefill_split), ("decode", &x.decode_split)] {
            let parts: Vec<String> = split
                .iter()
                .filter(|(_, share)| *share >= 0.0005)
                .map(|(name, share)| format!("{} {:.1}%", name.replace('_', " "), 100.0 * share))
                .collect();
            println!("{} {what} time: {}", x.run, parts.join(" | "));
        }
        if x.read_cpu_cores > 0.0 || x.prefault_cpu_cores > 0.0 {
            println!(
                "{} decode CPU beside the step's threads: I/O threads {:.2} cores ({:.2} ms per record read), \
                 backing slots {:.2} cores, of {} cores",
                x.run,
                x.read_cpu_cores,
                x.read_cpu_ms_per_record,
                x.prefault_cpu_cores,
                std::thread::available_parallelism().map_or(0, |n| n.get())
            );
        }
    }
    if let (Some(w), Some(d)) = (r.weight_bytes_per_token, r.dram_probe_gb_s) {
        for x in &r.runs {
            let gb_s = w as f64 * x.decode_tok_s / 1e9;
            println!(
                "{} decode weights: {:.1} MB/token, {gb_s:.1} GB/s = {:.0}% of the DRAM probe",
                x.run,
                w as f64 / 1e6,
                100.0 * gb_s / d
            );
        }
    }
    if let Some(ram) = &r.in_ram {
        println!(
            "in-RAM compute of the same shape: prefill {:.2} tok/s, decode {:.2} tok/s ({} records per layer \
             kept in RAM serve every request)",
            ram.prefill_tok_s, ram.decode_tok_s, ram.twins_per_layer
        );
    }
    for x in &r.runs {
        if let Some([before, after]) = x.disk_probes_gb_s {
            println!(
                "{} disk probes: {before:.2} GB/s right before the run, {after:.2} right after (its bounds use \
                 the faster, {:.2})",
                x.run,
                x.disk_gb_s(before)
            );
        }
        if x.prefill_read_bytes_per_token > 0.0 {
            println!(
                "{} prefill reads: {:.1} MB/token, hit {:.1}%, io wait {:.0}% (chunks of {}), I/O threads {:.2} \
                 cores ({:.2} ms per record read)",
                x.run,
                x.prefill_read_bytes_per_token / 1e6,
                100.0 * x.prefill_hit_rate,
                100.0 * x.prefill_io_wait_share,
                r.prefill_chunk,
                x.prefill_read_cpu_cores,
                x.prefill_read_cpu_ms_per_record
            );
        }
        for (what, bound) in [("prefill", &x.prefill_bound), ("decode", &x.decode_bound)] {
            if let Some(b) = bound {
                println!(
                    "{} {what} bound: {:.2} tok/s ({}: an optimal cache of these slots misses {:.1} records per \
                     token on this trace, read at the disk probe, overlapped with the in-RAM compute); achieved {:.0}%",
                    x.run,
                    b.tok_s,
                    b.limit,
                    b.optimal_misses_per_token,
                    100.0 * b.achieved
                );
                println!(
                    "{} {what} with an LRU cache instead: {:.1} misses per token, bound {:.2} tok/s; achieved {:.0}%",
                    x.run,
                    b.lru_misses_per_token,
                    b.lru_tok_s,
                    100.0 * b.lru_achieved
                );
                if b.page_cache_beyond_slots {
                    println!(
                        "{} {what}: reads went through the page cache, which held records beyond the slots the \
                         optimal cache is given; the shares above may overstate (--io direct compares them)",
                        x.run
                    );
                }
            }
        }
    }
    if let (Some(disk), Some(w)) = (r.disk_probe_gb_s, r.runs.first()) {
        if w.read_gb_s > 0.0 {
            println!(
                "achieved read bandwidth / disk probe: {:.0}%",
                100.0 * w.read_gb_s / w.disk_gb_s(disk)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(len: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        std::io::Write::write_all(&mut f, &vec![7u8; len]).expect("write");
        f
    }

    #[test]
    fn bounds_read_each_miss_at_its_layers_size_and_the_faster_probe() {
        // Layer 1's records are twice layer 0's; layer 2 has none.
        let sizes = [1_000_000, 2_000_000, 0];
        let misses = [(0, 3), (1, 3), (1, 5)];
        assert_eq!(read_seconds(&misses, &sizes, 1.0), 0.005);
        assert_eq!(read_seconds(&[(2, 0), (7, 1)], &sizes, 1.0), 0.0);
        assert_eq!(faster_probe(Some([2.0, 3.0]), 1.0), 3.0);
        assert_eq!(faster_probe(Some([3.5, 3.0]), 1.0), 3.5);
        assert_eq!(faster_probe(None, 1.0), 1.0);
    }

    #[test]
    fn the_disk_probe_measures_fresh_reads_and_rereads_when_asked() {
        let f = file_of(8 << 20);
        let time = Duration::from_millis(150);
        let mut buffers = ProbeBuffers::new(1 << 20, 4).expect("buffers");
        let both = disk_probe_file(f.path(), 1 << 20, (2, false), time, true, &mut buffers).expect("probe");
        assert!(both.fresh > 0.0, "{both:?}");
        // Without O_DIRECT (tmpfs) the re-reads would come from the page cache, so there are none.
        let direct = PosixFile::open(f.path(), true).is_ok();
        assert_eq!(both.reread.is_some_and(|r| r > 0.0), direct, "{both:?}");
        let fresh_only = disk_probe_file(f.path(), 1 << 20, (2, false), time, false, &mut buffers).expect("probe");
        assert!(fresh_only.fresh > 0.0 && fresh_only.reread.is_none(), "{fresh_only:?}");
        assert_eq!((fresh_only.depth, fresh_only.pieces), (2, 1));
        // Buffers made for smaller records: refused, not read short.
        assert!(disk_probe_file(f.path(), 2 << 20, (1, false), time, false, &mut buffers).is_err());
    }

    #[test]
    fn the_probe_tries_whole_records_and_pieces_at_each_depth() {
        // A 2.5 MiB record: the engine's three pieces of at most 1 MiB; one of 1 MiB or less is only read whole.
        let big = 5 << 19;
        let (whole, split) = (false, true);
        assert_eq!(
            probe_shapes(big, 4),
            vec![(1, whole), (2, whole), (4, whole), (1, split), (2, split), (4, split)]
        );
        assert_eq!((pieces_of(big, split), pieces_of(big, whole)), (3, 1));
        assert_eq!(
            probe_shapes(expert_store::READ_PIECE as u64, 2),
            vec![(1, whole), (2, whole)]
        );
        assert_eq!(max_probe_threads(big, &probe_shapes(big, 4)), 12);
        // Each reader's buffers are its own and the pool spans PROBE_POOL (or two per reader).
        let b = ProbeBuffers::new(big, 12).expect("buffers");
        assert!(
            b.slots.len() >= 24 && b.slots.len() * b.len >= PROBE_POOL - b.len,
            "{}",
            b.slots.len()
        );
        let f = file_of(8 << 20);
        let by_depth = disk_probe_depths(f.path(), big, 2, Duration::from_millis(200)).expect("probe");
        assert_eq!(by_depth.iter().map(|p| p.depth).collect::<Vec<_>>(), vec![1, 2]);
        assert!(
            by_depth.iter().all(|p| p.fresh > 0.0 && [1, 3].contains(&p.pieces)),
            "{by_depth:?}"
        );
    }

    #[test]
    fn the_best_disk_probe_tries_each_depth_and_rereads_at_the_best() {
        let f = file_of(8 << 20);
        let p = disk_probe_best(f.path(), 1 << 20, 4, Duration::from_millis(300), true).expect("probe");
        assert!(
            p.fresh > 0.0 && p.window > 0.0 && [1, 2, 4].contains(&p.depth) && p.pieces == 1,
            "{p:?}"
        );
        let direct = PosixFile::open(f.path(), true).is_ok();
        assert_eq!(p.reread.is_some_and(|r| r > 0.0), direct, "{p:?}");
        let one = disk_probe_best(f.path(), 1 << 20, 1, Duration::from_millis(50), false).expect("probe");
        assert!(one.depth == 1 && one.reread.is_none(), "{one:?}");
    }

    #[test]
    fn the_disk_probe_refuses_a_file_smaller_than_a_record() {
        let f = file_of(4096);
        let mut buffers = ProbeBuffers::new(1 << 20, 1).expect("buffers");
        let err = disk_probe_file(
            f.path(),
            1 << 20,
            (1, false),
            Duration::from_millis(10),
            true,
            &mut buffers,
        )
        .unwrap_err();
        assert!(err.to_string().contains("smaller than one record"), "{err}");
    }
}
