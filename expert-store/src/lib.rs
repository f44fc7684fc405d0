//! Everything that touches the disk: safetensors checkpoints and the per-expert records the runtime reads.
//!
//! The runtime never opens a weight file itself. It asks a [`Checkpoint`] for named tensors (resident
//! weights) and an [`ExpertSource`] for "the record of expert e in layer l". The current source views the
//! mmap'd safetensors in place ([`MmapExpertSource`]); the streaming engine replaces the source, not the
//! model code.

#![warn(missing_docs)]

mod bytes;
mod checkpoint;
mod error;
mod experts;
mod mmap;

pub use bytes::OwnedBytes;
pub use checkpoint::{Checkpoint, Dtype, TensorInfo};
pub use error::StoreError;
pub use experts::{ExpertRecord, ExpertSource, InMemoryExpertSource, MmapExpertSource, StackedExperts};
