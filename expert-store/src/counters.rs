//! What the expert store did: plain atomics that the CLI prints and the server exports.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds (seconds) of the read-latency histogram buckets; the last bucket is unbounded.
pub const LATENCY_BOUNDS: [f64; 14] = [
    50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3, 51.2e-3, 102.4e-3, 204.8e-3,
    409.6e-3,
];

/// A latency histogram with fixed buckets ([`LATENCY_BOUNDS`] plus +Inf).
#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = LATENCY_BOUNDS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(d.as_nanos() as u64, Relaxed);
    }

    /// Its counts and sum now.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            counts: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            sum_seconds: self.sum_ns.load(Relaxed) as f64 * 1e-9,
        }
    }
}

/// A histogram's counts per bucket (not cumulative) and the sum of observations.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct HistogramSnapshot {
    /// Count per bucket: one per [`LATENCY_BOUNDS`] entry, then the overflow bucket.
    pub counts: Vec<u64>,
    /// Sum of all observations in seconds.
    pub sum_seconds: f64,
}

impl HistogramSnapshot {
    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The smallest bucket bound below which at least `q` of the observations fall (seconds).
    pub fn quantile(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen as f64 >= q * total as f64 {
                return LATENCY_BOUNDS.get(i).copied().unwrap_or(f64::INFINITY);
            }
        }
        f64::INFINITY
    }
}

/// Live counters of one expert store; every field only grows.
#[derive(Default)]
pub struct StoreCounters {
    /// Bytes read from disk for records the decode step was waiting for.
    pub demand_bytes: AtomicU64,
    /// Bytes read from disk for predicted records.
    pub prefetch_bytes: AtomicU64,
    /// Record reads completed (demand and prefetch).
    pub reads: AtomicU64,
    /// Record reads that failed (I/O error, short read or checksum mismatch).
    pub read_errors: AtomicU64,
    /// Requests served from a resident slot (including finished prefetches).
    pub hits: AtomicU64,
    /// Requests that had to wait for a read (demand, or a prefetch still in flight).
    pub misses: AtomicU64,
    /// Prefetch reads issued.
    pub prefetch_issued: AtomicU64,
    /// Prefetched records later requested by a decode step.
    pub prefetch_hits: AtomicU64,
    /// Prefetched records evicted (or dropped) without being used.
    pub prefetch_wasted: AtomicU64,
    /// Bytes of those wasted prefetches.
    pub prefetch_wasted_bytes: AtomicU64,
    /// Queued prefetches dropped unread because their layer was fetched without them.
    pub prefetch_cancelled: AtomicU64,
    /// Experts the model guessed decode steps' layers ahead would use (scored guesses, read or not).
    pub guessed: AtomicU64,
    /// Of those, the experts the layers then used.
    pub guessed_used: AtomicU64,
    /// Time decode steps spent blocked on reads (nanoseconds).
    pub io_wait_ns: AtomicU64,
    /// Sum of the durations of all reads (nanoseconds).
    pub read_busy_ns: AtomicU64,
    /// Wall time during which at least one read was in flight (nanoseconds).
    pub read_active_ns: AtomicU64,
    /// CPU time the I/O threads spent loading records: the read calls, faulting fresh slots in, checksums
    /// and rewrites (nanoseconds). On two cores this is time the decode step cannot have.
    pub read_cpu_ns: AtomicU64,
    /// CPU time the background pass spent backing slots with memory ahead of their first read (nanoseconds).
    pub prefault_cpu_ns: AtomicU64,
    /// Latency of each record read (submission to completion of the data).
    pub read_latency: Histogram,
    /// Every slot is backed with memory (the start-up pass has ended, or there was none). Until then reads
    /// may also fault fresh memory in, and run slower.
    pub slots_backed: AtomicBool,
}

impl StoreCounters {
    /// A consistent-enough copy of every counter.
    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            demand_bytes: self.demand_bytes.load(Relaxed),
            prefetch_bytes: self.prefetch_bytes.load(Relaxed),
            reads: self.reads.load(Relaxed),
            read_errors: self.read_errors.load(Relaxed),
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            prefetch_issued: self.prefetch_issued.load(Relaxed),
            prefetch_hits: self.prefetch_hits.load(Relaxed),
            prefetch_wasted: self.prefetch_wasted.load(Relaxed),
            prefetch_wasted_bytes: self.prefetch_wasted_bytes.load(Relaxed),
            prefetch_cancelled: self.prefetch_cancelled.load(Relaxed),
            guessed: self.guessed.load(Relaxed),
            guessed_used: self.guessed_used.load(Relaxed),
            io_wait_seconds: self.io_wait_ns.load(Relaxed) as f64 * 1e-9,
            read_busy_seconds: self.read_busy_ns.load(Relaxed) as f64 * 1e-9,
            read_active_seconds: self.read_active_ns.load(Relaxed) as f64 * 1e-9,
            read_cpu_seconds: self.read_cpu_ns.load(Relaxed) as f64 * 1e-9,
            prefault_cpu_seconds: self.prefault_cpu_ns.load(Relaxed) as f64 * 1e-9,
            read_latency: self.read_latency.snapshot(),
        }
    }
}

/// A copy of [`StoreCounters`] at one moment; subtract two to get the activity in between.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[allow(missing_docs)] // fields mirror `StoreCounters`
pub struct CounterSnapshot {
    pub demand_bytes: u64,
    pub prefetch_bytes: u64,
    pub reads: u64,
    pub read_errors: u64,
    pub hits: u64,
    pub misses: u64,
    pub prefetch_issued: u64,
    pub prefetch_hits: u64,
    pub prefetch_wasted: u64,
    pub prefetch_wasted_bytes: u64,
    pub prefetch_cancelled: u64,
    pub guessed: u64,
    pub guessed_used: u64,
    pub io_wait_seconds: f64,
    pub read_busy_seconds: f64,
    pub read_active_seconds: f64,
    pub read_cpu_seconds: f64,
    pub prefault_cpu_seconds: f64,
    pub read_latency: HistogramSnapshot,
}

impl CounterSnapshot {
    /// The activity between `earlier` and `self` (none for a counter `earlier` shows higher: a snapshot
    /// taken later).
    pub fn since(&self, earlier: &CounterSnapshot) -> CounterSnapshot {
        CounterSnapshot {
            demand_bytes: self.demand_bytes.saturating_sub(earlier.demand_bytes),
            prefetch_bytes: self.prefetch_bytes.saturating_sub(earlier.prefetch_bytes),
            reads: self.reads.saturating_sub(earlier.reads),
            read_errors: self.read_errors.saturating_sub(earlier.read_errors),
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            prefetch_issued: self.prefetch_issued.saturating_sub(earlier.prefetch_issued),
            prefetch_hits: self.prefetch_hits.saturating_sub(earlier.prefetch_hits),
            prefetch_wasted: self.prefetch_wasted.saturating_sub(earlier.prefetch_wasted),
            prefetch_wasted_bytes: self.prefetch_wasted_bytes.saturating_sub(earlier.prefetch_wasted_bytes),
            prefetch_cancelled: self.prefetch_cancelled.saturating_sub(earlier.prefetch_cancelled),
            guessed: self.guessed.saturating_sub(earlier.guessed),
            guessed_used: self.guessed_used.saturating_sub(earlier.guessed_used),
            io_wait_seconds: self.io_wait_seconds - earlier.io_wait_seconds,
            read_busy_seconds: self.read_busy_seconds - earlier.read_busy_seconds,
            read_active_seconds: self.read_active_seconds - earlier.read_active_seconds,
            read_cpu_seconds: self.read_cpu_seconds - earlier.read_cpu_seconds,
            prefault_cpu_seconds: self.prefault_cpu_seconds - earlier.prefault_cpu_seconds,
            read_latency: HistogramSnapshot {
                counts: (self.read_latency.counts.iter())
                    .zip(earlier.read_latency.counts.iter().chain(std::iter::repeat(&0)))
                    .map(|(a, b)| a.saturating_sub(*b))
                    .collect(),
                sum_seconds: self.read_latency.sum_seconds - earlier.read_latency.sum_seconds,
            },
        }
    }

    /// Share of requests served without waiting (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits as f64, (self.hits + self.misses) as f64)
    }

    /// Average number of reads in flight while any was (sum of read time / busy wall time).
    pub fn effective_queue_depth(&self) -> f64 {
        ratio(self.read_busy_seconds, self.read_active_seconds)
    }

    /// Share of issued prefetches that a decode step then used.
    pub fn prefetch_accuracy(&self) -> f64 {
        // Of the guesses read: a queued one dropped unread (its layer fetched without it, a newer guess, a
        // demand read that took its slot) cost nothing and is no miss.
        let read = self.prefetch_issued.saturating_sub(self.prefetch_cancelled);
        ratio(self.prefetch_hits as f64, read as f64)
    }

    /// CPU the I/O threads used per record read, seconds (0 when nothing was read).
    pub fn read_cpu_per_record(&self) -> f64 {
        ratio(self.read_cpu_seconds, self.reads as f64)
    }

    /// Bytes read from disk, demand plus prefetch.
    pub fn bytes_read(&self) -> u64 {
        self.demand_bytes + self.prefetch_bytes
    }

    /// One line for humans.
    pub fn summary(&self) -> String {
        format!(
            "experts: {} hits, {} misses ({:.1}% hit), read {:.1} MB demand + {:.1} MB prefetch, \
             io wait {:.2} s, read p50 {:.2} ms p99 {:.2} ms, queue depth {:.1}, prefetch accuracy {:.0}% \
             ({:.1} MB wasted), CPU {:.2} s loading records + {:.2} s backing slots",
            self.hits,
            self.misses,
            100.0 * self.hit_rate(),
            self.demand_bytes as f64 / 1e6,
            self.prefetch_bytes as f64 / 1e6,
            self.io_wait_seconds,
            self.read_latency.quantile(0.5) * 1e3,
            self.read_latency.quantile(0.99) * 1e3,
            self.effective_queue_depth(),
            100.0 * self.prefetch_accuracy(),
            self.prefetch_wasted_bytes as f64 / 1e6,
            self.read_cpu_seconds,
            self.prefault_cpu_seconds,
        )
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_accuracy_is_over_the_guesses_read() {
        // Ten guesses queued, four dropped unread, three of the six read then used.
        let c = StoreCounters::default();
        c.prefetch_issued.store(10, Relaxed);
        c.prefetch_cancelled.store(4, Relaxed);
        c.prefetch_hits.store(3, Relaxed);
        assert_eq!(c.snapshot().prefetch_accuracy(), 0.5);
        assert_eq!(StoreCounters::default().snapshot().prefetch_accuracy(), 0.0);
    }

    #[test]
    fn histogram_buckets_and_quantiles() {
        let c = StoreCounters::default();
        c.read_latency.observe(Duration::from_micros(30));
        c.read_latency.observe(Duration::from_micros(150));
        c.read_latency.observe(Duration::from_secs(2));
        let s = c.snapshot();
        assert_eq!(s.read_latency.count(), 3);
        assert_eq!(s.read_latency.counts[0], 1);
        assert_eq!(s.read_latency.counts[2], 1);
        assert_eq!(*s.read_latency.counts.last().unwrap(), 1);
        assert_eq!(s.read_latency.quantile(0.5), 200e-6);
        assert!(s.read_latency.quantile(1.0).is_infinite());
        c.hits.fetch_add(3, Relaxed);
        c.misses.fetch_add(1, Relaxed);
        let d = c.snapshot().since(&s);
        assert_eq!((d.hits, d.read_latency.count()), (3, 0));
        assert_eq!(c.snapshot().hit_rate(), 0.75);
    }
}
