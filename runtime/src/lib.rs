//! Model math for sluice: MoE architectures written once over a compute [`backend`] (`cpu`, `reference`,
//! `mlx`), sequence state, sampling and the decode loop. No HTTP.

#![warn(missing_docs)]

pub mod attention;
pub mod backend;
pub mod config;
pub mod convert;
pub mod cpu;
pub mod error;
pub mod eval;
mod expert_source;
pub mod forecast;
pub mod gated_delta;
pub mod generate;
pub mod golden;
pub mod linear;
mod location;
pub mod memory_plan;
pub mod model;
pub mod models;
pub mod moe;
pub mod ops;
pub mod options;
pub mod prefetch;
pub mod profile;
pub mod quant;
pub mod sampling;
pub mod sequence;
pub mod text;
pub mod threads;
pub mod weights;

pub use convert::{convert_model, StoreLayout};
pub use error::{ModelError, Result};
pub use generate::{FinishReason, GenerateParams, GenerationStats, Pipeline, Progress, Prompt, PromptLimits};
pub use location::model_dir;
pub use memory_plan::{MemoryPlan, DEFAULT_PREFILL_CHUNK, STREAMED_PREFILL_CHUNK};
pub use model::{DecoderModel, ForwardOptions, ModelInfo, PrefetchMode, SeqRequest};
pub use models::{load_model, load_model_with, supported_model_types};
pub use moe::RouterKind;
pub use options::{parse_size, BackendKind, ExpertMode, ExpertOptions, IoMode, DEFAULT_PREFETCH_AHEAD};
pub use profile::{Part, StepProfile};
pub use sampling::SamplingParams;
pub use sequence::{CacheCheckpoint, KvCache};
pub use text::{ChatMessage, GenerationDefaults, TextCodec};
