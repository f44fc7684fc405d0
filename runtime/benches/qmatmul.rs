//! Quantized matmul throughput against this machine's own DRAM read bandwidth, measured in the same run.
//!
//! `cargo bench -p sluice-runtime --bench qmatmul` (add `-- --quick` for a shorter run). Decode (one token) is
//! bound by streaming weight bytes, so its figure is weight GB/s and the ratio to the DRAM probe, once with each
//! matrix split across the threads (as attention's projections run) and once with whole matrices per thread
//! (as a layer's experts run); prefill reuses each unpacked row across tokens, so its figure is GFLOP/s. With
//! the int8 kernels on a CPU that has a tiled kernel (AVX-512 VNNI or AVX2), a last row measures the same
//! matrices repacked into tiles. `SLUICE_BENCH_BITS=8` measures 8-bit codes instead of 4-bit ones.

use std::hint::black_box;
use std::time::{Duration, Instant};

use sluice_runtime::cpu::{tiled, FloatType, Isa, MatRef, QuantMatrix, TiledMatrix};

struct Expert {
    packed: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // SLUICE_KERNELS=q8 measures the int8-activation kernels instead of the exact ones.
    let q8 = std::env::var("SLUICE_KERNELS").is_ok_and(|v| v == "q8");
    sluice_runtime::cpu::q8::set_q8_activations(q8);
    // As `sluice` runs a model: this thread is worker 0 of the compute pool, and each measurement is one step
    // with the workers awake (parallel loops go to the step's team).
    let _pool = sluice_runtime::threads::join_compute_pool(None).expect("compute pool");
    // A Qwen3-30B-A3B expert gate/up; SLUICE_BENCH_BITS=8 measures 8-bit codes (as routers and 8-bit models have).
    let bits: u32 = match std::env::var("SLUICE_BENCH_BITS").as_deref() {
        Ok("8") => 8,
        _ => 4,
    };
    let (rows, cols, group) = (768usize, 2048usize, 64usize);
    // 192 × 0.88 MB exceeds the private caches; SLUICE_BENCH_MATRICES=2 measures cache-resident compute.
    let count = std::env::var("SLUICE_BENCH_MATRICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 64 } else { 192 });
    let experts: Vec<Expert> = (0..count)
        .map(|e| Expert {
            packed: (0..rows * cols * bits as usize / 8)
                .map(|i| (i * 31 + e) as u8)
                .collect(),
            scales: vec![0x3c; rows * cols / group * 2],
            biases: vec![0xbc; rows * cols / group * 2],
        })
        .collect();
    fn view(e: &Expert, bits: u32, group: usize, rows: usize, cols: usize) -> MatRef<'_> {
        MatRef::Quant(QuantMatrix {
            packed: &e.packed,
            scales: &e.scales,
            biases: &e.biases,
            scale_type: FloatType::BF16,
            bits,
            group,
            rows,
            cols,
        })
    }
    let mat = |e| view(e, bits, group, rows, cols);
    let bytes_per = experts[0].packed.len() + experts[0].scales.len() * 2;
    let probe = sluice_runtime::cpu::dram_read_probe(512 << 20, Duration::from_millis(if quick { 300 } else { 1000 }));
    let dram = probe.best();
    println!(
        "threads: {}   DRAM read probe: {dram:.1} GB/s (one stream per thread {:.1}, four {:.1})   kernels: {}",
        rayon::current_num_threads(),
        probe.one_stream,
        probe.four_streams,
        if q8 { "q8" } else { "exact" }
    );
    println!(
        "matrix {rows}×{cols}, {bits}-bit g{group}, {:.2} MB each, {count} distinct (cache-cold cycle); tiles in \
         panels of {}",
        bytes_per as f64 / 1e6,
        sluice_runtime::cpu::panel_tiles()
    );
    // The tiled copies, when this CPU runs the tiled kernel (the cpu backend's layout for 4-bit matrices).
    let tiles: Vec<Vec<u8>> = match q8 && sluice_runtime::cpu::q8::tiled_kernel_on(Isa::detect()) {
        true => experts
            .iter()
            .filter_map(|e| match mat(e) {
                MatRef::Quant(q) => tiled::tile(&q, sluice_runtime::cpu::panel_tiles().into()),
                _ => None,
            })
            .collect(),
        false => Vec::new(),
    };
    let mut rows_to_run: Vec<(String, Isa, Vec<MatRef<'_>>)> = Isa::available()
        .into_iter()
        .map(|isa| (format!("{isa:?}"), isa, experts.iter().map(mat).collect()))
        .collect();
    if !tiles.is_empty() {
        rows_to_run.push((
            "tiled".into(),
            Isa::detect(),
            tiles.iter().map(|t| tiled_view(t, group, rows, cols)).collect(),
        ));
    }
    let run = Run {
        rows,
        cols,
        count,
        bytes_per,
        quick,
        dram,
    };
    for (name, isa, mats) in &rows_to_run {
        sluice_runtime::threads::with_workers_awake(|| run.measure(name, *isa, mats));
    }
    if !tiles.is_empty() {
        let quants: Vec<QuantMatrix<'_>> = (experts.iter())
            .filter_map(|e| match mat(e) {
                MatRef::Quant(q) => Some(q),
                _ => None,
            })
            .collect();
        run.measure_tiling(&quants);
    }
}

/// What every row shares: the matrices' shape and count, and the DRAM probe.
struct Run {
    rows: usize,
    cols: usize,
    count: usize,
    bytes_per: usize,
    quick: bool,
    dram: f64,
}

impl Run {
    /// One row: decode weight GB/s over `mats` (cycled), prefill GFLOP/s over the first 32.
    fn measure(&self, name: &str, isa: Isa, mats: &[MatRef<'_>]) {
        let (rows, cols, count) = (self.rows, self.cols, self.count);
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut y = vec![0f32; rows];
        // At least one pass: more matrices than the pass budget would otherwise measure nothing.
        let passes = ((if self.quick { 128 } else { 960 }) / count.max(1)).max(1);
        let t = Instant::now();
        for _ in 0..passes {
            for m in mats {
                m.matmul(isa, &x, 1, &mut y);
                black_box(&y);
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let gbps = (passes * count * self.bytes_per) as f64 / secs / 1e9;
        // As decode runs a layer's experts: eight at a time, each expert's three matrices one after another on one
        // thread, with no split of a matrix across threads (a split costs each matrix a fork and a join).
        let t = Instant::now();
        for _ in 0..passes {
            for layer in mats.chunks(24) {
                let experts: Vec<&[MatRef<'_>]> = layer.chunks(3).collect();
                sluice_runtime::threads::parallel_map(&experts, |expert| {
                    let mut y = vec![0f32; rows];
                    for m in expert.iter() {
                        sluice_runtime::cpu::matmul_many(isa, std::slice::from_ref(m), &x, 1, &mut [&mut y[..]], false);
                    }
                    black_box(&y);
                });
            }
        }
        let whole = (passes * count * self.bytes_per) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let n = 32;
        let xs: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut ys = vec![0f32; n * rows];
        let t = Instant::now();
        for m in mats.iter().take(32.min(count)) {
            m.matmul(isa, &xs, n, &mut ys);
            black_box(&ys);
        }
        let gflops = (32.min(count) * 2 * n * rows * cols) as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!(
            "{name}: decode {gbps:.2} GB/s of weights = {:.1}% of DRAM (whole matrices per thread, as decode's experts: \
             {whole:.2} GB/s = {:.1}%) | prefill (32 tokens) {gflops:.1} GFLOP/s",
            100.0 * gbps / self.dram,
            100.0 * whole / self.dram
        );
    }
}

impl Run {
    /// Repacking stored matrices into tiles on one thread, as an expert-store I/O thread does for each record
    /// it reads: from DRAM (every matrix once, cycled) and cache-hot (one matrix again and again).
    fn measure_tiling(&self, quants: &[QuantMatrix<'_>]) {
        let len = tiled::tiled_len(self.rows, self.cols, quants[0].group, quants[0].scale_type);
        // Written once first, so the timing does not include the first touch of fresh pages.
        let mut outs: Vec<Vec<u8>> = quants.iter().map(|_| vec![1u8; len]).collect();
        let passes = if self.quick { 2 } else { 5 };
        let time = |picks: &mut dyn FnMut() -> Option<usize>, outs: &mut [Vec<u8>]| {
            let (t, mut n) = (Instant::now(), 0usize);
            while let Some(i) = picks() {
                assert!(tiled::tile_into(
                    &quants[i],
                    sluice_runtime::cpu::panel_tiles().into(),
                    &mut outs[i]
                ));
                black_box(&outs[i]);
                n += 1;
            }
            (t.elapsed().as_secs_f64(), n)
        };
        let mut order = (0..passes).flat_map(|_| 0..quants.len());
        let (cold, n_cold) = time(&mut || order.next(), &mut outs);
        let mut hot = std::iter::repeat_n(0, passes * quants.len());
        let (warm, n_warm) = time(&mut || hot.next(), &mut outs);
        // A record is three such matrices (gate, up, down).
        let ms_per_record = |secs: f64, n: usize| 3e3 * secs / n as f64;
        let gbps = |secs: f64, n: usize| (n * self.bytes_per) as f64 / secs / 1e9;
        println!(
            "tiling (one thread, as the I/O threads repack each record read): from DRAM {:.2} GB/s = {:.1}% of DRAM, \
             {:.3} ms per 3-matrix record | cache-hot {:.2} GB/s, {:.3} ms per record",
            gbps(cold, n_cold),
            100.0 * gbps(cold, n_cold) / self.dram,
            ms_per_record(cold, n_cold),
            gbps(warm, n_warm),
            ms_per_record(warm, n_warm),
        );
    }
}

/// A tiled matrix as the kernels take it.
fn tiled_view(data: &[u8], group: usize, rows: usize, cols: usize) -> MatRef<'_> {
    MatRef::Tiled(TiledMatrix {
        data,
        scale_type: FloatType::BF16,
        group,
        rows,
        cols,
        panel: sluice_runtime::cpu::panel_tiles().into(),
    })
}
