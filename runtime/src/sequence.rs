//! The state of one sequence: its position, each layer's backend-owned cache (KV for attention layers, conv
//! history and recurrent state for Gated DeltaNet layers), and the experts its last token used.
//!
//! [`KvCache`] is the handle users hold (one per sequence; the model that made it runs it). It can report
//! its length, checkpoint and restore (speculative decoding's rollback), truncate (KV-only models, or to where
//! it is), and fork (a prefix shared by two continuations). A forward that fails leaves it as it was: KV
//! appends are cut back and recurrent layers drop the state they wrote.

use std::any::Any;

use crate::backend::{Backend, KvState, RecurrentState};
use crate::error::{ModelError, Result};

/// One layer's state.
pub(crate) enum LayerState<B: Backend> {
    Kv(B::Kv),
    Recurrent(B::Recurrent),
}

impl<B: Backend> Clone for LayerState<B> {
    fn clone(&self) -> Self {
        match self {
            LayerState::Kv(k) => LayerState::Kv(k.clone()),
            LayerState::Recurrent(r) => LayerState::Recurrent(r.clone()),
        }
    }
}

/// A sequence's state on backend `B`.
pub(crate) struct Sequence<B: Backend> {
    /// Which model made it (a sequence is refused by another model).
    pub model_id: u64,
    pub layers: Vec<LayerState<B>>,
    /// Per layer, the experts the last token was routed to (the prev-token prefetch prediction).
    pub last_experts: Vec<Vec<usize>>,
    /// `prefixes[i]` fingerprints the first `i` tokens (`prefixes[0]` the empty sequence), one per position
    /// processed and the empty one: a checkpoint restores only onto the tokens it was taken after, not onto a
    /// branch that rewrote them since.
    pub prefixes: Vec<u64>,
}

/// The fingerprint of a prefix followed by `token` computed with `top_k` experts per token (splitmix64's
/// finaliser over the three): the same tokens through other experts leave other KV and recurrent state.
fn extend_prefix(prefix: u64, token: u32, top_k: usize) -> u64 {
    let step = u64::from(token) | (top_k as u64) << 32;
    let mut z = prefix ^ (step + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl<B: Backend> Clone for Sequence<B> {
    fn clone(&self) -> Self {
        Self {
            model_id: self.model_id,
            layers: self.layers.clone(),
            last_experts: self.last_experts.clone(),
            prefixes: self.prefixes.clone(),
        }
    }
}

impl<B: Backend> Sequence<B> {
    /// After a failed forward: every layer back to `len` positions, written states dropped.
    pub fn roll_back(&mut self, len: usize) {
        for l in &mut self.layers {
            match l {
                LayerState::Kv(k) => k.truncate(len),
                LayerState::Recurrent(r) => r.discard(),
            }
        }
    }

    /// After a successful forward of `tokens` with `top_k` experts per token.
    pub fn commit(&mut self, tokens: &[u32], top_k: usize) {
        for l in &mut self.layers {
            if let LayerState::Recurrent(r) = l {
                r.commit();
            }
        }
        for &t in tokens {
            let last = self.prefixes.last().copied().unwrap_or(0);
            self.prefixes.push(extend_prefix(last, t, top_k));
        }
    }

    /// Positions processed.
    pub fn positions(&self) -> usize {
        self.prefixes.len().saturating_sub(1)
    }

    /// The fingerprint of the first `len` tokens (0 for none, or past the end).
    fn prefix(&self, len: usize) -> u64 {
        self.prefixes.get(len).copied().unwrap_or(0)
    }
}

/// What every backend's sequence offers behind [`KvCache`].
pub(crate) trait SequenceState: Send {
    fn len(&self) -> usize;
    fn model_id(&self) -> u64;
    fn checkpoint(&self) -> Box<dyn Any + Send>;
    fn restore(&mut self, cp: &(dyn Any + Send)) -> Result<()>;
    fn truncate(&mut self, len: usize) -> Result<()>;
    fn fork(&self) -> Box<dyn SequenceState>;
    /// Bytes of the recurrent states (what a checkpoint copies).
    fn recurrent_bytes(&self) -> usize;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A snapshot of a sequence at one position.
struct Snapshot<B: Backend> {
    len: usize,
    /// The fingerprint of the tokens before `len`.
    prefix: u64,
    /// Per layer: the KV length, or a copy of the recurrent state.
    layers: Vec<LayerSnapshot<B>>,
    last_experts: Vec<Vec<usize>>,
}

enum LayerSnapshot<B: Backend> {
    Kv(usize),
    Recurrent(B::Recurrent),
}

impl<B: Backend> SequenceState for Sequence<B> {
    fn len(&self) -> usize {
        self.positions()
    }

    fn model_id(&self) -> u64 {
        self.model_id
    }

    fn checkpoint(&self) -> Box<dyn Any + Send> {
        Box::new(Snapshot::<B> {
            len: self.positions(),
            prefix: self.prefix(self.positions()),
            layers: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Kv(k) => LayerSnapshot::Kv(k.len()),
                    LayerState::Recurrent(r) => LayerSnapshot::Recurrent(r.clone()),
                })
                .collect(),
            last_experts: self.last_experts.clone(),
        })
    }

    fn restore(&mut self, cp: &(dyn Any + Send)) -> Result<()> {
        let refuse = |why: &str| {
            Err(ModelError::InvalidArgument(format!(
                "this checkpoint does not belong to this cache ({why}; the cache is at position {}, {} layers)",
                self.positions(),
                self.layers.len()
            )))
        };
        let Some(cp) = cp.downcast_ref::<Snapshot<B>>() else {
            return refuse("it comes from another backend");
        };
        if cp.layers.len() != self.layers.len() || cp.len > self.positions() {
            return refuse(&format!("it is at position {}", cp.len));
        }
        let fits = self.layers.iter().zip(&cp.layers).all(|(l, s)| match (l, s) {
            (LayerState::Kv(k), LayerSnapshot::Kv(n)) => *n <= k.len(),
            (LayerState::Recurrent(_), LayerSnapshot::Recurrent(_)) => true,
            _ => false,
        });
        if !fits {
            return refuse(&format!("it is at position {}", cp.len));
        }
        if self.prefix(cp.len) != cp.prefix {
            return refuse(&format!(
                "it was taken after other tokens than the cache now holds before position {}: a branch since \
                 rewrote them",
                cp.len
            ));
        }
        for (l, s) in self.layers.iter_mut().zip(&cp.layers) {
            match (l, s) {
                (LayerState::Kv(k), LayerSnapshot::Kv(n)) => k.truncate(*n),
                (LayerState::Recurrent(r), LayerSnapshot::Recurrent(saved)) => *r = saved.clone(),
                _ => unreachable!("checked above"),
            }
        }
        self.last_experts.clone_from(&cp.last_experts);
        self.prefixes.truncate(cp.len + 1);
        Ok(())
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.positions() {
            return Err(ModelError::InvalidArgument(format!(
                "cannot truncate a sequence of {} positions to {len}",
                self.positions()
            )));
        }
        if len < self.positions() && self.layers.iter().any(|l| matches!(l, LayerState::Recurrent(_))) {
            return Err(ModelError::InvalidArgument(
                "a recurrent (Gated DeltaNet) state cannot be truncated; restore a checkpoint instead".into(),
            ));
        }
        for l in &mut self.layers {
            if let LayerState::Kv(k) = l {
                k.truncate(len);
            }
        }
        if len < self.positions() {
            // The routes of a token no longer cached guess nothing about the next one (as after a restore).
            self.last_experts.iter_mut().for_each(Vec::clear);
        }
        self.prefixes.truncate(len + 1);
        Ok(())
    }

    fn fork(&self) -> Box<dyn SequenceState> {
        Box::new(self.clone())
    }

    fn recurrent_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Recurrent(r) => r.bytes(),
                LayerState::Kv(_) => 0,
            })
            .sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// One sequence's state (KV caches, recurrent states), owned by the backend of the model that made it
/// ([`crate::DecoderModel::new_cache`]).
pub struct KvCache {
    pub(crate) inner: Box<dyn SequenceState>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvCache({} positions)", self.len())
    }
}

/// A snapshot of a [`KvCache`] at one position: KV lengths (KV caches roll back by truncation) and copies of
/// every recurrent state (which cannot be rolled back otherwise).
pub struct CacheCheckpoint {
    len: usize,
    model_id: u64,
    snapshot: Box<dyn Any + Send>,
    /// Bytes of the copied recurrent states.
    bytes: usize,
}

impl std::fmt::Debug for CacheCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CacheCheckpoint(position {})", self.len)
    }
}

impl CacheCheckpoint {
    /// The position the snapshot was taken at.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it was taken before any token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the copied recurrent states.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl KvCache {
    pub(crate) fn new<B: Backend>(seq: Sequence<B>) -> Self {
        Self { inner: Box::new(seq) }
    }

    /// Positions processed.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether no position has been processed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Snapshots the cache after its current position.
    pub fn checkpoint(&self) -> CacheCheckpoint {
        CacheCheckpoint {
            len: self.len(),
            model_id: self.inner.model_id(),
            snapshot: self.inner.checkpoint(),
            bytes: self.inner.recurrent_bytes(),
        }
    }

    /// Returns the cache to `cp`'s position exactly: KV caches are truncated, recurrent states copied back.
    /// `cp` must come from this sequence (or a fork of it) at or before its current position.
    pub fn restore(&mut self, cp: &CacheCheckpoint) -> Result<()> {
        if cp.model_id != self.inner.model_id() {
            return Err(ModelError::InvalidArgument(
                "this checkpoint does not belong to this cache (it comes from another model)".into(),
            ));
        }
        self.inner.restore(cp.snapshot.as_ref())
    }

    /// Forgets every position from `len` on. Models with recurrent layers can only be taken back with a
    /// checkpoint, and refuse.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }

    /// An independent copy that continues from the same position (a shared prefix).
    pub fn fork(&self) -> KvCache {
        KvCache {
            inner: self.inner.fork(),
        }
    }
}
