//! Quantized matmul throughput against this machine's own DRAM read bandwidth, measured in the same run.
//!
//! `cargo bench -p sluice-runtime --bench qmatmul` (add `-- --quick` for a shorter run). Decode (one token) is
//! bound by streaming weight bytes, so its figure is weight GB/s and the ratio to the DRAM probe; prefill
//! reuses each unpacked row across tokens, so its figure is GFLOP/s.

use std::hint::black_box;
use std::time::{Duration, Instant};

use sluice_runtime::cpu::{FloatType, Isa, MatRef, QuantMatrix};

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
    let (rows, cols, bits, group) = (768usize, 2048usize, 4u32, 64usize); // a Qwen3-30B-A3B expert gate/up
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
    let dram = sluice_runtime::cpu::dram_read_gbps(512 << 20, Duration::from_millis(if quick { 300 } else { 1000 }));
    println!(
        "threads: {}   DRAM read probe: {dram:.1} GB/s   kernels: {}",
        rayon::current_num_threads(),
        if q8 { "q8" } else { "exact" }
    );
    println!(
        "matrix {rows}×{cols}, {bits}-bit g{group}, {:.2} MB each, {count} distinct (cache-cold cycle)",
        bytes_per as f64 / 1e6
    );
    for isa in Isa::available() {
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut y = vec![0f32; rows];
        let passes = (if quick { 128 } else { 960 }) / count.max(1);
        let t = Instant::now();
        for _ in 0..passes {
            for e in &experts {
                mat(e).matmul(isa, &x, 1, &mut y);
                black_box(&y);
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let gbps = (passes * count * bytes_per) as f64 / secs / 1e9;
        let n = 32;
        let xs: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut ys = vec![0f32; n * rows];
        let t = Instant::now();
        for e in experts.iter().take(32.min(count)) {
            mat(e).matmul(isa, &xs, n, &mut ys);
            black_box(&ys);
        }
        let gflops = (32.min(count) * 2 * n * rows * cols) as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!(
            "{isa:?}: decode {gbps:.2} GB/s of weights = {:.1}% of DRAM | prefill (32 tokens) {gflops:.1} GFLOP/s",
            100.0 * gbps / dram
        );
    }
}
