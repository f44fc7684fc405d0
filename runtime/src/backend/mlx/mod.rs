//! The `mlx` backend: the model's ops on MLX arrays and kernels (mlx-rs), Metal on macOS and MLX's CPU build on
//! Linux.
//!
//! Weights are uploaded once at load, in f32 where they are floats (scales, biases, norms, dense weights):
//! MLX's CPU quantized kernels lose accuracy with bf16 scales. Quantized matrices keep their packed codes and
//! run through `quantized_matmul`. Everything is queued lazily; each layer's output is started with
//! `async_eval`, and the one host sync per MoE layer is the router's logits (`to_host`). An expert record's
//! packed codes are handed to MLX in place with a handle that pins the record's slot until MLX releases the
//! buffer: with Metal on unified memory that is zero-copy for page-aligned buffers; MLX's CPU allocator
//! (Linux) copies at once and releases the slot.

mod device;
mod ops;
mod zero_copy;

pub use device::{limit_buffer_cache, recommended_working_set};

use expert_store::ExpertRecord;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::Array;

use super::{Backend, ExpertJob, KvState, Pick, RecurrentState, SeqSpan};
use crate::error::Result;
use crate::gated_delta::{DeltaParams, DeltaShape};
use crate::linear::Linear;
use crate::ops::{AttnShape, Rope};
use crate::weights::ExpertLayout;

use ops::{bad, err, f32s, scalar, upload_linear, MlxLinear};

/// MLX through mlx-rs.
#[derive(Debug, Clone, Copy, Default)]
pub struct MlxBackend;

/// Keys and values `[1, kv_heads, capacity, head_dim]` whose first `len` positions hold the sequence (none
/// before the first token). The capacity grows in steps of [`KV_STEP`] positions and new rows are written into
/// it (`slice_update`, which MLX does in place when nothing else holds the buffer), as mlx-lm's `KVCache`
/// does: appending by concatenation copied every layer's whole cache at each decode step (~3 GB a token at
/// 8k positions on a 235B model). Arrays are values, so a clone is still a snapshot.
#[derive(Clone)]
pub struct MlxKv {
    kv: Option<(Array, Array)>,
    len: usize,
}

/// Positions the mlx KV cache grows by.
const KV_STEP: usize = 256;

thread_local! {
    /// This thread's score block budget (tests shrink it to see blocks on small fixtures).
    static SCORE_BLOCK_BYTES: std::cell::Cell<u64> = const { std::cell::Cell::new(super::MLX_SCORE_BLOCK_BYTES) };
}

/// Runs `f` with prompt attention on this thread cut into query blocks of at most `bytes` of scores (tests).
#[doc(hidden)]
pub fn with_score_block_bytes<R>(bytes: u64, f: impl FnOnce() -> R) -> R {
    let old = SCORE_BLOCK_BYTES.replace(bytes);
    let out = f();
    SCORE_BLOCK_BYTES.set(old);
    out
}

/// Query rows per block for `heads` query heads over `keys` positions: as many as keep the scores within the
/// budget, at least 1.
fn query_block_rows(heads: usize, keys: usize) -> usize {
    let row = (heads * keys * 4).max(1) as u64;
    (SCORE_BLOCK_BYTES.get() / row).max(1) as usize
}

impl MlxKv {
    /// Writes `k` and `v` `[1, kv_heads, n, head_dim]` at the positions after the sequence, and returns the
    /// cache's keys and values up to their end.
    fn append(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let n = k.shape()[2] as usize;
        let (start, end) = (self.len, self.len + n);
        let capacity = self.kv.as_ref().map_or(0, |(k, _)| k.shape()[2] as usize);
        if end > capacity {
            // A bigger buffer holding the positions so far; those past `len` (truncated away) are not kept.
            let grown = |new: &Array, old: Option<&Array>| -> Result<Array> {
                let s = new.shape();
                let room = (end.next_multiple_of(KV_STEP) - start) as i32;
                let free = mlx_rs::ops::zeros_dtype(&[s[0], s[1], room, s[3]], new.dtype()).map_err(err)?;
                match old {
                    Some(old) if start > 0 => {
                        mlx_rs::ops::concatenate(&[old.index((.., .., ..start as i32, ..)), free], 2).map_err(err)
                    }
                    _ => Ok(free),
                }
            };
            // Both built before either replaces the buffers: a failure leaves the cache as it was.
            let old = self.kv.as_ref();
            let keys = grown(k, old.map(|o| &o.0))?;
            let values = grown(v, old.map(|o| &o.1))?;
            self.kv = Some((keys, values));
        }
        let Some((kc, vc)) = self.kv.as_mut() else {
            return Err(bad("the KV cache has no buffer after growing"));
        };
        let (s, e) = (start as i32, end as i32);
        kc.try_index_mut((.., .., s..e, ..), k).map_err(err)?;
        vc.try_index_mut((.., .., s..e, ..), v).map_err(err)?;
        self.len = end;
        Ok((kc.index((.., .., ..e, ..)), vc.index((.., .., ..e, ..))))
    }
}

impl KvState for MlxKv {
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) {
        // The positions past `len` are overwritten by the next append.
        self.len = self.len.min(len);
    }
}

/// The conv history `[kernel − 1, conv_dim]` and state `[v_heads, Dv, Dk]`, and the next ones a forward wrote.
/// Arrays are immutable values, so a clone is a cheap snapshot.
pub struct MlxRecurrent {
    hist: Array,
    state: Array,
    next: Option<(Array, Array)>,
}

impl Clone for MlxRecurrent {
    /// The committed state only, as the cpu backend's: a snapshot or fork never carries a forward's uncommitted
    /// write along.
    fn clone(&self) -> Self {
        MlxRecurrent {
            hist: self.hist.clone(),
            state: self.state.clone(),
            next: None,
        }
    }
}

impl RecurrentState for MlxRecurrent {
    fn commit(&mut self) {
        if let Some((h, s)) = self.next.take() {
            self.hist = h;
            self.state = s;
        }
    }
    fn discard(&mut self) {
        self.next = None;
    }
    fn bytes(&self) -> usize {
        (self.hist.size() + self.state.size()) * 4
    }
}

/// Gated DeltaNet parameters on the device.
pub struct MlxDelta {
    shape: DeltaShape,
    eps: f32,
    /// Conv taps as `kernel` arrays of `[conv_dim]`.
    taps: Vec<Array>,
    decay_rate: Array,
    dt_bias: Array,
    norm: Array,
}

/// `[n, H·D]` → `[1, H, n, D]`.
fn heads_first(a: &Array, n: i32, heads: i32, d: i32) -> Result<Array> {
    a.reshape(&[1, n, heads, d])
        .and_then(|a| a.transpose_axes(&[0, 2, 1, 3]))
        .map_err(err)
}

/// Rows `r` of a 2-D array.
fn rows(a: &Array, r: &std::ops::Range<usize>) -> Array {
    a.index((r.start as i32..r.end as i32, ..))
}

impl Backend for MlxBackend {
    type Tensor = Array;
    type Matrix = MlxLinear;
    type Vector = Array;
    type DeltaWeights = MlxDelta;
    type Kv = MlxKv;
    type Recurrent = MlxRecurrent;

    fn name(&self) -> &'static str {
        "mlx"
    }

    fn matrix(&self, l: &Linear) -> Result<MlxLinear> {
        upload_linear(l.format, l.rows, l.cols, &l.parts, l.bias.as_deref())
    }

    fn vector(&self, v: &[f32]) -> Result<Array> {
        Ok(f32s(v, &[v.len() as i32]))
    }

    fn delta_weights(&self, p: &DeltaParams) -> Result<MlxDelta> {
        let s = p.shape;
        let (c, kk) = (s.conv_dim(), s.kernel);
        let taps = (0..kk)
            .map(|j| {
                let tap: Vec<f32> = (0..c).map(|ch| p.conv[ch * kk + j]).collect();
                f32s(&tap, &[c as i32])
            })
            .collect();
        let hv = s.v_heads as i32;
        Ok(MlxDelta {
            shape: s,
            eps: p.eps,
            taps,
            decay_rate: f32s(&p.decay_rate, &[hv]),
            dt_bias: f32s(&p.dt_bias, &[hv]),
            norm: f32s(&p.norm, &[s.v_dim as i32]),
        })
    }

    fn expert(&self, layout: &ExpertLayout, inter: usize, hidden: usize, rec: &ExpertRecord) -> Result<[MlxLinear; 3]> {
        let [g, u, d] = layout.linears(inter, hidden, &rec.parts)?;
        Ok([self.matrix(&g)?, self.matrix(&u)?, self.matrix(&d)?])
    }

    fn new_kv(&self, _shape: AttnShape) -> MlxKv {
        MlxKv { kv: None, len: 0 }
    }

    fn new_recurrent(&self, s: DeltaShape) -> MlxRecurrent {
        MlxRecurrent {
            // Data, not a lazy `zeros`, whose stream would be this thread's (a cache may be used on another).
            hist: f32s(
                &vec![0f32; (s.kernel - 1) * s.conv_dim()],
                &[s.kernel as i32 - 1, s.conv_dim() as i32],
            ),
            state: f32s(
                &vec![0f32; s.v_heads * s.v_dim * s.k_dim],
                &[s.v_heads as i32, s.v_dim as i32, s.k_dim as i32],
            ),
            next: None,
        }
    }

    fn upload(&self, data: Vec<f32>, cols: usize) -> Result<Array> {
        if cols == 0 || !data.len().is_multiple_of(cols) {
            return Err(bad("host data is not whole rows"));
        }
        Ok(f32s(&data, &[(data.len() / cols) as i32, cols as i32]))
    }

    fn to_host(&self, x: &Array) -> Result<Vec<f32>> {
        let x = x.contiguous().map_err(err)?;
        x.eval().map_err(err)?;
        Ok(x.try_as_slice::<f32>().map_err(|e| bad(&e.to_string()))?.to_vec())
    }

    fn gather_rows(&self, x: &Array, r: &[usize]) -> Result<Array> {
        let idx: Vec<i32> = r.iter().map(|&i| i as i32).collect();
        x.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 0)
            .map_err(err)
    }

    fn take_columns(&self, x: &Array, cols: &[usize]) -> Result<Array> {
        let idx: Vec<i32> = cols.iter().map(|&i| i as i32).collect();
        x.take_axis(Array::from_slice(&idx, &[idx.len() as i32]), 1)
            .map_err(err)
    }

    fn matmul(&self, w: &MlxLinear, x: &Array) -> Result<Array> {
        w.forward(x)
    }

    fn rms_norm(&self, x: &Array, w: &Array, eps: f32) -> Result<Array> {
        let (shape, width) = (x.shape().to_vec(), w.size() as i32);
        let (n, cols) = (shape[0], shape[1]);
        if width == 0 || cols % width != 0 {
            return Err(bad("norm width does not divide the rows"));
        }
        let y =
            mlx_rs::fast::rms_norm(x.reshape(&[n, cols / width, width]).map_err(err)?, Some(w), eps).map_err(err)?;
        y.reshape(&[n, cols]).map_err(err)
    }

    fn add(&self, a: &Array, b: &Array) -> Result<Array> {
        a.add(b).map_err(err)
    }

    fn swiglu(&self, gate: &Array, up: &Array) -> Result<Array> {
        mlx_rs::nn::silu(gate).and_then(|g| g.multiply(up)).map_err(err)
    }

    fn mul_sigmoid(&self, x: &Array, g: &Array) -> Result<Array> {
        x.multiply(mlx_rs::ops::sigmoid(g).map_err(err)?).map_err(err)
    }

    fn rope(&self, x: &Array, rope: &Rope, head_dim: usize, spans: &[SeqSpan]) -> Result<Array> {
        // YaRN's magnitude scale applies to the rotated dims only (as mlx-lm's `YarnRoPE` and the cpu backend
        // scale them): with partial rotary, a per-column factor, 1 past the rotated prefix.
        let mscale = (rope.mscale != 1.0).then(|| {
            if rope.dims == head_dim {
                scalar(rope.mscale)
            } else {
                let cols: Vec<f32> = (0..head_dim)
                    .map(|c| if c < rope.dims { rope.mscale } else { 1.0 })
                    .collect();
                f32s(&cols, &[head_dim as i32])
            }
        });
        let freqs: Vec<f32> = rope.inv_freq.iter().map(|f| (1.0 / f) as f32).collect();
        let freqs = f32s(&freqs, &[freqs.len() as i32]);
        let cols = x.shape()[1];
        let (d, heads) = (head_dim as i32, cols / head_dim as i32);
        let mut parts = Vec::with_capacity(spans.len());
        for s in spans {
            let n = s.len() as i32;
            let mut a = heads_first(&rows(x, &s.rows), n, heads, d)?;
            if let Some(m) = &mscale {
                a = a.multiply(m).map_err(err)?;
            }
            let r = mlx_rs::fast::rope(a, rope.dims as i32, rope.traditional, None, 1.0, s.pos0 as i32, &freqs)
                .map_err(err)?;
            parts.push(
                r.transpose_axes(&[0, 2, 1, 3])
                    .and_then(|r| r.reshape(&[n, cols]))
                    .map_err(err)?,
            );
        }
        mlx_rs::ops::concatenate(&parts, 0).map_err(err)
    }

    fn attention(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        s: AttnShape,
        spans: &[SeqSpan],
        kv: &mut [&mut MlxKv],
    ) -> Result<Array> {
        let (heads, kvh, d) = (s.heads as i32, s.kv_heads as i32, s.head_dim as i32);
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let mut parts = Vec::with_capacity(spans.len());
        for (span, cache) in spans.iter().zip(kv.iter_mut()) {
            let n = span.len() as i32;
            let q = heads_first(&rows(q, &span.rows), n, heads, d)?;
            let k = heads_first(&rows(k, &span.rows), n, kvh, d)?;
            let v = heads_first(&rows(v, &span.rows), n, kvh, d)?;
            let (k, v) = cache.append(&k, &v)?;
            let keys = k.shape()[2];
            let block = query_block_rows(s.heads, keys as usize) as i32;
            let o = if n > block {
                // Query rows `b0..b1` see the keys up to their last row's position: MLX aligns a causal mask
                // to the end of the keys, so each block is masked as the whole chunk would be.
                let start = keys - n;
                let mut blocks = Vec::with_capacity((n / block + 1) as usize);
                for b0 in (0..n).step_by(block as usize) {
                    let b1 = (b0 + block).min(n);
                    blocks.push(
                        mlx_rs::fast::scaled_dot_product_attention(
                            q.index((.., .., b0..b1, ..)),
                            k.index((.., .., ..start + b1, ..)),
                            v.index((.., .., ..start + b1, ..)),
                            scale,
                            ScaledDotProductAttentionMask::Causal,
                            None,
                        )
                        .map_err(err)?,
                    );
                }
                mlx_rs::ops::concatenate(&blocks, 2)
            } else if n > 1 {
                mlx_rs::fast::scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    scale,
                    ScaledDotProductAttentionMask::Causal,
                    None,
                )
            } else {
                mlx_rs::fast::scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    scale,
                    None::<ScaledDotProductAttentionMask>,
                    None,
                )
            }
            .map_err(err)?;
            parts.push(
                o.transpose_axes(&[0, 2, 1, 3])
                    .and_then(|o| o.reshape(&[n, heads * d]))
                    .map_err(err)?,
            );
        }
        mlx_rs::ops::concatenate(&parts, 0).map_err(err)
    }

    fn gated_delta(
        &self,
        w: &MlxDelta,
        qkv: &Array,
        z: &Array,
        b: &Array,
        a: &Array,
        spans: &[SeqSpan],
        state: &mut [&mut MlxRecurrent],
    ) -> Result<Array> {
        let s = w.shape;
        let e = err;
        let (hk, hv, dk, dv) = (s.k_heads as i32, s.v_heads as i32, s.k_dim as i32, s.v_dim as i32);
        let (kd, vd, kernel) = (s.key_dim() as i32, s.value_dim() as i32, s.kernel as i32);
        let mut parts = Vec::with_capacity(spans.len());
        for (span, st) in spans.iter().zip(state.iter_mut()) {
            let ni = span.len() as i32;
            let (qkv, z, b, a) = (
                rows(qkv, &span.rows),
                rows(z, &span.rows),
                rows(b, &span.rows),
                rows(a, &span.rows),
            );
            let window = mlx_rs::ops::concatenate(&[st.hist.clone(), qkv], 0).map_err(e)?;
            let mut conv = window.index((0..ni, ..)).multiply(&w.taps[0]).map_err(e)?;
            for j in 1..kernel {
                conv = conv
                    .add(window.index((j..j + ni, ..)).multiply(&w.taps[j as usize]).map_err(e)?)
                    .map_err(e)?;
            }
            let u = mlx_rs::nn::silu(conv).map_err(e)?;
            // The next history is the window's last `kernel − 1` rows. A slice shares the window's buffer (the
            // whole chunk's conv input, ~67 MB a layer for a 2,048-token chunk on Qwen3-Next), and an
            // unevaluated one holds the window through its graph: either way the state would pin it until the
            // next forward, or for a checkpoint's life. So a chunk's history is computed into a buffer of its
            // own now (an elementwise op cannot take over a buffer much bigger than its output); a decode
            // step's window is no bigger than the history, and keeps the slice.
            let hist = window.index((ni.., ..));
            let hist = if ni > kernel {
                let own = hist.multiply(scalar(1.0)).map_err(e)?;
                mlx_rs::transforms::async_eval([&own]).map_err(e)?;
                own
            } else {
                hist
            };
            // q = l2norm(q)/√Dk, k = l2norm(k) (HF's x/√(Σx² + 1e-6): an RMSNorm with eps 1e-6/Dk, scaled),
            // heads repeated to the v-heads.
            let inv = 1.0 / (dk as f32).sqrt();
            let norm = |x: Array, scale: f32| -> Result<Array> {
                let x = x.reshape(&[ni, hk, dk]).map_err(e)?;
                let x = mlx_rs::fast::rms_norm(x, None, 1e-6 * inv * inv)
                    .map_err(e)?
                    .multiply(scalar(scale))
                    .map_err(e)?;
                mlx_rs::ops::repeat_axis::<f32>(x, hv / hk, 1).map_err(e)
            };
            let q = norm(u.index((.., ..kd)), inv * inv)?;
            let k = norm(u.index((.., kd..2 * kd)), inv)?;
            let v = u.index((.., 2 * kd..)).reshape(&[ni, hv, dv]).map_err(e)?;
            let beta = mlx_rs::ops::sigmoid(&b).map_err(e)?;
            let sp = mlx_rs::nn::softplus(a.add(&w.dt_bias).map_err(e)?).map_err(e)?;
            let g = sp
                .multiply(&w.decay_rate)
                .and_then(|x| x.negative())
                .and_then(|x| x.exp())
                .map_err(e)?;
            let mut state = st.state.clone();
            let mut ys = Vec::with_capacity(span.len());
            for t in 0..ni {
                let (qt, kt, vt) = (q.index(t), k.index(t), v.index(t)); // [Hv, Dk], [Hv, Dk], [Hv, Dv]
                let (gt, bt) = (
                    g.index(t).reshape(&[hv, 1, 1]).map_err(e)?,
                    beta.index(t).reshape(&[hv, 1]).map_err(e)?,
                );
                let kt3 = kt.reshape(&[hv, 1, dk]).map_err(e)?;
                state = state.multiply(&gt).map_err(e)?;
                let mem = state.multiply(&kt3).and_then(|x| x.sum_axis(-1, false)).map_err(e)?;
                let delta = vt.subtract(&mem).and_then(|x| x.multiply(&bt)).map_err(e)?;
                let update = kt3.multiply(delta.reshape(&[hv, dv, 1]).map_err(e)?).map_err(e)?;
                state = state.add(&update).map_err(e)?;
                let qt3 = qt.reshape(&[hv, 1, dk]).map_err(e)?;
                ys.push(state.multiply(&qt3).and_then(|x| x.sum_axis(-1, false)).map_err(e)?);
            }
            st.next = Some((hist, state));
            let y = mlx_rs::ops::stack(&ys, 0).map_err(e)?; // [n, Hv, Dv]
            let y = mlx_rs::fast::rms_norm(y, Some(&w.norm), w.eps).map_err(e)?;
            let z = mlx_rs::nn::silu(z.reshape(&[ni, hv, dv]).map_err(e)?).map_err(e)?;
            parts.push(y.multiply(z).and_then(|x| x.reshape(&[ni, vd])).map_err(e)?);
        }
        mlx_rs::ops::concatenate(&parts, 0).map_err(e)
    }

    fn combine(&self, hidden: usize, outputs: &[Array], picks: &[Vec<Pick>]) -> Result<Array> {
        let n = picks.len() as i32;
        let mut out = Array::zeros::<f32>(&[n, hidden as i32]).map_err(err)?;
        if outputs.is_empty() {
            return Ok(out);
        }
        // Every expert's rows in one array; a token's slot-s output is one row of it.
        let mut offsets = Vec::with_capacity(outputs.len());
        let mut at = 0i32;
        for o in outputs {
            offsets.push(at);
            at += o.shape()[0];
        }
        let all = mlx_rs::ops::concatenate(outputs, 0).map_err(err)?;
        let slots = picks.iter().map(Vec::len).max().unwrap_or(0);
        for slot in 0..slots {
            let (mut idx, mut wts) = (Vec::with_capacity(picks.len()), Vec::with_capacity(picks.len()));
            for token in picks {
                match token.get(slot) {
                    Some(p) => {
                        idx.push(offsets[p.expert] + p.row as i32);
                        wts.push(p.weight);
                    }
                    None => {
                        idx.push(0);
                        wts.push(0.0);
                    }
                }
            }
            let rows = all.take_axis(Array::from_slice(&idx, &[n]), 0).map_err(err)?;
            let w = f32s(&wts, &[n, 1]);
            out = out.add(rows.multiply(&w).map_err(err)?).map_err(err)?;
        }
        Ok(out)
    }

    fn experts(&self, jobs: Vec<ExpertJob<Self>>) -> Result<Vec<Array>> {
        let many = jobs.iter().any(|j| j.x.shape()[0] > 1);
        let outputs = jobs
            .into_iter()
            .map(|j| {
                let [gate, up, down] = &j.mats;
                let [g, u] = self.matmul_each([gate, up], &j.x)?;
                let h = self.swiglu(&g, &u)?;
                self.matmul(down, &h)
            })
            .collect::<Result<Vec<_>>>()?;
        // A prompt's chunk: started now, so each record's slot (wrapped without a copy on Metal) and its f32
        // scale copies are let go as the layer goes on, not held until the layer's end; a chunk can use more
        // of a layer's experts than the cache has slots. Decode's few records wait for the layer's own start.
        if many {
            mlx_rs::transforms::async_eval(&outputs).map_err(err)?;
        }
        Ok(outputs)
    }

    fn layer_done(&self, x: &Array) -> Result<()> {
        mlx_rs::transforms::async_eval([x]).map_err(err)
    }
}
