//! Model math for sluice: the `cpu` backend, MoE architectures, sampling and the decode loop. No HTTP.

#![warn(missing_docs)]

pub mod config;
pub mod cpu;
pub mod error;
pub mod experts;
pub mod gated_delta;
pub mod generate;
pub mod golden;
pub mod layers;
pub mod linear;
pub mod memory_plan;
#[cfg(feature = "mlx")]
pub mod mlx;
pub mod models;
pub mod ops;
pub mod profile;
pub mod quant;
pub mod sampling;
pub mod text;
pub mod weights;

pub use error::{ModelError, Result};
pub use experts::{convert_model, parse_size, Backend, ExpertMode, ExpertOptions};
pub use generate::{FinishReason, GenerateParams, GenerationStats, Pipeline, Prompt};
pub use layers::{DecoderModel, ForwardOptions, ModelInfo, PrefetchMode, RouterKind};
pub use memory_plan::MemoryPlan;
pub use models::{load_model, load_model_with, supported_model_types};
pub use ops::{CacheCheckpoint, KvCache};
pub use profile::{Part, StepProfile};
pub use sampling::SamplingParams;
pub use text::{ChatMessage, TextCodec};
