//! The feed-forward blocks: dense SwiGLU, and routed experts whose weights come from the expert store.
//!
//! The host-side MoE logic is written once here for every backend ([`RoutePlan`]): router logits → each
//! token's top k and weights (k per token: sequences in a batch may differ) → which tokens each expert serves
//! → after the experts ran, each token's outputs summed in its own routing order.

use std::sync::Arc;
use std::time::Instant;

use expert_store::ExpertSource;

use crate::backend::{Backend, ExpertJob, Pick};
use crate::error::Result;
use crate::ops;
use crate::profile::{Part, StepProfile};
use crate::weights::{ExpertLayout, Weights};

/// How router logits become expert weights; decides what happens when `--top-k` lowers k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// Softmax over all experts, then the top k (Qwen3-MoE). With `renormalize` (`norm_topk_prob`) the k
    /// weights are divided by their sum, so they always sum to 1; without it they keep their share of the
    /// full softmax, and a smaller k drops mass.
    SoftmaxTopK {
        /// Divide the chosen weights by their sum.
        renormalize: bool,
    },
    /// Top k of the raw logits, then a softmax over those k (Mixtral): the weights always sum to 1.
    TopKSoftmax,
}

impl RouterKind {
    /// The chosen experts (best first) and their weights for one token's router logits.
    ///
    /// ```
    /// use sluice_runtime::RouterKind;
    /// let logits = [2.0, 0.5, 1.0, -1.0];
    /// // Mixtral: top-2 of the logits, softmax over those two — weights sum to 1 at any k.
    /// let (ids, w) = RouterKind::TopKSoftmax.route(&logits, 2);
    /// assert_eq!(ids, [0, 2]);
    /// assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
    /// // Qwen3-MoE without norm_topk_prob: the two keep their share of the full softmax.
    /// let (_, w) = RouterKind::SoftmaxTopK { renormalize: false }.route(&logits, 2);
    /// assert!(w[0] + w[1] < 0.95);
    /// ```
    pub fn route(self, logits: &[f32], k: usize) -> (Vec<usize>, Vec<f32>) {
        match self {
            RouterKind::SoftmaxTopK { renormalize } => {
                let mut p = logits.to_vec();
                ops::softmax(&mut p);
                let idx = ops::top_k(&p, k);
                let mut w: Vec<f32> = idx.iter().map(|&i| p[i]).collect();
                if renormalize {
                    let s: f32 = w.iter().sum();
                    w.iter_mut().for_each(|v| *v /= s);
                }
                (idx, w)
            }
            RouterKind::TopKSoftmax => {
                let idx = ops::top_k(logits, k);
                let mut w: Vec<f32> = idx.iter().map(|&i| logits[i]).collect();
                ops::softmax(&mut w);
                (idx, w)
            }
        }
    }
}

/// Which experts a batch's tokens go to, and how their outputs combine.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutePlan {
    /// Per token: its experts (best first) and weights.
    pub routes: Vec<(Vec<usize>, Vec<f32>)>,
    /// The experts used by any token, ascending: what the store is asked for.
    pub used: Vec<usize>,
    /// Per used expert (same order): the tokens it serves, ascending.
    pub users: Vec<Vec<usize>>,
    /// Per token, per routing slot: which used expert and which of its rows holds the output, and the weight.
    pub picks: Vec<Vec<Pick>>,
}

impl RoutePlan {
    /// Routes each row of `logits` (`[tokens, experts]`) to `ks[t]` experts.
    pub fn new(kind: RouterKind, logits: &[f32], experts: usize, ks: &[usize]) -> Self {
        let routes: Vec<(Vec<usize>, Vec<f32>)> = logits
            .chunks(experts)
            .zip(ks)
            .map(|(l, &k)| kind.route(l, k.min(experts)))
            .collect();
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts];
        for (t, (ids, _)) in routes.iter().enumerate() {
            for &e in ids {
                by_expert[e].push(t);
            }
        }
        let used: Vec<usize> = (0..experts).filter(|&e| !by_expert[e].is_empty()).collect();
        let mut position = vec![usize::MAX; experts];
        for (i, &e) in used.iter().enumerate() {
            position[e] = i;
        }
        let users: Vec<Vec<usize>> = used.iter().map(|&e| std::mem::take(&mut by_expert[e])).collect();
        let picks = routes
            .iter()
            .enumerate()
            .map(|(t, (ids, w))| {
                ids.iter()
                    .zip(w)
                    .map(|(&e, &weight)| {
                        let expert = position[e];
                        let row = users[expert].binary_search(&t).unwrap_or_default();
                        Pick { expert, row, weight }
                    })
                    .collect()
            })
            .collect();
        Self {
            routes,
            used,
            users,
            picks,
        }
    }
}

/// A dense SwiGLU MLP: `down(silu(gate x) ⊙ up x)`.
pub struct Mlp<B: Backend> {
    gate: B::Matrix,
    up: B::Matrix,
    down: B::Matrix,
}

impl<B: Backend> Mlp<B> {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(be: &B, w: &Weights, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        let m = |name: &str, rows: usize, cols: usize| be.matrix(&w.linear(&format!("{prefix}.{name}"), rows, cols)?);
        Ok(Self {
            gate: m("gate_proj", inter, hidden)?,
            up: m("up_proj", inter, hidden)?,
            down: m("down_proj", hidden, inter)?,
        })
    }

    /// `[n, hidden]` → `[n, hidden]`.
    pub fn forward(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let [g, u] = be.matmul_each([&self.gate, &self.up], x)?;
        let g = be.swiglu(&g, &u)?;
        be.matmul(&self.down, &g)
    }
}

/// A dense SwiGLU expert every token uses, scaled by `sigmoid(gate · x)` (a scalar per token).
pub struct SharedExpert<B: Backend> {
    /// The expert.
    pub mlp: Mlp<B>,
    /// `[1, hidden]` gate.
    pub gate: B::Matrix,
}

/// A routed-experts SwiGLU block whose expert weights come from an [`ExpertSource`].
pub struct SparseMoe<B: Backend> {
    /// Router `[num_experts, hidden]`.
    pub router: B::Matrix,
    /// How router logits become weights.
    pub kind: RouterKind,
    /// Layer index (the expert store's key).
    pub layer: usize,
    /// Experts in this layer.
    pub num_experts: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Expert intermediate size.
    pub inter: usize,
    /// How a record's parts form the gate, up and down projections.
    pub layout: ExpertLayout,
    /// The layout of records the store rewrote as they loaded (the cpu backend's tiles), told apart from
    /// stored ones by their part count; `None`: records come as stored.
    pub rewritten: Option<ExpertLayout>,
    /// Where expert records come from.
    pub experts: Arc<dyn ExpertSource>,
    /// An always-on expert added to the routed sum (Qwen3-Next, Qwen3.5), resident in RAM.
    pub shared: Option<SharedExpert<B>>,
}

/// Mean tokens per requested expert from which a layer's reads are rewritten (tiled) as they load: a prompt's
/// chunk, not a decode step (one token) or a short prompt.
pub const REWRITE_MIN_USES: usize = 4;

impl<B: Backend> SparseMoe<B> {
    /// Routes each of the rows of `x` to `ks[row]` experts and sums their weighted outputs (plus the shared
    /// expert's). Returns the plan too (the last token's experts feed the prev-token prefetch).
    ///
    /// Each expert runs once over all tokens routed to it; all of them are requested from the store at once
    /// and each is computed as its record arrives (resident ones first), its record released right after, so
    /// a small cache still works. `prefetch` names the next layer's predicted experts, hinted to the store
    /// once this layer's reads are queued; `refine`, when given, names them again from this layer's output
    /// so far, once the experts at hand are computed and records are still to come (a step waiting on the
    /// disk), and its guess replaces the queued one.
    pub fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        ks: &[usize],
        prefetch: &mut dyn FnMut() -> Result<crate::model::Prediction>,
        mut refine: Option<crate::model::Refine<'_, B::Tensor>>,
        profile: &StepProfile,
    ) -> Result<(B::Tensor, RoutePlan)> {
        let start = Instant::now();
        // The one host sync of the layer: the ids decide what to read.
        let logits = be.to_host(&be.matmul(&self.router, x)?)?;
        let plan = RoutePlan::new(self.kind, &logits, self.num_experts, ks);
        // Records this pass reads (and the guesses made after it) are rewritten (tiled) only when each serves
        // several tokens here (a prompt's chunk): the rewrite costs its I/O thread about a millisecond per
        // 2.5 MB record, and computed as stored a record gives the same bits (`docs/performance-log.md`).
        let routes: usize = plan.users.iter().map(|u| u.len()).sum();
        let rewrite = routes >= REWRITE_MIN_USES * plan.used.len().max(1);
        let mut fetch = (self.experts).fetch_layer_rewriting(self.layer, &plan.used, rewrite)?;
        // Guessed after this layer's reads are queued, so the guess never delays them.
        for (layer, experts) in prefetch()? {
            self.experts.prefetch(layer, &experts);
        }
        let mut outputs: Vec<Option<B::Tensor>> = vec![None; plan.used.len()];
        while let Some(batch) = fetch.next_batch(usize::MAX) {
            let batch = batch?;
            let mut positions = Vec::with_capacity(batch.len());
            let mut jobs = Vec::with_capacity(batch.len());
            for (pos, rec) in &batch {
                let layout = match &self.rewritten {
                    Some(r) if rec.parts.len() == r.record_parts() => r,
                    _ => &self.layout,
                };
                jobs.push(ExpertJob {
                    mats: be.expert(layout, self.inter, self.hidden, rec)?,
                    x: be.gather_rows(x, &plan.users[*pos])?,
                });
                positions.push(*pos);
            }
            drop(batch);
            for (pos, y) in positions.into_iter().zip(be.experts(jobs)?) {
                outputs[pos] = Some(y);
            }
            // Once: the rest of this layer waits on the disk, and what it has computed is most of what moves
            // the next router's choice.
            if let Some(refine) = refine.take_if(|_| outputs.iter().any(Option::is_none)) {
                let so_far = partial_output(be, self.hidden, &outputs, &plan.picks)?;
                for (layer, experts) in refine(&so_far)? {
                    self.experts.prefetch(layer, &experts);
                }
            }
        }
        let outputs: Vec<B::Tensor> = outputs
            .into_iter()
            .map(|o| o.ok_or_else(|| crate::error::ModelError::Backend("an expert's record never arrived".into())))
            .collect::<Result<_>>()?;
        let mut out = be.combine(self.hidden, &outputs, &plan.picks)?;
        profile.add(Part::RoutedExperts, start.elapsed());
        if let Some(shared) = &self.shared {
            let start = Instant::now();
            let y = shared.mlp.forward(be, x)?;
            let y = be.mul_sigmoid(&y, &be.matmul(&shared.gate, x)?)?;
            out = be.add(&out, &y)?;
            profile.add(Part::SharedExpert, start.elapsed());
        }
        Ok((out, plan))
    }

    /// The experts this layer's router picks for each of the normalized rows `x` (row `t` takes `ks[t]`), best
    /// first: the prefetch guess for a layer ahead.
    pub fn predict(&self, be: &B, x: &B::Tensor, ks: &[usize]) -> Result<Vec<Vec<usize>>> {
        let logits = be.to_host(&be.matmul(&self.router, x)?)?;
        let rows = logits.chunks(self.num_experts).zip(ks);
        Ok(rows
            .map(|(l, &k)| self.kind.route(l, k.min(self.num_experts)).0)
            .collect())
    }
}

/// The layer's output from the experts computed so far (`outputs[i]` is `None` for those still to come, which
/// count as zero): what a refined guess of the next layer's experts starts from.
fn partial_output<B: Backend>(
    be: &B,
    hidden: usize,
    outputs: &[Option<B::Tensor>],
    picks: &[Vec<Pick>],
) -> Result<B::Tensor> {
    let mut done = Vec::with_capacity(outputs.len());
    let at: Vec<Option<usize>> = (outputs.iter())
        .map(|o| {
            o.as_ref().map(|t| {
                done.push(t.clone());
                done.len() - 1
            })
        })
        .collect();
    let picks: Vec<Vec<Pick>> = (picks.iter())
        .map(|token| {
            (token.iter())
                .filter_map(|p| at.get(p.expert).copied().flatten().map(|expert| Pick { expert, ..*p }))
                .collect()
        })
        .collect();
    be.combine(hidden, &done, &picks)
}

#[cfg(test)]
mod tests {
    use expert_store::{InMemoryExpertSource, OwnedBytes};
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuTensor};
    use crate::cpu::testutil::{encode, pack};
    use crate::cpu::{reference_matmul, FloatType};
    use crate::linear::{Linear, WeightFormat};

    /// A random affine-quantized `[rows, cols]` matrix as (weight, scales, biases) bytes.
    fn random_quant(rng: &mut impl Rng, bits: u32, group: usize, rows: usize, cols: usize) -> Vec<Vec<u8>> {
        let codes: Vec<u32> = (0..rows * cols).map(|_| rng.gen_range(0..1u32 << bits)).collect();
        let g = rows * cols / group;
        let s: Vec<f32> = (0..g).map(|_| rng.gen_range(-0.05f32..0.05)).collect();
        let b: Vec<f32> = (0..g).map(|_| rng.gen_range(-0.3f32..0.3)).collect();
        vec![
            pack(bits, &codes),
            encode(FloatType::BF16, &s),
            encode(FloatType::BF16, &b),
        ]
    }

    fn moe(kind: RouterKind, seed: u64) -> SparseMoe<CpuBackend> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (h, inter, experts, bits, group) = (64, 96, 6, 4, 32);
        let mut src = InMemoryExpertSource::new();
        for e in 0..experts {
            let mut parts = random_quant(&mut rng, bits, group, inter, h);
            parts.extend(random_quant(&mut rng, bits, group, inter, h));
            parts.extend(random_quant(&mut rng, bits, group, h, inter));
            src.insert(3, e, parts);
        }
        let r = random_quant(&mut rng, 8, 64, experts, h);
        let router = Linear {
            format: WeightFormat::Affine {
                bits: 8,
                group: 64,
                scale_type: FloatType::BF16,
            },
            rows: experts,
            cols: h,
            parts: r.into_iter().map(OwnedBytes::from_vec).collect(),
            bias: None,
        };
        let f = WeightFormat::Affine {
            bits,
            group,
            scale_type: FloatType::BF16,
        };
        SparseMoe {
            router,
            kind,
            layer: 3,
            num_experts: experts,
            hidden: h,
            inter,
            layout: ExpertLayout {
                formats: [f; 3],
                fused: false,
            },
            rewritten: None,
            experts: Arc::new(src),
            shared: None,
        }
    }

    /// The naive oracle: each token alone, each chosen expert dequantized by the scalar reference matmul,
    /// weighted outputs summed in routing order.
    fn naive(m: &SparseMoe<CpuBackend>, x: &[f32], n: usize, k: usize) -> Vec<f32> {
        let h = m.hidden;
        let mut out = vec![0f32; n * h];
        for t in 0..n {
            let xt = &x[t * h..(t + 1) * h];
            let mut logits = vec![0f32; m.num_experts];
            reference_matmul(&m.router.mat(), xt, 1, &mut logits);
            let (ids, w) = m.kind.route(&logits, k);
            for (e, wt) in ids.iter().zip(w) {
                let rec = m.experts.read_expert(m.layer, *e).unwrap();
                let [gate, up, down] = m.layout.linears(m.inter, h, &rec.parts).unwrap();
                let (gate, up, down) = (gate.mat(), up.mat(), down.mat());
                let mut g = vec![0f32; m.inter];
                let mut u = vec![0f32; m.inter];
                reference_matmul(&gate, xt, 1, &mut g);
                reference_matmul(&up, xt, 1, &mut u);
                ops::swiglu(&mut g, &u);
                let mut y = vec![0f32; h];
                reference_matmul(&down, &g, 1, &mut y);
                for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(&y) {
                    *o += wt * v;
                }
            }
        }
        out
    }

    fn run(m: &SparseMoe<CpuBackend>, x: &[f32], ks: &[usize]) -> Vec<f32> {
        let x = CpuTensor {
            data: x.to_vec(),
            cols: m.hidden,
        };
        m.forward(
            &CpuBackend::default(),
            &x,
            ks,
            &mut || Ok(Vec::new()),
            None,
            &StepProfile::default(),
        )
        .unwrap()
        .0
        .data
    }

    #[test]
    fn grouped_moe_matches_the_naive_reference_at_every_k() {
        let kinds = [
            RouterKind::SoftmaxTopK { renormalize: true },
            RouterKind::SoftmaxTopK { renormalize: false },
            RouterKind::TopKSoftmax,
        ];
        for (i, kind) in kinds.into_iter().enumerate() {
            let m = moe(kind, i as u64);
            let n = 7;
            let mut rng = rand::rngs::StdRng::seed_from_u64(99);
            let x: Vec<f32> = (0..n * 64).map(|_| rng.gen_range(-1f32..1.0)).collect();
            for k in 1..=6 {
                let fast = run(&m, &x, &vec![k; n]);
                let slow = naive(&m, &x, n, k);
                let scale = slow.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in fast.iter().zip(&slow) {
                    assert!((a - b).abs() <= 1e-4 * scale, "{kind:?} k={k}: {a} vs {b}");
                }
                // Batched equals token-by-token bit for bit.
                for t in 0..n {
                    assert_eq!(run(&m, &x[t * 64..(t + 1) * 64], &[k]), fast[t * 64..(t + 1) * 64]);
                }
            }
            // Each token with its own k in one batch equals each token alone.
            let ks: Vec<usize> = (0..n).map(|t| 1 + t % 6).collect();
            let mixed = run(&m, &x, &ks);
            for t in 0..n {
                assert_eq!(run(&m, &x[t * 64..(t + 1) * 64], &[ks[t]]), mixed[t * 64..(t + 1) * 64]);
            }
        }
    }

    #[test]
    fn routing_weights_follow_the_router_kind() {
        let logits = [2.0, 1.0, 0.5, -1.0];
        let (ids, w) = RouterKind::SoftmaxTopK { renormalize: true }.route(&logits, 2);
        assert_eq!(ids, vec![0, 1]);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let (_, w) = RouterKind::SoftmaxTopK { renormalize: false }.route(&logits, 2);
        assert!(
            w.iter().sum::<f32>() < 0.95,
            "un-renormalised weights keep their softmax share"
        );
        let (_, w) = RouterKind::TopKSoftmax.route(&logits, 2);
        assert!((w[0] - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn a_route_plan_lists_each_expert_once_with_its_tokens() {
        // 3 tokens over 4 experts; token 1 routes to one expert only.
        let logits = [0.0, 3.0, 2.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 4.0];
        let p = RoutePlan::new(RouterKind::TopKSoftmax, &logits, 4, &[2, 1, 2]);
        assert_eq!(p.used, vec![0, 1, 2, 3]);
        assert_eq!(p.users, vec![vec![1], vec![0, 2], vec![0], vec![2]]);
        assert_eq!(
            p.picks[0].iter().map(|x| (x.expert, x.row)).collect::<Vec<_>>(),
            [(1, 0), (2, 0)]
        );
        assert_eq!(
            p.picks[1].iter().map(|x| (x.expert, x.row)).collect::<Vec<_>>(),
            [(0, 0)]
        );
        assert_eq!(
            p.picks[2].iter().map(|x| (x.expert, x.row)).collect::<Vec<_>>(),
            [(3, 0), (1, 1)]
        );
    }

    #[test]
    fn a_failing_expert_read_is_an_error_not_a_panic() {
        let mut m = moe(RouterKind::TopKSoftmax, 5);
        m.experts = Arc::new(InMemoryExpertSource::new());
        let x = CpuTensor {
            data: vec![0.1; 64],
            cols: 64,
        };
        let e = m
            .forward(
                &CpuBackend::default(),
                &x,
                &[2],
                &mut || Ok(Vec::new()),
                None,
                &StepProfile::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("no expert record for layer 3"), "{e}");
    }
}
