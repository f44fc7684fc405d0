//! Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): projections, causal depthwise conv, the gated
//! delta-rule recurrence over a per-head state `S [Dv, Dk]`, and the gated RMSNorm output.
//!
//! Prefill runs the recurrence token by token (sequential, exact; the projections, the conv and the output
//! are batched over the prompt). The recurrent work is `O(v_heads · Dv · Dk)` per token, small beside the
//! projections, and is spread over the v-heads in parallel.

use std::time::Instant;

use rayon::prelude::*;

use crate::cpu::Isa;
use crate::error::Result;
use crate::linear::Linear;
use crate::ops::{self, LayerKv};
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
        self.v_heads * self.v_dim * self.k_dim + (self.kernel - 1) * self.conv_dim()
    }
}

/// The input projections, in either checkpoint layout.
enum InProj {
    /// Qwen3.5: `in_proj_qkv` (`[q | k | v]` over all heads), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped per key head
    /// (`[q Dk | k Dk | v r·Dv | z r·Dv]` and `[b r | a r]` for each of the `Hk` groups).
    Grouped { qkvz: Linear, ba: Linear },
}

/// One Gated DeltaNet token mixer.
pub struct GatedDeltaNet {
    proj: InProj,
    /// Depthwise conv taps `[conv_dim, kernel]`; tap `kernel − 1` multiplies the current token.
    conv: Vec<f32>,
    /// `exp(A_log)` per v-head.
    decay_rate: Vec<f32>,
    dt_bias: Vec<f32>,
    /// Gated RMSNorm weight over `Dv` (plain `w`, never `1 + w`).
    norm: Vec<f32>,
    out: Linear,
    shape: DeltaShape,
    eps: f32,
}

/// The per-token inputs of the recurrence after projection.
struct Projected {
    /// `[n, conv_dim]`, pre-conv.
    qkv: Vec<f32>,
    /// `[n, value_dim]`.
    z: Vec<f32>,
    /// `[n, v_heads]`.
    b: Vec<f32>,
    /// `[n, v_heads]`.
    a: Vec<f32>,
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + e^x)`, stable for large |x|.
fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

impl GatedDeltaNet {
    /// Loads `{prefix}.{in_proj_*, conv1d, A_log, dt_bias, norm, out_proj}`; the layout is detected from the
    /// projection names, and the conv weight may be MLX `[C, K, 1]` or PyTorch `[C, 1, K]` (same bytes).
    pub fn load(w: &Weights, prefix: &str, hidden: usize, shape: DeltaShape, eps: f32) -> Result<Self> {
        let s = shape;
        if s.k_heads == 0 || s.v_heads == 0 || !s.v_heads.is_multiple_of(s.k_heads) || s.kernel == 0 {
            return Err(w.config().error(format!(
                "linear_num_value_heads {} must be a non-zero multiple of linear_num_key_heads {} (kernel {})",
                s.v_heads, s.k_heads, s.kernel
            )));
        }
        let p = |n: &str| format!("{prefix}.{n}");
        let proj = if w.has(&p("in_proj_qkvz.weight")) {
            InProj::Grouped {
                qkvz: w.linear(&p("in_proj_qkvz"), s.conv_dim() + s.value_dim(), hidden)?,
                ba: w.linear(&p("in_proj_ba"), 2 * s.v_heads, hidden)?,
            }
        } else {
            InProj::Split {
                qkv: w.linear(&p("in_proj_qkv"), s.conv_dim(), hidden)?,
                z: w.linear(&p("in_proj_z"), s.value_dim(), hidden)?,
                b: w.linear(&p("in_proj_b"), s.v_heads, hidden)?,
                a: w.linear(&p("in_proj_a"), s.v_heads, hidden)?,
            }
        };
        let (c, k) = (s.conv_dim(), s.kernel);
        let conv = w.array(&p("conv1d.weight"), &[&[c, k, 1], &[c, 1, k]])?;
        Ok(Self {
            proj,
            conv,
            decay_rate: w.vector(&p("A_log"), s.v_heads)?.iter().map(|a| a.exp()).collect(),
            dt_bias: w.vector(&p("dt_bias"), s.v_heads)?,
            norm: w.vector(&p("norm.weight"), s.v_dim)?,
            out: w.linear(&p("out_proj"), hidden, s.value_dim())?,
            shape,
            eps,
        })
    }

    fn project(&self, isa: Isa, x: &[f32], n: usize) -> Projected {
        match &self.proj {
            InProj::Split { qkv, z, b, a } => Projected {
                qkv: qkv.forward(isa, x, n),
                z: z.forward(isa, x, n),
                b: b.forward(isa, x, n),
                a: a.forward(isa, x, n),
            },
            InProj::Grouped { qkvz, ba } => {
                let s = self.shape;
                let (dk, rdv, r) = (s.k_dim, s.v_heads / s.k_heads * s.v_dim, s.v_heads / s.k_heads);
                let (mixed, mixed_ba) = (qkvz.forward(isa, x, n), ba.forward(isa, x, n));
                let (kd, c) = (s.key_dim(), s.conv_dim());
                let mut p = Projected {
                    qkv: vec![0f32; n * c],
                    z: vec![0f32; n * s.value_dim()],
                    b: vec![0f32; n * s.v_heads],
                    a: vec![0f32; n * s.v_heads],
                };
                let group = 2 * dk + 2 * rdv;
                for t in 0..n {
                    let row = &mixed[t * group * s.k_heads..(t + 1) * group * s.k_heads];
                    let qkv = &mut p.qkv[t * c..(t + 1) * c];
                    for (g, seg) in row.chunks(group).enumerate() {
                        qkv[g * dk..(g + 1) * dk].copy_from_slice(&seg[..dk]);
                        qkv[kd + g * dk..kd + (g + 1) * dk].copy_from_slice(&seg[dk..2 * dk]);
                        qkv[2 * kd + g * rdv..2 * kd + (g + 1) * rdv].copy_from_slice(&seg[2 * dk..2 * dk + rdv]);
                        p.z[t * s.value_dim() + g * rdv..t * s.value_dim() + (g + 1) * rdv]
                            .copy_from_slice(&seg[2 * dk + rdv..]);
                    }
                    let row = &mixed_ba[t * 2 * s.v_heads..(t + 1) * 2 * s.v_heads];
                    for (g, seg) in row.chunks(2 * r).enumerate() {
                        p.b[t * s.v_heads + g * r..t * s.v_heads + (g + 1) * r].copy_from_slice(&seg[..r]);
                        p.a[t * s.v_heads + g * r..t * s.v_heads + (g + 1) * r].copy_from_slice(&seg[r..]);
                    }
                }
                p
            }
        }
    }

    /// Causal depthwise conv of `qkv` (`[n, C]`) after the cached history, then SiLU; advances the history.
    fn conv(&self, qkv: &[f32], n: usize, cache: &mut LayerKv) -> Vec<f32> {
        let (c, k) = (self.shape.conv_dim(), self.shape.kernel);
        if cache.conv.len() != (k - 1) * c {
            cache.conv = vec![0f32; (k - 1) * c];
        }
        let mut window = std::mem::take(&mut cache.conv);
        window.extend_from_slice(qkv);
        let mut out = vec![0f32; n * c];
        let work = |(t, o): (usize, &mut [f32])| {
            for (ch, o) in o.iter_mut().enumerate() {
                let taps = &self.conv[ch * k..(ch + 1) * k];
                let acc = taps
                    .iter()
                    .enumerate()
                    .fold(0f32, |acc, (j, w)| acc + window[(t + j) * c + ch] * w);
                *o = silu(acc);
            }
        };
        if n * c * k < 1 << 16 {
            out.chunks_mut(c).enumerate().for_each(work);
        } else {
            out.par_chunks_mut(c).enumerate().for_each(work);
        }
        cache.conv = window.split_off(n * c);
        out
    }

    /// `[n, hidden]` normalized input → `[n, hidden]` mixer output; reads and advances the layer's state.
    /// Time goes to `profile` as projections ([`Part::LinearAttention`]) and the rest
    /// ([`Part::DeltaRecurrence`]).
    pub fn forward(&self, isa: Isa, x: &[f32], n: usize, cache: &mut LayerKv, profile: &StepProfile) -> Vec<f32> {
        let s = self.shape;
        let (c, kd, vd, dk, dv) = (s.conv_dim(), s.key_dim(), s.value_dim(), s.k_dim, s.v_dim);
        let start = Instant::now();
        let p = self.project(isa, x, n);
        let core = Instant::now();
        profile.add(Part::LinearAttention, core - start);
        let mut u = self.conv(&p.qkv, n, cache);
        // q = l2norm(q)/√Dk, k = l2norm(k), as mlx-lm does it: an RMSNorm with eps 1e-6/Dk, scaled.
        let inv = 1.0 / (dk as f32).sqrt();
        let rms_eps = 1e-6 * inv * inv;
        for row in u.chunks_mut(c) {
            let (q, rest) = row.split_at_mut(kd);
            let k = &mut rest[..kd];
            for (head, scale) in [(q, inv * inv), (k, inv)] {
                for h in head.chunks_mut(dk) {
                    let ms = h.iter().map(|v| v * v).sum::<f32>() / dk as f32;
                    let r = 1.0 / (ms + rms_eps).sqrt();
                    h.iter_mut().for_each(|v| *v = scale * (*v * r));
                }
            }
        }
        let beta: Vec<f32> = p.b.iter().map(|&b| sigmoid(b)).collect();
        let decay: Vec<f32> =
            p.a.iter()
                .enumerate()
                .map(|(i, &a)| {
                    let h = i % s.v_heads;
                    (-self.decay_rate[h] * softplus(a + self.dt_bias[h])).exp()
                })
                .collect();
        if cache.ssm.len() != s.v_heads * dv * dk {
            cache.ssm = vec![0f32; s.v_heads * dv * dk];
        }
        // Each v-head's state is independent: heads in parallel, tokens in order inside a head.
        let r = s.v_heads / s.k_heads;
        let per_head: Vec<Vec<f32>> = cache
            .ssm
            .par_chunks_mut(dv * dk)
            .enumerate()
            .map(|(h, state)| {
                let kh = h / r;
                let mut y = vec![0f32; n * dv];
                for t in 0..n {
                    let row = &u[t * c..(t + 1) * c];
                    let q = &row[kh * dk..(kh + 1) * dk];
                    let k = &row[kd + kh * dk..kd + (kh + 1) * dk];
                    let v = &row[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                    let (g, b) = (decay[t * s.v_heads + h], beta[t * s.v_heads + h]);
                    for (i, srow) in state.chunks_mut(dk).enumerate() {
                        srow.iter_mut().for_each(|x| *x *= g);
                        let delta = (v[i] - isa.dot(srow, k)) * b;
                        srow.iter_mut().zip(k).for_each(|(x, kj)| *x += kj * delta);
                        y[t * dv + i] = isa.dot(srow, q);
                    }
                }
                y
            })
            .collect();
        // Gated RMSNorm per head: rms_norm(y) ⊙ silu(z).
        let mut o = vec![0f32; n * vd];
        for (h, y) in per_head.iter().enumerate() {
            for t in 0..n {
                let dst = &mut o[t * vd + h * dv..t * vd + (h + 1) * dv];
                dst.copy_from_slice(&y[t * dv..(t + 1) * dv]);
                ops::rms_norm(dst, &self.norm, self.eps);
                let z = &p.z[t * vd + h * dv..t * vd + (h + 1) * dv];
                dst.iter_mut().zip(z).for_each(|(d, &z)| *d *= silu(z));
            }
        }
        let out_start = Instant::now();
        profile.add(Part::DeltaRecurrence, out_start - core);
        let y = self.out.forward(isa, &o, n);
        profile.add(Part::LinearAttention, out_start.elapsed());
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softplus_is_stable_and_exact_enough() {
        for x in [-50f32, -3.0, -0.5, 0.0, 0.5, 3.0, 50.0] {
            let want = (x as f64).exp().ln_1p() as f32;
            assert!((softplus(x) - want).abs() <= 1e-6 * want.abs().max(1e-30), "{x}");
        }
        assert!(softplus(100.0).is_finite() && softplus(-100.0) >= 0.0);
    }
}
