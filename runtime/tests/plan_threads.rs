//! The memory plan counts the compute pool's threads as the pool has them (its own binary: it sets
//! `RAYON_NUM_THREADS`, which every pool built without a count in this process reads).

use sluice_runtime::memory_plan::PlanRequest;
use sluice_runtime::{threads, ExpertOptions};

#[test]
fn the_plan_counts_the_threads_the_pool_has() {
    std::env::set_var("RAYON_NUM_THREADS", "7");
    let (planned, pooled) = std::thread::spawn(|| {
        let _pool = threads::join_compute_pool(None).unwrap();
        let planned = PlanRequest::from_options(&ExpertOptions::default()).threads;
        (planned, rayon::current_num_threads())
    })
    .join()
    .unwrap();
    assert_eq!((planned, pooled), (7, 7));
    // An explicit count wins over the variable, in both.
    let opts = ExpertOptions {
        threads: Some(3),
        ..ExpertOptions::default()
    };
    assert_eq!(PlanRequest::from_options(&opts).threads, 3);
    assert_eq!(threads::compute_threads(Some(3)), 3);
    std::env::set_var("RAYON_NUM_THREADS", "0");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(
        threads::compute_threads(None),
        cores,
        "0 means every core, as rayon reads it"
    );
}
