//! The `mlx` backend: the `cpu` backend's forward pass on MLX arrays and kernels (mlx-rs), Metal on macOS and
//! MLX's CPU build on Linux.
//!
//! Weights are uploaded once at load, in f32 where they are floats (scales, biases, norms, dense weights):
//! MLX's CPU quantized kernels lose accuracy with bf16 scales. Quantized matrices keep their packed codes and
//! run through `quantized_matmul`. Each step has one host sync per MoE layer: the router's logits come back,
//! the experts are chosen and fetched from the expert store on the host, and their records are uploaded as
//! arrays; everything else is queued lazily and started with `async_eval`. A record's packed codes are handed
//! to MLX in place together with a handle that pins the record's slot until MLX releases the buffer: with
//! Metal on unified memory that is zero-copy for page-aligned buffers, and the slot stays pinned until the
//! computation that reads it is done; MLX's CPU allocator (Linux) copies at once and releases the slot.

mod ops;
mod zero_copy;

use std::sync::Mutex;

use expert_store::OwnedBytes;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::cpu::Isa;
use crate::error::Result;
use crate::gated_delta::{GatedDeltaNet, InProj};
use crate::layers::{Attention, DecoderModel, Ffn, ForwardOptions, Mixer, Mlp, SparseMoe};
use crate::linear::Linear;
use crate::ops::KvCache;

use ops::{bad, f32s, scalar, MlxLinear};

/// Per-layer MLX state of one sequence: keys/values `[1, kv_heads, T, head_dim]`, or the Gated DeltaNet
/// conv history `[kernel − 1, conv_dim]` and state `[v_heads, Dv, Dk]`. Arrays are immutable values, so a
/// clone is a cheap snapshot (what cache checkpoints take).
#[derive(Clone, Default)]
pub struct MlxCache {
    layers: Vec<LayerState>,
}

impl std::fmt::Debug for MlxCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MlxCache({} layers)", self.layers.len())
    }
}

#[derive(Clone, Default)]
enum LayerState {
    #[default]
    Empty,
    Kv(Array, Array),
    Delta(Array, Array),
}

/// An attention block's weights on the device.
struct MlxAttention {
    q: MlxLinear,
    k: MlxLinear,
    v: MlxLinear,
    o: MlxLinear,
    qk_norm: Option<(Array, Array)>,
    /// `1 / inv_freq` of the rotated dims (MLX's `freqs`).
    freqs: Array,
}

/// A Gated DeltaNet block's weights on the device.
struct MlxDelta {
    /// `[qkv, z, b, a]` (split) or `[qkvz, ba]` (grouped).
    proj: Vec<MlxLinear>,
    grouped: bool,
    /// Conv taps as `kernel` arrays of `[conv_dim]`.
    taps: Vec<Array>,
    decay_rate: Array,
    dt_bias: Array,
    norm: Array,
    out: MlxLinear,
}

struct MlxMlp {
    gate: MlxLinear,
    up: MlxLinear,
    down: MlxLinear,
}

enum MlxFfn {
    Dense(MlxMlp),
    Moe {
        router: MlxLinear,
        shared: Option<(MlxMlp, Option<MlxLinear>)>,
    },
}

struct MlxLayer {
    input_norm: Array,
    post_norm: Array,
    attn: Option<MlxAttention>,
    delta: Option<MlxDelta>,
    ffn: MlxFfn,
}

struct Weights {
    layers: Vec<MlxLayer>,
    norm: Array,
    head: MlxLinear,
}

/// The model's weights as MLX arrays, computing [`DecoderModel::forward`] on MLX.
pub struct MlxModel {
    // MLX arrays are `Send` but not `Sync`; the model is shared by reference, so calls are serialized.
    weights: Mutex<Weights>,
}

impl MlxModel {
    /// Uploads `m`'s resident weights (experts stay in the expert store and are uploaded per step).
    pub fn new(m: &DecoderModel) -> Result<Self> {
        let mut layers = Vec::with_capacity(m.layers.len());
        for l in &m.layers {
            let (attn, delta) = match &l.mixer {
                Mixer::Attention(a) => (Some(upload_attention(a)?), None),
                Mixer::Linear(d) => (None, Some(upload_delta(d)?)),
            };
            let ffn = match &l.ffn {
                Ffn::Dense(mlp) => MlxFfn::Dense(upload_mlp(mlp)?),
                Ffn::Moe(moe) => MlxFfn::Moe {
                    router: MlxLinear::resident(&moe.router)?,
                    shared: match &moe.shared {
                        Some(s) => Some((
                            upload_mlp(&s.mlp)?,
                            s.gate.as_ref().map(MlxLinear::resident).transpose()?,
                        )),
                        None => None,
                    },
                },
            };
            layers.push(MlxLayer {
                input_norm: f32s(&l.input_norm, &[l.input_norm.len() as i32]),
                post_norm: f32s(&l.post_norm, &[l.post_norm.len() as i32]),
                attn,
                delta,
                ffn,
            });
        }
        Ok(Self {
            weights: Mutex::new(Weights {
                layers,
                norm: f32s(&m.norm, &[m.norm.len() as i32]),
                head: MlxLinear::resident(&m.lm_head)?,
            }),
        })
    }

    /// [`DecoderModel::forward`] on MLX: same checks, same routing, logits `[m, vocab]` on the host.
    pub fn forward(
        &self,
        m: &DecoderModel,
        tokens: &[u32],
        cache: &mut KvCache,
        opts: &ForwardOptions,
    ) -> Result<Vec<f32>> {
        let (n, h) = (tokens.len(), m.hidden);
        let k = m.check_forward(tokens, cache, opts)?;
        let w = self
            .weights
            .lock()
            .map_err(|_| bad("an earlier mlx forward panicked"))?;
        let state = cache.mlx.get_or_insert_with(|| MlxCache {
            layers: vec![LayerState::Empty; m.layers.len()],
        });
        // The embedding lookup is a row copy: done on the host, then uploaded.
        let isa = Isa::detect();
        let mut x0 = vec![0f32; n * h];
        for (t, &id) in tokens.iter().enumerate() {
            m.embed.mat().row(isa, id as usize, &mut x0[t * h..(t + 1) * h]);
        }
        let mut x = f32s(&x0, &[n as i32, h as i32]);
        let pos0 = cache.len;
        for (i, (layer, ml)) in m.layers.iter().zip(&w.layers).enumerate() {
            let a = ops::rms_norm(&x, &ml.input_norm, m.eps)?;
            let st = &mut state.layers[i];
            let a = match (&layer.mixer, &ml.attn, &ml.delta) {
                (Mixer::Attention(cpu), Some(attn), _) => attention(cpu, attn, &a, n, pos0, st)?,
                (Mixer::Linear(cpu), _, Some(d)) => delta(cpu, d, &a, n, st)?,
                _ => return Err(bad("layer kinds changed after upload")),
            };
            x = x.add(&a).map_err(ops::err)?;
            let b = ops::rms_norm(&x, &ml.post_norm, m.eps)?;
            let f = match (&layer.ffn, &ml.ffn) {
                (Ffn::Dense(_), MlxFfn::Dense(mlp)) => mlp_forward(mlp, &b)?,
                (Ffn::Moe(moe), MlxFfn::Moe { router, shared }) => {
                    let (f, last) = moe_forward(moe, router, shared.as_ref(), &b, n, k)?;
                    if let Some(slot) = cache.last_experts.get_mut(i) {
                        *slot = last;
                    }
                    f
                }
                _ => return Err(bad("layer kinds changed after upload")),
            };
            x = x.add(&f).map_err(ops::err)?;
            // Start this layer on the device while the host moves on (the next router read waits for it).
            mlx_rs::transforms::async_eval([&x]).map_err(ops::err)?;
        }
        cache.len += n;
        let rows = if opts.all_logits {
            x
        } else {
            x.index((n as i32 - 1.., ..))
        };
        let logits = w.head.forward(&ops::rms_norm(&rows, &w.norm, m.eps)?)?;
        logits.eval().map_err(ops::err)?;
        Ok(logits.as_slice::<f32>().to_vec())
    }
}

fn upload_attention(a: &Attention) -> Result<MlxAttention> {
    if a.rope.mscale != 1.0 && a.rope.dims != a.shape.head_dim {
        return Err(bad(
            "YaRN magnitude scaling on partial rotary dims is not implemented on mlx",
        ));
    }
    let freqs: Vec<f32> = a.rope.inv_freq.iter().map(|f| (1.0 / f) as f32).collect();
    let d = a.shape.head_dim as i32;
    Ok(MlxAttention {
        q: MlxLinear::resident(&a.q)?,
        k: MlxLinear::resident(&a.k)?,
        v: MlxLinear::resident(&a.v)?,
        o: MlxLinear::resident(&a.o)?,
        qk_norm: a.qk_norm.as_ref().map(|(q, k)| (f32s(q, &[d]), f32s(k, &[d]))),
        freqs: f32s(&freqs, &[freqs.len() as i32]),
    })
}

fn upload_delta(d: &GatedDeltaNet) -> Result<MlxDelta> {
    let (proj, grouped) = match &d.proj {
        InProj::Split { qkv, z, b, a } => (
            [qkv, z, b, a]
                .into_iter()
                .map(MlxLinear::resident)
                .collect::<Result<Vec<_>>>()?,
            false,
        ),
        InProj::Grouped { qkvz, ba } => (
            [qkvz, ba]
                .into_iter()
                .map(MlxLinear::resident)
                .collect::<Result<Vec<_>>>()?,
            true,
        ),
    };
    let (c, kk) = (d.shape.conv_dim(), d.shape.kernel);
    let taps = (0..kk)
        .map(|j| {
            let tap: Vec<f32> = (0..c).map(|ch| d.conv[ch * kk + j]).collect();
            f32s(&tap, &[c as i32])
        })
        .collect();
    let hv = d.shape.v_heads as i32;
    Ok(MlxDelta {
        proj,
        grouped,
        taps,
        decay_rate: f32s(&d.decay_rate, &[hv]),
        dt_bias: f32s(&d.dt_bias, &[hv]),
        norm: f32s(&d.norm, &[d.shape.v_dim as i32]),
        out: MlxLinear::resident(&d.out)?,
    })
}

fn upload_mlp(m: &Mlp) -> Result<MlxMlp> {
    Ok(MlxMlp {
        gate: MlxLinear::resident(&m.gate)?,
        up: MlxLinear::resident(&m.up)?,
        down: MlxLinear::resident(&m.down)?,
    })
}

fn mlp_forward(m: &MlxMlp, x: &Array) -> Result<Array> {
    let g = mlx_rs::nn::silu(m.gate.forward(x)?).map_err(ops::err)?;
    m.down.forward(&g.multiply(m.up.forward(x)?).map_err(ops::err)?)
}

/// Self-attention for `n` tokens at positions `pos0..`: `[n, hidden]` → `[n, hidden]`.
fn attention(
    cpu: &Attention,
    w: &MlxAttention,
    x: &Array,
    n: usize,
    pos0: usize,
    st: &mut LayerState,
) -> Result<Array> {
    let s = cpu.shape;
    let (n, heads, kvh, d) = (n as i32, s.heads as i32, s.kv_heads as i32, s.head_dim as i32);
    let e = ops::err;
    let q = w.q.forward(x)?;
    let (q, gate) = if cpu.output_gate {
        let qg = q.reshape(&[n, heads, 2 * d]).map_err(e)?;
        (
            qg.index((.., .., ..d)),
            Some(qg.index((.., .., d..)).reshape(&[n, heads * d]).map_err(e)?),
        )
    } else {
        (q.reshape(&[n, heads, d]).map_err(e)?, None)
    };
    let k = w.k.forward(x)?.reshape(&[n, kvh, d]).map_err(e)?;
    let v = w.v.forward(x)?.reshape(&[n, kvh, d]).map_err(e)?;
    let (q, k) = match &w.qk_norm {
        Some((qn, kn)) => (ops::rms_norm(&q, qn, cpu.eps)?, ops::rms_norm(&k, kn, cpu.eps)?),
        None => (q, k),
    };
    // [n, H, D] → [1, H, n, D]
    let heads_first = |a: &Array| {
        a.expand_dims(0)
            .and_then(|a| a.transpose_axes(&[0, 2, 1, 3]))
            .map_err(e)
    };
    let rope = |a: Array| -> Result<Array> {
        let a = if cpu.rope.mscale != 1.0 {
            a.multiply(scalar(cpu.rope.mscale)).map_err(e)?
        } else {
            a
        };
        mlx_rs::fast::rope(
            a,
            cpu.rope.dims as i32,
            cpu.rope.traditional,
            None,
            1.0,
            pos0 as i32,
            &w.freqs,
        )
        .map_err(e)
    };
    let q = rope(heads_first(&q)?)?;
    let k = rope(heads_first(&k)?)?;
    let v = heads_first(&v)?;
    let (k, v) = match std::mem::take(st) {
        LayerState::Kv(pk, pv) => (
            mlx_rs::ops::concatenate(&[pk, k], 2).map_err(e)?,
            mlx_rs::ops::concatenate(&[pv, v], 2).map_err(e)?,
        ),
        _ => (k, v),
    };
    *st = LayerState::Kv(k.clone(), v.clone());
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    let o = if n > 1 {
        mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, scale, ScaledDotProductAttentionMask::Causal, None)
    } else {
        mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, scale, None::<ScaledDotProductAttentionMask>, None)
    }
    .map_err(e)?;
    let mut o = o
        .transpose_axes(&[0, 2, 1, 3])
        .and_then(|o| o.reshape(&[n, heads * d]))
        .map_err(e)?;
    if let Some(g) = gate {
        o = o.multiply(mlx_rs::ops::sigmoid(&g).map_err(e)?).map_err(e)?;
    }
    w.o.forward(&o)
}

/// Gated DeltaNet for `n` tokens: projections, causal conv over the cached history, then the delta rule
/// token by token on the `[Hv, Dv, Dk]` state, the gated norm and the output projection.
fn delta(cpu: &GatedDeltaNet, w: &MlxDelta, x: &Array, n: usize, st: &mut LayerState) -> Result<Array> {
    let s = cpu.shape;
    let e = ops::err;
    let (ni, hk, hv, dk, dv) = (
        n as i32,
        s.k_heads as i32,
        s.v_heads as i32,
        s.k_dim as i32,
        s.v_dim as i32,
    );
    let (kd, vd, c, kernel) = (
        s.key_dim() as i32,
        s.value_dim() as i32,
        s.conv_dim() as i32,
        s.kernel as i32,
    );
    let (qkv, z, b, a) = if w.grouped {
        let r = hv / hk;
        let mixed = w.proj[0]
            .forward(x)?
            .reshape(&[ni, hk, 2 * dk + 2 * r * dv])
            .map_err(e)?;
        let flat = |a: Array, width: i32| a.reshape(&[ni, width]).map_err(e);
        let q = flat(mixed.index((.., .., ..dk)), kd)?;
        let k = flat(mixed.index((.., .., dk..2 * dk)), kd)?;
        let v = flat(mixed.index((.., .., 2 * dk..2 * dk + r * dv)), vd)?;
        let z = flat(mixed.index((.., .., 2 * dk + r * dv..)), vd)?;
        let ba = w.proj[1].forward(x)?.reshape(&[ni, hk, 2 * r]).map_err(e)?;
        let qkv = mlx_rs::ops::concatenate(&[q, k, v], 1).map_err(e)?;
        (
            qkv,
            z,
            flat(ba.index((.., .., ..r)), hv)?,
            flat(ba.index((.., .., r..)), hv)?,
        )
    } else {
        (
            w.proj[0].forward(x)?,
            w.proj[1].forward(x)?,
            w.proj[2].forward(x)?,
            w.proj[3].forward(x)?,
        )
    };
    let (hist, state) = match std::mem::take(st) {
        LayerState::Delta(hist, state) => (hist, state),
        _ => (
            Array::zeros::<f32>(&[kernel - 1, c]).map_err(e)?,
            Array::zeros::<f32>(&[hv, dv, dk]).map_err(e)?,
        ),
    };
    let window = mlx_rs::ops::concatenate(&[hist, qkv], 0).map_err(e)?;
    let mut conv = window.index((0..ni, ..)).multiply(&w.taps[0]).map_err(e)?;
    for j in 1..kernel {
        conv = conv
            .add(window.index((j..j + ni, ..)).multiply(&w.taps[j as usize]).map_err(e)?)
            .map_err(e)?;
    }
    let u = mlx_rs::nn::silu(conv).map_err(e)?;
    let hist = window.index((ni.., ..));
    // q = l2norm(q)/√Dk, k = l2norm(k) (an RMSNorm with eps 1e-6/Dk, scaled), heads repeated to the v-heads.
    let inv = 1.0 / (dk as f32).sqrt();
    let norm = |a: Array, scale: f32| -> Result<Array> {
        let a = a.reshape(&[ni, hk, dk]).map_err(e)?;
        let a = mlx_rs::fast::rms_norm(a, None, 1e-6 * inv * inv)
            .map_err(e)?
            .multiply(scalar(scale))
            .map_err(e)?;
        mlx_rs::ops::repeat_axis::<f32>(a, hv / hk, 1).map_err(e)
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
    let mut state = state;
    let mut ys = Vec::with_capacity(n);
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
    *st = LayerState::Delta(hist, state);
    let y = mlx_rs::ops::stack(&ys, 0).map_err(e)?; // [n, Hv, Dv]
    let y = mlx_rs::fast::rms_norm(y, Some(&w.norm), cpu.eps).map_err(e)?;
    let z = mlx_rs::nn::silu(z.reshape(&[ni, hv, dv]).map_err(e)?).map_err(e)?;
    w.out
        .forward(&y.multiply(z).and_then(|x| x.reshape(&[ni, vd])).map_err(e)?)
}

/// Routed experts (and the shared expert) for `n` tokens. The one host sync of the layer: the router's
/// logits, routed on the host exactly as the cpu backend does; each chosen expert's record is fetched from
/// the expert store, uploaded, and run over the tokens routed to it.
fn moe_forward(
    moe: &SparseMoe,
    router: &MlxLinear,
    shared: Option<&(MlxMlp, Option<MlxLinear>)>,
    x: &Array,
    n: usize,
    k: usize,
) -> Result<(Array, Vec<usize>)> {
    let e = ops::err;
    let (h, k) = (moe.hidden, k.min(moe.num_experts));
    let logits = router.forward(x)?;
    logits.eval().map_err(e)?;
    let logits = logits.as_slice::<f32>();
    let routes: Vec<(Vec<usize>, Vec<f32>)> = logits.chunks(moe.num_experts).map(|l| moe.kind.route(l, k)).collect();
    let mut users: Vec<Vec<(usize, f32)>> = vec![Vec::new(); moe.num_experts];
    for (t, (ids, ws)) in routes.iter().enumerate() {
        for (&ex, &wt) in ids.iter().zip(ws) {
            users[ex].push((t, wt));
        }
    }
    let used: Vec<usize> = (0..moe.num_experts).filter(|&ex| !users[ex].is_empty()).collect();
    let mut fetch = moe.experts.fetch_layer(moe.layer, &used)?;
    // Experts arrive in any order (resident first, then as reads complete); their contributions are summed
    // in expert order so the result does not depend on it (streamed equals resident bit for bit).
    let mut parts: Vec<(usize, Array)> = Vec::with_capacity(used.len());
    while let Some(batch) = fetch.next_batch(usize::MAX) {
        for (pos, rec) in batch? {
            let ex = used[pos];
            let [gate, up, down] = expert_linears(moe, &rec.parts)?;
            let rows: Vec<i32> = users[ex].iter().map(|&(t, _)| t as i32).collect();
            let idx = Array::from_slice(&rows, &[rows.len() as i32]);
            let xs = x.take_axis(&idx, 0).map_err(e)?;
            let g = mlx_rs::nn::silu(gate.forward(&xs)?).map_err(e)?;
            let y = down.forward(&g.multiply(up.forward(&xs)?).map_err(e)?)?;
            // Scatter the weighted rows back: a [n, m] matrix holding each token's routing weight.
            let mut sel = vec![0f32; n * rows.len()];
            for (i, &(t, wt)) in users[ex].iter().enumerate() {
                sel[t * rows.len() + i] = wt;
            }
            let sel = f32s(&sel, &[n as i32, rows.len() as i32]);
            parts.push((pos, sel.matmul(&y).map_err(e)?));
        }
    }
    parts.sort_by_key(|(pos, _)| *pos);
    let mut out = Array::zeros::<f32>(&[n as i32, h as i32]).map_err(e)?;
    for (_, p) in parts {
        out = out.add(&p).map_err(e)?;
    }
    if let Some((mlp, gate)) = shared {
        let mut y = mlp_forward(mlp, x)?;
        if let Some(g) = gate {
            y = y.multiply(mlx_rs::ops::sigmoid(g.forward(x)?).map_err(e)?).map_err(e)?;
        }
        out = out.add(&y).map_err(e)?;
    }
    let last = routes.last().map(|(ids, _)| ids.clone()).unwrap_or_default();
    Ok((out, last))
}

/// Gate, up and down projections of one expert record, uploaded.
fn expert_linears(moe: &SparseMoe, parts: &[OwnedBytes]) -> Result<[MlxLinear; 3]> {
    let (h, inter) = (moe.hidden, moe.inter);
    let [fg, fu, fd] = moe.layout.formats;
    let (gate_parts, up_parts, down_parts): (Vec<OwnedBytes>, Vec<OwnedBytes>, Vec<OwnedBytes>) = if moe.layout.fused {
        // Row-major `[2·inter, ·]` parts: the first half of each is the gate's rows.
        let pg = fg.parts();
        let half = |p: &OwnedBytes, first: bool| {
            let mid = p.len() / 2;
            p.slice(if first { 0..mid } else { mid..p.len() })
                .ok_or_else(|| bad("fused expert part cannot be halved"))
        };
        (
            parts[..pg].iter().map(|p| half(p, true)).collect::<Result<_>>()?,
            parts[..pg].iter().map(|p| half(p, false)).collect::<Result<_>>()?,
            parts[pg..].to_vec(),
        )
    } else {
        let (pg, pu) = (fg.parts(), fu.parts());
        (
            parts[..pg].to_vec(),
            parts[pg..pg + pu].to_vec(),
            parts[pg + pu..].to_vec(),
        )
    };
    Ok([
        ops::upload_linear(fg, inter, h, &gate_parts, None)?,
        ops::upload_linear(fu, inter, h, &up_parts, None)?,
        ops::upload_linear(fd, h, inter, &down_parts, None)?,
    ])
}

impl MlxLinear {
    /// A resident [`Linear`] uploaded.
    fn resident(l: &Linear) -> Result<Self> {
        ops::upload_linear(l.format, l.rows, l.cols, &l.parts, l.bias.as_deref())
    }
}
