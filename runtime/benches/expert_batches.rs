//! Routed experts computed in batches of 1 to 8 records, as a streamed decode step computes them (records
//! land a few at a time), one token each, from DRAM: time per record by batch size, and weight GB/s against
//! this machine's DRAM probe measured in the same run. An odd batch on two threads should cost no more per
//! record than an even one (`CpuBackend::experts` splits the last expert's matmuls across the threads).
//!
//! `cargo bench -p sluice-runtime --bench expert_batches` (`-- --quick` for fewer rounds).

use std::time::{Duration, Instant};

use sluice_runtime::backend::cpu::{CpuBackend, CpuTensor};
use sluice_runtime::backend::{Backend, ExpertJob};
use sluice_runtime::linear::Linear;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    sluice_runtime::cpu::q8::set_q8_activations(true);
    let _pool = sluice_runtime::threads::join_compute_pool(None).expect("compute pool");
    // A Qwen3-30B-A3B expert (gate, up, down), 2.65 MB; 120 of them (318 MB) cycle through DRAM, not the caches.
    let (hidden, inter, count) = (2048, 768, 120);
    let records: Vec<[Linear; 3]> = (0..count)
        .map(|e| {
            [
                Linear::arbitrary_q4(inter, hidden, 64, 3 * e),
                Linear::arbitrary_q4(inter, hidden, 64, 3 * e + 1),
                Linear::arbitrary_q4(hidden, inter, 64, 3 * e + 2),
            ]
        })
        .collect();
    let record_bytes: usize = records[0].iter().flat_map(|m| m.parts.iter().map(|p| p.len())).sum();
    let probe = sluice_runtime::cpu::dram_read_probe(512 << 20, Duration::from_millis(if quick { 300 } else { 1000 }));
    println!(
        "threads: {}   DRAM read probe: {:.1} GB/s   record {:.2} MB, {count} distinct",
        rayon::current_num_threads(),
        probe.best(),
        record_bytes as f64 / 1e6
    );
    let be = CpuBackend::default();
    let x = CpuTensor {
        data: (0..hidden).map(|i| (i as f32 * 0.01).sin()).collect(),
        cols: hidden,
    };
    let rounds = if quick { 3 } else { 12 };
    let mut ms = [0f64; 9];
    let mut next = 0;
    sluice_runtime::threads::with_workers_awake(|| {
        // Batch sizes interleaved round by round, so a drift in the machine's speed reaches them all alike.
        for round in 0..=rounds {
            for (size, total) in ms.iter_mut().enumerate().skip(1) {
                let (t, mut done) = (Instant::now(), 0);
                while done < 48 {
                    let jobs = (0..size)
                        .map(|i| ExpertJob {
                            mats: records[(next + i) % count].clone(),
                            x: x.clone(),
                        })
                        .collect();
                    next += size;
                    std::hint::black_box(be.experts(jobs).expect("experts"));
                    done += size;
                }
                // Round 0 warms up.
                if round > 0 {
                    *total += t.elapsed().as_secs_f64() * 1e3 / done as f64;
                }
            }
        }
    });
    for (size, total) in ms.iter().enumerate().skip(1) {
        let per = total / rounds as f64;
        let gbps = record_bytes as f64 / (per / 1e3) / 1e9;
        println!(
            "batch of {size}: {per:.3} ms per record, {gbps:.1} GB/s of weights = {:.0}% of DRAM",
            100.0 * gbps / probe.best()
        );
    }
}
