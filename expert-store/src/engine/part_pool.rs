//! Threads that run one record's reads side by side, and sleep between records.
//!
//! A record read in place from a checkpoint takes nine reads (one per tensor) and a long packed record one per
//! piece; run one after another they would cost nine latencies (README, "Streaming experts from the SSD",
//! item 1). Until 2026-11-29 a rayon pool ran them. Its idle threads look for work with `sched_yield` for a
//! while before they sleep, and sixteen of them did so after every read, on the two cores the decode step
//! computes on: in a warm `large` run each part thread was switched out involuntarily twice as often as it
//! slept. These threads wait on a condition variable instead, and the thread that asks for a record runs one of
//! its reads itself.

use std::any::Any;
use std::collections::VecDeque;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::lock;

/// One read (or any short job) for the pool, borrowing from the caller of [`PartPool::run_all`].
pub(crate) type Part<'a> = Box<dyn FnOnce() + Send + 'a>;

/// A job as the queue holds it: a [`Part`] whose borrows [`PartPool::run_all`] keeps alive.
type Queued = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of threads that run [`Part`]s handed to [`PartPool::run_all`].
pub(crate) struct PartPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    work: Condvar,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Queued>,
    shutdown: bool,
}

/// What one [`PartPool::run_all`] waits for: its parts still running, and the first panic among them.
#[derive(Default)]
struct Batch {
    state: Mutex<(usize, Option<Box<dyn Any + Send>>)>,
    finished: Condvar,
}

impl PartPool {
    /// Starts up to `threads` threads named `{name}{i}`, stopping at the first the OS refuses; `None` when
    /// none started (the caller then runs its reads one after another, as for a one-read record).
    pub(crate) fn new(threads: usize, name: &str) -> Option<Self> {
        let shared = Arc::new(Shared::default());
        let started: Vec<JoinHandle<()>> = (0..threads)
            .map_while(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("{name}{i}"))
                    .spawn(move || shared.serve())
                    .ok()
            })
            .collect();
        if started.len() < threads {
            tracing::warn!(
                "started {} of {threads} part-read threads: a record's reads run less side by side (with none, one \
                 after another)",
                started.len()
            );
        }
        (!started.is_empty()).then_some(Self {
            shared,
            threads: started,
        })
    }

    /// Runs every part, the first on this thread and the others on the pool's, and returns once all have
    /// finished; the first panic among them is raised here after that. A part must not call `run_all` on the
    /// same pool (with every pool thread waiting inside one, nothing would run the inner parts).
    pub(crate) fn run_all(&self, mut parts: Vec<Part<'_>>) {
        if parts.is_empty() {
            return;
        }
        let mine = parts.remove(0);
        let batch = Arc::new(Batch::default());
        // From here on, leaving this function by any path (a return or an unwind) first waits for every part
        // counted in `batch`: the guarantee the lifetime erasure below rests on.
        let all_finished = WaitForBatch(&batch);
        let handed = parts.len();
        {
            let mut q = lock(&self.shared.queue);
            for part in parts {
                let batch = Arc::clone(&batch);
                // SAFETY: the part borrows only from this call's caller. It is counted in `batch` as it is
                // queued, and `all_finished` (dropped on every path out of this function, unwinding included)
                // blocks until the count is back to 0. The wrapper below lowers the count only after the part
                // has run and been dropped (its panic caught), and touches only the `Arc<Batch>` and the
                // `'static` panic payload afterwards. Pool threads pop every queued job before they stop, and
                // they stop only in `drop`, which cannot run while `self` is borrowed here. So no borrow is
                // used after this call ends, which is all the lifetime erased here promised.
                let part: Queued = unsafe { std::mem::transmute::<Part<'_>, Queued>(part) };
                q.jobs.push_back(Box::new(move || {
                    let panicked = catch_unwind(AssertUnwindSafe(part)).err();
                    let mut st = lock(&batch.state);
                    st.0 -= 1;
                    if st.1.is_none() {
                        st.1 = panicked;
                    }
                    if st.0 == 0 {
                        batch.finished.notify_all();
                    }
                }));
                // Counted once queued (a failed push leaves nothing to wait for), under the queue's lock, so
                // no pool thread can have taken it yet.
                lock(&all_finished.0.state).0 += 1;
            }
        }
        for _ in 0..handed.min(self.threads.len()) {
            self.shared.work.notify_one();
        }
        let own = catch_unwind(AssertUnwindSafe(mine)).err();
        drop(all_finished);
        let theirs = lock(&batch.state).1.take();
        if let Some(payload) = own.or(theirs) {
            resume_unwind(payload);
        }
    }
}

/// Waits, when dropped, until every part counted in its batch has finished.
struct WaitForBatch<'b>(&'b Batch);

impl Drop for WaitForBatch<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.0.state);
        while st.0 > 0 {
            st = self.0.finished.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Shared {
    fn serve(&self) {
        loop {
            let job = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break job;
                    }
                    if q.shutdown {
                        return;
                    }
                    q = self.work.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            // A job catches its part's panic itself; this catches one from dropping a second panic's payload,
            // so no thread of the pool can die and leave queued parts unrun.
            let _ = catch_unwind(AssertUnwindSafe(job));
        }
    }
}

impl Drop for PartPool {
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::time::Duration;

    /// Runs `test` on its own thread and fails if it has not ended within 60 s: a pool that loses a part
    /// hangs rather than fails.
    fn within_a_minute(test: impl FnOnce() + Send + 'static) {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let outcome = catch_unwind(AssertUnwindSafe(test));
            let _ = tx.send(outcome);
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(())) => {}
            Ok(Err(panic)) => resume_unwind(panic),
            Err(_) => panic!("the test did not end within 60 s: a part was never run or never counted"),
        }
    }

    #[test]
    fn every_part_runs_once_and_writes_its_own_slice() {
        within_a_minute(|| {
            let pool = PartPool::new(3, "test-part-").unwrap();
            for round in 0..200usize {
                let mut buf = vec![0u32; 9 * 7];
                let parts: Vec<Part<'_>> = buf
                    .chunks_mut(7)
                    .enumerate()
                    .map(|(i, chunk)| {
                        let add = (round * 100 + i) as u32 + 1;
                        Box::new(move || chunk.iter_mut().for_each(|v| *v += add)) as Part<'_>
                    })
                    .collect();
                pool.run_all(parts);
                for (i, chunk) in buf.chunks(7).enumerate() {
                    assert!(
                        chunk.iter().all(|&v| v == (round * 100 + i) as u32 + 1),
                        "round {round} part {i}"
                    );
                }
            }
        });
    }

    #[test]
    fn callers_on_many_threads_each_wait_for_their_own_parts() {
        within_a_minute(|| {
            let pool = PartPool::new(4, "test-part-").unwrap();
            let ran = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for _ in 0..6 {
                    s.spawn(|| {
                        for _ in 0..100 {
                            let mut seen = [0u8; 5];
                            let parts: Vec<Part<'_>> = seen
                                .iter_mut()
                                .map(|v| {
                                    let ran = &ran;
                                    Box::new(move || {
                                        // Long enough that a caller returning early would see a part unfinished.
                                        std::thread::sleep(Duration::from_micros(200));
                                        *v += 1;
                                        ran.fetch_add(1, SeqCst);
                                    }) as Part<'_>
                                })
                                .collect();
                            pool.run_all(parts);
                            assert_eq!(seen, [1; 5]);
                        }
                    });
                }
            });
            assert_eq!(ran.load(SeqCst), 6 * 100 * 5);
        });
    }

    /// Six parts, part `failing` panics and the others wait and then count themselves: the panic must reach
    /// the caller only after the other five finished, and the pool must serve afterwards.
    fn panic_raised_after_the_others(threads: usize, failing: usize) {
        let pool = PartPool::new(threads, "test-part-").unwrap();
        let finished = AtomicUsize::new(0);
        // The other parts finish only after this instant: well after the failing part's panic (its hook may
        // print a backtrace), so a caller that did not wait for them would see them unfinished.
        let open_at = std::time::Instant::now() + Duration::from_millis(500);
        let result = catch_unwind(AssertUnwindSafe(|| {
            let parts: Vec<Part<'_>> = (0..6)
                .map(|i| {
                    let finished = &finished;
                    Box::new(move || {
                        if i == failing {
                            panic!("part {i} fails");
                        }
                        while std::time::Instant::now() < open_at {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        finished.fetch_add(1, SeqCst);
                    }) as Part<'_>
                })
                .collect();
            pool.run_all(parts);
        }));
        let message = result.expect_err("the panic reaches the caller");
        assert_eq!(
            message.downcast_ref::<String>().map(String::as_str),
            Some(format!("part {failing} fails").as_str())
        );
        assert_eq!(finished.load(SeqCst), 5, "every other part ran to the end first");
        // Every thread of the pool still serves: more parts than threads, each waiting for the others.
        let arrived = std::sync::Barrier::new(threads + 1);
        let parts: Vec<Part<'_>> = (0..=threads)
            .map(|_| {
                let arrived = &arrived;
                Box::new(move || {
                    arrived.wait();
                }) as Part<'_>
            })
            .collect();
        pool.run_all(parts);
    }

    #[test]
    fn a_panicking_part_is_raised_after_the_others_finish() {
        within_a_minute(|| panic_raised_after_the_others(2, 3));
    }

    #[test]
    fn a_panic_in_the_callers_own_part_waits_for_the_others_too() {
        within_a_minute(|| panic_raised_after_the_others(2, 0));
    }

    #[test]
    fn a_pool_of_no_threads_is_none() {
        assert!(PartPool::new(0, "test-part-").is_none());
    }
}
