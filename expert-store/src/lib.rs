//! Everything that touches the disk: safetensors checkpoints, packed expert stores, and the streaming
//! engine that serves expert records to the runtime.
//!
//! The runtime never opens a weight file itself. It asks a [`Checkpoint`] for named tensors (resident
//! weights) and an [`ExpertSource`] for "the record of expert e in layer l". Sources: the mmap'd
//! safetensors viewed in place ([`MmapExpertSource`]), records in memory ([`InMemoryExpertSource`]), and
//! the [`StreamingSource`], which reads records by `pread` into a budgeted pool of persistent slots from
//! either a packed store ([`PackedStore`]) or the original safetensors in place
//! ([`RecordTable::in_place`]).

#![warn(missing_docs)]

mod aligned;
mod bytes;
mod checkpoint;
mod counters;
mod engine;
mod error;
mod experts;
mod layout;
mod mmap;
pub mod platform;
mod store;
mod trace;

pub use aligned::{ResidentArena, SlotBuf, SLOT_ALIGN};
pub use bytes::OwnedBytes;
pub use checkpoint::{Checkpoint, Dtype, TensorInfo};
pub use counters::{CounterSnapshot, Histogram, HistogramSnapshot, StoreCounters, LATENCY_BOUNDS};
pub use engine::{panic_message, EngineOptions, StreamingSource, DEFAULT_GUESS_DEPTH};
pub use error::StoreError;
pub use experts::{ExpertFetch, ExpertRecord, ExpertSource, InMemoryExpertSource, MmapExpertSource, StackedExperts};
pub use layout::{
    piece_len, read_full, PosixFile, ReadAt, ReadOp, RecordLayout, RecordTable, RecordTransform, DIRECT_ALIGN,
    READ_PIECE,
};
pub use store::{
    convert, is_store, ConvertOptions, LayerManifest, Manifest, PackedStore, PartManifest, RecordManifest, DATA_FILE,
    MANIFEST_FILE, STORE_VERSION,
};
pub use trace::{lru_misses, optimal_misses, RecordKey, TracingSource};
