//! `sluice doctor`'s arithmetic: what a model needs, from its `config.json` alone, and the decode speed this
//! machine's probes forecast at each experts-per-token value.
//!
//! The forecast (the README states it too): one decode step reads every resident matrix once (attention,
//! routers, dense and shared MLPs, the head; one embedding row) and `k` expert records per MoE layer.
//! * compute: bytes read ÷ the matvec probe's bandwidth (sluice's own kernel at the model's quantization, on
//!   matrices larger than the caches) + one probed call overhead per kernel call;
//! * I/O, when experts stream: a record misses with probability 1 − h, where h = cached records ÷ all records
//!   (uniform routing in steady state: what random weights and `sluice bench`'s random tokens give; real
//!   routing is skewed, so real hit rates are higher); cold, h = 0. A layer's m = k(1 − h) misses are read
//!   together, so they run min(m, io depth) deep, and the disk's bandwidth at that depth (probed at 1, 2, 4, …
//!   reads in flight, interpolated between) prices them: the engine reads one layer at a time, and one or two
//!   reads in flight get a fraction of what eight get;
//! * each MoE layer waits for the longer of its reads and its experts' compute: experts are computed as their
//!   records land, but reads in flight share the disk and land together, so the last wave's min(m, depth)
//!   records are computed after the reads end; everything else adds up.
//!
//! No constant in it is fitted to a benchmark: its inputs are the probes and the shapes.

use serde::Serialize;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::memory_plan::{ExpertPlacement, MemoryPlan, ModelFootprint};
use crate::models::{describe_config, FfnPlan};
use crate::options::{BackendKind, ExpertOptions};
use crate::quant::{QuantMode, QuantSpec};

/// A model's sizes, from its config (and the safetensors index's total, when given).
#[derive(Debug, Clone, Serialize)]
pub struct ModelSize {
    /// `model_type`.
    pub model_type: String,
    /// Decoder layers.
    pub layers: usize,
    /// Layers with routed experts.
    pub moe_layers: usize,
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// The model's own experts per token.
    pub top_k: usize,
    /// Bytes of every weight that is not a routed expert.
    pub resident_bytes: u64,
    /// Resident bytes one decode step reads (all but the embedding table, of which one row).
    pub resident_read_per_token: u64,
    /// Mean bytes of one expert of one layer (gate, up and down).
    pub record_bytes: u64,
    /// Bytes of every routed expert.
    pub expert_bytes: u64,
    /// Kernel calls one decode step makes outside the routed experts.
    pub resident_calls_per_token: usize,
    /// Bytes per weight of the quantized matrices.
    pub bytes_per_weight: f64,
    /// Whether the totals were scaled to the index's exact `total_size`.
    pub exact: bool,
    /// The memory planner's view of it.
    #[serde(skip)]
    pub footprint: ModelFootprint,
}

/// Bytes per weight of a matrix stored with `spec` (scales and biases in `float_bytes`), or unquantized.
pub fn bytes_per_weight(spec: Option<QuantSpec>, float_bytes: usize) -> f64 {
    match spec {
        None => float_bytes as f64,
        Some(s) => {
            let per_group = match s.mode {
                QuantMode::Affine => 2 * float_bytes, // scale and bias
                QuantMode::Mxfp4 | QuantMode::Mxfp8 | QuantMode::Nvfp4 => 1,
            };
            s.bits as f64 / 8.0 + per_group as f64 / s.group_size.max(1) as f64
        }
    }
}

/// Sizes a model from its config as `opts` would load it (its KV cache's element type, its prefill
/// activations at `--top-k`, the backend's copies); `index_total` (the safetensors index's
/// `metadata.total_size`) rescales the estimate to the exact total.
pub fn size_from_config(config: &ModelConfig, index_total: Option<u64>, opts: &ExpertOptions) -> Result<ModelSize> {
    let arch = describe_config(config)?;
    let d = &arch.dims;
    let float_bytes = match config.text.get("torch_dtype").and_then(|v| v.as_str()) {
        Some("float32") => 4,
        _ => 2,
    };
    let bpw = bytes_per_weight(config.quant.default, float_bytes);
    // Bytes of the float tensors among the matrices sized (scales and biases, unquantized matrices).
    let floats = std::cell::Cell::new(0u64);
    // One matrix [rows, cols] of module `path`: quantized per the config's entry for it when its rows split
    // into whole groups (mlx-lm's rule), else floats.
    // The config's quantization entry for module `path` (under a VLM's `language_model.` too).
    let spec = |path: &str| config.quant.spec_for(path, Some(&format!("language_model.{path}")));
    let mat = |path: &str, rows: usize, cols: usize| -> u64 {
        let (all, float) = match spec(path) {
            Some(q) if cols.is_multiple_of(q.group_size.max(1)) => {
                let all = (rows as f64 * cols as f64 * bytes_per_weight(Some(q), float_bytes)) as u64;
                (all, all - (rows as f64 * cols as f64 * q.bits as f64 / 8.0) as u64)
            }
            _ => ((rows * cols * float_bytes) as u64, (rows * cols * float_bytes) as u64),
        };
        floats.set(floats.get() + float);
        all
    };
    let (h, a) = (d.hidden, &d.attn);
    let fb = float_bytes as u64;
    // Bytes a decode step reads from resident weights, bytes of vectors, kernel calls outside the experts.
    let (mut per_token, mut vectors, mut calls) = (0u64, 0u64, 0usize);
    let (mut all_experts, mut moe_layers, mut num_experts) = (0u64, 0usize, 0usize);
    // Records of every MoE layer, and the longest (mixed-precision layers differ).
    let (mut records, mut longest) = (0u64, 0u64);
    // Whether records of tileable layers are rewritten as they land (see `rewritten`).
    let tiling = opts.backend == BackendKind::Cpu && crate::cpu::q8::tiled_kernel_on(crate::cpu::Isa::detect());
    let mut rewritten = false;
    for (i, ffn) in arch.ffn.iter().enumerate() {
        vectors += 2 * h as u64 * fb;
        let linear = d.hybrid.as_ref().is_some_and(|x| x.linear[i]);
        if let (true, Some(hy)) = (linear, &d.hybrid) {
            let x = &hy.delta;
            let (kd, vd) = (x.key_dim(), x.value_dim());
            let l = |m: &str| format!("model.layers.{i}.linear_attn.{m}");
            per_token += mat(&l("in_proj_qkvz"), 2 * kd + 2 * vd, h)
                + mat(&l("in_proj_ba"), 2 * x.v_heads, h)
                + mat(&l("out_proj"), h, vd);
            vectors += ((2 * kd + vd) * x.kernel + 2 * x.v_heads + x.v_dim) as u64 * fb;
            calls += 3;
        } else {
            let gate = if d.hybrid.is_some() { 2 } else { 1 };
            let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
            let l = |m: &str| format!("model.layers.{i}.self_attn.{m}");
            per_token += mat(&l("q_proj"), q * gate, h)
                + mat(&l("k_proj"), kv, h)
                + mat(&l("v_proj"), kv, h)
                + mat(&l("o_proj"), h, q);
            vectors += if d.qk_norm { 2 * a.head_dim as u64 * fb } else { 0 };
            calls += 4;
        }
        match ffn {
            FfnPlan::Dense { inter, prefix } => {
                let l = |m: &str| format!("{prefix}.{m}");
                per_token +=
                    mat(&l("gate_proj"), *inter, h) + mat(&l("up_proj"), *inter, h) + mat(&l("down_proj"), h, *inter);
                calls += 3;
            }
            FfnPlan::Moe {
                num_experts: e,
                inter,
                shared,
                prefix,
            } => {
                let l = |m: &str| format!("{prefix}.{m}");
                moe_layers += 1;
                num_experts = *e;
                // Expert records are served as stored, whatever the backend: not among the resident floats.
                let resident_floats = floats.get();
                let record = mat(&l("switch_mlp.gate_proj"), *inter, h)
                    + mat(&l("switch_mlp.up_proj"), *inter, h)
                    + mat(&l("switch_mlp.down_proj"), h, *inter);
                floats.set(resident_floats);
                let sh = |si: usize| {
                    mat(&l("shared_expert.gate_proj"), si, h)
                        + mat(&l("shared_expert.up_proj"), si, h)
                        + mat(&l("shared_expert.down_proj"), h, si)
                        + mat(&l("shared_expert_gate"), 1, h)
                };
                // Saturating: sizes within the config's limits can still multiply past u64 (a corrupt config).
                all_experts = all_experts.saturating_add((*e as u64).saturating_mul(record));
                records += *e as u64;
                longest = longest.max(record);
                // The cpu backend rewrites 4-bit records into its int8 kernels' tiles as they land.
                rewritten |= tiling
                    && spec(&l("switch_mlp.gate_proj")).is_some_and(|q| {
                        q.mode == QuantMode::Affine && crate::cpu::tiled::tiles(q.bits, q.group_size, h)
                    });
                per_token += mat(&l("gate"), *e, h) + shared.map_or(0, sh);
                calls += 1 + shared.map_or(0, |_| 4);
            }
        }
    }
    // The final norm.
    vectors += h as u64 * fb;
    let before_table = floats.get();
    let table = mat("model.embed_tokens", d.vocab, h);
    if !d.tie_embeddings {
        // An untied table stays in the mapped file (rows are looked up on the host), on every backend.
        floats.set(before_table);
    }
    let head = if d.tie_embeddings {
        0
    } else {
        mat("lm_head", d.vocab, h)
    };
    calls += 1;
    let mut resident = per_token + table + head + vectors;
    // The mlx backend keeps every 16-bit float tensor it uploads as an f32 copy: twice its bytes (as the
    // loader counts them, `expert_source::weight_bytes`).
    let mut copies = match (opts.backend, float_bytes) {
        (BackendKind::Mlx, 2) => floats.get() + vectors,
        _ => 0,
    };
    // A step reads the head (or the tied table as one) whole, and one embedding row.
    let mut read = per_token + if d.tie_embeddings { table } else { head } + table / d.vocab.max(1) as u64 + vectors;
    let exact = index_total.is_some();
    if let Some(total) = index_total {
        let est = resident.saturating_add(all_experts);
        if est > 0 {
            let f = total as f64 / est as f64;
            resident = (resident as f64 * f) as u64;
            copies = (copies as f64 * f) as u64;
            read = (read as f64 * f) as u64;
            all_experts = (all_experts as f64 * f) as u64;
            longest = (longest as f64 * f) as u64;
        }
    }
    let expert_bytes = all_experts;
    let record = all_experts / (moe_layers * num_experts).max(1) as u64;
    let mut footprint = crate::models::footprint(&arch, opts);
    footprint.resident_weights = resident + copies;
    // Planned as the loader plans them: the slots every record would take.
    footprint.expert_bytes = crate::expert_source::slot_arena_bytes(records, longest);
    // As the loader counts them: each I/O thread's buffer to read a record into before rewriting it.
    if rewritten {
        footprint.io_buffers = crate::expert_source::slot_arena_bytes(opts.io_depth.max(1) as u64, longest);
    }
    Ok(ModelSize {
        model_type: config.model_type.clone(),
        layers: d.layers,
        moe_layers,
        num_experts,
        top_k: d.top_k,
        resident_bytes: resident,
        resident_read_per_token: read,
        record_bytes: record,
        expert_bytes,
        resident_calls_per_token: calls,
        bytes_per_weight: bpw,
        exact,
        footprint,
    })
}

/// What the machine measured.
#[derive(Debug, Clone, Serialize)]
pub struct MachineProbes {
    /// Random reads of one record bypassing the page cache, GB/s, at each probed depth (reads in flight),
    /// ascending; the last is the engine's depth.
    pub disk_gbps_by_depth: Vec<(usize, f64)>,
    /// Plain sequential DRAM reads, GB/s.
    pub dram_gbps: f64,
    /// sluice's matvec kernel at the model's quantization on matrices larger than the caches, GB/s of weights.
    pub matvec_gbps: f64,
    /// Seconds one small kernel call costs (dispatch to the thread pool and back).
    pub call_seconds: f64,
}

impl MachineProbes {
    /// Disk bandwidth at the engine's depth, GB/s (0 when the disk was not probed).
    pub fn disk_gbps(&self) -> f64 {
        self.disk_gbps_by_depth.last().map_or(0.0, |&(_, b)| b)
    }

    /// The probed curve, held to what a disk can do, from the engine's depth down: fewer reads in flight never
    /// get more bandwidth than more do, nor less per read. A short probe's noise breaks either (seen in CI:
    /// depth 4 more than twice depth 2), and then three misses forecast faster than two and a cold start
    /// faster than a warm one. The deepest probe, the one the engine runs at, is kept as measured.
    fn disk_curve(&self) -> Vec<(usize, f64)> {
        let mut curve = self.disk_gbps_by_depth.clone();
        for i in (1..curve.len()).rev() {
            let ((lo, b), (hi, above)) = (curve[i - 1], curve[i]);
            let floor = above * lo as f64 / hi.max(1) as f64;
            curve[i - 1].1 = b.min(above).max(floor);
        }
        curve
    }

    /// Disk bandwidth with `depth` reads in flight, GB/s: linear between the probed depths (held to what a
    /// disk can do), clamped to them.
    pub fn disk_gbps_at(&self, depth: f64) -> f64 {
        let d = &self.disk_curve();
        let Some(&(d0, b0)) = d.first() else {
            return 0.0;
        };
        if depth <= d0 as f64 {
            return b0;
        }
        for w in d.windows(2) {
            let ((lo, blo), (hi, bhi)) = (w[0], w[1]);
            if depth <= hi as f64 {
                let t = (depth - lo as f64) / (hi - lo).max(1) as f64;
                return blo + t * (bhi - blo);
            }
        }
        self.disk_gbps()
    }
}

/// The depths `doctor` probes the disk at: 1, 2, 4, … below `io_depth`, then `io_depth`.
pub fn probe_depths(io_depth: usize) -> Vec<usize> {
    let io_depth = io_depth.max(1);
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |d| Some(d * 2))
        .take_while(|&d| d < io_depth)
        .collect();
    v.push(io_depth);
    v
}

/// One experts-per-token value's forecast.
#[derive(Debug, Clone, Serialize)]
pub struct Forecast {
    /// Experts per token.
    pub top_k: usize,
    /// Assumed share of expert records found in memory (slot cache or page cache).
    pub hit_rate: f64,
    /// Expert bytes read from disk per token.
    pub read_bytes_per_token: f64,
    /// Seconds per token of compute.
    pub compute_seconds: f64,
    /// Seconds per token of waiting for the disk, after overlap with expert compute.
    pub io_wait_seconds: f64,
    /// Forecast decode speed.
    pub tok_s: f64,
    /// `compute` or `disk`: which term is larger.
    pub limited_by: &'static str,
}

/// The forecast at `top_k` for a model sized `s`, planned as `plan`, read `io_depth` records at a time, on a
/// machine measured as `p`. `cold`: every cache empty (the first tokens after a start). `page_cache`: bytes of
/// expert records the OS page cache may hold beside the slot cache (0 with direct I/O).
pub fn forecast(
    s: &ModelSize,
    plan: &MemoryPlan,
    p: &MachineProbes,
    io_depth: usize,
    top_k: usize,
    cold: bool,
    page_cache: u64,
) -> Forecast {
    let streamed = plan.placement != ExpertPlacement::Resident && s.expert_bytes > 0;
    let hit_rate = if !streamed {
        1.0
    } else if cold {
        0.0
    } else {
        // Records held, over all of them: the slot cache holds whole slots, each as long as the longest record
        // (aligned); the page cache holds records as stored.
        let records = (s.moe_layers * s.num_experts).max(1) as f64;
        let slot = (s.footprint.expert_bytes as f64 / records).max(1.0);
        let held = (plan.expert_cache as f64 / slot).floor() + page_cache as f64 / s.record_bytes.max(1) as f64;
        (held / records).min(1.0)
    };
    let bw = p.matvec_gbps * 1e9;
    let resident = s.resident_read_per_token as f64 / bw + s.resident_calls_per_token as f64 * p.call_seconds;
    let per_layer_compute = top_k as f64 * (s.record_bytes as f64 / bw + 3.0 * p.call_seconds);
    let misses = top_k as f64 * (1.0 - hit_rate);
    // A layer's misses are read together, min(m, io depth) in flight. Reads in flight share the disk, so a
    // wave of them lands together at the end: the last wave's records are computed after the layer's reads
    // (`last`); hits and earlier waves meanwhile.
    let (per_layer_io, last) = if misses > 0.0 {
        let depth = misses.clamp(1.0, io_depth.max(1) as f64);
        (
            misses * s.record_bytes as f64 / (p.disk_gbps_at(depth) * 1e9),
            depth * per_layer_compute / top_k.max(1) as f64,
        )
    } else {
        (0.0, 0.0)
    };
    let layers = s.moe_layers as f64;
    let compute = resident + layers * per_layer_compute;
    let step = resident + layers * per_layer_compute.max(per_layer_io + last);
    Forecast {
        top_k,
        hit_rate,
        read_bytes_per_token: layers * misses * s.record_bytes as f64,
        compute_seconds: compute,
        io_wait_seconds: step - compute,
        tok_s: 1.0 / step,
        limited_by: if per_layer_io + last > per_layer_compute {
            "disk"
        } else {
            "compute"
        },
    }
}

/// Checks a `--top-k` value against the model.
pub fn check_top_k(s: &ModelSize, k: usize) -> Result<()> {
    if s.num_experts > 0 && (k == 0 || k > s.num_experts) {
        return Err(ModelError::InvalidArgument(format!(
            "--top-k {k} is outside 1..={}",
            s.num_experts
        )));
    }
    Ok(())
}

/// Times sluice's matvec kernel (one token, rows split across the thread pool, as a decode step runs it) on
/// matrices stored like the model's (`spec`, else bf16; tiled where the cpu backend tiles them), `cols` wide:
/// returns (GB/s of weights over 256 MiB of distinct matrices, so from DRAM; seconds per call on a tiny
/// matrix, the fixed cost of a call).
pub fn matvec_probe(spec: Option<QuantSpec>, cols: usize, time: std::time::Duration) -> (f64, f64) {
    use crate::cpu::{FloatType, Isa};
    use crate::linear::WeightFormat;
    use std::time::Instant;

    let stored = match spec {
        // The cpu kernels implement affine codes; other modes are probed as affine of the same width.
        Some(s) => WeightFormat::Affine {
            bits: s.bits,
            group: s.group_size.max(1),
            scale_type: FloatType::BF16,
        },
        None => WeightFormat::Dense(FloatType::BF16),
    };
    let group = match stored {
        WeightFormat::Affine { group, .. } | WeightFormat::Tiled { group, .. } => group,
        WeightFormat::Dense(_) => 1,
    };
    let cols = cols.max(group).next_multiple_of(group.max(32));
    let isa = Isa::detect();
    // Small bf16 values (0x3c00 ≈ 0.0078) for scales and biases; codes from a counter.
    let fill = |n: usize, scale: bool| -> Vec<u8> {
        (0..n)
            .map(|i| {
                if scale {
                    [0x00u8, 0x3c][i % 2]
                } else {
                    (i * 131 % 251) as u8
                }
            })
            .collect()
    };
    // The cpu backend repacks 4-bit matrices into tiles where its tiled kernel runs: probe that kernel there.
    let panel = crate::cpu::panel_tiles();
    let tiled = match stored {
        WeightFormat::Affine { bits, scale_type, .. }
            if crate::cpu::tiled::tiles(bits, group, cols) && crate::cpu::q8::tiled_kernel_on(isa) =>
        {
            Some(WeightFormat::Tiled {
                group,
                scale_type,
                panel,
            })
        }
        _ => None,
    };
    let matrix = |rows: usize| -> Vec<Vec<u8>> {
        let parts: Vec<Vec<u8>> = stored
            .part_bytes(rows, cols)
            .iter()
            .enumerate()
            .map(|(i, &n)| fill(n, i > 0 || matches!(stored, WeightFormat::Dense(_))))
            .collect();
        let tiles = tiled.and_then(|_| match stored.view(rows, cols, &[&parts[0], &parts[1], &parts[2]]) {
            crate::cpu::MatRef::Quant(q) => crate::cpu::tiled::tile(&q, panel.into()),
            _ => None,
        });
        tiles.map_or(parts, |t| vec![t])
    };
    // What the step runs.
    let format = tiled.unwrap_or(stored);
    let run = |mats: &[Vec<Vec<u8>>], rows: usize, until: Instant| -> (f64, usize) {
        let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut y = vec![0f32; rows];
        let (mut bytes, mut calls) = (0usize, 0usize);
        let t0 = Instant::now();
        while Instant::now() < until || calls == 0 {
            for m in mats {
                let parts: Vec<&[u8]> = m.iter().map(|p| p.as_slice()).collect();
                format.view(rows, cols, &parts).matmul_with(isa, &x, 1, &mut y, true);
                bytes += parts.iter().map(|p| p.len()).sum::<usize>();
                calls += 1;
            }
        }
        (bytes as f64 / t0.elapsed().as_secs_f64(), calls)
    };
    let big_rows = 2048;
    let per = format.part_bytes(big_rows, cols).iter().sum::<usize>().max(1);
    let big: Vec<_> = (0..(256usize << 20).div_ceil(per)).map(|_| matrix(big_rows)).collect();
    let (bw, _) = run(&big, big_rows, Instant::now() + time / 2);
    let tiny = vec![matrix(16)];
    let t0 = Instant::now();
    let (_, calls) = run(&tiny, 16, t0 + time / 2);
    (bw / 1e9, t0.elapsed().as_secs_f64() / calls as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory_plan::{MachineMemory, PlanRequest};
    use crate::options::ExpertOptions;
    use crate::weights::Weights;
    use std::path::Path;

    /// The config-only estimate against every committed fixture's real tensors: within 3% overall, and the
    /// expert/resident split within 3% of each part (routed experts are what the forecast streams).
    #[test]
    fn sizes_from_config_match_the_checkpoints() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
        let mut checked = 0;
        for e in std::fs::read_dir(&root).unwrap() {
            let dir = e.unwrap().path();
            if !dir.join("config.json").exists() || dir.to_string_lossy().contains("overrides") {
                continue;
            }
            let config = ModelConfig::load(&dir).unwrap();
            let est = size_from_config(&config, None, &ExpertOptions::default()).unwrap();
            let w = Weights::open(&dir, config.clone()).unwrap();
            let total = w.checkpoint().total_bytes() as f64;
            let experts: f64 = w
                .checkpoint()
                .names()
                .filter(|n| n.contains("switch_mlp") || n.contains(".experts."))
                .map(|n| w.checkpoint().get(n).unwrap().bytes().len() as f64)
                .sum();
            let name = dir.file_name().unwrap().to_string_lossy().to_string();
            let got = (est.resident_bytes + est.expert_bytes) as f64;
            eprintln!(
                "{name}: estimate {got} vs {total}; experts {} vs {experts}",
                est.expert_bytes
            );
            assert!((got / total - 1.0).abs() < 0.03, "{name}: total {got} vs {total}");
            if experts > 0.0 {
                assert!(
                    (est.expert_bytes as f64 / experts - 1.0).abs() < 0.03,
                    "{name}: experts"
                );
            }
            // With the exact total, the sum is exact.
            let exact = size_from_config(&config, Some(total as u64), &ExpertOptions::default()).unwrap();
            let sum = (exact.resident_bytes + exact.expert_bytes) as f64;
            assert!((sum / total - 1.0).abs() < 1e-3, "{name}: {sum} vs {total}");
            // The mlx backend's f32 copies: the text model's 16-bit tensors it uploads (all but the experts and
            // an untied embedding table), as the loader counts them.
            let ck = w.checkpoint();
            let tied = !ck.names().any(|n| n.contains("lm_head."));
            let copied: f64 = (ck.names())
                .filter(|n| w.is_text_model(n) && !(n.contains("switch_mlp") || n.contains(".experts.")))
                .filter(|n| tied || !n.contains("embed_tokens."))
                .filter_map(|n| ck.get(n))
                .filter(|t| matches!(t.dtype, expert_store::Dtype::F16 | expert_store::Dtype::BF16))
                .map(|t| t.bytes().len() as f64)
                .sum();
            let mlx = ExpertOptions {
                backend: crate::options::BackendKind::Mlx,
                ..Default::default()
            };
            let on_mlx = size_from_config(&config, None, &mlx)
                .unwrap()
                .footprint
                .resident_weights;
            let copies = (on_mlx - est.footprint.resident_weights) as f64;
            eprintln!("{name}: copies {copies} vs {copied}");
            assert!(
                (copies / copied - 1.0).abs() < 0.03,
                "{name}: mlx copies {copies} vs {copied}"
            );
            checked += 1;
        }
        assert!(checked >= 20, "{checked}");
    }

    #[test]
    fn forecast_is_slower_with_more_experts_and_fewer_hits() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3_moe-q4g64");
        let s = size_from_config(&ModelConfig::load(&root).unwrap(), None, &ExpertOptions::default()).unwrap();
        let probes = MachineProbes {
            disk_gbps_by_depth: vec![(1, 0.5), (2, 1.0), (4, 2.0), (8, 2.0)],
            dram_gbps: 20.0,
            matvec_gbps: 10.0,
            call_seconds: 1e-9,
        };
        let machine = MachineMemory {
            total: 16 << 30,
            available: 8 << 30,
            gpu_working_set: None,
            cgroup_limit: None,
            measured: true,
        };
        let resident = MemoryPlan::new(
            machine,
            s.footprint,
            &PlanRequest::from_options(&ExpertOptions::default()),
        );
        let stream_opts = ExpertOptions {
            mode: crate::options::ExpertMode::Stream,
            cache_bytes: Some(s.record_bytes * 4),
            ..ExpertOptions::default()
        };
        let streamed = MemoryPlan::new(machine, s.footprint, &PlanRequest::from_options(&stream_opts));
        let r: Vec<_> = (1..=8)
            .map(|k| forecast(&s, &resident, &probes, 8, k, false, 0))
            .collect();
        for w in r.windows(2) {
            assert!(w[1].tok_s < w[0].tok_s);
            assert_eq!(w[0].hit_rate, 1.0);
        }
        let warm = forecast(&s, &streamed, &probes, 8, 3, false, 0);
        let cold = forecast(&s, &streamed, &probes, 8, 3, true, 0);
        // Four records' bytes make three 16 KiB slots (a record is 13.5 KiB): 3 of the 16 records.
        assert!(s.record_bytes < 16 << 10 && 4 * s.record_bytes >= 48 << 10);
        assert_eq!(warm.hit_rate, 3.0 / 16.0);
        assert_eq!(cold.hit_rate, 0.0);
        assert!(cold.tok_s < warm.tok_s && warm.tok_s < r[2].tok_s);
        // Disk time per layer beside compute per layer decides the label.
        assert_eq!(cold.limited_by, "disk");
        assert_eq!(
            cold.read_bytes_per_token,
            (3 * s.moe_layers as u64 * s.record_bytes) as f64
        );
        // One read in flight gets the depth-1 bandwidth: slower per record than three.
        let one = forecast(&s, &streamed, &probes, 8, 1, true, 0);
        assert!(one.io_wait_seconds + one.compute_seconds > (cold.io_wait_seconds + cold.compute_seconds) / 3.0);
    }

    #[test]
    fn disk_bandwidth_is_interpolated_between_probed_depths() {
        assert_eq!(probe_depths(8), vec![1, 2, 4, 8]);
        assert_eq!(probe_depths(6), vec![1, 2, 4, 6]);
        assert_eq!(probe_depths(1), vec![1]);
        let p = MachineProbes {
            disk_gbps_by_depth: vec![(1, 1.0), (2, 2.0), (4, 3.0), (8, 4.0)],
            dram_gbps: 0.0,
            matvec_gbps: 0.0,
            call_seconds: 0.0,
        };
        for (d, want) in [
            (0.5, 1.0),
            (1.0, 1.0),
            (1.5, 1.5),
            (3.0, 2.5),
            (6.0, 3.5),
            (8.0, 4.0),
            (16.0, 4.0),
        ] {
            assert!((p.disk_gbps_at(d) - want).abs() < 1e-12, "{d}: {}", p.disk_gbps_at(d));
        }
        assert_eq!(p.disk_gbps(), 4.0);
        // Noise that breaks either bound is held to it, from the deepest probe down.
        let noisy = MachineProbes {
            disk_gbps_by_depth: vec![(1, 0.1), (2, 2.5), (4, 1.0), (8, 4.0)],
            ..p
        };
        for (d, want) in [(1.0, 1.0), (2.0, 2.0), (3.0, 2.0), (4.0, 2.0), (8.0, 4.0)] {
            assert!(
                (noisy.disk_gbps_at(d) - want).abs() < 1e-12,
                "{d}: {}",
                noisy.disk_gbps_at(d)
            );
        }
    }

    #[test]
    fn a_cold_start_is_never_forecast_faster_than_a_warm_one() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3_moe-q4g64");
        let s = size_from_config(&ModelConfig::load(&root).unwrap(), None, &ExpertOptions::default()).unwrap();
        let machine = MachineMemory {
            total: 16 << 30,
            available: 8 << 30,
            gpu_working_set: None,
            cgroup_limit: None,
            measured: true,
        };
        // As `doctor`'s streamed case: four records of cache, three experts per token.
        let opts = ExpertOptions {
            mode: crate::options::ExpertMode::Stream,
            cache_bytes: Some(s.record_bytes * 4),
            ..ExpertOptions::default()
        };
        let plan = MemoryPlan::new(machine, s.footprint, &PlanRequest::from_options(&opts));
        // Short probes on a page-cached file: per-read rates that rise with depth, by noise.
        for curve in [
            vec![(1, 1.0), (2, 1.0), (4, 4.0), (8, 8.0)],
            vec![(1, 2.0), (2, 1.0), (4, 6.0), (8, 5.0)],
            vec![(1, 0.5), (2, 1.0), (4, 2.0), (8, 4.0)],
        ] {
            let probes = MachineProbes {
                disk_gbps_by_depth: curve.clone(),
                dram_gbps: 20.0,
                matvec_gbps: 10.0,
                call_seconds: 1e-6,
            };
            for k in 1..=8 {
                let warm = forecast(&s, &plan, &probes, 8, k, false, 0);
                let cold = forecast(&s, &plan, &probes, 8, k, true, 0);
                assert!(
                    cold.tok_s <= warm.tok_s,
                    "{curve:?} k={k}: {} > {}",
                    cold.tok_s,
                    warm.tok_s
                );
            }
        }
    }
}
