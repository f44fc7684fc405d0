//! The one memory planner: every byte budget sluice keeps (resident weights, expert cache, KV per sequence,
//! the margin; on a Mac running the mlx backend, Metal's working-set limit) computed in one place from the
//! machine's facts, the model's footprint and the user's flags. Later budgets (a draft model, a prefix
//! cache) add their line here.
//!
//! The rule:
//! - **limit** = available memory now; with the mlx backend on macOS, at most Metal's working-set limit
//!   (weights, slots and KV are GPU buffers there).
//! - **margin** = max(1 GiB, total / 32), at most total / 4: the tokenizer, a token block's matmul scratch,
//!   allocator slack (the cap is for small containers, where 1 GiB would be all of it).
//! - **KV per sequence** = (K and V of every full-attention layer + recurrent state) for the context limit
//!   when one is given (`--ctx-size`), else for min(model context, 32768) tokens.
//! - **prefill activations** = prompt tokens per prefill pass × the model's activation bytes per token
//!   (`--prefill-chunk` when given; never more tokens than the KV budget's). A pass reads each streamed record
//!   it misses once, so streamed (and mmapped) experts take passes of 2048 tokens, halved while their
//!   activations would exceed ⅛ of the room left before them (down to 512); resident ones take 512, which
//!   computes as fast (`docs/performance-log.md`, "Thirty-third session": on `compare.sh large`'s model a
//!   2,048-token prompt read 23.5 MB per token in passes of 512 and 14.1 in one of 2,048; on a slow disk the
//!   first waited on reads for 22% of the prefill and the second for 1%).
//! - **attention scores** = compute threads × the scores one keeps per context position (4 positions × the
//!   query heads of a key/value head, f32) × the KV budget's tokens: a thread keeps its largest task's (the
//!   cpu backends). On mlx, 3 × 64 MiB: MLX's unfused attention holds a query block's scores, their masked
//!   copy and their softmax, and the backend cuts a prompt's chunk into blocks of at most 64 MiB of scores.
//! - **room for experts** = limit − resident weights − KV − prefill activations − attention scores − margin.
//! - `--experts auto` keeps every expert resident when they fit in that room, else streams them.
//! - A **draft model** and a **prefix cache** take their bytes off the room too (none exist yet), and so do
//!   the full-vocabulary **logits** a command holds beside the pass (`eval`: three windows' worth).
//! - The streamed **expert cache** (slots under a hard budget) is `--expert-cache` when given, else the
//!   whole room for experts (at least 256 MiB, at most the experts themselves). When the plan fits the
//!   limit, the slots are backed with memory from the start; an overcommitted one stays lazy.
//! - **Reads** (`--io auto`) bypass the OS page cache when streaming into a cache of at least half the
//!   room (always so by default): the page cache would then have less room than the slots and would mostly
//!   hold copies of records already in them, and every buffered read costs an extra copy. With a smaller
//!   `--expert-cache` the page cache keeps more room than the slots and serves as a second tier, so reads
//!   go through it. Resident experts are read once, through the page cache. On `compare.sh large`
//!   (27 GB of experts, 24 GB machine) direct reads into the room-sized cache decoded 1.4–2.8× faster warm
//!   than the old default (⅛ of memory, buffered) and 1.1–1.8× faster than the same cache read buffered
//!   (`docs/performance-log.md`, "Defaults, and the measurements behind them").

use std::fmt;

use crate::options::{BackendKind, ExpertMode, ExpertOptions, IoMode};

/// The machine's memory, as the platform module reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineMemory {
    /// Physical memory, or the memory cgroup's limit where that is less.
    pub total: u64,
    /// Memory the OS can hand out now without paging.
    pub available: u64,
    /// The GPU's working-set limit (macOS), if it has one.
    pub gpu_working_set: Option<u64>,
    /// The memory cgroup's limit (Linux containers, systemd slices), already applied to `total` and
    /// `available`.
    pub cgroup_limit: Option<u64>,
    /// Whether the numbers came from the OS (else they are the 8 GiB fallback).
    pub measured: bool,
}

/// What is assumed when the OS does not say: a small machine.
const FALLBACK_MEMORY: u64 = 8 << 30;

impl MachineMemory {
    /// Asks the OS (see [`expert_store::platform`]).
    pub fn probe() -> Self {
        use expert_store::platform;
        match platform::memory_now() {
            Some(m) => Self {
                total: m.total,
                available: m.available,
                gpu_working_set: platform::gpu_working_set_limit(),
                cgroup_limit: m.cgroup.map(|cg| cg.limit),
                measured: true,
            },
            None => Self {
                total: FALLBACK_MEMORY,
                available: FALLBACK_MEMORY,
                gpu_working_set: None,
                cgroup_limit: None,
                measured: false,
            },
        }
    }

    /// [`Self::probe`] as `backend` sees the machine: the mlx backend takes Metal's working-set limit from
    /// MLX when it reports one.
    pub fn probe_for(backend: BackendKind) -> Self {
        #[cfg_attr(not(feature = "mlx"), allow(unused_mut))]
        let mut machine = Self::probe();
        #[cfg(feature = "mlx")]
        if backend == BackendKind::Mlx {
            if let Some(w) = crate::backend::mlx::recommended_working_set() {
                machine.gpu_working_set = Some(w);
            }
        }
        #[cfg(not(feature = "mlx"))]
        let _ = backend;
        machine
    }
}

/// A model's memory needs, from its tensors and shapes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelFootprint {
    /// Every weight that stays in memory: embeddings, attention, routers, norms, shared experts, head.
    pub resident_weights: u64,
    /// Every routed-expert record.
    pub expert_bytes: u64,
    /// K and V of one token over every full-attention layer.
    pub kv_bytes_per_token: u64,
    /// Fixed per-sequence state (hybrid models' recurrent and conv state).
    pub state_bytes: u64,
    /// One row of full-vocabulary f32 logits.
    pub logit_bytes_per_row: u64,
    /// The model's own context limit.
    pub context_length: usize,
    /// Activations one prompt token holds at the peak of a prefill pass (f32 hidden states, projections,
    /// router logits, its routed experts' inputs and outputs).
    pub activation_bytes_per_token: u64,
    /// Attention scores one compute thread keeps per position of the context (f32, for the positions of one
    /// task and the query heads of one key/value head).
    pub score_bytes_per_position: u64,
    /// Attention scores held at once whatever the context (the mlx backend's query blocks).
    pub score_bytes_bounded: u64,
    /// Buffers the I/O threads read records into and rewrite them from (one per thread, kept for its life;
    /// 0 when records land as stored).
    pub io_buffers: u64,
}

/// What the user asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanRequest {
    /// `--experts`.
    pub mode: ExpertMode,
    /// `--expert-cache`.
    pub cache_bytes: Option<u64>,
    /// `--io`.
    pub io: IoMode,
    /// `--ctx-size`.
    pub context: Option<usize>,
    /// `--prefill-chunk`.
    pub prefill_chunk: Option<usize>,
    /// The weights live in GPU buffers under the working-set limit (the mlx backend on macOS).
    pub gpu_buffers: bool,
    /// A draft model kept in memory for speculative decoding (none yet: 0).
    pub draft_model: u64,
    /// A prefix cache shared between sequences (none yet: 0).
    pub prefix_cache: u64,
    /// Rows of full-vocabulary logits held at once beside the pass (`eval`).
    pub logit_rows: usize,
    /// Threads that compute (each keeps its own attention scores; 0 counts as 1).
    pub threads: usize,
}

impl PlanRequest {
    /// The request the loader's flags make.
    pub fn from_options(opts: &ExpertOptions) -> Self {
        Self {
            mode: opts.mode,
            cache_bytes: opts.cache_bytes,
            io: opts.io,
            context: opts.context,
            prefill_chunk: opts.prefill_chunk,
            gpu_buffers: opts.backend == BackendKind::Mlx && cfg!(target_os = "macos"),
            logit_rows: opts.logit_rows,
            threads: crate::threads::compute_threads(opts.threads),
            ..Self::default()
        }
    }
}

/// Where the routed experts live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPlacement {
    /// Every record read into slots at load.
    Resident,
    /// Records read on demand into the budgeted slot cache.
    Stream,
    /// Records viewed in place through the OS's mapping of the files.
    Mmap,
}

/// Every budget, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The facts it started from.
    pub machine: MachineMemory,
    /// The model it is for.
    pub model: ModelFootprint,
    /// The ceiling every budget below shares.
    pub limit: u64,
    /// Kept free.
    pub margin: u64,
    /// Tokens the KV budget covers.
    pub kv_tokens: usize,
    /// KV and recurrent state of one sequence.
    pub kv_per_sequence: u64,
    /// Prompt tokens per prefill pass.
    pub prefill_chunk: usize,
    /// Activations of one prefill pass.
    pub prefill_activations: u64,
    /// The compute threads' attention scores over the KV budget's context.
    pub attention_scores: u64,
    /// Threads they are counted for.
    pub threads: usize,
    /// Where the experts live.
    pub placement: ExpertPlacement,
    /// Bytes of expert records held in slots (all of them when resident).
    pub expert_cache: u64,
    /// Room for experts: the limit less every other budget.
    pub room: u64,
    /// Streamed reads bypass the OS page cache.
    pub direct_io: bool,
    /// The draft model.
    pub draft_model: u64,
    /// The prefix cache.
    pub prefix_cache: u64,
    /// Full-vocabulary logits the caller holds (`eval`).
    pub logits: u64,
}

/// KV tokens reserved when no context limit is given.
pub const DEFAULT_KV_TOKENS: usize = 32768;

/// Prompt tokens per prefill pass when the experts are resident, and the fewest a streamed model's passes
/// are cut to.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Prompt tokens per prefill pass when the experts are streamed (or mmapped) and memory allows.
pub const STREAMED_PREFILL_CHUNK: usize = 2048;

/// Smallest default expert cache.
const MIN_DEFAULT_CACHE: u64 = 256 << 20;

impl MemoryPlan {
    /// Applies the rule in the module docs.
    pub fn new(machine: MachineMemory, model: ModelFootprint, req: &PlanRequest) -> Self {
        let limit = match (req.gpu_buffers, machine.gpu_working_set) {
            (true, Some(gpu)) => machine.available.min(gpu),
            _ => machine.available,
        };
        let margin = (machine.total / 32).max(1 << 30).min(machine.total / 4);
        // A context asked for beyond the model's own is the model's: budgeting KV no sequence can use would
        // only take the experts' room.
        let own = model.context_length.max(1);
        let kv_tokens = req.context.map_or(DEFAULT_KV_TOKENS.min(own), |c| c.min(own));
        let kv_per_sequence = model
            .kv_bytes_per_token
            .saturating_mul(kv_tokens as u64)
            .saturating_add(model.state_bytes);
        let logits = model.logit_bytes_per_row.saturating_mul(req.logit_rows as u64);
        let threads = req.threads.max(1);
        let attention_scores = (model.score_bytes_per_position)
            .saturating_mul(kv_tokens as u64)
            .saturating_mul(threads as u64)
            .saturating_add(model.score_bytes_bounded);
        let before_prefill = limit
            .saturating_sub(model.resident_weights)
            .saturating_sub(logits)
            .saturating_sub(attention_scores)
            .saturating_sub(kv_per_sequence)
            .saturating_sub(req.draft_model)
            .saturating_sub(req.prefix_cache)
            .saturating_sub(model.io_buffers)
            .saturating_sub(margin);
        let activations = |chunk: usize| model.activation_bytes_per_token.saturating_mul(chunk as u64);
        // Placement is decided with the resident chunk's activations (or the one asked for) taken off.
        let room_for = |chunk: usize| before_prefill.saturating_sub(activations(chunk));
        // No pass holds more tokens than the context the KV budget covers.
        let max_chunk = kv_tokens.max(1);
        let first_chunk = req.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK).clamp(1, max_chunk);
        let placement = match req.mode {
            ExpertMode::Resident => ExpertPlacement::Resident,
            ExpertMode::Mmap => ExpertPlacement::Mmap,
            ExpertMode::Stream => ExpertPlacement::Stream,
            ExpertMode::Auto if req.cache_bytes.is_none() && model.expert_bytes <= room_for(first_chunk) => {
                ExpertPlacement::Resident
            }
            ExpertMode::Auto => ExpertPlacement::Stream,
        };
        let prefill_chunk = match (req.prefill_chunk, placement) {
            (Some(_), _) | (None, ExpertPlacement::Resident) => first_chunk,
            (None, _) => {
                let mut chunk = STREAMED_PREFILL_CHUNK;
                while chunk > DEFAULT_PREFILL_CHUNK && activations(chunk) > before_prefill / 8 {
                    chunk /= 2;
                }
                chunk.min(max_chunk)
            }
        };
        let prefill_activations = activations(prefill_chunk);
        let room = room_for(prefill_chunk);
        let expert_cache = match placement {
            ExpertPlacement::Resident | ExpertPlacement::Mmap => model.expert_bytes,
            // A cache asked for beyond every record holds every record (the engine makes no more slots).
            ExpertPlacement::Stream => req
                .cache_bytes
                .unwrap_or_else(|| room.max(MIN_DEFAULT_CACHE))
                .min(model.expert_bytes.max(1)),
        };
        let direct_io = match req.io {
            IoMode::Direct => true,
            IoMode::Buffered => false,
            // Direct when the slots take at least half the room (the page cache would mostly hold copies of
            // their records) or hold every record (each is read once; a page-cache copy would only take memory).
            IoMode::Auto => {
                placement == ExpertPlacement::Stream
                    && (expert_cache.saturating_mul(2) >= room || expert_cache >= model.expert_bytes)
            }
        };
        Self {
            machine,
            model,
            limit,
            margin,
            kv_tokens,
            kv_per_sequence,
            prefill_chunk,
            prefill_activations,
            attention_scores,
            threads,
            placement,
            expert_cache,
            room,
            direct_io,
            draft_model: req.draft_model,
            prefix_cache: req.prefix_cache,
            logits,
        }
    }

    /// What every budget adds up to.
    pub fn total(&self) -> u64 {
        let experts = match self.placement {
            ExpertPlacement::Mmap => 0,
            _ => self.expert_cache,
        };
        self.fixed_bytes().saturating_add(experts)
    }

    /// Every budget but the experts': what the model needs in memory however its experts are served.
    pub fn fixed_bytes(&self) -> u64 {
        [
            self.kv_per_sequence,
            self.prefill_activations,
            self.attention_scores,
            self.draft_model,
            self.prefix_cache,
            self.logits,
            self.model.io_buffers,
            self.margin,
        ]
        .iter()
        .fold(self.model.resident_weights, |sum, b| sum.saturating_add(*b))
    }

    /// Whether every budget fits in the limit (an explicit `--expert-cache` may overcommit the machine).
    pub fn fits(&self) -> bool {
        self.total() <= self.limit
    }
}

/// `b` bytes as GiB with two decimals, as the plan prints budgets.
pub(crate) fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.machine;
        writeln!(
            f,
            "memory plan: total {}, available {}{}{}{}",
            gib(m.total),
            gib(m.available),
            m.gpu_working_set
                .map_or(String::new(), |g| format!(", GPU working set {}", gib(g))),
            m.cgroup_limit
                .map_or(String::new(), |c| format!(" (memory cgroup limit {})", gib(c))),
            if m.measured { "" } else { " (unknown: assumed)" }
        )?;
        writeln!(f, "  limit            {:>11}", gib(self.limit))?;
        writeln!(f, "  resident weights {:>11}", gib(self.model.resident_weights))?;
        let (experts, note) = match self.placement {
            ExpertPlacement::Resident => (gib(self.expert_cache), "all resident".to_string()),
            ExpertPlacement::Stream => (
                gib(self.expert_cache),
                format!("streamed cache; experts total {}", gib(self.model.expert_bytes)),
            ),
            ExpertPlacement::Mmap => (gib(self.model.expert_bytes), "mmap: the OS decides".to_string()),
        };
        writeln!(f, "  experts          {experts:>11} ({note})")?;
        if self.placement == ExpertPlacement::Stream {
            writeln!(
                f,
                "  reads            {} (room for experts {})",
                if self.direct_io {
                    "direct: the page cache would only duplicate the slots"
                } else {
                    "buffered: the page cache is a second tier"
                },
                gib(self.room)
            )?;
        }
        writeln!(
            f,
            "  KV per sequence  {:>11} ({} tokens)",
            gib(self.kv_per_sequence),
            self.kv_tokens
        )?;
        writeln!(
            f,
            "  prefill          {:>11} ({} prompt tokens per pass)",
            gib(self.prefill_activations),
            self.prefill_chunk
        )?;
        if self.model.score_bytes_bounded > 0 {
            let (block, copies) = (
                crate::backend::MLX_SCORE_BLOCK_BYTES >> 20,
                crate::backend::MLX_SCORE_COPIES,
            );
            writeln!(
                f,
                "  attention scores {:>11} (query blocks of at most {block} MiB of scores, {copies} alive)",
                gib(self.attention_scores)
            )?;
        } else if self.attention_scores > 0 {
            writeln!(
                f,
                "  attention scores {:>11} ({} threads over {} tokens)",
                gib(self.attention_scores),
                self.threads,
                self.kv_tokens
            )?;
        }
        let optional = |b: u64| if b == 0 { "none".to_string() } else { gib(b) };
        writeln!(f, "  draft model      {:>11}", optional(self.draft_model))?;
        writeln!(f, "  prefix cache     {:>11}", optional(self.prefix_cache))?;
        if self.logits > 0 {
            writeln!(f, "  logits           {:>11} (held beside the pass)", gib(self.logits))?;
        }
        if self.model.io_buffers > 0 {
            writeln!(
                f,
                "  read buffers     {:>11} (one per I/O thread, records rewritten from it)",
                gib(self.model.io_buffers)
            )?;
        }
        writeln!(f, "  margin           {:>11}", gib(self.margin))?;
        write!(f, "  total            {:>11}", gib(self.total()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// A 64 GB Mac with 44.9 GB available (the `vm_statistics64` captured in the platform tests), Metal's
    /// default working set (48 GiB). The README's table for a 64 GB Mac is these numbers.
    fn mac_64gb() -> MachineMemory {
        MachineMemory {
            total: 64 * GIB,
            available: 44_917_735_424,
            gpu_working_set: Some(expert_store::platform::default_gpu_working_set(64 * GIB)),
            cgroup_limit: None,
            measured: true,
        }
    }

    /// Qwen3.5-122B-A10B at 4 bits (mlx-community layout): 48 layers × 256 experts of 3 matrices
    /// 1024×3072 at 4.5 bits/weight; 12 full-attention layers × 2 KV heads × 256 dims; 36 linear layers with
    /// a 64×128×128 f32 state and a 3-row conv history of 12288 channels; ~6.2 B resident parameters at
    /// 4.5 bits (embedding and head 0.76 B each, attention and linear-attention projections, shared experts).
    fn qwen35_122b() -> ModelFootprint {
        let record = 3 * (1024 * 3072 / 2 + 2 * 2 * 1024 * 3072 / 64);
        ModelFootprint {
            resident_weights: 3_500_000_000,
            expert_bytes: 48 * 256 * record,
            kv_bytes_per_token: 12 * 2 * 2 * 256 * 4,
            // Twice, as `models::footprint` counts it: a forward writes the next state beside the current.
            state_bytes: 2 * 36 * (64 * 128 * 128 + 3 * 12288) * 4,
            logit_bytes_per_row: 248_320 * 4,
            context_length: 262_144,
            // 3 hidden vectors + the router's 256 logits + 8 experts' inputs, outputs, gate and up outputs
            // + the shared expert's 1024-wide intermediates (the widest stage), f32.
            activation_bytes_per_token: (3 * 3072 + 256 + 8 * (2 * 3072 + 2 * 1024) + 3 * 1024 + 1) * 4,
            // 4 positions × 16 query heads per key/value head, f32.
            score_bytes_per_position: 4 * 16 * 4,
            score_bytes_bounded: 0,
            io_buffers: 0,
        }
    }

    #[test]
    fn a_64gb_mac_streams_qwen35_122b_with_these_budgets() {
        let machine = mac_64gb();
        let model = qwen35_122b();
        assert_eq!(model.expert_bytes, 65_229_815_808);
        // Twelve compute threads (an M4 Pro's cores).
        let req = PlanRequest {
            threads: 12,
            ..Default::default()
        };
        let cpu = MemoryPlan::new(machine, model, &req);
        assert_eq!(cpu.limit, machine.available);
        assert_eq!(cpu.margin, 2 * GIB);
        assert_eq!(cpu.kv_tokens, 32768);
        assert_eq!(cpu.kv_per_sequence, 32768 * 49152 + 2 * 36 * (1_048_576 + 36864) * 4);
        assert_eq!(cpu.placement, ExpertPlacement::Stream);
        assert_eq!(cpu.kv_per_sequence, 1_923_219_456);
        // Streamed: prefill passes of 2048 tokens, whose activations come off the room.
        assert_eq!(cpu.prefill_chunk, 2048);
        assert_eq!(cpu.prefill_activations, 2048 * 312_324);
        // The slot cache takes all the room the other budgets leave, and reads bypass the page cache.
        // Each compute thread's attention scores over the 32768 tokens.
        assert_eq!((cpu.threads, cpu.attention_scores), (12, 12 * 256 * 32768));
        assert_eq!(
            cpu.room,
            44_917_735_424 - 3_500_000_000 - 1_923_219_456 - 2048 * 312_324 - 12 * 256 * 32768 - 2 * GIB
        );
        assert_eq!(cpu.room, 36_606_729_472);
        assert_eq!(cpu.expert_cache, cpu.room);
        assert_eq!(cpu.total(), cpu.limit);
        // Each compute thread keeps its own scores.
        let one = MemoryPlan::new(
            machine,
            model,
            &PlanRequest {
                threads: 1,
                ..Default::default()
            },
        );
        assert_eq!(one.room - cpu.room, 11 * 256 * 32768);
        assert!(cpu.to_string().contains("(12 threads over 32768 tokens)"), "{cpu}");
        assert!(cpu.direct_io);
        assert!(cpu.to_string().contains("reads            direct"), "{cpu}");
        // On Metal the same machine is capped by the working set (48 GiB > 45 GB available: no change).
        let gpu = MemoryPlan::new(
            machine,
            model,
            &PlanRequest {
                gpu_buffers: true,
                ..Default::default()
            },
        );
        assert_eq!(gpu.limit, machine.available);
        assert!(gpu.total() <= gpu.limit, "{gpu}");
        let text = gpu.to_string();
        assert!(
            text.contains("GPU working set 48.00 GiB") && text.contains("streamed cache"),
            "{text}"
        );
    }

    #[test]
    fn auto_keeps_experts_resident_only_when_everything_fits() {
        let machine = mac_64gb();
        // Qwen3-30B-A3B at 4 bits: 16 GB of experts, 1 GB resident: resident on this Mac.
        let small = ModelFootprint {
            resident_weights: GIB,
            expert_bytes: 16 * GIB,
            kv_bytes_per_token: 48 * 2 * 4 * 128 * 4,
            state_bytes: 0,
            logit_bytes_per_row: 151_936 * 4,
            context_length: 40960,
            activation_bytes_per_token: 200_000,
            score_bytes_per_position: 4 * 8 * 4,
            score_bytes_bounded: 0,
            io_buffers: 0,
        };
        // The I/O threads' read buffers take their bytes off the room, and count.
        let buffered = ModelFootprint {
            io_buffers: 3 * GIB / 4,
            ..small
        };
        let req = PlanRequest {
            mode: ExpertMode::Stream,
            ..PlanRequest::default()
        };
        let (with, without) = (
            MemoryPlan::new(machine, buffered, &req),
            MemoryPlan::new(machine, small, &req),
        );
        assert_eq!(without.room - with.room, 3 * GIB / 4);
        assert_eq!(with.fixed_bytes() - without.fixed_bytes(), 3 * GIB / 4);
        assert!(with.to_string().contains("read buffers") && !without.to_string().contains("read buffers"));
        // Logits a command holds beside the pass (`eval`'s) take their bytes off the room, and count.
        let plain = MemoryPlan::new(machine, small, &PlanRequest::default());
        let eval = MemoryPlan::new(
            machine,
            small,
            &PlanRequest {
                logit_rows: 2 * 4096,
                ..PlanRequest::default()
            },
        );
        assert_eq!(eval.logits, 2 * 4096 * 151_936 * 4);
        assert_eq!(plain.room - eval.room, eval.logits);
        assert_eq!(eval.fixed_bytes() - plain.fixed_bytes(), eval.logits);
        assert!(format!("{eval}").contains("logits") && !format!("{plain}").contains("logits"));
        let p = MemoryPlan::new(machine, small, &PlanRequest::default());
        assert_eq!(p.placement, ExpertPlacement::Resident);
        assert_eq!(p.expert_cache, 16 * GIB);
        // Resident experts are never read again: passes of 512 tokens compute as fast and hold less.
        assert_eq!((p.prefill_chunk, p.prefill_activations), (512, 512 * 200_000));
        assert!(p.to_string().contains("(512 prompt tokens per pass)"), "{p}");
        // The same model when the GPU may wire only 16 GiB: streamed.
        let tight = MachineMemory {
            gpu_working_set: Some(16 * GIB),
            cgroup_limit: None,
            ..machine
        };
        let req = PlanRequest {
            gpu_buffers: true,
            ..Default::default()
        };
        assert_eq!(MemoryPlan::new(tight, small, &req).placement, ExpertPlacement::Stream);
        // An explicit cache size means streaming, and is kept as given.
        let req = PlanRequest {
            cache_bytes: Some(3 * GIB),
            ..Default::default()
        };
        let p = MemoryPlan::new(machine, small, &req);
        assert_eq!((p.placement, p.expert_cache), (ExpertPlacement::Stream, 3 * GIB));
        assert!(p.fits() && MemoryPlan::new(machine, small, &PlanRequest::default()).fits());
        // A cache beyond the machine's room is kept as given, and the plan says it does not fit...
        let over = PlanRequest {
            cache_bytes: Some(64 * GIB),
            ..Default::default()
        };
        let big = ModelFootprint {
            expert_bytes: 100 * GIB,
            ..small
        };
        assert!(!MemoryPlan::new(machine, big, &over).fits());
        assert_eq!(MemoryPlan::new(machine, big, &over).expert_cache, 64 * GIB);
        // ... unless it is beyond every record too: it holds them all, no more (the engine makes no more slots).
        let all = MemoryPlan::new(machine, small, &over);
        assert!(all.fits(), "{all}");
        assert_eq!((all.placement, all.expert_cache), (ExpertPlacement::Stream, 16 * GIB));
        // It holds every record, each read once: directly (a page-cache copy would only take memory), as
        // `--experts stream` with the default cache on a model smaller than half the room.
        assert!(all.direct_io, "{all}");
        let streamed = PlanRequest {
            mode: ExpertMode::Stream,
            ..Default::default()
        };
        let p_all = MemoryPlan::new(machine, small, &streamed);
        assert_eq!(p_all.expert_cache, small.expert_bytes);
        assert!(p_all.expert_cache * 2 < p_all.room && p_all.direct_io, "{p_all}");
        // ... and leaves the page cache more room than the slots: it is the second tier, reads go through it.
        assert!(!p.direct_io);
        for (io, direct) in [(IoMode::Direct, true), (IoMode::Buffered, false)] {
            let req = PlanRequest { io, ..req };
            assert_eq!(MemoryPlan::new(machine, small, &req).direct_io, direct);
        }
        // Resident experts are read once, through the page cache.
        assert!(!MemoryPlan::new(machine, small, &PlanRequest::default()).direct_io);
        // A context limit sizes the KV budget exactly.
        let req = PlanRequest {
            context: Some(1000),
            ..Default::default()
        };
        assert_eq!(
            MemoryPlan::new(machine, small, &req).kv_per_sequence,
            1000 * 48 * 2 * 4 * 128 * 4
        );
        // One beyond the model's own context plans the model's: no sequence could use the rest.
        let req = PlanRequest {
            context: Some(4_000_000_000),
            ..Default::default()
        };
        let p = MemoryPlan::new(machine, small, &req);
        assert_eq!(
            (p.kv_tokens, p.placement),
            (small.context_length, ExpertPlacement::Resident),
            "{p}"
        );
    }

    #[test]
    fn the_default_cache_stays_between_256_mib_and_the_experts() {
        // No room at all: a quarter of 1 GiB available, which the margin (at most a quarter) takes.
        let tiny = MachineMemory {
            total: GIB,
            available: GIB / 4,
            gpu_working_set: None,
            cgroup_limit: None,
            measured: true,
        };
        let model = ModelFootprint {
            expert_bytes: 100 * GIB,
            context_length: 10,
            ..Default::default()
        };
        let p = MemoryPlan::new(tiny, model, &PlanRequest::default());
        assert_eq!((p.placement, p.expert_cache), (ExpertPlacement::Stream, 256 << 20));
        // A 1 GiB container keeps a quarter as margin, not all of it.
        assert_eq!(p.margin, GIB / 4);
        let few = ModelFootprint {
            expert_bytes: 1000,
            ..model
        };
        let req = PlanRequest {
            mode: ExpertMode::Stream,
            ..Default::default()
        };
        assert_eq!(MemoryPlan::new(mac_64gb(), few, &req).expert_cache, 1000);
    }

    #[test]
    fn streamed_prefill_passes_shrink_to_fit_an_eighth_of_the_room() {
        // 20 GiB available, 1 GiB resident, no KV to speak of, experts bigger than the room: streamed.
        let machine = MachineMemory {
            total: 24 * GIB,
            available: 20 * GIB,
            gpu_working_set: None,
            cgroup_limit: None,
            measured: true,
        };
        let model = |per_token: u64| ModelFootprint {
            resident_weights: GIB,
            expert_bytes: 100 * GIB,
            context_length: 32768,
            activation_bytes_per_token: per_token,
            ..Default::default()
        };
        let before = 20 * GIB - GIB - GIB; // less the resident weights and the 1 GiB margin
        let chunk = |per_token: u64, req: &PlanRequest| {
            let p = MemoryPlan::new(machine, model(per_token), req);
            assert_eq!(p.placement, ExpertPlacement::Stream);
            assert_eq!(p.room, before.saturating_sub(p.prefill_activations), "{p}");
            assert_eq!(p.fits(), p.prefill_activations <= before, "{p}");
            p.prefill_chunk
        };
        let auto = PlanRequest::default();
        // 2048 tokens fit in an eighth of the room up to before / 8 / 2048 bytes a token.
        let edge = before / 8 / 2048;
        assert_eq!(chunk(edge, &auto), 2048);
        assert_eq!(chunk(edge + 1, &auto), 1024);
        assert_eq!(chunk(2 * edge + 1, &auto), 512);
        // Never below 512 by default, even when that takes more than an eighth (or more than there is: the
        // plan then says it does not fit).
        assert_eq!(chunk(4 * edge, &auto), 512);
        assert_eq!(chunk(100 * edge, &auto), 512);
        // `--prefill-chunk` is kept as given, whatever it costs.
        let asked = PlanRequest {
            prefill_chunk: Some(4096),
            ..Default::default()
        };
        assert_eq!(chunk(edge, &asked), 4096);
        // Mmapped experts are read per pass as well.
        let mmap = PlanRequest {
            mode: ExpertMode::Mmap,
            ..Default::default()
        };
        assert_eq!(MemoryPlan::new(machine, model(edge), &mmap).prefill_chunk, 2048);
        // No pass is longer than the context the KV budget covers, asked for or not.
        let short = PlanRequest {
            context: Some(1000),
            ..Default::default()
        };
        assert_eq!(chunk(edge, &short), 1000);
        assert_eq!(
            chunk(
                edge,
                &PlanRequest {
                    prefill_chunk: Some(4096),
                    ..short
                }
            ),
            1000
        );
        // An absurd request saturates rather than wraps: the plan says it does not fit.
        let absurd = PlanRequest {
            prefill_chunk: Some(usize::MAX),
            ..Default::default()
        };
        assert!(!MemoryPlan::new(machine, model(u64::MAX / 2), &absurd).fits());
    }

    #[test]
    fn the_prefill_budget_can_tip_auto_into_streaming() {
        // Experts that fit the room exactly, until a 512-token pass's activations come off it.
        let machine = mac_64gb();
        let base = ModelFootprint {
            resident_weights: GIB,
            context_length: 32768,
            ..Default::default()
        };
        let room = MemoryPlan::new(machine, base, &PlanRequest::default()).room;
        let fits = ModelFootprint {
            expert_bytes: room - 512 * 1000,
            activation_bytes_per_token: 1000,
            ..base
        };
        let p = MemoryPlan::new(machine, fits, &PlanRequest::default());
        assert_eq!((p.placement, p.prefill_chunk), (ExpertPlacement::Resident, 512), "{p}");
        assert!(p.fits());
        let over = ModelFootprint {
            expert_bytes: room - 512 * 1000 + 1,
            ..fits
        };
        assert_eq!(
            MemoryPlan::new(machine, over, &PlanRequest::default()).placement,
            ExpertPlacement::Stream
        );
    }
}
