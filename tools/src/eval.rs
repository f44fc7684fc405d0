//! `sluice eval`: what each `--top-k` costs in quality (perplexity, KL and top-1 agreement against the model's
//! own k) and what it buys in speed (decode tok/s, expert bytes per token), from one run.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use sluice_runtime::eval::{default_top_ks, evaluate, parse_top_ks, window_count, EvalOptions, QualityRow};
use sluice_runtime::memory_plan::ExpertPlacement;
use sluice_runtime::{Pipeline, Prompt};

use crate::bench::measure;
use crate::store_cmds::EngineArgs;

/// Arguments of `sluice eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// Model directory or packed store.
    #[arg(short = 'm', long, env = "SLUICE_MODEL")]
    model: PathBuf,
    /// UTF-8 text to evaluate on (tokenized whole, as the model's tokenizer does).
    #[arg(long)]
    text: PathBuf,
    /// Experts-per-token values: a list (`1,2,4,8`) or `all`. Default: every value from 1 to the model's own,
    /// then doubling up to every expert.
    #[arg(long)]
    top_k: Option<String>,
    /// Tokens per window; each window starts from an empty cache (`mlx_lm.perplexity`'s rule).
    #[arg(short = 'c', long, default_value_t = 512)]
    ctx: usize,
    /// Evaluate only the first N windows (default: every full window of the text).
    #[arg(long)]
    windows: Option<usize>,
    /// Tokens of the text decoded one at a time per k to measure speed (0: skip the speed half).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also draw quality and speed against experts per token into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long, env = "SLUICE_THREADS")]
    threads: Option<usize>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// One experts-per-token value: its quality and its speed.
#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    quality: QualityRow,
    /// Expert weight bytes one token uses at this k (every MoE layer).
    expert_bytes_per_token: u64,
    /// Decode speed, tokens of the text fed one at a time.
    decode_tok_s: Option<f64>,
    /// Expert bytes read from disk per decoded token (0 when resident).
    read_bytes_per_token: Option<f64>,
    /// Expert cache hit rate during the decode measurement.
    hit_rate: Option<f64>,
}

/// Everything `eval` reports.
#[derive(Serialize)]
struct Report {
    model: String,
    text: String,
    text_tokens: usize,
    ctx: usize,
    windows: usize,
    own_top_k: usize,
    experts: usize,
    mode: String,
    backend: String,
    rows: Vec<Row>,
}

/// The most experts per token a `--top-k` list asks for (`all`, or no list: every expert, as many as there are).
fn most_top_k(spec: Option<&str>) -> usize {
    let listed = spec.and_then(|s| (s.split(',').map(|k| k.trim().parse::<usize>().ok())).collect::<Option<Vec<_>>>());
    listed.and_then(|ks| ks.into_iter().max()).unwrap_or(usize::MAX)
}

/// Runs `sluice eval`.
pub fn run(a: EvalArgs) -> Result<()> {
    if a.windows == Some(0) {
        bail!("--windows must be at least 1 (leave it out to evaluate every full window of the text)");
    }
    let _pool = crate::compute_pool(a.threads)?;
    let text = std::fs::read_to_string(&a.text).with_context(|| format!("reading {}", a.text.display()))?;
    let mut opts = a.engine.options()?;
    opts.context = Some(a.ctx);
    // Each window is one forward pass of `ctx` tokens: the plan budgets its activations, and the window's
    // logits at every position three times over: the reference's, the head's output and its copy per sequence.
    opts.prefill_chunk = Some(a.ctx);
    opts.logit_rows = 3 * a.ctx;
    // Each token's routes hold their experts' inputs and outputs: planned for the most experts evaluated (the
    // default list ends at all of them).
    opts.top_k = Some(most_top_k(a.top_k.as_deref()));
    opts.threads = a.threads;
    let p = Pipeline::load_with(&a.model, &opts).with_context(|| format!("loading {}", a.model.display()))?;
    let m = &p.model;
    if a.engine.verbose {
        eprintln!("{}", m.memory_plan);
    }
    let experts = m.info.num_experts;
    let own = m.info.default_top_k;
    let top_ks = match &a.top_k {
        Some(spec) => parse_top_ks(spec, experts)?,
        None if experts == 0 => bail!("{} has no routed experts: nothing to vary", a.model.display()),
        None => default_top_ks(own, experts),
    };
    let ids = p.tokenize(&Prompt::Raw(text))?;
    let eval_opts = EvalOptions {
        ctx: a.ctx,
        top_ks: top_ks.clone(),
        max_windows: a.windows,
    };
    let windows = window_count(ids.len(), &eval_opts);
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} forwards, {elapsed} (eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!(
        "{windows} windows of {} tokens × {} values of k",
        a.ctx,
        top_ks.len()
    ));
    let quality = evaluate(m, &ids, &eval_opts, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();

    // Each layer's own record size (mixed-precision layers differ).
    let records_per_k: u64 = m.info.expert_record_bytes_by_layer.iter().sum();
    let mut rows = Vec::new();
    for q in quality {
        let speed = if a.decode_tokens > 0 {
            // A short prompt, then the text's next tokens one at a time: bench's decode measurement. A small
            // --ctx leaves room for some decode tokens after it.
            let prompt = (16.min(ids.len().saturating_sub(2))).min(m.context_limit() / 2).max(1);
            let n = a
                .decode_tokens
                .min(ids.len() - prompt)
                .min(m.context_limit().saturating_sub(prompt));
            if n == 0 {
                bail!("the text is too short to measure decode speed; pass --decode-tokens 0");
            }
            // Streamed, every k starts from the same empty caches, as bench's cold run: else each would find the
            // experts the quality pass and the k before it left behind, and a later k would read less for it.
            if m.memory_plan.placement == ExpertPlacement::Stream {
                m.drop_expert_caches()?;
            }
            Some(measure(
                m,
                &format!("k={}", q.top_k),
                &ids[..prompt + n],
                prompt,
                m.memory_plan.prefill_chunk,
                q.top_k,
                None,
            )?)
        } else {
            None
        };
        rows.push(Row {
            expert_bytes_per_token: records_per_k * q.top_k as u64,
            decode_tok_s: speed.as_ref().map(|s| s.decode_tok_s),
            read_bytes_per_token: speed.as_ref().map(|s| s.read_bytes_per_token),
            hit_rate: speed.as_ref().map(|s| s.hit_rate),
            quality: q,
        });
    }
    let report = Report {
        model: a.model.display().to_string(),
        text: a.text.display().to_string(),
        text_tokens: ids.len(),
        ctx: a.ctx,
        windows,
        own_top_k: own,
        experts,
        mode: format!("{:?}", m.memory_plan.placement).to_lowercase(),
        backend: m.backend().into(),
        rows,
    };
    if let Some(path) = &a.plot {
        plot(&report, path).with_context(|| format!("drawing {}", path.display()))?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(r: &Report) {
    println!(
        "{}: {} windows of {} tokens from {} ({} tokens); {} experts, own k {}; {} backend, experts {}",
        r.model, r.windows, r.ctx, r.text, r.text_tokens, r.experts, r.own_top_k, r.backend, r.mode
    );
    println!();
    println!("| experts/token | perplexity | vs own k | KL (nats/token) | top-1 agreement | decode tok/s | expert MB/token | read MB/token |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    let own_ppl = r
        .rows
        .iter()
        .find(|x| x.quality.top_k == r.own_top_k)
        .map(|x| x.quality.perplexity);
    let opt =
        |v: Option<f64>, scale: f64, digits: usize| v.map_or("—".into(), |v| format!("{:.*}", digits, v * scale));
    for row in &r.rows {
        let q = &row.quality;
        println!(
            "| {}{} | {:.3} | {} | {:.4} | {:.3} | {} | {:.2} | {} |",
            q.top_k,
            if q.top_k == r.own_top_k { " (own)" } else { "" },
            q.perplexity,
            own_ppl.map_or("—".into(), |o| format!("{:+.1}%", (q.perplexity / o - 1.0) * 100.0)),
            q.kl,
            q.top1_agreement,
            opt(row.decode_tok_s, 1.0, 1),
            row.expert_bytes_per_token as f64 / 1e6,
            opt(row.read_bytes_per_token, 1e-6, 2),
        );
    }
}

/// Quality (perplexity, KL) and speed (decode tok/s) against experts per token, side by side.
fn plot(r: &Report, path: &Path) -> Result<()> {
    use plotters::prelude::*;

    let root = SVGBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(500);
    let kmax = r.rows.iter().map(|x| x.quality.top_k as f64).fold(1.0, f64::max);
    let series = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
        r.rows
            .iter()
            .filter_map(|x| f(x).map(|v| (x.quality.top_k as f64, v)))
            .collect()
    };
    let draw = |area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
                title: &str,
                y_label: &str,
                points: Vec<(f64, f64)>,
                color: RGBColor|
     -> Result<()> {
        if points.is_empty() {
            return Ok(());
        }
        let lo = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
        let hi = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
        let pad = ((hi - lo) * 0.1).max(hi.abs() * 0.01).max(1e-9);
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(0.5..kmax + 0.5, (lo - pad)..(hi + pad))?;
        chart
            .configure_mesh()
            .x_desc("experts per token (--top-k)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_desc(y_label)
            .draw()?;
        chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?;
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        Ok(())
    };
    let name = Path::new(&r.model)
        .file_name()
        .map_or(r.model.clone(), |n| n.to_string_lossy().into());
    draw(
        &left,
        &format!("quality: {name}"),
        "perplexity",
        series(&|x| Some(x.quality.perplexity)),
        RED,
    )?;
    draw(&right, "speed", "decode tok/s", series(&|x| x.decode_tok_s), BLUE)?;
    root.present()?;
    Ok(())
}
