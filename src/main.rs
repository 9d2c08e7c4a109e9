//! The `braid-proxy` binary: parse the configuration, set up logging,
//! handle signals, and run the library's server.

use std::process::ExitCode;

use braid_proxy::config::{Args, Config, LogFormat, Upstream};
use braid_proxy::server::Server;
use clap::Parser;
use tracing_subscriber::EnvFilter;

/// jemalloc gives the memory of dropped state back to the system, with
/// its background purging thread; glibc's malloc kept most of it
/// (BENCHMARKS.md, "Memory within --state-bytes").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let args = Args::parse();
    let config = match Config::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("braid-proxy: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Text => logs.init(),
        // One JSON object per line: time, level, target, message and fields.
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    // jemalloc's purging thread returns freed pages within seconds; with
    // one worker the process keeps to one thread, and pages are returned
    // as the allocator is used.
    if config.workers != 1 {
        let _ = tikv_jemalloc_ctl::background_thread::write(true);
    }
    // One worker is the single-threaded runtime. It runs woken tasks in
    // order, so an h2c connection writes after all its streams have run:
    // fewer, larger writes and later first bytes (BENCHMARKS.md, "Runtime
    // flavour").
    let mut builder = match config.workers {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if n > 1 {
                b.worker_threads(n);
            }
            b
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("braid-proxy: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("braid-proxy: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Prints a line to stdout, ignoring a closed stdout (a supervisor that
/// read the banner and went away must not take the proxy down with it).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

async fn run(mut config: Config) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let demo = config.upstream.is_none();
    if demo {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(braid_proxy::demo::serve(listener));
        config.upstream = Some(Upstream::parse(&format!("http://{addr}"))?);
    }
    let server = Server::bind(config.clone())
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = server.local_addr()?;
    say!("braid-proxy listening on http://{addr}");
    if let Some(admin) = server.admin_addr() {
        say!("braid-proxy admin listening on http://{admin}");
    }
    if demo {
        say!("demo origin (plain REST) started; open http://{addr}/ in a browser, or try:");
        say!("  curl -N -H 'Subscribe: true' http://{addr}/clock");
        say!("  curl -X PUT --data 'new text' http://{addr}/notes.txt");
    } else if let Some(upstream) = &config.upstream {
        say!("proxying {upstream}");
    }
    server.run(shutdown_signal()).await
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
