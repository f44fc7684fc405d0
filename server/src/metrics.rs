//! The Prometheus registry: request, latency and token metrics, plus the expert store's counters.

use std::sync::{Arc, Mutex};

use expert_store::{CounterSnapshot, StoreCounters, LATENCY_BOUNDS};
use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, Bucket, Metric, MetricFamily, MetricType};
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// Every metric sluice exports.
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint and HTTP status.
    pub requests: IntCounterVec,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens.
    pub itl: Histogram,
    /// Request latency, arrival to last byte.
    pub e2e: Histogram,
    /// Time spent waiting in the queue.
    pub queue_time: Histogram,
    /// Prefill speed per request.
    pub prompt_tps: Histogram,
    /// Decode speed per request.
    pub gen_tps: Histogram,
    /// Prompt tokens processed.
    pub prompt_tokens: IntCounter,
    /// Tokens generated.
    pub gen_tokens: IntCounter,
    /// Generations stopped because the client went away.
    pub cancelled: IntCounter,
    queue_len: IntGauge,
    running: IntGauge,
    top_k: IntGauge,
    rss: IntGauge,
    cache_bytes: IntGauge,
    store: Option<StoreMetrics>,
}

/// The expert store's counters as Prometheus series, advanced from snapshots at scrape time.
struct StoreMetrics {
    source: Arc<StoreCounters>,
    last: Mutex<CounterSnapshot>,
    bytes: IntCounterVec,
    hits: IntCounter,
    misses: IntCounter,
    prefetch_issued: IntCounter,
    prefetch_hits: IntCounter,
    prefetch_wasted_bytes: IntCounter,
    prefetch_cancelled: IntCounter,
    guessed: IntCounter,
    guessed_used: IntCounter,
    read_errors: IntCounter,
    io_wait: prometheus::Counter,
    read_cpu: prometheus::Counter,
    prefault_cpu: prometheus::Counter,
    depth: Gauge,
    slots_backed: IntGauge,
}

fn hist(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid histogram")
}

fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid counter")
}

fn gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("valid gauge")
}

/// Latency buckets from 1 ms (a small model's tokens at several hundred a second) to 5 minutes.
fn seconds() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    ]
}

impl Metrics {
    /// Counts a generation's tokens and speeds, however it ended (the engine calls it: a client that left
    /// mid-stream never reads the end).
    pub fn record_generation(&self, stats: &sluice_runtime::GenerationStats) {
        self.prompt_tokens.inc_by(stats.prompt_tokens as u64);
        self.gen_tokens.inc_by(stats.generated_tokens as u64);
        if !stats.prefill_time.is_zero() {
            self.prompt_tps
                .observe(stats.prompt_tokens as f64 / stats.prefill_time.as_secs_f64());
        }
        if !stats.decode_time.is_zero() && stats.decode_steps > 0 {
            self.gen_tps
                .observe(stats.decode_steps as f64 / stats.decode_time.as_secs_f64());
        }
    }

    /// Registers every metric; `store` adds the expert-store series, `cache_bytes` the slot budget.
    pub fn new(top_k: usize, store: Option<Arc<StoreCounters>>, cache_bytes: u64) -> Arc<Self> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("sluice_requests_total", "HTTP requests by endpoint and status"),
            &["endpoint", "status"],
        )
        .expect("valid counter");
        // Up to 10k tokens a second: prefill of a prompt's chunk runs well past 1000 on small models.
        let tps = vec![
            0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
        ];
        let m = Metrics {
            requests,
            ttft: hist(
                "sluice_time_to_first_token_seconds",
                "Time from arrival to the first token",
                seconds(),
            ),
            itl: hist(
                "sluice_inter_token_latency_seconds",
                "Time between consecutive tokens",
                seconds(),
            ),
            e2e: hist(
                "sluice_e2e_request_latency_seconds",
                "Time from arrival to the end of the response",
                seconds(),
            ),
            queue_time: hist(
                "sluice_request_queue_time_seconds",
                "Time a request waited in the queue",
                seconds(),
            ),
            prompt_tps: hist(
                "sluice_prompt_tokens_per_second",
                "Prefill speed of each request",
                tps.clone(),
            ),
            gen_tps: hist(
                "sluice_generation_tokens_per_second",
                "Decode speed of each request",
                tps,
            ),
            prompt_tokens: counter("sluice_prompt_tokens_total", "Prompt tokens processed"),
            gen_tokens: counter("sluice_generation_tokens_total", "Tokens generated"),
            cancelled: counter(
                "sluice_requests_cancelled_total",
                "Generations stopped because the client left",
            ),
            queue_len: gauge("sluice_queue_length", "Requests waiting for the engine"),
            running: gauge("sluice_requests_running", "Requests being generated"),
            top_k: gauge(
                "sluice_expert_top_k",
                "Experts per token the server runs with (upper bound for requests)",
            ),
            rss: gauge("sluice_resident_memory_bytes", "Resident set size of the process"),
            cache_bytes: gauge("sluice_expert_cache_bytes", "Bytes of expert slot cache"),
            store: store.map(|source| StoreMetrics {
                last: Mutex::new(source.snapshot()),
                source,
                bytes: IntCounterVec::new(
                    Opts::new("sluice_expert_read_bytes_total", "Expert bytes read from disk"),
                    &["kind"],
                )
                .expect("valid counter"),
                hits: counter(
                    "sluice_expert_cache_hits_total",
                    "Expert requests served from a resident slot",
                ),
                misses: counter(
                    "sluice_expert_cache_misses_total",
                    "Expert requests that waited for a read",
                ),
                prefetch_issued: counter(
                    "sluice_expert_prefetch_issued_total",
                    "Prefetch reads queued (those later dropped unread are also in prefetch_cancelled)",
                ),
                prefetch_hits: counter("sluice_expert_prefetch_hits_total", "Prefetched records later used"),
                prefetch_wasted_bytes: counter(
                    "sluice_expert_prefetch_wasted_bytes_total",
                    "Bytes of prefetched records evicted unused",
                ),
                prefetch_cancelled: counter(
                    "sluice_expert_prefetch_cancelled_total",
                    "Queued prefetches dropped unread: their layer was fetched without them, a newer guess replaced \
                     them, or a demand read took their slot",
                ),
                guessed: counter(
                    "sluice_expert_guessed_total",
                    "Experts guessed for decode steps' layers ahead (read or not)",
                ),
                guessed_used: counter(
                    "sluice_expert_guessed_used_total",
                    "Guessed experts the layers then used (guess precision = rate of this / rate of guessed)",
                ),
                read_errors: counter("sluice_expert_read_errors_total", "Expert reads that failed"),
                io_wait: prometheus::Counter::new(
                    "sluice_expert_io_wait_seconds_total",
                    "Time decode steps waited for expert reads",
                )
                .expect("valid counter"),
                read_cpu: prometheus::Counter::new(
                    "sluice_expert_read_cpu_seconds_total",
                    "CPU time the I/O threads spent loading expert records (read calls, first touch, checksums, rewrites)",
                )
                .expect("valid counter"),
                prefault_cpu: prometheus::Counter::new(
                    "sluice_expert_prefault_cpu_seconds_total",
                    "CPU time spent backing expert cache slots with memory ahead of their first read",
                )
                .expect("valid counter"),
                depth: Gauge::new(
                    "sluice_expert_read_queue_depth",
                    "Expert reads in flight on average while any was, since the previous scrape",
                )
                    .expect("valid gauge"),
                slots_backed: gauge(
                    "sluice_expert_slots_backed",
                    "1 once every expert cache slot is backed with memory; until then reads also fault memory in",
                ),
            }),
            registry,
        };
        m.top_k.set(top_k as i64);
        m.cache_bytes.set(cache_bytes as i64);
        let r = &m.registry;
        let all: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.requests.clone()),
            Box::new(m.ttft.clone()),
            Box::new(m.itl.clone()),
            Box::new(m.e2e.clone()),
            Box::new(m.queue_time.clone()),
            Box::new(m.prompt_tps.clone()),
            Box::new(m.gen_tps.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.gen_tokens.clone()),
            Box::new(m.cancelled.clone()),
            Box::new(m.queue_len.clone()),
            Box::new(m.running.clone()),
            Box::new(m.top_k.clone()),
            Box::new(m.rss.clone()),
            Box::new(m.cache_bytes.clone()),
        ];
        for c in all {
            r.register(c).expect("unique metric names");
        }
        if let Some(s) = &m.store {
            let all: Vec<Box<dyn prometheus::core::Collector>> = vec![
                Box::new(s.bytes.clone()),
                Box::new(s.hits.clone()),
                Box::new(s.misses.clone()),
                Box::new(s.prefetch_issued.clone()),
                Box::new(s.prefetch_hits.clone()),
                Box::new(s.prefetch_wasted_bytes.clone()),
                Box::new(s.prefetch_cancelled.clone()),
                Box::new(s.guessed.clone()),
                Box::new(s.guessed_used.clone()),
                Box::new(s.read_errors.clone()),
                Box::new(s.io_wait.clone()),
                Box::new(s.read_cpu.clone()),
                Box::new(s.prefault_cpu.clone()),
                Box::new(ReadLatency::new(s.source.clone())),
                Box::new(s.depth.clone()),
                Box::new(s.slots_backed.clone()),
            ];
            for c in all {
                r.register(c).expect("unique metric names");
            }
        }
        Arc::new(m)
    }

    /// The text exposition, after bringing gauges and store counters up to date.
    pub fn render(&self, waiting: usize, running: usize) -> String {
        self.queue_len.set(waiting as i64);
        self.running.set(running as i64);
        if let Some(rss) = expert_store::platform::resident_bytes() {
            self.rss.set(rss as i64);
        }
        if let Some(s) = &self.store {
            s.advance();
        }
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Whether every expert cache slot is backed with memory (`None`: experts do not go through a store).
    pub fn slots_backed(&self) -> Option<bool> {
        self.store.as_ref().map(StoreMetrics::backed)
    }
}

impl StoreMetrics {
    /// Whether the store's slots are all backed with memory.
    fn backed(&self) -> bool {
        self.source.slots_backed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Adds what the store did since the last scrape.
    fn advance(&self) {
        // The snapshot is taken under the lock: two scrapes at once would otherwise each subtract the other's
        // later snapshot from their earlier one.
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.source.snapshot();
        let d = now.since(&last);
        self.bytes.with_label_values(&["demand"]).inc_by(d.demand_bytes);
        self.bytes.with_label_values(&["prefetch"]).inc_by(d.prefetch_bytes);
        self.hits.inc_by(d.hits);
        self.misses.inc_by(d.misses);
        self.prefetch_issued.inc_by(d.prefetch_issued);
        self.prefetch_hits.inc_by(d.prefetch_hits);
        self.prefetch_wasted_bytes.inc_by(d.prefetch_wasted_bytes);
        self.prefetch_cancelled.inc_by(d.prefetch_cancelled);
        self.guessed.inc_by(d.guessed);
        self.guessed_used.inc_by(d.guessed_used);
        self.read_errors.inc_by(d.read_errors);
        self.io_wait.inc_by(d.io_wait_seconds.max(0.0));
        self.read_cpu.inc_by(d.read_cpu_seconds.max(0.0));
        self.prefault_cpu.inc_by(d.prefault_cpu_seconds.max(0.0));
        // Over the interval: the average since start would hardly move after a few hours of serving.
        self.depth.set(d.effective_queue_depth());
        self.slots_backed.set(i64::from(self.backed()));
        *last = now;
    }
}

/// The store's read-latency histogram exported as it stands: its own buckets and the true sum of the
/// latencies, so `_sum / _count` is the mean read time.
struct ReadLatency {
    desc: Desc,
    source: Arc<StoreCounters>,
}

impl ReadLatency {
    fn new(source: Arc<StoreCounters>) -> Self {
        let desc = Desc::new(
            "sluice_expert_read_latency_seconds".into(),
            "Latency of one expert record read".into(),
            Vec::new(),
            Default::default(),
        )
        .expect("valid histogram");
        ReadLatency { desc, source }
    }
}

impl Collector for ReadLatency {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let snap = self.source.read_latency.snapshot();
        let mut cumulative = 0;
        let buckets = (LATENCY_BOUNDS.iter().zip(&snap.counts))
            .map(|(&bound, &n)| {
                cumulative += n;
                let mut b = Bucket::default();
                b.set_upper_bound(bound);
                b.set_cumulative_count(cumulative);
                b
            })
            .collect();
        let mut h = proto::Histogram::default();
        h.set_bucket(buckets);
        // The count includes the overflow bucket, which the encoder writes as `le="+Inf"`.
        h.set_sample_count(snap.count());
        h.set_sample_sum(snap.sum_seconds);
        let mut m = Metric::default();
        m.set_histogram(h);
        let mut f = MetricFamily::default();
        f.set_name(self.desc.fq_name.clone());
        f.set_help(self.desc.help.clone());
        f.set_field_type(MetricType::HISTOGRAM);
        f.set_metric(vec![m]);
        vec![f]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use super::*;

    /// The counter `name`'s value in a rendered page.
    fn value(page: &str, name: &str) -> f64 {
        (page.lines())
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in the page"))
    }

    #[test]
    fn scrapes_at_once_add_what_the_store_did_once() {
        let counters = Arc::new(StoreCounters::default());
        let metrics = Metrics::new(4, Some(counters.clone()), 0);
        let done = std::sync::atomic::AtomicBool::new(false);
        let reads = std::thread::scope(|s| {
            let store = s.spawn(|| {
                // Reads at a pace a disk could keep, while four scrapers render as fast as they can.
                for _ in 0..20_000 {
                    counters.hits.fetch_add(1, Ordering::Relaxed);
                    counters.read_latency.observe(Duration::from_micros(100));
                    std::thread::yield_now();
                }
                done.store(true, Ordering::Relaxed);
                20_000u64
            });
            let scrapers: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        while !done.load(Ordering::Relaxed) {
                            metrics.render(0, 0);
                        }
                    })
                })
                .collect();
            for t in scrapers {
                t.join().expect("a scrape panicked");
            }
            store.join().expect("the store's thread")
        });
        let page = metrics.render(0, 0);
        assert_eq!(
            value(&page, "sluice_expert_cache_hits_total"),
            counters.hits.load(Ordering::Relaxed) as f64
        );
        assert_eq!(value(&page, "sluice_expert_read_latency_seconds_count"), reads as f64);
    }

    #[test]
    fn read_latency_is_exported_with_its_true_sum() {
        let counters = Arc::new(StoreCounters::default());
        let metrics = Metrics::new(4, Some(counters.clone()), 0);
        // One read in the first bucket, one in the third, one past the last bound.
        for us in [30, 150, 1_000_000] {
            counters.read_latency.observe(Duration::from_micros(us));
        }
        let page = metrics.render(0, 0);
        let name = "sluice_expert_read_latency_seconds";
        assert_eq!(value(&page, &format!("{name}_count")), 3.0);
        // Replayed at bucket bounds, the sum was 0.00005 + 0.0002 + 1.0.
        let sum = value(&page, &format!("{name}_sum"));
        assert!((sum - 1.000180).abs() < 1e-9, "{sum}");
        let bucket = |le: &str| value(&page, &format!("{name}_bucket{{le=\"{le}\"}}"));
        assert_eq!(bucket("0.00005"), 1.0);
        assert_eq!(bucket("0.0001"), 1.0);
        assert_eq!(bucket("0.0002"), 2.0);
        assert_eq!(bucket("0.4096"), 2.0);
        assert_eq!(bucket("+Inf"), 3.0);
        assert_eq!(page.matches(&format!("# TYPE {name} histogram")).count(), 1);
    }

    #[test]
    fn the_read_depth_gauge_is_that_of_the_last_interval() {
        let counters = Arc::new(StoreCounters::default());
        let metrics = Metrics::new(4, Some(counters.clone()), 0);
        let read = |busy_ms: u64, active_ms: u64| {
            counters.read_busy_ns.fetch_add(busy_ms * 1_000_000, Ordering::Relaxed);
            counters
                .read_active_ns
                .fetch_add(active_ms * 1_000_000, Ordering::Relaxed);
        };
        let depth = || value(&metrics.render(0, 0), "sluice_expert_read_queue_depth");
        // An hour at depth 1, then a minute at depth 8: the gauge says 8, not the average since start (1.1).
        read(3_600_000, 3_600_000);
        assert!((depth() - 1.0).abs() < 1e-9);
        read(480_000, 60_000);
        let d = depth();
        assert!((d - 8.0).abs() < 1e-9, "{d}");
        // No reads since: none in flight.
        assert_eq!(depth(), 0.0);
    }
}
