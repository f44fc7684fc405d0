//! How expert records reach the model: viewed in place (mmap) or streamed through the expert store's engine
//! from a packed store or from the original safetensors, sized by the memory plan.

use std::sync::Arc;

use expert_store::{
    Checkpoint, EngineOptions, ExpertSource, InMemoryExpertSource, MmapExpertSource, PackedStore, RecordTable,
    RecordTransform, StackedExperts, StoreError, StreamingSource,
};

use crate::error::{ModelError, Result};
use crate::memory_plan::{gib, ExpertPlacement, MachineMemory, MemoryPlan, ModelFootprint, PlanRequest};
use crate::options::{BackendKind, ExpertMode, ExpertOptions, IoMode};
use crate::weights::Weights;

/// An expert source with the memory plan that sized it.
pub(crate) struct OpenedSource {
    pub source: Arc<dyn ExpertSource>,
    pub plan: MemoryPlan,
    /// Whether records are rewritten by the transform asked for as they load (only streamed ones are).
    pub rewritten: bool,
}

/// Builds the expert source for `stacks` per `opts`. `footprint` holds the model's KV and state sizes; its
/// weight sizes are filled in here from the checkpoint. Streamed records are rewritten by `rewrite` as they
/// land, when given. A `store` has been checked against `stacks` by the caller (`PackedStore::check_against`).
pub(crate) fn open_source(
    weights: &Weights,
    stacks: &[StackedExperts],
    store: Option<&PackedStore>,
    opts: &ExpertOptions,
    mut footprint: ModelFootprint,
    rewrite: Option<Arc<dyn RecordTransform>>,
) -> Result<OpenedSource> {
    let ckpt = weights.checkpoint();
    (footprint.resident_weights, footprint.expert_bytes) = weight_bytes(weights, stacks, opts.backend);
    let machine = MachineMemory::probe_for(opts.backend);
    let plan_for = |footprint| MemoryPlan::new(machine, footprint, &PlanRequest::from_options(opts));
    let unwritten = |source: Arc<dyn ExpertSource>, plan: MemoryPlan| {
        warn_unless_fits(&plan);
        OpenedSource {
            source,
            plan,
            rewritten: false,
        }
    };
    if stacks.is_empty() {
        return Ok(unwritten(Arc::new(InMemoryExpertSource::new()), plan_for(footprint)));
    }
    // The read mode is decided on the checkpoint's sizes (the table's reads depend on it); the plan is then
    // redone on what the slots take and keeps that decision, unless the slots' padding moved the experts from
    // resident to streamed, which `--io auto` reads direct: then the table is opened again for direct reads.
    let wanted = plan_for(footprint).direct_io;
    if store.is_some() && opts.mode == ExpertMode::Mmap {
        return Err(ModelError::InvalidArgument(
            "--experts mmap views a model directory in place; a packed store is read with pread".into(),
        ));
    }
    if opts.mode == ExpertMode::Mmap {
        return Ok(unwritten(
            Arc::new(MmapExpertSource::new(ckpt, stacks)?),
            plan_for(footprint),
        ));
    }
    let open = |direct: bool| -> Result<(RecordTable, bool)> {
        let (table, direct) = match store {
            Some(s) => open_table(|d| s.table(d), direct, opts.io)?,
            None => open_table(|d| RecordTable::in_place(ckpt, stacks, d), direct, opts.io)?,
        };
        let table = match &rewrite {
            Some(t) => table.with_transform(Arc::clone(t))?,
            None => table,
        };
        Ok((table, direct))
    };
    let (mut table, mut direct) = open(wanted)?;
    let rewritten = rewrite.is_some();
    // What the slots take to hold every record: a slot per record, each as long as the longest (records of
    // mixed-precision layers differ; packed ones are padded), aligned. Planning on the records' own sizes
    // instead would let a resident arena outgrow its plan (by ~2 GB on a mixed 3/6-bit 30B).
    let longest = table.max_slot_len() as u64;
    let every_record = slot_arena_bytes(table.len() as u64, longest);
    footprint.expert_bytes = every_record;
    // Each I/O thread keeps a buffer to read a record into before rewriting it into its slot.
    if rewritten {
        footprint.io_buffers = slot_arena_bytes(opts.io_depth.max(1) as u64, longest);
    }
    let planned = plan_for(footprint);
    if opts.io == IoMode::Auto && planned.direct_io && !wanted {
        (table, direct) = open(true)?;
    }
    let plan = MemoryPlan {
        direct_io: direct,
        ..planned
    };
    warn_unless_fits(&plan);
    let preload = plan.placement == ExpertPlacement::Resident;
    let cache_bytes = if preload { every_record } else { plan.expert_cache };
    let engine = StreamingSource::new(
        table,
        &EngineOptions {
            cache_bytes,
            io_depth: opts.io_depth,
            guess_depth: opts.guess_depth,
            verify: opts.verify,
            // An explicit `--expert-cache` beyond the machine's room stays lazy (see the option). Resident
            // records are all read below, which backs every slot: a prefault pass beside it would only race it
            // (and leave the slots reported as backing after the load is done).
            prefault: plan.fits() && !preload,
        },
    )?;
    let (slots, slot_len) = engine.slots();
    tracing::info!(
        slots,
        slot_len,
        cache_bytes = slots * slot_len,
        io_depth = opts.io_depth,
        "streaming experts"
    );
    if preload {
        engine.preload()?;
    }
    Ok(OpenedSource {
        source: Arc::new(engine),
        plan,
        rewritten,
    })
}

/// The bytes of the weights outside the expert stacks once loaded, and those of the stacks as stored. The
/// former are as stored (the cpu backend computes from the mapped file), except that the mlx backend keeps
/// every 16-bit float tensor (norms, dense weights, quantization scales and biases) as an f32 copy
/// (`backend/mlx/ops.rs`), twice its size on disk. The embedding table stays in the mapped file (rows are
/// looked up on the host) unless it is also the head (tied: no `lm_head` tensor), which the backend uploads.
fn weight_bytes(weights: &Weights, stacks: &[StackedExperts], backend: BackendKind) -> (u64, u64) {
    let ckpt = weights.checkpoint();
    let stacked: std::collections::HashSet<&str> = stacks.iter().flat_map(|s| &s.tensors).map(String::as_str).collect();
    let tied = !ckpt.names().any(|n| n.contains("lm_head."));
    let (mut resident, mut experts) = (0u64, 0u64);
    // Only what the text model reads: a VLM's vision tower and an MTP head stay in the mapped file, unread.
    let read = ckpt.names().filter(|n| weights.is_text_model(n));
    for (name, t) in read.filter_map(|n| Some((n, ckpt.get(n)?))) {
        let bytes = t.bytes().len() as u64;
        if stacked.contains(name) {
            experts += bytes;
            continue;
        }
        let half = matches!(t.dtype, expert_store::Dtype::F16 | expert_store::Dtype::BF16);
        let uploaded = tied || !name.contains("embed_tokens.");
        resident += if backend == BackendKind::Mlx && half && uploaded {
            2 * bytes
        } else {
            bytes
        };
    }
    (resident, experts)
}

/// Says so (without `-v`) when the plan's budgets overrun its limit: an explicit `--experts resident`,
/// `--expert-cache` or `--ctx-size` beyond the machine's room pages or gets the process killed.
fn warn_unless_fits(plan: &MemoryPlan) {
    if !plan.fits() {
        tracing::warn!(
            "the memory plan needs {} but {} is available: expect paging or an out-of-memory kill (a smaller \
             --expert-cache or --ctx-size, or --experts stream, fits; -v prints the plan)",
            gib(plan.total()),
            gib(plan.limit)
        );
    }
}

/// Bytes of the slots that hold `records` expert records at once, each slot as long as the `longest` record,
/// aligned: what resident experts take, and what the plan counts for them.
pub(crate) fn slot_arena_bytes(records: u64, longest: u64) -> u64 {
    records.saturating_mul(longest.next_multiple_of(expert_store::SLOT_ALIGN as u64))
}

/// The record table, read directly when `direct`; under `--io auto` a filesystem that refuses direct reads
/// (some network and in-memory ones, at open or at the first read) gets buffered reads instead. Returns
/// whether reads are direct.
fn open_table(
    open: impl Fn(bool) -> std::result::Result<RecordTable, StoreError>,
    direct: bool,
    io: IoMode,
) -> Result<(RecordTable, bool)> {
    let buffered = |why: &dyn std::fmt::Display| -> Result<(RecordTable, bool)> {
        tracing::warn!("direct reads refused ({why}); reading experts through the page cache");
        Ok((open(false)?, false))
    };
    match open(direct) {
        Err(e) if direct && io == IoMode::Auto => buffered(&e),
        Ok(table) if direct && io == IoMode::Auto => match table.probe_read() {
            // Other errors are the disk's, and a generation that reads that record will say so.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => buffered(&e),
            _ => Ok((table, true)),
        },
        r => Ok((r?, direct)),
    }
}

/// Bytes of each layer's expert records, by layer index (0 for a layer without experts): as packed (padded)
/// when a store serves the experts, else the sum of one expert's slices of its stacked tensors.
pub(crate) fn record_bytes_by_layer(
    ckpt: &Checkpoint,
    stacks: &[StackedExperts],
    store: Option<&PackedStore>,
    layers: usize,
) -> Vec<u64> {
    let mut by_layer = vec![0u64; layers];
    let mut set = |layer: usize, bytes: u64| {
        if let Some(b) = by_layer.get_mut(layer) {
            *b = bytes;
        }
    };
    match store {
        Some(s) => (s.manifest().layers.iter()).for_each(|l| set(l.layer, l.record_len)),
        None => {
            for s in stacks {
                let per_expert = (s.tensors.iter())
                    .filter_map(|n| ckpt.get(n))
                    .map(|t| (t.bytes().len() / s.num_experts.max(1)) as u64)
                    .sum::<u64>();
                set(s.layer, per_expert);
            }
        }
    }
    by_layer
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;

    use expert_store::{ReadAt, ReadOp, RecordLayout};

    use super::*;

    /// A file of zeros whose reads fail with `EINVAL` when opened for direct reads, as some filesystems do.
    struct Refusing {
        direct: bool,
    }

    impl ReadAt for Refusing {
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> std::io::Result<usize> {
            if self.direct {
                return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
            }
            buf.fill(0);
            Ok(buf.len())
        }
        fn path(&self) -> &Path {
            Path::new("experts.bin")
        }
    }

    fn table(direct: bool) -> std::result::Result<RecordTable, StoreError> {
        let read = ReadOp {
            file: 0,
            offset: 0,
            len: 4096,
            slot_offset: 0,
            needed: 4096,
        };
        let record = RecordLayout {
            reads: vec![read],
            parts: vec![(0, 4096)],
            checksum: None,
            rewritten: None,
        };
        let files: Vec<Arc<dyn ReadAt>> = vec![Arc::new(Refusing { direct })];
        Ok(RecordTable::new(files, HashMap::from([(0, vec![record])])))
    }

    #[test]
    fn direct_reads_refused_at_the_first_read_fall_back_to_buffered_under_auto() {
        let (t, direct) = open_table(table, true, IoMode::Auto).unwrap();
        assert!(!direct);
        assert!(t.probe_read().is_ok());
        // Asked for by name, direct reads stay direct (and fail when read).
        let (t, direct) = open_table(table, true, IoMode::Direct).unwrap();
        assert!(direct && t.probe_read().is_err());
        let (_, direct) = open_table(table, false, IoMode::Auto).unwrap();
        assert!(!direct);
    }
}
