//! `sluice serve` over real HTTP on a random port with a fixture model.

mod common;

use common::fixture;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_runtime::{ChatMessage, GenerateParams, GenerationStats, Pipeline, Prompt, SamplingParams};

/// A running server, killed on drop.
struct Server {
    child: Child,
    addr: String,
    /// Kept open so the server's stderr writes never hit a closed pipe.
    _stderr: BufReader<std::process::ChildStderr>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Server {
    start_model(&fixture("qwen3_moe-q4g64"), extra)
}

/// A server for the model directory or packed store at `model`.
fn start_model(model: &Path, extra: &[&str]) -> Server {
    // The library's kernels, which the tests compare against (the command line defaults to q8).
    let mut args = vec![
        "serve",
        "-m",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--model-id",
        "fox",
        "--kernels",
        "exact",
    ];
    args.extend_from_slice(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(&args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    stderr.read_line(&mut line).unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let s = Server {
        child,
        addr,
        _stderr: stderr,
    };
    let t = Instant::now();
    while request(&s, "GET", "/health", "").0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(30), "server never became ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    s
}

/// One HTTP/1.1 request; returns status and body (chunked bodies are de-chunked).
fn request(s: &Server, method: &str, path: &str, body: &str) -> (u16, String) {
    // A server may answer (a 413) and close before the whole body is sent: the write then fails and the
    // close may reset the connection before the answer is read, so that case is tried again.
    let mut raw = Vec::new();
    for attempt in 0..5 {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        let sent = write!(
            c,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        raw.clear();
        let read = c.read_to_end(&mut raw);
        if sent.is_ok() {
            read.unwrap();
        }
        if !raw.is_empty() || attempt == 4 {
            break;
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut r = rest;
        while let Some((size, tail)) = r.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            r = &tail[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}

fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (st, b) = request(s, "POST", path, &body.to_string());
    (st, serde_json::from_str(&b).unwrap_or_else(|_| json!({"raw": b})))
}

/// The data lines of an SSE body, parsed, up to `[DONE]` (which must be there).
fn sse(body: &str) -> Vec<Value> {
    let data: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn greedy(prompt: Prompt, max: usize) -> String {
    greedy_with_stats(prompt, max).0
}

/// The text `generate` writes greedily, with its statistics (prompt and generated token counts).
fn greedy_with_stats(prompt: Prompt, max: usize) -> (String, GenerationStats) {
    let p = Pipeline::load(&fixture("qwen3_moe-q4g64")).unwrap();
    let mut text = String::new();
    let params = GenerateParams {
        max_tokens: max,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    };
    let stats = p
        .generate(&prompt, &params, |t| {
            text.push_str(t);
            true
        })
        .unwrap();
    (text, stats)
}

#[test]
fn endpoints_match_generate_streaming_and_not() {
    let s = start(&[]);
    let (st, body) = request(&s, "GET", "/v1/models", "");
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "fox");

    let (want, stats) = greedy_with_stats(Prompt::Chat(vec![ChatMessage::new("user", "Name a fox.")]), 12);
    let req = json!({"model": "fox", "messages": [{"role": "user", "content": "Name a fox."}], "max_tokens": 12, "temperature": 0});
    let (st, v) = post(&s, "/v1/chat/completions", &req);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    // Usage counts what generate counted: the chat-templated prompt's tokens and the tokens generated.
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64(),
        Some(stats.prompt_tokens as u64),
        "{v}"
    );
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64(),
        Some(stats.generated_tokens as u64),
        "{v}"
    );
    assert_eq!(
        v["usage"]["total_tokens"].as_u64(),
        Some((stats.prompt_tokens + stats.generated_tokens) as u64)
    );
    assert!(stats.prompt_tokens > 5 && stats.generated_tokens <= 12, "{stats:?}");
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (st, body) = request(&s, "POST", "/v1/chat/completions", &streamed.to_string());
    assert_eq!(st, 200);
    let chunks = sse(&body);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    assert_eq!(chunks.last().unwrap()["usage"], v["usage"]);
    // The chunks before it say `"usage": null`, as OpenAI's do; without `include_usage`, none has the key.
    let (before, _) = chunks.split_at(chunks.len() - 1);
    assert!(before.iter().all(|c| c.get("usage") == Some(&Value::Null)), "{body}");

    let want = greedy(Prompt::Raw("The quick brown fox".into()), 10);
    let req = json!({"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0});
    let (st, v) = post(&s, "/v1/completions", &req);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    let mut streamed = req.clone();
    streamed["stream"] = json!(true);
    let (_, body) = request(&s, "POST", "/v1/completions", &streamed.to_string());
    assert!(sse(&body).iter().all(|c| c.get("usage").is_none()), "{body}");
    let text: String = sse(&body)
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, want);

    // OpenAI's stream shape: a chat stream opens with the role and no text, later chunks carry text only, and
    // every chunk has the same id and `created`.
    let chat = json!({"messages": [{"role": "user", "content": "Name a fox."}], "max_tokens": 12, "stream": true});
    let (_, body) = request(&s, "POST", "/v1/chat/completions", &chat.to_string());
    let chunks = sse(&body);
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(
        chunks[1..]
            .iter()
            .all(|c| c["choices"][0]["delta"].get("role").is_none()),
        "{body}"
    );
    assert!(chunks
        .iter()
        .all(|c| c["created"] == chunks[0]["created"] && c["id"] == chunks[0]["id"]));

    // A lower expert top-k per request is accepted; above the server's is refused.
    let (st, _) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 3, "expert_top_k": 1}),
    );
    assert_eq!(st, 200);
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 3, "expert_top_k": 9}),
    );
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("expert_top_k")));

    // Metrics after traffic: the series the README lists exist.
    let (st, m) = request(&s, "GET", "/metrics", "");
    assert_eq!(st, 200);
    for name in [
        "sluice_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}",
        "sluice_time_to_first_token_seconds_bucket",
        "sluice_inter_token_latency_seconds_bucket",
        "sluice_e2e_request_latency_seconds_bucket",
        "sluice_prompt_tokens_total",
        "sluice_generation_tokens_total",
        "sluice_queue_length",
        "sluice_requests_running",
        "sluice_expert_top_k",
        "sluice_resident_memory_bytes",
        "sluice_expert_cache_hits_total",
        "sluice_expert_read_bytes_total",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics");
    }
    // Every metric the Grafana dashboard queries exists with the type its query needs: a histogram through
    // its `_bucket` series, and `rate()` only over counters and buckets.
    let dash =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../dashboards/sluice.json")).unwrap();
    let types: std::collections::HashMap<&str, &str> = (m.lines())
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut queried = 0;
    for word in dash.split(|c: char| !is_word(c)).filter(|w| w.starts_with("sluice_")) {
        let (name, histogram) = match word.strip_suffix("_bucket") {
            Some(base) => (base, true),
            None => (word, false),
        };
        let Some(&ty) = types.get(name) else {
            panic!("dashboard queries {word}, not exported");
        };
        assert_eq!(ty == "histogram", histogram, "dashboard queries {word}, a {ty}");
        queried += 1;
    }
    assert!(queried >= 20, "dashboard queries only {queried} sluice metrics");
    for rated in dash.split("rate(").skip(1) {
        let name = rated.split(|c: char| !is_word(c)).next().unwrap_or("");
        if name.starts_with("sluice_") && !name.ends_with("_bucket") {
            assert_eq!(
                types.get(name),
                Some(&"counter"),
                "the dashboard takes rate() of {name}"
            );
        }
    }
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = start(&[]);
    let long = "word ".repeat(2000);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, "invalid request body"),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
            "invalid request body",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            400,
            "must not be empty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            400,
            "unknown role",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).to_string(),
            404,
            "does not exist",
        ),
        (
            "/v1/completions",
            json!({"prompt": long}).to_string(),
            400,
            "context limit",
        ),
        // Streamed too: the prompt is checked before a stream's 200 goes out.
        (
            "/v1/completions",
            json!({"prompt": long, "stream": true}).to_string(),
            400,
            "context limit",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}], "stream": true}).to_string(),
            400,
            "context limit",
        ),
        (
            "/v1/completions",
            json!({"prompt": [999_999], "stream": true}).to_string(),
            400,
            "outside the vocabulary",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -1}).to_string(),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1_000_000_000}).to_string(),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 2}).to_string(),
            400,
            "n must be 1",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_json": {"type": "object"}}).to_string(),
            400,
            "guided_json is not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop_token_ids": [5]}).to_string(),
            400,
            "stop_token_ids is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": true}).to_string(),
            400,
            "chat_template_kwargs must be an object",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})
                .to_string(),
            400,
            "set by the server",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}).to_string(),
            400,
            "tools",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -1}).to_string(),
            400,
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 2}).to_string(),
            400,
            "logprobs is not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": {"5": -100}}).to_string(),
            400,
            "logit_bias is not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true}).to_string(),
            400,
            "echo is not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": vec!["a"; 17]}).to_string(),
            400,
            "at most 16 are allowed",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "stop": "z".repeat(513)}).to_string(),
            400,
            "513 bytes long",
        ),
        ("/v1/completions", "x".repeat(5 << 20), 413, "exceeds"),
        ("/v1/nothing", "{}".into(), 404, "no such endpoint"),
    ];
    // The field a bad value is in is named.
    for (body, param) in [
        (json!({"prompt": "x", "temperature": -1}), "temperature"),
        (json!({"prompt": "x", "top_p": 2}), "top_p"),
        (json!({"prompt": "x", "presence_penalty": 3}), "presence_penalty"),
        (
            json!({"prompt": "x", "max_completion_tokens": 0}),
            "max_completion_tokens",
        ),
        (json!({"prompt": "x", "reasoning_effort": "high"}), "reasoning_effort"),
        // Other servers' fields that change the output are refused, not ignored.
        (json!({"prompt": "x", "typical_p": 0.5}), "typical_p"),
        (
            json!({"prompt": "x", "repeat_last_n": 64, "repetition_penalty": 1.1}),
            "repeat_last_n",
        ),
        (
            json!({"prompt": "x", "skip_special_tokens": false}),
            "skip_special_tokens",
        ),
        (json!({"prompt": "x", "n_predict": 0}), "n_predict"),
        // Several prompts in one request.
        (json!({"prompt": [[1, 2], [3]]}), "prompt"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
    ] {
        let (st, v) = post(&s, "/v1/completions", &body);
        assert_eq!((st, &v["error"]["param"]), (400, &json!(param)), "{v}");
    }
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    for body in [
        json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": tools}}),
        json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"documents": []}}),
    ] {
        let (st, v) = post(&s, "/v1/chat/completions", &body);
        let param = "chat_template_kwargs";
        assert_eq!((st, &v["error"]["param"]), (400, &json!(param)), "{v}");
    }
    let user = json!([{"role": "user", "content": "x"}]);
    for (body, param) in [
        (
            json!({"messages": user, "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            json!({"messages": user, "continue_final_message": true}),
            "continue_final_message",
        ),
        (json!({"messages": user, "chat_template": "{{ 1 }}"}), "chat_template"),
        // Only an assistant turn may leave its content out.
        (json!({"messages": [{"role": "user"}]}), "messages"),
        (
            json!({"messages": [{"role": "system", "content": null}, {"role": "user", "content": "x"}]}),
            "messages",
        ),
    ] {
        let (st, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!((st, &v["error"]["param"]), (400, &json!(param)), "{v}");
    }
    for (path, body, status, msg) in cases {
        let (st, b) = request(&s, "POST", path, &body);
        let v: Value = serde_json::from_str(&b).unwrap_or_else(|_| panic!("{path}: not JSON: {b}"));
        assert_eq!(st, status, "{path} {}: {v}", &body[..body.len().min(80)]);
        let e = &v["error"];
        assert!(e["message"].as_str().unwrap().contains(msg), "{v}");
        assert!(
            e.get("type").is_some() && e.get("param").is_some() && e.get("code").is_some(),
            "{v}"
        );
    }
    let (st, _) = post(&s, "/v1/completions", &json!({"prompt": "still here", "max_tokens": 2}));
    assert_eq!(st, 200);
    // Those fields' "off" values, which clients send by default, pass; so do 16 stop strings of 512 bytes.
    let off = json!({"prompt": "x", "max_tokens": 2, "logprobs": false, "top_logprobs": null, "logit_bias": {},
        "echo": false, "best_of": 1, "tool_choice": "auto", "stop": vec!["s".repeat(512); 16], "typical_p": 1,
        "mirostat": 0, "repeat_last_n": 64, "skip_special_tokens": true, "bad_words": []});
    let (st, v) = post(&s, "/v1/completions", &off);
    assert_eq!(st, 200, "{v}");
    // A token id outside the vocabulary is a bad prompt, not a context overflow.
    let (st, v) = post(&s, "/v1/completions", &json!({"prompt": [999_999]}));
    assert_eq!(st, 400, "{v}");
    let e = &v["error"];
    assert!(e["message"].as_str().unwrap().contains("outside the vocabulary"), "{v}");
    assert!(e.get("type").is_some() && e.get("code").is_some(), "{v}");
    assert_eq!(e["param"], Value::Null, "{v}");
    assert_ne!(v["error"]["code"], "context_length_exceeded", "{v}");
}

#[test]
fn what_common_clients_send_is_understood() {
    let s = start(&[]);
    // Explicit nulls mean the defaults; llama.cpp's seed -1 means random.
    let nulls = json!({"prompt": "x", "max_tokens": 2, "stream": null, "ignore_eos": null,
        "stream_options": {"include_usage": null}, "seed": -1});
    let (st, v) = post(&s, "/v1/completions", &nulls);
    assert_eq!(st, 200, "{v}");
    let (st, v) = post(&s, "/v1/completions", &json!({"prompt": "x", "seed": "abc"}));
    assert_eq!((st, &v["error"]["param"]), (400, &json!("seed")), "{v}");
    // A conversation with tool calls is refused (tools are not supported yet), not passed on without them.
    let calls = json!({"messages": [{"role": "user", "content": "6*7?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function",
            "function": {"name": "mul", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "42"}]});
    let (st, v) = post(&s, "/v1/chat/completions", &calls);
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("tool calls"), "{v}");
    let legacy = json!({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]});
    let (st, v) = post(&s, "/v1/chat/completions", &legacy);
    assert_eq!((st, &v["error"]["param"]), (400, &json!("functions")), "{v}");
    let empty = json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}], "functions": [],
        "tools": [], "max_tokens": 2, "modalities": ["text"], "min_tokens": 0, "stop_token_ids": []});
    let (st, v) = post(&s, "/v1/chat/completions", &empty);
    assert_eq!(st, 200, "{v}");
    // Text parts are lines of one message, as vLLM joins them: the reply is the one to the joined text.
    let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "The quick"},
        {"type": "text", "text": "brown fox"}]}], "max_tokens": 6, "temperature": 0});
    let (st, v) = post(&s, "/v1/chat/completions", &parts);
    assert_eq!(st, 200, "{v}");
    let want = greedy(Prompt::Chat(vec![ChatMessage::new("user", "The quick\nbrown fox")]), 6);
    assert_eq!(v["choices"][0]["message"]["content"], want, "{v}");
    // Template variables reach the chat template (Qwen3's `enable_thinking`): the reply is the one to that
    // rendering.
    let kwargs = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false}});
    let (st, v) = post(&s, "/v1/chat/completions", &kwargs);
    assert_eq!(st, 200, "{v}");
    let mut vars = serde_json::Map::new();
    vars.insert("enable_thinking".into(), json!(false));
    let want = greedy(Prompt::ChatWith(vec![ChatMessage::new("user", "Hello")], vars), 6);
    assert_eq!(v["choices"][0]["message"]["content"], want, "{v}");
    // Request ids differ.
    let id = |v: &Value| v["id"].as_str().unwrap().to_string();
    let (_, a) = post(&s, "/v1/chat/completions", &empty);
    let (_, b) = post(&s, "/v1/chat/completions", &empty);
    assert_ne!(id(&a), id(&b));
    // The model by id (openai-python's `models.retrieve`), and OpenAI errors for a wrong id or method.
    let (st, body) = request(&s, "GET", "/v1/models/fox", "");
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["id"], "fox");
    let (st, body) = request(&s, "GET", "/v1/models/wolf", "");
    assert_eq!(st, 404);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["code"],
        "model_not_found"
    );
    let (st, body) = request(&s, "GET", "/v1/chat/completions", "");
    assert_eq!(st, 405);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["code"],
        "method_not_allowed"
    );
}

#[test]
fn a_host_name_is_resolved() {
    let s = start(&["--host", "localhost"]);
    assert_eq!(request(&s, "GET", "/health", "").0, 200);
}

#[test]
fn the_context_limit_is_the_one_the_kv_budget_is_planned_for() {
    // `--ctx-size` plans the KV budget for 48 tokens; requests are held to it, not to the model's context.
    let s = start(&["--ctx-size", "48"]);
    let (st, v) = post(&s, "/v1/completions", &json!({"prompt": "x", "max_tokens": 100}));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("context length 48"),
        "{v}"
    );
    let long = "word ".repeat(60);
    let (st, v) = post(&s, "/v1/completions", &json!({"prompt": long, "max_tokens": 2}));
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("context limit is 48"),
        "{v}"
    );
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let chat = json!({"messages": [{"role": "user", "content": long}], "max_tokens": 2});
    let (st, v) = post(&s, "/v1/chat/completions", &chat);
    assert_eq!((st, &v["error"]["param"]), (400, &json!("messages")), "{v}");
    // Without max_tokens a chat reply runs to the context's end: once 48 positions are filled, the token
    // sampled from the last is the last one.
    let chat = json!({"messages": [{"role": "user", "content": "x"}], "ignore_eos": true});
    let (st, v) = post(&s, "/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), 49 - prompt, "{v}");
    // A completion that reaches the limit ends there: once 48 positions are filled, the token sampled from the
    // last is the last one (as in the library's own test).
    let (st, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "word ".repeat(3), "max_tokens": 45, "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 4, "{v}");
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), 49 - prompt, "{v}");
}

/// A chat reply without `max_tokens` is not cut at a fixed length (it was 256): it runs to the context's end. A
/// text completion without one gets OpenAI's and vLLM's 16 tokens (it ran to the context's end too), or
/// llama.cpp's `n_predict`.
#[test]
fn a_reply_without_max_tokens_runs_to_the_end_of_the_context() {
    let s = start(&["--ctx-size", "400"]);
    let chat = json!({"messages": [{"role": "user", "content": "x"}], "ignore_eos": true});
    let (st, v) = post(&s, "/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), 401 - prompt, "{v}");
    for (body, want) in [
        (json!({"prompt": "x", "ignore_eos": true}), 16),
        (json!({"prompt": "x", "ignore_eos": true, "n_predict": 5}), 5),
        (
            json!({"prompt": "x", "ignore_eos": true, "n_predict": 5, "max_tokens": 3}),
            3,
        ),
    ] {
        let (st, v) = post(&s, "/v1/completions", &body);
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        assert_eq!(v["usage"]["completion_tokens"], want, "{body}: {v}");
    }
    // llama.cpp's -1: no limit but the context's.
    let body = json!({"prompt": "x", "ignore_eos": true, "n_predict": -1});
    let (st, v) = post(&s, "/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), 401 - prompt, "{v}");
    // One list of token ids in a list is that prompt (lm-evaluation-harness's form).
    let flat = post(
        &s,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}),
    );
    let nested = post(
        &s,
        "/v1/completions",
        &json!({"prompt": [[1, 2, 3]], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(flat.0, 200, "{}", flat.1);
    assert_eq!(
        flat.1["choices"][0]["text"], nested.1["choices"][0]["text"],
        "{}",
        nested.1
    );
    assert_eq!(flat.1["usage"], nested.1["usage"]);
}

#[test]
fn a_corrupt_expert_record_fails_its_request_and_the_server_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let convert = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["convert", "-m", fixture("qwen3_moe-q4g64").to_str().unwrap(), "-o"])
        .arg(&store)
        // MLX's layout: these tests run the float kernels (`start_model`), which do not read tiles.
        .args(["--layout", "mlx"])
        .output()
        .unwrap();
    assert!(convert.status.success(), "{}", String::from_utf8_lossy(&convert.stderr));
    // One flipped bit every 4 KiB: every record fails its checksum, so any generation meets one.
    let data = store.join("experts.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    for b in bytes.iter_mut().step_by(4096) {
        *b ^= 1;
    }
    std::fs::write(&data, bytes).unwrap();
    let s = start_model(&store, &["--experts", "stream", "--expert-cache", "64K"]);
    let body = json!({"model": "fox", "prompt": "The fox", "max_tokens": 4});
    for _ in 0..2 {
        let (status, r) = post(&s, "/v1/completions", &body);
        assert_eq!(status, 500, "{r}");
        let msg = r["error"]["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains("checksum mismatch") && msg.contains("expert record layer"),
            "{r}"
        );
        assert_eq!(r["error"]["type"], "server_error", "{r}");
        // Streamed, the error arrives as the last event before [DONE].
        let (status, raw) = request(
            &s,
            "POST",
            "/v1/completions",
            &json!({"stream": true, "prompt": "x"}).to_string(),
        );
        assert_eq!(status, 200);
        let events = sse(&raw);
        let last = events.last().unwrap();
        assert!(
            last["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("checksum mismatch"),
            "{raw}"
        );
        assert_eq!(request(&s, "GET", "/health", "").0, 200, "the server went down");
    }
    let (_, metrics) = request(&s, "GET", "/metrics", "");
    let errors: f64 = (metrics.lines())
        .find_map(|l| l.strip_prefix("sluice_expert_read_errors_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(errors >= 4.0, "each failed request counts its read error: {errors}");
}

#[test]
fn health_and_metrics_say_when_the_expert_slots_are_backed() {
    let s = start(&["--experts", "stream", "--expert-cache", "1M"]);
    // The start-up pass backs the slots in the background; requests are served meanwhile.
    let t = Instant::now();
    let health = loop {
        let (status, body) = request(&s, "GET", "/health", "");
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        match v["expert_slots"].as_str() {
            Some("backed") => break v,
            Some("backing") => {}
            _ => panic!("/health does not say whether the expert slots are backed: {v}"),
        }
        assert!(t.elapsed() < Duration::from_secs(30), "the slots were never backed");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(health["status"], "ok");
    let (_, metrics) = request(&s, "GET", "/metrics", "");
    assert!(
        metrics.lines().any(|l| l == "sluice_expert_slots_backed 1"),
        "{metrics}"
    );
    // Resident experts are read into their slots at load, before the server says it is ready.
    let resident = start(&["--experts", "resident"]);
    let (_, body) = request(&resident, "GET", "/health", "");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (&v["status"], &v["expert_slots"]),
        (&json!("ok"), &json!("backed")),
        "{v}"
    );
}

#[test]
fn concurrent_clients_get_their_own_answers_and_a_full_queue_says_429() {
    let s = start(&["--max-queue", "64"]);
    let prompts: Vec<String> = (0..32).map(|i| format!("Fox number {i} says")).collect();
    let want: Vec<String> = prompts.iter().map(|p| greedy(Prompt::Raw(p.clone()), 8)).collect();
    let got: Vec<(u16, Value)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (prompts.iter())
            .map(|p| {
                let s = &s;
                sc.spawn(move || {
                    post(
                        s,
                        "/v1/completions",
                        &json!({"prompt": p, "max_tokens": 8, "temperature": 0}),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (st, v)) in got.iter().enumerate() {
        assert_eq!(*st, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want[i].as_str(), "client {i}");
    }
    drop(s);

    // Queue of one: a burst of long requests overflows it; every accepted one completes.
    let s = start(&["--max-queue", "1"]);
    let got: Vec<u16> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..24)
            .map(|_| {
                let s = &s;
                sc.spawn(move || {
                    post(
                        s,
                        "/v1/completions",
                        &json!({"prompt": "go", "max_tokens": 480, "ignore_eos": true}),
                    )
                    .0
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(got.contains(&429), "{got:?}");
    assert!(got.iter().all(|&c| c == 200 || c == 429), "{got:?}");
    assert!(got.contains(&200));
}

#[test]
fn a_client_that_disconnects_frees_the_engine() {
    // A model slow enough (4 layers, an 8192-token vocabulary, one thread) that its 480 tokens outlast the
    // disconnect on a loaded machine: on the 2-layer fixture they could all be made before the server noticed.
    let s = start_model(
        &fixture("brown-qwen3_moe-q8g32"),
        &["--max-queue", "1", "--threads", "1"],
    );
    let body = json!({"prompt": "go", "max_tokens": 480, "ignore_eos": true, "stream": true}).to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Its first token: the generation runs (a stream's headers come when it is queued, before it runs).
    let (mut got, mut buf) = (Vec::new(), [0u8; 256]);
    while !String::from_utf8_lossy(&got).contains("data:") {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    drop(c);
    // The next request runs (its place was freed), and nothing stays running afterwards.
    let (st, v) = post(&s, "/v1/completions", &json!({"prompt": "next", "max_tokens": 4}));
    assert_eq!(st, 200, "{v}");
    // The abandoned generation was stopped early (cancelled), not run to its 480 tokens.
    let t = Instant::now();
    loop {
        let (_, m) = request(&s, "GET", "/metrics", "");
        if m.contains("sluice_requests_cancelled_total 1") && m.contains("sluice_requests_running 0") {
            // Both requests count in the latency, and the abandoned one's tokens in the totals (they were
            // counted where the reply is written, which a client that left never reaches).
            assert!(m.contains("sluice_e2e_request_latency_seconds_count 2"), "{m}");
            let generated = m
                .lines()
                .find_map(|l| l.strip_prefix("sluice_generation_tokens_total "))
                .and_then(|n| n.parse::<u64>().ok());
            let next_tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
            assert!(generated.is_some_and(|g| g > next_tokens), "{m}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_server_flags_fail_at_start() {
    let dir = fixture("qwen3_moe-q4g64");
    for (flags, want) in [
        (&["--top-k", "99"][..], "--top-k 99"),
        (&["--max-queue", "0"][..], "--max-queue"),
        (&["--ctx-size", "0"][..], "--ctx-size"),
    ] {
        let mut args = vec!["serve", "-m", dir.to_str().unwrap(), "--port", "0"];
        args.extend_from_slice(flags);
        let out = Command::new(env!("CARGO_BIN_EXE_sluice")).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want) && !err.contains("panicked"),
            "{err}"
        );
    }
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let mut s = start(&[]);
    let (st, _) = post(&s, "/v1/completions", &json!({"prompt": "bye", "max_tokens": 2}));
    assert_eq!(st, 200);
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let t = Instant::now();
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A copy of fixture `name` to change, in a directory that lives as long as the first value.
fn copy_of_fixture(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    (tmp, dir)
}

/// An assistant turn's `reasoning_content` reaches the chat template (Qwen3's renders it as a `<think>` block);
/// it was dropped with the other unknown fields.
#[test]
fn an_assistant_turns_reasoning_reaches_the_template() {
    let (_tmp, dir) = copy_of_fixture("qwen3_moe-q4g64");
    let t = "{% for m in messages %}{% if m.reasoning_content is string %}<think>{{ m.reasoning_content }}</think>\
             {% endif %}{{ m.content }}{% endfor %}";
    std::fs::write(dir.join("chat_template.jinja"), t).unwrap();
    let s = start_model(&dir, &[]);
    let tokens = |assistant: Value| {
        let body = json!({"messages": [{"role": "user", "content": "q"}, assistant], "max_tokens": 1});
        let (st, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{v}");
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let raw = |text: &str| {
        let (st, v) = post(&s, "/v1/completions", &json!({"prompt": text, "max_tokens": 1}));
        assert_eq!(st, 200, "{v}");
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let plain = tokens(json!({"role": "assistant", "content": "A"}));
    let reasoned = tokens(json!({"role": "assistant", "content": "A", "reasoning_content": "Rx"}));
    assert_eq!(plain, raw("qA"));
    assert_eq!(reasoned, raw("q<think>Rx</think>A"));
    assert!(reasoned > plain);
}

/// Sampling values a request leaves out come from the model's `generation_config.json` (as vLLM's), unless
/// `--sampling-defaults openai`; a request's own values win either way.
#[test]
fn generation_config_sets_the_sampling_a_request_leaves_out() {
    let (_tmp, dir) = copy_of_fixture("qwen3_moe-q4g64");
    // top_k 1: the likeliest token whatever the temperature.
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"top_k": 1, "temperature": 0.7}"#,
    )
    .unwrap();
    let text = |s: &Server, extra: Value| {
        let mut body = json!({"prompt": "the fox", "max_tokens": 16, "seed": 7, "ignore_eos": true});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, v) = post(s, "/v1/completions", &body);
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let s = start_model(&dir, &[]);
    let greedy = text(&s, json!({"temperature": 0}));
    let sampled = text(&s, json!({"temperature": 1.0, "top_k": -1}));
    assert_ne!(
        greedy, sampled,
        "seed 7 at temperature 1 picks other tokens than greedy on this model"
    );
    assert_eq!(text(&s, json!({})), greedy, "the model's top_k 1");
    assert_eq!(text(&s, json!({"seed": 8})), greedy);
    drop(s);
    // OpenAI's defaults: temperature 1, no top_k.
    let s = start_model(&dir, &["--sampling-defaults", "openai"]);
    assert_eq!(text(&s, json!({})), sampled);
}

/// Every node of three realistic requests (a chat with most sampling fields, the same streamed, a completion)
/// replaced in turn by a value of another kind or range, or removed: each answer is a completion (a JSON one,
/// or an SSE stream that ends with `[DONE]`) or a 4xx with an OpenAI error body that says what is wrong. Never a
/// 5xx, never a dropped connection, and the server keeps serving. `SLUICE_SHOW_MUTATIONS=1` prints each answer.
#[test]
fn every_request_field_damaged_gets_a_completion_or_an_openai_error() {
    let s = start(&[]);
    let chat = json!({
        "model": "fox",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1, "seed": 7,
        "stop": ["\n\n"], "n": 1, "expert_top_k": 2, "ignore_eos": false,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let completion = json!({"model": "fox", "prompt": "It was a", "max_tokens": 4, "temperature": 0, "stop": "x"});
    let replacements = [
        json!(0),
        json!(1),
        json!(-1),
        json!(1_000_003),
        json!(2.5),
        json!("7"),
        json!("x"),
        json!(""),
        Value::Null,
        json!(true),
        json!([]),
        json!({}),
    ];
    let mut checked = 0;
    let mut faults = Vec::new();
    for (endpoint, base) in [
        ("/v1/chat/completions", &chat),
        ("/v1/chat/completions", &streamed),
        ("/v1/completions", &completion),
    ] {
        // Undamaged, each is answered: a case fails for its damage.
        let (st, body) = request(&s, "POST", endpoint, &base.to_string());
        assert_eq!(st, 200, "{endpoint} {base}: {body}");
        let mut pointers = Vec::new();
        every_node(base, String::new(), &mut pointers);
        for pointer in pointers {
            let (parent, key) = pointer.rsplit_once('/').unwrap();
            let mut cases: Vec<(String, Value)> = Vec::new();
            for r in &replacements {
                let mut v = base.clone();
                *v.pointer_mut(&pointer).unwrap() = r.clone();
                cases.push((format!("{pointer} = {r}"), v));
            }
            let mut v = base.clone();
            match v.pointer_mut(parent).unwrap() {
                Value::Object(m) => drop(m.remove(key)),
                Value::Array(a) => drop(a.remove(key.parse::<usize>().unwrap())),
                _ => unreachable!("a node sits in an object or an array"),
            }
            cases.push((format!("{pointer} removed"), v));
            for (label, body) in cases {
                checked += 1;
                let (st, text) = request(&s, "POST", endpoint, &body.to_string());
                let stream = body["stream"] == json!(true);
                let fine = match st {
                    200 if stream => text.lines().any(|l| l == "data: [DONE]"),
                    200 => serde_json::from_str::<Value>(&text).is_ok_and(|v| v["choices"][0].is_object()),
                    400..=499 => serde_json::from_str::<Value>(&text).is_ok_and(|v| {
                        v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()) && v["error"]["type"].is_string()
                    }),
                    _ => false,
                };
                if std::env::var_os("SLUICE_SHOW_MUTATIONS").is_some() {
                    eprintln!("{endpoint} {label}: {st}");
                }
                if !fine {
                    faults.push(format!("{endpoint} {label}: {st} {}", &text[..text.len().min(300)]));
                }
            }
        }
    }
    assert!(checked > 500, "only {checked} requests: the walk found too few fields");
    assert!(
        faults.is_empty(),
        "{} of {checked} damaged requests:\n{}",
        faults.len(),
        faults.join("\n")
    );
    assert_eq!(request(&s, "GET", "/health", "").0, 200);
}

/// The JSON pointer of every node of `v` below the root.
fn every_node(v: &Value, at: String, out: &mut Vec<String>) {
    let children: Vec<(String, &Value)> = match v {
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| (k.replace('~', "~0").replace('/', "~1"), v))
            .collect(),
        Value::Array(a) => a.iter().enumerate().map(|(i, v)| (i.to_string(), v)).collect(),
        _ => Vec::new(),
    };
    for (k, child) in children {
        let p = format!("{at}/{k}");
        out.push(p.clone());
        every_node(child, p, out);
    }
}
