//! The cpu backend's KV cache, one [`KvHead`] per key/value head, and the two attention kernels that read it.
//!
//! Keys are kept in blocks of [`KEY_BLOCK`] positions, dims-major inside a block (`[head_dim][KEY_BLOCK]`), so a
//! query's dot products with 16 keys are 16 lanes of one multiply-add chain over the dims: one vector load per
//! dim, shared by every query head of the group, and no horizontal sum per key (with keys row-major, the sums
//! across lanes cost as much as the products). Values stay row-major (`[positions, head_dim]`), which is the
//! order the weighted sum wants. Elements are f32 or f16 ([`KvType`]); the kernels widen f16 on load.
//!
//! Every score is one fused multiply-add chain in dim order and every output element one chain in position
//! order, so all instruction sets give the same bits, as do a batch and each of its sequences alone.

use std::ops::Range;

use half::f16;

use super::Isa;

/// Positions per key block.
pub const KEY_BLOCK: usize = 16;

/// Positions a head's arrays grow by. Capacity stays within this of the length: `Vec`'s doubling would let a
/// long context hold up to twice the memory the planner's KV budget counts.
const GROW_POSITIONS: usize = 256;

/// Element type of a KV cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvType {
    /// IEEE single: the activations' own values.
    #[default]
    F32,
    /// IEEE half: half the memory and the bytes read per step (about 3 significant digits; K and V are
    /// projections of normalized activations, far inside its range; a value beyond ±65504 is kept at the
    /// largest half instead of becoming infinite).
    F16,
}

impl KvType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    /// `f32` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }
}

/// A KV element the kernels can read.
pub(super) trait KvElem: Copy + Default {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// The slice itself when the elements are f32 (the NEON kernels widen other types into a buffer).
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
}

impl KvElem for f32 {
    #[inline(always)]
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        // Saturating: an infinite key would turn every later score of its head into NaN.
        f16::from_f32(x.clamp(-f16::MAX.to_f32(), f16::MAX.to_f32()))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// A borrowed run of KV elements.
#[derive(Debug, Clone, Copy)]
pub enum KvSlice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
}

impl KvSlice<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone)]
enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl Store {
    fn new(ty: KvType) -> Self {
        match ty {
            KvType::F32 => Store::F32(Vec::new()),
            KvType::F16 => Store::F16(Vec::new()),
        }
    }

    fn view(&self) -> KvSlice<'_> {
        match self {
            Store::F32(v) => KvSlice::F32(v),
            Store::F16(v) => KvSlice::F16(v),
        }
    }

    fn capacity_bytes(&self) -> usize {
        match self {
            Store::F32(v) => v.capacity() * 4,
            Store::F16(v) => v.capacity() * 2,
        }
    }

    fn truncate(&mut self, n: usize) {
        match self {
            Store::F32(v) => v.truncate(n),
            Store::F16(v) => v.truncate(n),
        }
    }
}

/// Reserves room for `need` elements in steps of [`GROW_POSITIONS`] positions of `per_position` elements.
fn reserve<T>(v: &mut Vec<T>, need: usize, per_position: usize) {
    if need > v.capacity() {
        v.reserve_exact(need.next_multiple_of(GROW_POSITIONS * per_position) - v.len());
    }
}

/// Writes position `p`'s key into its block (a new block starts zeroed) and appends its value row.
fn push_into<T: KvElem>(keys: &mut Vec<T>, values: &mut Vec<T>, hd: usize, p: usize, k: &[f32], v: &[f32]) {
    let (block, lane) = (p / KEY_BLOCK, p % KEY_BLOCK);
    let start = block * KEY_BLOCK * hd;
    if lane == 0 {
        // `truncate` keeps whole blocks, so a new block starts at the end.
        debug_assert_eq!(keys.len(), start);
        reserve(keys, start + KEY_BLOCK * hd, hd);
        keys.resize(start + KEY_BLOCK * hd, T::default());
    }
    for (d, &x) in k.iter().enumerate() {
        keys[start + d * KEY_BLOCK + lane] = T::from_f32(x);
    }
    debug_assert_eq!(values.len(), p * hd);
    reserve(values, (p + 1) * hd, hd);
    values.extend(v.iter().map(|&x| T::from_f32(x)));
}

/// One key/value head's cache.
#[derive(Debug, Clone)]
pub struct KvHead {
    keys: Store,
    values: Store,
    head_dim: usize,
    len: usize,
}

impl KvHead {
    /// An empty cache of `head_dim`-wide keys and values stored as `ty`.
    pub fn new(ty: KvType, head_dim: usize) -> Self {
        Self {
            keys: Store::new(ty),
            values: Store::new(ty),
            head_dim,
            len: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends one position's key and value (`head_dim` each).
    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        assert!(k.len() == hd && v.len() == hd, "KvHead::push: key and value of {hd}");
        match (&mut self.keys, &mut self.values) {
            (Store::F32(ks), Store::F32(vs)) => push_into(ks, vs, hd, self.len, k, v),
            (Store::F16(ks), Store::F16(vs)) => push_into(ks, vs, hd, self.len, k, v),
            _ => unreachable!("keys and values share one type"),
        }
        self.len += 1;
    }

    /// Keeps the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            // Lanes past `len` in the last block keep stale keys: nothing reads a score beyond `visible`.
            self.keys.truncate(len.div_ceil(KEY_BLOCK) * KEY_BLOCK * self.head_dim);
            self.values.truncate(len * self.head_dim);
        }
    }

    /// The keys: every block holding a position, `[blocks][head_dim][KEY_BLOCK]`.
    pub fn keys(&self) -> KvSlice<'_> {
        self.keys.view()
    }

    /// The values, `[positions, head_dim]`.
    pub fn values(&self) -> KvSlice<'_> {
        self.values.view()
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.keys.capacity_bytes() + self.values.capacity_bytes()
    }
}

impl Isa {
    /// Attention scores of `q.len() / hd` query heads against the first `visible` keys of one head's
    /// [`KvHead::keys`]: `out[g·visible + j] = scale · Σ_d q[g·hd + d]·key_j[d]`, the sum one fused
    /// multiply-add chain in `d` order.
    pub fn key_scores(self, q: &[f32], keys: KvSlice<'_>, hd: usize, visible: usize, scale: f32, out: &mut [f32]) {
        let heads = q.len().checked_div(hd).unwrap_or(0);
        assert!(
            q.len() == heads * hd
                && out.len() == heads * visible
                && keys.len() >= visible.div_ceil(KEY_BLOCK) * KEY_BLOCK * hd,
            "key_scores: {heads} heads of {hd}, {visible} keys, {} key elements, {} scores",
            keys.len(),
            out.len()
        );
        if heads == 0 || visible == 0 {
            return;
        }
        match (self, keys) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, KvSlice::F32(k)) => super::kv_x86::key_scores_avx512(q, k, hd, visible, scale, out),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, KvSlice::F16(k)) => super::kv_x86::key_scores_avx512(q, k, hd, visible, scale, out),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, KvSlice::F32(k)) => super::kv_x86::key_scores_avx2(q, k, hd, visible, scale, out),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, KvSlice::F16(k)) => super::kv_x86::key_scores_avx2(q, k, hd, visible, scale, out),
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, KvSlice::F32(k)) => super::neon::key_scores(q, k, hd, visible, scale, out),
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, KvSlice::F16(k)) => super::neon::key_scores(q, k, hd, visible, scale, out),
            (_, KvSlice::F32(k)) => key_scores_scalar(q, k, hd, visible, scale, out),
            (_, KvSlice::F16(k)) => key_scores_scalar(q, k, hd, visible, scale, out),
        }
    }

    /// The probability-weighted sum of value rows `rows` for `out.len() / hd` query heads: `out[g·hd + c] +=
    /// Σ_{j ∈ rows} w[g·stride + j]·v[j·hd + c]`, each element one fused multiply-add chain in `j` order (so
    /// summing `0..a` and then `a..b` into the same `out` gives the bits of summing `0..b`).
    pub fn weighted_values(
        self,
        out: &mut [f32],
        w: &[f32],
        stride: usize,
        rows: Range<usize>,
        values: KvSlice<'_>,
        hd: usize,
    ) {
        let heads = out.len().checked_div(hd).unwrap_or(0);
        assert!(
            out.len() == heads * hd
                && rows.end <= stride
                && (heads == 0 || w.len() >= (heads - 1) * stride + rows.end)
                && values.len() >= rows.end * hd,
            "weighted_values: {heads} heads of {hd}, rows {rows:?} of {stride}, {} weights, {} value elements",
            w.len(),
            values.len()
        );
        if rows.is_empty() || heads == 0 {
            return;
        }
        let r = rows;
        match (self, values) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, KvSlice::F32(v)) => super::kv_x86::weighted_values_avx512(out, w, stride, r, v, hd),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, KvSlice::F16(v)) => super::kv_x86::weighted_values_avx512(out, w, stride, r, v, hd),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, KvSlice::F32(v)) => super::kv_x86::weighted_values_avx2(out, w, stride, r, v, hd),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, KvSlice::F16(v)) => super::kv_x86::weighted_values_avx2(out, w, stride, r, v, hd),
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, KvSlice::F32(v)) => super::neon::weighted_values(out, w, stride, r, v, hd),
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, KvSlice::F16(v)) => super::neon::weighted_values(out, w, stride, r, v, hd),
            (_, KvSlice::F32(v)) => weighted_values_scalar(out, w, stride, r, v, hd, 0),
            (_, KvSlice::F16(v)) => weighted_values_scalar(out, w, stride, r, v, hd, 0),
        }
    }
}

/// [`Isa::key_scores`] one score at a time: the oracle the SIMD kernels equal bit for bit.
pub(super) fn key_scores_scalar<T: KvElem>(
    q: &[f32],
    keys: &[T],
    hd: usize,
    visible: usize,
    scale: f32,
    out: &mut [f32],
) {
    for (qh, row) in q.chunks_exact(hd).zip(out.chunks_exact_mut(visible)) {
        for (j, o) in row.iter_mut().enumerate() {
            let block = &keys[(j / KEY_BLOCK) * KEY_BLOCK * hd + j % KEY_BLOCK..];
            let mut s = 0f32;
            for (d, &x) in qh.iter().enumerate() {
                s = x.mul_add(block[d * KEY_BLOCK].to_f32(), s);
            }
            *o = s * scale;
        }
    }
}

/// [`Isa::weighted_values`] one element at a time, for columns `from..hd`: the oracle the SIMD kernels equal
/// bit for bit (`from` 0), and their columns past the last whole register.
pub(super) fn weighted_values_scalar<T: KvElem>(
    out: &mut [f32],
    w: &[f32],
    stride: usize,
    rows: Range<usize>,
    values: &[T],
    hd: usize,
    from: usize,
) {
    for (g, o) in out.chunks_exact_mut(hd).enumerate() {
        for j in rows.clone() {
            let (p, row) = (w[g * stride + j], &values[j * hd..(j + 1) * hd]);
            for (acc, &x) in o[from..].iter_mut().zip(&row[from..]) {
                *acc = p.mul_add(x.to_f32(), *acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_keys_and_values_saturate_instead_of_overflowing() {
        for (x, want) in [(1e6f32, 65504.0f32), (-7e4, -65504.0), (65504.0, 65504.0), (1.5, 1.5)] {
            assert_eq!(<f16 as KvElem>::from_f32(x).to_f32(), want, "{x}");
        }
        assert!(<f16 as KvElem>::from_f32(f32::NAN).to_f32().is_nan());
    }

    fn rows(n: usize, hd: usize, seed: u32) -> Vec<f32> {
        (0..n * hd)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// Key `j` as the kernels see it, read back out of its block.
    fn key(h: &KvHead, j: usize) -> Vec<f32> {
        let hd = h.head_dim;
        let at = |d: usize| (j / KEY_BLOCK) * KEY_BLOCK * hd + d * KEY_BLOCK + j % KEY_BLOCK;
        match h.keys() {
            KvSlice::F32(k) => (0..hd).map(|d| k[at(d)]).collect(),
            KvSlice::F16(k) => (0..hd).map(|d| k[at(d)].to_f32()).collect(),
        }
    }

    fn value(h: &KvHead, j: usize) -> Vec<f32> {
        let hd = h.head_dim;
        match h.values() {
            KvSlice::F32(v) => v[j * hd..(j + 1) * hd].to_vec(),
            KvSlice::F16(v) => v[j * hd..(j + 1) * hd].iter().map(|x| x.to_f32()).collect(),
        }
    }

    #[test]
    fn positions_read_back_after_pushes_and_truncation() {
        let hd = 6;
        for ty in [KvType::F32, KvType::F16] {
            let round = |x: f32| {
                if ty == KvType::F16 {
                    f16::from_f32(x).to_f32()
                } else {
                    x
                }
            };
            let (ks, vs) = (rows(40, hd, 1), rows(40, hd, 2));
            let mut h = KvHead::new(ty, hd);
            for p in 0..37 {
                h.push(&ks[p * hd..(p + 1) * hd], &vs[p * hd..(p + 1) * hd]);
            }
            // Cut back into a block, then past a block boundary, and write different rows after each cut.
            h.truncate(20);
            h.truncate(33);
            assert_eq!(h.len(), 20);
            let (ks2, vs2) = (rows(40, hd, 3), rows(40, hd, 4));
            for p in 20..40 {
                h.push(&ks2[p * hd..(p + 1) * hd], &vs2[p * hd..(p + 1) * hd]);
            }
            assert_eq!(h.len(), 40);
            assert_eq!(h.keys().len(), 48 * hd);
            assert_eq!(h.values().len(), 40 * hd);
            for p in 0..40 {
                let (k, v) = if p < 20 { (&ks, &vs) } else { (&ks2, &vs2) };
                let want = |r: &[f32]| r[p * hd..(p + 1) * hd].iter().map(|&x| round(x)).collect::<Vec<_>>();
                assert_eq!(key(&h, p), want(k), "{ty:?} key {p}");
                assert_eq!(value(&h, p), want(v), "{ty:?} value {p}");
            }
            h.truncate(16);
            assert_eq!((h.len(), h.keys().len(), h.values().len()), (16, 16 * hd, 16 * hd));
        }
    }

    #[test]
    fn arrays_grow_in_steps_not_by_doubling() {
        let hd = 8;
        let r = rows(1, hd, 5);
        let mut h = KvHead::new(KvType::F32, hd);
        for p in 0..1100 {
            h.push(&r, &r);
            // Both arrays stay within GROW_POSITIONS positions of the length.
            assert!(
                h.bytes() <= 2 * (p + 1 + GROW_POSITIONS) * hd * 4,
                "{} bytes at {}",
                h.bytes(),
                p + 1
            );
        }
        let mut half = KvHead::new(KvType::F16, hd);
        for _ in 0..1100 {
            half.push(&r, &r);
        }
        assert_eq!(half.bytes() * 2, h.bytes());
    }
}
