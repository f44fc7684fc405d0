//! The routing trace (which records each layer step asked for, in order) and the misses an optimal cache would
//! have on it: the yardstick a real cache is judged against.

use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

use crate::{ExpertFetch, ExpertRecord, ExpertSource, StoreCounters, StoreError};

/// One record key: (layer, expert).
pub type RecordKey = (usize, usize);

/// An [`ExpertSource`] that logs every layer fetch passing through it, then serves it from `inner`.
pub struct TracingSource {
    inner: Arc<dyn ExpertSource>,
    log: Mutex<Vec<RecordKey>>,
}

impl TracingSource {
    /// Wraps `inner`; the log starts empty.
    pub fn new(inner: Arc<dyn ExpertSource>) -> Self {
        Self {
            inner,
            log: Mutex::new(Vec::new()),
        }
    }

    /// Records requested so far, in request order (each fetch's distinct experts in its order).
    pub fn requests(&self) -> Vec<RecordKey> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Number of records requested so far (a mark into [`TracingSource::requests`]).
    pub fn len(&self) -> usize {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when nothing was requested yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ExpertSource for TracingSource {
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError> {
        self.inner.read_expert(layer, expert)
    }

    fn fetch_layer_rewriting<'a>(
        &'a self,
        layer: usize,
        experts: &[usize],
        rewrite: bool,
    ) -> Result<Box<dyn ExpertFetch + 'a>, StoreError> {
        {
            let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
            for (i, &e) in experts.iter().enumerate() {
                if !experts[..i].contains(&e) {
                    log.push((layer, e));
                }
            }
        }
        self.inner.fetch_layer_rewriting(layer, experts, rewrite)
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.inner.prefetch(layer, experts)
    }

    fn wait_backed(&self) {
        self.inner.wait_backed()
    }

    fn drop_caches(&self) -> Result<(), StoreError> {
        self.inner.drop_caches()
    }

    fn slots(&self) -> Option<usize> {
        self.inner.slots()
    }

    fn slot_len(&self) -> Option<usize> {
        self.inner.slot_len()
    }

    fn counters(&self) -> Option<Arc<StoreCounters>> {
        self.inner.counters()
    }
}

/// Misses of Belady's optimal replacement (evict the record used furthest in the future) with `slots` slots,
/// starting empty, over `requests`; only requests at indices in `counted` are counted.
pub fn optimal_misses(requests: &[RecordKey], slots: usize, counted: std::ops::Range<usize>) -> u64 {
    let n = requests.len();
    let mut next_use = vec![usize::MAX; n];
    let mut seen: HashMap<RecordKey, usize> = HashMap::new();
    for i in (0..n).rev() {
        if let Some(&j) = seen.get(&requests[i]) {
            next_use[i] = j;
        }
        seen.insert(requests[i], i);
    }
    // Cached records with their next use; the heap holds (next use, key) with stale entries skipped.
    let mut cached: HashMap<RecordKey, usize> = HashMap::new();
    let mut heap: BinaryHeap<(usize, RecordKey)> = BinaryHeap::new();
    let mut misses = 0;
    for (i, &key) in requests.iter().enumerate() {
        if !cached.contains_key(&key) {
            if counted.contains(&i) {
                misses += 1;
            }
            if slots == 0 {
                continue;
            }
            while cached.len() >= slots {
                match heap.pop() {
                    Some((when, victim)) if cached.get(&victim) == Some(&when) => {
                        cached.remove(&victim);
                    }
                    Some(_) => {}
                    None => break,
                }
            }
        }
        cached.insert(key, next_use[i]);
        heap.push((next_use[i], key));
    }
    misses
}

/// Misses of a least-recently-used cache with `slots` slots, starting empty, over `requests`; only requests at
/// indices in `counted` are counted. What a plain online cache gets on the same trace: beside
/// [`optimal_misses`] it tells what only knowing the future saves (on near-uniform routing, about what any
/// online policy would miss) from what a run loses below it.
pub fn lru_misses(requests: &[RecordKey], slots: usize, counted: std::ops::Range<usize>) -> u64 {
    let Some(cap) = std::num::NonZeroUsize::new(slots) else {
        return requests.len().min(counted.end).saturating_sub(counted.start) as u64;
    };
    let mut cache = lru::LruCache::new(cap);
    let mut misses = 0;
    for (i, &key) in requests.iter().enumerate() {
        if cache.put(key, ()).is_none() && counted.contains(&i) {
            misses += 1;
        }
    }
    misses
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(ids: &[usize]) -> Vec<RecordKey> {
        ids.iter().map(|&e| (0, e)).collect()
    }

    /// Least-recently-used misses by the definition (a list in use order), the oracle of [`super::lru_misses`].
    fn naive_lru_misses(requests: &[RecordKey], slots: usize) -> u64 {
        let mut order: Vec<RecordKey> = Vec::new();
        let mut misses = 0;
        for &k in requests {
            if let Some(p) = order.iter().position(|&x| x == k) {
                order.remove(p);
            } else {
                misses += 1;
                if order.len() == slots {
                    order.remove(0);
                }
            }
            order.push(k);
        }
        misses
    }

    #[test]
    fn optimal_replacement_by_hand() {
        // The textbook reference string (Silberschatz): 3 frames, optimal 9 faults, LRU 12.
        let r = keys(&[7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]);
        assert_eq!(optimal_misses(&r, 3, 0..r.len()), 9);
        assert_eq!(naive_lru_misses(&r, 3), 12);
        assert_eq!(lru_misses(&r, 3, 0..r.len()), 12);
        assert_eq!(lru_misses(&r, 0, 0..r.len()), r.len() as u64);
        assert_eq!(lru_misses(&r, 0, 5..9), 4);
        // Only the counted range counts; with room for everything only first uses miss.
        assert_eq!(optimal_misses(&r, 3, 0..3), 3);
        assert_eq!(optimal_misses(&r, 8, 0..r.len()), 6);
        assert_eq!(optimal_misses(&r, 0, 0..r.len()), r.len() as u64);
    }

    #[test]
    fn optimal_never_loses_to_lru_on_random_traces() {
        let mut x: u64 = 12345;
        for slots in [1, 2, 5, 9] {
            let r: Vec<RecordKey> = (0..400)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((x >> 60) as usize % 2, (x >> 33) as usize % 12)
                })
                .collect();
            let (opt, lru) = (optimal_misses(&r, slots, 0..r.len()), naive_lru_misses(&r, slots));
            assert!(opt <= lru, "{slots} slots: optimal {opt} > LRU {lru}");
            assert_eq!(lru_misses(&r, slots, 0..r.len()), lru, "{slots} slots");
            // A counted window counts the misses inside it, with the cache warmed by what came before.
            let before = naive_lru_misses(&r[..200], slots);
            assert_eq!(lru_misses(&r, slots, 200..r.len()), lru - before, "{slots} slots");
            let distinct = r.iter().collect::<std::collections::HashSet<_>>().len() as u64;
            assert!(opt >= distinct, "first uses always miss");
        }
    }
}
