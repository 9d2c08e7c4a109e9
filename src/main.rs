//! The `braid-proxy` binary: parse the configuration, set up logging,
//! handle signals, and run the library's server.

use std::process::ExitCode;

use braid_proxy::config::{Args, Config, LogFormat, Upstream};
use braid_proxy::limits::FileLimit;
use braid_proxy::listen::server::Server;
use clap::Parser;
use tracing_subscriber::fmt::writer::MakeWriterExt;
use tracing_subscriber::EnvFilter;

/// jemalloc gives the memory of dropped state back to the system (its
/// decay is set in .cargo/config.toml); glibc's malloc kept most of it
/// (BENCHMARKS.md, "Memory within --state-bytes").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    // A bad command line or configuration is reported in the format it
    // asked for, when the flag says (a config file's `log-format` is not
    // known yet); `--help` and `--version` stay text.
    let json_flag = asks_for_json(std::env::args());
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if json_flag && e.use_stderr() => {
            init_logs(LogFormat::Json);
            fatal(LogFormat::Json, e.render().to_string().trim_end());
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    let config = match Config::from_args(args) {
        Ok(config) => config,
        Err(e) => {
            let format = if json_flag {
                LogFormat::Json
            } else {
                LogFormat::Text
            };
            init_logs(format);
            fatal(format, e);
            return ExitCode::from(2);
        }
    };
    init_logs(config.log_format);
    // Before anything is opened: the listeners and every connection count.
    let files = braid_proxy::limits::set_at_start(config.max_open_files, config.max_subscriptions);
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
            fatal(config.log_format, format!("cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let format = config.log_format;
    match runtime.block_on(run(config, files)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            fatal(format, e);
            ExitCode::FAILURE
        }
    }
}

/// Whether the command line says `--log-format json` (or `=json`).
fn asks_for_json(args: impl Iterator<Item = String>) -> bool {
    let mut json = false;
    let mut value_next = false;
    for arg in args {
        if value_next {
            json = arg.trim() == "json";
        }
        value_next = arg == "--log-format";
        if let Some(value) = arg.strip_prefix("--log-format=") {
            json = value.trim() == "json";
        }
    }
    json
}

/// The target of the listening banner's event in JSON format; it goes to
/// stdout, whatever `RUST_LOG` says, where supervisors and scripts read it.
const BANNER: &str = "braid_proxy::banner";

/// Sets up the log lines on stderr: text, or one JSON object per line (in
/// which case panics are logged as JSON events too, and the banner is an
/// event on stdout).
fn init_logs(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_timer(braid_proxy::logtime::LogClock)
            .with_writer(std::io::stderr)
            // Colours for a person at a terminal; none in files and pipes
            // (supervisors, log shippers), nor with NO_COLOR set.
            .with_ansi(
                std::io::IsTerminal::is_terminal(&std::io::stderr())
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            )
            .init(),
        LogFormat::Json => {
            let filter = match BANNER.parse() {
                Ok(banner) => filter.add_directive(banner),
                Err(_) => filter,
            };
            let writer = std::io::stdout
                .with_filter(|meta: &tracing::Metadata<'_>| meta.target() == BANNER)
                .or_else(std::io::stderr);
            // Time, level, target, message and fields.
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(writer)
                .json()
                .flatten_event(true)
                .init();
            std::panic::set_hook(Box::new(|panic| tracing::error!(%panic, "panic")));
        }
    }
}

/// Reports the error that stops the proxy: `braid-proxy: <error>` on
/// stderr, or an error event in JSON format.
fn fatal(format: LogFormat, error: impl std::fmt::Display) {
    match format {
        LogFormat::Text => eprintln!("braid-proxy: {error}"),
        LogFormat::Json => tracing::error!(%error, "braid-proxy stopped"),
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

async fn run(
    mut config: Config,
    files: Option<FileLimit>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let demo = config.upstream.is_none();
    if demo {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(braid_proxy::demo::serve(listener));
        config.upstream = Some(Upstream::parse(&format!("http://{addr}"))?);
    }
    // A TLS file that does not load is its own error (naming the file).
    let server = Server::bind(config.clone())
        .await
        .map_err(|e| e.to_string())?;
    let addr = server.local_addr()?;
    let admin = server.admin_addr();
    // TLS hook (issue 47): a TLS listener is named with https.
    let scheme = if server.tls().is_some() {
        "https"
    } else {
        "http"
    };
    if config.log_format == LogFormat::Json {
        let upstream = config.upstream.as_ref().map(|u| u.to_string());
        tracing::info!(
            target: BANNER,
            listen = %format_args!("{scheme}://{addr}"),
            admin = admin.map(|a| format!("http://{a}")),
            upstream,
            demo,
            open_files = files.map(|f| f.soft),
            open_files_hard = files.map(|f| f.hard),
            open_files_was = files.map(|f| f.was),
            "braid-proxy listening"
        );
    } else {
        say!("braid-proxy listening on {scheme}://{addr}");
        if let Some(admin) = admin {
            say!("braid-proxy admin listening on http://{admin}");
        }
        if demo {
            say!("demo origin (plain REST) started; open {scheme}://{addr}/ in a browser, or try:");
            say!("  curl -N -H 'Subscribe: true' {scheme}://{addr}/clock");
            say!("  curl -X PUT --data 'new text' {scheme}://{addr}/notes.txt");
        } else if let Some(upstream) = &config.upstream {
            say!("proxying {upstream}");
        }
        if let Some(files) = files {
            say!("open files: {files}");
        }
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
