//! The compute thread pool, joined by the thread that runs the model.
//!
//! A parallel kernel called from a thread outside rayon's pool is handed to a pool thread, and the caller
//! sleeps on a lock until it returns. On a 2-vCPU VM that hand-off and wake-up cost ~10 µs per call, more than
//! a 512-row matrix takes on one core, and a decode step makes ~200 such calls. A thread that is itself worker
//! 0 of the pool splits the work in place: it keeps half and the other workers steal the rest.

use rayon::{ThreadPool, ThreadPoolBuildError, ThreadPoolBuilder};

/// Makes the calling thread worker 0 of a new compute pool of `threads` threads in all (`None`: rayon's
/// default, `RAYON_NUM_THREADS` or every core), so the parallel kernels it calls from then on run on that pool.
/// Keep the pool alive while the thread computes; dropping it stops the other workers. A thread can join one
/// pool in its life (rayon's rule).
pub fn join_compute_pool(threads: Option<usize>) -> Result<ThreadPool, ThreadPoolBuildError> {
    ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .thread_name(|i| format!("sluice-compute-{i}"))
        .use_current_thread()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

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
}
