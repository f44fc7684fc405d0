//! Expert records tiled as they load hold the weights the stored records hold. In its own process: the int8
//! kernels are switched on to load (records are tiled only for them) and off to compute, so both layouts run
//! the float kernels and differ by summation order alone, not by activation rounding, which random fixtures
//! amplify past any bound that could catch a misplaced matrix.

mod common;

use common::fixtures;

use sluice_runtime::config::ModelConfig;
use sluice_runtime::cpu::q8::{set_q8_activations, tiled_kernel_on};
use sluice_runtime::cpu::Isa;
use sluice_runtime::forecast::size_from_config;
use sluice_runtime::{load_model_with, ExpertMode, ExpertOptions};

#[test]
fn tiled_expert_records_compute_what_the_stored_records_compute() {
    let load = |dir: &std::path::Path, mode| {
        let opts = ExpertOptions {
            mode,
            ..ExpertOptions::default()
        };
        load_model_with(dir, ModelConfig::load(dir).unwrap(), &opts).unwrap()
    };
    let kernel = {
        set_q8_activations(true);
        tiled_kernel_on(Isa::detect())
    };
    let mut tiled = 0;
    for dir in fixtures() {
        set_q8_activations(true);
        let m = load(&dir, ExpertMode::Resident);
        // `--experts mmap` views the records in place, as stored: never tiled.
        let stored = load(&dir, ExpertMode::Mmap);
        assert!(!stored.info.tiled_experts);
        set_q8_activations(false);
        if !m.info.tiled_experts {
            continue;
        }
        tiled += 1;
        let (got, want) = (common::prompt_logits(&m), common::prompt_logits(&stored));
        let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
        let err = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        eprintln!("{}: max logit difference {err:.2e} of {scale:.2}", dir.display());
        assert!(
            err <= 1e-4 * scale,
            "{}: tiled records moved the logits by {err}",
            dir.display()
        );
    }
    if kernel {
        assert!(tiled >= 4, "only {tiled} fixtures had their records tiled");
    } else {
        assert_eq!(tiled, 0);
    }
    // Records rewritten as they land are read into a buffer each I/O thread keeps: the memory plan counts one
    // record per thread, and sizes it from the config (`doctor`) as the loader does.
    set_q8_activations(true);
    for dir in fixtures() {
        let opts = ExpertOptions {
            mode: ExpertMode::Stream,
            io_depth: 3,
            ..ExpertOptions::default()
        };
        let config = ModelConfig::load(&dir).unwrap();
        let m = load_model_with(&dir, config.clone(), &opts).unwrap();
        let planned = (size_from_config(&config, None, &opts).unwrap().footprint).io_buffers;
        let plan = &m.memory_plan;
        let want = if m.info.tiled_experts {
            3 * m.expert_slot_len().unwrap() as u64
        } else {
            0
        };
        assert_eq!(plan.model.io_buffers, want, "{}: {plan}", dir.display());
        assert_eq!(plan.to_string().contains("read buffers"), want > 0, "{plan}");
        assert_eq!(planned > 0, want > 0, "{}: {planned} from the config", dir.display());
        // The config gives a record's bytes; the loader's slot also holds the alignment of each of its (up to 9)
        // in-place reads, widened to 4 KiB each side, within a 16 KiB-aligned slot.
        let per_thread_slack = 9 * 2 * 4096 + 16384;
        assert!(
            want >= planned && want - planned <= 3 * per_thread_slack,
            "{}: {planned} from the config, {want} loaded",
            dir.display()
        );
    }
}
