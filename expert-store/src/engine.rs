//! The streaming engine: expert records read by a pool of I/O threads into persistent slots, kept under
//! a byte budget, served to the decode step as they arrive.
//!
//! Invariants:
//! - Slots are allocated once, at start; a background thread backs them with memory in the order the free
//!   list hands them out (without writing them), so first reads do not stop to fault pages in. A slot is
//!   written only by the I/O thread that exclusively owns it (`Arc::get_mut` proves nobody else holds it); a
//!   slot whose record is still referenced by a computation (an [`ExpertRecord`] clone keeps the `Arc`
//!   alive) is never chosen for eviction.
//! - Demand reads are queued ahead of prefetches; a prefetch a step turns out to need is promoted.
//! - After a decode step's fetch at most `guess_depth` prefetches are read at once: a disk reads no faster
//!   at depth, so more would only slow the reads a step waits for, and a queued guess can still be cancelled.
//! - Prefetches are read nearest layer first, counting forward (cyclically) from the layer last fetched: a
//!   guess for the next layer goes before a guess for the one after, whatever order the guesses came in.
//! - A layer's fetch cancels that layer's queued prefetches it did not ask for: the guess was wrong, and
//!   reading it now would only delay the reads still useful.
//! - A newer guess for a layer replaces its queued older one (what was already read or started stays).
//! - Eviction takes the record its own layer has passed over most often since it was last asked for (a pass
//!   is one forward through the layers: a token, or a prompt's chunk), and among equals the one whose layer
//!   comes back last: layers run in a cycle, so the layer just computed is needed furthest in the future
//!   (least recently used first within a layer). A prompt's chunk reads every expert of every layer in
//!   order; plain LRU then evicts exactly the records the next chunk needs first and hits nothing, while
//!   this keeps most layers whole (Belady's choice for a cycle). Decode routes repeat over nearby tokens, so
//!   a record its layer skipped for several tokens is a better victim than one the layer just used (on a
//!   streamed decode trace, about a fifth fewer misses than evicting by layer alone). A fetch for most of a
//!   layer (a prompt's chunk) makes any record likely wanted on its layer's next visit: then only the cycle
//!   order counts.
//! - Prefetches only take free slots or evict entries that are neither pinned nor unused prefetches, and
//!   only records of the guessed layer or of layers that come back after it.
//! - A fetch dropped before its reads land (an error elsewhere in the step) drops those not started, their slots
//!   back on the free list, and leaves those under way to whoever asks next, who reads the record again if
//!   that read failed. Dropping the caches (a cold run's start) drops the queued guesses and waits for reads
//!   under way.
//! - A record has at most one entry and one read: an expert asked for twice in one fetch, or by two
//!   fetches, shares the first request's read (a second read would replace the entry and lose a slot).

mod part_pool;

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lru::LruCache;

use crate::aligned::{Prefault, SlotBuf};
use crate::counters::StoreCounters;
use crate::experts::{ExpertFetch, ExpertRecord, ExpertSource};
use crate::layout::{read_full, ReadOp, RecordLayout, RecordTable};
use crate::{OwnedBytes, StoreError};
use part_pool::{Part, PartPool};

type Key = (usize, usize);

/// Below this share of the slots on huge pages, the engine warns once they are backed.
const LOW_HUGE_PAGE_SHARE: f64 = 0.9;

/// Guesses read at once by default (see [`EngineOptions::guess_depth`]).
pub const DEFAULT_GUESS_DEPTH: usize = 2;

/// Settings of a [`StreamingSource`].
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Hard budget for record slots in bytes (rounded down to whole slots, at least one).
    pub cache_bytes: u64,
    /// I/O threads, i.e. records read at once (a record of several reads runs them side by side on
    /// `2 * io_depth` part-read threads).
    pub io_depth: usize,
    /// Guesses (prefetches) read at once after a decode step's fetch (0 acts as 1, more than `io_depth` as
    /// `io_depth`). The rest wait in the queue, where their layer's fetch can still cancel them and a newer
    /// guess replace them, and a read the step waits for shares the disk with no more guesses than this.
    pub guess_depth: usize,
    /// Check each packed record's checksum after its first read (again after [`ExpertSource::drop_caches`]).
    pub verify: bool,
    /// Back every slot with memory from the start, in the background (else slots fault in on first read).
    /// Only for a budget the machine has room for: backing an overcommitted one would push out other memory
    /// at once instead of when the cache fills.
    pub prefault: bool,
}

impl EngineOptions {
    /// The guesses read at once that these options give: `guess_depth` within 1..=`io_depth`.
    pub fn effective_guess_depth(&self) -> usize {
        self.guess_depth.clamp(1, self.io_depth.max(1))
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            cache_bytes: 1 << 30,
            io_depth: 8,
            guess_depth: DEFAULT_GUESS_DEPTH,
            verify: true,
            prefault: true,
        }
    }
}

enum SlotState {
    Loading,
    Ready(Arc<SlotBuf>),
    Failed(String),
}

struct Entry {
    state: SlotState,
    /// Loaded by a prefetch and not yet requested by a decode step.
    unused_prefetch: bool,
    /// Fetches waiting for this record that have not taken it yet (it must not be evicted meanwhile).
    waiters: usize,
    bytes: usize,
    /// The pass in which a fetch (or a guess) last asked for it.
    last_pass: u64,
    /// Whether its slot holds the record as the table's transform rewrote it (else as read).
    rewritten: bool,
    /// Whether its read was a guess's: a fetch that finds such a read failed reads it again on demand, as it
    /// does for a guess that failed before the fetch asked.
    guessed: bool,
}

struct Job {
    key: Key,
    buf: Arc<SlotBuf>,
    prefetch: bool,
    rewrite: bool,
}

#[derive(Default)]
struct Queue {
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    in_flight: usize,
    /// Reads under way: popped jobs whose `pread` has started and not yet ended.
    reading: usize,
    /// The start of the first read and the end of the latest one since `reading` last left 0. The active
    /// window opens at a read's start, not at a job's pop: a worker held off the core between the two is
    /// not the disk being busy.
    window: Option<(Instant, Instant)>,
    shutdown: bool,
    /// The layer fetched last: prefetches are read in order of their layer's distance after it, and
    /// eviction spares the layers that come right after it.
    focus: usize,
    /// One past the highest layer with records (the cycle of that distance).
    layer_cycle: usize,
    /// Guesses being read now (popped from the prefetch queue, not yet landed).
    guesses_reading: usize,
    /// At most this many guesses are read at once while `guesses_limited`.
    guess_depth: usize,
    /// Whether the latest fetch was sparse (a decode step's; true before the first fetch). A prompt's chunk
    /// uses most experts of every layer, so its guesses are nearly all right: nothing is gained by holding
    /// them back.
    guesses_limited: bool,
}

impl Queue {
    /// The next read and whether it is a guess: demand first, else the prefetch of the nearest layer after
    /// the focus (oldest first) unless `guess_depth` guesses are being read and the limit applies.
    fn pop(&mut self) -> Option<(Job, bool)> {
        if let Some(j) = self.demand.pop_front() {
            return Some((j, false));
        }
        if !self.guess_may_start() {
            return None;
        }
        let (focus, cycle) = (self.focus, self.layer_cycle);
        let best = (self.prefetch.iter().enumerate())
            .min_by_key(|(i, j)| (layers_after(focus, j.key.0, cycle), *i))
            .map(|(i, _)| i)?;
        let job = self.prefetch.remove(best)?;
        self.guesses_reading += 1;
        Some((job, true))
    }

    /// Whether a queued guess may be read now: fewer than `guess_depth` are being read, or no limit applies.
    fn guess_may_start(&self) -> bool {
        !self.guesses_limited || self.guesses_reading < self.guess_depth
    }
}

/// How many layers after `focus` layer `layer` comes, in a cycle of `cycle` layers (0 for `focus` itself).
fn layers_after(focus: usize, layer: usize, cycle: usize) -> usize {
    let cycle = cycle.max(1);
    (layer + cycle - focus % cycle) % cycle
}

/// The cache's entries: one LRU list per layer, so the victim search walks layers by distance.
struct Entries {
    layers: Vec<LruCache<usize, Entry>>,
    /// Forward passes begun: a fetch of a layer below the previous fetch's starts the next one.
    pass: u64,
    /// The layer fetched last.
    last_layer: Option<usize>,
    /// Whether that fetch asked for at most a quarter of its layer's experts (a decode step's, not a prompt
    /// chunk's, which asks for most of every layer: then any record is likely wanted on its layer's next
    /// visit, and only the cycle order tells records apart).
    sparse: bool,
}

impl Entries {
    fn new(layer_cycle: usize) -> Self {
        Self {
            layers: (0..layer_cycle.max(1)).map(|_| LruCache::unbounded()).collect(),
            pass: 0,
            last_layer: None,
            sparse: true,
        }
    }

    /// Notes a fetch of `layer` (`sparse`: for at most a quarter of its experts): the next pass begins when
    /// the layers start over.
    fn begin_fetch(&mut self, layer: usize, sparse: bool) {
        if self.last_layer.is_some_and(|last| layer < last) {
            self.pass += 1;
        }
        self.last_layer = Some(layer);
        self.sparse = sparse;
    }

    /// How many of `layer`'s visits since `entry` was last asked for did not ask for it (its visit in this
    /// pass counts only once it has happened); 0 while fetches are not sparse.
    fn visits_missed(&self, layer: usize, entry: &Entry) -> u64 {
        if !self.sparse {
            return 0;
        }
        let to_come = self.last_layer.is_some_and(|last| layer > last);
        (self.pass - entry.last_pass.min(self.pass)).saturating_sub(u64::from(to_come))
    }

    /// The entry of `key`, marked most recently used in its layer.
    fn get_mut(&mut self, key: &Key) -> Option<&mut Entry> {
        self.layers.get_mut(key.0)?.get_mut(&key.1)
    }

    fn peek_mut(&mut self, key: &Key) -> Option<&mut Entry> {
        self.layers.get_mut(key.0)?.peek_mut(&key.1)
    }

    fn contains(&self, key: &Key) -> bool {
        self.layers.get(key.0).is_some_and(|l| l.contains(&key.1))
    }

    fn put(&mut self, key: Key, entry: Entry) {
        if key.0 >= self.layers.len() {
            self.layers.resize_with(key.0 + 1, LruCache::unbounded);
        }
        self.layers[key.0].put(key.1, entry);
    }

    fn pop(&mut self, key: &Key) -> Option<Entry> {
        self.layers.get_mut(key.0)?.pop(&key.1)
    }

    /// Every entry, layer by layer, most recently used first within a layer.
    fn iter(&self) -> impl Iterator<Item = (Key, &Entry)> {
        (self.layers.iter().enumerate()).flat_map(|(l, c)| c.iter().map(move |(e, entry)| ((l, *e), entry)))
    }

    /// How far ahead `layer` comes back after `focus`, the layer fetched last: 1 for the next layer, the whole
    /// cycle for `focus` itself (its records not in use now are next wanted by the next token or chunk).
    fn distance(&self, focus: usize, layer: usize) -> usize {
        match layers_after(focus, layer, self.layers.len()) {
            0 => self.layers.len(),
            d => d,
        }
    }

    /// The entry `evictable` allows, of a layer that comes back after `beyond` layers, whose layer passed it
    /// over most often; among equals, of the layer that comes back last. Least recently used first within a
    /// layer (which is also the one its layer passed over most).
    fn victim(&self, focus: usize, beyond: usize, evictable: impl Fn(&Entry) -> bool) -> Option<Key> {
        let cycle = self.layers.len();
        (beyond + 1..=cycle)
            .filter_map(|d| {
                let layer = (focus + d) % cycle;
                let (&e, entry) = self.layers[layer].iter().rev().find(|(_, entry)| evictable(entry))?;
                Some(((self.visits_missed(layer, entry), d), (layer, e)))
            })
            .max_by_key(|&(rank, _)| rank)
            .map(|(_, key)| key)
    }
}

struct State {
    entries: Entries,
    free: Vec<Arc<SlotBuf>>,
    /// Whether guesses are rewritten: as the latest fetch's reads are (a prompt's chunk's guesses serve it).
    rewrite_guesses: bool,
}

struct Inner {
    table: RecordTable,
    state: Mutex<State>,
    arrived: Condvar,
    queue: Mutex<Queue>,
    work: Condvar,
    counters: Arc<StoreCounters>,
    verify: bool,
    /// Records whose checksum has passed since the engine started (or the caches were last dropped): a record
    /// read again is not hashed again. Hashing cost the I/O threads ~0.5 ms of CPU per 2.65 MB record, beside
    /// compute workers that take both cores of a small machine, and a packed store's decode read ~20% slower
    /// for it (README, "Streaming experts from the SSD", item 7); a corrupt record never passes, so it fails
    /// every read.
    verified: Mutex<HashSet<Key>>,
    /// Records hashed, for tests.
    #[cfg(test)]
    hashed: std::sync::atomic::AtomicUsize,
    slots: usize,
    slot_len: usize,
    /// The slots' mapping (address, length): asked after which share of it is on huge pages.
    slot_arena: (usize, usize),
    /// Threads that run a record's reads side by side when it takes more than one (records read in place
    /// from a checkpoint: one read per tensor; reads longer than [`crate::READ_PIECE`]: one per piece); `None`
    /// when every record is one read, or when no such thread could start (reads then run one after another).
    part_readers: Option<PartPool>,
    /// Times a fetch blocked waiting for a read to land.
    #[cfg(test)]
    fetch_waits: std::sync::atomic::AtomicUsize,
    /// Held while `counters.slots_backed` turns true, so a waiter cannot miss the signal.
    backed_lock: Mutex<()>,
    /// Signalled when `counters.slots_backed` turns true.
    backed_now: Condvar,
}

/// Serves expert records from disk through a budgeted cache of persistent slots.
pub struct StreamingSource {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave these structures half-updated in a way that matters
    // more than stopping service, so keep going with the data as is.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StreamingSource {
    /// Starts the I/O threads and allocates the slots for `table` under `opts.cache_bytes`.
    pub fn new(table: RecordTable, opts: &EngineOptions) -> Result<Self, StoreError> {
        let record_len = table.max_slot_len();
        let slot_len = SlotBuf::slot_len(record_len);
        if table.is_empty() {
            return Err(StoreError::Engine("no expert records to serve".into()));
        }
        let slots = ((opts.cache_bytes / slot_len as u64) as usize).min(table.len());
        if slots == 0 {
            return Err(StoreError::Engine(format!(
                "expert cache budget of {} bytes is smaller than one record slot ({slot_len} bytes, for records \
                 of up to {record_len} bytes)",
                opts.cache_bytes
            )));
        }
        let layer_cycle = table.layers().last().map_or(0, |l| l + 1);
        // One read after another, a record read from a checkpoint took nine reads' latencies; side by side it
        // lands in about one, and the step waits less (README, "Streaming experts from the SSD", item 1). A
        // packed record's one read is cut into pieces of at most READ_PIECE, read side by side too.
        let part_readers = if table.max_pieces_per_record() > 1 {
            PartPool::new(2 * opts.io_depth.max(1), "sluice-part-")
        } else {
            None
        };
        let free: Vec<Arc<SlotBuf>> = SlotBuf::allocate(slots, slot_len)
            .ok_or_else(|| StoreError::Engine(format!("cannot allocate {slots} slots of {slot_len} bytes")))?
            .into_iter()
            .map(Arc::new)
            .collect();
        let slot_arena = free.first().map_or((0, 0), |b| b.arena_span());
        // The free list hands out slots from its end: back them with memory in that order.
        let prefault = if opts.prefault {
            Prefault::new(free.iter().rev().map(|b| &**b))
        } else {
            None
        };
        let inner = Arc::new(Inner {
            table,
            state: Mutex::new(State {
                entries: Entries::new(layer_cycle),
                free,
                rewrite_guesses: true,
            }),
            arrived: Condvar::new(),
            queue: Mutex::new(Queue {
                layer_cycle,
                guess_depth: opts.effective_guess_depth(),
                guesses_limited: true,
                ..Queue::default()
            }),
            work: Condvar::new(),
            counters: Arc::new(StoreCounters {
                slots_backed: AtomicBool::new(prefault.is_none()),
                ..StoreCounters::default()
            }),
            verify: opts.verify,
            verified: Mutex::default(),
            #[cfg(test)]
            hashed: Default::default(),
            slots,
            slot_len,
            slot_arena,
            part_readers,
            #[cfg(test)]
            fetch_waits: Default::default(),
            backed_lock: Mutex::new(()),
            backed_now: Condvar::new(),
        });
        // Started one by one into the engine, so that one failing to start stops those before it (the drop).
        let mut engine = Self {
            inner,
            workers: Vec::new(),
        };
        for i in 0..opts.io_depth.max(1) {
            let inner = Arc::clone(&engine.inner);
            let worker = std::thread::Builder::new()
                .name(format!("sluice-io-{i}"))
                .spawn(move || inner.worker())
                .map_err(|e| StoreError::Engine(format!("cannot start I/O thread: {e}")))?;
            engine.workers.push(worker);
        }
        if let Some(pass) = prefault {
            let inner = Arc::clone(&engine.inner);
            // Without this thread the slots still fault in on first read, only slower: nothing to report.
            match std::thread::Builder::new()
                .name("sluice-prefault".into())
                .spawn(move || inner.prefault(&pass))
            {
                Ok(h) => engine.workers.push(h),
                Err(_) => engine.inner.mark_backed(),
            }
        }
        Ok(engine)
    }

    /// Number of slots and bytes per slot.
    pub fn slots(&self) -> (usize, usize) {
        (self.inner.slots, self.inner.slot_len)
    }

    /// The record table being served.
    pub fn table(&self) -> &RecordTable {
        &self.inner.table
    }

    /// Loads every record while slots remain (fully-resident mode when the budget covers the model).
    pub fn preload(&self) -> Result<(), StoreError> {
        for layer in self.inner.table.layers() {
            let experts: Vec<usize> = (0..self.inner.table.num_experts(layer)).collect();
            let room = lock(&self.inner.state).free.len();
            if room == 0 {
                break;
            }
            let mut f = self.fetch_layer(layer, &experts[..experts.len().min(room)])?;
            while let Some(r) = f.next_ready() {
                r?;
            }
        }
        Ok(())
    }
}

/// Views into the engine's state for its unit tests.
#[cfg(test)]
impl StreamingSource {
    /// (free slots, slots holding a loaded record): their sum is the slot count unless a slot leaked.
    fn slot_census(&self) -> (usize, usize) {
        let st = lock(&self.inner.state);
        let loaded = (st.entries.iter())
            .filter(|(_, e)| matches!(e.state, SlotState::Ready(_)))
            .count();
        (st.free.len(), loaded)
    }

    /// Whether the background pass that backs the slots has ended.
    fn pass_ended(&self) -> bool {
        self.inner.counters.slots_backed.load(Relaxed)
    }

    /// Times a fetch blocked waiting for a read to land.
    fn fetch_waits(&self) -> usize {
        self.inner.fetch_waits.load(Relaxed)
    }

    /// Records whose checksum was computed.
    fn hashed(&self) -> usize {
        self.inner.hashed.load(Relaxed)
    }

    /// Keys of the loaded records, layer by layer, most recently used first within a layer.
    fn resident(&self) -> Vec<Key> {
        let st = lock(&self.inner.state);
        (st.entries.iter())
            .filter(|(_, e)| matches!(e.state, SlotState::Ready(_)))
            .map(|(k, _)| k)
            .collect()
    }

    /// Blocks until no read is queued or in flight and every record has settled; panics after 10 s.
    fn wait_idle(&self) {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        let mut st = lock(&self.inner.state);
        loop {
            let loading = st.entries.iter().any(|(_, e)| matches!(e.state, SlotState::Loading));
            let q = lock(&self.inner.queue);
            let busy = q.in_flight > 0 || !q.demand.is_empty() || !q.prefetch.is_empty();
            drop(q);
            if !loading && !busy {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "engine still busy after 10 s");
            let step = left.min(std::time::Duration::from_millis(20));
            st = self
                .inner
                .arrived
                .wait_timeout(st, step)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for StreamingSource {
    fn drop(&mut self) {
        lock(&self.inner.queue).shutdown = true;
        self.inner.work.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Inner {
    fn layout(&self, key: Key) -> Result<&RecordLayout, StoreError> {
        self.table.record(key.0, key.1).ok_or(StoreError::NoRecord {
            layer: key.0,
            expert: key.1,
        })
    }

    /// A slot for a new read of `key`: a free one, else an entry that no computation references and no
    /// fetch waits for, from the layer that comes back last. Prefetches also spare unused prefetched
    /// entries and the layers that come back before the guessed one.
    fn take_slot(&self, st: &mut State, key: Key, for_prefetch: bool) -> Option<Arc<SlotBuf>> {
        if let Some(b) = st.free.pop() {
            return Some(b);
        }
        // Eviction spares the layers right after the one fetched last (the queue's focus). A guess may evict
        // records of its own layer (least recently used first), not of layers before it.
        let focus = lock(&self.queue).focus;
        let beyond = if for_prefetch {
            st.entries.distance(focus, key.0) - 1
        } else {
            0
        };
        let victim = st.entries.victim(focus, beyond, |e| match &e.state {
            SlotState::Ready(b) => Arc::strong_count(b) == 1 && e.waiters == 0 && !(for_prefetch && e.unused_prefetch),
            _ => false,
        });
        let Some(victim) = victim else {
            // A demand read takes the slot of a guess not started yet rather than wait for a read to land:
            // that guess would be read and then evicted unused for it. (A queued guess has no waiters: a fetch
            // that asks for one moves it to the demand queue.)
            if for_prefetch {
                return None;
            }
            let job = lock(&self.queue).prefetch.pop_back()?;
            st.entries.pop(&job.key);
            self.counters.prefetch_cancelled.fetch_add(1, Relaxed);
            return Some(job.buf);
        };
        let e = st.entries.pop(&victim)?;
        if e.unused_prefetch {
            self.counters.prefetch_wasted.fetch_add(1, Relaxed);
            self.counters.prefetch_wasted_bytes.fetch_add(e.bytes as u64, Relaxed);
        }
        match e.state {
            SlotState::Ready(b) => Some(b),
            _ => None,
        }
    }

    /// Queues the read of `key` into `buf`, rewritten by the table's transform when `rewrite` (and it has one).
    fn submit(
        &self,
        st: &mut State,
        key: Key,
        buf: Arc<SlotBuf>,
        prefetch: bool,
        rewrite: bool,
    ) -> Result<(), StoreError> {
        debug_assert!(!st.entries.contains(&key), "second read of {key:?}");
        let layout = self.layout(key)?;
        let bytes = layout.read_len();
        let rewrite = rewrite && self.table.transform().is_some() && layout.rewritten.is_some();
        let last_pass = st.entries.pass;
        st.entries.put(
            key,
            Entry {
                state: SlotState::Loading,
                unused_prefetch: prefetch,
                waiters: usize::from(!prefetch),
                bytes,
                last_pass,
                rewritten: rewrite,
                guessed: prefetch,
            },
        );
        let mut q = lock(&self.queue);
        let job = Job {
            key,
            buf,
            prefetch,
            rewrite,
        };
        // A guess held back by the limit is taken by the thread whose guess lands next (see `worker`). Waking
        // a thread for it would only have that thread find nothing and sleep again: two context switches on
        // the cores a decode step computes on (~100 per token on `large`, 45% of its guesses).
        let startable = !prefetch || q.guess_may_start();
        if prefetch {
            q.prefetch.push_back(job);
        } else {
            q.demand.push_back(job);
        }
        drop(q);
        if startable {
            self.work.notify_one();
        }
        Ok(())
    }

    /// Makes `layer` the focus of the prefetch order, limits the guesses read at once after a `sparse` fetch
    /// only, and cancels `layer`'s queued prefetches of experts not in `wanted`.
    fn cancel_prefetches(&self, st: &mut State, layer: usize, wanted: &[usize], sparse: bool) {
        let lifted = {
            let mut q = lock(&self.queue);
            q.focus = layer;
            std::mem::replace(&mut q.guesses_limited, sparse) && !sparse
        };
        if lifted {
            // Guesses held back by the limit may be waiting with idle I/O threads.
            self.work.notify_all();
        }
        self.drop_queued_prefetches(st, layer, wanted);
    }

    /// Drops the queued (not yet started) prefetches of `layer` for experts not in `keep`: their entries go,
    /// their slots return to the free list, nothing was read.
    fn drop_queued_prefetches(&self, st: &mut State, layer: usize, keep: &[usize]) {
        self.drop_queued_prefetches_where(st, |key| key.0 == layer && !keep.contains(&key.1));
    }

    /// Drops the queued (not yet started) prefetches whose key `drop` picks, as
    /// [`Inner::drop_queued_prefetches`] does.
    fn drop_queued_prefetches_where(&self, st: &mut State, drop: impl Fn(Key) -> bool) {
        let mut q = lock(&self.queue);
        let mut i = 0;
        let mut freed = false;
        while i < q.prefetch.len() {
            let key = q.prefetch[i].key;
            if !drop(key) {
                i += 1;
                continue;
            }
            if let Some(job) = q.prefetch.remove(i) {
                st.entries.pop(&key);
                st.free.push(job.buf);
                self.counters.prefetch_cancelled.fetch_add(1, Relaxed);
                freed = true;
            }
        }
        if freed {
            // A fetch may be waiting for a slot, which no landing read would now announce.
            self.arrived.notify_all();
        }
    }

    /// Moves a queued prefetch of `key` to the demand queue (it is needed now).
    fn promote(&self, key: Key) {
        let mut q = lock(&self.queue);
        if let Some(i) = q.prefetch.iter().position(|j| j.key == key) {
            if let Some(job) = q.prefetch.remove(i) {
                q.demand.push_back(job);
                drop(q);
                // Idle I/O threads may be waiting only because the guesses' share of them is taken.
                self.work.notify_one();
            }
        }
    }

    /// Says the background pass has ended, to whoever waits in [`ExpertSource::wait_backed`].
    fn mark_backed(&self) {
        let _held = lock(&self.backed_lock);
        self.counters.slots_backed.store(true, Relaxed);
        self.backed_now.notify_all();
    }

    /// Bytes of the slots on huge pages, and of the slots' mapping.
    fn slots_on_huge_pages(&self) -> Option<(u64, u64)> {
        let (addr, len) = self.slot_arena;
        let huge = crate::platform::huge_page_bytes(addr, len)?;
        Some((huge, len as u64))
    }

    /// Backs the slots with memory ahead of the reads that will fill them (see [`Prefault`]).
    fn prefault(&self, pass: &Prefault) {
        /// Says the pass has ended however it ends: a panic in it must not leave `wait_backed` waiting.
        struct Ended<'a>(&'a Inner);
        impl Drop for Ended<'_> {
            fn drop(&mut self) {
                self.0.mark_backed();
            }
        }
        let ended = Ended(self);
        let started = Instant::now();
        // Stops between slots once the engine is dropped; counts its CPU time slot by slot, so a run sees
        // what the pass took from it while it ran.
        let mut cpu = crate::platform::thread_cpu_time();
        let count_cpu = || cpu = add_cpu_since(&self.counters.prefault_cpu_ns, cpu);
        let bytes = pass.run(|| lock(&self.queue).shutdown, count_cpu);
        drop(ended);
        let secs = started.elapsed().as_secs_f64();
        tracing::info!(
            "backed {:.2} GB of expert slots with memory in {secs:.2} s ({:.2} GB/s): reads no longer fault fresh memory in",
            bytes as f64 / 1e9,
            bytes as f64 / 1e9 / secs.max(1e-9)
        );
        // The kernel falls back to 4 KiB pages where it finds no free 2 MiB ones (memory fragmented by the
        // page cache), and direct reads into those ran at half the speed or less on some machines.
        if let Some((huge, all)) = self.slots_on_huge_pages().filter(|_| bytes > 0) {
            let share = huge as f64 / all.max(1) as f64;
            if share < LOW_HUGE_PAGE_SHARE && crate::platform::huge_pages() != Some(crate::platform::HugePages::Never) {
                tracing::warn!(
                    "only {:.0}% of the expert slots are on huge pages ({:.2} of {:.2} GB): reads into the rest may \
                     run at half speed; `echo 1 > /proc/sys/vm/compact_memory` (as root) before starting gives the \
                     kernel whole 2 MiB pages again",
                    100.0 * share,
                    huge as f64 / 1e9,
                    all as f64 / 1e9
                );
            }
        }
    }

    fn worker(&self) {
        // Where a record the table rewrites is read to (page-aligned, as direct reads need; kept between
        // reads: records are megabytes). The rewrite then goes from here into the slot, one pass, where
        // reading into the slot would need a copy out of it first.
        let mut scratch: Option<SlotBuf> = None;
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if q.shutdown {
                        return;
                    }
                    if let Some(j) = q.pop() {
                        q.in_flight += 1;
                        break j;
                    }
                    q = self.work.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let (
                Job {
                    key,
                    mut buf,
                    prefetch,
                    rewrite,
                },
                guess,
            ) = job;
            let started = {
                let mut q = lock(&self.queue);
                let now = Instant::now();
                if q.reading == 0 {
                    q.window = Some((now, now));
                }
                q.reading += 1;
                now
            };
            let cpu = crate::platform::thread_cpu_time();
            // A panic while loading (a bug in a reader or a rewrite) fails this record, not the thread: the
            // fetch waiting for it gets an error instead of waiting forever, and the slot goes back.
            let result = catch_unwind(AssertUnwindSafe(|| self.load(key, &mut buf, &mut scratch, rewrite)))
                .unwrap_or_else(|payload| {
                    let msg = format!(
                        "expert record layer {} expert {}: loading it panicked: {}",
                        key.0,
                        key.1,
                        panic_message(payload.as_ref())
                    );
                    // A payload whose own drop panics must not unwind out of this thread either: its record
                    // would stay loading for good, and the fetch waiting for it with it.
                    let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
                    Err(msg)
                });
            let took = started.elapsed();
            add_cpu_since(&self.counters.read_cpu_ns, cpu);
            {
                let mut q = lock(&self.queue);
                // Ended when the read ended, not when this lock was taken: a busy machine can keep a
                // worker waiting for the lock far longer than the read took.
                let ended = started + took;
                if let Some((first, last)) = &mut q.window {
                    *last = (*last).max(ended);
                    // Counted at every read's end, not when the disk goes idle: under sustained load it never
                    // does, and the depth of a scrape's interval would read 0 (busy time and no active time).
                    let active = last.saturating_duration_since(*first);
                    self.counters
                        .read_active_ns
                        .fetch_add(active.as_nanos() as u64, Relaxed);
                    *first = *last;
                }
                q.in_flight -= 1;
                q.reading -= 1;
                if guess {
                    // This thread pops again right after, so a guess held back by the limit needs no wake-up.
                    q.guesses_reading -= 1;
                }
                if q.reading == 0 {
                    q.window = None;
                }
            }
            let c = &self.counters;
            c.read_busy_ns.fetch_add(took.as_nanos() as u64, Relaxed);
            c.read_latency.observe(took);
            let mut st = lock(&self.state);
            let state = match result {
                Ok(bytes) => {
                    c.reads.fetch_add(1, Relaxed);
                    let counter = if prefetch { &c.prefetch_bytes } else { &c.demand_bytes };
                    counter.fetch_add(bytes as u64, Relaxed);
                    SlotState::Ready(buf)
                }
                Err(msg) => {
                    c.read_errors.fetch_add(1, Relaxed);
                    tracing::warn!("{msg}");
                    st.free.push(buf);
                    SlotState::Failed(msg)
                }
            };
            if let Some(e) = st.entries.peek_mut(&key) {
                e.state = state;
            }
            drop(st);
            self.arrived.notify_all();
        }
    }

    /// Fills `buf` with record `key` (read into `scratch` and rewritten from there by the table's transform
    /// when `rewrite`); returns the bytes read or a message naming the record and file.
    fn load(
        &self,
        key: Key,
        buf: &mut Arc<SlotBuf>,
        scratch: &mut Option<SlotBuf>,
        rewrite: bool,
    ) -> Result<usize, String> {
        let (layer, expert) = key;
        let fail = |what: String| format!("expert record layer {layer} expert {expert}: {what}");
        let layout = self.layout(key).map_err(|e| fail(e.to_string()))?;
        let slot = Arc::get_mut(buf).ok_or_else(|| fail("slot still referenced (engine bug)".into()))?;
        let slot = slot.as_mut_slice();
        let transform = match (rewrite, self.table.transform(), &layout.rewritten) {
            (true, Some(t), Some(to)) => Some((t, to)),
            _ => None,
        };
        let len = layout.slot_len();
        if transform.is_some() && scratch.as_ref().is_none_or(|s| s.as_ref().len() < len) {
            *scratch = SlotBuf::allocate(1, len).and_then(|mut v| v.pop());
        }
        // Reads go to the scratch buffer when the record is rewritten into the slot, else to the slot.
        let (read_to, rewrite_into): (&mut [u8], Option<&mut [u8]>) = match (transform, scratch.as_mut()) {
            (Some(_), Some(s)) => (s.as_mut_slice(), Some(slot)),
            (Some(_), None) => return Err(fail(format!("no memory for a {len}-byte buffer to rewrite it from"))),
            (None, _) => (slot, None),
        };
        let read_one = |r: ReadOp, dst: &mut [u8]| {
            let file = &self.table.files[r.file];
            read_full(file.as_ref(), dst, r.offset, r.needed).map_err(|e| {
                fail(format!(
                    "{}: read of {} bytes at {}: {e}",
                    file.path().display(),
                    r.len,
                    r.offset
                ))
            })
        };
        // Each read's bytes in the slot, in slot order (disjoint, so they can be filled side by side).
        let mut reads = Vec::with_capacity(layout.reads.len());
        let mut order: Vec<&ReadOp> = layout.reads.iter().collect();
        order.sort_by_key(|r| r.slot_offset);
        let (mut rest, mut at): (&mut [u8], usize) = (&mut *read_to, 0);
        for r in order {
            let skip = (r.slot_offset.checked_sub(at)).ok_or_else(|| fail("reads overlap in the slot".into()))?;
            if rest.len() < skip + r.len {
                return Err(fail("record larger than its slot".into()));
            }
            let (dst, tail) = std::mem::take(&mut rest)[skip..].split_at_mut(r.len);
            (rest, at) = (tail, r.slot_offset + r.len);
            let mut dst = dst;
            for piece in r.pieces() {
                let (head, tail) = std::mem::take(&mut dst).split_at_mut(piece.len);
                reads.push((piece, head));
                dst = tail;
            }
        }
        let total = match &self.part_readers {
            Some(pool) if reads.len() > 1 => {
                let mut done: Vec<Result<usize, String>> = vec![Ok(0); reads.len()];
                // The parts this I/O thread runs itself are in its own count of the whole load already.
                let caller = std::thread::current().id();
                let parts = reads.into_iter().zip(done.iter_mut()).map(|((r, dst), out)| {
                    let read_one = &read_one;
                    Box::new(move || {
                        let helper = std::thread::current().id() != caller;
                        let cpu = crate::platform::thread_cpu_time();
                        *out = read_one(r, dst);
                        if helper {
                            add_cpu_since(&self.counters.read_cpu_ns, cpu);
                        }
                    }) as Part<'_>
                });
                pool.run_all(parts.collect());
                done.into_iter().sum::<Result<usize, String>>()?
            }
            _ => (reads.into_iter().map(|(r, dst)| read_one(r, dst))).sum::<Result<usize, String>>()?,
        };
        // Hashed on the record's first read only (see `verified`).
        let first_read = self.verify && layout.checksum.is_some() && !lock(&self.verified).contains(&key);
        if let (true, Some(want), [r]) = (first_read, layout.checksum, layout.reads.as_slice()) {
            #[cfg(test)]
            self.hashed.fetch_add(1, Relaxed);
            let got = xxhash_rust::xxh3::xxh3_64(&read_to[r.slot_offset..r.slot_offset + r.len]);
            if got != want {
                return Err(fail(format!(
                    "{}: checksum mismatch at offset {} (stored {want:016x}, read {got:016x}); the store is corrupt, \
                     run `sluice inspect --verify`",
                    self.table.files[r.file].path().display(),
                    r.offset
                )));
            }
            lock(&self.verified).insert(key);
        }
        if let (Some((t, to)), Some(slot)) = (transform, rewrite_into) {
            t.apply(layer, &read_to[..len], &layout.parts, slot, to).map_err(fail)?;
        }
        Ok(total)
    }

    /// Blocks until a read lands or fails (the caller re-checks what it waits for).
    fn wait_arrival<'a>(&'a self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        #[cfg(test)]
        self.fetch_waits.fetch_add(1, Relaxed);
        self.arrived.wait(st).unwrap_or_else(|e| e.into_inner())
    }

    /// The record in `buf`, as rewritten (`rewritten`) or as read.
    fn record_of(&self, key: Key, buf: &Arc<SlotBuf>, rewritten: bool) -> Result<ExpertRecord, StoreError> {
        let whole = OwnedBytes::new(Arc::clone(buf) as Arc<dyn AsRef<[u8]> + Send + Sync>);
        let layout = self.layout(key)?;
        let places = if rewritten {
            layout.loaded_parts()
        } else {
            &layout.parts
        };
        let parts = (places.iter())
            .map(|&(off, len)| whole.slice(off..off + len))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| StoreError::Engine("record part outside its slot".into()))?;
        Ok(ExpertRecord { parts })
    }
}

/// The text a panic was raised with (its payload, when that is a string).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    (payload.downcast_ref::<&str>().copied())
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-string panic")
}

/// Adds to `counter` the nanoseconds of CPU this thread has used since `since` (its CPU clock then), and
/// returns the clock now; counts nothing where the OS has no per-thread clock.
fn add_cpu_since(
    counter: &std::sync::atomic::AtomicU64,
    since: Option<std::time::Duration>,
) -> Option<std::time::Duration> {
    let now = crate::platform::thread_cpu_time();
    if let (Some(before), Some(after)) = (since, now) {
        counter.fetch_add(after.saturating_sub(before).as_nanos() as u64, Relaxed);
    }
    now
}

/// How long a fetch that finds every slot held by computations looks again before it fails: records are let
/// go of asynchronously on some backends.
const RELEASE_GRACE: Duration = Duration::from_millis(500);

/// What a waiting fetch found for one of its records.
enum Arrival {
    Ready(ExpertRecord),
    Failed(String),
    Lost,
}

/// One layer's requested records, handed out as they become resident.
struct LayerFetch<'a> {
    inner: &'a Inner,
    layer: usize,
    experts: Vec<usize>,
    /// Positions already pinned (hits), served first.
    ready: Vec<(usize, ExpertRecord)>,
    /// Positions whose read is queued or in flight.
    waiting: Vec<usize>,
    /// Positions with no slot yet (the budget is smaller than the layer's working set).
    unsubmitted: VecDeque<usize>,
    /// (position, earlier position asking for the same expert): served with that position's record.
    duplicates: Vec<(usize, usize)>,
    /// Whether the records this fetch reads are rewritten by the table's transform.
    rewrite: bool,
}

impl LayerFetch<'_> {
    /// Queues a copy of `rec`, the record for `pos`, for every later position that asked for it too.
    fn queue_duplicates(&mut self, pos: usize, rec: &ExpertRecord) {
        let mut i = 0;
        while i < self.duplicates.len() {
            if self.duplicates[i].1 == pos {
                let (dup, _) = self.duplicates.swap_remove(i);
                self.ready.push((dup, rec.clone()));
            } else {
                i += 1;
            }
        }
    }

    /// Gives each position without a slot one, in order, while slots can be had. A record that another
    /// fetch or a prefetch has requested meanwhile is shared, never read a second time.
    fn submit_pending(&mut self, st: &mut State) -> Result<(), StoreError> {
        let inner = self.inner;
        while let Some(&pos) = self.unsubmitted.front() {
            let key = (self.layer, self.experts[pos]);
            let mut failed = false;
            if let Some(e) = st.entries.get_mut(&key) {
                match &e.state {
                    SlotState::Ready(b) => {
                        if std::mem::take(&mut e.unused_prefetch) {
                            inner.counters.prefetch_hits.fetch_add(1, Relaxed);
                        }
                        let rec = inner.record_of(key, b, e.rewritten)?;
                        self.unsubmitted.pop_front();
                        self.queue_duplicates(pos, &rec);
                        self.ready.push((pos, rec));
                        continue;
                    }
                    SlotState::Loading => {
                        if std::mem::take(&mut e.unused_prefetch) {
                            inner.counters.prefetch_hits.fetch_add(1, Relaxed);
                        }
                        e.waiters += 1;
                        inner.promote(key);
                        self.unsubmitted.pop_front();
                        self.waiting.push(pos);
                        continue;
                    }
                    SlotState::Failed(_) => failed = true,
                }
            }
            if failed {
                st.entries.pop(&key);
            }
            let Some(buf) = inner.take_slot(st, key, false) else {
                break;
            };
            self.unsubmitted.pop_front();
            inner.submit(st, key, buf, false, self.rewrite)?;
            self.waiting.push(pos);
        }
        Ok(())
    }

    fn wait_next(&mut self) -> Result<(usize, ExpertRecord), StoreError> {
        let inner = self.inner;
        let started = Instant::now();
        let mut all_held_since: Option<Instant> = None;
        let mut st = lock(&inner.state);
        let result = loop {
            self.submit_pending(&mut st)?;
            if let Some(r) = self.ready.pop() {
                break Ok(r);
            }
            let mut found = None;
            for (i, &pos) in self.waiting.iter().enumerate() {
                let key = (self.layer, self.experts[pos]);
                match st
                    .entries
                    .get_mut(&key)
                    .map(|e| (&e.state, &mut e.waiters, e.rewritten, e.guessed))
                {
                    Some((SlotState::Ready(b), waiters, rewritten, _)) => {
                        *waiters = waiters.saturating_sub(1);
                        found = Some((i, Arrival::Ready(inner.record_of(key, b, rewritten)?)));
                        break;
                    }
                    // A guess's read that failed after this fetch asked for it: read again on demand, as
                    // when it failed before (a transient error must not fail the step in one case only).
                    Some((SlotState::Failed(_), _, _, true)) => {
                        found = Some((i, Arrival::Lost));
                        st.entries.pop(&key);
                        break;
                    }
                    Some((SlotState::Failed(msg), _, _, false)) => {
                        found = Some((i, Arrival::Failed(msg.clone())));
                        st.entries.pop(&key);
                        break;
                    }
                    Some((SlotState::Loading, _, _, _)) => {}
                    // Cannot happen (a loading entry is dropped only when no fetch waits for it); request it again
                    // rather than hang.
                    None => {
                        found = Some((i, Arrival::Lost));
                        break;
                    }
                }
            }
            match found {
                Some((i, Arrival::Ready(rec))) => {
                    let pos = self.waiting.swap_remove(i);
                    self.queue_duplicates(pos, &rec);
                    break Ok((pos, rec));
                }
                Some((i, Arrival::Failed(msg))) => {
                    let pos = self.waiting.swap_remove(i);
                    self.duplicates.retain(|&(_, first)| first != pos);
                    break Err(StoreError::Read(msg));
                }
                Some((i, Arrival::Lost)) => {
                    let pos = self.waiting.swap_remove(i);
                    self.unsubmitted.push_back(pos);
                }
                None if self.waiting.is_empty() && !self.unsubmitted.is_empty() => {
                    // No slot and no read of ours to wait for: wait only while some other read (a prefetch,
                    // another fetch's) is still to land, as it may free a slot. Judged from the entries,
                    // which change under this lock when a read lands (the queue's count drops before).
                    let loading = (st.entries.iter()).any(|(_, e)| matches!(e.state, SlotState::Loading));
                    if !loading {
                        // A computation lets go of its records when it is done, with no word to this engine (MLX
                        // releases Metal's hold on a zero-copy slot once its command buffer completes): look
                        // again for a while before calling the cache too small.
                        let since = *all_held_since.get_or_insert_with(Instant::now);
                        if since.elapsed() < RELEASE_GRACE {
                            st = (inner.arrived.wait_timeout(st, Duration::from_millis(1)))
                                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
                            continue;
                        }
                        break Err(StoreError::Engine(format!(
                            "expert cache of {} slots is too small: every slot is held by a computation",
                            inner.slots
                        )));
                    }
                    st = inner.wait_arrival(st);
                }
                None => st = inner.wait_arrival(st),
            }
        };
        inner
            .counters
            .io_wait_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
        result
    }
}

impl Drop for LayerFetch<'_> {
    fn drop(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        // Abandoned (an error, or the caller stopped early): these records may be evicted again. A read no
        // fetch waits for any more is dropped if it has not started (demand reads go first, so it would hold
        // up the next step's and its slot); one under way lands for whoever asks next, who reads it again if
        // it failed, as a guess's (an error of a read nobody waited for must not fail another step).
        let inner = self.inner;
        let mut st = lock(&inner.state);
        let mut q = lock(&inner.queue);
        for &pos in &self.waiting {
            let key = (self.layer, self.experts[pos]);
            let Some(e) = st.entries.peek_mut(&key) else {
                continue;
            };
            e.waiters = e.waiters.saturating_sub(1);
            if e.waiters > 0 || !matches!(e.state, SlotState::Loading) {
                continue;
            }
            e.guessed = true;
            if let Some(i) = q.demand.iter().position(|j| j.key == key) {
                if let Some(job) = q.demand.remove(i) {
                    st.entries.pop(&key);
                    st.free.push(job.buf);
                    // Another fetch may be waiting for a slot, which no landing read would now announce.
                    inner.arrived.notify_all();
                }
            }
        }
    }
}

impl LayerFetch<'_> {
    /// Moves every waiting record that has arrived to `ready` (until it holds `max`), without blocking.
    fn take_arrived(&mut self, max: usize) -> Result<(), StoreError> {
        let inner = self.inner;
        let mut st = lock(&inner.state);
        let mut i = 0;
        while i < self.waiting.len() && self.ready.len() < max {
            let key = (self.layer, self.experts[self.waiting[i]]);
            match st.entries.get_mut(&key) {
                Some(Entry {
                    state: SlotState::Ready(b),
                    waiters,
                    rewritten,
                    ..
                }) => {
                    *waiters = waiters.saturating_sub(1);
                    let rec = inner.record_of(key, b, *rewritten)?;
                    let pos = self.waiting.swap_remove(i);
                    self.queue_duplicates(pos, &rec);
                    self.ready.push((pos, rec));
                }
                _ => i += 1,
            }
        }
        Ok(())
    }
}

impl ExpertFetch for LayerFetch<'_> {
    fn next_ready(&mut self) -> Option<Result<(usize, ExpertRecord), StoreError>> {
        if let Some(r) = self.ready.pop() {
            return Some(Ok(r));
        }
        if self.waiting.is_empty() && self.unsubmitted.is_empty() {
            return None;
        }
        Some(self.wait_next())
    }

    fn next_batch(&mut self, max: usize) -> Option<Result<Vec<(usize, ExpertRecord)>, StoreError>> {
        let max = max.max(1);
        let mut batch = Vec::new();
        if self.ready.is_empty() {
            match self.next_ready()? {
                Ok(r) => batch.push(r),
                Err(e) => return Some(Err(e)),
            }
        }
        if let Err(e) = self.take_arrived(max) {
            return Some(Err(e));
        }
        while batch.len() < max {
            match self.ready.pop() {
                Some(r) => batch.push(r),
                None => break,
            }
        }
        Some(Ok(batch))
    }
}

impl ExpertSource for StreamingSource {
    fn read_expert(&self, layer: usize, expert: usize) -> Result<ExpertRecord, StoreError> {
        let mut f = self.fetch_layer(layer, &[expert])?;
        f.next_ready()
            .ok_or(StoreError::NoRecord { layer, expert })?
            .map(|(_, r)| r)
    }

    fn fetch_layer_rewriting<'a>(
        &'a self,
        layer: usize,
        experts: &[usize],
        rewrite: bool,
    ) -> Result<Box<dyn ExpertFetch + 'a>, StoreError> {
        let inner = &*self.inner;
        for &e in experts {
            inner.layout((layer, e))?;
        }
        let mut f = LayerFetch {
            inner,
            layer,
            experts: experts.to_vec(),
            ready: Vec::new(),
            waiting: Vec::new(),
            unsubmitted: VecDeque::new(),
            duplicates: Vec::new(),
            rewrite,
        };
        let c = &inner.counters;
        let mut st = lock(&inner.state);
        st.rewrite_guesses = rewrite;
        // At most a quarter of the layer's experts: a decode step's fetch, not a prompt chunk's.
        let sparse = experts.len() * 4 <= inner.table.num_experts(layer);
        inner.cancel_prefetches(&mut st, layer, experts, sparse);
        st.entries.begin_fetch(layer, sparse);
        let pass = st.entries.pass;
        // The first position asking for each expert; later ones get a copy of its record (one read, one slot).
        let mut first: HashMap<usize, usize> = HashMap::with_capacity(experts.len());
        for (pos, &e) in experts.iter().enumerate() {
            if let Some(&earlier) = first.get(&e) {
                f.duplicates.push((pos, earlier));
                continue;
            }
            first.insert(e, pos);
            let key = (layer, e);
            let mut failed = false;
            match st.entries.get_mut(&key) {
                Some(entry) => {
                    entry.last_pass = pass;
                    // A guess that was read (or is being read) and is now asked for; one whose read failed
                    // is no hit.
                    let guessed = std::mem::take(&mut entry.unused_prefetch);
                    if guessed && !matches!(entry.state, SlotState::Failed(_)) {
                        c.prefetch_hits.fetch_add(1, Relaxed);
                    }
                    match &entry.state {
                        SlotState::Ready(b) => {
                            let b = Arc::clone(b);
                            c.hits.fetch_add(1, Relaxed);
                            f.ready.push((pos, inner.record_of(key, &b, entry.rewritten)?));
                        }
                        SlotState::Loading => {
                            entry.waiters += 1;
                            c.misses.fetch_add(1, Relaxed);
                            inner.promote(key);
                            f.waiting.push(pos);
                        }
                        SlotState::Failed(_) => failed = true,
                    }
                }
                None => {
                    c.misses.fetch_add(1, Relaxed);
                    f.unsubmitted.push_back(pos);
                }
            }
            if failed {
                // A failed prefetch: forget it and read again on demand.
                st.entries.pop(&key);
                c.misses.fetch_add(1, Relaxed);
                f.unsubmitted.push_back(pos);
            }
        }
        // Hits are handed out in request order (popped from the back), each followed by its duplicates.
        for (pos, rec) in std::mem::take(&mut f.ready).into_iter().rev() {
            f.queue_duplicates(pos, &rec);
            f.ready.push((pos, rec));
        }
        f.submit_pending(&mut st)?;
        Ok(Box::new(f))
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        // The latest guess for a layer replaces the earlier ones still queued.
        inner.drop_queued_prefetches(&mut st, layer, experts);
        for &e in experts {
            let key = (layer, e);
            if inner.table.record(layer, e).is_none() || st.entries.contains(&key) {
                continue;
            }
            let Some(buf) = inner.take_slot(&mut st, key, true) else {
                break;
            };
            let rewrite = st.rewrite_guesses;
            if inner.submit(&mut st, key, buf, true, rewrite).is_ok() {
                inner.counters.prefetch_issued.fetch_add(1, Relaxed);
            }
        }
    }

    fn wait_backed(&self) {
        let inner = &*self.inner;
        let mut held = lock(&inner.backed_lock);
        while !inner.counters.slots_backed.load(Relaxed) {
            held = inner.backed_now.wait(held).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn slots_on_huge_pages(&self) -> Option<(u64, u64)> {
        self.inner.slots_on_huge_pages()
    }

    fn drop_caches(&self) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        // Guesses not started are dropped, and reads under way (the last step's guesses) are waited for: landing
        // after the reset, they would be hits of a run that is meant to start cold.
        inner.drop_queued_prefetches_where(&mut st, |_| true);
        let deadline = Instant::now() + Duration::from_secs(30);
        while (st.entries.iter()).any(|(_, e)| matches!(e.state, SlotState::Loading)) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!("reads still under way after 30 s; the caches are dropped without them");
                break;
            }
            st = (inner.arrived.wait_timeout(st, left.min(Duration::from_millis(20))))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
        // As a fresh process would, the next reads check every record's checksum again.
        lock(&inner.verified).clear();
        let idle: Vec<Key> = (st.entries.iter())
            .filter(|(_, e)| matches!(&e.state, SlotState::Ready(b) if Arc::strong_count(b) == 1 && e.waiters == 0))
            .map(|(k, _)| k)
            .collect();
        for k in idle {
            if let Some(Entry {
                state: SlotState::Ready(b),
                unused_prefetch,
                bytes,
                ..
            }) = st.entries.pop(&k)
            {
                if unused_prefetch {
                    inner.counters.prefetch_wasted.fetch_add(1, Relaxed);
                    inner.counters.prefetch_wasted_bytes.fetch_add(bytes as u64, Relaxed);
                }
                st.free.push(b);
            }
        }
        drop(st);
        for f in &inner.table.files {
            f.drop_os_cache().map_err(|source| StoreError::Io {
                path: f.path().to_path_buf(),
                source,
            })?;
        }
        Ok(())
    }

    fn counters(&self) -> Option<Arc<StoreCounters>> {
        Some(Arc::clone(&self.inner.counters))
    }

    fn slots(&self) -> Option<usize> {
        Some(self.inner.slots)
    }

    fn slot_len(&self) -> Option<usize> {
        Some(self.inner.slot_len)
    }
}

#[cfg(test)]
mod tests;
