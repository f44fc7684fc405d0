//! Model math for sluice: the `cpu` backend, MoE architectures, sampling and the decode loop. No HTTP.

#![warn(missing_docs)]

pub mod config;
pub mod convert;
pub mod cpu;
pub mod error;
mod expert_source;
pub mod gated_delta;
pub mod generate;
pub mod golden;
pub mod layers;
pub mod linear;
mod location;
pub mod memory_plan;
#[cfg(feature = "mlx")]
pub mod mlx;
pub mod models;
pub mod ops;
pub mod options;
pub mod profile;
pub mod quant;
pub mod sampling;
pub mod text;
pub mod weights;

pub use convert::convert_model;
pub use error::{ModelError, Result};
pub use generate::{FinishReason, GenerateParams, GenerationStats, Pipeline, Prompt};
pub use layers::{DecoderModel, ForwardOptions, ModelInfo, PrefetchMode, RouterKind};
pub use memory_plan::MemoryPlan;
pub use models::{load_model, load_model_with, supported_model_types};
pub use ops::{CacheCheckpoint, KvCache};
pub use options::{parse_size, Backend, ExpertMode, ExpertOptions};
pub use profile::{Part, StepProfile};
pub use sampling::SamplingParams;
pub use text::{ChatMessage, TextCodec};
