//! Configuration: command-line flags and an optional TOML file merged into
//! one validated [`Config`]. Every key of the file has the name of its flag
//! (without the leading `--`); flags override the file. Errors name the key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use http::Uri;

/// A configuration error; the message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("config file {path}: unknown key `{key}`")]
    UnknownKey { path: PathBuf, key: String },
    #[error("invalid value for `{key}`: {reason}")]
    Value { key: &'static str, reason: String },
}

/// The command line. Every value is optional here so that the config file
/// can supply it; defaults live in [`Config::default`].
#[derive(Debug, Default, Parser)]
#[command(
    name = "braid-proxy",
    version,
    about = "A reverse proxy that serves a plain REST origin's resources as Braid-HTTP subscriptions.",
    long_about = "A reverse proxy that serves a plain REST origin's resources as Braid-HTTP \
subscriptions. Without --upstream it starts an embedded demo origin.\n\n\
Durations accept `250ms`, `1s`, `2m`, `1h` or a bare number of seconds; sizes accept \
`512`, `64KiB`, `16MiB`, `1GiB`. RUST_LOG sets the log filter (default: info, one access-log \
line per request)."
)]
pub struct Args {
    /// Address to listen on for clients [default: 127.0.0.1:8080]
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// The origin, e.g. http://127.0.0.1:9000 or http://127.0.0.1:9000/api. Without it, an embedded demo origin is started
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,
    /// Address of the operations listener (/metrics, /healthz, /readyz, POST /refresh?path=) [default: off]
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Bearer token the admin listener requires (Authorization: Bearer TOKEN); needed when it listens beyond loopback [default: none]
    #[arg(long, value_name = "TOKEN", env = "BRAID_PROXY_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    /// Log format: `text`, or `json` for one JSON object per line [default: text]
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<String>,
    /// TOML file with the same keys as these flags; flags override it
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Timeout for connecting to the upstream [default: 5s]
    #[arg(long, value_name = "DURATION")]
    pub connect_timeout: Option<String>,
    /// Timeout for the upstream's response headers [default: 30s]
    #[arg(long, value_name = "DURATION")]
    pub response_timeout: Option<String>,
    /// Time a client has to send its request headers [default: 10s]
    #[arg(long, value_name = "DURATION")]
    pub header_read_timeout: Option<String>,
    /// Largest request header block accepted; larger gets 431 [default: 16KiB]
    #[arg(long, value_name = "SIZE")]
    pub max_header_bytes: Option<String>,
    /// Most request headers accepted; more gets 431 [default: 100]
    #[arg(long, value_name = "N")]
    pub max_headers: Option<String>,
    /// How long in-flight requests may take to finish on shutdown [default: 10s]
    #[arg(long, value_name = "DURATION")]
    pub shutdown_grace: Option<String>,
    /// Interval between conditional polls of a subscribed resource [default: 1s]
    #[arg(long, value_name = "DURATION")]
    pub poll_interval: Option<String>,
    /// Updates kept per resource for resuming subscribers [default: 256]
    #[arg(long, value_name = "N")]
    pub history_len: Option<String>,
    /// Bytes of history kept by all resources together [default: 64MiB]
    #[arg(long, value_name = "SIZE")]
    pub history_bytes: Option<String>,
    /// Bytes of all tracked states (bodies and keys) together; idle ones are evicted least recently used first [default: 256MiB]
    #[arg(long, value_name = "SIZE")]
    pub state_bytes: Option<String>,
    /// Unsent bytes the kernel may hold per client connection (TCP_NOTSENT_LOWAT); a stalled subscriber then resumes with one collapsed update. 0 = the system's setting [default: 16KiB]
    #[arg(long, value_name = "SIZE")]
    pub notsent_lowat: Option<String>,
    /// Most resources tracked for one credential or not shareable; more get 503 [default: 10000]
    #[arg(long, value_name = "N")]
    pub max_private_resources: Option<String>,
    /// Default heartbeat interval on subscriptions, 0 = off [default: 25s]
    #[arg(long, value_name = "DURATION")]
    pub heartbeat: Option<String>,
    /// Most subscriptions at once; more get 503 [default: 100000]
    #[arg(long, value_name = "N")]
    pub max_subscriptions: Option<String>,
    /// Most subscriptions to one resource; more get 503 [default: 100000]
    #[arg(long, value_name = "N")]
    pub max_subscriptions_per_resource: Option<String>,
    /// Origin allowed by CORS; repeatable; `*` allows any
    #[arg(long, value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// How long a resource nobody subscribes to is kept [default: 30s]
    #[arg(long, value_name = "DURATION")]
    pub resource_idle: Option<String>,
    /// Largest origin body the proxy tracks versions of [default: 16MiB]
    #[arg(long, value_name = "SIZE")]
    pub max_body_bytes: Option<String>,
    /// Time budget of one diff; over it a snapshot is stored [default: 50ms]
    #[arg(long, value_name = "DURATION")]
    pub diff_timeout: Option<String>,
    /// Store a snapshot when patches exceed this fraction of the new body [default: 0.9]
    #[arg(long, value_name = "FRACTION")]
    pub snapshot_ratio: Option<String>,
    /// Most concurrent streams on one HTTP/2 connection; an edge following this proxy over h2c holds one per resource [default: 10000]
    #[arg(long, value_name = "N")]
    pub max_streams_per_connection: Option<String>,
    /// Unused since subscriptions to a Braid upstream are relayed with the client's own Heartbeats; accepted for existing configurations [default: 20s]
    #[arg(long, value_name = "DURATION")]
    pub upstream_heartbeat: Option<String>,
    /// Speak HTTP/2 without TLS (h2c, prior knowledge) to the upstream, so that all subscriptions to it share one connection; for tiers of braid-proxies [default: false]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub upstream_h2c: Option<String>,
    /// What the upstream is: `braid` (subscriptions are relayed as the upstream sends them), `rest` (polled and diffed by the proxy), or `auto` (learned from the first 209 or Braid response header) [default: auto]
    #[arg(long, value_name = "KIND")]
    pub upstream_kind: Option<String>,
    /// How long downstream streams of a Braid upstream stay open while the proxy resumes an ended or broken upstream subscription itself; 0 ends them with it and clients resume with Parents [default: 0]
    #[arg(long, value_name = "DURATION")]
    pub hold_upstream_breaks: Option<String>,
    /// braid-http's multiplexing: `terminate` (the proxy serves multiplexers itself, from its shared state: fan-out kept) or `relay` (multiplexer requests go to the upstream as they are, for a Braid upstream whose own multiplexer clients rely on; multiplexed subscriptions then each cost an upstream request) [default: terminate]
    #[arg(long, value_name = "MODE")]
    pub multiplex: Option<String>,
    /// Most multiplexers open at once on this proxy; more get 503 [default: 1024]
    #[arg(long, value_name = "N")]
    pub max_multiplexers: Option<String>,
    /// Most requests open at once inside one multiplexer; more get 503 [default: 256]
    #[arg(long, value_name = "N")]
    pub max_multiplexed_requests: Option<String>,
    /// A multiplexer without any request for this long ends [default: 60s]
    #[arg(long, value_name = "DURATION")]
    pub multiplexer_idle: Option<String>,
    /// This proxy's id in Via headers, used to detect loops [default: <hostname>:<listen port>]
    #[arg(long, value_name = "ID")]
    pub proxy_id: Option<String>,
    /// Runtime worker threads: 0 = one per core; 1 = a single-threaded runtime, less CPU per delivery over h2c but later first deliveries [default: 0]
    #[arg(long, value_name = "N")]
    pub workers: Option<String>,
}

/// The configured upstream: scheme, authority and an optional path prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `host:port` as written in the URL.
    pub authority: http::uri::Authority,
    /// Path prefix without a trailing slash; empty for none.
    pub prefix: String,
}

impl Upstream {
    /// Parses `http://host:port[/prefix]`.
    pub fn parse(s: &str) -> Result<Upstream, String> {
        let uri: Uri = s.parse().map_err(|e| format!("not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => return Err(format!("scheme `{other}` is not supported, use http")),
            None => return Err("the URL needs a scheme, e.g. http://127.0.0.1:9000".into()),
        }
        let authority = uri.authority().cloned().ok_or("the URL needs a host")?;
        if uri.query().is_some() {
            return Err("the URL must not have a query".into());
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(Upstream { authority, prefix })
    }

    /// The upstream URI for a request's path and query.
    pub fn uri_for(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.authority, self.prefix)
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// `None` means: start the embedded demo origin.
    pub upstream: Option<Upstream>,
    pub admin_listen: Option<SocketAddr>,
    pub admin_token: Option<String>,
    pub log_format: LogFormat,
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub shutdown_grace: Duration,
    pub poll_interval: Duration,
    pub history_len: usize,
    pub history_bytes: u64,
    pub state_bytes: usize,
    pub notsent_lowat: usize,
    pub max_private_resources: usize,
    /// Zero turns default heartbeats off.
    pub heartbeat: Duration,
    pub max_subscriptions: usize,
    pub max_subscriptions_per_resource: usize,
    pub cors_origins: Vec<String>,
    pub resource_idle: Duration,
    pub max_body_bytes: usize,
    pub diff_timeout: Duration,
    pub snapshot_ratio: f64,
    /// Empty until the listener is bound: then `<hostname>:<port>` unless set.
    pub proxy_id: String,
    pub upstream_heartbeat: Duration,
    pub upstream_h2c: bool,
    pub max_streams_per_connection: u32,
    pub upstream_kind: UpstreamKind,
    pub hold_upstream_breaks: Duration,
    pub multiplex: MultiplexMode,
    pub max_multiplexers: usize,
    pub max_multiplexed_requests: usize,
    pub multiplexer_idle: Duration,
    /// Runtime worker threads; 0 is one per core, 1 the single-threaded runtime.
    pub workers: usize,
}

/// Who serves braid-http's multiplexing (`--multiplex`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MultiplexMode {
    /// The proxy: multiplexed subscriptions share its state and fan-out.
    #[default]
    Terminate,
    /// The upstream: multiplexer requests pass through as they are.
    Relay,
}

/// What the upstream is (`--upstream-kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamKind {
    /// Learned from the first 209 or Braid response header.
    #[default]
    Auto,
    /// A Braid server: subscriptions are relayed, nothing is emulated.
    Braid,
    /// A plain origin: polled, diffed, served as Braid by the proxy.
    Rest,
}

impl Default for Config {
    fn default() -> Self {
        // The multiplexers' bounds have one home: multiplex::Limits.
        let mux = crate::multiplex::Limits::default();
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstream: None,
            admin_listen: None,
            admin_token: None,
            log_format: LogFormat::Text,
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(30),
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            shutdown_grace: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            history_len: 256,
            history_bytes: 64 * 1024 * 1024,
            state_bytes: 256 * 1024 * 1024,
            notsent_lowat: 16 * 1024,
            max_private_resources: 10_000,
            heartbeat: Duration::from_secs(25),
            max_subscriptions: 100_000,
            max_subscriptions_per_resource: 100_000,
            cors_origins: Vec::new(),
            resource_idle: Duration::from_secs(30),
            max_body_bytes: 16 * 1024 * 1024,
            diff_timeout: Duration::from_millis(50),
            snapshot_ratio: 0.9,
            proxy_id: String::new(),
            upstream_heartbeat: Duration::from_secs(20),
            upstream_h2c: false,
            max_streams_per_connection: 10_000,
            upstream_kind: UpstreamKind::Auto,
            hold_upstream_breaks: Duration::ZERO,
            multiplex: MultiplexMode::Terminate,
            max_multiplexers: mux.max_multiplexers,
            max_multiplexed_requests: mux.max_requests,
            multiplexer_idle: mux.idle,
            workers: 0,
        }
    }
}

/// The default id of the instance listening on `port`: `<hostname>:<port>`,
/// the hostname reduced to Via-token characters. Unique per instance on a
/// host, and stable across restarts of that instance.
pub fn default_proxy_id(port: u16) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        .take(64)
        .collect();
    let host = if host.is_empty() {
        "braid-proxy"
    } else {
        &host
    };
    format!("{host}:{port}")
}

impl Config {
    /// Builds the configuration from parsed flags, reading `--config` if given.
    pub fn from_args(args: Args) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        if let Some(path) = &args.config {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            config.apply_toml(path, &text)?;
        }
        config.apply_args(args)?;
        config.check()?;
        Ok(config)
    }

    /// Checks that the keys agree with each other.
    fn check(&self) -> Result<(), ConfigError> {
        if let Some(addr) = self.admin_listen {
            if !addr.ip().is_loopback() && self.admin_token.is_none() {
                return Err(bad(
                    "admin-listen",
                    format!("{addr} is not loopback: set admin-token so that only operators reach /metrics and /refresh"),
                ));
            }
        }
        Ok(())
    }

    /// Applies a TOML document; each key is validated by the same parser as its flag.
    pub fn apply_toml(&mut self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::File {
                path: path.to_path_buf(),
                reason: e.message().to_string(),
            })?;
        for (key, value) in table {
            let Some(key) = KEYS.iter().copied().find(|k| *k == key) else {
                return Err(ConfigError::UnknownKey {
                    path: path.to_path_buf(),
                    key,
                });
            };
            if key == "cors-origin" {
                let list = match value {
                    toml::Value::String(s) => vec![s],
                    toml::Value::Array(items) => items
                        .into_iter()
                        .map(|v| match v {
                            toml::Value::String(s) => Ok(s),
                            other => Err(bad(key, format!("expected a string, got {other}"))),
                        })
                        .collect::<Result<_, _>>()?,
                    other => {
                        return Err(bad(key, format!("expected a list of strings, got {other}")))
                    }
                };
                self.cors_origins = validate_cors(list)?;
                continue;
            }
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    return Err(bad(
                        key,
                        format!("expected a string or a number, got {other}"),
                    ))
                }
            };
            self.set(key, &text)?;
        }
        Ok(())
    }

    fn apply_args(&mut self, args: Args) -> Result<(), ConfigError> {
        let pairs: [(&'static str, Option<String>); 36] = [
            ("listen", args.listen),
            ("upstream", args.upstream),
            ("admin-listen", args.admin_listen),
            ("admin-token", args.admin_token),
            ("log-format", args.log_format),
            ("connect-timeout", args.connect_timeout),
            ("response-timeout", args.response_timeout),
            ("header-read-timeout", args.header_read_timeout),
            ("max-header-bytes", args.max_header_bytes),
            ("max-headers", args.max_headers),
            ("shutdown-grace", args.shutdown_grace),
            ("poll-interval", args.poll_interval),
            ("history-len", args.history_len),
            ("history-bytes", args.history_bytes),
            ("state-bytes", args.state_bytes),
            ("notsent-lowat", args.notsent_lowat),
            ("max-private-resources", args.max_private_resources),
            ("heartbeat", args.heartbeat),
            ("max-subscriptions", args.max_subscriptions),
            (
                "max-subscriptions-per-resource",
                args.max_subscriptions_per_resource,
            ),
            ("resource-idle", args.resource_idle),
            ("max-body-bytes", args.max_body_bytes),
            ("diff-timeout", args.diff_timeout),
            ("snapshot-ratio", args.snapshot_ratio),
            ("proxy-id", args.proxy_id),
            ("upstream-heartbeat", args.upstream_heartbeat),
            ("upstream-h2c", args.upstream_h2c),
            (
                "max-streams-per-connection",
                args.max_streams_per_connection,
            ),
            ("upstream-kind", args.upstream_kind),
            ("hold-upstream-breaks", args.hold_upstream_breaks),
            ("multiplex", args.multiplex),
            ("max-multiplexers", args.max_multiplexers),
            ("max-multiplexed-requests", args.max_multiplexed_requests),
            ("multiplexer-idle", args.multiplexer_idle),
            ("workers", args.workers),
            ("config", None),
        ];
        for (key, value) in pairs {
            if let Some(value) = value {
                self.set(key, &value)?;
            }
        }
        if !args.cors_origin.is_empty() {
            self.cors_origins = validate_cors(args.cors_origin)?;
        }
        Ok(())
    }

    /// Sets one key from its textual value.
    pub fn set(&mut self, key: &'static str, v: &str) -> Result<(), ConfigError> {
        let e = |reason: String| bad(key, reason);
        match key {
            "listen" => self.listen = parse_addr(v).map_err(e)?,
            "upstream" => self.upstream = Some(Upstream::parse(v).map_err(e)?),
            "admin-listen" => self.admin_listen = Some(parse_addr(v).map_err(e)?),
            "admin-token" => {
                let token = v.trim();
                if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(e(
                        "the admin token must be at least 16 visible ASCII characters".into(),
                    ));
                }
                self.admin_token = Some(token.to_string());
            }
            "log-format" => {
                self.log_format = match v.trim() {
                    "text" => LogFormat::Text,
                    "json" => LogFormat::Json,
                    other => return Err(e(format!("`{other}` is not text or json"))),
                }
            }
            "connect-timeout" => {
                self.connect_timeout = positive(parse_duration(v).map_err(e)?, key)?
            }
            "response-timeout" => {
                self.response_timeout = positive(parse_duration(v).map_err(e)?, key)?
            }
            "header-read-timeout" => {
                self.header_read_timeout = positive(parse_duration(v).map_err(e)?, key)?
            }
            "max-header-bytes" => {
                self.max_header_bytes = in_range(parse_size(v).map_err(e)?, 1024, 1 << 20, key)?
            }
            "max-headers" => {
                self.max_headers = in_range(parse_count(v).map_err(e)?, 1, 10_000, key)?
            }
            "shutdown-grace" => self.shutdown_grace = parse_duration(v).map_err(e)?,
            "poll-interval" => self.poll_interval = positive(parse_duration(v).map_err(e)?, key)?,
            "history-len" => {
                self.history_len = in_range(parse_count(v).map_err(e)?, 1, 1 << 20, key)?
            }
            "history-bytes" => self.history_bytes = parse_size(v).map_err(e)? as u64,
            "state-bytes" => {
                self.state_bytes = in_range(parse_size(v).map_err(e)?, 1 << 20, usize::MAX, key)?
            }
            "max-private-resources" => self.max_private_resources = parse_count(v).map_err(e)?,
            "notsent-lowat" => {
                self.notsent_lowat = in_range(parse_size(v).map_err(e)?, 0, 1 << 30, key)?
            }
            "heartbeat" => self.heartbeat = parse_duration(v).map_err(e)?,
            "max-subscriptions" => self.max_subscriptions = parse_count(v).map_err(e)?,
            "max-multiplexers" => {
                self.max_multiplexers = in_range(parse_count(v).map_err(e)?, 1, 1 << 20, key)?
            }
            "max-multiplexed-requests" => {
                self.max_multiplexed_requests =
                    in_range(parse_count(v).map_err(e)?, 1, 1 << 16, key)?
            }
            "multiplexer-idle" => {
                let idle = parse_duration(v).map_err(e)?;
                if idle < Duration::from_secs(1) {
                    return Err(bad(key, format!("{v} is shorter than 1s")));
                }
                self.multiplexer_idle = idle;
            }
            "max-subscriptions-per-resource" => {
                self.max_subscriptions_per_resource = parse_count(v).map_err(e)?
            }
            "resource-idle" => self.resource_idle = parse_duration(v).map_err(e)?,
            "max-body-bytes" => {
                self.max_body_bytes = in_range(parse_size(v).map_err(e)?, 1, 1 << 32, key)?
            }
            "diff-timeout" => self.diff_timeout = positive(parse_duration(v).map_err(e)?, key)?,
            "snapshot-ratio" => {
                let r: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| e(format!("`{v}` is not a number")))?;
                if !(r > 0.0 && r <= 1.0) {
                    return Err(e(format!("{r} is not in (0, 1]")));
                }
                self.snapshot_ratio = r;
            }
            "proxy-id" => {
                let ok = !v.is_empty()
                    && v.len() <= 128
                    && v.chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
                if !ok {
                    return Err(e("use 1 to 128 of A-Z a-z 0-9 - . _".into()));
                }
                self.proxy_id = v.to_string();
            }
            "upstream-heartbeat" => {
                let d = positive(parse_duration(v).map_err(e)?, key)?;
                if d > Duration::from_secs(3600) {
                    return Err(e("at most 1h".into()));
                }
                self.upstream_heartbeat = d;
            }
            "max-streams-per-connection" => {
                self.max_streams_per_connection =
                    in_range(parse_count(v).map_err(e)?, 1, 1_000_000, key)? as u32
            }
            "upstream-h2c" => {
                self.upstream_h2c = match v.trim() {
                    "true" | "yes" | "on" | "1" => true,
                    "false" | "no" | "off" | "0" => false,
                    other => return Err(e(format!("`{other}` is not true or false"))),
                }
            }
            "upstream-kind" => {
                self.upstream_kind = match v.trim() {
                    "auto" => UpstreamKind::Auto,
                    "braid" => UpstreamKind::Braid,
                    "rest" => UpstreamKind::Rest,
                    other => return Err(e(format!("`{other}` is not auto, braid or rest"))),
                }
            }
            "hold-upstream-breaks" => {
                let d = parse_duration(v).map_err(e)?;
                if d > Duration::from_secs(3600) {
                    return Err(e("at most 1h".into()));
                }
                self.hold_upstream_breaks = d;
            }
            "multiplex" => {
                self.multiplex = match v.trim() {
                    "terminate" => MultiplexMode::Terminate,
                    "relay" => MultiplexMode::Relay,
                    other => return Err(e(format!("`{other}` is not terminate or relay"))),
                }
            }
            "workers" => self.workers = in_range(parse_count(v).map_err(e)?, 0, 1024, key)?,
            "config" => return Err(e("`config` cannot be set from a config file".into())),
            _ => return Err(e("unknown key".into())),
        }
        Ok(())
    }
}

/// Every key of the configuration file (the flag names without `--`).
pub const KEYS: &[&str] = &[
    "listen",
    "upstream",
    "admin-listen",
    "admin-token",
    "log-format",
    "connect-timeout",
    "response-timeout",
    "header-read-timeout",
    "max-header-bytes",
    "max-headers",
    "shutdown-grace",
    "poll-interval",
    "history-len",
    "history-bytes",
    "state-bytes",
    "notsent-lowat",
    "max-private-resources",
    "heartbeat",
    "max-subscriptions",
    "max-subscriptions-per-resource",
    "cors-origin",
    "resource-idle",
    "max-body-bytes",
    "diff-timeout",
    "snapshot-ratio",
    "proxy-id",
    "upstream-heartbeat",
    "upstream-h2c",
    "max-streams-per-connection",
    "upstream-kind",
    "hold-upstream-breaks",
    "multiplex",
    "max-multiplexers",
    "max-multiplexed-requests",
    "multiplexer-idle",
    "workers",
];

fn bad(key: &'static str, reason: String) -> ConfigError {
    ConfigError::Value { key, reason }
}

fn positive(d: Duration, key: &'static str) -> Result<Duration, ConfigError> {
    if d.is_zero() {
        Err(bad(key, "must be more than zero".into()))
    } else {
        Ok(d)
    }
}

fn in_range(n: usize, lo: usize, hi: usize, key: &'static str) -> Result<usize, ConfigError> {
    if n < lo || n > hi {
        Err(bad(key, format!("{n} is not between {lo} and {hi}")))
    } else {
        Ok(n)
    }
}

fn validate_cors(list: Vec<String>) -> Result<Vec<String>, ConfigError> {
    for origin in &list {
        let ok = origin == "*"
            || ((origin.starts_with("http://") || origin.starts_with("https://"))
                && origin.parse::<Uri>().is_ok()
                && !origin
                    .trim_start_matches("https://")
                    .trim_start_matches("http://")
                    .contains('/'));
        if !ok {
            return Err(bad(
                "cors-origin",
                format!("`{origin}` is not `*` or an origin like https://example.com"),
            ));
        }
    }
    Ok(list)
}

/// Parses `host:port`; `localhost` is taken as 127.0.0.1.
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    let t = s.trim();
    let t = match t.strip_prefix("localhost:") {
        Some(port) => format!("127.0.0.1:{port}"),
        None => t.to_string(),
    };
    t.parse()
        .map_err(|_| format!("`{s}` is not an address like 127.0.0.1:8080"))
}

/// Parses `250ms`, `1.5s`, `2m`, `1h` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (try 250ms, 1s, 2m)"))?;
    let secs = n * scale;
    if !secs.is_finite() || !(0.0..=30.0 * 86400.0).contains(&secs) {
        return Err(format!("`{s}` is out of range (0 to 30 days)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses `512`, `64KiB`, `16MiB`, `1GiB` (also KB/MB/GB, taken as powers of 1000).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let units: [(&str, u64); 7] = [
        ("KiB", 1 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("KB", 1000),
        ("MB", 1_000_000),
        ("GB", 1_000_000_000),
        ("B", 1),
    ];
    let (num, scale) = units
        .iter()
        .find_map(|(u, m)| t.strip_suffix(u).map(|n| (n, *m)))
        .unwrap_or((t, 1));
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size (try 512, 64KiB, 16MiB)"))?;
    n.checked_mul(scale)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| format!("`{s}` is too large"))
}

fn parse_count(s: &str) -> Result<usize, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("soon").is_err());
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("100"), Ok(100));
        assert_eq!(parse_size("1KB"), Ok(1000));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn upstream_urls() {
        let u = Upstream::parse("http://127.0.0.1:9000/api/").unwrap();
        assert_eq!(u.prefix, "/api");
        assert_eq!(
            u.uri_for("/x?y=1").unwrap().to_string(),
            "http://127.0.0.1:9000/api/x?y=1"
        );
        assert!(Upstream::parse("https://example.com").is_err());
        assert!(Upstream::parse("127.0.0.1:9000").is_err());
    }

    #[test]
    fn upstream_kind_and_hold_from_flags_and_toml() {
        let mut c = Config::default();
        assert_eq!(c.upstream_kind, UpstreamKind::Auto);
        c.apply_toml(
            Path::new("t.toml"),
            "upstream-kind = \"braid\"\nhold-upstream-breaks = \"2s\"\n",
        )
        .unwrap();
        assert_eq!(c.upstream_kind, UpstreamKind::Braid);
        assert_eq!(c.hold_upstream_breaks, Duration::from_secs(2));
        c.set("upstream-kind", "rest").unwrap();
        assert_eq!(c.upstream_kind, UpstreamKind::Rest);
        assert!(c.set("upstream-kind", "maybe").is_err());
        assert!(c.set("hold-upstream-breaks", "2h").is_err());
        assert_eq!(c.multiplex, MultiplexMode::Terminate);
        c.set("multiplex", "relay").unwrap();
        assert_eq!(c.multiplex, MultiplexMode::Relay);
        assert!(c.set("multiplex", "both").is_err());
    }

    #[test]
    fn multiplexer_bounds_from_flags_and_toml() {
        use clap::Parser;
        let d = Config::default();
        assert_eq!(
            (d.max_multiplexers, d.max_multiplexed_requests),
            (1024, 256)
        );
        assert_eq!(d.multiplexer_idle, Duration::from_secs(60));
        let args = Args::try_parse_from([
            "braid-proxy",
            "--max-multiplexers",
            "3",
            "--max-multiplexed-requests",
            "7",
            "--multiplexer-idle",
            "5s",
        ])
        .unwrap();
        let c = Config::from_args(args).unwrap();
        assert_eq!((c.max_multiplexers, c.max_multiplexed_requests), (3, 7));
        assert_eq!(c.multiplexer_idle, Duration::from_secs(5));
        let mut t = Config::default();
        t.apply_toml(Path::new("t.toml"), "max-multiplexers = 9\n")
            .unwrap();
        assert_eq!(t.max_multiplexers, 9);
        assert_eq!(t.workers, 0);
        t.apply_toml(Path::new("t.toml"), "workers = 1\n").unwrap();
        assert_eq!(t.workers, 1);
        for (key, value) in [
            ("max-multiplexers", "0"),
            ("max-multiplexed-requests", "0"),
            ("max-multiplexed-requests", "many"),
            ("multiplexer-idle", "10ms"),
            ("workers", "-1"),
            ("workers", "5000"),
        ] {
            assert!(t.set(key, value).is_err(), "{key} = {value}");
        }
    }
}
