//! The OpenAI-compatible endpoints. Handlers stay thin: they validate, queue a job, and relay its events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{to_bytes, Body};
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use sluice_runtime::{
    ChatMessage, FinishReason, GenerateParams, GenerationDefaults, ModelError, Prompt, PromptLimits, SamplingParams,
    TextCodec,
};
use tokio::sync::mpsc;

use crate::engine::{EngineHandle, Event, Job, SubmitError};
use crate::metrics::Metrics;

/// Largest request body accepted.
pub const MAX_BODY: usize = 4 << 20;

/// Bytes of prompt text tokenized at once, over every request: one largest body's. The tokenizer holds ~110
/// bytes per byte of text at its peak (a 4 MiB prompt: ~460 MiB), so one core per prompt alone would let a
/// burst of long prompts hold gigabytes beyond the memory plan; this keeps it within the plan's margin.
pub const TOKENIZING_BYTES: usize = MAX_BODY;

/// State shared by the handlers.
pub struct AppState {
    /// The id clients must send as `model`.
    pub model_id: String,
    /// Set once the model has loaded.
    pub loaded: std::sync::OnceLock<Loaded>,
}

/// What exists once the model has loaded.
pub struct Loaded {
    /// The queue to the engine.
    pub engine: EngineHandle,
    /// Metrics registry.
    pub metrics: Arc<Metrics>,
    /// Experts per token the server runs (requests may lower it).
    pub top_k: usize,
    /// The model's tokenizer and chat template (requests are tokenized by their handlers).
    pub codec: Arc<TextCodec>,
    /// What a prompt must fit: the context limit (the one the memory plan's KV budget covers) and the vocabulary.
    pub limits: PromptLimits,
    /// Sampling values for the fields a request leaves out (the model's `generation_config.json`'s, or none).
    pub sampling_defaults: GenerationDefaults,
    /// Prompts tokenized at once (see `run`).
    pub tokenizing: Arc<tokio::sync::Semaphore>,
    /// Bytes of their text tokenized at once ([`TOKENIZING_BYTES`] permits).
    pub tokenizing_bytes: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    fn loaded(&self) -> Result<&Loaded, ApiError> {
        self.loaded.get().ok_or_else(ApiError::loading)
    }
}

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    fn with(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code),
        }
    }

    /// 503 while the model loads.
    pub fn loading() -> Self {
        Self::with(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "model_loading",
            "the model is still loading",
        )
    }

    /// 503 once the engine thread has ended.
    fn engine_stopped() -> Self {
        Self::with(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "engine_stopped",
            "the engine stopped; restart the server",
        )
    }

    /// 429 when the request queue is full.
    fn queue_full() -> Self {
        Self::with(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            "the request queue is full; retry later",
        )
    }

    /// 404 for a model id this server does not serve.
    fn model_not_found(asked: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("model `{asked}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    /// 405 for a known path asked with another method.
    pub fn method_not_allowed() -> Self {
        Self::with(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            "this endpoint does not take that method",
        )
    }

    /// 404 for an unknown path.
    pub fn not_found() -> Self {
        Self::with(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            "no such endpoint",
        )
    }

    /// The error for a failed generation; a prompt past the context names the chat's `messages` or the
    /// completion's `prompt`.
    fn from_model(e: ModelError, chat: bool) -> Self {
        match e {
            ModelError::Limit(m) => {
                let mut e = Self::bad(m, Some(if chat { "messages" } else { "prompt" }));
                e.code = Some("context_length_exceeded");
                e
            }
            ModelError::InvalidArgument(m) | ModelError::Tokenizer(m) => Self::bad(m, None),
            other => Self::with(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
                other.to_string(),
            ),
        }
    }

    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // A full queue frees a place when a generation ends: try again soon.
            r.headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

/// `stop`: one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string or a list of parts (only text parts are supported).
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
    /// An assistant turn's reasoning (vLLM's field), passed to the template (Qwen3's renders it).
    reasoning_content: Option<String>,
    /// An assistant turn's tool calls (and the legacy `function_call`): refused while tools are, rather than
    /// dropped from the conversation the model sees.
    tool_calls: Option<Value>,
    function_call: Option<Value>,
}

// Booleans are `Option`s: clients send `null` for "the default".
#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The fields both completion endpoints share.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    /// llama.cpp's name for `max_tokens` (its OpenAI endpoints read it too); -1 there means no limit.
    n_predict: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    /// llama.cpp's name for `repetition_penalty`.
    repeat_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    /// An integer; a negative one (llama.cpp's -1) asks for a random seed.
    seed: Option<Value>,
    stop: Option<Stop>,
    n: Option<i64>,
    tools: Option<Value>,
    response_format: Option<Value>,
    // OpenAI fields sluice does not implement: asked for, they get a 400 (`Common::reject_unsupported`).
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    logit_bias: Option<Value>,
    echo: Option<Value>,
    suffix: Option<Value>,
    best_of: Option<Value>,
    tool_choice: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
    // Fields of other OpenAI-compatible servers (vLLM, llama.cpp) and newer OpenAI ones that change the output:
    // refused when asked for, not silently ignored.
    guided_json: Option<Value>,
    guided_regex: Option<Value>,
    guided_choice: Option<Value>,
    guided_grammar: Option<Value>,
    grammar: Option<Value>,
    json_schema: Option<Value>,
    stop_token_ids: Option<Value>,
    min_tokens: Option<Value>,
    include_stop_str_in_output: Option<Value>,
    reasoning_effort: Option<Value>,
    modalities: Option<Value>,
    audio: Option<Value>,
    prediction: Option<Value>,
    repeat_last_n: Option<Value>,
    typical_p: Option<Value>,
    mirostat: Option<Value>,
    dry_multiplier: Option<Value>,
    xtc_probability: Option<Value>,
    bad_words: Option<Value>,
    allowed_token_ids: Option<Value>,
    structured_outputs: Option<Value>,
    truncate_prompt_tokens: Option<Value>,
    skip_special_tokens: Option<Value>,
    add_generation_prompt: Option<Value>,
    continue_final_message: Option<Value>,
    chat_template: Option<Value>,
    /// sluice extension: experts per token for this request (at most the server's `--top-k`).
    expert_top_k: Option<i64>,
    /// Extension (as in vLLM): keep generating past end-of-sequence tokens.
    ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    /// Extra variables for the chat template (vLLM's and llama.cpp's extension), e.g. Qwen3's
    /// `{"enable_thinking": false}`.
    chat_template_kwargs: Option<Value>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct CompletionRequest {
    prompt: Value,
    #[serde(flatten)]
    common: Common,
}

/// Reads and parses a JSON body, with OpenAI errors for oversized or malformed input.
async fn parse<T: for<'de> Deserialize<'de>>(req: Request) -> Result<T, ApiError> {
    let bytes = to_bytes(req.into_body(), MAX_BODY).await.map_err(|e| {
        // The limit's error says so in its own words; anything else is a body the client did not finish.
        if e.to_string().contains("length limit") {
            ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!("request body exceeds {MAX_BODY} bytes"),
                kind: "invalid_request_error",
                param: None,
                code: Some("request_too_large"),
            }
        } else {
            ApiError::bad(format!("the request body could not be read: {e}"), None)
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(format!("invalid request body: {e}"), None))
}

/// The Unix time of this server's first request id, in seconds.
fn started_at() -> u64 {
    static AT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *AT.get_or_init(now)
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Common {
    /// A 400 for a field of OpenAI's API that sluice does not implement, when a request asks for it (its
    /// "off" values pass: clients send them by default), instead of a reply that silently lacks it.
    fn reject_unsupported(&self) -> Result<(), ApiError> {
        let asked =
            |v: &Option<Value>, off: &dyn Fn(&Value) -> bool| v.as_ref().is_some_and(|v| !(v.is_null() || off(v)));
        let none = |v: &Value| v.as_array().is_some_and(|a| a.is_empty()) || v.as_str() == Some("");
        let number = |want: f64| move |v: &Value| v.as_f64() == Some(want);
        let fields: [(&'static str, bool); 35] = [
            ("guided_json", asked(&self.guided_json, &none)),
            ("guided_regex", asked(&self.guided_regex, &none)),
            ("guided_choice", asked(&self.guided_choice, &none)),
            ("guided_grammar", asked(&self.guided_grammar, &none)),
            ("grammar", asked(&self.grammar, &none)),
            ("json_schema", asked(&self.json_schema, &none)),
            ("stop_token_ids", asked(&self.stop_token_ids, &none)),
            ("min_tokens", asked(&self.min_tokens, &|v| v.as_i64() == Some(0))),
            (
                "include_stop_str_in_output",
                asked(&self.include_stop_str_in_output, &|v| v == &Value::Bool(false)),
            ),
            ("reasoning_effort", asked(&self.reasoning_effort, &none)),
            ("modalities", asked(&self.modalities, &|v| v == &json!(["text"]))),
            ("audio", asked(&self.audio, &none)),
            ("prediction", asked(&self.prediction, &none)),
            ("logprobs", asked(&self.logprobs, &|v| v == &Value::Bool(false))),
            ("top_logprobs", asked(&self.top_logprobs, &|v| v.as_i64() == Some(0))),
            (
                "logit_bias",
                asked(&self.logit_bias, &|v| v.as_object().is_some_and(|o| o.is_empty())),
            ),
            ("echo", asked(&self.echo, &|v| v == &Value::Bool(false))),
            ("suffix", asked(&self.suffix, &|v| v.as_str() == Some(""))),
            ("best_of", asked(&self.best_of, &|v| v.as_i64() == Some(1))),
            // Tools themselves are refused above, so "auto" has none to choose from.
            (
                "tool_choice",
                asked(&self.tool_choice, &|v| matches!(v.as_str(), Some("none" | "auto"))),
            ),
            // The legacy form of tools.
            (
                "functions",
                asked(&self.functions, &|v| v.as_array().is_some_and(|a| a.is_empty())),
            ),
            (
                "function_call",
                asked(&self.function_call, &|v| matches!(v.as_str(), Some("none" | "auto"))),
            ),
            // llama.cpp's samplers. Its penalties' window matters only with a penalty on (clients send its
            // default 64 with none); -1 is the whole history, which the server's penalties cover.
            (
                "repeat_last_n",
                self.penalized() && asked(&self.repeat_last_n, &number(-1.0)),
            ),
            ("typical_p", asked(&self.typical_p, &number(1.0))),
            ("mirostat", asked(&self.mirostat, &number(0.0))),
            ("dry_multiplier", asked(&self.dry_multiplier, &number(0.0))),
            ("xtc_probability", asked(&self.xtc_probability, &number(0.0))),
            // vLLM's.
            ("bad_words", asked(&self.bad_words, &none)),
            ("allowed_token_ids", asked(&self.allowed_token_ids, &none)),
            ("structured_outputs", asked(&self.structured_outputs, &none)),
            ("truncate_prompt_tokens", asked(&self.truncate_prompt_tokens, &none)),
            (
                "skip_special_tokens",
                asked(&self.skip_special_tokens, &|v| v == &Value::Bool(true)),
            ),
            // How the chat template is rendered: a new assistant turn from the server's own template.
            (
                "add_generation_prompt",
                asked(&self.add_generation_prompt, &|v| v == &Value::Bool(true)),
            ),
            (
                "continue_final_message",
                asked(&self.continue_final_message, &|v| v == &Value::Bool(false)),
            ),
            ("chat_template", asked(&self.chat_template, &none)),
        ];
        match fields.into_iter().find(|&(_, asked)| asked) {
            Some((field, _)) => Err(ApiError::bad(format!("{field} is not supported yet"), Some(field))),
            None => Ok(()),
        }
    }

    /// Whether a repetition, frequency or presence penalty is on.
    fn penalized(&self) -> bool {
        let off = |v: Option<f32>, none: f32| v.is_none_or(|v| v == none);
        !(off(self.repetition_penalty, 1.0)
            && off(self.repeat_penalty, 1.0)
            && off(self.frequency_penalty, 0.0)
            && off(self.presence_penalty, 0.0))
    }

    /// The seed asked for: an integer, a negative one (llama.cpp's -1) meaning random.
    fn seed(&self) -> Result<Option<u64>, ApiError> {
        match &self.seed {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match (v.as_u64(), v.as_i64()) {
                (Some(s), _) => Ok(Some(s)),
                (None, Some(n)) if n < 0 => Ok(None),
                _ => Err(ApiError::bad("seed must be an integer", Some("seed"))),
            },
        }
    }

    /// Checks the fields and builds generation settings.
    fn params(&self, st: &AppState, l: &Loaded, chat: bool) -> Result<GenerateParams, ApiError> {
        if let Some(m) = &self.model {
            if m != &st.model_id {
                return Err(ApiError::model_not_found(m, &st.model_id));
            }
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad(
                "n must be 1 (several choices are not supported yet)",
                Some("n"),
            ));
        }
        self.reject_unsupported()?;
        if self
            .tools
            .as_ref()
            .is_some_and(|t| !(t.is_null() || t.as_array().is_some_and(|a| a.is_empty())))
        {
            return Err(ApiError::bad("tools are not supported yet", Some("tools")));
        }
        if let Some(f) = &self.response_format {
            if f.get("type").and_then(Value::as_str) != Some("text") {
                return Err(ApiError::bad(
                    "response_format other than text is not supported yet",
                    Some("response_format"),
                ));
            }
        }
        // Left out, a chat reply runs to its end-of-sequence token or the context's end, as OpenAI's chat API
        // and llama.cpp's server run it (a fixed default cut agents' replies, and a thinking model's, short); a
        // text completion gets 16 tokens, as OpenAI's legacy completions and vLLM give it. llama.cpp's
        // `n_predict` counts when the OpenAI names are absent, its -1 as no limit (the context's end).
        let n_predict = (self.n_predict).map(|n| if n == -1 { l.limits.context as i64 } else { n });
        let default = if chat {
            l.limits.context as i64
        } else {
            16.min(l.limits.context as i64)
        };
        let max = (self.max_completion_tokens.or(self.max_tokens).or(n_predict)).unwrap_or(default);
        if max < 1 || max as u64 > l.limits.context as u64 {
            let field = match (self.max_completion_tokens, self.max_tokens) {
                (Some(_), _) => "max_completion_tokens",
                (None, Some(_)) => "max_tokens",
                _ => "n_predict",
            };
            return Err(ApiError::bad(
                format!("{field} must be between 1 and the context length {}", l.limits.context),
                Some(field),
            ));
        }
        let expert_top_k = match self.expert_top_k {
            None => None,
            Some(k) if k >= 1 && k as usize <= l.top_k => Some(k as usize),
            Some(_) => {
                return Err(ApiError::bad(
                    format!("expert_top_k must be between 1 and the server's --top-k {}", l.top_k),
                    Some("expert_top_k"),
                ))
            }
        };
        let d = &l.sampling_defaults;
        let top_k = match self.top_k {
            None => d.top_k.unwrap_or(0),
            Some(-1) => 0,
            Some(k) if k >= 0 => k as usize,
            Some(_) => return Err(ApiError::bad("top_k must be ≥ 0 (or -1 for off)", Some("top_k"))),
        };
        let sampling = SamplingParams {
            temperature: self.temperature.or(d.temperature).unwrap_or(1.0),
            top_p: self.top_p.or(d.top_p).unwrap_or(1.0),
            top_k,
            min_p: self.min_p.or(d.min_p).unwrap_or(0.0),
            repetition_penalty: (self.repetition_penalty.or(self.repeat_penalty))
                .or(d.repetition_penalty)
                .unwrap_or(1.0),
            // Over the whole prompt and output, as vLLM and Hugging Face apply it (the window is the CLI's).
            repeat_last_n: 0,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            seed: self.seed()?,
        };
        sampling.validate().map_err(|e| {
            // The field the message starts with (its own words name it).
            let fields = [
                "temperature",
                "top_p",
                "min_p",
                "repetition_penalty",
                "frequency_penalty",
                "presence_penalty",
            ];
            let param = match &e {
                ModelError::InvalidArgument(m) => fields.into_iter().find(|f| m.starts_with(f)),
                _ => None,
            };
            ApiError::bad(e.to_string(), param)
        })?;
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        check_stops(&stop)?;
        Ok(GenerateParams {
            max_tokens: max as usize,
            sampling,
            stop,
            expert_top_k: expert_top_k.or(Some(l.top_k)),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            ..GenerateParams::default()
        })
    }
}

/// Most stop strings a request may give (OpenAI's API takes 4). Each generated piece of text is matched
/// against every one: a million short ones cost the engine 22 ms a token, as much as a decode step.
const MAX_STOPS: usize = 16;
/// Longest stop string, in bytes: the matcher also checks each one's prefixes against the end of the text.
const MAX_STOP_BYTES: usize = 512;

/// A 400 when `stops` are more or longer than [`MAX_STOPS`] and [`MAX_STOP_BYTES`] allow.
fn check_stops(stops: &[String]) -> Result<(), ApiError> {
    if stops.len() > MAX_STOPS {
        let msg = format!("stop has {} strings; at most {MAX_STOPS} are allowed", stops.len());
        return Err(ApiError::bad(msg, Some("stop")));
    }
    match stops.iter().map(String::len).max() {
        Some(n) if n > MAX_STOP_BYTES => {
            let msg = format!("a stop string is {n} bytes long; at most {MAX_STOP_BYTES} are allowed");
            Err(ApiError::bad(msg, Some("stop")))
        }
        _ => Ok(()),
    }
}

/// `GET /v1/models`.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    if let Some(l) = st.loaded.get() {
        l.metrics.requests.with_label_values(&["/v1/models", "200"]).inc();
    }
    Json(json!({"object": "list", "data": [model_object(&st.model_id)]})).into_response()
}

/// `GET /v1/models/{id}`: the model, under its id; another id is a 404.
pub async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let found = id == st.model_id;
    if let Some(l) = st.loaded.get() {
        let status = if found { "200" } else { "404" };
        l.metrics.requests.with_label_values(&["/v1/models/{id}", status]).inc();
    }
    if !found {
        return ApiError::model_not_found(&id, &st.model_id).into_response();
    }
    Json(model_object(&st.model_id)).into_response()
}

/// The OpenAI model object for `id`.
fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "sluice"})
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = chat_inner(&st, req).await;
    finish(&st, "/v1/chat/completions", r)
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = completions_inner(&st, req).await;
    finish(&st, "/v1/completions", r)
}

fn finish(st: &AppState, endpoint: &str, r: Result<Response, ApiError>) -> Response {
    let resp = r.unwrap_or_else(IntoResponse::into_response);
    if let Some(l) = st.loaded.get() {
        l.metrics
            .requests
            .with_label_values(&[endpoint, resp.status().as_str()])
            .inc();
    }
    resp
}

async fn chat_inner(st: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let l = st.loaded()?;
    let body: ChatRequest = parse(req).await?;
    if body.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty", Some("messages")));
    }
    let mut msgs = Vec::new();
    for m in &body.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(ApiError::bad(format!("unknown role `{}`", m.role), Some("messages")));
        }
        let called = |v: &Option<Value>| {
            v.as_ref()
                .is_some_and(|v| !(v.is_null() || v.as_array().is_some_and(|a| a.is_empty())))
        };
        if called(&m.tool_calls) || called(&m.function_call) {
            return Err(ApiError::bad(
                "tool calls in messages are not supported yet",
                Some("messages"),
            ));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        let msg = match &m.content {
            // Only an assistant turn may leave its content out (OpenAI's rule: it carries tool calls then).
            None if m.role == "assistant" => ChatMessage::new(role, ""),
            None => {
                return Err(ApiError::bad(
                    format!("a `{}` message needs content", m.role),
                    Some("messages"),
                ))
            }
            Some(Content::Text(t)) => ChatMessage::new(role, t),
            // Kept as parts: joined one per line for a template that prints the content (as vLLM joins them:
            // parts run together would merge their words), given as parts to one that walks them.
            Some(Content::Parts(list)) => {
                let mut texts = Vec::with_capacity(list.len());
                for p in list {
                    if p.kind != "text" {
                        return Err(ApiError::bad(
                            format!("content part `{}` is not supported", p.kind),
                            Some("messages"),
                        ));
                    }
                    texts.push(p.text.clone().unwrap_or_default());
                }
                ChatMessage::from_parts(role, texts)
            }
        };
        msgs.push(match &m.reasoning_content {
            Some(r) => msg.with_reasoning(r),
            None => msg,
        });
    }
    let prompt = match body.chat_template_kwargs {
        None | Some(Value::Null) => Prompt::Chat(msgs),
        // Tools reach a template through its variables too; they are refused there as at the top level.
        Some(Value::Object(kwargs)) if kwargs.contains_key("tools") || kwargs.contains_key("documents") => {
            return Err(ApiError::bad(
                "tools and documents are not supported yet, in chat_template_kwargs as elsewhere",
                Some("chat_template_kwargs"),
            ))
        }
        Some(Value::Object(kwargs)) => Prompt::ChatWith(msgs, kwargs),
        Some(_) => {
            return Err(ApiError::bad(
                "chat_template_kwargs must be an object",
                Some("chat_template_kwargs"),
            ))
        }
    };
    let params = body.common.params(st, l, true)?;
    run(l, &st.model_id, prompt, params, &body.common, true).await
}

async fn completions_inner(st: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let l = st.loaded()?;
    let body: CompletionRequest = parse(req).await?;
    let prompt = match &body.prompt {
        Value::String(s) => Prompt::Raw(s.clone()),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => Prompt::Raw(a[0].as_str().unwrap_or("").into()),
        Value::Array(a) if a.len() > 1 && a.iter().all(|v| v.is_string() || v.is_array()) => {
            return Err(ApiError::bad(
                "one prompt per request: a list of several prompts is not supported yet",
                Some("prompt"),
            ))
        }
        // A list of token ids, or one such list in a list (lm-evaluation-harness sends its prompts so).
        other => match other.as_array().and_then(|a| match a.as_slice() {
            [Value::Array(t)] => token_ids(t),
            _ => token_ids(a),
        }) {
            Some(ids) => Prompt::Tokens(ids),
            None => {
                return Err(ApiError::bad(
                    "prompt must be a string or a list of token ids",
                    Some("prompt"),
                ))
            }
        },
    };
    let params = body.common.params(st, l, false)?;
    run(l, &st.model_id, prompt, params, &body.common, false).await
}

/// A non-empty list of token ids (each within u32), else `None`.
fn token_ids(a: &[Value]) -> Option<Vec<u32>> {
    let ids: Option<Vec<u32>> = a
        .iter()
        .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect();
    ids.filter(|ids| !ids.is_empty())
}

/// Tokenizes and checks the prompt (its errors are HTTP errors, at once, however long the queue), queues the
/// job, then answers whole or as an SSE stream: a stream's headers go out when it is queued, and its keep-alive
/// comments cover the wait for the engine.
async fn run(
    l: &Loaded,
    model: &str,
    prompt: Prompt,
    params: GenerateParams,
    c: &Common,
    chat: bool,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    // Refused before its tokenization is paid for; the queue may still fill meanwhile (then `submit` says so).
    if l.engine.full() {
        return Err(ApiError::queue_full());
    }
    // Off the async workers: a long prompt's tokenization or a template's rendering takes a while. A few at a
    // time, in arrival order (a fair semaphore), so a burst does not take the cores from the generation.
    // The permits go with the tokenization (and come back when it ends, even if this request is dropped
    // meanwhile), not with the request: a whole reply's would otherwise be held through its queueing and
    // generation, and a few such requests would stop every other prompt's tokenization.
    let Ok(permit) = Arc::clone(&l.tokenizing).acquire_owned().await else {
        return Err(ApiError::engine_stopped());
    };
    let text_bytes = prompt.text_bytes().clamp(1, TOKENIZING_BYTES) as u32;
    let Ok(bytes_permit) = Arc::clone(&l.tokenizing_bytes).acquire_many_owned(text_bytes).await else {
        return Err(ApiError::engine_stopped());
    };
    let (codec, limits) = (Arc::clone(&l.codec), l.limits);
    let checked = tokio::task::spawn_blocking(move || {
        let _held = (permit, bytes_permit);
        let ids = prompt.tokenize(&codec)?;
        limits.check(&ids, &params).map(|()| (ids, params))
    })
    .await;
    let (ids, params) = match checked {
        Ok(Ok(checked)) => checked,
        Ok(Err(e)) => return Err(ApiError::from_model(e, chat)),
        Err(e) => {
            tracing::error!("tokenizing a prompt panicked: {e}");
            return Err(ApiError::with(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
                "tokenizing the prompt failed",
            ));
        }
    };
    let prompt_tokens = ids.len();
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        ids,
        chat,
        params,
        events: tx,
        arrived,
        queued: Instant::now(),
    };
    match l.engine.submit(job) {
        Ok(()) => {}
        Err(SubmitError::Full) => return Err(ApiError::queue_full()),
        Err(SubmitError::Stopped) => return Err(ApiError::engine_stopped()),
    }
    // Unique within this server's life, and across restarts by the start time in it.
    static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = format!("{}-{:x}{n:06x}", if chat { "chatcmpl" } else { "cmpl" }, started_at());
    let ctx = Reply {
        metrics: Arc::clone(&l.metrics),
        id,
        model: model.to_string(),
        chat,
        prompt_tokens,
        arrived,
        include_usage: (c.stream_options.as_ref()).is_some_and(|o| o.include_usage.unwrap_or(false)),
        created: now(),
    };
    if c.stream.unwrap_or(false) {
        Ok(stream_reply(ctx, rx).into_response())
    } else {
        whole_reply(ctx, rx).await
    }
}

struct Reply {
    metrics: Arc<Metrics>,
    id: String,
    model: String,
    chat: bool,
    prompt_tokens: usize,
    arrived: Instant,
    include_usage: bool,
    /// Unix seconds when the reply began: every chunk of a stream carries the same.
    created: u64,
}

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

impl Reply {
    fn usage(&self, generated: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": generated, "total_tokens": self.prompt_tokens + generated})
    }

    fn chunk(&self, text: Option<&str>, finish: Option<&str>) -> Value {
        let choice = if self.chat {
            let delta = match text {
                Some(t) => json!({"content": t}),
                None => json!({}),
            };
            json!({"index": 0, "delta": delta, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "finish_reason": finish})
        };
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut chunk =
            json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        // With `include_usage`, OpenAI's chunks before the last carry `"usage": null`; typed clients read it.
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// A stream's event carrying `text`.
    fn text_event(&self, text: &str) -> SseEvent {
        SseEvent::default().data(self.chunk(Some(text), None).to_string())
    }
}

async fn whole_reply(r: Reply, mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut last: Option<Instant> = None;
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => {
                tick(&r, &mut last);
                text.push_str(&t);
            }
            Some(Event::Tail(t)) => text.push_str(&t),
            Some(Event::Done(stats)) => {
                let fr = finish_reason(stats.finish);
                let choice = if r.chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fr})
                } else {
                    json!({"index": 0, "text": text, "finish_reason": fr})
                };
                let object = if r.chat { "chat.completion" } else { "text_completion" };
                return Ok(Json(json!({
                    "id": r.id, "object": object, "created": r.created, "model": r.model,
                    "choices": [choice], "usage": r.usage(stats.generated_tokens),
                }))
                .into_response());
            }
            Some(Event::Failed(e)) => return Err(ApiError::from_model(e, r.chat)),
            // The job's sender went without a word: the engine thread ended (its queue is cleared then).
            None => return Err(ApiError::engine_stopped()),
        }
    }
}

/// Records time to first token and inter-token latency.
fn tick(r: &Reply, last: &mut Option<Instant>) {
    let now = Instant::now();
    match last {
        None => r.metrics.ttft.observe(now.duration_since(r.arrived).as_secs_f64()),
        Some(t) => r.metrics.itl.observe(now.duration_since(*t).as_secs_f64()),
    }
    *last = Some(now);
}

fn stream_reply(r: Reply, rx: mpsc::UnboundedReceiver<Event>) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let first = r.chat;
    let mut first_chunk = r.chunk(None, None);
    first_chunk["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
    // State: the receiver (dropped with the stream when the client leaves, which cancels the job) and
    // whether the end was sent.
    let s = stream::unfold(
        (r, rx, None::<Instant>, false),
        |(r, mut rx, mut last, done)| async move {
            if done {
                return None;
            }
            loop {
                match rx.recv().await {
                    Some(Event::Text(t)) => {
                        tick(&r, &mut last);
                        if !t.is_empty() {
                            return Some((vec![r.text_event(&t)], (r, rx, last, false)));
                        }
                    }
                    Some(Event::Tail(t)) => {
                        if !t.is_empty() {
                            return Some((vec![r.text_event(&t)], (r, rx, last, false)));
                        }
                    }
                    Some(Event::Done(stats)) => {
                        let mut evs = vec![
                            SseEvent::default().data(r.chunk(None, Some(finish_reason(stats.finish))).to_string())
                        ];
                        if r.include_usage {
                            let mut u = r.chunk(None, None);
                            u["choices"] = json!([]);
                            u["usage"] = r.usage(stats.generated_tokens);
                            evs.push(SseEvent::default().data(u.to_string()));
                        }
                        evs.push(SseEvent::default().data("[DONE]"));
                        return Some((evs, (r, rx, last, true)));
                    }
                    Some(Event::Failed(e)) => {
                        let ev = SseEvent::default().data(ApiError::from_model(e, r.chat).body().to_string());
                        return Some((vec![ev, SseEvent::default().data("[DONE]")], (r, rx, last, true)));
                    }
                    // The engine thread ended (see `whole_reply`): said in the stream, which has its 200.
                    None => {
                        let ev = SseEvent::default().data(ApiError::engine_stopped().body().to_string());
                        return Some((vec![ev, SseEvent::default().data("[DONE]")], (r, rx, last, true)));
                    }
                }
            }
        },
    )
    .flat_map(|evs| stream::iter(evs.into_iter().map(Ok)));
    // A chat stream opens with the assistant's role and no text, as OpenAI's does (so a reply with no text
    // still names its role); comments every 15 s keep proxies from closing a stream through a long prompt.
    let opening = first.then(|| Ok(SseEvent::default().data(first_chunk.to_string())));
    Sse::new(stream::iter(opening).chain(s)).keep_alive(KeepAlive::default())
}

/// `GET /health`: 503 while loading, 200 when ready; says whether the expert slots are backed with memory yet.
pub async fn health(State(st): State<Arc<AppState>>) -> Response {
    let Some(l) = st.loaded.get() else {
        return ApiError::loading().into_response();
    };
    if l.engine.stopped() {
        return ApiError::engine_stopped().into_response();
    }
    // Requests are served either way; until the slots are backed, reads also fault memory in and run slower.
    let body = match l.metrics.slots_backed() {
        Some(backed) => json!({"status": "ok", "expert_slots": if backed { "backed" } else { "backing" }}),
        None => json!({"status": "ok"}),
    };
    (StatusCode::OK, Json(body)).into_response()
}

/// `GET /metrics`.
pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let Some(l) = st.loaded.get() else {
        return ApiError::loading().into_response();
    };
    let body = l.metrics.render(l.engine.waiting(), l.engine.running());
    ([("content-type", "text/plain; version=0.0.4")], Body::from(body)).into_response()
}
