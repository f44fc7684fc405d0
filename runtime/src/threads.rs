//! The compute thread pool, joined by the thread that runs the model.
//!
//! A parallel kernel called from a thread outside rayon's pool is handed to a pool thread, and the caller
//! sleeps on a lock until it returns. On a 2-vCPU VM that hand-off and wake-up cost ~10 µs per call, more than
//! a 512-row matrix takes on one core, and a decode step makes ~200 such calls. A thread that is itself worker
//! 0 of the pool splits the work in place: it keeps half and the other workers steal the rest.
//!
//! Between parallel calls a step has serial stretches (norms, routing, small attention) of tens of µs. Rayon
//! puts an idle worker to sleep after a few yields, and the caller of a join sleeps too when its other half
//! is still running; waking either costs more than the stretch (on a microVM that halts an idle vCPU at once,
//! ~200 sleeps and wakes per decode step cost ~15% of it). So a step runs inside [`with_workers_awake`]: the
//! other workers poll instead of sleeping, and the step's parallel loops ([`parallel_each`], [`parallel_map`])
//! hand them tasks through a team while the calling thread spins, never sleeps, until its loop is done.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuildError, ThreadPoolBuilder, Yield};

/// The threads a compute pool of `threads` has (`None` or 0: `RAYON_NUM_THREADS` when set to a positive number,
/// else every core), as rayon resolves them; the memory plan counts per-thread buffers by it.
pub fn compute_threads(threads: Option<usize>) -> usize {
    let from_env = || {
        std::env::var("RAYON_NUM_THREADS")
            .ok()?
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
    };
    (threads.filter(|&n| n > 0))
        .or_else(from_env)
        .unwrap_or_else(machine_cores)
}

/// The cores this process may run on (at least 1): the default compute thread count.
pub fn machine_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Makes the calling thread worker 0 of a new compute pool of `threads` threads in all (`None`: rayon's
/// default, `RAYON_NUM_THREADS` or every core), so the parallel kernels it calls from then on run on that pool.
/// Keep the pool alive while the thread computes; dropping it stops the other workers. A thread can join one
/// pool in its life (rayon's rule).
pub fn join_compute_pool(threads: Option<usize>) -> Result<ThreadPool, ThreadPoolBuildError> {
    ThreadPoolBuilder::new()
        .num_threads(compute_threads(threads))
        .thread_name(|i| format!("sluice-compute-{i}"))
        .use_current_thread()
        .build()
}

/// One parallel loop: tasks `0..n` cut into one contiguous run per worker, each worker walking its own run
/// upwards (long memory streams, in order) and, once done, taking tasks from the top of the others'; each task
/// runs exactly once.
struct Job<'a> {
    run: &'a (dyn Fn(usize) + Sync),
    /// Per run: next task to take from below (low 32 bits) and one past the last left (high 32 bits).
    runs: Vec<AtomicU64>,
    finished: AtomicUsize,
    n: usize,
    /// The first panic of a task, resumed by the poster once no task runs.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    fn new(run: &(dyn Fn(usize) + Sync), n: usize, workers: usize) -> Job<'_> {
        let bound = |w: usize| (n * w / workers) as u64;
        Job {
            run,
            runs: (0..workers)
                .map(|w| AtomicU64::new(bound(w) | bound(w + 1) << 32))
                .collect(),
            finished: AtomicUsize::new(0),
            n,
            panic: Mutex::new(None),
        }
    }

    /// A task of run `r`: its lowest left (the owner's) or its highest (a thief's).
    fn claim(&self, r: usize, own: bool) -> Option<usize> {
        let ends = &self.runs[r];
        let mut cur = ends.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = (cur & 0xffff_ffff, cur >> 32);
            if lo >= hi {
                return None;
            }
            let (next, task) = if own { (cur + 1, lo) } else { (cur - (1 << 32), hi - 1) };
            match ends.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(task as usize),
                Err(seen) => cur = seen,
            }
        }
    }

    /// Runs worker `me`'s tasks, then whatever is left of the others'.
    fn work(&self, me: usize) {
        let me = me % self.runs.len();
        let others = (1..self.runs.len()).map(|d| (me + d) % self.runs.len());
        let mine = std::iter::from_fn(|| self.claim(me, true));
        let stolen = others.flat_map(|r| std::iter::from_fn(move || self.claim(r, false)));
        for i in mine.chain(stolen) {
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.run)(i))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    *slot = Some(p);
                } else {
                    // A later panic's payload is dropped here, and its `Drop` may panic too: caught, so this
                    // never unwinds while the job is published (the poster would free it under the pollers).
                    let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
                }
            }
            self.finished.fetch_add(1, Ordering::Release);
        }
    }
}

/// The workers of one step: the posted loop, if any, and how many pollers may be looking at it.
struct Team {
    job: AtomicPtr<Job<'static>>,
    holders: AtomicUsize,
    done: AtomicBool,
    /// Pollers asleep on `wake` (counted under `sleep`).
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

/// How long a poller finds nothing before it sleeps: longer than an in-RAM step's serial stretches (~20 µs
/// in decode; 200 µs cost decode 512 deep ~8%), short enough not to hold a core long after a step's work
/// (a prompt's chunk that reads experts from disk does not keep its workers awake at all: see
/// `Model::awake_steps`).
const SLEEP_AFTER: Duration = Duration::from_millis(2);

thread_local! {
    /// The team this thread posts to while it runs a step (and is not inside one of its own tasks).
    static POSTER: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
}

impl Team {
    /// A poller's life: run the posted loops' tasks (and rayon's queued jobs) until the step ends.
    fn poll(&self) {
        let mut idle_since: Option<Instant> = None;
        while !self.done.load(Ordering::Acquire) {
            if !self.job.load(Ordering::Relaxed).is_null() {
                idle_since = None;
                self.holders.fetch_add(1, Ordering::SeqCst);
                let job = self.job.load(Ordering::SeqCst);
                // SAFETY: the poster unpublishes a job and then waits for `holders` to reach 0 before the job
                // leaves its stack; this thread counted itself a holder before loading the pointer (both
                // SeqCst), so the job it loaded outlives this use.
                if let Some(job) = unsafe { job.as_ref() } {
                    job.work(rayon::current_thread_index().unwrap_or(1));
                }
                self.holders.fetch_sub(1, Ordering::SeqCst);
            } else if rayon::yield_now() == Some(Yield::Executed) {
                idle_since = None;
            } else if idle_since.get_or_insert_with(Instant::now).elapsed() < SLEEP_AFTER {
                std::thread::yield_now();
            } else {
                self.sleep_until_posted();
                idle_since = None;
            }
        }
    }

    /// Sleeps until a loop is posted or the step ends (or briefly, to look for rayon work again).
    fn sleep_until_posted(&self) {
        let guard = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
        // Counted before looking (both SeqCst): a poster that stores its job after this look sees the count and
        // wakes this thread; one that stored it before is seen here.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        if self.job.load(Ordering::SeqCst).is_null() && !self.done.load(Ordering::SeqCst) {
            let timeout = Duration::from_millis(1);
            let _ = self
                .wake
                .wait_timeout(guard, timeout)
                .unwrap_or_else(|e| e.into_inner());
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes sleeping pollers (a loop was posted, or the step ended).
    fn wake_sleepers(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }

    /// Posts tasks `0..n` of `run`, takes a share, and returns once all have run (resuming a task's panic).
    fn run(&self, n: usize, run: &(dyn Fn(usize) + Sync)) {
        let job = Job::new(run, n, rayon::current_num_threads().max(1));
        let ptr = (&job as *const Job<'_>).cast::<Job<'static>>().cast_mut();
        self.job.store(ptr, Ordering::SeqCst);
        self.wake_sleepers();
        job.work(rayon::current_thread_index().unwrap_or(0));
        let mut spins = 0u32;
        while job.finished.load(Ordering::Acquire) < job.n {
            // Spin, but let a preempted poller have the core back if its task is what is left.
            spins += 1;
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        self.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        while self.holders.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        if let Some(p) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }
}

/// Runs `f` on this thread while the other workers of its pool poll for work instead of sleeping, and returns
/// its result; [`parallel_each`] and [`parallel_map`] called by `f` on this thread use them. Outside a pool,
/// or alone in it, just runs `f`. Results do not depend on it: only who runs a task changes.
pub fn with_workers_awake<R>(f: impl FnOnce() -> R) -> R {
    let (Some(me), workers) = (rayon::current_thread_index(), rayon::current_num_threads()) else {
        return f();
    };
    if workers < 2 || !POSTER.get().is_null() {
        return f();
    }
    /// Ends the step however `f` ends (a panic too: the scope waits for the pollers before unwinding on).
    struct End<'a>(&'a Team);
    impl Drop for End<'_> {
        fn drop(&mut self) {
            POSTER.set(std::ptr::null());
            self.0.done.store(true, Ordering::SeqCst);
            self.0.wake_sleepers();
        }
    }
    let team = Team {
        job: AtomicPtr::new(std::ptr::null_mut()),
        holders: AtomicUsize::new(0),
        done: AtomicBool::new(false),
        sleepers: AtomicUsize::new(0),
        sleep: Mutex::new(()),
        wake: Condvar::new(),
    };
    rayon::in_place_scope(|s| {
        let end = End(&team);
        for _ in 1..workers {
            s.spawn(|_| {
                // Picked up by this thread itself (waiting on a join before a worker took the poller): polling
                // here would keep it from finishing `f`.
                if rayon::current_thread_index() != Some(me) {
                    team.poll();
                }
            });
        }
        POSTER.set(&team);
        let out = f();
        drop(end);
        out
    })
}

/// Runs `f(i)` for `i` in `0..n` across the compute threads (the step's team, else rayon), each once.
fn parallel_for(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let team = POSTER.get();
    if n < 2 {
        (0..n).for_each(f);
    } else if team.is_null() {
        (0..n).into_par_iter().with_max_len(1).for_each(f);
    } else {
        // A task that loops in parallel itself runs that loop alone: one posted loop at a time.
        POSTER.set(std::ptr::null());
        // SAFETY: `POSTER` holds a team only while `with_workers_awake`'s frame that owns it is live on this
        // thread (its guard clears it before the team is dropped).
        let out = catch_unwind(AssertUnwindSafe(|| unsafe { &*team }.run(n, f)));
        POSTER.set(team);
        if let Err(p) = out {
            resume_unwind(p);
        }
    }
}

/// Calls `f` on each item, across the compute threads.
pub fn parallel_each<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync) {
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    parallel_for(slots.len(), &|i| {
        let item = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(item) = item {
            f(item);
        }
    });
}

/// `f` of each item, in order, computed across the compute threads.
pub fn parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let out: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    parallel_for(items.len(), &|i| {
        let r = f(&items[i]);
        *out[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    });
    out.into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .expect("parallel_for runs every task")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic payload whose `Drop` panics too, while armed.
    struct Bomb;
    static ARMED: AtomicBool = AtomicBool::new(false);
    impl Drop for Bomb {
        fn drop(&mut self) {
            if ARMED.load(Ordering::SeqCst) {
                panic!("a payload's drop panicked");
            }
        }
    }

    #[test]
    fn a_payload_whose_drop_panics_neither_hangs_nor_unwinds_a_step() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pool = join_compute_pool(Some(2)).unwrap();
            ARMED.store(true, Ordering::SeqCst);
            // Every task panics with a bomb: the first is kept for the caller, the others dropped in the tasks.
            let caught = std::panic::catch_unwind(|| {
                with_workers_awake(|| parallel_map(&[0u8; 64], |_| std::panic::panic_any(Bomb)))
            });
            ARMED.store(false, Ordering::SeqCst);
            let first_kept = caught.err().is_some_and(|p| p.is::<Bomb>());
            // The pool still serves the next step.
            let sum: u64 = with_workers_awake(|| parallel_map(&[1u64; 64], |x| *x)).iter().sum();
            drop(pool);
            let _ = tx.send((first_kept, sum));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(got.ok(), Some((true, 64)), "the step hung or lost its panic");
    }

    #[test]
    fn the_joining_thread_is_worker_zero_and_parallel_work_spreads() {
        std::thread::spawn(|| {
            let pool = join_compute_pool(Some(2)).unwrap();
            assert_eq!(rayon::current_thread_index(), Some(0));
            assert_eq!(rayon::current_num_threads(), 2);
            let me = std::thread::current().id();
            // Enough slow items that the second worker steals some.
            let ids: Vec<_> = (0..64)
                .into_par_iter()
                .map(|_| {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    std::thread::current().id()
                })
                .collect();
            assert!(ids.contains(&me), "worker 0 computes its share");
            assert!(ids.iter().any(|&t| t != me), "the other worker takes a share");
            drop(pool);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn awake_workers_take_a_steps_parallel_work_and_stop_with_it() {
        std::thread::spawn(|| {
            let pool = join_compute_pool(Some(2)).unwrap();
            let me = std::thread::current().id();
            // Over 20 steps the other worker must take part; a step of a few milliseconds in which it never got
            // the core (a loaded 2-core machine) is not a failure.
            let mut others_in_all = 0;
            for _ in 0..20 {
                let (sum, others) = with_workers_awake(|| {
                    // Parallel calls separated by serial gaps, as in a decode step.
                    let mut others = 0;
                    let mut sum = 0u64;
                    for round in 0..10u64 {
                        let ids: Vec<_> = (0..8u64)
                            .into_par_iter()
                            .map(|i| {
                                std::thread::sleep(std::time::Duration::from_micros(200));
                                (round * 8 + i, std::thread::current().id())
                            })
                            .collect();
                        sum += ids.iter().map(|(v, _)| v).sum::<u64>();
                        others += ids.iter().filter(|(_, t)| *t != me).count();
                        std::thread::sleep(std::time::Duration::from_micros(100));
                    }
                    (sum, others)
                });
                assert_eq!(sum, (0..80).sum::<u64>());
                others_in_all += others;
            }
            assert!(others_in_all > 0, "the other worker computed part of the steps");
            // Outside a step the pool still works, and a panic inside one reaches the caller.
            assert_eq!((0..100u64).into_par_iter().sum::<u64>(), 4950);
            let caught = std::panic::catch_unwind(|| with_workers_awake(|| panic!("step failed")));
            assert!(caught.is_err());
            assert_eq!(with_workers_awake(|| 7), 7);
            drop(pool);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_teams_loops_run_every_task_once_in_order_on_every_worker() {
        std::thread::spawn(|| {
            let pool = join_compute_pool(Some(2)).unwrap();
            let me = std::thread::current().id();
            with_workers_awake(|| {
                for n in [0usize, 1, 2, 3, 7, 64] {
                    let items: Vec<usize> = (0..n).collect();
                    let runs: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    let out = parallel_map(&items, |&i| {
                        runs[i].fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(std::time::Duration::from_micros(300));
                        (i * i, std::thread::current().id())
                    });
                    assert_eq!(
                        out.iter().map(|o| o.0).collect::<Vec<_>>(),
                        items.iter().map(|i| i * i).collect::<Vec<_>>()
                    );
                    assert!(
                        runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                        "each task once (n = {n})"
                    );
                    if n == 64 {
                        assert!(out.iter().any(|o| o.1 == me), "the poster took tasks (n = {n})");
                    }
                }
                // The poller takes tasks of a long loop, also after sleeping through a long serial stretch (a
                // wait on the disk). One loop is ~19 ms: a few tries, so that a poller kept off a loaded core
                // for one of them does not fail the test.
                let items: Vec<usize> = (0..64).collect();
                let poller_took_tasks = (0..10).any(|_| {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    let ids = parallel_map(&items, |_| {
                        std::thread::sleep(std::time::Duration::from_micros(300));
                        std::thread::current().id()
                    });
                    ids.iter().any(|&t| t != me)
                });
                assert!(poller_took_tasks, "the sleeping poller woke and took tasks");
                // A loop inside a task runs (alone), and each_mut hands out every item.
                let sums = parallel_map(&[10u64, 20, 30], |&base| {
                    parallel_map(&[1u64, 2], |&x| base + x).iter().sum::<u64>()
                });
                assert_eq!(sums, vec![23, 43, 63]);
                let mut cells = vec![0u32; 9];
                parallel_each(cells.chunks_mut(2).enumerate().collect(), |(i, c)| c.fill(i as u32 + 1));
                assert_eq!(cells, vec![1, 1, 2, 2, 3, 3, 4, 4, 5]);
                // A task's panic reaches the poster once the loop is over, and the team keeps working.
                let caught = catch_unwind(AssertUnwindSafe(|| {
                    parallel_map(&[0, 1, 2, 3, 4, 5], |&i| {
                        assert!(i != 4, "task 4 fails");
                        i
                    })
                }));
                assert!(caught.is_err());
                assert_eq!(parallel_map(&[1, 2, 3], |&i| i + 1), vec![2, 3, 4]);
            });
            drop(pool);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn outside_a_pool_the_step_just_runs() {
        std::thread::spawn(|| assert_eq!(with_workers_awake(|| 3), 3))
            .join()
            .unwrap();
    }
}
