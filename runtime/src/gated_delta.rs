//! Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the input projections (split or grouped per key
//! head), the core every backend implements ([`crate::backend::Backend::gated_delta`]: causal depthwise conv,
//! q/k L2 norm, the gated delta-rule recurrence over a per-head state `S [Dv, Dk]`, the gated RMSNorm), and
//! the output projection.
//!
//! Prefill runs the recurrence token by token (sequential, exact; the projections, the conv and the output
//! are batched over the prompt), so prefill and decode compute the same numbers.

use std::time::Instant;

use crate::backend::{Backend, SeqSpan};
use crate::error::Result;
use crate::profile::{Part, StepProfile};
use crate::weights::Weights;

/// Head counts and widths of a Gated DeltaNet layer (config `linear_*` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    /// Key (and query) heads `Hk`.
    pub k_heads: usize,
    /// Value heads `Hv` (a multiple of `Hk`; v-head `h` reads k-head `h / (Hv/Hk)`).
    pub v_heads: usize,
    /// Key head width `Dk`.
    pub k_dim: usize,
    /// Value head width `Dv`.
    pub v_dim: usize,
    /// Causal conv kernel length.
    pub kernel: usize,
}

impl DeltaShape {
    /// `Hk · Dk`.
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }
    /// `Hv · Dv`.
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }
    /// Conv channels: q, k and v together.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats of recurrent state per layer (`S` plus the conv history).
    pub fn state_floats(&self) -> usize {
        self.v_heads * self.v_dim * self.k_dim + self.kernel.saturating_sub(1) * self.conv_dim()
    }
}

/// The parameters of a Gated DeltaNet layer other than its projections, on the host.
#[derive(Debug, Clone)]
pub struct DeltaParams {
    /// Head counts and widths.
    pub shape: DeltaShape,
    /// RMSNorm epsilon of the gated norm.
    pub eps: f32,
    /// Depthwise conv taps `[conv_dim, kernel]`; tap `kernel − 1` multiplies the current token.
    pub conv: Vec<f32>,
    /// `exp(A_log)` per v-head.
    pub decay_rate: Vec<f32>,
    /// Added to `a` before the softplus, per v-head.
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight over `Dv` (plain `w`, never `1 + w`).
    pub norm: Vec<f32>,
}

/// The input projections, in either checkpoint layout.
enum InProj<B: Backend> {
    /// Qwen3.5: `in_proj_qkv` (`[q | k | v]` over all heads), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split {
        qkv: B::Matrix,
        z: B::Matrix,
        b: B::Matrix,
        a: B::Matrix,
    },
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped per key head (`[q Dk | k Dk | v r·Dv | z r·Dv]`
    /// and `[b r | a r]` for each of the `Hk` groups), and the columns that regroup them as the split layout.
    Grouped {
        qkvz: B::Matrix,
        ba: B::Matrix,
        cols: [Vec<usize>; 4],
    },
}

/// Columns of the grouped projections' outputs that make `qkv`, `z`, `b` and `a` in the split layout.
fn grouped_columns(s: DeltaShape) -> [Vec<usize>; 4] {
    let (dk, r) = (s.k_dim, s.v_heads / s.k_heads);
    let rdv = r * s.v_dim;
    let group = 2 * dk + 2 * rdv;
    let span = |g: usize, from: usize, len: usize| g * group + from..g * group + from + len;
    let heads = 0..s.k_heads;
    let qkv = heads
        .clone()
        .flat_map(|g| span(g, 0, dk))
        .chain(heads.clone().flat_map(|g| span(g, dk, dk)))
        .chain(heads.clone().flat_map(|g| span(g, 2 * dk, rdv)))
        .collect();
    let z = heads.clone().flat_map(|g| span(g, 2 * dk + rdv, rdv)).collect();
    let b = heads.clone().flat_map(|g| g * 2 * r..g * 2 * r + r).collect();
    let a = heads.flat_map(|g| g * 2 * r + r..(g + 1) * 2 * r).collect();
    [qkv, z, b, a]
}

/// One Gated DeltaNet token mixer.
pub struct GatedDeltaNet<B: Backend> {
    proj: InProj<B>,
    weights: B::DeltaWeights,
    out: B::Matrix,
    /// Head counts and widths.
    pub shape: DeltaShape,
}

impl<B: Backend> GatedDeltaNet<B> {
    /// Loads `{prefix}.{in_proj_*, conv1d, A_log, dt_bias, norm, out_proj}`; the layout is detected from the
    /// projection names, and the conv weight may be MLX `[C, K, 1]` or PyTorch `[C, 1, K]` (same bytes).
    pub fn load(be: &B, w: &Weights, prefix: &str, hidden: usize, shape: DeltaShape, eps: f32) -> Result<Self> {
        let s = shape;
        if s.kernel == 0 {
            return Err(w.config().error("linear_conv_kernel_dim must be at least 1"));
        }
        if s.k_heads == 0 || s.v_heads == 0 || !s.v_heads.is_multiple_of(s.k_heads) {
            return Err(w.config().error(format!(
                "linear_num_value_heads {} must be a non-zero multiple of linear_num_key_heads {}",
                s.v_heads, s.k_heads
            )));
        }
        let p = |n: &str| format!("{prefix}.{n}");
        let m = |name: &str, rows: usize| be.matrix(&w.linear(&p(name), rows, hidden)?);
        let proj = if w.has(&p("in_proj_qkvz.weight")) {
            InProj::Grouped {
                qkvz: m("in_proj_qkvz", s.conv_dim() + s.value_dim())?,
                ba: m("in_proj_ba", 2 * s.v_heads)?,
                cols: grouped_columns(s),
            }
        } else {
            InProj::Split {
                qkv: m("in_proj_qkv", s.conv_dim())?,
                z: m("in_proj_z", s.value_dim())?,
                b: m("in_proj_b", s.v_heads)?,
                a: m("in_proj_a", s.v_heads)?,
            }
        };
        let (c, k) = (s.conv_dim(), s.kernel);
        let params = DeltaParams {
            shape,
            eps,
            conv: w.array(&p("conv1d.weight"), &[&[c, k, 1], &[c, 1, k]])?,
            decay_rate: w.vector(&p("A_log"), s.v_heads)?.iter().map(|a| a.exp()).collect(),
            dt_bias: w.vector(&p("dt_bias"), s.v_heads)?,
            norm: w.vector(&p("norm.weight"), s.v_dim)?,
        };
        Ok(Self {
            proj,
            weights: be.delta_weights(&params)?,
            out: be.matrix(&w.linear(&p("out_proj"), hidden, s.value_dim())?)?,
            shape,
        })
    }

    /// `[n, hidden]` normalized input → `[n, hidden]` mixer output; reads each sequence's state and writes its
    /// next one. Time goes to `profile` as projections ([`Part::LinearAttention`]) and the rest
    /// ([`Part::DeltaRecurrence`]).
    pub fn forward(
        &self,
        be: &B,
        x: &B::Tensor,
        spans: &[SeqSpan],
        state: &mut [&mut B::Recurrent],
        profile: &StepProfile,
    ) -> Result<B::Tensor> {
        let start = Instant::now();
        let (qkv, z, b, a) = match &self.proj {
            InProj::Split { qkv, z, b, a } => {
                let [qkv, z, b, a] = be.matmul_each([qkv, z, b, a], x)?;
                (qkv, z, b, a)
            }
            InProj::Grouped { qkvz, ba, cols } => {
                let [mixed, mixed_ba] = be.matmul_each([qkvz, ba], x)?;
                (
                    be.take_columns(&mixed, &cols[0])?,
                    be.take_columns(&mixed, &cols[1])?,
                    be.take_columns(&mixed_ba, &cols[2])?,
                    be.take_columns(&mixed_ba, &cols[3])?,
                )
            }
        };
        let core = Instant::now();
        profile.add(Part::LinearAttention, core - start);
        let y = be.gated_delta(&self.weights, &qkv, &z, &b, &a, spans, state)?;
        let out_start = Instant::now();
        profile.add(Part::DeltaRecurrence, out_start - core);
        let y = be.matmul(&self.out, &y)?;
        profile.add(Part::LinearAttention, out_start.elapsed());
        Ok(y)
    }
}

/// `x · sigmoid(x)`.
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `1 / (1 + e^−x)`.
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + e^x)`, stable for large |x|.
pub(crate) fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

#[cfg(test)]
mod tests {
    use expert_store::OwnedBytes;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuRecurrent, CpuTensor};
    use crate::backend::reference::ReferenceBackend;
    use crate::backend::RecurrentState;
    use crate::cpu::FloatType;
    use crate::linear::{Linear, WeightFormat};

    fn dense(rng: &mut impl Rng, rows: usize, cols: usize) -> Linear {
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-0.3f32..0.3)).collect();
        let lin = Linear {
            format: WeightFormat::Dense(FloatType::F32),
            rows,
            cols,
            parts: vec![OwnedBytes::from_vec(w.iter().flat_map(|v| v.to_le_bytes()).collect())],
            bias: None,
        };
        lin
    }

    #[test]
    /// The cpu core against the reference backend's f64 one (the decode-step equations of architectures.md
    /// §9.4, token by token), in prefill and decode.
    fn matches_the_f64_reference_in_prefill_and_decode() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let s = DeltaShape {
            k_heads: 2,
            v_heads: 6,
            k_dim: 16,
            v_dim: 8,
            kernel: 4,
        };
        let hidden = 24;
        let qkv = dense(&mut rng, s.conv_dim(), hidden);
        let z = dense(&mut rng, s.value_dim(), hidden);
        let b = dense(&mut rng, s.v_heads, hidden);
        let a = dense(&mut rng, s.v_heads, hidden);
        let out = dense(&mut rng, hidden, s.value_dim());
        let conv: Vec<f32> = (0..s.conv_dim() * s.kernel)
            .map(|_| rng.gen_range(-0.8f32..0.8))
            .collect();
        let decay_rate: Vec<f32> = (0..s.v_heads).map(|_| rng.gen_range(0.2f32..3.0)).collect();
        let dt_bias: Vec<f32> = (0..s.v_heads).map(|_| rng.gen_range(-3f32..0.0)).collect();
        let norm: Vec<f32> = (0..s.v_dim).map(|_| rng.gen_range(0.5f32..1.5)).collect();
        let be = CpuBackend::default();
        let net = GatedDeltaNet::<CpuBackend> {
            proj: InProj::Split { qkv, z, b, a },
            weights: DeltaParams {
                shape: s,
                eps: 1e-6,
                conv,
                decay_rate,
                dt_bias,
                norm,
            },
            out,
            shape: s,
        };
        let n = 9;
        let x: Vec<f32> = (0..n * hidden).map(|_| rng.gen_range(-2f32..2.0)).collect();
        let profile = StepProfile::default();
        // The oracle: the reference backend (f64) over the same weights, all tokens in one step.
        let rb = ReferenceBackend;
        let rnet = GatedDeltaNet::<ReferenceBackend> {
            proj: match &net.proj {
                InProj::Split { qkv, z, b, a } => InProj::Split {
                    qkv: rb.matrix(qkv).unwrap(),
                    z: rb.matrix(z).unwrap(),
                    b: rb.matrix(b).unwrap(),
                    a: rb.matrix(a).unwrap(),
                },
                InProj::Grouped { .. } => unreachable!(),
            },
            weights: net.weights.clone(),
            out: rb.matrix(&net.out).unwrap(),
            shape: s,
        };
        let mut st = rb.new_recurrent(s);
        let xs = rb.upload(x.clone(), hidden).unwrap();
        let span = SeqSpan { rows: 0..n, pos0: 0 };
        let y = rnet.forward(&rb, &xs, &[span], &mut [&mut st], &profile).unwrap();
        let want = rb.to_host(&y).unwrap();
        // One step of `n` tokens on a state, committed (as a successful forward does).
        let step = |st: &mut CpuRecurrent, rows: std::ops::Range<usize>| {
            let x = CpuTensor {
                data: x[rows.start * hidden..rows.end * hidden].to_vec(),
                cols: hidden,
            };
            let span = SeqSpan {
                rows: 0..rows.len(),
                pos0: 0,
            };
            let y = net.forward(&be, &x, &[span], &mut [st], &profile).unwrap();
            st.commit();
            y.data
        };
        // 5 tokens of prefill, then 4 decode steps on the same state.
        let mut state = be.new_recurrent(s);
        let mut got = step(&mut state, 0..5);
        for t in 5..n {
            got.extend(step(&mut state, t..t + 1));
        }
        for t in 0..n {
            for i in 0..hidden {
                let (g, w) = (got[t * hidden + i] as f64, want[t * hidden + i] as f64);
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "token {t} [{i}]: {g} vs reference {w}"
                );
            }
        }
        // The same tokens one at a time reproduce the batched prefill bit for bit.
        let mut one = be.new_recurrent(s);
        for t in 0..5 {
            assert_eq!(step(&mut one, t..t + 1), got[t * hidden..(t + 1) * hidden]);
        }
        assert_eq!(one.ssm.len(), s.v_heads * s.v_dim * s.k_dim);
    }

    #[test]
    fn a_zero_conv_kernel_sizes_its_state_without_overflow() {
        // A config's `linear_conv_kernel_dim: 0` is sized (memory plan, doctor) before loading rejects it.
        let s = DeltaShape {
            k_heads: 2,
            v_heads: 4,
            k_dim: 8,
            v_dim: 8,
            kernel: 0,
        };
        assert_eq!(s.state_floats(), 4 * 8 * 8);
    }

    #[test]
    fn softplus_is_stable_and_exact_enough() {
        for x in [-50f32, -3.0, -0.5, 0.0, 0.5, 3.0, 50.0] {
            let want = (x as f64).exp().ln_1p() as f32;
            assert!((softplus(x) - want).abs() <= 1e-6 * want.abs().max(1e-30), "{x}");
        }
        assert!(softplus(100.0).is_finite() && softplus(-100.0) >= 0.0);
    }
}
