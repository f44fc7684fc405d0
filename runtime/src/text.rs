//! Text in and out: `tokenizer.json`, chat templates (minijinja), streaming detokenisation, stop strings.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JValue};
use serde::Serialize;
use serde_json::Value;

use crate::config::token_ids;
use crate::error::{ModelError, Result};

/// One chat message.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// Message text.
    pub content: String,
    /// An assistant turn's reasoning (Qwen3's templates render it in a `<think>` block); absent, the template
    /// sees it undefined.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The text parts the content was given as (`content` joins them), for templates that walk a message's
    /// parts themselves.
    #[serde(skip)]
    pub parts: Option<Vec<String>>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            parts: None,
        }
    }

    /// A message whose content was given as text parts: joined one per line, as vLLM joins them for a template
    /// that prints `content`; a template that walks the parts (Qwen3.5's) gets them as parts.
    pub fn from_parts(role: &str, parts: Vec<String>) -> Self {
        let mut m = Self::new(role, &parts.join("\n"));
        m.parts = Some(parts);
        m
    }

    /// The message with this reasoning.
    pub fn with_reasoning(mut self, reasoning: &str) -> Self {
        self.reasoning_content = Some(reasoning.into());
        self
    }
}

/// Python's `str.isspace()`: Unicode whitespace and the separators U+001C–U+001F, which Rust's `trim` keeps.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip(chars)` (`lstrip`, `rstrip`: one end): `chars` absent strips whitespace as Python does.
fn py_strip(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let strip = |c: char| chars.map_or_else(|| py_space(c), |set| set.contains(c));
    let s = if left { s.trim_start_matches(strip) } else { s };
    let s = if right { s.trim_end_matches(strip) } else { s };
    s.to_string()
}

/// minijinja-contrib's Python string methods, with `strip`, `lstrip` and `rstrip` stripping Python's whitespace.
fn python_methods(
    state: &minijinja::State,
    value: &JValue,
    method: &str,
    args: &[JValue],
) -> std::result::Result<JValue, JinjaError> {
    let ends = match method {
        "strip" => Some((true, true)),
        "lstrip" => Some((true, false)),
        "rstrip" => Some((false, true)),
        _ => None,
    };
    // No characters given (none, or `None`): Python's whitespace. With characters, minijinja-contrib's is Python's.
    let no_chars = match args {
        [] => true,
        [chars] => chars.is_none(),
        _ => false,
    };
    match (value.as_str(), ends) {
        (Some(s), Some((left, right))) if no_chars => Ok(JValue::from(py_strip(s, None, left, right))),
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// Whether a chat template loops over a message's content (`{% for item in content %}`, `message.content`,
/// `message['content']`): it is then written for OpenAI's list of parts, which it is given (vLLM tells the two
/// kinds apart the same way, from the template).
fn loops_over_content(template: &str) -> bool {
    template.split("{%").skip(1).any(|block| {
        let inner = block
            .split("%}")
            .next()
            .unwrap_or("")
            .trim_start_matches(['-', '+'])
            .trim();
        let Some(rest) = inner.strip_prefix("for ") else {
            return false;
        };
        let Some((_, iterable)) = rest.split_once(" in ") else {
            return false;
        };
        let first = iterable
            .trim()
            .split(|c: char| c.is_whitespace() || c == '|' || c == '-')
            .next()
            .unwrap_or("");
        let first = first.trim_end_matches([']', '\'', '"']);
        first.ends_with("content")
    })
}

/// A model's tokenizer, chat template and end-of-sequence tokens.
pub struct TextCodec {
    tok: tokenizers::Tokenizer,
    chat_template: Option<String>,
    /// Whether the template loops over a message's content ([`loops_over_content`]), read once at load.
    template_walks_parts: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    generation_defaults: GenerationDefaults,
}

/// The sampling values a checkpoint's `generation_config.json` recommends (Qwen3's: temperature 0.6, top_k 20,
/// top_p 0.95), for a server to use where a request sets none, as vLLM does. Values out of range are dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationDefaults {
    /// `temperature`; 0 when `do_sample` is false (greedy, as Hugging Face reads it).
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k` (0: off).
    pub top_k: Option<usize>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// Reads them from a parsed `generation_config.json`.
    pub fn from_config(gc: &Value) -> Self {
        let float = |key: &str, ok: fn(f32) -> bool| {
            let v = gc.get(key)?.as_f64()? as f32;
            if ok(v) {
                Some(v)
            } else {
                tracing::warn!("generation_config.json: {key} {v} is out of range; ignored");
                None
            }
        };
        let greedy = gc.get("do_sample").and_then(Value::as_bool) == Some(false);
        Self {
            temperature: if greedy {
                Some(0.0)
            } else {
                float("temperature", |t| t >= 0.0 && t.is_finite())
            },
            top_p: float("top_p", |p| (0.0..=1.0).contains(&p)),
            top_k: gc.get("top_k").and_then(Value::as_u64).map(|k| k as usize),
            min_p: float("min_p", |p| (0.0..=1.0).contains(&p)),
            repetition_penalty: float("repetition_penalty", |r| r > 0.0 && r.is_finite()),
        }
    }
}

fn tok_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{}: {e}", path.display()))
}

thread_local! {
    /// Set while this thread runs [`catch_unwind_quietly`]'s closure.
    static QUIET_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `catch_unwind(f)` without the panic hook printing the panic: the caller reports it as an error of its own (a
/// library that panics on a bad file), so a user sees one message, not a "panicked at" line before it. Panics
/// on other threads, and outside `f`, go to the hook as before.
fn catch_unwind_quietly<R>(f: impl FnOnce() -> R + std::panic::UnwindSafe) -> std::thread::Result<R> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET_PANICS.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
    let was = QUIET_PANICS.with(|q| q.replace(true));
    let result = std::panic::catch_unwind(f);
    QUIET_PANICS.with(|q| q.set(was));
    result
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_str(&text).map(Some).map_err(|e| ModelError::Config {
        path: path.into(),
        message: format!("not valid JSON: {e}"),
    })
}

/// A special-token entry: `"<s>"` or `{"content": "<s>", ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

impl TextCodec {
    /// Loads `tokenizer.json`, `tokenizer_config.json` / `chat_template.jinja` and `generation_config.json`
    /// from `dir`; `config_eos` are the `eos_token_id`s of config.json.
    pub fn load(dir: &Path, config_eos: &[u32]) -> Result<Self> {
        let tpath: PathBuf = dir.join("tokenizer.json");
        if !tpath.exists() {
            return Err(ModelError::Tokenizer(format!("{}: not found", tpath.display())));
        }
        // The tokenizers crate panics on some inconsistent files (a BPE `continuing_subword_prefix` its merges do
        // not carry slices a token mid-character): that is a bad file, and an error, not a crash.
        let built = catch_unwind_quietly(|| tokenizers::Tokenizer::from_file(&tpath));
        let mut tok = match built {
            Ok(t) => t.map_err(|e| tok_err(&tpath, e))?,
            Err(panic) => {
                let why = expert_store::panic_message(panic.as_ref());
                return Err(tok_err(
                    &tpath,
                    format!("the tokenizers library could not build it ({why})"),
                ));
            }
        };
        // A tokenizer.json may keep the truncation and padding it was trained with; Hugging Face's tokenizers
        // drop them unless a call asks, and a prompt or an eval text cut short without a word would be wrong.
        tok.with_truncation(None).map_err(|e| tok_err(&tpath, e))?;
        tok.with_padding(None);
        let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            Some(std::fs::read_to_string(&jinja).map_err(|source| ModelError::Io { path: jinja, source })?)
        } else {
            match tc.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: use "default".
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(String::from),
                _ => None,
            }
        };
        let bos_token = token_string(tc.get("bos_token"));
        let eos_token = token_string(tc.get("eos_token"));
        let mut eos_ids = config_eos.to_vec();
        let mut generation_defaults = GenerationDefaults::default();
        if let Some(gc) = read_json(&dir.join("generation_config.json"))? {
            eos_ids.extend(token_ids(gc.get("eos_token_id")));
            generation_defaults = GenerationDefaults::from_config(&gc);
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| tok.token_to_id(t)) {
            eos_ids.push(id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        Ok(Self {
            tok,
            template_walks_parts: chat_template.as_deref().is_some_and(loops_over_content),
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
            generation_defaults,
        })
    }

    /// The sampling values the checkpoint's `generation_config.json` recommends.
    pub fn generation_defaults(&self) -> GenerationDefaults {
        self.generation_defaults
    }

    /// Token ids of `text`; `add_special` adds what the tokenizer's post-processor adds (e.g. BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, add_special)
            .map_err(|e| ModelError::Tokenizer(format!("encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped. Incomplete UTF-8 shows as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer(format!("decode: {e}")))
    }

    /// End-of-sequence ids (config.json, generation_config.json, tokenizer_config.json's `eos_token`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders `messages` with the model's chat template (as Hugging Face's `apply_chat_template` does).
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`TextCodec::apply_chat_template`] with extra variables for the template (HF's `**kwargs`, the
    /// `chat_template_kwargs` of OpenAI-compatible servers: Qwen3's `enable_thinking`, say). They cannot
    /// replace the variables the renderer sets.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        const OWN: [&str; 4] = ["messages", "add_generation_prompt", "bos_token", "eos_token"];
        if let Some(k) = kwargs.keys().find(|k| OWN.contains(&k.as_str())) {
            return Err(ModelError::InvalidArgument(format!(
                "chat template variable `{k}` is set by the server and cannot be passed"
            )));
        }
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| ModelError::Tokenizer("this model has no chat template; use a raw prompt".into()))?;
        let mut env = Environment::new();
        // Hugging Face renders with trim_blocks and lstrip_blocks, and Python string methods in templates.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(python_methods);
        env.add_filter("trim", |v: String, chars: Option<String>| {
            py_strip(&v, chars.as_deref(), true, true)
        });
        env.add_function("raise_exception", |msg: String| -> Result<JValue, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
        env.add_filter("tojson", tojson);
        env.add_template("chat", template)
            .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))?;
        // Parts go to a template that loops over them; every other template gets the joined text.
        let messages: Vec<Value> = (messages.iter())
            .map(|m| {
                let mut v = serde_json::to_value(m).unwrap_or(Value::Null);
                if let (Some(parts), true) = (&m.parts, self.template_walks_parts) {
                    v["content"] = parts
                        .iter()
                        .map(|t| serde_json::json!({"type": "text", "text": t}))
                        .collect();
                }
                v
            })
            .collect();
        let own = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        let ctx = minijinja::context! { ..own, ..JValue::from_serialize(kwargs) };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))
    }
}

/// The `tojson` filter as Hugging Face's templates get it: Python's `json.dumps` separators (`", "` and `": "`
/// between items, or `indent` spaces a level; non-ASCII and `<>&` written as they are, where minijinja's own
/// escapes them for HTML). `indent` may be given by position or by name. Object keys come out sorted (the
/// request's JSON is parsed into sorted maps), where Python keeps their order.
fn tojson(v: JValue, indent: Option<usize>, kwargs: minijinja::value::Kwargs) -> Result<String, JinjaError> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(n) => Some(n),
        None => indent,
    };
    kwargs.assert_all_used()?;
    let j: Value = serde_json::to_value(&v).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut buf = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            j.serialize(&mut serde_json::Serializer::with_formatter(
                &mut buf,
                serde_json::ser::PrettyFormatter::with_indent(&spaces),
            ))
        }
        None => j.serialize(&mut serde_json::Serializer::with_formatter(&mut buf, PythonJson)),
    };
    written.map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    String::from_utf8(buf).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `json.dumps`'s default separators.
struct PythonJson;

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.begin_array_value(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// The current UTC time formatted with the few strftime codes chat templates use.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86400) as i64;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    fmt.replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", month)
        .replace("%b", &month[..3])
}

/// Tokens a character can span (UTF-8's longest, one byte a token).
const MAX_CHAR_TOKENS: usize = 4;

/// Tokens held back at most for a character a later token might complete (a chain of tokens that each end one
/// character and start the next; no tokenizer we know has more than a few such tokens).
const MAX_HELD_TOKENS: usize = 16;

/// Turns a growing token sequence into text chunks that never split a UTF-8 character.
///
/// It decodes a short window of recent tokens twice (with and without the newest) and emits the difference
/// only once it no longer ends in U+FFFD, the mark of a byte sequence still incomplete.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    /// A decoder with no tokens.
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder continuing `context` (a prompt): the first token's text is what it adds after the context's
    /// last few tokens, a leading space included where the tokenizer strips it at the start of a text.
    pub fn after(context: &[u32]) -> Self {
        let ids = context[context.len().saturating_sub(4)..].to_vec();
        Self {
            prefix: 0,
            read: ids.len(),
            ids,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let now = codec.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            return Ok(self.emit(&before, &now, self.ids.len()));
        }
        // A character is at most 4 bytes and a token at least 1: a U+FFFD held behind 4 tokens is the text's
        // own (or bytes that never form a character), not one in the making. It goes out with all but the last
        // 3 tokens, which may be a character's start, if the whole text agrees: a token can also end one
        // character and start the next, whose U+FFFD the next tokens replace.
        if self.ids.len() - self.read >= MAX_CHAR_TOKENS {
            let upto = self.ids.len() - (MAX_CHAR_TOKENS - 1);
            let settled = codec.decode(&self.ids[self.prefix..upto])?;
            // (Held past MAX_HELD_TOKENS, it goes out anyway: each token re-decodes what is held.)
            let agreed = now.starts_with(settled.as_str()) || self.ids.len() - self.read >= MAX_HELD_TOKENS;
            if settled.len() > before.len() && agreed {
                return Ok(self.emit(&before, &settled, upto));
            }
        }
        Ok(String::new())
    }

    /// The text `now` (decoded up to token `upto`) adds to `before`, from a character boundary; the window then
    /// starts where `before` ended.
    fn emit(&mut self, before: &str, now: &str, upto: usize) -> String {
        let mut cut = before.len();
        while !now.is_char_boundary(cut) {
            cut += 1;
        }
        self.prefix = self.read;
        self.read = upto;
        now[cut..].to_string()
    }

    /// Text still held back at the end of the sequence (an incomplete character decodes as U+FFFD).
    pub fn finish(&mut self, codec: &TextCodec) -> Result<String> {
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let now = codec.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or("").to_string())
    }
}

/// Finds stop strings in streamed text, holding back any tail that could still become one.
///
/// ```
/// use sluice_runtime::text::StopMatcher;
/// let mut m = StopMatcher::new(&["</answer>".to_string()]);
/// assert_eq!(m.push("42 </ans"), ("42 ".to_string(), false)); // "</ans" might start the stop string
/// assert_eq!(m.push("wer> ignored"), (String::new(), true));
/// ```
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Feeds a chunk; returns the text safe to emit and whether a stop string was hit (text after it is
    /// dropped, the stop string itself is not emitted).
    pub fn push(&mut self, chunk: &str) -> (String, bool) {
        self.held.push_str(chunk);
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// Whatever is held back, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_split_across_chunks() {
        let mut m = StopMatcher::new(&["END".to_string(), "\n\n".to_string()]);
        assert_eq!(m.push("hello E"), ("hello ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("Dgone"), (String::new(), true));
        let mut m = StopMatcher::new(&["END".to_string()]);
        assert_eq!(m.push("ENx"), ("ENx".to_string(), false));
        assert_eq!(m.push("E"), (String::new(), false));
        assert_eq!(m.finish(), "E");
        let mut m = StopMatcher::new(&["日本".to_string()]);
        assert_eq!(m.push("a日"), ("a".to_string(), false));
        assert_eq!(m.push("x"), ("日x".to_string(), false));
    }

    /// A codec over a fixture's tokenizer with `template` as its chat template (in tokenizer_config.json).
    fn codec_with_template(template: Value) -> (tempfile::TempDir, TextCodec) {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3_moe-q4g64");
        let d = tempfile::tempdir().unwrap();
        std::fs::copy(fixture.join("tokenizer.json"), d.path().join("tokenizer.json")).unwrap();
        let tc = serde_json::json!({"eos_token": {"content": "<|im_end|>"}, "bos_token": "<|endoftext|>", "chat_template": template});
        std::fs::write(d.path().join("tokenizer_config.json"), tc.to_string()).unwrap();
        let codec = TextCodec::load(d.path(), &[]).unwrap();
        (d, codec)
    }

    #[test]
    fn templates_can_raise_and_use_hf_helpers() {
        let t = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
                 {{ raise_exception('roles must be user or assistant, got ' + m.role) }}{% endif %}\
                 [{{ m.role | upper }}]{{ m.content.strip() }}{{ {'t': [m.content, 1]} | tojson }}{% endfor %}\
                 {{ [1] | tojson(indent=2) }}{{ [2] | tojson(2) }}{% if add_generation_prompt %}[A]{% endif %}";
        let (_d, c) = codec_with_template(Value::String(t.into()));
        assert_eq!(c.eos_ids(), &[2], "eos_token given as an object");
        let out = c
            .apply_chat_template(&[ChatMessage::new("user", " <a&b> ")], true)
            .unwrap();
        // `tojson` writes what Python's `json.dumps` does.
        assert_eq!(
            out,
            "<|endoftext|>[USER]<a&b>{\"t\": [\" <a&b> \", 1]}[\n  1\n][\n  2\n][A]"
        );
        let e = c
            .apply_chat_template(&[ChatMessage::new("tool", "x")], true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("roles must be user or assistant, got tool"), "{e}");
    }

    /// A truncation or padding left in tokenizer.json cuts or pads nothing, as in Hugging Face's tokenizers.
    #[test]
    fn a_truncation_in_the_tokenizer_file_cuts_nothing() {
        let d = tempfile::tempdir().unwrap();
        let tok = serde_json::json!({"version": "1.0", "added_tokens": [],
            "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
            "padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 2,
                "pad_type_id": 0, "pad_token": "<unk>"},
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "<unk>": 2}, "unk_token": "<unk>"}});
        std::fs::write(d.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let c = TextCodec::load(d.path(), &[]).unwrap();
        assert_eq!(c.encode("a b a b a", false).unwrap(), vec![0, 1, 0, 1, 0]);
    }

    /// A codec whose tokens are the strings of `vocab` (ids in order) in GPT-2's byte-level alphabet (Qwen's
    /// tokenizers), with `<unk>` last.
    fn byte_level_codec(vocab: &[&str]) -> TextCodec {
        let d = tempfile::tempdir().unwrap();
        let vocab: serde_json::Map<String, Value> = (vocab.iter().chain(&["<unk>"]))
            .enumerate()
            .map(|(i, b)| (b.to_string(), Value::from(i)))
            .collect();
        let decoder = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
            "use_regex": false});
        let tok = serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": decoder,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}});
        std::fs::write(d.path().join("tokenizer.json"), tok.to_string()).unwrap();
        TextCodec::load(d.path(), &[]).unwrap()
    }

    /// A byte that never forms a character, then an emoji in byte tokens: the stray byte goes out once 4 tokens
    /// wait behind it, and the emoji's first bytes stay held until it is whole (a flush of all 4 lost it).
    #[test]
    fn a_stray_byte_before_a_split_character_loses_neither() {
        // Bytes E4, F0, 9F, 98 and 80.
        let c = byte_level_codec(&["ä", "ð", "Ł", "ĺ", "Ģ"]);
        let ids = [0, 1, 2, 3, 4];
        assert_eq!(c.decode(&ids).unwrap(), "\u{FFFD}😀");
        let (mut dec, mut out) = (StreamDecoder::new(), String::new());
        for id in ids {
            out.push_str(&dec.push(&c, id).unwrap());
        }
        assert_eq!(out, "\u{FFFD}😀", "streamed");
        out.push_str(&dec.finish(&c).unwrap());
        assert_eq!(out, "\u{FFFD}😀");
    }

    /// Tokens that each end one character and start the next: the 4-token fallback sent a U+FFFD for a character
    /// the next token completed, and the character never came.
    #[test]
    fn tokens_that_end_and_start_characters_lose_none() {
        // "aæ" = 61 E6, "Ĺ¥æ" = 97 A5 E6, "Ĺ¥" = 97 A5 (日 = E6 97 A5).
        let c = byte_level_codec(&["aæ", "Ĺ¥æ", "Ĺ¥"]);
        let ids = [0, 1, 1, 1, 2];
        assert_eq!(c.decode(&ids).unwrap(), "a日日日日");
        let (mut dec, mut out) = (StreamDecoder::new(), String::new());
        for id in ids {
            out.push_str(&dec.push(&c, id).unwrap());
        }
        out.push_str(&dec.finish(&c).unwrap());
        assert_eq!(out, "a日日日日");
        // A chain longer than anything a tokenizer makes is not held (and re-decoded) for good.
        let mut dec = StreamDecoder::new();
        for i in 0..40 {
            let _ = dec.push(&c, 1).unwrap();
            assert!(dec.ids.len() - dec.read <= MAX_HELD_TOKENS, "token {i}: held back");
        }
    }

    /// A model writing U+FFFD itself is not held back for good (every token re-decoded the growing window).
    #[test]
    fn replacement_characters_of_the_text_itself_flow() {
        let d = tempfile::tempdir().unwrap();
        let tok = serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "\u{FFFD}": 1, "<unk>": 2}, "unk_token": "<unk>"}});
        std::fs::write(d.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let c = TextCodec::load(d.path(), &[]).unwrap();
        let ids: Vec<u32> = std::iter::once(0).chain([1; 100]).collect();
        let (mut dec, mut out) = (StreamDecoder::new(), String::new());
        for (i, &id) in ids.iter().enumerate() {
            out.push_str(&dec.push(&c, id).unwrap());
            assert!(dec.ids.len() - dec.read < MAX_CHAR_TOKENS, "token {i}: held back");
        }
        out.push_str(&dec.finish(&c).unwrap());
        assert_eq!(out, c.decode(&ids).unwrap());
        assert_eq!(out.matches('\u{FFFD}').count(), 100);
    }

    #[test]
    fn a_continuation_keeps_the_leading_space_a_sentencepiece_decoder_strips_at_the_start() {
        // SentencePiece style (Mixtral, Llama): `▁` marks a space, and decoding a text drops the first one.
        let d = tempfile::tempdir().unwrap();
        let meta =
            serde_json::json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
        let tok = serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": meta, "post_processor": null, "decoder": meta,
            "model": {"type": "WordLevel", "vocab": {"▁The": 0, "▁quick": 1, "▁fox": 2, "<unk>": 3}, "unk_token": "<unk>"}});
        std::fs::write(d.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let c = TextCodec::load(d.path(), &[]).unwrap();
        assert_eq!(c.encode("The quick", false).unwrap(), vec![0, 1]);
        assert_eq!(c.decode(&[2]).unwrap(), "fox");
        let mut cont = StreamDecoder::after(&[0, 1]);
        assert_eq!(cont.push(&c, 2).unwrap(), " fox");
        assert_eq!(cont.push(&c, 1).unwrap(), " quick");
        // A reply on its own (a chat turn) starts without it, as HF decodes the reply's tokens.
        assert_eq!(StreamDecoder::new().push(&c, 2).unwrap(), "fox");
    }

    #[test]
    fn templates_can_use_loop_controls() {
        // Jinja's loop-controls extension, which transformers turns on for chat templates.
        let t = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}\
                 {% if m.content == 'stop' %}{% break %}{% endif %}{% endfor %}";
        let (_d, c) = codec_with_template(Value::String(t.into()));
        let msgs = ["s", "u", "stop", "never"].map(|m| ChatMessage::new(if m == "s" { "system" } else { "user" }, m));
        assert_eq!(c.apply_chat_template(&msgs, false).unwrap(), "ustop");
    }

    #[test]
    fn trim_and_strip_take_pythons_whitespace() {
        // Python's str.strip() removes U+001C–U+001F too (Qwen3.5's template trims every message); with
        // characters given, those are stripped.
        let t = "{% for m in messages %}[{{ m.content|trim }}|{{ m.content.strip() }}|{{ m.content.lstrip() }}|\
                 {{ m.content.rstrip() }}|{{ m.content.strip('x\u{1c}') }}|{{ m.content|trim('x\u{1c}') }}]{% endfor %}";
        let (_d, c) = codec_with_template(Value::String(t.into()));
        let msgs = [
            ChatMessage::new("user", "\u{1c} x \u{1f}"),
            ChatMessage::new("user", "xa\u{1c}"),
        ];
        assert_eq!(
            c.apply_chat_template(&msgs, false).unwrap(),
            // What Python gives.
            "[x|x|x \u{1f}|\u{1c} x| x \u{1f}| x \u{1f}][xa|xa|xa\u{1c}|xa|a|a]"
        );
    }

    #[test]
    fn text_parts_reach_a_template_that_walks_them_and_are_joined_for_others() {
        // Qwen3.5's way: the template prints a string, or each text part of a list with nothing between.
        let walks = "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}\
                     {% for item in m.content %}{{ item.text }}{% endfor %}{% endif %}|{% endfor %}";
        let prints = "{% for m in messages %}{{ m.content }}|{% endfor %}";
        let msgs = [
            ChatMessage::from_parts("user", vec!["ab".into(), "cd".into()]),
            ChatMessage::new("user", "ef"),
        ];
        let (_d, c) = codec_with_template(Value::String(walks.into()));
        assert_eq!(c.apply_chat_template(&msgs, false).unwrap(), "abcd|ef|");
        let (_d, c) = codec_with_template(Value::String(prints.into()));
        assert_eq!(c.apply_chat_template(&msgs, false).unwrap(), "ab\ncd|ef|");
        for (t, want) in [
            ("{%- for item in content %}", true),
            ("{% for p in message['content'] if p.type == 'text' %}", true),
            ("{% for p in m.content|selectattr('type') %}", true),
            ("{% for message in messages %}", false),
            ("{{ content }}", false),
        ] {
            assert_eq!(loops_over_content(t), want, "{t}");
        }
    }

    #[test]
    fn an_assistant_turns_reasoning_reaches_the_template() {
        // Qwen3's templates render an earlier turn's reasoning in a `<think>` block when it is a string.
        let t = "{% for m in messages %}{% if m.reasoning_content is string %}<think>{{ m.reasoning_content }}\
                 </think>{% endif %}{{ m.content }}|{% endfor %}";
        let (_d, c) = codec_with_template(Value::String(t.into()));
        let msgs = [
            ChatMessage::new("user", "q"),
            ChatMessage::new("assistant", "A").with_reasoning("R"),
            ChatMessage::new("user", "again"),
        ];
        assert_eq!(
            c.apply_chat_template(&msgs, false).unwrap(),
            "q|<think>R</think>A|again|"
        );
    }

    #[test]
    fn template_variables_reach_the_template_and_cannot_replace_its_own() {
        // Qwen3's switch, as its template reads it.
        let t = "{% for m in messages %}{{ m.content }}{% endfor %}\
                 {% if add_generation_prompt %}{% if enable_thinking is defined and enable_thinking is false %}\
                 [no-think]{% else %}[think]{% endif %}{% endif %}";
        let (_d, c) = codec_with_template(Value::String(t.into()));
        let msgs = [ChatMessage::new("user", "q")];
        assert_eq!(c.apply_chat_template(&msgs, true).unwrap(), "q[think]");
        let mut vars = serde_json::Map::new();
        vars.insert("enable_thinking".into(), Value::Bool(false));
        assert_eq!(c.apply_chat_template_with(&msgs, true, &vars).unwrap(), "q[no-think]");
        vars.insert("add_generation_prompt".into(), Value::Bool(false));
        let e = c.apply_chat_template_with(&msgs, true, &vars).unwrap_err().to_string();
        assert!(e.contains("`add_generation_prompt` is set by the server"), "{e}");
    }

    #[test]
    fn named_template_list_uses_default_and_missing_template_is_an_error() {
        let list = serde_json::json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
        let (_d, c) = codec_with_template(list);
        assert_eq!(c.apply_chat_template(&[], false).unwrap(), "D");
        let (_d, c) = codec_with_template(Value::Null);
        assert!(!c.has_chat_template());
        assert!(c
            .apply_chat_template(&[], true)
            .unwrap_err()
            .to_string()
            .contains("no chat template"));
    }

    #[test]
    fn generation_config_sampling_defaults() {
        let d = |v: Value| GenerationDefaults::from_config(&v);
        // Qwen3's.
        let qwen = d(
            serde_json::json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}),
        );
        assert_eq!(
            qwen,
            GenerationDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                min_p: None,
                repetition_penalty: None,
            }
        );
        // do_sample false is greedy, as Hugging Face reads it, whatever the temperature.
        assert_eq!(
            d(serde_json::json!({"do_sample": false, "temperature": 0.7})).temperature,
            Some(0.0)
        );
        // Out of range or of the wrong type: left out.
        let bad =
            d(serde_json::json!({"temperature": -1, "top_p": 1.5, "top_k": -3, "min_p": "x", "repetition_penalty": 0}));
        assert_eq!(bad, GenerationDefaults::default());
        assert_eq!(
            d(serde_json::json!({"repetition_penalty": 1.05})).repetition_penalty,
            Some(1.05)
        );
    }

    #[test]
    fn strftime_now_formats_a_date() {
        let s = strftime_now("%d %B %Y");
        assert_eq!(s.len(), s.trim().len());
        assert!(
            s.split(' ').count() == 3 && s.ends_with(|c: char| c.is_ascii_digit()),
            "{s}"
        );
    }
}
