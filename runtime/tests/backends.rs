//! The model written once over the Backend trait: the naive f64 `reference` backend agrees with `cpu` on every
//! fixture; a batch of sequences at different positions, each with its own experts per token, equals each
//! sequence run alone bit for bit; a forward that fails mid-way leaves every sequence as it was; sequences
//! fork and truncate.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{fixture, fixtures};
use expert_store::{ExpertFetch, ExpertRecord, ExpertSource, StoreCounters, StoreError};
use sluice_runtime::config::ModelConfig;
use sluice_runtime::{load_model_with, BackendKind, DecoderModel, ExpertOptions, ForwardOptions, KvCache, SeqRequest};

fn load(dir: &Path, backend: BackendKind) -> DecoderModel {
    let opts = ExpertOptions {
        backend,
        ..ExpertOptions::default()
    };
    load_model_with(dir, ModelConfig::load(dir).unwrap(), &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn all_logits() -> ForwardOptions {
    ForwardOptions {
        all_logits: true,
        ..Default::default()
    }
}

/// Tolerance of `cpu` (f32, SIMD summation order) against `reference` (f64): per logit,
/// |cpu − ref| ≤ 1e-4 · (1 + max |ref| of the row) (largest seen: 1.2e-5).
const REF_TOL: f32 = 1e-4;

#[test]
fn reference_backend_agrees_with_cpu_on_every_fixture() {
    let mut worst_seen = 0f32;
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (cpu, reference) = (load(&dir, BackendKind::Cpu), load(&dir, BackendKind::Reference));
        assert_eq!(reference.backend(), "reference");
        let v = cpu.info.vocab_size;
        let prompt: Vec<u32> = (0..9).map(|i| (i * 131 + 7) % v as u32).collect();
        for k in [None, Some(1)] {
            let opts = ForwardOptions {
                top_k: k,
                all_logits: true,
            };
            let (mut c1, mut c2) = (cpu.new_cache(), reference.new_cache());
            let a = cpu.forward(&prompt, &mut c1, &opts).unwrap();
            let b = reference.forward(&prompt, &mut c2, &opts).unwrap();
            // Then two decode steps on each.
            let (mut a, mut b) = (vec![a], vec![b]);
            for t in [3u32, 11] {
                a.push(cpu.forward(&[t], &mut c1, &opts).unwrap());
                b.push(reference.forward(&[t], &mut c2, &opts).unwrap());
            }
            for (step, (a, b)) in a.iter().zip(&b).enumerate() {
                for (row, (ra, rb)) in a.chunks(v).zip(b.chunks(v)).enumerate() {
                    let scale = 1.0 + rb.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let worst = ra.iter().zip(rb).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        worst <= REF_TOL * scale,
                        "{name} top_k {k:?} step {step} row {row}: |cpu − reference| {worst} > {REF_TOL}·{scale}"
                    );
                    worst_seen = worst_seen.max(worst / scale);
                }
            }
        }
    }
    eprintln!("largest |cpu − reference| / (1 + max|logit|): {worst_seen:.2e}");
}

fn step(m: &DecoderModel, cache: &mut KvCache, tokens: &[u32], k: Option<usize>) -> Vec<f32> {
    let opts = ForwardOptions {
        top_k: k,
        all_logits: true,
    };
    m.forward(tokens, cache, &opts).unwrap()
}

#[test]
fn a_batch_of_sequences_equals_each_run_alone_bit_for_bit() {
    for name in [
        "qwen3_moe-q4g64",
        "mixtral-q6g64",
        "qwen3_5_moe-q4g64",
        "qwen3_next-q8g32",
        "qwen3_5-q4g64",
        "qwen3_moe_tied-q8g32",
    ] {
        let m = load(&fixture(name), BackendKind::Cpu);
        let top = m.info.default_top_k.max(1);
        // Three sequences at different positions (prompts of 5, 1 and 12 tokens).
        let prompts: [Vec<u32>; 3] = [vec![5, 9, 2, 7, 1], vec![4], (0..12).map(|i| i * 3 + 1).collect()];
        let mut caches: Vec<KvCache> = prompts
            .iter()
            .map(|p| {
                let mut c = m.new_cache();
                step(&m, &mut c, p, None);
                c
            })
            .collect();
        // Each continues with its own tokens and experts per token.
        let news: [Vec<u32>; 3] = [vec![8], vec![2, 6, 3], vec![10, 11]];
        let ks = [Some(top), Some(1), None];
        let want: Vec<Vec<f32>> = caches
            .iter()
            .zip(news.iter().zip(ks))
            .map(|(c, (t, k))| step(&m, &mut c.fork(), t, k))
            .collect();
        let mut reqs: Vec<SeqRequest<'_>> = caches
            .iter_mut()
            .zip(news.iter().zip(ks))
            .map(|(cache, (tokens, k))| SeqRequest {
                tokens,
                cache,
                opts: ForwardOptions {
                    top_k: k,
                    all_logits: true,
                },
            })
            .collect();
        let got = m.forward_batch(&mut reqs).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "{name}: sequence {i} differs from its own forward");
        }
        for (c, (p, n)) in caches.iter().zip(prompts.iter().zip(&news)) {
            assert_eq!(c.len(), p.len() + n.len());
        }
        // And they go on from there like sequences that were never batched.
        let again: Vec<Vec<f32>> = caches.iter_mut().map(|c| step(&m, c, &[1], None)).collect();
        for (i, (c, w)) in again.iter().zip(&want).enumerate() {
            assert!(c.iter().all(|x| x.is_finite()) && !w.is_empty(), "{name}: sequence {i}");
        }
    }
}

/// An expert source that fails every fetch of one layer while armed.
struct FailLayer {
    inner: Arc<dyn ExpertSource>,
    layer: usize,
    armed: AtomicBool,
}

impl ExpertSource for FailLayer {
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError> {
        self.inner.read_expert(layer, expert)
    }
    fn fetch_layer_rewriting<'a>(
        &'a self,
        layer: usize,
        experts: &[usize],
        rewrite: bool,
    ) -> Result<Box<dyn ExpertFetch + 'a>, StoreError> {
        if layer == self.layer && self.armed.load(Ordering::SeqCst) {
            return Err(StoreError::Engine(format!("injected failure in layer {layer}")));
        }
        self.inner.fetch_layer_rewriting(layer, experts, rewrite)
    }
    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.inner.prefetch(layer, experts)
    }
    fn counters(&self) -> Option<Arc<StoreCounters>> {
        self.inner.counters()
    }
}

#[test]
fn a_forward_that_fails_mid_way_leaves_the_sequence_as_it_was() {
    // Hybrids (recurrent layers before the failing one) and plain models; the failure is in the last MoE layer.
    for name in [
        "qwen3_5_moe-q4g64",
        "qwen3_next-q4g64",
        "qwen3_moe-q4g64",
        "mixtral-q4g64",
    ] {
        let mut m = load(&fixture(name), BackendKind::Cpu);
        let layer = m.info.num_layers - 1;
        assert!(layer > 0);
        let inner = m.expert_source().unwrap();
        let failing = Arc::new(FailLayer {
            inner,
            layer,
            armed: AtomicBool::new(false),
        });
        m.set_expert_source(failing.clone());
        let mut cache = m.new_cache();
        step(&m, &mut cache, &[3, 1, 4, 1, 5], None);
        let before = cache.fork();
        failing.armed.store(true, Ordering::SeqCst);
        for tokens in [&[9u32][..], &[2, 6, 5]] {
            let e = m.forward(tokens, &mut cache, &all_logits()).unwrap_err().to_string();
            assert!(e.contains("injected failure"), "{name}: {e}");
            assert_eq!(cache.len(), 5, "{name}: a failed forward moved the sequence");
        }
        // A failed batch leaves every sequence of it alone too.
        let mut other = before.fork();
        {
            let mut reqs = [
                SeqRequest {
                    tokens: &[7],
                    cache: &mut cache,
                    opts: all_logits(),
                },
                SeqRequest {
                    tokens: &[8, 8],
                    cache: &mut other,
                    opts: all_logits(),
                },
            ];
            assert!(m.forward_batch(&mut reqs).is_err());
        }
        assert_eq!((cache.len(), other.len()), (5, 5));
        failing.armed.store(false, Ordering::SeqCst);
        // Usable, and equal to before: the same next steps give the same logits as an untouched copy.
        for tokens in [&[2u32, 6, 5][..], &[7]] {
            let want = step(&m, &mut before.fork(), tokens, None);
            let got = step(&m, &mut cache.fork(), tokens, None);
            assert!(got == want, "{name}: the failed forward changed the state ({tokens:?})");
        }
        assert!(step(&m, &mut other, &[8, 8], None) == step(&m, &mut before.fork(), &[8, 8], None));
    }
}

#[test]
fn sequences_fork_and_truncate() {
    let m = load(&fixture("qwen3_moe-q4g64"), BackendKind::Cpu);
    let mut a = m.new_cache();
    step(&m, &mut a, &[1, 2, 3, 4], None);
    let mut b = a.fork();
    let x = step(&m, &mut a, &[5], None);
    assert!(
        step(&m, &mut b, &[5], None) == x,
        "a fork continues exactly like its origin"
    );
    // Truncating a KV-only model takes it back: position 4 again gives the same logits.
    a.truncate(4).unwrap();
    assert_eq!(a.len(), 4);
    assert!(step(&m, &mut a, &[5], None) == x);
    assert!(a.truncate(9).is_err());
    // A cache from another model is refused.
    let other = load(&fixture("qwen3_moe-q8g32"), BackendKind::Cpu);
    let e = other.forward(&[1], &mut a, &all_logits()).unwrap_err().to_string();
    assert!(e.contains("another model"), "{e}");
    // A recurrent model refuses to truncate backwards (a checkpoint does that).
    let h = load(&fixture("qwen3_5_moe-q4g64"), BackendKind::Cpu);
    let mut c = h.new_cache();
    step(&h, &mut c, &[1, 2, 3], None);
    let e = c.truncate(1).unwrap_err().to_string();
    assert!(e.contains("checkpoint"), "{e}");
    c.truncate(3).unwrap();
}
