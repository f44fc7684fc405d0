//! `sluice doctor`: before a download, whether a model fits this machine, its memory plan, and the decode
//! speed the machine's own probes forecast at each `--top-k` (the model behind it: `runtime/src/forecast.rs`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use expert_store::platform::HugePages;
use serde::Serialize;
use sluice_runtime::config::ModelConfig;
use sluice_runtime::eval::{default_top_ks, parse_top_ks};
use sluice_runtime::forecast::{
    check_top_k, forecast, matvec_probe, size_from_config, Forecast, MachineProbes, ModelSize,
};
use sluice_runtime::memory_plan::{ExpertPlacement, MachineMemory, MemoryPlan, PlanRequest};
use sluice_runtime::ExpertOptions;

use crate::store_cmds::EngineArgs;
use crate::ContextArgs;

/// Arguments of `sluice doctor`.
#[derive(Args)]
pub struct DoctorArgs {
    /// The model's `config.json`, or a directory holding it (a downloaded model, or just its config).
    #[arg(long, value_name = "PATH")]
    config: PathBuf,
    /// The model's `model.safetensors.index.json`, for its exact size (default: beside the config, if there).
    #[arg(long)]
    index: Option<PathBuf>,
    /// Experts-per-token values to forecast: a list or `all` (default: 1 up to the model's own, then doubling).
    #[arg(long)]
    top_k: Option<String>,
    /// Directory on the disk the model will live on; a probe file is written there and deleted.
    #[arg(long, default_value = ".")]
    disk: PathBuf,
    /// Size of that probe file.
    #[arg(long, default_value = "1G", value_parser = sluice_runtime::parse_size)]
    probe_size: u64,
    /// Seconds spent on each probe.
    #[arg(long, default_value_t = 3.0, value_parser = crate::parse_probe_seconds)]
    probe_seconds: f64,
    #[command(flatten)]
    context: ContextArgs,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Serialize)]
struct Report {
    config: String,
    size: ModelSize,
    probes: MachineProbes,
    fits: bool,
    placement: String,
    expert_cache: u64,
    page_cache_for_experts: u64,
    kv_bytes_per_1k_tokens: u64,
    /// Linux's transparent huge page setting (`null` where the OS has none).
    huge_pages: Option<HugePages>,
    /// The kernels' instruction set on this CPU, and which int8 kernels it has.
    kernels: String,
    warm: Vec<Forecast>,
    cold: Vec<Forecast>,
}

/// Runs `sluice doctor`.
pub fn run(a: DoctorArgs) -> Result<()> {
    let (config_path, dir) = if a.config.is_dir() {
        (a.config.join("config.json"), a.config.clone())
    } else {
        (
            a.config.clone(),
            a.config.parent().unwrap_or(Path::new(".")).to_path_buf(),
        )
    };
    let text = std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let config = ModelConfig::parse(&config_path, &text)?;
    let index = a
        .index
        .clone()
        .or_else(|| Some(dir.join("model.safetensors.index.json")).filter(|p| p.exists()));
    let index_total = match &index {
        Some(p) => Some(index_total_size(p)?),
        None => None,
    };
    let mut opts = a.engine.options()?;
    opts.context = a.context.ctx_size;
    let size = size_from_config(&config, index_total, &opts)?;
    let top_ks = match &a.top_k {
        Some(spec) => parse_top_ks(spec, size.num_experts)?,
        None if size.num_experts == 0 => vec![0],
        None => default_top_ks(size.top_k, size.num_experts),
    };
    for &k in &top_ks {
        check_top_k(&size, k)?;
    }
    // Before any probe: the kernels must take the config's code widths (loading would refuse them too).
    if let Some(Err(e)) = config.quant.default.map(|s| s.check_widths()) {
        bail!("{}: quantization: {e}", config_path.display());
    }
    let machine = MachineMemory::probe_for(opts.backend);
    let plan = MemoryPlan::new(machine, size.footprint, &PlanRequest::from_options(&opts));
    let time = Duration::from_secs_f64(a.probe_seconds.max(0.1));
    if !a.json {
        eprintln!(
            "probing: the disk under {}, DRAM, and the matvec kernel ({:.1} s each)…",
            a.disk.display(),
            time.as_secs_f64()
        );
    }
    let probes = MachineProbes {
        disk_gbps_by_depth: probe_disk(&a.disk, a.probe_size, size.record_bytes.max(4096), opts.io_depth, time)?,
        dram_gbps: sluice_runtime::cpu::dram_read_gbps(512 << 20, time),
        matvec_gbps: 0.0,
        call_seconds: 0.0,
    };
    let hidden = config.text.get("hidden_size").and_then(|v| v.as_u64()).unwrap_or(4096) as usize;
    let (matvec_gbps, call_seconds) = matvec_probe(config.quant.default, hidden, time);
    let probes = MachineProbes {
        matvec_gbps,
        call_seconds,
        ..probes
    };
    // The OS page cache holds expert records too, unless reads bypass it: what the plan leaves free. Mapped
    // experts live in it alone (the plan names all of them, which only the page cache's room can hold).
    let caches = |plan: MemoryPlan| {
        let room = plan.limit.saturating_sub(plan.fixed_bytes());
        let (slot_cache, page_cache) = match plan.placement {
            ExpertPlacement::Resident => (plan.expert_cache, 0),
            ExpertPlacement::Mmap => (0, room.min(size.expert_bytes)),
            ExpertPlacement::Stream if plan.direct_io => (plan.expert_cache, 0),
            ExpertPlacement::Stream => (
                plan.expert_cache,
                (room.saturating_sub(plan.expert_cache)).min(size.expert_bytes.saturating_sub(plan.expert_cache)),
            ),
        };
        let cache_plan = MemoryPlan {
            expert_cache: slot_cache,
            ..plan
        };
        (cache_plan, page_cache)
    };
    let k_of = |k: usize| if k == 0 { size.top_k } else { k };
    // Each row as `--top-k k` would plan it: a prompt token's routes hold k experts' inputs and outputs.
    let mut rows = Vec::new();
    for &k in &top_ks {
        let at_k = ExpertOptions {
            top_k: Some(k_of(k)),
            ..opts.clone()
        };
        let footprint = size_from_config(&config, index_total, &at_k)?.footprint;
        let (cache_plan, page_cache) = caches(MemoryPlan::new(machine, footprint, &PlanRequest::from_options(&opts)));
        let at = |cold: bool, page_cache: u64| {
            forecast(&size, &cache_plan, &probes, opts.io_depth, k_of(k), cold, page_cache)
        };
        rows.push((at(false, page_cache), at(true, 0)));
    }
    let (_, page_cache) = caches(plan);
    let report = Report {
        config: config_path.display().to_string(),
        fits: plan.fits(),
        placement: format!("{:?}", plan.placement).to_lowercase(),
        expert_cache: plan.expert_cache,
        page_cache_for_experts: page_cache,
        kv_bytes_per_1k_tokens: size.footprint.kv_bytes_per_token * 1000,
        huge_pages: expert_store::platform::huge_pages(),
        kernels: sluice_runtime::cpu::kernel_summary(),
        warm: rows.iter().map(|r| r.0.clone()).collect(),
        cold: rows.into_iter().map(|r| r.1).collect(),
        size,
        probes,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report, &plan);
    }
    Ok(())
}

/// `metadata.total_size` of a safetensors index.
pub(crate) fn index_total_size(path: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    match v.pointer("/metadata/total_size").and_then(|t| t.as_u64()) {
        Some(t) if t > 0 => Ok(t),
        _ => bail!("{} has no metadata.total_size", path.display()),
    }
}

/// Writes a probe file of `size` bytes under `dir`, reads records of `record` bytes from it at random
/// offsets, 1, 2, 4, … up to `depth` at a time (`time` split between the depths), bypassing the page cache,
/// and deletes it: GB/s at each depth.
fn probe_disk(dir: &Path, size: u64, record: u64, depth: usize, time: Duration) -> Result<Vec<(usize, f64)>> {
    use std::io::Write;

    let size = size.max(record * 4).next_multiple_of(1 << 20);
    let file = tempfile::Builder::new()
        .prefix(".sluice-doctor-probe")
        .tempfile_in(dir)
        .with_context(|| format!("creating a probe file in {}", dir.display()))?;
    {
        let mut w = std::io::BufWriter::with_capacity(8 << 20, file.as_file());
        // Incompressible-looking bytes, so no filesystem shortcut flatters the reads.
        let block: Vec<u8> = (0..(1usize << 20))
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for _ in 0..size >> 20 {
            w.write_all(&block)?;
        }
        w.flush()?;
    }
    file.as_file().sync_all()?;
    Ok(
        (crate::bench::disk_probe_depths(file.path(), record, depth, time)?.into_iter())
            .map(|p| (p.depth, p.fresh))
            .collect(),
    )
}

fn print_report(r: &Report, plan: &MemoryPlan) {
    let s = &r.size;
    println!(
        "{}: {} ({} layers, {} of them MoE with {} experts, top-{}), {:.2} bytes/weight; sizes {}",
        r.config,
        s.model_type,
        s.layers,
        s.moe_layers,
        s.num_experts,
        s.top_k,
        s.bytes_per_weight,
        if s.exact {
            "scaled to the index's total_size"
        } else {
            "estimated from the config"
        }
    );
    println!(
        "weights: {} resident + {} of experts ({:.1} MiB per expert record); KV {:.1} MiB per 1k tokens",
        crate::gib(s.resident_bytes),
        crate::gib(s.expert_bytes),
        s.record_bytes as f64 / (1u64 << 20) as f64,
        r.kv_bytes_per_1k_tokens as f64 / (1u64 << 20) as f64
    );
    println!(
        "probes: disk {} GB/s (random {:.1} MiB reads at depth {}) | DRAM {:.1} GB/s | matvec {:.1} GB/s, {:.1} µs per call",
        r.probes
            .disk_gbps_by_depth
            .iter()
            .map(|(_, b)| format!("{b:.2}"))
            .collect::<Vec<_>>()
            .join("/"),
        s.record_bytes as f64 / (1u64 << 20) as f64,
        r.probes
            .disk_gbps_by_depth
            .iter()
            .map(|(d, _)| d.to_string())
            .collect::<Vec<_>>()
            .join("/"),
        r.probes.dram_gbps,
        r.probes.matvec_gbps,
        r.probes.call_seconds * 1e6
    );
    println!("kernels: {}", r.kernels);
    match r.huge_pages {
        Some(HugePages::Never) => println!(
            "huge pages: NEVER. Expert slots sit on 4 KiB pages, and uncached reads into them ran at half speed \
             or less on the development VM (the disk probe above reads into such buffers too). As root: \
             `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled`"
        ),
        Some(mode) => println!("huge pages: {mode} (expert slots and resident weights ask for them)"),
        None => {}
    }
    println!();
    print!("{plan}");
    println!();
    if !r.fits {
        let what = match plan.placement {
            ExpertPlacement::Resident => {
                "the resident experts, with the other weights, KV, prefill activations and margin,"
            }
            ExpertPlacement::Stream if plan.fixed_bytes() <= plan.limit => {
                "the expert cache asked for, with the resident weights, KV, prefill activations and margin,"
            }
            _ => "the resident weights, KV, prefill activations and margin alone",
        };
        println!("does NOT fit: {what} exceed the memory limit");
    } else {
        println!(
            "fits: experts {}{}",
            r.placement,
            if r.page_cache_for_experts > 0 {
                format!(
                    ", plus ~{} of page cache for expert records",
                    crate::gib(r.page_cache_for_experts)
                )
            } else {
                String::new()
            }
        );
        if r.placement == "stream" {
            println!("hint: {}", crate::bench::PACKED_STORE_HINT);
        }
    }
    println!();
    println!("| experts/token | assumed hit rate | disk MB/token | forecast tok/s (steady) | limited by | forecast tok/s (cold) |");
    println!("|---:|---:|---:|---:|---|---:|");
    for (w, c) in r.warm.iter().zip(&r.cold) {
        println!(
            "| {}{} | {:.0}% | {:.1} | {:.2} | {} | {:.2} |",
            w.top_k,
            if w.top_k == s.top_k { " (own)" } else { "" },
            w.hit_rate * 100.0,
            w.read_bytes_per_token / 1e6,
            w.tok_s,
            w.limited_by,
            c.tok_s
        );
    }
}
