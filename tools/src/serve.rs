//! `sluice serve`: the OpenAI-compatible server.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use sluice_runtime::Pipeline;
use sluice_server::ServerConfig;

use crate::store_cmds::EngineArgs;
use crate::ContextArgs;

/// Arguments of `sluice serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Model directory or packed store.
    #[arg(short = 'm', long, env = "SLUICE_MODEL")]
    model: PathBuf,
    /// Address to listen on: an IP address, or a host name such as `localhost`.
    #[arg(long, default_value = "127.0.0.1", env = "SLUICE_HOST")]
    host: String,
    /// Port (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080, env = "SLUICE_PORT")]
    port: u16,
    /// Model id clients send (default: the model directory's name).
    #[arg(long, env = "SLUICE_MODEL_ID")]
    model_id: Option<String>,
    /// Experts per token (default: the model's own); requests may lower it with `expert_top_k`.
    #[arg(long, env = "SLUICE_TOP_K")]
    top_k: Option<usize>,
    /// Requests that may wait for the engine before new ones get 429.
    #[arg(long, default_value_t = 64, env = "SLUICE_MAX_QUEUE")]
    max_queue: usize,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long, env = "SLUICE_THREADS")]
    threads: Option<usize>,
    /// Where the sampling values a request leaves out come from: `model`, the checkpoint's
    /// `generation_config.json` (as vLLM; Qwen3's: temperature 0.6, top_k 20, top_p 0.95), or `openai`,
    /// OpenAI's (temperature 1, top_p 1)
    #[arg(long, value_enum, default_value_t = SamplingDefaults::Model, env = "SLUICE_SAMPLING_DEFAULTS")]
    sampling_defaults: SamplingDefaults,
    #[command(flatten)]
    context: ContextArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// `--sampling-defaults`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SamplingDefaults {
    /// The checkpoint's `generation_config.json`.
    Model,
    /// OpenAI's.
    Openai,
}

/// The address `--host` and `--port` name: an IP address (`::` and `[::1]` too) or a host name such as
/// `localhost`, resolved (its first address).
fn listen_addr(host: &str, port: u16) -> Result<SocketAddr> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    use std::net::ToSocketAddrs;
    (host, port)
        .to_socket_addrs()
        .with_context(|| format!("bad --host `{host}`"))?
        .next()
        .with_context(|| format!("--host `{host}` resolves to no address"))
}

/// Runs `sluice serve` until SIGINT or SIGTERM.
pub fn run(a: ServeArgs) -> Result<()> {
    crate::check_threads(a.threads)?;
    if a.max_queue == 0 {
        bail!("--max-queue must be at least 1");
    }
    let mut opts = a.engine.options()?;
    opts.context = a.context.ctx_size;
    // Requests may lower the experts per token, not raise them: the plan is for the server's.
    opts.top_k = a.top_k;
    opts.threads = a.threads;
    let addr = listen_addr(&a.host, a.port)?;
    let model_id = a.model_id.clone().unwrap_or_else(|| {
        a.model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "sluice".into())
    });
    let cfg = ServerConfig {
        addr,
        model_id: model_id.clone(),
        max_queue: a.max_queue,
        top_k: a.top_k,
        threads: a.threads,
        shutdown_grace: std::time::Duration::from_secs(30),
        model_sampling_defaults: a.sampling_defaults == SamplingDefaults::Model,
    };
    let model = a.model.clone();
    let load = move || {
        let t = std::time::Instant::now();
        let p = Pipeline::load_with(&model, &opts).map_err(|e| format!("{}: {e}", model.display()))?;
        let _ = writeln!(
            std::io::stderr(),
            "sluice: model loaded in {:.1} s; ready\n{}",
            t.elapsed().as_secs_f64(),
            p.model.memory_plan
        );
        Ok(p)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(sluice_server::serve(
        cfg,
        load,
        |bound| {
            eprintln!("sluice: serving `{model_id}` on http://{bound} (loading the model; /health says when ready)")
        },
        shutdown_signal(),
    ))?;
    // Neither a load cut short nor a response past its grace is waited for.
    rt.shutdown_background();
    let _ = writeln!(std::io::stderr(), "sluice: shut down");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
