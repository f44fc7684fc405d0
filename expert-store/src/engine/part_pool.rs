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
    /// Starts `threads` threads named `{name}{i}`; fewer when the OS refuses some (with none, parts run on
    /// the caller's thread).
    pub(crate) fn new(threads: usize, name: &str) -> Self {
        let shared = Arc::new(Shared::default());
        let threads = (0..threads)
            .map_while(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("{name}{i}"))
                    .spawn(move || shared.serve())
                    .ok()
            })
            .collect();
        Self { shared, threads }
    }

    /// Runs every part, the first on this thread and the others on the pool's, and returns once all have
    /// finished; a panic in any of them is raised here after that.
    pub(crate) fn run_all(&self, mut parts: Vec<Part<'_>>) {
        if parts.is_empty() {
            return;
        }
        let mine = parts.remove(0);
        if self.threads.is_empty() {
            parts.into_iter().for_each(|p| p());
            return mine();
        }
        let batch = Arc::new(Batch::default());
        lock(&batch.state).0 = parts.len();
        let handed = parts.len();
        {
            let mut q = lock(&self.shared.queue);
            for part in parts {
                let batch = Arc::clone(&batch);
                // SAFETY: the part borrows only from this call's caller, and this function neither returns nor
                // unwinds before `batch` counts every queued part as finished (the loop below); the queue is
                // drained only by the pool's threads, which stop only in `drop`, which cannot run while `self`
                // is borrowed here, and each runs its job to the end (panics caught). So no borrow is used
                // after it ends, which is all the lifetime erased here promised.
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
            }
        }
        for _ in 0..handed.min(self.threads.len()) {
            self.shared.work.notify_one();
        }
        let own = catch_unwind(AssertUnwindSafe(mine)).err();
        let mut st = lock(&batch.state);
        while st.0 > 0 {
            st = batch.finished.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(payload) = own.or_else(|| st.1.take()) {
            drop(st);
            resume_unwind(payload);
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
            job();
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

    #[test]
    fn every_part_runs_once_and_writes_its_own_slice() {
        let pool = PartPool::new(3, "test-part-");
        for round in 0..200usize {
            let mut buf = vec![0u32; 9 * 7];
            let parts: Vec<Part<'_>> = buf
                .chunks_mut(7)
                .enumerate()
                .map(|(i, chunk)| {
                    Box::new(move || chunk.iter_mut().for_each(|v| *v += (round * 100 + i) as u32 + 1)) as Part<'_>
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
    }

    #[test]
    fn callers_on_many_threads_each_wait_for_their_own_parts() {
        let pool = PartPool::new(4, "test-part-");
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
    }

    #[test]
    fn a_panicking_part_is_raised_after_the_others_finish() {
        let pool = PartPool::new(2, "test-part-");
        let finished = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            let parts: Vec<Part<'_>> = (0..6)
                .map(|i| {
                    let finished = &finished;
                    Box::new(move || {
                        if i == 3 {
                            panic!("part 3 fails");
                        }
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        finished.fetch_add(1, SeqCst);
                    }) as Part<'_>
                })
                .collect();
            pool.run_all(parts);
        }));
        assert!(result.is_err(), "the panic reaches the caller");
        assert_eq!(finished.load(SeqCst), 5, "every other part ran to the end first");
        // The pool still serves.
        let mut x = 0;
        pool.run_all(vec![Box::new(|| x = 1), Box::new(|| {})]);
        assert_eq!(x, 1);
    }

    #[test]
    fn a_pool_without_threads_runs_parts_on_the_caller() {
        let pool = PartPool::new(0, "test-part-");
        let mut v = [0; 3];
        let parts: Vec<Part<'_>> = v.iter_mut().map(|x| Box::new(move || *x = 7) as Part<'_>).collect();
        pool.run_all(parts);
        assert_eq!(v, [7; 3]);
    }
}
