//! Attention's cost by depth, with the machine's DRAM read bandwidth measured in the same run.
//!
//! `cargo bench -p sluice-runtime --bench attention` (add `-- --quick` for a shorter run). The shape is
//! Qwen3-30B-A3B's (32 query heads, 4 key/value heads, 128 dims), with the cache in f32 and in f16 as the cpu
//! backend keeps it. Decode rows give time per token per layer and the cache bytes read per second; prefill rows
//! give GFLOP/s of the score and weighted-sum products. The last lines time softmax alone (ours against a libm
//! `exp` loop) on rows as long as the deepest decode's, and swiglu (the same) on a medium decode layer's eight
//! experts' hidden rows.

use std::hint::black_box;
use std::time::{Duration, Instant};

use sluice_runtime::cpu::kv::{KvHead, KvType};
use sluice_runtime::cpu::Isa;
use sluice_runtime::ops::{attention, AttnShape};

/// Layers whose caches a decode step visits in turn (the medium model's 24).
const LAYERS: usize = 24;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let _pool = sluice_runtime::threads::join_compute_pool(None).expect("compute pool");
    let shape = AttnShape {
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
    };
    let isa = Isa::detect();
    let dram = sluice_runtime::cpu::dram_read_gbps(512 << 20, Duration::from_millis(if quick { 300 } else { 1000 }));
    println!(
        "threads: {}   DRAM read probe: {dram:.1} GB/s   isa: {isa:?}   {} heads, {} kv heads, {} dims",
        rayon::current_num_threads(),
        shape.heads,
        shape.kv_heads,
        shape.head_dim
    );
    let (qw, kvw) = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    let fill =
        |len: usize, seed: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + seed) as f32 * 0.013).sin()).collect() };
    let budget = Duration::from_millis(if quick { 300 } else { 1500 });
    for ty in [KvType::F32, KvType::F16] {
        // One cache per key/value head, as the cpu backend keeps it.
        let cache = |depth: usize, seed: usize| -> Vec<KvHead> {
            (0..shape.kv_heads)
                .map(|h| {
                    let (k, v) = (
                        fill(depth * shape.head_dim, 2 * (seed * shape.kv_heads + h)),
                        fill(depth * shape.head_dim, 2 * (seed * shape.kv_heads + h) + 1),
                    );
                    let mut c = KvHead::new(ty, shape.head_dim);
                    for (k, v) in k.chunks_exact(shape.head_dim).zip(v.chunks_exact(shape.head_dim)) {
                        c.push(k, v);
                    }
                    c
                })
                .collect()
        };
        let bytes = |depth: usize| (2 * depth * kvw * ty.size()) as f64;
        for depth in [512usize, 2048, 8192] {
            let (kv, q) = (cache(depth, 1), fill(qw, 3));
            let secs = time(budget, || {
                black_box(attention(isa, shape, &q, 1, &kv));
            });
            let gbps = bytes(depth) / secs / 1e9;
            println!(
                "{ty:?} decode at depth {depth:>5}: {:7.1} µs per layer   cache read {gbps:5.1} GB/s = {:4.1}% of DRAM   (one layer, cache-hot)",
                secs * 1e6,
                100.0 * gbps / dram
            );
            // As in a model: each layer's cache comes from DRAM, the other layers having passed since.
            let layers: Vec<_> = (0..LAYERS).map(|l| cache(depth, l + 1)).collect();
            let mut l = 0;
            let secs = time(budget, || {
                black_box(attention(isa, shape, &q, 1, &layers[l]));
                l = (l + 1) % LAYERS;
            });
            let gbps = bytes(depth) / secs / 1e9;
            println!(
                "{ty:?} decode at depth {depth:>5}: {:7.1} µs per layer   cache read {gbps:5.1} GB/s = {:4.1}% of DRAM   ({LAYERS} layers in turn)",
                secs * 1e6,
                100.0 * gbps / dram
            );
        }
        let chunk = 512;
        for end in [512usize, 2048, 8192] {
            let (kv, q) = (cache(end, 1), fill(chunk * qw, 3));
            let secs = time(budget, || {
                black_box(attention(isa, shape, &q, chunk, &kv));
            });
            // Each query position p sees p + 1 keys: two products of head_dim per head and key.
            let pairs: usize = (end - chunk..end).map(|p| p + 1).sum();
            let flops = (4 * pairs * shape.heads * shape.head_dim) as f64;
            println!(
                "{ty:?} prefill {chunk} tokens ending at {end:>5}: {:8.1} ms per layer   {:6.1} GFLOP/s",
                secs * 1e3,
                flops / secs / 1e9
            );
        }
    }
    let row = fill(8192, 4);
    let mut x = row.clone();
    let ours = time(budget, || {
        x.copy_from_slice(&row);
        isa.softmax(&mut x);
        black_box(&x);
    });
    let libm = time(budget, || {
        x.copy_from_slice(&row);
        libm_softmax(&mut x);
        black_box(&x);
    });
    println!(
        "softmax of 8192: {:.2} µs ({:.2} ns per element); a libm exp loop {:.2} µs ({:.1}×)",
        ours * 1e6,
        ours * 1e9 / 8192.0,
        libm * 1e6,
        libm / ours
    );
    let (gate, up) = (fill(8 * 768, 5), fill(8 * 768, 6));
    let mut g = gate.clone();
    let ours = time(budget, || {
        g.copy_from_slice(&gate);
        isa.swiglu(&mut g, &up);
        black_box(&g);
    });
    let libm = time(budget, || {
        g.copy_from_slice(&gate);
        for (g, u) in g.iter_mut().zip(&up) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
        black_box(&g);
    });
    println!(
        "swiglu of 8 × 768: {:.2} µs ({:.2} ns per element); a libm exp loop {:.2} µs ({:.1}×)",
        ours * 1e6,
        ours * 1e9 / 6144.0,
        libm * 1e6,
        libm / ours
    );
}

/// Seconds per call of `f`, the best of repeated batches filling about `budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    sluice_runtime::threads::with_workers_awake(|| {
        f();
        let start = Instant::now();
        let mut best = f64::INFINITY;
        while start.elapsed() < budget {
            let t = Instant::now();
            let mut calls = 0;
            while t.elapsed() < budget / 10 {
                f();
                calls += 1;
            }
            best = best.min(t.elapsed().as_secs_f64() / calls as f64);
        }
        best
    })
}

/// Softmax as it is usually written: libm `exp` per element, a sequential sum.
fn libm_softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}
