//! The `reference` backend: every op written the plainest way, in f64, with weights dequantized to f64 at
//! load (from the packed codes, exactly). It is the oracle the tests check `cpu` against on every
//! architecture and quantization; it is slow and holds f64 copies of every weight, so it is for tests only.

use expert_store::ExpertRecord;

use super::{Backend, KvState, Pick, RecurrentState, SeqSpan};
use crate::cpu::{Isa, MatRef};
use crate::error::{ModelError, Result};
use crate::gated_delta::{DeltaParams, DeltaShape};
use crate::linear::Linear;
use crate::ops::{AttnShape, Rope};
use crate::weights::ExpertLayout;

/// Naive f64 arithmetic.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceBackend;

/// Row-major `[rows, cols]` f64 values.
#[derive(Debug, Clone)]
pub struct RefTensor {
    data: Vec<f64>,
    cols: usize,
}

impl RefTensor {
    fn rows(&self) -> usize {
        self.data.len() / self.cols.max(1)
    }
    fn row(&self, r: usize) -> &[f64] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A dequantized `[rows, cols]` matrix.
pub struct RefMatrix {
    w: Vec<f64>,
    rows: usize,
    cols: usize,
    bias: Option<Vec<f64>>,
}

/// Keys and values in f64.
#[derive(Debug, Clone)]
pub struct RefKv {
    k: Vec<f64>,
    v: Vec<f64>,
    width: usize,
}

impl KvState for RefKv {
    fn len(&self) -> usize {
        self.k.len() / self.width.max(1)
    }
    fn truncate(&mut self, len: usize) {
        self.k.truncate(len * self.width);
        self.v.truncate(len * self.width);
    }
}

/// Conv history and state in f64, with the next ones a forward wrote.
#[derive(Debug, Clone)]
pub struct RefRecurrent {
    hist: Vec<Vec<f64>>,
    ssm: Vec<f64>,
    next: Option<(Vec<Vec<f64>>, Vec<f64>)>,
}

impl RecurrentState for RefRecurrent {
    fn commit(&mut self) {
        if let Some((h, s)) = self.next.take() {
            self.hist = h;
            self.ssm = s;
        }
    }
    fn discard(&mut self) {
        self.next = None;
    }
    fn bytes(&self) -> usize {
        (self.hist.iter().map(Vec::len).sum::<usize>() + self.ssm.len()) * 8
    }
}

fn err(what: &str) -> ModelError {
    ModelError::Backend(format!("reference: {what}"))
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `x / sqrt(mean(x²) + eps) · w`.
fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let r = 1.0 / (dot(x, x) / x.len() as f64 + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

/// `x / sqrt(Σx² + 1e-6)`.
fn l2(x: &[f64]) -> Vec<f64> {
    let n = (dot(x, x) + 1e-6).sqrt();
    x.iter().map(|v| v / n).collect()
}

/// Every weight of `l` in f64: `scale · q + bias` from the packed codes, or the stored floats.
fn dequantize(m: &MatRef<'_>) -> Vec<f64> {
    let (rows, cols) = (m.rows(), m.cols());
    let mut w = vec![0f64; rows * cols];
    match m {
        MatRef::Dense(_) | MatRef::Tiled(_) => {
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                m.row(crate::cpu::Isa::Scalar, r, &mut row);
                w[r * cols..(r + 1) * cols]
                    .iter_mut()
                    .zip(&row)
                    .for_each(|(o, &v)| *o = v as f64);
            }
        }
        MatRef::Quant(q) => {
            let row_bytes = cols * q.bits as usize / 8;
            let gpr = cols / q.group;
            let mut codes = vec![0f32; cols];
            for r in 0..rows {
                Isa::Scalar.unpack(q.bits, &q.packed[r * row_bytes..(r + 1) * row_bytes], &mut codes);
                for c in 0..cols {
                    let g = r * gpr + c / q.group;
                    let (s, b) = (
                        q.scale_type.get(q.scales, g) as f64,
                        q.scale_type.get(q.biases, g) as f64,
                    );
                    w[r * cols + c] = s * codes[c] as f64 + b;
                }
            }
        }
    }
    w
}

fn upload(l: &Linear) -> RefMatrix {
    RefMatrix {
        w: dequantize(&l.mat()),
        rows: l.rows,
        cols: l.cols,
        bias: l.bias.as_ref().map(|b| b.iter().map(|&v| v as f64).collect()),
    }
}

impl ReferenceBackend {
    fn zip(&self, a: &RefTensor, b: &RefTensor, f: impl Fn(f64, f64) -> f64) -> Result<RefTensor> {
        if a.data.len() != b.data.len() {
            return Err(err("element-wise operands differ in size"));
        }
        Ok(RefTensor {
            data: a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect(),
            cols: a.cols,
        })
    }
}

impl Backend for ReferenceBackend {
    type Tensor = RefTensor;
    type Matrix = RefMatrix;
    type Vector = Vec<f64>;
    type DeltaWeights = DeltaParams;
    type Kv = RefKv;
    type Recurrent = RefRecurrent;

    fn name(&self) -> &'static str {
        "reference"
    }

    fn matrix(&self, l: &Linear) -> Result<RefMatrix> {
        Ok(upload(l))
    }

    fn vector(&self, v: &[f32]) -> Result<Vec<f64>> {
        Ok(v.iter().map(|&x| x as f64).collect())
    }

    fn delta_weights(&self, p: &DeltaParams) -> Result<DeltaParams> {
        Ok(p.clone())
    }

    fn expert(&self, layout: &ExpertLayout, inter: usize, hidden: usize, rec: &ExpertRecord) -> Result<[RefMatrix; 3]> {
        let [g, u, d] = layout.linears(inter, hidden, &rec.parts)?;
        Ok([upload(&g), upload(&u), upload(&d)])
    }

    fn new_kv(&self, shape: AttnShape) -> RefKv {
        RefKv {
            k: Vec::new(),
            v: Vec::new(),
            width: shape.kv_heads * shape.head_dim,
        }
    }

    fn new_recurrent(&self, s: DeltaShape) -> RefRecurrent {
        RefRecurrent {
            hist: vec![vec![0f64; s.conv_dim()]; s.kernel - 1],
            ssm: vec![0f64; s.v_heads * s.v_dim * s.k_dim],
            next: None,
        }
    }

    fn upload(&self, data: Vec<f32>, cols: usize) -> Result<RefTensor> {
        Ok(RefTensor {
            data: data.into_iter().map(|v| v as f64).collect(),
            cols,
        })
    }

    fn to_host(&self, x: &RefTensor) -> Result<Vec<f32>> {
        Ok(x.data.iter().map(|&v| v as f32).collect())
    }

    fn gather_rows(&self, x: &RefTensor, rows: &[usize]) -> Result<RefTensor> {
        if rows.iter().any(|&r| r >= x.rows()) {
            return Err(err("row index out of range"));
        }
        Ok(RefTensor {
            data: rows.iter().flat_map(|&r| x.row(r).iter().copied()).collect(),
            cols: x.cols,
        })
    }

    fn take_columns(&self, x: &RefTensor, cols: &[usize]) -> Result<RefTensor> {
        if cols.iter().any(|&c| c >= x.cols) {
            return Err(err("column index out of range"));
        }
        Ok(RefTensor {
            data: (0..x.rows())
                .flat_map(|r| cols.iter().map(move |&c| x.data[r * x.cols + c]))
                .collect(),
            cols: cols.len(),
        })
    }

    fn matmul(&self, m: &RefMatrix, x: &RefTensor) -> Result<RefTensor> {
        if x.cols != m.cols {
            return Err(err("matmul input width differs from the matrix"));
        }
        let mut data = Vec::with_capacity(x.rows() * m.rows);
        for t in 0..x.rows() {
            for r in 0..m.rows {
                let b = m.bias.as_ref().map_or(0.0, |b| b[r]);
                data.push(dot(&m.w[r * m.cols..(r + 1) * m.cols], x.row(t)) + b);
            }
        }
        Ok(RefTensor { data, cols: m.rows })
    }

    fn rms_norm(&self, x: &RefTensor, w: &Vec<f64>, eps: f32) -> Result<RefTensor> {
        if w.is_empty() || !x.cols.is_multiple_of(w.len()) {
            return Err(err("norm width does not divide the rows"));
        }
        Ok(RefTensor {
            data: x.data.chunks(w.len()).flat_map(|c| rms(c, w, eps as f64)).collect(),
            cols: x.cols,
        })
    }

    fn add(&self, a: &RefTensor, b: &RefTensor) -> Result<RefTensor> {
        self.zip(a, b, |x, y| x + y)
    }

    fn swiglu(&self, gate: &RefTensor, up: &RefTensor) -> Result<RefTensor> {
        self.zip(gate, up, |g, u| silu(g) * u)
    }

    fn mul_sigmoid(&self, x: &RefTensor, g: &RefTensor) -> Result<RefTensor> {
        if g.cols == 1 && x.cols != 1 {
            let data = (0..x.rows())
                .flat_map(|r| x.row(r).iter().map(move |v| v * sigmoid(g.data[r])))
                .collect();
            return Ok(RefTensor { data, cols: x.cols });
        }
        self.zip(x, g, |x, g| x * sigmoid(g))
    }

    fn rope(&self, x: &RefTensor, rope: &Rope, head_dim: usize, spans: &[SeqSpan]) -> Result<RefTensor> {
        let mut y = x.clone();
        let half = rope.dims / 2;
        for s in spans {
            for (t, r) in s.rows.clone().enumerate() {
                let pos = (s.pos0 + t) as f64;
                for head in y.data[r * x.cols..(r + 1) * x.cols].chunks_mut(head_dim) {
                    for (i, f) in rope.inv_freq.iter().enumerate() {
                        let (sin, cos) = (pos * f).sin_cos();
                        let (a, b) = if rope.traditional {
                            (2 * i, 2 * i + 1)
                        } else {
                            (i, i + half)
                        };
                        let (x0, x1) = (head[a], head[b]);
                        head[a] = (x0 * cos - x1 * sin) * rope.mscale as f64;
                        head[b] = (x0 * sin + x1 * cos) * rope.mscale as f64;
                    }
                }
            }
        }
        Ok(y)
    }

    fn attention(
        &self,
        q: &RefTensor,
        k: &RefTensor,
        v: &RefTensor,
        s: AttnShape,
        spans: &[SeqSpan],
        kv: &mut [&mut RefKv],
    ) -> Result<RefTensor> {
        let (hd, kvw) = (s.head_dim, s.kv_heads * s.head_dim);
        let group = s.heads / s.kv_heads;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = Vec::with_capacity(q.rows() * s.heads * hd);
        for (span, cache) in spans.iter().zip(kv.iter_mut()) {
            for r in span.rows.clone() {
                cache.k.extend_from_slice(k.row(r));
                cache.v.extend_from_slice(v.row(r));
            }
            for (t, r) in span.rows.clone().enumerate() {
                let visible = span.pos0 + t + 1;
                for h in 0..s.heads {
                    let kvh = h / group;
                    let qh = &q.row(r)[h * hd..(h + 1) * hd];
                    let scores: Vec<f64> = (0..visible)
                        .map(|j| dot(qh, &cache.k[j * kvw + kvh * hd..j * kvw + (kvh + 1) * hd]) * scale)
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        out.push((0..visible).map(|j| e[j] / z * cache.v[j * kvw + kvh * hd + d]).sum());
                    }
                }
            }
        }
        Ok(RefTensor {
            data: out,
            cols: s.heads * hd,
        })
    }

    fn gated_delta(
        &self,
        p: &DeltaParams,
        qkv: &RefTensor,
        z: &RefTensor,
        b: &RefTensor,
        a: &RefTensor,
        spans: &[SeqSpan],
        state: &mut [&mut RefRecurrent],
    ) -> Result<RefTensor> {
        let s = p.shape;
        let (c, kd, dk, dv, kernel) = (s.conv_dim(), s.key_dim(), s.k_dim, s.v_dim, s.kernel);
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let (taps, decay_rate, dt_bias, norm) = (f(&p.conv), f(&p.decay_rate), f(&p.dt_bias), f(&p.norm));
        let mut out = Vec::with_capacity(qkv.rows() * s.value_dim());
        for (span, st) in spans.iter().zip(state.iter_mut()) {
            let mut hist = st.hist.clone();
            let mut ssm = st.ssm.clone();
            for r in span.rows.clone() {
                hist.push(qkv.row(r).to_vec());
                let u: Vec<f64> = (0..c)
                    .map(|ch| silu((0..kernel).map(|j| hist[j][ch] * taps[ch * kernel + j]).sum()))
                    .collect();
                hist.remove(0);
                for h in 0..s.v_heads {
                    let kh = h / (s.v_heads / s.k_heads);
                    let q: Vec<f64> = l2(&u[kh * dk..(kh + 1) * dk])
                        .iter()
                        .map(|v| v / (dk as f64).sqrt())
                        .collect();
                    let kk = l2(&u[kd + kh * dk..kd + (kh + 1) * dk]);
                    let v = &u[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                    let softplus = (1.0 + (a.row(r)[h] + dt_bias[h]).exp()).ln();
                    let g = (-decay_rate[h] * softplus).exp();
                    let beta = sigmoid(b.row(r)[h]);
                    let st = &mut ssm[h * dv * dk..(h + 1) * dv * dk];
                    st.iter_mut().for_each(|x| *x *= g);
                    let y: Vec<f64> = st
                        .chunks_mut(dk)
                        .enumerate()
                        .map(|(i, row)| {
                            let delta = beta * (v[i] - dot(row, &kk));
                            row.iter_mut().zip(&kk).for_each(|(x, kj)| *x += delta * kj);
                            dot(row, &q)
                        })
                        .collect();
                    let zr = &z.row(r)[h * dv..(h + 1) * dv];
                    let normed = rms(&y, &norm, p.eps as f64);
                    out.extend(normed.iter().zip(zr).map(|(y, &z)| y * silu(z)));
                }
            }
            st.next = Some((hist, ssm));
        }
        Ok(RefTensor {
            data: out,
            cols: s.value_dim(),
        })
    }

    fn combine(&self, hidden: usize, outputs: &[RefTensor], picks: &[Vec<Pick>]) -> Result<RefTensor> {
        let mut data = vec![0f64; picks.len() * hidden];
        for (o, token) in data.chunks_mut(hidden).zip(picks) {
            for p in token {
                let y = outputs
                    .get(p.expert)
                    .filter(|y| p.row < y.rows())
                    .ok_or_else(|| err("a routed expert's output is missing"))?;
                o.iter_mut()
                    .zip(y.row(p.row))
                    .for_each(|(acc, v)| *acc += p.weight as f64 * v);
            }
        }
        Ok(RefTensor { data, cols: hidden })
    }
}
