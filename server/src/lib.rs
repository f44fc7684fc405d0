//! The OpenAI-compatible HTTP server of sluice: axum handlers in front of one engine thread fed by a
//! bounded FIFO queue, SSE streaming, and a Prometheus registry that also exports the expert store's
//! counters.
//!
//! One sequence decodes at a time; queued requests wait in arrival order, a full queue answers 429, and a
//! client that disconnects stops its generation at the next token.

#![warn(missing_docs)]

pub mod api;
pub mod engine;
pub mod metrics;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use sluice_runtime::Pipeline;

use crate::api::{AppState, Loaded};
use crate::engine::EngineHandle;
use crate::metrics::Metrics;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on.
    pub addr: SocketAddr,
    /// The model id clients send (and `/v1/models` lists).
    pub model_id: String,
    /// Requests that may wait for the engine before 429.
    pub max_queue: usize,
    /// Experts per token (`None`: the model's own); requests may lower it.
    pub top_k: Option<usize>,
    /// Compute threads of the engine (`None`: all cores).
    pub threads: Option<usize>,
    /// How long in-flight responses may take to finish once shutdown begins (a client that stopped reading
    /// would otherwise hold the server up for good).
    pub shutdown_grace: std::time::Duration,
    /// Sampling values a request leaves out come from the model's `generation_config.json` (else OpenAI's:
    /// temperature 1, top_p 1, no top_k, min_p or repetition penalty).
    pub model_sampling_defaults: bool,
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(api::health))
        .route("/metrics", get(api::metrics))
        .route("/v1/models", get(api::models))
        // Hugging Face-style ids have a slash (`Qwen/Qwen3-30B-A3B`), and clients send them unencoded.
        .route("/v1/models/{*id}", get(api::model))
        .route("/v1/chat/completions", post(api::chat))
        .route("/v1/completions", post(api::completions))
        .fallback(|| async { api::ApiError::not_found() })
        .method_not_allowed_fallback(|| async { api::ApiError::method_not_allowed() })
        .with_state(state)
}

/// Binds `cfg.addr`, answers `/health` with 503 while `load` runs on a blocking thread, then serves until
/// `shutdown` resolves (in-flight responses get `cfg.shutdown_grace` to finish; a shutdown during the load
/// returns at once). Calls `on_bound` with the bound address.
pub async fn serve(
    cfg: ServerConfig,
    load: impl FnOnce() -> anyhow_free::Result<Pipeline> + Send + 'static,
    on_bound: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .map_err(|e| ServeError::Bind(cfg.addr, e))?;
    let addr = listener.local_addr().map_err(|e| ServeError::Bind(cfg.addr, e))?;
    on_bound(addr);
    let state = Arc::new(AppState {
        model_id: cfg.model_id.clone(),
        loaded: std::sync::OnceLock::new(),
    });
    let app = router(Arc::clone(&state));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|&s| s).await;
        }
    };
    let graceful = stopped();
    let server = tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(graceful).await });
    let grace = cfg.shutdown_grace;
    let deadline = {
        let stopped = stopped();
        async move {
            stopped.await;
            tokio::time::sleep(grace).await;
        }
    };
    let pipeline = tokio::select! {
        loaded = tokio::task::spawn_blocking(load) => {
            loaded.map_err(|e| ServeError::Load(e.to_string()))?.map_err(ServeError::Load)?
        }
        // The load runs on; the process is on its way out.
        () = stopped() => return Ok(()),
    };
    pipeline
        .model
        .check_top_k(cfg.top_k)
        .map_err(|e| ServeError::Load(e.to_string()))?;
    let top_k = cfg.top_k.unwrap_or(pipeline.model.info.default_top_k);
    // The slot memory the engine really holds (resident or streamed); 0 when experts are mmap'd.
    let m = &pipeline.model;
    let cache_bytes = m.expert_slots().unwrap_or(0) as u64 * m.expert_slot_len().unwrap_or(0) as u64;
    let metrics = Metrics::new(top_k, m.expert_counters(), cache_bytes);
    // The plan's context, not the model's: KV beyond what the plan budgets would take the experts' room.
    let (codec, limits) = (Arc::clone(&pipeline.codec), pipeline.prompt_limits());
    let sampling_defaults = match cfg.model_sampling_defaults {
        true => codec.generation_defaults(),
        false => Default::default(),
    };
    if sampling_defaults != Default::default() {
        tracing::info!(
            ?sampling_defaults,
            "sampling values a request leaves out: generation_config.json's"
        );
    }
    let engine = EngineHandle::start(pipeline, cfg.max_queue, cfg.threads, Arc::clone(&metrics));
    let _ = state.loaded.set(Loaded {
        engine,
        metrics,
        top_k,
        codec,
        limits,
        sampling_defaults,
        // As many as there are cores: more would only queue on them, and take them from the generation.
        tokenizing: Arc::new(tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(2, |n| n.get()),
        )),
        tokenizing_bytes: Arc::new(tokio::sync::Semaphore::new(api::TOKENIZING_BYTES)),
    });
    tracing::info!(%addr, "model loaded; serving");
    tokio::select! {
        r = server => r.map_err(|e| ServeError::Serve(e.to_string()))?.map_err(|e| ServeError::Serve(e.to_string())),
        () = deadline => {
            tracing::warn!("responses still open {grace:?} after shutdown began; closing them");
            Ok(())
        }
    }
}

/// Loading errors are passed as text so this crate needs no error framework.
pub mod anyhow_free {
    /// A result whose error is a message.
    pub type Result<T> = std::result::Result<T, String>;
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound.
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    /// The model failed to load.
    #[error("loading the model: {0}")]
    Load(String),
    /// The HTTP server failed.
    #[error("server: {0}")]
    Serve(String),
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shutdown_during_the_load_returns_at_once() {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let cfg = ServerConfig {
            addr: "127.0.0.1:0".parse().unwrap(),
            model_id: "fox".into(),
            max_queue: 1,
            top_k: None,
            threads: Some(1),
            shutdown_grace: Duration::from_secs(30),
            model_sampling_defaults: true,
        };
        // A load that would take 30 s.
        let load = move || {
            let _ = held.recv_timeout(Duration::from_secs(30));
            Err("never loaded".to_string())
        };
        let t = Instant::now();
        let r = serve(cfg, load, |_| {}, tokio::time::sleep(Duration::from_millis(100))).await;
        assert!(r.is_ok(), "{r:?}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "waited {:?} for the load",
            t.elapsed()
        );
        let _ = release.send(());
    }

    /// A request is tokenized and checked by its handler, not by the engine: a bad prompt's 400 and a stream's
    /// headers come at once, however long the queue waits (here on an engine that never takes a job). Both
    /// waited for the engine to reach the request.
    #[test]
    fn requests_are_checked_and_streams_open_without_waiting_for_the_engine() {
        use std::io::{Read, Write};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3_moe-q4g64");
        let codec = Arc::new(sluice_runtime::TextCodec::load(&dir, &[]).unwrap());
        let metrics = Metrics::new(4, None, 0);
        let state = Arc::new(AppState {
            model_id: "fox".into(),
            loaded: std::sync::OnceLock::new(),
        });
        let limits = sluice_runtime::PromptLimits {
            context: 64,
            vocab_size: 1000,
        };
        let loaded = Loaded {
            engine: EngineHandle::idle(4, Arc::clone(&metrics)),
            metrics,
            top_k: 4,
            codec,
            limits,
            sampling_defaults: Default::default(),
            tokenizing: Arc::new(tokio::sync::Semaphore::new(2)),
            tokenizing_bytes: Arc::new(tokio::sync::Semaphore::new(api::TOKENIZING_BYTES)),
        };
        assert!(state.loaded.set(loaded).is_ok());
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::clone(&state);
        rt.spawn(async move { axum::serve(listener, router(state)).await });
        // The head of the answer to `body` (and what came with it), or what arrived within 10 s.
        let answer = |path: &str, body: String| {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            write!(
                c,
                "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
            while !String::from_utf8_lossy(&got).contains("\r\n\r\n") {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            String::from_utf8_lossy(&got).into_owned()
        };
        let long = serde_json::json!({"prompt": "word ".repeat(100), "max_tokens": 1}).to_string();
        let got = answer("/v1/completions", long);
        assert!(got.starts_with("HTTP/1.1 400"), "{got}");
        let stream = serde_json::json!({"prompt": "x", "max_tokens": 1, "stream": true}).to_string();
        let got = answer("/v1/completions", stream);
        assert!(
            got.starts_with("HTTP/1.1 200") && got.contains("text/event-stream"),
            "{got}"
        );
        let chat = serde_json::json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": false}, "stream": true});
        let got = answer("/v1/chat/completions", chat.to_string());
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        // Prompt text is tokenized within a byte budget over every request: while it is all taken, a request
        // waits for its share, then is answered.
        let budget = &shared.loaded.get().unwrap().tokenizing_bytes;
        let taken = rt.block_on(budget.acquire_many(api::TOKENIZING_BYTES as u32)).unwrap();
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        let body = serde_json::json!({"prompt": "word ".repeat(100), "max_tokens": 1}).to_string();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        c.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        let mut head = [0u8; 12];
        assert!(
            c.read_exact(&mut head).is_err(),
            "answered without its share of the budget"
        );
        drop(taken);
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 400");
        // Four streams held open fill the queue of four (the engine takes none): a fifth request is refused
        // before its prompt is tokenized, so even a prompt over the context limit gets the 429.
        let held: Vec<std::net::TcpStream> = (0..4)
            .map(|_| {
                let mut c = std::net::TcpStream::connect(addr).unwrap();
                let body = serde_json::json!({"prompt": "x", "max_tokens": 1, "stream": true}).to_string();
                write!(
                    c,
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .unwrap();
                let mut head = [0u8; 12];
                c.read_exact(&mut head).unwrap();
                assert_eq!(&head, b"HTTP/1.1 200");
                c
            })
            .collect();
        let long = serde_json::json!({"prompt": "word ".repeat(100), "max_tokens": 1}).to_string();
        let got = answer("/v1/completions", long);
        assert!(got.starts_with("HTTP/1.1 429"), "{got}");
        // Their clients leave: their places are given up (the server notices the closed connections), and a
        // new stream is queued again.
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stream = serde_json::json!({"prompt": "x", "max_tokens": 1, "stream": true}).to_string();
            let got = answer("/v1/completions", stream);
            if got.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(Instant::now() < deadline, "the queue stayed full: {got}");
            std::thread::sleep(Duration::from_millis(50));
        }
        // Whole replies waiting in the queue hold no tokenization permit: with as many of them queued as prompts
        // may be tokenized at once (2 here), a bad prompt still gets its 400 at once (it waited for good).
        let whole: Vec<std::net::TcpStream> = (0..2)
            .map(|_| {
                let mut c = std::net::TcpStream::connect(addr).unwrap();
                let body = serde_json::json!({"prompt": "x", "max_tokens": 1}).to_string();
                write!(
                    c,
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .unwrap();
                c
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let long = serde_json::json!({"prompt": "word ".repeat(100), "max_tokens": 1}).to_string();
        let got = answer("/v1/completions", long);
        assert!(got.starts_with("HTTP/1.1 400"), "{got}");
        drop(whole);
    }
}
