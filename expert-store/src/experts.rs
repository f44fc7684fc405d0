//! Expert records: "the bytes of expert e in layer l", whatever the storage.

use std::collections::HashMap;
use std::sync::Arc;

use crate::{Checkpoint, OwnedBytes, StoreCounters, StoreError, TensorInfo};

/// The bytes of one expert: its parts in the order the layer's [`StackedExperts::tensors`] lists them.
#[derive(Debug, Clone)]
pub struct ExpertRecord {
    /// One byte range per component tensor (e.g. gate weight, gate scales, ..., down biases).
    pub parts: Vec<OwnedBytes>,
}

impl ExpertRecord {
    /// Total bytes of the record.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    /// True when the record holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Serves expert records by (layer, expert).
pub trait ExpertSource: Send + Sync {
    /// The record of expert `expert` in layer `layer`.
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError>;

    /// Requests `experts` of `layer` at once, the records it reads rewritten:
    /// [`fetch_layer_rewriting`](Self::fetch_layer_rewriting) with `rewrite` on.
    fn fetch_layer<'a>(&'a self, layer: usize, experts: &[usize]) -> Result<Box<dyn ExpertFetch + 'a>, StoreError> {
        self.fetch_layer_rewriting(layer, experts, true)
    }

    /// Requests `experts` of `layer` at once; the fetch yields each (position in `experts`, record) as it
    /// becomes available, resident ones first (sources without I/O: in order, see [`in_order_fetch`]).
    /// `rewrite` says whether the records it reads get the table's rewrite
    /// ([`RecordTransform`](crate::RecordTransform)): a rewritten record is told apart by its parts. Records
    /// already cached keep the layout they were read in; guesses ([`prefetch`](Self::prefetch)) made after it
    /// are read the same way. Sources without a rewrite ignore `rewrite`. Every source implements this one (no
    /// default), so a source that wraps another cannot drop the flag by forgetting an override.
    fn fetch_layer_rewriting<'a>(
        &'a self,
        layer: usize,
        experts: &[usize],
        rewrite: bool,
    ) -> Result<Box<dyn ExpertFetch + 'a>, StoreError>;

    /// Hints that `experts` of `layer` (likeliest first) will probably be needed soon (read on idle I/O
    /// capacity if useful, in that order).
    fn prefetch(&self, _layer: usize, _experts: &[usize]) {}

    /// Blocks until the background pass that backs the source's slots with memory has ended; returns at
    /// once where there is none. Benchmarks call it before a timed run, so the run measures reads and
    /// compute, not the one-time cost of the OS handing the process its memory.
    fn wait_backed(&self) {}

    /// Bytes of the source's slots on huge pages, and of its slots in all (`None`: no slots, or the OS does
    /// not say). Direct reads into 4 KiB pages ran at half the speed or less on some machines
    /// (`docs/performance-log.md`, "Huge pages matter to O_DIRECT here").
    fn slots_on_huge_pages(&self) -> Option<(u64, u64)> {
        None
    }

    /// Empties the source's caches (its slots and the OS page cache of its files) so the next reads are
    /// cold; records still in use stay. For benchmarks.
    fn drop_caches(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Number of record slots, for sources with a slot cache.
    fn slots(&self) -> Option<usize> {
        None
    }

    /// Bytes per slot (the largest record, page-aligned), for sources with a slot cache.
    fn slot_len(&self) -> Option<usize> {
        None
    }

    /// The source's I/O counters, if it does I/O.
    fn counters(&self) -> Option<Arc<StoreCounters>> {
        None
    }
}

/// Records of one [`ExpertSource::fetch_layer`] request, in arrival order.
pub trait ExpertFetch {
    /// The next available record with its position in the request; `None` when all were handed out.
    fn next_ready(&mut self) -> Option<Result<(usize, ExpertRecord), StoreError>>;

    /// Waits for at least one record, then returns it with every other record already available (at most
    /// `max`); `None` when all were handed out.
    fn next_batch(&mut self, max: usize) -> Option<Result<Vec<(usize, ExpertRecord)>, StoreError>> {
        let mut batch = Vec::new();
        while batch.len() < max.max(1) {
            match self.next_ready() {
                Some(Ok(r)) => batch.push(r),
                Some(Err(e)) => return Some(Err(e)),
                None => break,
            }
        }
        (!batch.is_empty()).then_some(Ok(batch))
    }
}

/// A fetch that reads `experts` of `layer` one by one, in order, through `source.read_expert` (sources whose
/// records are already in memory or mapped).
pub fn in_order_fetch<'a, S: ExpertSource + ?Sized>(
    source: &'a S,
    layer: usize,
    experts: &[usize],
) -> Box<dyn ExpertFetch + 'a> {
    Box::new(InOrderFetch {
        source,
        layer,
        experts: experts.to_vec(),
        next: 0,
    })
}

/// The default fetch: reads each record when asked, in request order.
struct InOrderFetch<'a, S: ?Sized> {
    source: &'a S,
    layer: usize,
    experts: Vec<usize>,
    next: usize,
}

impl<S: ExpertSource + ?Sized> ExpertFetch for InOrderFetch<'_, S> {
    fn next_ready(&mut self) -> Option<Result<(usize, ExpertRecord), StoreError>> {
        let pos = self.next;
        let &e = self.experts.get(pos)?;
        self.next += 1;
        Some(self.source.read_expert(self.layer, e).map(|r| (pos, r)))
    }
}

/// One layer's experts stored stacked: each named tensor has the expert index as its leading dimension.
#[derive(Debug, Clone)]
pub struct StackedExperts {
    /// Layer index.
    pub layer: usize,
    /// Number of experts stacked in each tensor.
    pub num_experts: usize,
    /// Component tensor names, in record order.
    pub tensors: Vec<String>,
}

impl StackedExperts {
    /// Component tensor `name` of this layer and the bytes one expert's slice of it takes; an error unless
    /// its leading dimension is `num_experts` and its bytes split evenly.
    pub fn part<'a>(&self, ckpt: &'a Checkpoint, name: &str) -> Result<(&'a TensorInfo, usize), StoreError> {
        let t = ckpt.require(name)?;
        let total = t.bytes().len();
        let n = self.num_experts;
        if n == 0 || t.shape.first() != Some(&n) || !total.is_multiple_of(n) {
            return Err(StoreError::BadTensor {
                name: name.to_string(),
                message: format!("shape {:?} ({total} bytes) does not hold {n} stacked experts", t.shape),
            });
        }
        Ok((t, total / n))
    }
}

/// Views expert slices of stacked tensors straight from the mmap'd checkpoint (no copy, no packing).
pub struct MmapExpertSource {
    /// Per layer: per component, the whole stacked tensor and one expert's stride in bytes.
    layers: HashMap<usize, Vec<(OwnedBytes, usize)>>,
    num_experts: HashMap<usize, usize>,
}

impl MmapExpertSource {
    /// Indexes the given layers; every tensor must exist with leading dimension `num_experts`.
    pub fn new(ckpt: &Arc<Checkpoint>, layout: &[StackedExperts]) -> Result<Self, StoreError> {
        let mut layers = HashMap::new();
        let mut num_experts = HashMap::new();
        for l in layout {
            let mut comps = Vec::with_capacity(l.tensors.len());
            for name in &l.tensors {
                let (t, stride) = l.part(ckpt, name)?;
                comps.push((t.bytes().clone(), stride));
            }
            layers.insert(l.layer, comps);
            num_experts.insert(l.layer, l.num_experts);
        }
        Ok(Self { layers, num_experts })
    }
}

impl ExpertSource for MmapExpertSource {
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError> {
        let missing = || StoreError::NoRecord { layer, expert };
        let comps = self.layers.get(&layer).ok_or_else(missing)?;
        if expert >= self.num_experts[&layer] {
            return Err(missing());
        }
        let parts = comps
            .iter()
            .map(|(whole, stride)| whole.slice(expert * stride..(expert + 1) * stride).ok_or_else(missing))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ExpertRecord { parts })
    }

    fn fetch_layer_rewriting<'a>(
        &'a self,
        layer: usize,
        experts: &[usize],
        _rewrite: bool,
    ) -> Result<Box<dyn ExpertFetch + 'a>, StoreError> {
        Ok(in_order_fetch(self, layer, experts))
    }
}

/// Records held in memory (tests, and tiny models); each record is its list of parts.
#[derive(Default)]
pub struct InMemoryExpertSource {
    records: HashMap<(usize, usize), ExpertRecord>,
}

impl InMemoryExpertSource {
    /// An empty source.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores the parts of expert `expert` in layer `layer`.
    pub fn insert(&mut self, layer: usize, expert: usize, parts: Vec<Vec<u8>>) {
        let parts = parts.into_iter().map(OwnedBytes::from_vec).collect();
        self.records.insert((layer, expert), ExpertRecord { parts });
    }
}

impl ExpertSource for InMemoryExpertSource {
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError> {
        self.records
            .get(&(layer, expert))
            .cloned()
            .ok_or(StoreError::NoRecord { layer, expert })
    }

    fn fetch_layer_rewriting<'a>(
        &'a self,
        layer: usize,
        experts: &[usize],
        _rewrite: bool,
    ) -> Result<Box<dyn ExpertFetch + 'a>, StoreError> {
        Ok(in_order_fetch(self, layer, experts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same checks against every source: records come back whole, in part order, and out-of-range
    /// requests are errors.
    fn check_source(src: &dyn ExpertSource, layer: usize, experts: usize, expect: impl Fn(usize) -> Vec<Vec<u8>>) {
        for e in 0..experts {
            let rec = src.read_expert(layer, e).unwrap();
            let got: Vec<Vec<u8>> = rec.parts.iter().map(|p| p.to_vec()).collect();
            assert_eq!(got, expect(e), "expert {e}");
            assert_eq!(rec.len(), got.iter().map(Vec::len).sum::<usize>());
        }
        assert!(matches!(
            src.read_expert(layer, experts),
            Err(StoreError::NoRecord { .. })
        ));
        assert!(matches!(
            src.read_expert(layer + 1, 0),
            Err(StoreError::NoRecord { .. })
        ));
        // A whole-layer request yields every position once, with the right record.
        for _ in 0..2 {
            let want: Vec<usize> = (0..experts).rev().collect();
            let mut f = src.fetch_layer(layer, &want).unwrap();
            let mut seen = vec![false; want.len()];
            while let Some(r) = f.next_ready() {
                let (pos, rec) = r.unwrap();
                assert!(!seen[pos], "position {pos} twice");
                seen[pos] = true;
                let got: Vec<Vec<u8>> = rec.parts.iter().map(|p| p.to_vec()).collect();
                assert_eq!(got, expect(want[pos]));
            }
            assert!(seen.iter().all(|&s| s));
        }
        // Out of range: an error at the request or at the first record.
        if let Ok(mut f) = src.fetch_layer(layer, &[experts]) {
            assert!(matches!(f.next_ready(), Some(Err(StoreError::NoRecord { .. }))));
        }
    }

    fn parts_of(e: usize) -> Vec<Vec<u8>> {
        vec![vec![e as u8; 8], vec![100 + e as u8; 4]]
    }

    #[test]
    fn in_memory_source() {
        let mut m = InMemoryExpertSource::new();
        for e in 0..3 {
            m.insert(2, e, parts_of(e));
        }
        check_source(&m, 2, 3, parts_of);
    }

    /// A one-file checkpoint with two stacked tensors of 3 experts (8 and 4 bytes per expert).
    fn stacked_checkpoint(d: &std::path::Path) -> (Arc<Checkpoint>, StackedExperts) {
        let a: Vec<u8> = (0..3).flat_map(|e| parts_of(e)[0].clone()).collect();
        let b: Vec<u8> = (0..3).flat_map(|e| parts_of(e)[1].clone()).collect();
        let header = r#"{"a":{"dtype":"U8","shape":[3,8],"data_offsets":[0,24]},"b":{"dtype":"U8","shape":[3,4],"data_offsets":[24,36]}}"#;
        let mut buf = (header.len() as u64).to_le_bytes().to_vec();
        buf.extend_from_slice(header.as_bytes());
        buf.extend(a);
        buf.extend(b);
        std::fs::write(d.join("m.safetensors"), buf).unwrap();
        let ck = Arc::new(Checkpoint::open(d).unwrap());
        let layout = StackedExperts {
            layer: 2,
            num_experts: 3,
            tensors: vec!["a".into(), "b".into()],
        };
        (ck, layout)
    }

    #[test]
    fn mmap_source_slices_stacked_tensors() {
        let d = tempfile::tempdir().unwrap();
        let (ck, layout) = stacked_checkpoint(d.path());
        check_source(&MmapExpertSource::new(&ck, &[layout]).unwrap(), 2, 3, parts_of);

        let wrong = StackedExperts {
            layer: 0,
            num_experts: 4,
            tensors: vec!["a".into()],
        };
        let e = MmapExpertSource::new(&ck, &[wrong]).err().unwrap().to_string();
        assert!(e.contains("`a`") && e.contains("4 stacked experts"), "{e}");
    }

    #[test]
    fn streaming_sources_in_place_and_packed() {
        use crate::{EngineOptions, RecordTable, StreamingSource};
        let d = tempfile::tempdir().unwrap();
        let (ck, layout) = stacked_checkpoint(d.path());
        let store = crate::convert(
            &ck,
            std::slice::from_ref(&layout),
            &d.path().join("store"),
            &crate::ConvertOptions {
                force: false,
                progress: &|_, _| {},
                rewrite: None,
            },
        )
        .unwrap();
        assert_eq!(
            store.manifest().version,
            1,
            "records as the checkpoint holds them: version 1"
        );
        for slots in [1, 2, 3] {
            for depth in [1, 4] {
                for direct in [false, true] {
                    let opts = EngineOptions {
                        cache_bytes: slots * crate::SLOT_ALIGN as u64,
                        io_depth: depth,
                        guess_depth: depth,
                        verify: true,
                        // Engines with and without the background prefault must serve the same bytes.
                        prefault: depth == 1,
                    };
                    let tables = [
                        RecordTable::in_place(&ck, std::slice::from_ref(&layout), direct).unwrap(),
                        store.table(direct).unwrap(),
                    ];
                    for t in tables {
                        let engine = StreamingSource::new(t, &opts).unwrap();
                        check_source(&engine, 2, 3, parts_of);
                        let c = engine.counters().unwrap().snapshot();
                        assert_eq!(c.read_errors, 0);
                        assert!(c.hits + c.misses > 0);
                    }
                }
            }
        }
    }

    /// Stores the second part first, each part's bytes reversed and plus one.
    struct Reversed;

    impl crate::RecordTransform for Reversed {
        fn parts(&self, layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>> {
            let [(_, a), (_, b)] = read else { return None };
            (layer == 2).then(|| vec![(64, *a), (0, *b)])
        }

        fn apply(
            &self,
            _: usize,
            record: &[u8],
            from: &[(usize, usize)],
            slot: &mut [u8],
            to: &[(usize, usize)],
        ) -> Result<(), String> {
            for (&(f, len), &(t, _)) in from.iter().zip(to) {
                for i in 0..len {
                    slot[t + i] = record[f + len - 1 - i].wrapping_add(1);
                }
            }
            Ok(())
        }
    }

    fn reversed_parts_of(e: usize) -> Vec<Vec<u8>> {
        parts_of(e)
            .into_iter()
            .map(|p| p.iter().rev().map(|b| b + 1).collect())
            .collect()
    }

    /// A rewrite that fails on the last record.
    struct FailsLast;

    impl crate::RecordTransform for FailsLast {
        fn parts(&self, layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>> {
            Reversed.parts(layer, read)
        }

        fn apply(
            &self,
            layer: usize,
            record: &[u8],
            from: &[(usize, usize)],
            slot: &mut [u8],
            to: &[(usize, usize)],
        ) -> Result<(), String> {
            // Expert 2's records start with its own number in every part (`parts_of`).
            match record[from[0].0] {
                2 => Err("no room".into()),
                _ => Reversed.apply(layer, record, from, slot, to),
            }
        }
    }

    #[test]
    fn a_convert_that_fails_midway_leaves_no_partial_file() {
        let d = tempfile::tempdir().unwrap();
        let (ck, layout) = stacked_checkpoint(d.path());
        let out = d.path().join("store");
        let opts = crate::ConvertOptions {
            force: false,
            progress: &|_, _| {},
            rewrite: Some((&FailsLast, "fails")),
        };
        let Err(e) = crate::convert(&ck, std::slice::from_ref(&layout), &out, &opts) else {
            panic!("the rewrite's failure fails the convert")
        };
        assert!(e.to_string().contains("expert 2 cannot be rewritten: no room"), "{e}");
        let left: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_store_written_rewritten_serves_the_rewritten_records() {
        use crate::{EngineOptions, PackedStore, StreamingSource};
        let d = tempfile::tempdir().unwrap();
        let (ck, layout) = stacked_checkpoint(d.path());
        let out = d.path().join("store");
        let convert = |out: &std::path::Path| {
            let opts = crate::ConvertOptions {
                force: true,
                progress: &|_, _| {},
                rewrite: Some((&Reversed, "reversed")),
            };
            crate::convert(&ck, std::slice::from_ref(&layout), out, &opts).unwrap()
        };
        let store = convert(&out);
        let m = store.manifest();
        assert_eq!(m.version, 2);
        assert_eq!(m.layers[0].layout.as_deref(), Some("reversed"));
        assert_eq!(m.layers[0].stored_parts, Some(vec![(64, 8), (0, 4)]));
        // The parts it was written from are still named, so a store of another model is still told apart.
        assert_eq!(m.layers[0].parts.len(), 2);
        store.check_against(&ck, std::slice::from_ref(&layout)).unwrap();
        let opts = EngineOptions {
            cache_bytes: 2 * crate::SLOT_ALIGN as u64,
            io_depth: 2,
            guess_depth: 2,
            verify: true,
            prefault: false,
        };
        // In part order: the rewritten record's parts are at `stored_parts`, which the rewrite chose.
        let served = |e| {
            let p = reversed_parts_of(e);
            vec![p[0].clone(), p[1].clone()]
        };
        check_source(
            &StreamingSource::new(store.table(false).unwrap(), &opts).unwrap(),
            2,
            3,
            served,
        );

        // A manifest must not half-name a rewrite, and a version 1 store cannot hold one.
        let mpath = out.join(crate::MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).unwrap();
        let refused = |edit: &dyn Fn(&mut serde_json::Value), why: &str| {
            let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
            edit(&mut json);
            std::fs::write(&mpath, json.to_string()).unwrap();
            let e = PackedStore::open(&out).err().expect("refused").to_string();
            assert!(e.contains(why), "{e}");
        };
        refused(
            &|j| drop(j["layers"][0].as_object_mut().unwrap().remove("stored_parts")),
            "`layout` and `stored_parts` come together",
        );
        refused(&|j| j["version"] = 1.into(), "version 1 store");
        refused(
            &|j| j["layers"][0]["stored_parts"][0][0] = 16384.into(),
            "a rewritten part lies outside the record",
        );
        refused(&|j| j["version"] = 3.into(), "store version 3 is not supported");
    }
}
