//! The `cpu` backend: f32 activations on the host, weights viewed in place (mmap'd checkpoints, expert-store
//! slots) and multiplied by sluice's SIMD kernels (`crate::cpu`), rayon across rows, heads and experts.
//!
//! Every output element is computed by one thread in a fixed order, so results do not depend on the thread
//! count or on how many tokens (or sequences) share a call: a batch equals each sequence run alone, bit for bit.

use std::sync::Arc;

use rayon::prelude::*;

use expert_store::{ExpertRecord, ResidentArena};

use super::{Backend, ExpertJob, KvState, Pick, RecurrentState, SeqSpan};
use crate::cpu::kv::{KvHead, KvType};
use crate::cpu::Isa;
use crate::error::{ModelError, Result};
use crate::gated_delta::{sigmoid, silu, softplus, DeltaParams, DeltaShape};
use crate::linear::Linear;
use crate::ops::{self, AttnShape, Rope};
use crate::weights::ExpertLayout;

/// sluice's own kernels.
#[derive(Clone, Default)]
pub struct CpuBackend {
    /// Element type of the KV caches it makes.
    pub kv: KvType,
    /// Where resident matrices repacked at load live.
    pub resident: Arc<ResidentArena>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("kv", &self.kv)
            .finish_non_exhaustive()
    }
}

/// Row-major `[rows, cols]` f32 values.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    /// The values.
    pub data: Vec<f32>,
    /// Row width.
    pub cols: usize,
}

impl CpuTensor {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.data.len() / self.cols.max(1)
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// Keys and values, one [`KvHead`] per key/value head (a head's attention task then reads its own arrays).
#[derive(Debug, Clone)]
pub struct CpuKv {
    pub(crate) heads: Vec<KvHead>,
    head_dim: usize,
}

impl CpuKv {
    /// Appends rows `[positions, kv_heads·head_dim]` of keys and values.
    fn append(&mut self, ks: &[f32], vs: &[f32]) {
        let hd = self.head_dim;
        let width = self.heads.len() * hd;
        if width == 0 {
            return;
        }
        for (k, v) in ks.chunks_exact(width).zip(vs.chunks_exact(width)) {
            for (h, head) in self.heads.iter_mut().enumerate() {
                head.push(&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            }
        }
    }
}

impl KvState for CpuKv {
    fn len(&self) -> usize {
        self.heads.first().map_or(0, KvHead::len)
    }
    fn truncate(&mut self, len: usize) {
        for h in &mut self.heads {
            h.truncate(len);
        }
    }
}

/// The last `kernel − 1` pre-conv inputs `[kernel − 1, conv_dim]` and the state `S [v_heads, Dv, Dk]`, with the
/// next ones a forward writes (out of place: committing is a swap, discarding costs nothing).
#[derive(Debug)]
pub struct CpuRecurrent {
    pub(crate) conv: Vec<f32>,
    pub(crate) ssm: Vec<f32>,
    next: Option<(Vec<f32>, Vec<f32>)>,
    /// Buffers of an earlier state, reused for the next one.
    spare: Option<(Vec<f32>, Vec<f32>)>,
}

impl Clone for CpuRecurrent {
    /// The current state only (a snapshot).
    fn clone(&self) -> Self {
        Self {
            conv: self.conv.clone(),
            ssm: self.ssm.clone(),
            next: None,
            spare: None,
        }
    }
}

impl RecurrentState for CpuRecurrent {
    fn commit(&mut self) {
        if let Some((conv, ssm)) = self.next.take() {
            let old = (
                std::mem::replace(&mut self.conv, conv),
                std::mem::replace(&mut self.ssm, ssm),
            );
            self.spare = Some(old);
        }
    }
    fn discard(&mut self) {
        if let Some(n) = self.next.take() {
            self.spare = Some(n);
        }
    }
    fn bytes(&self) -> usize {
        (self.conv.len() + self.ssm.len()) * 4
    }
}

fn shape_error(what: &str) -> ModelError {
    ModelError::Backend(format!("cpu: {what}"))
}

impl CpuBackend {
    fn zip(&self, a: &CpuTensor, b: &CpuTensor, f: impl Fn(f32, f32) -> f32) -> Result<CpuTensor> {
        if a.data.len() != b.data.len() {
            return Err(shape_error("element-wise operands differ in size"));
        }
        Ok(CpuTensor {
            data: a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect(),
            cols: a.cols,
        })
    }

    /// One sequence's Gated DeltaNet core over its `n` rows (`u`: pre-conv `qkv`).
    #[allow(clippy::too_many_arguments)]
    fn delta_one(
        &self,
        p: &DeltaParams,
        qkv: &[f32],
        z: &[f32],
        b: &[f32],
        a: &[f32],
        n: usize,
        st: &mut CpuRecurrent,
        out: &mut [f32],
    ) {
        let isa = Isa::detect();
        let s = p.shape;
        let (c, k, kd, vd, dk, dv) = (s.conv_dim(), s.kernel, s.key_dim(), s.value_dim(), s.k_dim, s.v_dim);
        // Causal depthwise conv over the history, then SiLU; the new history is the window's tail.
        let mut window = Vec::with_capacity((k - 1 + n) * c);
        window.extend_from_slice(&st.conv);
        window.extend_from_slice(qkv);
        let mut u = vec![0f32; n * c];
        let conv = |(t, o): (usize, &mut [f32])| {
            for (ch, o) in o.iter_mut().enumerate() {
                let taps = &p.conv[ch * k..(ch + 1) * k];
                let acc = taps
                    .iter()
                    .enumerate()
                    .fold(0f32, |acc, (j, w)| acc + window[(t + j) * c + ch] * w);
                *o = silu(acc);
            }
        };
        if n * c * k < 1 << 16 {
            u.chunks_mut(c).enumerate().for_each(conv);
        } else {
            u.par_chunks_mut(c).enumerate().for_each(conv);
        }
        let (mut next_conv, mut next_ssm) = st.spare.take().unwrap_or_default();
        next_conv.clear();
        next_conv.extend_from_slice(&window[n * c..]);
        next_ssm.resize(st.ssm.len(), 0.0);
        // q = l2norm(q)/√Dk, k = l2norm(k) with the model's own l2norm (HF / flash-linear-attention:
        // x/√(Σx² + 1e-6)), written as an RMSNorm with eps 1e-6/Dk, scaled. mlx-lm puts eps 1e-6 on the mean
        // instead, which differs only for heads near zero (|x| ~ 1e-3).
        let inv = 1.0 / (dk as f32).sqrt();
        let rms_eps = 1e-6 * inv * inv;
        for row in u.chunks_mut(c) {
            let (q, rest) = row.split_at_mut(kd);
            let kk = &mut rest[..kd];
            for (head, scale) in [(q, inv * inv), (kk, inv)] {
                for h in head.chunks_mut(dk) {
                    let ms = h.iter().map(|v| v * v).sum::<f32>() / dk as f32;
                    let r = 1.0 / (ms + rms_eps).sqrt();
                    h.iter_mut().for_each(|v| *v = scale * (*v * r));
                }
            }
        }
        let beta: Vec<f32> = b.iter().map(|&b| sigmoid(b)).collect();
        let decay: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(i, &a)| {
                let h = i % s.v_heads;
                (-p.decay_rate[h] * softplus(a + p.dt_bias[h])).exp()
            })
            .collect();
        // Each v-head's state is independent: heads in parallel, tokens in order inside a head. The first token
        // reads the current state and writes the next one; later tokens update the next one in place.
        let r = s.v_heads / s.k_heads;
        let per_head: Vec<Vec<f32>> = next_ssm
            .par_chunks_mut(dv * dk)
            .zip(st.ssm.par_chunks(dv * dk))
            .enumerate()
            .map(|(h, (next, cur))| {
                let kh = h / r;
                let mut y = vec![0f32; n * dv];
                for t in 0..n {
                    let row = &u[t * c..(t + 1) * c];
                    let q = &row[kh * dk..(kh + 1) * dk];
                    let kv = &row[kd + kh * dk..kd + (kh + 1) * dk];
                    let v = &row[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                    let (g, b) = (decay[t * s.v_heads + h], beta[t * s.v_heads + h]);
                    for (i, srow) in next.chunks_mut(dk).enumerate() {
                        if t == 0 {
                            let src = &cur[i * dk..(i + 1) * dk];
                            srow.iter_mut().zip(src).for_each(|(x, s)| *x = s * g);
                        } else {
                            srow.iter_mut().for_each(|x| *x *= g);
                        }
                        let delta = (v[i] - isa.dot(srow, kv)) * b;
                        srow.iter_mut().zip(kv).for_each(|(x, kj)| *x += kj * delta);
                        y[t * dv + i] = isa.dot(srow, q);
                    }
                }
                y
            })
            .collect();
        // Gated RMSNorm per head: rms_norm(y) ⊙ silu(z).
        for (h, y) in per_head.iter().enumerate() {
            for t in 0..n {
                let dst = &mut out[t * vd + h * dv..t * vd + (h + 1) * dv];
                dst.copy_from_slice(&y[t * dv..(t + 1) * dv]);
                ops::rms_norm(dst, &p.norm, p.eps);
                let z = &z[t * vd + h * dv..t * vd + (h + 1) * dv];
                dst.iter_mut().zip(z).for_each(|(d, &z)| *d *= silu(z));
            }
        }
        st.next = Some((next_conv, next_ssm));
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Matrix = Linear;
    type Vector = Vec<f32>;
    type DeltaWeights = DeltaParams;
    type Kv = CpuKv;
    type Recurrent = CpuRecurrent;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matrix(&self, l: &Linear) -> Result<Linear> {
        // Resident 4-bit matrices are repacked once for the tiled int8 kernel where it runs.
        let tiled = crate::cpu::q8::tiled_kernel_on(Isa::detect())
            .then(|| l.tiled(&self.resident))
            .flatten();
        Ok(tiled.unwrap_or_else(|| l.clone()))
    }

    fn step<R>(&self, f: impl FnOnce() -> R) -> R {
        crate::threads::with_workers_awake(f)
    }

    fn vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn delta_weights(&self, p: &DeltaParams) -> Result<DeltaParams> {
        Ok(p.clone())
    }

    fn expert(&self, layout: &ExpertLayout, inter: usize, hidden: usize, rec: &ExpertRecord) -> Result<[Linear; 3]> {
        layout.linears(inter, hidden, &rec.parts)
    }

    fn new_kv(&self, shape: AttnShape) -> CpuKv {
        CpuKv {
            heads: (0..shape.kv_heads)
                .map(|_| KvHead::new(self.kv, shape.head_dim))
                .collect(),
            head_dim: shape.head_dim,
        }
    }

    fn new_recurrent(&self, s: DeltaShape) -> CpuRecurrent {
        CpuRecurrent {
            conv: vec![0f32; (s.kernel - 1) * s.conv_dim()],
            ssm: vec![0f32; s.v_heads * s.v_dim * s.k_dim],
            next: None,
            spare: None,
        }
    }

    fn upload(&self, data: Vec<f32>, cols: usize) -> Result<CpuTensor> {
        if cols == 0 || !data.len().is_multiple_of(cols) {
            return Err(shape_error("host data is not whole rows"));
        }
        Ok(CpuTensor { data, cols })
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            if r >= x.rows() {
                return Err(shape_error("row index out of range"));
            }
            data.extend_from_slice(x.row(r));
        }
        Ok(CpuTensor { data, cols: x.cols })
    }

    fn take_columns(&self, x: &CpuTensor, cols: &[usize]) -> Result<CpuTensor> {
        if cols.iter().any(|&c| c >= x.cols) {
            return Err(shape_error("column index out of range"));
        }
        let mut data = Vec::with_capacity(x.rows() * cols.len());
        for r in 0..x.rows() {
            let row = x.row(r);
            data.extend(cols.iter().map(|&c| row[c]));
        }
        Ok(CpuTensor { data, cols: cols.len() })
    }

    fn matmul(&self, w: &Linear, x: &CpuTensor) -> Result<CpuTensor> {
        if x.cols != w.cols {
            return Err(shape_error("matmul input width differs from the matrix"));
        }
        Ok(CpuTensor {
            data: w.forward(Isa::detect(), &x.data, x.rows()),
            cols: w.rows,
        })
    }

    fn matmuls(&self, ws: &[&Linear], x: &CpuTensor) -> Result<Vec<CpuTensor>> {
        if ws.iter().any(|w| w.cols != x.cols) {
            return Err(shape_error("matmul input width differs from the matrix"));
        }
        Ok(Linear::forward_many(ws, Isa::detect(), &x.data, x.rows(), true)
            .into_iter()
            .zip(ws)
            .map(|(data, w)| CpuTensor { data, cols: w.rows })
            .collect())
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> Result<CpuTensor> {
        if w.is_empty() || !x.cols.is_multiple_of(w.len()) {
            return Err(shape_error("norm width does not divide the rows"));
        }
        let mut y = x.clone();
        ops::rms_norm(&mut y.data, w, eps);
        Ok(y)
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor> {
        self.zip(a, b, |x, y| x + y)
    }

    fn swiglu(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        if gate.data.len() != up.data.len() {
            return Err(shape_error("swiglu operands differ in size"));
        }
        let mut g = gate.clone();
        ops::swiglu(&mut g.data, &up.data);
        Ok(g)
    }

    fn mul_sigmoid(&self, x: &CpuTensor, g: &CpuTensor) -> Result<CpuTensor> {
        if g.cols == 1 && x.cols != 1 {
            if g.rows() != x.rows() {
                return Err(shape_error("row gate has the wrong number of rows"));
            }
            let mut y = x.clone();
            for (row, &g) in y.data.chunks_mut(x.cols).zip(&g.data) {
                let s = sigmoid(g);
                row.iter_mut().for_each(|v| *v *= s);
            }
            return Ok(y);
        }
        self.zip(x, g, |x, g| x * sigmoid(g))
    }

    fn rope(&self, x: &CpuTensor, rope: &Rope, head_dim: usize, spans: &[SeqSpan]) -> Result<CpuTensor> {
        let mut y = x.clone();
        for s in spans {
            for (t, r) in s.rows.clone().enumerate() {
                rope.apply(&mut y.data[r * x.cols..(r + 1) * x.cols], head_dim, s.pos0 + t);
            }
        }
        Ok(y)
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        shape: AttnShape,
        spans: &[SeqSpan],
        kv: &mut [&mut CpuKv],
    ) -> Result<CpuTensor> {
        let isa = Isa::detect();
        let mut out = Vec::with_capacity(q.rows() * shape.heads * shape.head_dim);
        for (s, cache) in spans.iter().zip(kv.iter_mut()) {
            let r = s.rows.clone();
            let (qs, ks, vs) = (
                &q.data[r.start * q.cols..r.end * q.cols],
                &k.data[r.start * k.cols..r.end * k.cols],
                &v.data[r.start * v.cols..r.end * v.cols],
            );
            cache.append(ks, vs);
            out.extend(ops::attention(isa, shape, qs, s.len(), &cache.heads));
        }
        Ok(CpuTensor {
            data: out,
            cols: shape.heads * shape.head_dim,
        })
    }

    fn gated_delta(
        &self,
        p: &DeltaParams,
        qkv: &CpuTensor,
        z: &CpuTensor,
        b: &CpuTensor,
        a: &CpuTensor,
        spans: &[SeqSpan],
        state: &mut [&mut CpuRecurrent],
    ) -> Result<CpuTensor> {
        let vd = p.shape.value_dim();
        let mut out = vec![0f32; qkv.rows() * vd];
        for (s, st) in spans.iter().zip(state.iter_mut()) {
            let r = s.rows.clone();
            fn part(x: &CpuTensor, r: std::ops::Range<usize>) -> &[f32] {
                &x.data[r.start * x.cols..r.end * x.cols]
            }
            self.delta_one(
                p,
                part(qkv, r.clone()),
                part(z, r.clone()),
                part(b, r.clone()),
                part(a, r.clone()),
                s.len(),
                st,
                &mut out[r.start * vd..r.end * vd],
            );
        }
        Ok(CpuTensor { data: out, cols: vd })
    }

    fn experts(&self, jobs: Vec<ExpertJob<Self>>) -> Result<Vec<CpuTensor>> {
        let threads = rayon::current_num_threads();
        let isa = Isa::detect();
        let run = |j: &ExpertJob<Self>, split: bool| {
            let [gate, up, down] = &j.mats;
            let m = j.x.rows();
            let [mut g, u]: [Vec<f32>; 2] = Linear::forward_many(&[gate, up], isa, &j.x.data, m, split)
                .try_into()
                .expect("two matrices, two outputs");
            ops::swiglu(&mut g, &u);
            CpuTensor {
                data: down.forward_with(isa, &g, m, split),
                cols: down.rows,
            }
        };
        // Whole experts, one per thread at a time (one fork-join for them all), for as many as keep every
        // thread busy to the end; the rest (fewer than the threads) with each matmul's rows split across the
        // threads, so no thread waits through another's lone expert. A row's result does not depend on the
        // split, so neither do the bits.
        let whole = if threads > 1 {
            jobs.len() - jobs.len() % threads
        } else {
            0
        };
        let mut out = crate::threads::parallel_map(&jobs[..whole], |j| run(j, false));
        out.extend(jobs[whole..].iter().map(|j| run(j, threads > 1)));
        Ok(out)
    }

    fn combine(&self, hidden: usize, outputs: &[CpuTensor], picks: &[Vec<Pick>]) -> Result<CpuTensor> {
        let mut out = vec![0f32; picks.len() * hidden];
        for (o, token) in out.chunks_mut(hidden).zip(picks) {
            for p in token {
                let y = outputs
                    .get(p.expert)
                    .filter(|y| p.row < y.rows())
                    .ok_or_else(|| shape_error("a routed expert's output is missing"))?;
                for (acc, v) in o.iter_mut().zip(y.row(p.row)) {
                    *acc += p.weight * v;
                }
            }
        }
        Ok(CpuTensor {
            data: out,
            cols: hidden,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_rows_split_per_head_in_order() {
        let (kv_heads, hd) = (2, 8);
        let be = CpuBackend {
            kv: KvType::F32,
            ..CpuBackend::default()
        };
        let mut kv = be.new_kv(AttnShape {
            heads: 4,
            kv_heads,
            head_dim: hd,
        });
        let row = |p: usize, n: usize| -> Vec<f32> { (0..n * kv_heads * hd).map(|i| (p * 1000 + i) as f32).collect() };
        // A 30-token prompt, then one token at a time.
        kv.append(&row(0, 30), &row(5, 30));
        for p in 30..40 {
            kv.append(&row(p, 1), &row(p + 5, 1));
        }
        assert_eq!(kv.len(), 40);
        // Position 39's value for head 1 is the second half of its row.
        let crate::cpu::kv::KvSlice::F32(v) = kv.heads[1].values() else {
            panic!("f32 cache")
        };
        assert_eq!(&v[39 * hd..40 * hd], &row(44, 1)[hd..]);
        kv.truncate(10);
        assert!(kv.heads.iter().all(|h| h.len() == 10));
    }

    /// A batch of any size gives each expert's own output, in order, with the bits it gives alone: whole
    /// experts per thread and the odd one out split across threads compute the same rows.
    #[test]
    fn an_expert_batch_of_any_size_gives_each_experts_own_output() {
        let (hidden, inter) = (128, 64);
        let be = CpuBackend::default();
        let jobs = |n: usize| -> Vec<ExpertJob<CpuBackend>> {
            (0..n)
                .map(|e| ExpertJob {
                    mats: [
                        Linear::arbitrary_q4(inter, hidden, 32, 3 * e),
                        Linear::arbitrary_q4(inter, hidden, 32, 3 * e + 1),
                        Linear::arbitrary_q4(hidden, inter, 32, 3 * e + 2),
                    ],
                    x: CpuTensor {
                        data: (0..2 * hidden).map(|i| ((i + e) as f32 * 0.37).sin()).collect(),
                        cols: hidden,
                    },
                })
                .collect()
        };
        let alone: Vec<Vec<f32>> = (jobs(5).into_iter())
            .map(|j| be.experts(vec![j]).unwrap().remove(0).data)
            .collect();
        assert!(
            alone.windows(2).all(|w| w[0] != w[1]),
            "distinct experts give distinct outputs"
        );
        for n in 1..=5 {
            let out = be.experts(jobs(n)).unwrap();
            assert_eq!(out.len(), n);
            for (e, y) in out.iter().enumerate() {
                assert_eq!(y.data, alone[e], "batch of {n}, expert {e}");
            }
        }
    }
}
