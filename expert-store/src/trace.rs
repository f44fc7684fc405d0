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

    fn slots_on_huge_pages(&self) -> Option<(u64, u64)> {
        self.inner.slots_on_huge_pages()
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

/// The records Belady's optimal replacement (evict the record used furthest in the future) with `slots` slots
/// misses in the window `counted` of `requests`, in request order. The cache enters the window as the best one
/// the requests before it could have left: the last record asked for (every cache holds it then), and up to
/// `slots - 1` other records asked for before the window, those wanted soonest in it. No cache that holds only
/// records asked for misses fewer in the window (over a window from the start, this is Belady's from an empty
/// cache); simulating the whole prefix instead would let Belady trade misses before the window for misses
/// inside it.
pub fn optimal_misses(requests: &[RecordKey], slots: usize, counted: std::ops::Range<usize>) -> Vec<RecordKey> {
    let (start, end) = (counted.start.min(requests.len()), counted.end.min(requests.len()));
    let window = &requests[start..end.max(start)];
    let n = window.len();
    let mut next_use = vec![usize::MAX; n];
    let mut first_use: HashMap<RecordKey, usize> = HashMap::new();
    for i in (0..n).rev() {
        if let Some(&j) = first_use.get(&window[i]) {
            next_use[i] = j;
        }
        first_use.insert(window[i], i);
    }
    // Cached records with their next use; the heap holds (next use, key) with stale entries skipped.
    let mut cached: HashMap<RecordKey, usize> = HashMap::new();
    let mut heap: BinaryHeap<(usize, RecordKey)> = BinaryHeap::new();
    let last = start.checked_sub(1).map(|i| requests[i]);
    let mut before: Vec<(usize, RecordKey)> = (requests[..start].iter())
        .filter(|&&k| Some(k) != last)
        .collect::<std::collections::HashSet<_>>()
        .into_iter()
        .filter_map(|k| first_use.get(k).map(|&at| (at, *k)))
        .collect();
    before.sort_unstable();
    let last = last
        .filter(|_| slots > 0)
        .map(|k| (first_use.get(&k).copied().unwrap_or(usize::MAX), k));
    let others = slots.saturating_sub(usize::from(last.is_some()));
    for (at, key) in last.into_iter().chain(before.into_iter().take(others)) {
        cached.insert(key, at);
        heap.push((at, key));
    }
    let mut misses = Vec::new();
    for (i, &key) in window.iter().enumerate() {
        if !cached.contains_key(&key) {
            misses.push(key);
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

/// The records a least-recently-used cache with `slots` slots, starting empty, misses over `requests`, in order;
/// only requests at indices in `counted` are counted. What a plain online cache gets on the same trace: beside
/// [`optimal_misses`] it tells what only knowing the future saves (on near-uniform routing, about what any
/// online policy would miss) from what a run loses below it.
pub fn lru_misses(requests: &[RecordKey], slots: usize, counted: std::ops::Range<usize>) -> Vec<RecordKey> {
    let end = counted.end.min(requests.len());
    let Some(cap) = std::num::NonZeroUsize::new(slots) else {
        return requests[counted.start.min(end)..end].to_vec();
    };
    let mut cache = lru::LruCache::new(cap);
    let mut misses = Vec::new();
    for (i, &key) in requests[..end].iter().enumerate() {
        if cache.put(key, ()).is_none() && counted.contains(&i) {
            misses.push(key);
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

    fn opt(r: &[RecordKey], slots: usize, counted: std::ops::Range<usize>) -> u64 {
        optimal_misses(r, slots, counted).len() as u64
    }

    fn lru(r: &[RecordKey], slots: usize, counted: std::ops::Range<usize>) -> u64 {
        lru_misses(r, slots, counted).len() as u64
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

    /// The fewest misses in `requests[from..]` of any replacement run from an empty cache over the whole of
    /// `requests` (a missed record takes a slot, as the engine's reads do), by trying every victim at every
    /// miss: the oracle of [`super::optimal_misses`] (small traces only).
    fn fewest_misses(requests: &[RecordKey], slots: usize, from: usize) -> u64 {
        fn go(r: &[RecordKey], at: usize, from: usize, slots: usize, cache: &mut Vec<RecordKey>) -> u64 {
            let Some(&key) = r.get(at) else {
                return 0;
            };
            if cache.contains(&key) {
                return go(r, at + 1, from, slots, cache);
            }
            let miss = u64::from(at >= from);
            if slots == 0 {
                return miss + go(r, at + 1, from, slots, cache);
            }
            if cache.len() < slots {
                cache.push(key);
                let m = miss + go(r, at + 1, from, slots, cache);
                cache.pop();
                return m;
            }
            let mut best = u64::MAX;
            for v in 0..cache.len() {
                let old = std::mem::replace(&mut cache[v], key);
                best = best.min(miss + go(r, at + 1, from, slots, cache));
                cache[v] = old;
            }
            best
        }
        go(requests, 0, from, slots, &mut Vec::new())
    }

    #[test]
    fn optimal_replacement_by_hand() {
        // The textbook reference string (Silberschatz): 3 frames, optimal 9 faults, LRU 12.
        let r = keys(&[7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]);
        assert_eq!(opt(&r, 3, 0..r.len()), 9);
        assert_eq!(naive_lru_misses(&r, 3), 12);
        assert_eq!(lru(&r, 3, 0..r.len()), 12);
        assert_eq!(lru(&r, 0, 0..r.len()), r.len() as u64);
        assert_eq!(lru(&r, 0, 5..9), 4);
        // Only the counted range counts; with room for everything only first uses miss.
        assert_eq!(opt(&r, 3, 0..3), 3);
        assert_eq!(opt(&r, 8, 0..r.len()), 6);
        assert_eq!(opt(&r, 0, 0..r.len()), r.len() as u64);
        // A B C A | B with 2 slots: Belady run from the start keeps A for its next use and misses B in the window;
        // a cache that kept B misses nothing there.
        let r = keys(&[0, 1, 2, 0, 1]);
        assert_eq!(opt(&r, 2, 4..5), 0);
        // A B C | A B with 2 slots: every cache holds C when the window starts, so one of A and B misses.
        let r = keys(&[0, 1, 2, 0, 1]);
        assert_eq!(opt(&r, 2, 3..5), 1);
        assert_eq!(optimal_misses(&r, 2, 0..5), keys(&[0, 1, 2, 1]));
    }

    #[test]
    fn optimal_is_the_fewest_any_replacement_gets() {
        let mut x: u64 = 777;
        for round in 0..60 {
            let slots = 1 + round % 3;
            let r: Vec<RecordKey> = (0..11)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (0, (x >> 33) as usize % 5)
                })
                .collect();
            for from in [0, 3, 5, 8] {
                assert_eq!(
                    opt(&r, slots, from..r.len()),
                    fewest_misses(&r, slots, from),
                    "{r:?}, {slots} slots, from {from}"
                );
            }
        }
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
            let (o, l) = (opt(&r, slots, 0..r.len()), naive_lru_misses(&r, slots));
            assert!(o <= l, "{slots} slots: optimal {o} > LRU {l}");
            assert_eq!(lru(&r, slots, 0..r.len()), l, "{slots} slots");
            // A counted window counts the misses inside it, with the cache warmed by what came before.
            let before = naive_lru_misses(&r[..200], slots);
            assert_eq!(lru(&r, slots, 200..r.len()), l - before, "{slots} slots");
            assert!(
                opt(&r, slots, 200..r.len()) <= lru(&r, slots, 200..r.len()),
                "{slots} slots"
            );
            let distinct = r.iter().collect::<std::collections::HashSet<_>>().len() as u64;
            assert!(o >= distinct, "first uses always miss");
        }
    }
}
