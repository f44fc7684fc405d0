//! The engine: one thread owns the model and runs one generation at a time, fed by a bounded FIFO queue.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use sluice_runtime::{GenerateParams, GenerationStats, ModelError, Pipeline, Prompt};
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// What a request asks the engine to do.
pub struct Job {
    /// Prompt (text, messages or ids).
    pub prompt: Prompt,
    /// Generation settings.
    pub params: GenerateParams,
    /// Where the engine sends text and the end; dropping the receiver cancels the job.
    pub events: mpsc::UnboundedSender<Event>,
    /// When the request arrived (queue time).
    pub arrived: Instant,
}

/// What the engine reports back for a job.
pub enum Event {
    /// The prompt's token count, once tokenized (before any text).
    Started {
        /// Tokens in the prompt.
        prompt_tokens: usize,
    },
    /// Newly completed text of one token (may be empty while text is held back).
    Text(String),
    /// Finished normally.
    Done(GenerationStats),
    /// Failed.
    Failed(ModelError),
}

/// The HTTP side's handle on the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Job>,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
}

/// Why a job was not queued.
pub enum SubmitError {
    /// The queue is at capacity.
    Full,
    /// The engine thread is gone.
    Stopped,
}

impl EngineHandle {
    /// Starts the engine thread, computing on `threads` (`None`: all cores), with a queue of `capacity` waiting
    /// jobs.
    pub fn start(pipeline: Pipeline, capacity: usize, threads: Option<usize>, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = sync_channel(capacity.max(1));
        let waiting = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let (w, r) = (Arc::clone(&waiting), Arc::clone(&running));
        std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || {
                // The engine thread computes as the first worker of its own pool (see `threads`).
                let _pool = sluice_runtime::threads::join_compute_pool(threads)
                    .map_err(|e| tracing::warn!("compute threads: {e}; kernels run on the global pool"))
                    .ok();
                run(pipeline, rx, w, r, metrics)
            })
            .expect("spawning the engine thread");
        Self { tx, waiting, running }
    }

    /// Queues a job, or says why not.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::Full,
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Jobs waiting in the queue.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Jobs being generated (0 or 1).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }
}

fn run(p: Pipeline, rx: Receiver<Job>, waiting: Arc<AtomicUsize>, running: Arc<AtomicUsize>, m: Arc<Metrics>) {
    while let Ok(job) = rx.recv() {
        waiting.fetch_sub(1, Ordering::SeqCst);
        m.queue_time.observe(job.arrived.elapsed().as_secs_f64());
        // A client that left while queued frees its place without costing a generation.
        if job.events.is_closed() {
            m.cancelled.inc();
            continue;
        }
        running.store(1, Ordering::SeqCst);
        let events = job.events;
        // Each generation starts from a fresh KV cache, so a panic (a bug) fails only its own request: the
        // client gets an error and the thread goes on to the next job instead of taking the model with it.
        // The prompt is checked before `Started`, which commits a streamed reply to a 200.
        let tokenized = || {
            p.tokenize(&job.prompt)
                .and_then(|ids| p.check_prompt(&ids, &job.params).map(|()| ids))
        };
        let result = without_panics(|| match tokenized() {
            Ok(ids) => {
                let _ = events.send(Event::Started {
                    prompt_tokens: ids.len(),
                });
                let chat = matches!(job.prompt, Prompt::Chat(_));
                p.generate_tokens(&ids, chat, &job.params, |text| {
                    // The receiver is dropped when the client disconnects: stop at this token.
                    events.send(Event::Text(text.to_string())).is_ok()
                })
            }
            Err(e) => Err(e),
        });
        running.store(0, Ordering::SeqCst);
        if matches!(&result, Ok(s) if s.finish == sluice_runtime::FinishReason::Cancelled) {
            m.cancelled.inc();
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
