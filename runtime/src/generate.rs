//! The decode loop: prompt → prefill → sample → stream text, until EOS, a stop string, the token budget or
//! the context limit.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::location::ModelLocation;
use crate::model::{DecoderModel, ForwardOptions};
use crate::models::load_located;
use crate::options::ExpertOptions;
use crate::sampling::{Sampler, SamplingParams};
use crate::text::{ChatMessage, StopMatcher, StreamDecoder, TextCodec};

/// What to continue.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text, tokenized as is (with the tokenizer's own special tokens, e.g. BOS).
    Raw(String),
    /// Messages rendered through the model's chat template, ending with the assistant's turn.
    Chat(Vec<ChatMessage>),
    /// Messages rendered with extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    ChatWith(Vec<ChatMessage>, serde_json::Map<String, serde_json::Value>),
    /// Token ids.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Bytes of text its tokenization reads, before a chat template adds its own (0 for token ids).
    pub fn text_bytes(&self) -> usize {
        let message = |m: &ChatMessage| m.content.len() + m.reasoning_content.as_ref().map_or(0, String::len);
        match self {
            Prompt::Raw(text) => text.len(),
            Prompt::Chat(msgs) | Prompt::ChatWith(msgs, _) => msgs.iter().map(message).sum(),
            Prompt::Tokens(_) => 0,
        }
    }

    /// Whether it is rendered from messages (a reply then starts on its own, not after the prompt's text).
    pub fn is_chat(&self) -> bool {
        matches!(self, Prompt::Chat(_) | Prompt::ChatWith(..))
    }

    /// Token ids of the prompt.
    pub fn tokenize(&self, codec: &TextCodec) -> Result<Vec<u32>> {
        match self {
            Prompt::Raw(text) => codec.encode(text, true),
            // The template writes the special tokens itself, as in HF's apply_chat_template.
            Prompt::Chat(msgs) => codec.encode(&codec.apply_chat_template(msgs, true)?, false),
            Prompt::ChatWith(msgs, kwargs) => codec.encode(&codec.apply_chat_template_with(msgs, true, kwargs)?, false),
            Prompt::Tokens(t) => Ok(t.clone()),
        }
    }
}

/// What a prompt must fit: the context limit (the plan's) and the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimits {
    /// Context limit in tokens, prompt and completion together.
    pub context: usize,
    /// Token ids below this are in the vocabulary.
    pub vocab_size: usize,
}

impl PromptLimits {
    /// Rejects a tokenized prompt that a generation could not start on: no tokens, longer than the context
    /// limit (this one, or the request's lower one), or an id outside the vocabulary.
    pub fn check(&self, ids: &[u32], params: &GenerateParams) -> Result<()> {
        let ctx = self.context_for(params);
        if ids.is_empty() {
            return Err(ModelError::InvalidArgument("the prompt is empty (no tokens)".into()));
        }
        if ids.len() > ctx {
            return Err(ModelError::Limit(format!(
                "the prompt has {} tokens but the context limit is {ctx} tokens",
                ids.len()
            )));
        }
        crate::model::check_vocabulary(ids, self.vocab_size)
    }

    /// The context a request may fill: a request may lower the planned limit, never raise it.
    fn context_for(&self, params: &GenerateParams) -> usize {
        (params.context_limit.unwrap_or(usize::MAX)).min(self.context)
    }
}

/// How to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop strings (not included in the output).
    pub stop: Vec<String>,
    /// Experts per token (`None`: the model's own).
    pub expert_top_k: Option<usize>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Lower the context limit (`None`: the one the memory plan's KV budget covers,
    /// [`DecoderModel::context_limit`](crate::DecoderModel::context_limit), which also caps it).
    pub context_limit: Option<usize>,
    /// Prompt tokens per forward pass during prefill (`None`: the memory plan's, which budgets its
    /// activations; a longer one should be planned too, through `ExpertOptions::prefill_chunk`). Bounds
    /// activation memory for long prompts without changing results (a token's numbers do not depend on its
    /// batch).
    pub prefill_chunk: Option<usize>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            expert_top_k: None,
            ignore_eos: false,
            context_limit: None,
            prefill_chunk: None,
        }
    }
}

/// What [`Pipeline::generate_tokens`] reports as it goes; its callback returns `false` to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress<'a> {
    /// A chunk of the prompt was read and more follow (no token yet).
    Prefill,
    /// A token was generated: the text it completes, empty while a character or a possible stop string is
    /// held back.
    Token(&'a str),
    /// Text held back until the end, after the last token.
    Tail(&'a str),
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The text callback asked to stop (e.g. the client went away).
    Cancelled,
}

/// Counts and timings of one generation.
#[derive(Debug, Clone)]
pub struct GenerationStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Time for the prompt's forward pass.
    pub prefill_time: Duration,
    /// Tokens generated (an EOS token counts; it is not printed).
    pub generated_tokens: usize,
    /// The generated token ids.
    pub tokens: Vec<u32>,
    /// Single-token forward passes after the prefill.
    pub decode_steps: usize,
    /// Time spent in those steps (and sampling).
    pub decode_time: Duration,
    /// Why it ended.
    pub finish: FinishReason,
}

/// A model with its tokenizer: everything `generate` needs.
pub struct Pipeline {
    /// The network.
    pub model: DecoderModel,
    /// Tokenizer, chat template, EOS ids (shared: a server tokenizes requests beside the engine).
    pub codec: Arc<TextCodec>,
}

impl Pipeline {
    /// Loads the model and tokenizer at `path` (a model directory or a packed store), default options.
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, &ExpertOptions::default())
    }

    /// Loads the model and tokenizer at `path` with these expert-serving options.
    pub fn load_with(path: &Path, opts: &ExpertOptions) -> Result<Self> {
        let loc = ModelLocation::resolve(path)?;
        let config = ModelConfig::load(loc.model_dir())?;
        let codec = TextCodec::load(loc.model_dir(), &config.eos_token_ids())?;
        let model = load_located(&loc, config, opts)?;
        Ok(Self {
            model,
            codec: Arc::new(codec),
        })
    }

    /// Token ids of a prompt.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        prompt.tokenize(&self.codec)
    }

    /// What a prompt must fit to be generated from.
    pub fn prompt_limits(&self) -> PromptLimits {
        PromptLimits {
            context: self.model.context_limit(),
            vocab_size: self.model.info.vocab_size,
        }
    }

    /// Rejects a tokenized prompt that [`Pipeline::generate`] could not start on: no tokens, longer than the
    /// context limit (the plan's, or the request's lower one), or an id outside the vocabulary. A server calls it
    /// before it answers, so such a request gets an error status rather than a stream that fails.
    pub fn check_prompt(&self, ids: &[u32], params: &GenerateParams) -> Result<()> {
        self.prompt_limits().check(ids, params)
    }

    /// The context a request may fill: a request may lower the planned limit, never raise it.
    fn context_for(&self, params: &GenerateParams) -> usize {
        self.prompt_limits().context_for(params)
    }

    /// Generates from `prompt`, calling `on_text` once per generated token with the text it completes (possibly
    /// empty while a character or a possible stop string is held back), and with empty text between a long
    /// prompt's chunks; `on_text` returns `false` to stop.
    pub fn generate(
        &self,
        prompt: &Prompt,
        params: &GenerateParams,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<GenerationStats> {
        let ids = self.tokenize(prompt)?;
        self.generate_tokens(&ids, prompt.is_chat(), params, |p| match p {
            Progress::Prefill => on_text(""),
            Progress::Token(t) | Progress::Tail(t) => on_text(t),
        })
    }

    /// [`Pipeline::generate`] from a tokenized prompt, reporting each [`Progress`]; `chat` says it came from
    /// messages. A text prompt's
    /// continuation is decoded after the prompt's last tokens, so that prompt + completion is the text the
    /// tokens spell: tokenizers that strip the first token's leading space (SentencePiece's `▁`, Mixtral's)
    /// would otherwise turn " fox" into "fox". A chat reply starts on its own, as HF and mlx-lm decode it.
    pub fn generate_tokens(
        &self,
        ids: &[u32],
        chat: bool,
        params: &GenerateParams,
        mut on_progress: impl FnMut(Progress<'_>) -> bool,
    ) -> Result<GenerationStats> {
        self.check_prompt(ids, params)?;
        let mut sampler = Sampler::new(params.sampling.clone())?;
        let opts = ForwardOptions {
            top_k: params.expert_top_k,
            all_logits: false,
        };
        let mut cache = self.model.new_cache();
        let t0 = Instant::now();
        let mut logits = Vec::new();
        let chunk = params.prefill_chunk.unwrap_or(self.model.memory_plan.prefill_chunk);
        let mut chunks = ids.chunks(chunk.max(1)).peekable();
        let mut cancelled = false;
        while let Some(c) = chunks.next() {
            logits = self.model.forward(c, &mut cache, &opts)?;
            // Between a long prompt's chunks the receiver may cancel too (an agent's 30k-token prompt can take
            // minutes).
            if chunks.peek().is_some() && !on_progress(Progress::Prefill) {
                cancelled = true;
                break;
            }
        }
        let prefill_time = t0.elapsed();

        let t1 = Instant::now();
        let mut generated: Vec<u32> = Vec::new();
        let mut decoder = if chat {
            StreamDecoder::new()
        } else {
            StreamDecoder::after(ids)
        };
        let mut stops = StopMatcher::new(&params.stop);
        let mut decode_steps = 0;
        let mut stop_string_hit = false;
        let mut finish = loop {
            if cancelled {
                break FinishReason::Cancelled;
            }
            if generated.len() >= params.max_tokens {
                break FinishReason::Length;
            }
            let next = sampler.sample(&logits, ids, &generated);
            generated.push(next);
            if !params.ignore_eos && self.codec.eos_ids().contains(&next) {
                break FinishReason::Stop;
            }
            let (text, hit) = stops.push(&decoder.push(&self.codec, next)?);
            // Called for every token, even when its text is held back, so a receiver can cancel promptly.
            if !on_progress(Progress::Token(&text)) {
                break FinishReason::Cancelled;
            }
            if hit {
                stop_string_hit = true;
                break FinishReason::Stop;
            }
            if generated.len() >= params.max_tokens {
                break FinishReason::Length;
            }
            if cache.len() >= self.context_for(params) {
                break FinishReason::Length;
            }
            logits = self.model.forward(&[next], &mut cache, &opts)?;
            decode_steps += 1;
        };
        // Flush text held back for an incomplete character or a possible stop string, unless the output
        // already ended at a stop string or the receiver is gone.
        if finish != FinishReason::Cancelled && !stop_string_hit {
            let (mut rest, hit) = stops.push(&decoder.finish(&self.codec)?);
            if hit {
                // A stop string in text held back until now (a last token that ends in part of a character):
                // the output ended at it, not at the length.
                finish = FinishReason::Stop;
            } else {
                rest.push_str(&stops.finish());
            }
            if !rest.is_empty() {
                on_progress(Progress::Tail(&rest));
            }
        }
        Ok(GenerationStats {
            prompt_tokens: ids.len(),
            prefill_time,
            generated_tokens: generated.len(),
            tokens: generated,
            decode_steps,
            decode_time: t1.elapsed(),
            finish,
        })
    }
}
