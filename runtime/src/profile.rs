//! Where a forward pass spends its time, per part of the layer, accumulated in lock-free counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A part of the forward pass that is timed on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Softmax attention layers (projections, RoPE, attention, output).
    FullAttention,
    /// Gated DeltaNet layers' projections (in and out).
    LinearAttention,
    /// Gated DeltaNet layers' causal conv, delta-rule recurrence and gated norm.
    DeltaRecurrence,
    /// Router, routed experts and the wait for their records.
    RoutedExperts,
    /// The shared expert and its gate.
    SharedExpert,
    /// Dense MLP layers.
    DenseMlp,
    /// Embedding lookup, final norm and output head.
    Head,
}

impl Part {
    /// Every part, in report order.
    pub const ALL: [Part; 7] = [
        Part::FullAttention,
        Part::LinearAttention,
        Part::DeltaRecurrence,
        Part::RoutedExperts,
        Part::SharedExpert,
        Part::DenseMlp,
        Part::Head,
    ];

    /// Short name for reports and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Part::FullAttention => "full_attention",
            Part::LinearAttention => "linear_attention_proj",
            Part::DeltaRecurrence => "delta_recurrence",
            Part::RoutedExperts => "routed_experts",
            Part::SharedExpert => "shared_expert",
            Part::DenseMlp => "dense_mlp",
            Part::Head => "head",
        }
    }
}

/// Accumulated wall time per [`Part`].
#[derive(Debug, Default)]
pub struct StepProfile {
    nanos: [AtomicU64; Part::ALL.len()],
}

impl StepProfile {
    /// Adds `d` to `part`.
    pub fn add(&self, part: Part, d: Duration) {
        self.nanos[part as usize].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Seconds per part so far.
    pub fn snapshot(&self) -> Vec<(Part, f64)> {
        Part::ALL
            .iter()
            .map(|&p| (p, self.nanos[p as usize].load(Ordering::Relaxed) as f64 * 1e-9))
            .collect()
    }
}
