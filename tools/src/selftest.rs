//! `sluice selftest`: every committed golden (mlx-lm's logits and greedy tokens) on the backend this machine
//! would run, with experts resident and streamed, then a short bench of a synthesized model with the
//! machine's own disk and DRAM probes, printed as one report to paste into an issue. Metal cannot run in
//! CI, so every Mac that runs this is the test machine.
//!
//! Fixtures are found at `--fixtures` / `SLUICE_FIXTURES`, else in a `fixtures/` directory above the binary
//! (a binary in `target/release/` of a checkout), else in the checkout the binary was built from.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser};
use sluice_runtime::config::ModelConfig;
use sluice_runtime::golden::{self, Golden, GoldenReport};
use sluice_runtime::{load_model_with, BackendKind, ExpertMode, ExpertOptions};

use crate::bench::{self, BenchArgs};
use crate::synth::{self, SynthArgs};

/// Arguments of `sluice selftest`.
#[derive(Args)]
pub struct SelftestArgs {
    /// Directory of fixtures, each with a golden.json (default: the checkout's `fixtures/`).
    #[arg(long, env = "SLUICE_FIXTURES")]
    fixtures: Option<PathBuf>,
    /// Compute backend: cpu, mlx or reference (default: the one `generate` uses on this machine).
    #[arg(long, env = "SLUICE_BACKEND")]
    backend: Option<BackendKind>,
    /// Only the fixtures whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Size of the random model (Qwen3-30B-A3B shapes) the bench writes to a temporary directory; 0 skips the
    /// bench, and the report says so.
    #[arg(long, default_value = "1G", value_parser = sluice_runtime::parse_size)]
    bench_size: u64,
    /// Where the bench model goes (default: the system's temporary directory). It is deleted afterwards.
    #[arg(long)]
    bench_dir: Option<PathBuf>,
    /// Seconds spent on each bandwidth probe.
    #[arg(long, default_value_t = 2.0, value_parser = crate::parse_probe_seconds)]
    probe_seconds: f64,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long, env = "SLUICE_THREADS")]
    threads: Option<usize>,
}

/// One fixture's outcome.
struct FixtureResult {
    name: String,
    resident: std::result::Result<GoldenReport, String>,
    /// `None` for a model without routed experts.
    streamed: Option<std::result::Result<GoldenReport, String>>,
}

impl FixtureResult {
    fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut add = |mode: &str, r: &std::result::Result<GoldenReport, String>| match r {
            Err(e) => out.push(format!("{mode}: {e}")),
            Ok(g) => out.extend(g.failures.iter().map(|f| format!("{mode}: {f}"))),
        };
        add("resident", &self.resident);
        if let Some(s) = &self.streamed {
            add("streamed", s);
            if let (Ok(r), Ok(s)) = (&self.resident, s) {
                if r.logits_hash != s.logits_hash {
                    out.push("streamed logits differ from resident ones (must be bit for bit equal)".into());
                }
            }
        }
        out
    }
}

/// Runs `sluice selftest`; fails (non-zero exit) naming every fixture that did not pass.
pub fn run(a: SelftestArgs) -> Result<()> {
    let _pool = crate::compute_pool(a.threads)?;
    let backend = a.backend.unwrap_or_else(BackendKind::default_for_build);
    let root = find_fixtures(a.fixtures.as_deref())?;
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .with_context(|| format!("reading {}", root.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("golden.json").is_file())
        .filter(|p| a.only.as_ref().is_none_or(|o| name_of(p).contains(o.as_str())))
        .collect();
    dirs.sort();
    if dirs.is_empty() {
        bail!("no fixtures (directories with a golden.json) in {}", root.display());
    }
    print_header(backend, &root, dirs.len());
    println!();
    println!("| fixture | resident | streamed | max abs Δlogit |");
    println!("|---|---|---|---|");
    let started = Instant::now();
    let mut failed = Vec::new();
    for dir in &dirs {
        let r = check_fixture(dir, backend);
        let cell = |x: &Option<std::result::Result<GoldenReport, String>>| match x {
            None => "no experts".to_string(),
            Some(Ok(g)) if g.passed() => format!("pass ({} checks)", g.checks),
            Some(_) => "**FAIL**".to_string(),
        };
        let worst = [Some(&r.resident), r.streamed.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_ref().ok())
            .map(|g| g.max_logit_diff)
            .fold(0f32, f32::max);
        println!(
            "| {} | {} | {} | {worst:.1e} |",
            r.name,
            cell(&Some(r.resident.clone())),
            cell(&r.streamed)
        );
        let f = r.failures();
        if !f.is_empty() {
            failed.push((r.name.clone(), f));
        }
    }
    println!();
    println!(
        "goldens: {} of {} fixtures passed in {:.1} s (tolerance |Δ| ≤ {} + {}·|mlx-lm|; greedy tokens identical; \
         streamed equals resident bit for bit)",
        dirs.len() - failed.len(),
        dirs.len(),
        started.elapsed().as_secs_f64(),
        golden::ABS_TOL,
        golden::REL_TOL
    );
    for (name, f) in &failed {
        for line in f {
            println!("FAIL {name}: {line}");
        }
    }
    println!();
    if a.bench_size == 0 {
        println!("bench: skipped (--bench-size 0)");
    } else if let Err(e) = run_bench(&a, backend) {
        println!("bench: failed: {e:#}");
        failed.push(("bench".into(), vec![format!("{e:#}")]));
    }
    if !failed.is_empty() {
        let names: Vec<&str> = failed.iter().map(|(n, _)| n.as_str()).collect();
        bail!("selftest failed: {}", names.join(", "));
    }
    println!("\nselftest: PASS");
    Ok(())
}

fn name_of(p: &Path) -> String {
    p.file_name()
        .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// `explicit`, else a `fixtures/` directory above the running binary, else the one in the checkout this
/// binary was built from.
fn find_fixtures(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_dir() {
            bail!("--fixtures {}: not a directory", p.display());
        }
        return Ok(p.to_path_buf());
    }
    let has_fixtures = |d: &Path| d.join("fixtures").is_dir();
    let mut tried = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1) {
            if has_fixtures(dir) {
                return Ok(dir.join("fixtures"));
            }
        }
        tried.push(format!("above {}", exe.display()));
    }
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if has_fixtures(&built_from) {
        return Ok(built_from.join("fixtures"));
    }
    tried.push(built_from.join("fixtures").display().to_string());
    bail!(
        "no fixtures directory found ({}): pass --fixtures DIR (the `fixtures/` of a sluice checkout)",
        tried.join(", ")
    )
}

fn print_header(backend: BackendKind, root: &Path, n: usize) {
    use expert_store::platform;
    println!("## sluice selftest");
    println!();
    println!(
        "- sluice {} ({} build{})",
        env!("CARGO_PKG_VERSION"),
        if cfg!(debug_assertions) { "debug" } else { "release" },
        if cfg!(feature = "mlx") {
            ", with mlx-rs 0.33"
        } else {
            ""
        }
    );
    println!(
        "- platform: {} {} on {}, {} threads, kernels {:?}",
        platform::os_name(),
        platform::os_release().unwrap_or_else(|| "?".into()),
        std::env::consts::ARCH,
        rayon::current_num_threads(),
        sluice_runtime::cpu::Isa::detect()
    );
    let m = sluice_runtime::memory_plan::MachineMemory::probe();
    println!(
        "- memory: {} total, {} available{}",
        crate::gib(m.total),
        crate::gib(m.available),
        m.gpu_working_set
            .map_or(String::new(), |g| format!(", GPU working set {}", crate::gib(g)))
    );
    println!("- backend: {}", format!("{backend:?}").to_lowercase());
    println!("- fixtures: {} ({n})", root.display());
    // The bench takes the engine flags' environment variables as `sluice bench` does: a report says so.
    let mut set: Vec<String> = (std::env::vars())
        .filter(|(k, _)| k.starts_with("SLUICE_"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    set.sort();
    if !set.is_empty() {
        println!("- environment (the bench honours it): {}", set.join(" "));
    }
}

/// The golden checks with experts resident, then streamed through a cache of one layer's worth of slots.
fn check_fixture(dir: &Path, backend: BackendKind) -> FixtureResult {
    let name = name_of(dir);
    let golden = match Golden::load(dir) {
        Ok(g) => g,
        Err(e) => {
            return FixtureResult {
                name,
                resident: Err(e.to_string()),
                streamed: None,
            }
        }
    };
    let load = |opts: &ExpertOptions| -> std::result::Result<sluice_runtime::DecoderModel, String> {
        let config = ModelConfig::load(dir).map_err(|e| e.to_string())?;
        load_model_with(dir, config, opts).map_err(|e| e.to_string())
    };
    let base = ExpertOptions {
        backend,
        ..ExpertOptions::default()
    };
    let resident_opts = ExpertOptions {
        mode: ExpertMode::Resident,
        ..base.clone()
    };
    let mut streamed = None;
    let resident = load(&resident_opts).and_then(|m| {
        let report = golden::check(&m, &golden).map_err(|e| e.to_string())?;
        if let Some(slot) = m.expert_slot_len() {
            // One layer's experts: every token evicts and rereads records.
            let opts = ExpertOptions {
                mode: ExpertMode::Stream,
                cache_bytes: Some((slot * m.info.num_experts) as u64),
                io_depth: 4,
                ..base.clone()
            };
            streamed = Some(load(&opts).and_then(|s| golden::check(&s, &golden).map_err(|e| e.to_string())));
        }
        Ok(report)
    });
    FixtureResult {
        name,
        resident,
        streamed,
    }
}

/// Writes a Qwen3-30B-A3B-shaped model of `--bench-size`, benches it resident-or-auto with cold and warm runs
/// and the probes, prints the figures, and deletes the model.
fn run_bench(a: &SelftestArgs, backend: BackendKind) -> Result<()> {
    let parent = a.bench_dir.clone().unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::Builder::new()
        .prefix("sluice-selftest-")
        .tempdir_in(&parent)
        .with_context(|| format!("making a directory in {}", parent.display()))?;
    let model = tmp.path().join("model");
    // Arguments as the OS spells them: a lossy path would be another directory, which nothing deletes.
    let args = |words: &[&str], path_after: &str| -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = words.iter().map(Into::into).collect();
        let at = v.iter().position(|w| w == path_after).map_or(v.len(), |i| i + 1);
        v.insert(at, model.clone().into_os_string());
        v
    };
    let size = a.bench_size.to_string();
    let synth_args = Wrap::<SynthArgs>::try_parse_from(args(
        &["synth", "--shape", "qwen3-30b-a3b", "--size", &size, "-o"],
        "-o",
    ))?;
    let t = Instant::now();
    synth::run(synth_args.inner)?;
    let written = t.elapsed().as_secs_f64();
    let backend_name = format!("{backend:?}").to_lowercase();
    let probe = a.probe_seconds.to_string();
    let bench_args = Wrap::<BenchArgs>::try_parse_from(args(
        &[
            "bench",
            "-m",
            "-p",
            "16",
            "-n",
            "16",
            "--probe-seconds",
            &probe,
            "--backend",
            &backend_name,
        ],
        "-m",
    ))?;
    let r = bench::measure_all(&bench_args.inner)?;
    let model_bytes = dir_bytes(&model);
    // The model is deleted before anything is printed: a reader that leaves (`| head`) ends the process at
    // the next line, before any destructor runs.
    drop(tmp);
    println!(
        "bench: Qwen3-30B-A3B shapes, {} layers, {:.2} GB (written in {written:.1} s), experts {}, \
         {:.1} MB of experts per token",
        r.layers,
        model_bytes as f64 / 1e9,
        r.mode,
        r.expert_bytes_per_token as f64 / 1e6
    );
    for run in &r.runs {
        println!(
            "- {}: prefill {:.2} tok/s, decode {:.2} tok/s, {:.1} MB read per token, hit rate {:.0}%",
            run.run,
            run.prefill_tok_s,
            run.decode_tok_s,
            run.read_bytes_per_token / 1e6,
            100.0 * run.hit_rate
        );
    }
    if let Some(d) = r.disk_probe_gb_s {
        println!(
            "- disk probe: {d:.2} GB/s (random reads of one {:.2} MiB record at depth {})",
            r.record_bytes as f64 / 1048576.0,
            r.io_depth
        );
    }
    if let Some(d) = r.dram_probe_gb_s {
        println!("- DRAM probe: {d:.1} GB/s");
    }
    Ok(())
}

/// Total size of the files in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Parses another command's arguments from a list (the selftest reuses synth's and bench's flags and
/// their defaults).
#[derive(Parser)]
struct Wrap<T: Args> {
    #[command(flatten)]
    inner: T,
}
