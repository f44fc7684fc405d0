//! Unit tests of the streaming engine against an in-memory record table whose reads can be held back.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;
use crate::{CounterSnapshot, ReadAt, ReadOp, RecordLayout, RecordTransform, READ_PIECE, SLOT_ALIGN};

/// Bytes of each record (one slot of [`SLOT_ALIGN`] bytes each).
const REC: usize = 4096;
/// Where the second part of a record starts.
const SPLIT: usize = 1000;
const SLOT: u64 = SLOT_ALIGN as u64;
const LAYER: usize = 3;
const EXPERTS: usize = 8;
/// Failure guard for anything that waits on another thread; never reached when the test passes.
const GUARD: Duration = Duration::from_secs(10);

/// The bytes of record (layer, expert): its key, then a pattern that differs between records.
fn record_bytes(layer: usize, expert: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..REC)
        .map(|i| (i as u8).wrapping_mul(31) ^ (expert as u8).wrapping_mul(101) ^ (layer as u8).wrapping_mul(7))
        .collect();
    v[..8].copy_from_slice(&(layer as u64).to_le_bytes());
    v[8..16].copy_from_slice(&(expert as u64).to_le_bytes());
    v
}

fn offset_of(expert: usize) -> u64 {
    (expert * REC) as u64
}

#[derive(Default)]
struct Gate {
    closed: bool,
    /// Offset of every read started, in order.
    started: Vec<u64>,
}

/// The records of one layer in memory; reads are logged and can be held at a gate.
struct MemFile {
    data: Vec<u8>,
    path: PathBuf,
    gate: Mutex<Gate>,
    changed: Condvar,
}

impl MemFile {
    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap()
    }

    /// Reads started from now on block until [`MemFile::open`].
    fn close(&self) {
        self.gate().closed = true;
    }

    fn open(&self) {
        self.gate().closed = false;
        self.changed.notify_all();
    }

    /// Offsets of the reads started so far, in order.
    fn reads(&self) -> Vec<u64> {
        self.gate().started.clone()
    }

    /// Waits until `n` reads have started.
    fn wait_started(&self, n: usize) {
        let deadline = Instant::now() + GUARD;
        let mut g = self.gate();
        while g.started.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "only {} of {n} reads started", g.started.len());
            g = self.changed.wait_timeout(g, left).unwrap().0;
        }
    }
}

impl ReadAt for MemFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut g = self.gate();
        g.started.push(offset);
        self.changed.notify_all();
        let deadline = Instant::now() + GUARD;
        while g.closed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::other("test gate never opened"));
            }
            g = self.changed.wait_timeout(g, left).unwrap().0;
        }
        drop(g);
        let start = (offset as usize).min(self.data.len());
        let n = buf.len().min(self.data.len() - start);
        buf[..n].copy_from_slice(&self.data[start..start + n]);
        Ok(n)
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

/// A table of `EXPERTS` packed, checksummed records of layer `LAYER`, each one read of `REC` bytes in two
/// parts.
fn table() -> (RecordTable, Arc<MemFile>) {
    table_of(&[LAYER])
}

/// Where record (`layers[i]`, expert) starts in the file of [`table_of`]`(layers)`.
fn offset_in(i: usize, expert: usize) -> u64 {
    ((i * EXPERTS + expert) * REC) as u64
}

/// [`table`] for several layers, one after the other in the file in the order given.
fn table_of(layers: &[usize]) -> (RecordTable, Arc<MemFile>) {
    let data: Vec<u8> = (layers.iter())
        .flat_map(|&l| (0..EXPERTS).flat_map(move |e| record_bytes(l, e)))
        .collect();
    let layout = |i: usize, e: usize| {
        let at = offset_in(i, e) as usize;
        RecordLayout {
            reads: vec![ReadOp {
                file: 0,
                offset: at as u64,
                len: REC,
                slot_offset: 0,
                needed: REC,
            }],
            parts: vec![(0, SPLIT), (SPLIT, REC - SPLIT)],
            checksum: Some(xxhash_rust::xxh3::xxh3_64(&data[at..at + REC])),
            rewritten: None,
        }
    };
    let table = (layers.iter().enumerate())
        .map(|(i, &l)| (l, (0..EXPERTS).map(|e| layout(i, e)).collect()))
        .collect();
    let file = Arc::new(MemFile {
        data,
        path: PathBuf::from("/test/experts.bin"),
        gate: Mutex::default(),
        changed: Condvar::new(),
    });
    let files: Vec<Arc<dyn ReadAt>> = vec![file.clone()];
    (RecordTable::new(files, table), file)
}

fn options(cache_bytes: u64, io_depth: usize) -> EngineOptions {
    EngineOptions {
        cache_bytes,
        io_depth,
        guess_depth: io_depth,
        verify: true,
        prefault: true,
    }
}

/// An engine with `slots` slots and `io_depth` I/O threads.
fn engine(slots: usize, io_depth: usize) -> (StreamingSource, Arc<MemFile>) {
    let (t, file) = table();
    let src = StreamingSource::new(t, &options(slots as u64 * SLOT, io_depth)).unwrap();
    assert_eq!(src.slots(), (slots, SLOT_ALIGN));
    (src, file)
}

fn keys(experts: &[usize]) -> Vec<Key> {
    experts.iter().map(|&e| (LAYER, e)).collect()
}

fn offsets(experts: &[usize]) -> Vec<u64> {
    experts.iter().map(|&e| offset_of(e)).collect()
}

fn assert_record(rec: &ExpertRecord, expert: usize) {
    let lens: Vec<usize> = rec.parts.iter().map(|p| p.len()).collect();
    assert_eq!(lens, [SPLIT, REC - SPLIT], "parts of expert {expert}");
    let got: Vec<u8> = rec.parts.iter().flat_map(|p| p.iter().copied()).collect();
    assert!(
        got == record_bytes(LAYER, expert),
        "record of expert {expert} has wrong bytes"
    );
}

/// Address of the slot a record lives in.
fn slot_of(rec: &ExpertRecord) -> usize {
    rec.parts[0].as_ptr() as usize
}

/// Reads one record and checks its bytes.
fn read(src: &StreamingSource, expert: usize) -> ExpertRecord {
    let rec = src.read_expert(LAYER, expert).unwrap();
    assert_record(&rec, expert);
    rec
}

fn counters(src: &StreamingSource) -> CounterSnapshot {
    src.counters().unwrap().snapshot()
}

/// Fetches `experts` at once, holding every record until all have arrived (with `next_batch` or
/// `next_ready`); checks each position is handed out once, with the record asked for at that position.
fn fetch_all(src: &StreamingSource, experts: &[usize], batched: bool) -> Result<Vec<ExpertRecord>, StoreError> {
    fn put(got: &mut [Option<ExpertRecord>], experts: &[usize], pos: usize, rec: ExpertRecord) {
        assert!(pos < experts.len(), "position {pos} out of range");
        assert!(got[pos].is_none(), "position {pos} handed out twice");
        assert_record(&rec, experts[pos]);
        got[pos] = Some(rec);
    }
    let mut f = src.fetch_layer(LAYER, experts)?;
    let mut got: Vec<Option<ExpertRecord>> = vec![None; experts.len()];
    if batched {
        while let Some(batch) = f.next_batch(usize::MAX) {
            for (pos, rec) in batch? {
                put(&mut got, experts, pos, rec);
            }
        }
    } else {
        while let Some(r) = f.next_ready() {
            let (pos, rec) = r?;
            put(&mut got, experts, pos, rec);
        }
    }
    Ok(got
        .into_iter()
        .enumerate()
        .map(|(pos, r)| r.unwrap_or_else(|| panic!("position {pos} of {experts:?} never handed out")))
        .collect())
}

/// Reads `expert` of `layer` while `file`'s gate is closed: once the fetch waits for a read, opens the gate.
fn read_through_gate(
    src: &StreamingSource,
    file: &MemFile,
    layer: usize,
    expert: usize,
) -> Result<ExpertRecord, StoreError> {
    let waits = src.fetch_waits();
    std::thread::scope(|s| {
        let fetch = s.spawn(|| src.read_expert(layer, expert));
        wait_for_blocked_fetch(src, waits);
        file.open();
        fetch.join().unwrap()
    })
}

/// Waits until a fetch blocks for a read to land (`before` is the count of such waits seen earlier).
fn wait_for_blocked_fetch(src: &StreamingSource, before: usize) {
    let deadline = Instant::now() + GUARD;
    while src.fetch_waits() <= before {
        assert!(
            Instant::now() < deadline,
            "the fetch never waited for the read in flight"
        );
        std::thread::yield_now();
    }
}

#[test]
fn budget_smaller_than_one_record_is_a_clear_error() {
    for budget in [0, 1000, REC as u64, SLOT - 1] {
        let (t, _) = table();
        let err = StreamingSource::new(t, &options(budget, 2))
            .err()
            .unwrap_or_else(|| panic!("a budget of {budget} bytes was accepted"));
        assert!(matches!(err, StoreError::Engine(_)), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&format!("budget of {budget} bytes")), "{msg}");
        assert!(msg.contains("smaller than one record slot"), "{msg}");
        assert!(msg.contains(&format!("{SLOT_ALIGN} bytes")), "slot size missing: {msg}");
        assert!(msg.contains(&format!("{REC} bytes")), "record size missing: {msg}");
    }
    // Exactly one slot serves every record through it; a budget beyond the model is one slot per record.
    let (src, _) = engine(1, 2);
    for e in 0..EXPERTS {
        read(&src, e);
    }
    let (t, _) = table();
    assert_eq!(
        StreamingSource::new(t, &options(1 << 40, 2)).unwrap().slots().0,
        EXPERTS
    );
    let empty = RecordTable::new(Vec::new(), HashMap::new());
    let msg = StreamingSource::new(empty, &options(1 << 30, 2))
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("no expert records"), "{msg}");
}

#[test]
fn lru_evicts_the_least_recently_used_idle_record() {
    let (src, file) = engine(3, 2);
    for e in [0, 1, 2] {
        read(&src, e);
    }
    assert_eq!(src.resident(), keys(&[2, 1, 0]));
    read(&src, 0); // a hit makes 0 the most recently used
    assert_eq!(src.resident(), keys(&[0, 2, 1]));
    read(&src, 3); // evicts 1
    assert_eq!(src.resident(), keys(&[3, 0, 2]));
    read(&src, 4); // evicts 2
    assert_eq!(src.resident(), keys(&[4, 3, 0]));
    let c = counters(&src);
    assert_eq!((c.reads, c.hits, c.misses), (5, 1, 5), "{c:?}");
    assert_eq!((c.demand_bytes, c.prefetch_bytes), (5 * REC as u64, 0));
    assert_eq!(file.reads(), offsets(&[0, 1, 2, 3, 4]));
    assert_eq!(src.slot_census(), (0, 3));
}

#[test]
fn pinned_records_are_never_evicted_or_overwritten() {
    let (src, _) = engine(3, 2);
    let pinned = read(&src, 0);
    // One part alone keeps its slot pinned too.
    let part = read(&src, 1).parts[1].clone();
    let pinned_slots = [slot_of(&pinned), part.as_ptr() as usize - SPLIT];
    let mut spare = None;
    for i in 0..24 {
        let e = 2 + i % (EXPERTS - 2);
        let rec = read(&src, e);
        let slot = slot_of(&rec);
        assert!(!pinned_slots.contains(&slot), "expert {e} was read into a pinned slot");
        assert_eq!(*spare.get_or_insert(slot), slot, "only one slot is free to reuse");
        let resident = src.resident();
        assert_eq!(resident.len(), 3);
        assert!(
            resident.contains(&(LAYER, 0)) && resident.contains(&(LAYER, 1)),
            "{resident:?}"
        );
        assert_eq!(resident[0], (LAYER, e));
    }
    assert_record(&pinned, 0);
    assert!(*part == record_bytes(LAYER, 1)[SPLIT..], "pinned part was overwritten");
    let c = counters(&src);
    assert_eq!((c.reads, c.hits), (26, 0), "{c:?}");

    // Still resident: a hit, same slot. Released, they are evicted in LRU order like any record.
    assert_eq!(slot_of(&read(&src, 0)), pinned_slots[0]);
    assert_eq!(counters(&src).reads, 26);
    drop((pinned, part));
    let last = 2 + 23 % (EXPERTS - 2);
    assert_eq!(src.resident(), keys(&[0, last, 1]));
    let e = if last == 7 { 6 } else { 7 };
    read(&src, e);
    assert_eq!(src.resident(), keys(&[e, 0, last]));
    assert_eq!(src.slot_census(), (0, 3));
}

/// With every slot held by a computation and no read in flight, a record that needs a slot fails its
/// fetch with an error naming the cache (no wait: nothing could free a slot); the engine stays usable.
#[test]
fn every_slot_pinned_fails_the_fetch_clearly_and_the_engine_recovers() {
    let (src, _) = engine(2, 2);
    let a = read(&src, 0);
    let b = read(&src, 1);
    let check = |err: StoreError| {
        let msg = err.to_string();
        assert!(matches!(err, StoreError::Engine(_)), "{err:?}");
        assert!(
            msg.contains("2 slots is too small") && msg.contains("held by a computation"),
            "{msg}"
        );
    };
    check(
        src.read_expert(LAYER, 2)
            .expect_err("a record with no slot to go to was served"),
    );
    assert_eq!(counters(&src).reads, 2, "no read may be issued without a slot");
    // The fetch itself is made; resident records come first, then the error for the one without a slot.
    let mut f = src.fetch_layer(LAYER, &[2, 1]).unwrap();
    let (pos, rec) = f.next_ready().unwrap().unwrap();
    assert_eq!(pos, 1);
    assert_record(&rec, 1);
    check(f.next_ready().unwrap().err().unwrap());
    drop((f, rec));
    assert_record(&a, 0);
    assert_record(&b, 1);
    assert_eq!(src.slot_census(), (0, 2));

    // The same when the caller holds records of the same fetch: 3 takes 0's slot, then 4 finds none.
    drop(a);
    let mut f = src.fetch_layer(LAYER, &[3, 4]).unwrap();
    let (pos, three) = f.next_ready().unwrap().unwrap();
    assert_eq!(pos, 0);
    assert_record(&three, 3);
    check(f.next_ready().unwrap().err().unwrap());
    drop(f);
    assert!(matches!(fetch_all(&src, &[5, 6], false), Err(StoreError::Engine(_))));

    // Released, the engine serves again, and every slot is accounted for.
    drop((b, three));
    fetch_all(&src, &[5, 6], true).unwrap();
    assert_eq!(src.slot_census(), (0, 2));
    assert_eq!(counters(&src).read_errors, 0);
}

/// With no slot free and none evictable, a demand read takes the slot of a queued guess (not yet started)
/// instead of waiting for the read under way, after which that guess would be read and evicted unused.
#[test]
fn a_demand_read_takes_the_slot_of_a_guess_not_yet_started() {
    // Guesses for the next layer (a fetch drops its own layer's queued guesses anyway).
    let (t, file) = table_of(&[LAYER, LAYER + 1]);
    let src = StreamingSource::new(t, &options(2 * SLOT, 1)).unwrap();
    file.close();
    src.prefetch(LAYER + 1, &[0, 1]);
    file.wait_started(1);
    let got = read_through_gate(&src, &file, LAYER, 2);
    assert_record(&got.unwrap(), 2);
    assert_eq!(file.reads(), [offset_in(1, 0), offset_in(0, 2)]);
    let c = counters(&src);
    assert_eq!((c.prefetch_cancelled, c.prefetch_wasted), (1, 0), "{c:?}");
}

/// Records let go of a moment after a fetch found every slot held (as MLX lets go of Metal's hold on a slot once
/// its command buffer completes, telling no one) are waited for: no error.
#[test]
fn slots_let_go_of_a_moment_later_are_waited_for() {
    let (src, _) = engine(2, 2);
    let held = (read(&src, 0), read(&src, 1));
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(held);
        });
        read(&src, 2);
    });
    assert_eq!(counters(&src).reads, 3);
}

/// When every slot is held or being read into, a fetch waits for the read in flight rather than failing:
/// the prefetch lands unused and is evicted for the demand read (counted as waste).
#[test]
fn fetch_waits_for_a_read_in_flight_when_no_slot_is_free() {
    let (src, file) = engine(2, 1);
    let held = read(&src, 1);
    file.close();
    src.prefetch(LAYER, &[0]);
    file.wait_started(2);
    assert_eq!(src.slot_census(), (0, 1));
    let got = read_through_gate(&src, &file, LAYER, 2);
    assert_record(&got.unwrap(), 2);
    assert_record(&held, 1);
    let c = counters(&src);
    assert_eq!((c.reads, c.prefetch_issued, c.prefetch_hits), (3, 1, 0), "{c:?}");
    assert_eq!((c.prefetch_wasted, c.prefetch_wasted_bytes), (1, REC as u64));
    assert_eq!(file.reads(), offsets(&[1, 0, 2]));
    assert_eq!(src.resident(), keys(&[2, 1]));
}

#[test]
fn prefetched_record_is_served_without_a_second_read() {
    let (src, file) = engine(4, 2);
    src.prefetch(LAYER, &[1, 2]);
    src.wait_idle();
    let c = counters(&src);
    assert_eq!(
        (c.prefetch_issued, c.reads, c.prefetch_bytes, c.demand_bytes),
        (2, 2, 2 * REC as u64, 0)
    );
    assert_eq!((c.hits, c.misses, c.prefetch_hits), (0, 0, 0));

    fetch_all(&src, &[2, 1, 3], false).unwrap();
    let c = counters(&src);
    assert_eq!((c.hits, c.misses, c.prefetch_hits), (2, 1, 2), "{c:?}");
    assert_eq!(
        (c.reads, c.demand_bytes, c.prefetch_bytes),
        (3, REC as u64, 2 * REC as u64)
    );
    let mut read_once = file.reads();
    read_once.sort_unstable();
    assert_eq!(read_once, offsets(&[1, 2, 3]));

    // Used once, a prediction is an ordinary record: later hits are not prefetch hits again, and
    // predicting a resident record issues nothing.
    fetch_all(&src, &[1, 2], true).unwrap();
    src.prefetch(LAYER, &[1, 3]);
    let c = counters(&src);
    assert_eq!(
        (c.hits, c.prefetch_hits, c.prefetch_issued, c.reads),
        (4, 2, 2, 3),
        "{c:?}"
    );
    assert_eq!((c.prefetch_wasted, c.prefetch_wasted_bytes), (0, 0));
}

#[test]
fn cpu_spent_loading_records_and_backing_slots_is_counted() {
    let (t, _) = table();
    let started = Instant::now();
    let src = Arc::new(StreamingSource::new(t, &options(EXPERTS as u64 * SLOT, 2)).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = Arc::clone(&src);
    std::thread::spawn(move || {
        waiter.wait_backed();
        tx.send(waiter.pass_ended()).unwrap();
    });
    let ended = rx.recv_timeout(GUARD).expect("wait_backed never returned");
    assert!(ended, "wait_backed returned before the pass ended");
    let backing = counters(&src).prefault_cpu_seconds;
    // The pass's CPU is counted where the OS backs memory ahead of use (and can never exceed its wall time).
    let mut probe = crate::aligned::SlotBuf::allocate(1, SLOT_ALIGN).unwrap();
    let populates = crate::platform::populate(std::ptr::NonNull::from(probe[0].as_mut_slice()).cast(), SLOT_ALIGN);
    if populates && crate::platform::thread_cpu_time().is_some() {
        assert!(backing > 0.0, "backing slots took no CPU time");
    }
    assert!(
        backing <= started.elapsed().as_secs_f64(),
        "{backing} s of CPU in less wall time"
    );
    fetch_all(&src, &(0..EXPERTS).collect::<Vec<_>>(), true).unwrap();
    let c = counters(&src);
    assert_eq!(c.reads, EXPERTS as u64);
    if crate::platform::thread_cpu_time().is_some() {
        assert!(c.read_cpu_seconds > 0.0, "{c:?}");
    }
    // A one-read record's CPU time is measured inside its wall time (the 1 ms is the clocks' granularity); a
    // record of several reads sums their CPU from threads side by side, which can exceed it.
    assert!(c.read_cpu_seconds <= c.read_busy_seconds + 1e-3, "{c:?}");
    assert_eq!(c.prefault_cpu_seconds, backing, "the pass had ended");
}

/// A prediction still queued when a step needs it moves to the demand queue and is read once; the layer's
/// other queued predictions, which the step did not ask for, are cancelled unread and free their slots.
#[test]
fn queued_prefetch_is_promoted_when_demanded() {
    let (src, file) = engine(4, 1);
    file.close();
    src.prefetch(LAYER, &[0, 1, 2, 3]);
    file.wait_started(1); // the only I/O thread is held reading 0; 1, 2, 3 are queued in that order
    let mut f = src.fetch_layer(LAYER, &[3]).unwrap();
    file.open();
    let (pos, rec) = f.next_ready().unwrap().unwrap();
    assert_eq!(pos, 0);
    assert_record(&rec, 3);
    assert!(f.next_ready().is_none());
    drop(f);
    src.wait_idle();
    assert_eq!(file.reads(), offsets(&[0, 3]));
    let c = counters(&src);
    assert_eq!(
        (
            c.prefetch_issued,
            c.prefetch_hits,
            c.prefetch_cancelled,
            c.hits,
            c.misses
        ),
        (4, 1, 2, 0, 1),
        "{c:?}"
    );
    // No second read of 3 (its bytes count as prefetch bytes: a prediction read them).
    assert_eq!((c.reads, c.bytes_read(), c.demand_bytes), (2, 2 * REC as u64, 0));
    assert_eq!(src.slot_census(), (2, 2), "cancelled predictions give their slots back");
    // The cancelled records are read again when asked for.
    fetch_all(&src, &[1, 2], true).unwrap();
    assert_eq!(file.reads(), offsets(&[0, 3, 1, 2]));
}

/// At most `guess_depth` guesses are read at once, whatever the I/O threads: the rest wait in the queue, where
/// their layer's fetch promotes the ones it needs (read at once, beside the guess in flight) and cancels the
/// others unread.
#[test]
fn guesses_are_read_at_most_guess_depth_at_once() {
    let (t, file) = table();
    let opts = EngineOptions {
        guess_depth: 1,
        ..options(8 * SLOT, 4)
    };
    let src = StreamingSource::new(t, &opts).unwrap();
    file.close();
    src.prefetch(LAYER, &[0, 1, 2]);
    file.wait_started(1);
    // Three idle I/O threads: without the limit they start guesses 1 and 2 at once.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(file.reads(), offsets(&[0]), "a second guess started");
    let mut f = src.fetch_layer(LAYER, &[1, 5]).unwrap();
    file.wait_started(3); // 1 (promoted) and 5 start while guess 0 is still held
    let mut started = file.reads();
    started.sort_unstable();
    assert_eq!(started, offsets(&[0, 1, 5]));
    file.open();
    let mut got: Vec<usize> = std::iter::from_fn(|| f.next_ready()).map(|r| r.unwrap().0).collect();
    got.sort_unstable();
    assert_eq!(got, [0, 1]);
    drop(f);
    src.wait_idle();
    assert_eq!(file.reads().len(), 3, "the guess of 2 was cancelled unread");
    let c = counters(&src);
    assert_eq!((c.prefetch_issued, c.prefetch_cancelled, c.reads), (3, 1, 3), "{c:?}");
}

/// Guesses held back by the limit wake no I/O thread when queued (it would find nothing to take); the thread
/// whose guess lands takes the next, so every one is still read, `guess_depth` at a time.
#[test]
fn held_back_guesses_are_all_read_in_turn() {
    let (t, file) = table();
    let opts = EngineOptions {
        guess_depth: 2,
        ..options(8 * SLOT, 4)
    };
    let src = StreamingSource::new(t, &opts).unwrap();
    file.close();
    src.prefetch(LAYER, &[0, 1, 2, 3, 4, 5]);
    file.wait_started(2);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(file.reads().len(), 2, "more guesses started than the limit allows");
    file.open();
    src.wait_idle();
    let mut read = file.reads();
    read.sort_unstable();
    assert_eq!(read, offsets(&[0, 1, 2, 3, 4, 5]));
    let c = counters(&src);
    assert_eq!((c.prefetch_issued, c.reads), (6, 6), "{c:?}");
}

/// A prompt chunk's fetch (most of a layer) releases the guesses held back, and later ones are not held:
/// they are nearly all right.
#[test]
fn a_prompt_chunks_guesses_are_read_all_at_once() {
    let (t, file) = table_of(&[0, 1, 2]);
    let opts = EngineOptions {
        guess_depth: 1,
        ..options(24 * SLOT, 16)
    };
    let src = StreamingSource::new(t, &opts).unwrap();
    file.close();
    src.prefetch(1, &[0, 1, 2]);
    file.wait_started(1); // one guess read, two held
    let all: Vec<usize> = (0..EXPERTS).collect();
    let f = src.fetch_layer(0, &all).unwrap();
    file.wait_started(1 + EXPERTS + 2); // the chunk's reads and both held guesses, beside the first
    src.prefetch(2, &[0, 1, 2]);
    file.wait_started(1 + EXPERTS + 2 + 3);
    file.open();
    drop(f);
    src.wait_idle();
    assert_eq!(counters(&src).reads, EXPERTS as u64 + 6);
}

/// Predictions are read nearest layer first after the layer fetched last (cyclically: after the last layer
/// comes the first), whatever order they were made in.
#[test]
fn prefetches_are_read_nearest_layer_first() {
    let layers = [3, 0, 1, 2];
    let (t, file) = table_of(&layers);
    let src = StreamingSource::new(t, &options(8 * SLOT, 1)).unwrap();
    file.close();
    let mut f = src.fetch_layer(1, &[0]).unwrap(); // the focus is layer 1; its read holds the only thread
    file.wait_started(1);
    src.prefetch(0, &[1]); // three layers after 1
    src.prefetch(3, &[2]); // two after
    src.prefetch(2, &[3, 4]); // the next one
    file.open();
    assert!(f.next_ready().unwrap().is_ok());
    drop(f);
    src.wait_idle();
    let at = |layer: usize, e: usize| offset_in(layers.iter().position(|&l| l == layer).unwrap(), e);
    assert_eq!(file.reads(), [at(1, 0), at(2, 3), at(2, 4), at(3, 2), at(0, 1)]);
}

/// A newer prediction for a layer replaces its queued older one; predictions already read stay.
#[test]
fn a_newer_prediction_replaces_the_queued_one() {
    let (src, file) = engine(6, 1);
    file.close();
    src.prefetch(LAYER, &[0]);
    file.wait_started(1); // 0 is being read: it stays whatever comes next
    src.prefetch(LAYER, &[1, 2]);
    src.prefetch(LAYER, &[2, 3]); // 1 is no longer predicted: dropped unread
    assert_eq!(counters(&src).prefetch_cancelled, 1);
    file.open();
    src.wait_idle();
    assert_eq!(file.reads(), offsets(&[0, 2, 3]));
    assert_eq!(src.slot_census(), (3, 3));
    let c = counters(&src);
    assert_eq!((c.prefetch_issued, c.reads, c.prefetch_wasted), (4, 3, 0), "{c:?}");
}

/// Fetches all of `layer`'s experts at once, as a prompt's chunk does, holding them until all arrived;
/// returns how many were hits.
fn sweep_layer(src: &StreamingSource, layer: usize) -> u64 {
    let before = counters(src).hits;
    let all: Vec<usize> = (0..EXPERTS).collect();
    let mut f = src.fetch_layer(layer, &all).unwrap();
    let mut held = Vec::new();
    while let Some(r) = f.next_ready() {
        held.push(r.unwrap());
    }
    assert_eq!(held.len(), EXPERTS);
    counters(src).hits - before
}

/// Prompt chunks read every expert of every layer in order. With room for three of four layers, LRU would
/// evict each layer just before it is needed again and hit nothing; evicting the layer that comes back
/// last misses nearly as seldom as the optimal (Belady) cache. (Belady reads a layer's experts as a
/// sequence and splits layers by that order, which the engine, handed a layer's experts at once, cannot
/// use: 96 misses against its 80 here, and equal at the large model's scale.)
#[test]
fn prompt_sweeps_miss_nearly_as_seldom_as_the_optimal_cache() {
    let (t, _file) = table_of(&[0, 1, 2, 3]);
    let slots = 3 * EXPERTS;
    let src = StreamingSource::new(t, &options(slots as u64 * SLOT, 2)).unwrap();
    let chunks = 7;
    let hits: u64 = (0..chunks * 4).map(|i| sweep_layer(&src, i % 4)).sum();
    let trace: Vec<(usize, usize)> = (0..chunks * 4)
        .flat_map(|i| (0..EXPERTS).map(move |e| (i % 4, e)))
        .collect();
    let optimal = crate::optimal_misses(&trace, slots, 0..trace.len()).len() as u64;
    let misses = trace.len() as u64 - hits;
    assert!(misses <= optimal * 5 / 4, "{misses} misses, optimal {optimal}");
    assert!(hits >= (chunks as u64 - 1) * 2 * EXPERTS as u64, "{hits} hits");
    assert_eq!(src.slot_census(), (0, slots));
}

/// Fetches `experts` of `layer` and waits for all of them (released at once, as a decode step does).
fn step(src: &StreamingSource, layer: usize, experts: &[usize]) {
    let mut f = src.fetch_layer(layer, experts).unwrap();
    while let Some(r) = f.next_ready() {
        r.unwrap();
    }
}

/// Decode: a record its layer passed over for two tokens goes before one the current layer used a token ago,
/// though the current layer comes back last.
#[test]
fn a_record_its_layer_kept_skipping_goes_first() {
    let (t, _file) = table_of(&[0, 1]);
    let src = StreamingSource::new(t, &options(3 * SLOT, 1)).unwrap();
    step(&src, 0, &[0]);
    step(&src, 1, &[0]);
    step(&src, 0, &[1]); // the next token: layer 0 skips expert 0
    step(&src, 1, &[0]);
    step(&src, 0, &[1]); // and again
                         // Full: (0,0) skipped twice, (1,0) used last token. Evicting by layer alone would take (1,0).
    step(&src, 1, &[2]);
    assert_eq!(src.resident(), [(0, 1), (1, 2), (1, 0)]);
    let c = counters(&src);
    assert_eq!((c.hits, c.misses), (2, 4), "{c:?}");
}

/// A guess evicts only records of its own layer or of layers that come back after it, never a record
/// the layers before it will want first.
#[test]
fn a_guess_never_evicts_a_layer_wanted_before_it() {
    let (t, _file) = table_of(&[0, 1, 2, 3]);
    let src = StreamingSource::new(t, &options(2 * SLOT, 1)).unwrap();
    for layer in [1, 2] {
        src.fetch_layer(layer, &[0]).unwrap().next_ready().unwrap().unwrap();
    }
    drop(src.fetch_layer(0, &[]).unwrap()); // the focus is layer 0: layers 1, 2, 3 come next
    src.prefetch(3, &[5]); // would have to evict layer 1 or 2, both wanted sooner: not issued
    src.wait_idle();
    assert_eq!(counters(&src).prefetch_issued, 0);
    src.prefetch(2, &[5]); // evicts its own layer's older record
    src.wait_idle();
    assert_eq!(counters(&src).prefetch_issued, 1);
    assert_eq!(src.resident(), [(1, 0), (2, 5)]);
    // A demand read takes the layer that comes back last: layer 2's unused guess, before layer 1.
    src.fetch_layer(0, &[1]).unwrap().next_ready().unwrap().unwrap();
    assert_eq!(src.resident(), [(0, 1), (1, 0)]);
}

#[test]
fn unused_prefetch_evicted_counts_as_waste() {
    let (src, file) = engine(2, 2);
    src.prefetch(LAYER, &[0, 1]);
    src.wait_idle();
    read(&src, 2); // a demand read may evict an unused prediction: the least recently used, 0
    assert_eq!(src.resident(), keys(&[2, 1]));
    let c = counters(&src);
    assert_eq!((c.prefetch_wasted, c.prefetch_wasted_bytes), (1, REC as u64), "{c:?}");

    // A prediction spares unused predictions: 3 evicts the idle record 2, not 1.
    src.prefetch(LAYER, &[3]);
    src.wait_idle();
    assert_eq!(src.resident(), keys(&[3, 1]));
    // Now every slot holds an unused prediction: another one is not issued at all.
    src.prefetch(LAYER, &[4]);
    src.wait_idle();
    assert_eq!(src.resident(), keys(&[3, 1]));
    let c = counters(&src);
    assert_eq!((c.prefetch_issued, c.prefetch_wasted, c.reads), (3, 1, 4), "{c:?}");

    // Used, 1 is a prefetch hit; 3, dropped unused with the caches, is waste.
    read(&src, 1);
    src.drop_caches().unwrap();
    let c = counters(&src);
    assert_eq!((c.prefetch_hits, c.prefetch_wasted), (1, 2), "{c:?}");
    assert_eq!(c.prefetch_wasted_bytes, 2 * REC as u64);
    assert_eq!((c.prefetch_bytes, c.demand_bytes), (3 * REC as u64, REC as u64));
    let mut read_once = file.reads();
    read_once.sort_unstable();
    assert_eq!(read_once, offsets(&[0, 1, 2, 3]));
    assert_eq!(src.slot_census(), (2, 0));
}

/// The same expert twice in one request: every position gets the record, from a single read, and no slot
/// is lost (a leaked slot shows as free + loaded < slots, and eventually as "cache too small").
#[test]
fn duplicate_experts_in_one_fetch_share_one_read_and_leak_no_slot() {
    let (src, file) = engine(3, 2);
    let recs = fetch_all(&src, &[3, 3, 5], false).unwrap();
    assert_eq!(slot_of(&recs[0]), slot_of(&recs[1]), "both positions share one slot");
    drop(recs);
    assert_eq!(
        src.slot_census(),
        (1, 2),
        "(free, loaded) slots after fetching [3, 3, 5]"
    );
    let c = counters(&src);
    assert_eq!((c.reads, c.misses, c.hits), (2, 2, 0), "{c:?}");
    let mut read_once = file.reads();
    read_once.sort_unstable();
    assert_eq!(read_once, offsets(&[3, 5]));

    for i in 0..24 {
        let a = i % EXPERTS;
        let b = (a + 1 + i % 3) % EXPERTS;
        let want = match i % 3 {
            0 => vec![a, a, b],
            1 => vec![b, a, a],
            _ => vec![a, b, a, a],
        };
        fetch_all(&src, &want, i % 2 == 0).unwrap_or_else(|e| panic!("fetch {i} of {want:?}: {e}"));
        let (free, loaded) = src.slot_census();
        assert_eq!(free + loaded, 3, "fetch {i} of {want:?} lost a slot");
    }
    // Three distinct records held at once still fit: no slot was lost.
    fetch_all(&src, &[5, 6, 7], true).unwrap();
    fetch_all(&src, &[0, 1, 2], false).unwrap();

    // A duplicated request for a prediction (in flight or landed): one read, one prefetch hit.
    let before = counters(&src);
    src.prefetch(LAYER, &[4]);
    fetch_all(&src, &[4, 4, 4], true).unwrap();
    let c = counters(&src).since(&before);
    assert_eq!((c.reads, c.prefetch_issued, c.prefetch_hits), (1, 1, 1), "{c:?}");
    let (free, loaded) = src.slot_census();
    assert_eq!(free + loaded, 3);
}

/// Two fetches waiting for the same record (the first had no slot when it asked) share one read.
#[test]
fn two_fetches_of_one_record_share_one_read() {
    let (src, file) = engine(2, 2);
    let a = read(&src, 0);
    let b = read(&src, 1);
    let mut first = src.fetch_layer(LAYER, &[5]).unwrap(); // no slot: not submitted yet
    drop((a, b));
    let mut second = src.fetch_layer(LAYER, &[5]).unwrap(); // evicts 0 and reads 5
    let (_, r1) = first.next_ready().unwrap().unwrap();
    let (_, r2) = second.next_ready().unwrap().unwrap();
    assert_record(&r1, 5);
    assert_eq!(slot_of(&r1), slot_of(&r2));
    assert!(first.next_ready().is_none() && second.next_ready().is_none());
    drop((first, second, r1, r2));
    assert_eq!(file.reads(), offsets(&[0, 1, 5]));
    assert_eq!(counters(&src).reads, 3);
    assert_eq!(src.resident(), keys(&[5, 1]));
    assert_eq!(src.slot_census(), (0, 2));
}

/// Swaps a record's two parts and reverses each one's bytes; refuses expert [`Self::fails`].
struct SwapParts {
    fails: usize,
}

impl RecordTransform for SwapParts {
    fn parts(&self, _layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>> {
        let (a, b) = (read[0].1, read[1].1);
        Some(vec![(b, a), (0, b)])
    }

    fn apply(
        &self,
        _layer: usize,
        record: &[u8],
        from: &[(usize, usize)],
        slot: &mut [u8],
        to: &[(usize, usize)],
    ) -> Result<(), String> {
        if u64::from_le_bytes(record[8..16].try_into().unwrap()) == self.fails as u64 {
            return Err("refused".into());
        }
        for (&(src, len), &(dst, _)) in from.iter().zip(to) {
            let bytes = record[src..src + len].iter().rev();
            slot[dst..dst + len].iter_mut().zip(bytes).for_each(|(d, s)| *d = *s);
        }
        Ok(())
    }
}

#[test]
fn a_transform_rewrites_each_record_after_its_checksum_passes() {
    let (t, _file) = table();
    let t = t.with_transform(Arc::new(SwapParts { fails: 5 })).unwrap();
    let src = StreamingSource::new(t, &options(3 * SLOT, 2)).unwrap();
    for expert in [0, 7, 2, 0, 4, 1] {
        // Checksums are of the stored bytes: were they checked after the rewrite, every read would fail.
        let rec = src.read_expert(LAYER, expert).unwrap();
        let want = record_bytes(LAYER, expert);
        let lens: Vec<usize> = rec.parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, [SPLIT, REC - SPLIT]);
        for (part, range) in rec.parts.iter().zip([0..SPLIT, SPLIT..REC]) {
            let got: Vec<u8> = part.iter().rev().copied().collect();
            assert!(
                got == want[range],
                "expert {expert}: a rewritten part has the wrong bytes"
            );
        }
    }
    let err = src.read_expert(LAYER, 5).unwrap_err().to_string();
    assert!(err.contains("expert 5") && err.contains("refused"), "{err}");
    assert_eq!(
        src.slot_census().0 + src.slot_census().1,
        3,
        "the failed rewrite leaked its slot"
    );
    assert_eq!(
        src.read_expert(LAYER, 3).unwrap().len(),
        REC,
        "no service after a failed rewrite"
    );
}

/// A fetch says whether its reads get the rewrite; a cached record keeps the layout it was read in, and guesses
/// are read as the latest fetch's reads are.
#[test]
fn each_read_is_rewritten_or_not_as_its_fetch_asks() {
    let (t, _file) = table();
    let t = t.with_transform(Arc::new(SwapParts { fails: usize::MAX })).unwrap();
    let src = StreamingSource::new(t, &options(EXPERTS as u64 * SLOT, 2)).unwrap();
    // Whether `rec`, expert `expert`'s record, came rewritten (parts swapped and reversed) or as stored.
    let rewritten = |expert: usize, rec: &ExpertRecord| {
        let want = record_bytes(LAYER, expert);
        let parts: Vec<Vec<u8>> = rec.parts.iter().map(|p| p.to_vec()).collect();
        if parts == [want[..SPLIT].to_vec(), want[SPLIT..].to_vec()] {
            return false;
        }
        let back: Vec<Vec<u8>> = parts.iter().map(|p| p.iter().rev().copied().collect()).collect();
        assert_eq!(
            back,
            [want[..SPLIT].to_vec(), want[SPLIT..].to_vec()],
            "expert {expert}: wrong bytes"
        );
        true
    };
    let fetch = |experts: &[usize], rewrite: bool| -> Vec<bool> {
        let mut f = src.fetch_layer_rewriting(LAYER, experts, rewrite).unwrap();
        let mut got = vec![None; experts.len()];
        while let Some(r) = f.next_ready() {
            let (pos, rec) = r.unwrap();
            got[pos] = Some(rewritten(experts[pos], &rec));
        }
        got.into_iter().map(Option::unwrap).collect()
    };
    assert_eq!(fetch(&[0, 1], false), [false, false]);
    assert_eq!(fetch(&[2, 0], true), [true, false], "a cached record keeps its layout");
    src.prefetch(LAYER, &[3]);
    src.wait_idle();
    assert_eq!(
        fetch(&[3], false),
        [true],
        "a guess after a rewriting fetch is rewritten"
    );
    src.prefetch(LAYER, &[4]);
    src.wait_idle();
    assert_eq!(
        fetch(&[4, 2, 1], true),
        [false, true, false],
        "a guess after a plain fetch is not"
    );
}

/// Moves the second part past the end of the record.
struct Overflow;

impl RecordTransform for Overflow {
    fn parts(&self, _layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>> {
        Some(vec![read[0], (REC, read[1].1)])
    }
    fn apply(
        &self,
        _: usize,
        _: &[u8],
        _: &[(usize, usize)],
        _: &mut [u8],
        _: &[(usize, usize)],
    ) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn a_transform_whose_records_outgrow_their_slots_is_refused() {
    let err = table().0.with_transform(Arc::new(Overflow)).err().unwrap().to_string();
    assert!(err.contains("slot bytes"), "{err}");
}

/// [`SwapParts`] with a bug: it panics on expert [`Self::0`].
struct PanicsOn(usize);

impl RecordTransform for PanicsOn {
    fn parts(&self, layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>> {
        SwapParts { fails: usize::MAX }.parts(layer, read)
    }

    fn apply(
        &self,
        layer: usize,
        record: &[u8],
        from: &[(usize, usize)],
        slot: &mut [u8],
        to: &[(usize, usize)],
    ) -> Result<(), String> {
        let expert = u64::from_le_bytes(record[8..16].try_into().unwrap());
        assert_ne!(expert, self.0 as u64, "a bug in the rewrite");
        SwapParts { fails: usize::MAX }.apply(layer, record, from, slot, to)
    }
}

#[test]
fn a_panic_while_loading_fails_that_record_and_the_io_threads_keep_serving() {
    let (t, _file) = table();
    let t = t.with_transform(Arc::new(PanicsOn(5))).unwrap();
    let src = Arc::new(StreamingSource::new(t, &options(3 * SLOT, 2)).unwrap());
    // More panics than I/O threads, then another record: had a panic ended its thread, or left its record
    // loading, a read would wait forever (hence the reads on a thread of their own, under the guard).
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = Arc::clone(&src);
    std::thread::spawn(move || {
        for expert in [5, 5, 5, 2] {
            let got = reader.read_expert(LAYER, expert).map(|r| r.len());
            tx.send(got.map_err(|e| e.to_string())).unwrap();
        }
    });
    for _ in 0..3 {
        let err = rx.recv_timeout(GUARD).expect("a read never ended").unwrap_err();
        assert!(
            err.contains("expert 5") && err.contains("panicked") && err.contains("a bug in the rewrite"),
            "{err}"
        );
    }
    let got = rx.recv_timeout(GUARD).expect("no read served after the panics");
    assert_eq!(got.unwrap(), REC);
    assert_eq!(counters(&src).read_errors, 3);
    assert_eq!(
        src.slot_census().0 + src.slot_census().1,
        3,
        "a panicked load leaked its slot"
    );
}

/// A panic payload whose own drop panics.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("the payload's drop panicked");
    }
}

/// A transform that panics with a [`Bomb`].
struct PanicsWithBomb;

impl RecordTransform for PanicsWithBomb {
    fn parts(&self, _layer: usize, read: &[(usize, usize)]) -> Option<Vec<(usize, usize)>> {
        Some(read.to_vec())
    }

    fn apply(
        &self,
        _layer: usize,
        _record: &[u8],
        _from: &[(usize, usize)],
        _slot: &mut [u8],
        _to: &[(usize, usize)],
    ) -> Result<(), String> {
        std::panic::panic_any(Bomb)
    }
}

#[test]
fn a_panic_whose_payload_panics_when_dropped_still_fails_only_its_record() {
    let (t, _file) = table();
    let t = t.with_transform(Arc::new(PanicsWithBomb)).unwrap();
    let src = Arc::new(StreamingSource::new(t, &options(3 * SLOT, 1)).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = Arc::clone(&src);
    std::thread::spawn(move || {
        // Rewritten (panics), then as read (the one I/O thread still serves).
        let failed = reader
            .fetch_layer_rewriting(LAYER, &[5], true)
            .map(|mut f| f.next_ready().map(|r| r.is_err()));
        let served = (reader.fetch_layer_rewriting(LAYER, &[2], false))
            .map(|mut f| f.next_ready().and_then(|r| r.ok()).map(|(_, rec)| rec.len()));
        tx.send((failed.ok().flatten(), served.ok().flatten())).unwrap();
    });
    let got = rx.recv_timeout(GUARD).expect("a read never ended: the I/O thread died");
    assert_eq!(got, (Some(true), Some(REC)));
}

/// [`table`] with each record read in place as three reads (as a checkpoint's tensors are), listed out of slot
/// order; expert `broken`'s middle read points past the end of the file.
fn three_read_table(broken: usize) -> (RecordTable, Arc<MemFile>) {
    let (packed, file) = table();
    let end = file.data.len() as u64;
    let cuts = [0, SPLIT, 2500, REC];
    let layouts = (0..EXPERTS)
        .map(|e| {
            let mut reads: Vec<ReadOp> = (cuts.windows(2).rev())
                .map(|w| ReadOp {
                    file: 0,
                    offset: offset_of(e) + w[0] as u64,
                    len: w[1] - w[0],
                    slot_offset: w[0],
                    needed: w[1] - w[0],
                })
                .collect();
            if e == broken {
                reads[1].offset = end + 4096;
            }
            RecordLayout {
                reads,
                parts: vec![(0, SPLIT), (SPLIT, REC - SPLIT)],
                checksum: None,
                rewritten: None,
            }
        })
        .collect();
    (
        RecordTable::new(packed.files.clone(), HashMap::from([(LAYER, layouts)])),
        file,
    )
}

#[test]
fn a_records_reads_run_side_by_side_into_their_places() {
    let (t, file) = three_read_table(usize::MAX);
    let src = StreamingSource::new(t, &options(4 * SLOT, 2)).unwrap();
    file.close();
    std::thread::scope(|s| {
        let fetch = s.spawn(|| read(&src, 2));
        // One record, so one I/O thread: its three reads can only all start at once if they run side by side.
        file.wait_started(3);
        file.open();
        fetch.join().unwrap();
    });
    let mut started = file.reads();
    started.sort_unstable();
    assert_eq!(started, [0, SPLIT as u64, 2500].map(|o| offset_of(2) + o));
    for e in 0..EXPERTS {
        read(&src, e);
    }
}

#[test]
fn a_failed_read_among_several_fails_its_record_clearly_and_no_other() {
    let (t, _file) = three_read_table(5);
    let src = StreamingSource::new(t, &options(4 * SLOT, 2)).unwrap();
    let err = src.read_expert(LAYER, 5).unwrap_err().to_string();
    assert!(err.contains("layer 3 expert 5") && err.contains("short read"), "{err}");
    for e in [4, 6, 0] {
        read(&src, e);
    }
    assert_eq!(counters(&src).read_errors, 1);
}

/// A record's checksum is computed on its first read only, again after the caches are dropped; a record
/// whose checksum fails is never taken as checked, so every read of it fails.
#[test]
fn checksums_are_checked_on_a_records_first_read_and_a_bad_one_fails_every_read() {
    let (src, file) = engine(1, 1);
    drop(read(&src, 0));
    drop(read(&src, 1)); // evicts 0: one slot
    drop(read(&src, 0)); // read again from the file, not hashed again
    assert_eq!(file.reads(), offsets(&[0, 1, 0]));
    assert_eq!(src.hashed(), 2);
    src.drop_caches().unwrap();
    drop(read(&src, 0));
    assert_eq!(src.hashed(), 3, "dropped caches check every record again");

    let (good, file) = table();
    let mut layouts: Vec<RecordLayout> = (0..EXPERTS).map(|e| good.record(LAYER, e).unwrap().clone()).collect();
    layouts[0].checksum = layouts[0].checksum.map(|c| c ^ 1);
    let files: Vec<Arc<dyn ReadAt>> = vec![file];
    let bad = RecordTable::new(files, [(LAYER, layouts)].into_iter().collect());
    let src = StreamingSource::new(bad, &options(SLOT, 1)).unwrap();
    for _ in 0..2 {
        let err = src.read_expert(LAYER, 0).unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
    }
    assert_eq!(src.hashed(), 2);
    drop(read(&src, 1));
}

/// A packed record longer than [`READ_PIECE`] is read as equal pieces side by side, each into its place, and its
/// checksum covers the whole record.
#[test]
fn a_long_read_is_cut_into_pieces_read_side_by_side() {
    let len = 2 * READ_PIECE + 3 * 4096;
    let data: Vec<u8> = (0..2 * len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
        .collect();
    let layouts = (0..2)
        .map(|e| RecordLayout {
            reads: vec![ReadOp {
                file: 0,
                offset: (e * len) as u64,
                len,
                slot_offset: 0,
                needed: len,
            }],
            parts: vec![(0, 100), (100, len - 100)],
            checksum: Some(xxhash_rust::xxh3::xxh3_64(&data[e * len..(e + 1) * len])),
            rewritten: None,
        })
        .collect();
    let file = Arc::new(MemFile {
        data: data.clone(),
        path: PathBuf::from("/test/experts.bin"),
        gate: Mutex::default(),
        changed: Condvar::new(),
    });
    let files: Vec<Arc<dyn ReadAt>> = vec![file.clone()];
    let table = RecordTable::new(files, HashMap::from([(LAYER, layouts)]));
    assert_eq!(table.max_pieces_per_record(), 3);
    let slot = len.next_multiple_of(SLOT_ALIGN) as u64;
    let src = StreamingSource::new(table, &options(2 * slot, 2)).unwrap();
    file.close();
    let rec = std::thread::scope(|s| {
        let fetch = s.spawn(|| src.read_expert(LAYER, 1).unwrap());
        // One record, so one I/O thread: its three pieces can only all start at once if they run side by side.
        file.wait_started(3);
        file.open();
        fetch.join().unwrap()
    });
    let mut started = file.reads();
    started.sort_unstable();
    let piece = crate::piece_len(len);
    assert!(piece < READ_PIECE && 3 * piece >= len, "three equal pieces");
    assert_eq!(started, [0, piece, 2 * piece].map(|o| (len + o) as u64));
    let got: Vec<u8> = rec.parts.iter().flat_map(|p| p.iter().copied()).collect();
    assert!(got == data[len..], "record 1's bytes, in order");
    assert_eq!(src.hashed(), 1);
    assert_eq!(counters(&src).bytes_read(), len as u64);
}

/// A file whose first read at each of some offsets fails (a transient I/O error).
struct FailOnce {
    file: Arc<MemFile>,
    failing: Mutex<Vec<u64>>,
}

impl ReadAt for FailOnce {
    /// Reads through the file (held at its gate like any read), then fails if this offset is to fail once.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let n = self.file.read_at(buf, offset)?;
        let mut failing = self.failing.lock().unwrap();
        if let Some(i) = failing.iter().position(|&o| o == offset) {
            failing.remove(i);
            return Err(io::Error::other("transient"));
        }
        Ok(n)
    }

    fn path(&self) -> &Path {
        self.file.path()
    }
}

#[test]
fn a_guess_whose_read_failed_is_no_hit_and_is_read_again_on_demand() {
    let (mut t, file) = table();
    let failing = Mutex::new(vec![offset_of(5), offset_of(6)]);
    t.files = vec![Arc::new(FailOnce { file, failing })];
    let src = StreamingSource::new(t, &options(4 * SLOT, 2)).unwrap();
    src.prefetch(LAYER, &[5, 6]);
    src.wait_idle();
    assert_eq!(counters(&src).read_errors, 2);
    // Asked for, the failed guess is read again on demand, and was no prefetch hit.
    read(&src, 5);
    assert_eq!(counters(&src).prefetch_hits, 0);
    // Guessed again, it is not read again (a record that fails for good would cost a read every step), but
    // asked for, it is.
    src.prefetch(LAYER, &[6]);
    src.wait_idle();
    read(&src, 6);
    let c = counters(&src);
    assert_eq!((c.prefetch_issued, c.prefetch_hits, c.read_errors), (2, 0, 2), "{c:?}");
}

/// A guess whose read fails after a fetch asked for it is read again on demand, as one that failed before the
/// fetch: the same transient error must not fail the step in one of the two cases only.
#[test]
fn a_guess_that_fails_while_a_fetch_waits_for_it_is_read_again_on_demand() {
    let (mut t, file) = table();
    let failing = Mutex::new(vec![offset_of(5)]);
    t.files = vec![Arc::new(FailOnce {
        file: Arc::clone(&file),
        failing,
    })];
    let src = StreamingSource::new(t, &options(4 * SLOT, 2)).unwrap();
    file.close();
    src.prefetch(LAYER, &[5]);
    file.wait_started(1);
    let got = read_through_gate(&src, &file, LAYER, 5);
    assert_record(&got.unwrap(), 5);
    let c = counters(&src);
    assert_eq!((c.read_errors, c.reads), (1, 1), "{c:?}");
    assert_eq!(file.reads(), offsets(&[5, 5]));
}

/// A fetch abandoned while its reads wait (an error elsewhere in the step, a panic) leaves no orphans: its reads
/// not started are dropped and their slots come back, and one under way that fails is read again by the next
/// fetch that asks, not handed to it as an error (demand reads nobody waited for were read anyway, ahead of
/// everything, and a failure among them failed whichever fetch joined them).
#[test]
fn an_abandoned_fetch_leaves_no_orphaned_reads() {
    // Not started: dropped.
    let (src, file) = engine(4, 1);
    file.close();
    let fetch = src.fetch_layer(LAYER, &[5, 6, 7]).unwrap();
    file.wait_started(1);
    drop(fetch);
    file.open();
    src.wait_idle();
    assert_eq!(file.reads(), offsets(&[5]));
    assert_eq!(src.slot_census(), (3, 1), "6's and 7's slots are free again");
    read(&src, 6);
    // Under way, then failed: read again for the fetch that joined it.
    let (mut t, file) = table();
    let failing = Mutex::new(vec![offset_of(6)]);
    t.files = vec![Arc::new(FailOnce {
        file: Arc::clone(&file),
        failing,
    })];
    let src = StreamingSource::new(t, &options(4 * SLOT, 2)).unwrap();
    file.close();
    let fetch = src.fetch_layer(LAYER, &[5, 6]).unwrap();
    file.wait_started(2);
    drop(fetch);
    let got = read_through_gate(&src, &file, LAYER, 6);
    assert_record(&got.unwrap(), 6);
    let mut reads = file.reads();
    reads[..2].sort();
    assert_eq!(reads, offsets(&[5, 6, 6]));
}

/// Dropping the caches (a cold run's start) drops the guesses not started and waits for those under way: they
/// landed after the reset, and the cold run counted them as hits.
#[test]
fn dropping_the_caches_leaves_no_guess_to_land_after() {
    let (src, file) = engine(4, 1);
    file.close();
    src.prefetch(LAYER, &[5, 6]);
    file.wait_started(1);
    std::thread::scope(|s| {
        let dropped = s.spawn(|| src.drop_caches());
        let deadline = Instant::now() + GUARD;
        while counters(&src).prefetch_cancelled == 0 {
            assert!(Instant::now() < deadline, "the queued guess was never dropped");
            std::thread::yield_now();
        }
        file.open();
        dropped.join().unwrap().unwrap();
    });
    assert!(src.resident().is_empty(), "{:?}", src.resident());
    assert_eq!(file.reads(), offsets(&[5]));
    assert_eq!(src.slot_census(), (4, 0));
}

/// A file whose every read takes `delay`.
struct Slow {
    file: Arc<MemFile>,
    delay: Duration,
}

impl ReadAt for Slow {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::thread::sleep(self.delay);
        self.file.read_at(buf, offset)
    }

    fn path(&self) -> &Path {
        self.file.path()
    }
}

/// The read depth of an interval in which the disk never went idle is counted in that interval: the time
/// reads were under way is added as each read ends, not only once none is left.
#[test]
fn read_depth_is_counted_while_the_disk_stays_busy() {
    let (mut t, file) = table();
    t.files = vec![Arc::new(Slow {
        file,
        delay: Duration::from_millis(60),
    })];
    let src = StreamingSource::new(t, &options(8 * SLOT, 2)).unwrap();
    std::thread::scope(|s| {
        // Eight reads two at a time: ~240 ms of a disk never idle, reads ending at ~60, 120, 180 and 240 ms.
        let all = s.spawn(|| fetch_all(&src, &[0, 1, 2, 3, 4, 5, 6, 7], true).map(|r| r.len()));
        std::thread::sleep(Duration::from_millis(70));
        let a = counters(&src);
        std::thread::sleep(Duration::from_millis(120));
        let b = counters(&src);
        let d = b.since(&a);
        assert!(d.read_busy_seconds > 0.0, "{d:?}");
        let depth = d.effective_queue_depth();
        assert!((1.0..=2.5).contains(&depth), "depth {depth} over the interval: {d:?}");
        assert_eq!(all.join().unwrap().unwrap(), 8);
    });
}
