//! The engine: one thread owns the model and runs one generation at a time, fed by a bounded FIFO queue.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use sluice_runtime::{GenerateParams, GenerationStats, ModelError, Pipeline, Progress};
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// What a request asks the engine to do.
pub struct Job {
    /// The prompt's token ids (tokenized and checked by the handler).
    pub ids: Vec<u32>,
    /// Whether the prompt was rendered from messages (the reply then starts on its own).
    pub chat: bool,
    /// Generation settings.
    pub params: GenerateParams,
    /// Where the engine sends text and the end; dropping the receiver cancels the job.
    pub events: mpsc::UnboundedSender<Event>,
    /// When the request arrived (the reply's latencies count from it).
    pub arrived: Instant,
    /// When it was queued, its prompt tokenized and checked (the queue time counts from it).
    pub queued: Instant,
}

/// What the engine reports back for a job.
pub enum Event {
    /// A generated token's newly completed text (may be empty while text is held back).
    Text(String),
    /// Text held back until the last token, sent after it.
    Tail(String),
    /// Finished normally.
    Done(GenerationStats),
    /// Failed.
    Failed(ModelError),
}

/// The HTTP side's handle on the engine.
#[derive(Clone)]
pub struct EngineHandle {
    queue: Arc<Queue>,
    running: Arc<AtomicUsize>,
    /// Dropped with the last handle: the engine thread then ends once the queue is empty.
    _open: Arc<Open>,
}

/// Why a job was not queued.
pub enum SubmitError {
    /// The queue is at capacity.
    Full,
    /// The engine thread is gone.
    Stopped,
}

/// The jobs waiting for the engine, in arrival order. A plain channel could not drop a job whose client has
/// left: it would hold its place until the engine reached it, and a queue of such jobs turns live requests away.
struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
    capacity: usize,
    metrics: Arc<Metrics>,
}

struct QueueState {
    jobs: VecDeque<Job>,
    /// No handle is left to submit.
    closed: bool,
    /// The engine thread has ended.
    stopped: bool,
}

impl Queue {
    /// An empty queue of `capacity` places (at least one).
    fn new(capacity: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Queue {
            state: Mutex::new(QueueState {
                jobs: VecDeque::new(),
                closed: false,
                stopped: false,
            }),
            ready: Condvar::new(),
            capacity: capacity.max(1),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the jobs whose clients have left (each counted cancelled).
    fn purge(&self, st: &mut QueueState) {
        let before = st.jobs.len();
        st.jobs.retain(|j| !j.events.is_closed());
        for _ in st.jobs.len()..before {
            self.metrics.cancelled.inc();
        }
    }

    /// Queues a job, or says why not.
    fn push(&self, job: Job) -> Result<(), SubmitError> {
        let mut st = self.lock();
        if st.stopped {
            return Err(SubmitError::Stopped);
        }
        self.purge(&mut st);
        if st.jobs.len() >= self.capacity {
            return Err(SubmitError::Full);
        }
        st.jobs.push_back(job);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job to run, waiting for one; `None` once no handle is left and the queue is empty.
    fn next(&self) -> Option<Job> {
        let mut st = self.lock();
        loop {
            self.purge(&mut st);
            if let Some(job) = st.jobs.pop_front() {
                return Some(job);
            }
            if st.closed {
                return None;
            }
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Marks the queue closed when the last handle goes.
struct Open(Arc<Queue>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.ready.notify_all();
    }
}

/// Marks the queue stopped when the engine thread ends, however it ends.
struct Stopped(Arc<Queue>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.stopped = true;
        st.jobs.clear();
    }
}

impl EngineHandle {
    /// Starts the engine thread, computing on `threads` (`None`: all cores), with a queue of `capacity` waiting
    /// jobs.
    pub fn start(pipeline: Pipeline, capacity: usize, threads: Option<usize>, metrics: Arc<Metrics>) -> Self {
        let queue = Queue::new(capacity, Arc::clone(&metrics));
        let running = Arc::new(AtomicUsize::new(0));
        let (q, r) = (Arc::clone(&queue), Arc::clone(&running));
        std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || {
                let _stopped = Stopped(Arc::clone(&q));
                // The engine thread computes as the first worker of its own pool (see `threads`).
                let _pool = sluice_runtime::threads::join_compute_pool(threads)
                    .map_err(|e| tracing::warn!("compute threads: {e}; kernels run on the global pool"))
                    .ok();
                run(pipeline, &q, r, metrics)
            })
            .expect("spawning the engine thread");
        Self {
            _open: Arc::new(Open(Arc::clone(&queue))),
            queue,
            running,
        }
    }

    /// A handle on a queue no engine takes jobs from (tests of what is answered before the engine).
    #[cfg(test)]
    pub(crate) fn idle(capacity: usize, metrics: Arc<Metrics>) -> Self {
        let queue = Queue::new(capacity, metrics);
        Self {
            _open: Arc::new(Open(Arc::clone(&queue))),
            queue,
            running: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Queues a job, or says why not. Jobs whose clients have left give up their places first.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.queue.push(job)
    }

    /// Jobs waiting in the queue (those whose clients have left are dropped first).
    pub fn waiting(&self) -> usize {
        let mut st = self.queue.lock();
        self.queue.purge(&mut st);
        st.jobs.len()
    }

    /// Whether the engine thread has ended (no request can be served any more).
    pub fn stopped(&self) -> bool {
        self.queue.lock().stopped
    }

    /// Whether the queue holds as many jobs as it may (a request now would get a 429).
    pub fn full(&self) -> bool {
        self.waiting() >= self.queue.capacity
    }

    /// Jobs being generated (0 or 1).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }
}

fn run(p: Pipeline, queue: &Queue, running: Arc<AtomicUsize>, m: Arc<Metrics>) {
    while let Some(job) = queue.next() {
        m.queue_time.observe(job.queued.elapsed().as_secs_f64());
        running.store(1, Ordering::SeqCst);
        let events = job.events;
        // Each generation starts from a fresh KV cache, so a panic (a bug) fails only its own request: the
        // client gets an error and the thread goes on to the next job instead of taking the model with it.
        // The handler checked the prompt against the same limits; checked again, as a job's own guard.
        let mut started = false;
        let (ids, chat) = (&job.ids, job.chat);
        let result = without_panics(|| match p.check_prompt(ids, &job.params) {
            Ok(()) => {
                started = true;
                // The receiver is dropped when the client disconnects: stop at this token or prompt chunk.
                p.generate_tokens(ids, chat, &job.params, |progress| match progress {
                    Progress::Prefill => !events.is_closed(),
                    Progress::Token(text) => events.send(Event::Text(text.to_string())).is_ok(),
                    Progress::Tail(text) => events.send(Event::Tail(text.to_string())).is_ok(),
                })
            }
            Err(e) => Err(e),
        });
        running.store(0, Ordering::SeqCst);
        // Every generation the engine started counts here, also one whose client left or that failed: counted
        // where the reply is written, those would be missing from the tokens and, the slowest, from the latency.
        // A prompt refused before it started (a 400) is not a generation's latency.
        if started {
            m.e2e.observe(job.arrived.elapsed().as_secs_f64());
        }
        if let Ok(stats) = &result {
            m.record_generation(stats);
            if stats.finish == sluice_runtime::FinishReason::Cancelled {
                m.cancelled.inc();
            }
        }
        let _ = events.send(match result {
            Ok(stats) => Event::Done(stats),
            Err(e) => Event::Failed(e),
        });
    }
}

/// `job()`, with a panic turned into [`ModelError::Internal`] (and logged).
fn without_panics<T>(job: impl FnOnce() -> Result<T, ModelError>) -> Result<T, ModelError> {
    catch_unwind(AssertUnwindSafe(job)).unwrap_or_else(|payload| {
        let what = expert_store::panic_message(payload.as_ref());
        tracing::error!("a generation panicked: {what}; its request failed, the engine goes on");
        Err(ModelError::Internal(format!("the generation panicked: {what}")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job and the receiver its client holds.
    fn job(text: &str) -> (Job, mpsc::UnboundedReceiver<Event>) {
        let (events, rx) = mpsc::unbounded_channel();
        let job = Job {
            ids: text.bytes().map(u32::from).collect(),
            chat: false,
            params: GenerateParams::default(),
            events,
            arrived: Instant::now(),
            queued: Instant::now(),
        };
        (job, rx)
    }

    #[test]
    fn a_client_that_leaves_while_queued_gives_up_its_place() {
        let q = Queue::new(1, Metrics::new(4, None, 0));
        let (b, b_rx) = job("b");
        assert!(q.push(b).is_ok());
        let (c, _c_rx) = job("c");
        assert!(matches!(q.push(c), Err(SubmitError::Full)), "the queue of one is full");
        // B's client leaves: C takes its place, and the engine gets C, not B.
        drop(b_rx);
        let (c, _c_rx) = job("c");
        assert!(q.push(c).is_ok());
        let next = q.next().expect("a job");
        assert_eq!(next.ids, [u32::from(b'c')]);
        assert_eq!(q.metrics.cancelled.get(), 1);
        // Once no handle is left and nothing waits, the engine's loop ends.
        drop(Open(Arc::clone(&q)));
        assert!(q.next().is_none());
        // An engine that is gone takes no more jobs.
        drop(Stopped(Arc::clone(&q)));
        assert!(matches!(q.push(job("d").0), Err(SubmitError::Stopped)));
    }

    /// A long prompt's chunks are not tokens: the client hears of each generated token once (so the first token's
    /// time is that of the first token, not of the prompt's first chunk), and nothing before.
    #[test]
    fn a_long_prompt_sends_one_event_per_generated_token() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3_moe-q4g64");
        let pipeline = Pipeline::load(&dir).unwrap();
        let engine = EngineHandle::start(pipeline, 1, Some(1), Metrics::new(4, None, 0));
        let (mut job, mut rx) = job("");
        job.ids = (1..=40).collect();
        job.params.max_tokens = 3;
        job.params.prefill_chunk = Some(8);
        assert!(engine.submit(job).is_ok());
        let mut tokens = 0;
        let stats = loop {
            match rx.blocking_recv().expect("the engine ended the job") {
                Event::Text(_) => tokens += 1,
                Event::Tail(_) => {}
                Event::Done(stats) => break stats,
                Event::Failed(e) => panic!("{e}"),
            }
        };
        assert_eq!((tokens, stats.generated_tokens, stats.prompt_tokens), (3, 3, 40));
    }

    #[test]
    fn a_panicking_job_becomes_an_internal_error() {
        let err = without_panics::<()>(|| panic!("index out of bounds")).unwrap_err();
        assert!(
            matches!(&err, ModelError::Internal(m) if m.contains("index out of bounds")),
            "{err}"
        );
        let owned = without_panics::<()>(|| panic!("{} tokens", 3)).unwrap_err().to_string();
        assert!(owned.contains("3 tokens"), "{owned}");
        assert_eq!(without_panics(|| Ok(7)).unwrap(), 7);
    }
}
