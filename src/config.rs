//! Configuration: command-line flags and an optional TOML file merged into
//! one validated [`Config`]. Every key is declared once, in
//! `declare_keys!` below: its field, its flag (which is also its TOML key),
//! its default, its parser, its help text and its line in the sample
//! configuration ([`sample_toml`], `examples/deploy/braid-proxy.toml`).
//! Flags override the file. Errors name the key.

use std::net::{IpAddr, SocketAddr};
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
    #[error("there is no configuration key `{0}`")]
    NoSuchKey(String),
}

/// What the sample configuration and the documentation say of one key.
#[derive(Debug, Clone, Copy)]
pub struct KeyDoc {
    /// The part of the sample configuration it is shown in.
    pub section: &'static str,
    /// The flag without `--`, and the TOML key.
    pub key: &'static str,
    pub help: &'static str,
    /// The default as shown in `--help` and the sample.
    pub default: &'static str,
    /// The value the sample shows, when it is not the default.
    pub sample: Option<&'static str>,
    /// The sample shows the key commented out.
    pub commented: bool,
}

/// Declares every configuration key once, in sections (`["Name"]`). Each
/// entry is
///
/// `field: Type, "flag-and-key", "VALUE", default ("text") | default (none "shown"),
///  [sample ("value") | sample (# "commented value"),] [list = true,]
///  [#[arg(extra clap attributes)]] parse parser, "help text";`
///
/// `list = true` marks a key whose flag may be repeated and whose file value may
/// be a list: its values reach the parser joined with commas.
///
/// and makes the [`Config`] field, its default (the text given to its
/// parser), the [`Args`] flag with its help and default, the entry of
/// [`KEYS`] and [`KEY_DOCS`], and its arm of [`Config::set`].
macro_rules! declare_keys {
    (
        $(
            [$section:literal]
            $(
                $field:ident: $ty:ty, $key:literal, $value:literal,
                default $default:tt,
                $(sample $sample:tt,)?
                $(list = $list:literal,)?
                $(#[arg($($clap:tt)*)])?
                parse $parse:expr,
                $help:literal;
            )*
        )*
    ) => {
        /// The validated configuration.
        #[derive(Debug, Clone)]
        pub struct Config {
            $($(
                #[doc = $help]
                pub $field: $ty,
            )*)*
        }

        impl Default for Config {
            fn default() -> Self {
                Config {
                    $($( $field: declare_keys!(@default $key, $default, $parse), )*)*
                }
            }
        }

        /// The command line. Every value is optional here so that the
        /// config file can supply it; defaults live in [`Config::default`].
        /// Each flag is a list so that a repeated one is refused naming its
        /// key, or, for a list key, joined.
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
            $($(
                #[arg(
                    long = $key,
                    value_name = $value,
                    help = concat!($help, " [default: ", declare_keys!(@shown $default), "]")
                    $(, $($clap)*)?
                )]
                pub $field: Vec<String>,
            )*)*
            /// TOML file with the same keys as these flags; flags override it
            #[arg(long, value_name = "FILE")]
            pub config: Option<PathBuf>,
        }

        /// Every key of the configuration file (the flag names without `--`).
        pub const KEYS: &[&str] = &[$($($key,)*)*];

        /// Whether `key` takes a list (its flag may be repeated, its file
        /// value may be a TOML array).
        fn is_list(key: &str) -> bool {
            match key {
                $($( $key => declare_keys!(@list $($list)?), )*)*
                _ => false,
            }
        }

        /// What the sample configuration says of every key, in its order.
        pub const KEY_DOCS: &[KeyDoc] = &[$($(
            KeyDoc {
                section: $section,
                key: $key,
                help: $help,
                default: declare_keys!(@shown $default),
                sample: declare_keys!(@sample $($sample)?),
                commented: declare_keys!(@commented $($sample)?),
            },
        )*)*];

        impl Config {
            /// Sets one key from its textual value (as a flag gives it).
            pub fn set(&mut self, key: &str, v: &str) -> Result<(), ConfigError> {
                match key {
                    $($( $key => self.$field = ($parse)(v).map_err(|reason| bad($key, reason))?, )*)*
                    _ => return Err(ConfigError::NoSuchKey(key.to_string())),
                }
                Ok(())
            }

            /// Sets every key given as a flag.
            fn apply_args(&mut self, args: Args) -> Result<(), ConfigError> {
                $($(
                    let list = declare_keys!(@list $($list)?);
                    if args.$field.len() > 1 && !list {
                        return Err(bad($key, "given more than once".into()));
                    }
                    if !args.$field.is_empty() {
                        self.set($key, &args.$field.join(","))?;
                    }
                )*)*
                Ok(())
            }
        }
    };
    (@default $key:literal, ($text:literal), $parse:expr) => {
        match ($parse)($text) {
            Ok(value) => value,
            // A unit test parses every default.
            Err(e) => panic!("the default of `{}` does not parse: {e}", $key),
        }
    };
    (@default $key:literal, (none $shown:literal), $parse:expr) => {
        Default::default()
    };
    (@shown ($text:literal)) => { $text };
    (@shown (none $shown:literal)) => { $shown };
    (@list) => { false };
    (@list $list:literal) => { $list };
    (@sample) => { None };
    (@sample ($sample:literal)) => { Some($sample) };
    (@sample (# $sample:literal)) => { Some($sample) };
    (@commented) => { false };
    (@commented ($sample:literal)) => { false };
    (@commented (# $sample:literal)) => { true };
}

declare_keys! {
    ["Listeners"]
    listen: SocketAddr, "listen", "ADDR", default ("127.0.0.1:8080"), sample ("0.0.0.0:8080"),
        parse parse_addr,
        "Client listener: HTTP/1.1 and h2c (prior knowledge).";
    upstream: Option<Upstream>, "upstream", "URL", default (none "the demo origin"),
        sample ("http://127.0.0.1:9000"),
        parse |v: &str| Upstream::parse(v).map(Some),
        "The origin, e.g. http://127.0.0.1:9000 or http://127.0.0.1:9000/api: the only host the proxy ever reaches (not an open proxy). Without it, an embedded demo origin is started.";
    admin_listen: Option<SocketAddr>, "admin-listen", "ADDR", default (none "off"),
        sample ("127.0.0.1:9090"),
        parse |v: &str| parse_addr(v).map(Some),
        "Operations listener: the operator's page (/), /status, /metrics, /healthz, /readyz, POST /refresh?path=, POST /purge?path= or ?tag=. Off loopback it needs admin-token.";
    admin_token: Option<String>, "admin-token", "TOKEN", default (none "none"),
        sample (# "change-me-to-a-long-random-string"),
        #[arg(env = "BRAID_PROXY_ADMIN_TOKEN")]
        parse admin_token,
        "Bearer token the admin listener requires (Authorization: Bearer TOKEN) but on /healthz and /readyz; at least 16 visible characters. Prefer the BRAID_PROXY_ADMIN_TOKEN environment variable to keep it out of files.";
    log_format: LogFormat, "log-format", "FORMAT", default ("text"),
        parse log_format,
        "Log lines: `text`, or `json` for one JSON object per line on stderr and stdout (the listening banner included). RUST_LOG sets the filter (default info: one access line per request, one line per subscription opened and closed).";
    proxy_id: String, "proxy-id", "ID", default (none "<hostname>:<listen port>"),
        sample (# "edge-1"),
        parse proxy_id,
        "This proxy's name in Via; a request already naming it gets 508 (loops).";

    ["Upstream"]
    connect_timeout: Duration, "connect-timeout", "DURATION", default ("5s"),
        parse positive_duration,
        "Time to connect to the upstream (then 502).";
    response_timeout: Duration, "response-timeout", "DURATION", default ("30s"),
        parse positive_duration,
        "Time to the upstream's response headers (then 504).";
    poll_interval: Duration, "poll-interval", "DURATION", default ("1s"),
        parse positive_duration,
        "Shortest poll interval of a subscribed resource of a plain origin: the one after a change, a write, a refresh or a new subscriber. Polls are conditional on a strong validator (an ETag, or a Last-Modified at least a second older than the answer's Date); otherwise they fetch the body and compare its hash.";
    poll_max_interval: Option<Duration>, "poll-max-interval", "DURATION", default (none "10 x poll-interval"),
        sample (# "10s"),
        parse |v: &str| positive_duration(v).map(Some),
        "Longest poll interval of a quiet subscribed resource: each poll that finds no change doubles it, from --poll-interval up to this, so a change is seen within it. Equal to --poll-interval: every subscribed resource is polled at that interval.";
    origin_rps: Option<f64>, "origin-rps", "N", default (none "unlimited"),
        sample (# "200"),
        parse parse_rps,
        "Most requests a second the watchers together send the origin (polls, refreshes, the revalidation before a new subscription), spread evenly; the slots go first to resources that change and to requests someone waits on. Clients' own requests that go to the origin (the first request for a resource, GET misses, writes) are not held to it. Whatever this says, an origin's 429 or 503 with Retry-After pauses every watcher that long (at most 10 minutes).";
    upstream_kind: UpstreamKind, "upstream-kind", "KIND", default ("auto"),
        parse upstream_kind,
        "What the upstream is: `braid` (subscriptions relayed byte for byte, every answer as the upstream gave it), `rest` (polled and diffed), or `auto` (learned from the first 209 or Braid response header).";
    hold_upstream_breaks: Duration, "hold-upstream-breaks", "DURATION", default ("0s"),
        parse |v: &str| at_most_an_hour(parse_duration(v)?),
        "How long a Braid upstream's downstream streams stay open while the proxy itself resumes an ended or broken upstream subscription. 0s: they end with it, and clients resume with Parents (their own retry logic runs).";
    multiplex: MultiplexMode, "multiplex", "MODE", default ("terminate"),
        parse multiplex_mode,
        "braid-http's multiplexing (browsers hold many subscriptions on one connection with it): `terminate` serves multiplexers from this proxy's shared state, so multiplexed subscriptions keep the fan-out; `relay` sends multiplexer requests to a Braid upstream as they are (its own multiplexer serves them; each multiplexed subscription then costs an upstream request).";
    max_multiplexers: usize, "max-multiplexers", "N", default ("1024"),
        parse |v: &str| in_range(parse_count(v)?, 1, 1 << 20),
        "Multiplexers open at once on this proxy (then 503).";
    max_multiplexed_requests: usize, "max-multiplexed-requests", "N", default ("256"),
        parse |v: &str| in_range(parse_count(v)?, 1, 1 << 16),
        "Requests open at once inside one multiplexer (then 503, which braid-http retries).";
    multiplexer_idle: Duration, "multiplexer-idle", "DURATION", default ("60s"),
        parse multiplexer_idle,
        "A multiplexer without any request for this long ends; at least 1s.";
    upstream_heartbeat: Duration, "upstream-heartbeat", "DURATION", default ("20s"),
        parse |v: &str| at_most_an_hour(positive_duration(v)?),
        "Unused since subscriptions are relayed (a Braid upstream gets each client's own Heartbeats); still accepted so that existing configurations load.";
    upstream_purges: UpstreamPurges, "upstream-purges", "MODE", default ("auto"),
        parse upstream_purges,
        "Whether this tier follows its upstream's purge feed (spec/tiers.md), so that purges and refreshes made above reach it: `auto` asks once an upstream answer carried Purge-Feed (a braid-proxy's answers to the tiers below do), and stops asking for good at an answer that is not a purge feed; `follow` asks from the start and keeps asking (an upstream known to be a braid-proxy); `off` never asks.";
    upstream_h2c: bool, "upstream-h2c", "BOOL", default ("false"),
        #[arg(num_args = 0..=1, default_missing_value = "true")]
        parse parse_bool,
        "HTTP/2 with prior knowledge (h2c) to the upstream (another braid-proxy) for subscriptions and polls, so that they share one connection; pass-through requests stay on HTTP/1.1.";
    max_body_bytes: usize, "max-body-bytes", "SIZE", default ("16MiB"),
        parse |v: &str| in_range(parse_size(v)?, 1, 1 << 32),
        "Largest origin body tracked; larger ones give an error update and plain GETs stream through unstored. Also the limit of a patch write.";

    ["Client requests"]
    header_read_timeout: Duration, "header-read-timeout", "DURATION", default ("10s"),
        parse positive_duration,
        "Time a client has to send its request headers.";
    max_header_bytes: usize, "max-header-bytes", "SIZE", default ("16KiB"),
        parse |v: &str| in_range(parse_size(v)?, 1024, 1 << 20),
        "Largest request header block accepted (then 431).";
    max_headers: usize, "max-headers", "N", default ("100"),
        parse |v: &str| in_range(parse_count(v)?, 1, 10_000),
        "Most request headers accepted (then 431).";
    notsent_lowat: usize, "notsent-lowat", "SIZE", default ("16KiB"),
        parse |v: &str| in_range(parse_size(v)?, 0, 1 << 30),
        "Unsent bytes the kernel may hold per client connection (TCP_NOTSENT_LOWAT): a stalled subscriber then resumes with one collapsed update, not a backlog kept in the kernel. 0 leaves the system's setting.";
    h2_idle_timeout: Duration, "h2-idle-timeout", "DURATION", default ("75s"),
        parse |v: &str| at_most_an_hour(positive_duration(v)?),
        "An HTTP/2 client connection (h2c, or h2 over TLS) with no stream open for this long is closed gracefully (GOAWAY), as nginx's keepalive_timeout does; one with a subscription open is never idle. HTTP/1.1 connections wait for their next request no longer than header-read-timeout.";
    max_streams_per_connection: u32, "max-streams-per-connection", "N", default ("10000"),
        parse |v: &str| -> Result<u32, String> { Ok(in_range(parse_count(v)?, 1, 1_000_000)? as u32) },
        "Concurrent HTTP/2 streams on one client connection; an edge following this proxy over h2c holds one per resource.";
    cors_origins: Vec<String>, "cors-origin", "ORIGIN", default (none "none"),
        sample ("https://app.example.com"),
        list = true,
        parse cors_origins,
        "Browser origin allowed by CORS; repeatable (a list in the file); `*` allows any.";
    trusted_downstream: TrustedPeers, "trusted-downstream", "CIDR[,CIDR...]", default ("127.0.0.0/8,::1"),
        list = true,
        parse TrustedPeers::parse,
        "Peers (address ranges) whose X-Forwarded-Host names the client's host: downstream tiers of this proxy. From them the first X-Forwarded-Host is used for keys and forwarded as it is; from anyone else it is replaced by the request's Host (SECURITY.md, \"The forwarded host\"). The other forwarding headers (Forwarded, every X-Forwarded-*, X-Real-IP, X-Host) pass from them only; anyone else's are removed or replaced by what the proxy knows (SECURITY.md, \"Forwarding headers\"). Repeatable (a list in the file); empty trusts nobody.";
    shutdown_grace: Duration, "shutdown-grace", "DURATION", default ("10s"),
        parse parse_duration,
        "How long in-flight requests may finish on SIGINT/SIGTERM.";

    ["Subscriptions"]
    heartbeat: Duration, "heartbeat", "DURATION", default ("25s"),
        parse parse_duration,
        "Heartbeat when the client asks for none; 0s turns them off.";
    max_subscriptions: usize, "max-subscriptions", "N", default ("100000"),
        parse parse_count,
        "Open subscriptions in all (then 503 + Retry-After).";
    max_subscriptions_per_resource: usize, "max-subscriptions-per-resource", "N", default ("100000"),
        parse parse_count,
        "Open subscriptions to one resource (then 503).";
    resource_idle: Duration, "resource-idle", "DURATION", default ("30s"),
        parse parse_duration,
        "How long a resource nobody subscribes to is kept. Nothing polls it meanwhile: plain GETs are answered from it as its own freshness allows, and a new subscription waits for the origin's answer to a fresh poll before its 209 names a version.";

    ["State and history"]
    history_len: usize, "history-len", "N", default ("256"),
        parse |v: &str| in_range(parse_count(v)?, 1, 1 << 20),
        "Updates kept per resource for resuming subscribers.";
    history_bytes: u64, "history-bytes", "SIZE", default ("64MiB"),
        parse |v: &str| -> Result<u64, String> { Ok(parse_size(v)? as u64) },
        "Bytes of history of all resources together (counted within state-bytes too).";
    state_bytes: usize, "state-bytes", "SIZE", default ("256MiB"),
        parse |v: &str| in_range(parse_size(v)?, 1 << 20, usize::MAX),
        "Every byte of state held (bodies, frames, keys, history, relayed windows, copies in flight); over it idle resources are evicted least recently used first, then new state is refused with 503.";
    max_private_resources: usize, "max-private-resources", "N", default ("10000"),
        parse parse_count,
        "Resources tracked for one credential, or not shareable (then 503).";
    diff_timeout: Duration, "diff-timeout", "DURATION", default ("50ms"),
        parse positive_duration,
        "Time budget of one diff; over it, a snapshot is sent.";
    snapshot_ratio: f64, "snapshot-ratio", "FRACTION", default ("0.9"),
        parse snapshot_ratio,
        "Send a snapshot when patches exceed this fraction of its size.";

    ["Cache"]
    stale_if_error: Duration, "stale-if-error", "DURATION", default ("0s"),
        parse |v: &str| at_most_a_day(parse_duration(v)?),
        "How long past its freshness a stored answer may still replace an origin's error (500, 502, 503, 504, no connection, timeout) when neither the answer nor the request names `stale-if-error` (RFC 5861); never past must-revalidate, proxy-revalidate, s-maxage or no-cache. 0s: only where they name it.";
    keep_surrogate_key: bool, "keep-surrogate-key", "BOOL", default ("false"),
        #[arg(num_args = 0..=1, default_missing_value = "true")]
        parse parse_bool,
        "Pass the origin's Surrogate-Key header on to clients; by default it is removed from answers (and kept in state for POST /purge?tag=).";

    ["Runtime"]
    workers: usize, "workers", "N", default ("0"), sample (# "0"),
        parse |v: &str| in_range(parse_count(v)?, 0, 1024),
        "Runtime worker threads: 0 is one per core; 1 is the single-threaded runtime, which costs less CPU per delivery over h2c on a core of its own but delivers the first subscribers later (BENCHMARKS.md, \"Runtime flavour\").";
    max_open_files: u64, "max-open-files", "N", default ("0"), sample (# "0"),
        parse |v: &str| -> Result<u64, String> { Ok(in_range(parse_count(v)?, 0, 1 << 30)? as u64) },
        "Open files (RLIMIT_NOFILE) to run with: 0 raises the soft limit to the hard one at start; N sets it to N, never above the hard limit. Each client connection is one; within the last sixteenth (at least 64), kept for the admin listener, upstream connections and plain GETs, new subscriptions get 503 + Retry-After, and each new connection closes the idlest idle ones (no request open); its last quarter is kept from client connections altogether.";

    // TLS (issue 47): loaded and used by src/tls/.
    ["TLS"]
    tls_cert: Option<PathBuf>, "tls-cert", "FILE", default (none "off"),
        sample (# "/etc/braid-proxy/tls/fullchain.pem"),
        parse file_path,
        "PEM certificate chain (the server's certificate first) for the client listener, which then speaks TLS only, offering h2 and http/1.1 by ALPN. Needs tls-key. SIGHUP re-reads both files; one that does not load keeps the old certificate, with an error logged.";
    tls_key: Option<PathBuf>, "tls-key", "FILE", default (none "off"),
        sample (# "/etc/braid-proxy/tls/privkey.pem"),
        parse file_path,
        "PEM private key (PKCS#8, PKCS#1 or SEC1) of tls-cert.";
    tls_client_ca: Option<PathBuf>, "tls-client-ca", "FILE", default (none "off"),
        sample (# "/etc/braid-proxy/tls/edges-ca.pem"),
        parse file_path,
        "PEM CA certificates: the TLS listener then requires a client certificate issued by one of them, so that only the tiers holding one are served (mutual TLS). Needs tls-cert; SIGHUP re-reads it too.";
    upstream_ca: Option<PathBuf>, "upstream-ca", "FILE", default (none "system roots only"),
        sample (# "/etc/braid-proxy/tls/shield-ca.pem"),
        parse file_path,
        "PEM CA certificates an https upstream's certificate may chain to, besides the system's roots. There is no switch that turns verification off.";
    upstream_client_cert: Option<PathBuf>, "upstream-client-cert", "FILE", default (none "off"),
        sample (# "/etc/braid-proxy/tls/edge.pem"),
        parse file_path,
        "PEM certificate chain presented to an https upstream that asks for one (another tier's tls-client-ca). Needs upstream-client-key.";
    upstream_client_key: Option<PathBuf>, "upstream-client-key", "FILE", default (none "off"),
        sample (# "/etc/braid-proxy/tls/edge-key.pem"),
        parse file_path,
        "PEM private key of upstream-client-cert.";
}

/// The configured upstream: scheme, authority and an optional path prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `http` or `https` (then reached over TLS, src/tls/client.rs).
    pub scheme: http::uri::Scheme,
    /// `host:port` as written in the URL.
    pub authority: http::uri::Authority,
    /// Path prefix without a trailing slash; empty for none.
    pub prefix: String,
}

impl Upstream {
    /// Parses `http://host[:port][/prefix]` or `https://host[:port][/prefix]`.
    pub fn parse(s: &str) -> Result<Upstream, String> {
        let uri: Uri = s.parse().map_err(|e| format!("not a URL: {e}"))?;
        let scheme = match uri.scheme() {
            Some(scheme) if matches!(scheme.as_str(), "http" | "https") => scheme.clone(),
            Some(other) => {
                return Err(format!(
                    "scheme `{other}` is not supported, use http or https"
                ))
            }
            None => return Err("the URL needs a scheme, e.g. http://127.0.0.1:9000".into()),
        };
        let authority = uri.authority().cloned().ok_or("the URL needs a host")?;
        if uri.query().is_some() {
            return Err("the URL must not have a query".into());
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(Upstream {
            scheme,
            authority,
            prefix,
        })
    }

    /// Whether the upstream is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTPS
    }

    /// The port connected to: the URL's, or the scheme's.
    pub fn port(&self) -> u16 {
        let default = if self.is_https() { 443 } else { 80 };
        self.authority.port_u16().unwrap_or(default)
    }

    /// The upstream URI for a request's path and query.
    pub fn uri_for(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.prefix)
    }
}

/// An address range: an address and how many of its leading bits count
/// (`10.0.0.0/8`, `fd00::/8`; a bare address is a range of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `ADDR/PREFIX` or `ADDR`; bits past the prefix are ignored.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("`{s}` is not an address range like 10.0.0.0/8 or ::1"))?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => bits,
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p <= bits => p,
                _ => return Err(format!("`{s}`: the prefix length must be 0 to {bits}")),
            },
        };
        Ok(Cidr { addr, prefix })
    }

    /// Whether `ip` is in the range (an IPv4-mapped IPv6 address counts as
    /// its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// The peers whose `X-Forwarded-Host` is taken (`--trusted-downstream`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedPeers(Vec<Cidr>);

impl TrustedPeers {
    /// Parses comma-separated ranges; an empty list trusts nobody.
    pub fn parse(v: &str) -> Result<TrustedPeers, String> {
        v.split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(Cidr::parse)
            .collect::<Result<_, _>>()
            .map(TrustedPeers)
    }

    /// Whether a connection from `peer` is a trusted downstream's.
    pub fn contains(&self, peer: IpAddr) -> bool {
        self.0.iter().any(|range| range.contains(peer))
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

/// Whether this tier follows its upstream's purge feed (`--upstream-purges`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamPurges {
    /// Once an upstream answer named its purge feed (`Purge-Feed`); an
    /// answer that is not a purge feed is remembered and the feed never
    /// asked for again.
    #[default]
    Auto,
    /// From the start, whatever the upstream answers.
    Follow,
    /// Never.
    Off,
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

    /// The longest poll interval of a quiet resource: `--poll-max-interval`,
    /// by default ten times `--poll-interval`, never below it.
    pub fn poll_ceiling(&self) -> Duration {
        self.poll_max_interval
            .unwrap_or(self.poll_interval.saturating_mul(10))
            .max(self.poll_interval)
    }

    /// Checks that the keys agree with each other.
    fn check(&self) -> Result<(), ConfigError> {
        if self
            .poll_max_interval
            .is_some_and(|max| max < self.poll_interval)
        {
            return Err(bad(
                "poll-max-interval",
                "is shorter than poll-interval".into(),
            ));
        }
        if let Some(addr) = self.admin_listen {
            if !addr.ip().is_loopback() && self.admin_token.is_none() {
                return Err(bad(
                    "admin-listen",
                    format!("{addr} is not loopback: set admin-token so that only operators reach /metrics and /refresh"),
                ));
            }
        }
        self.check_tls()
    }

    /// The TLS keys that only make sense together (the files themselves are
    /// read when the server starts, by src/tls/).
    fn check_tls(&self) -> Result<(), ConfigError> {
        let pairs = [
            (
                "tls-cert",
                self.tls_cert.is_some(),
                "tls-key",
                self.tls_key.is_some(),
            ),
            (
                "upstream-client-cert",
                self.upstream_client_cert.is_some(),
                "upstream-client-key",
                self.upstream_client_key.is_some(),
            ),
        ];
        for (a, has_a, b, has_b) in pairs {
            if has_a != has_b {
                let (given, missing) = if has_a { (a, b) } else { (b, a) };
                return Err(bad(given, format!("needs {missing} too")));
            }
        }
        if self.tls_client_ca.is_some() && self.tls_cert.is_none() {
            return Err(bad(
                "tls-client-ca",
                "needs tls-cert and tls-key: client certificates are asked for over TLS".into(),
            ));
        }
        let https = self.upstream.as_ref().is_some_and(Upstream::is_https);
        for (key, set) in [
            ("upstream-ca", self.upstream_ca.is_some()),
            ("upstream-client-cert", self.upstream_client_cert.is_some()),
        ] {
            if set && !https {
                return Err(bad(key, "applies to an https:// upstream only".into()));
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
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                // A key that takes a list, as its flag is repeated.
                toml::Value::Array(items) if is_list(key) => items
                    .into_iter()
                    .map(|v| match v {
                        toml::Value::String(s) => Ok(s),
                        other => Err(bad(key, format!("expected a string, got {other}"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(","),
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
}

/// The sample configuration: every key in its section, with its help,
/// its default, and the value an example deployment would give it
/// (`examples/deploy/braid-proxy.toml` is this text; a test checks it).
pub fn sample_toml() -> String {
    let mut out = String::from(
        "# braid-proxy configuration: every key, with its default unless noted.\n\
         # Each key is a flag's name without its two leading dashes; flags override\n\
         # this file.\n\
         # Durations: 250ms, 1s, 2m, 1h or seconds; sizes: 512, 64KiB, 16MiB, 1GiB.\n\
         # Start with: braid-proxy --config /etc/braid-proxy/braid-proxy.toml\n\
         # Generated from the declarations in src/config.rs (`cargo test` checks it).\n",
    );
    let mut section = "";
    for doc in KEY_DOCS {
        if doc.section != section {
            section = doc.section;
            let title = format!("# --- {section} ");
            out.push_str(&format!("\n{title:-<77}\n"));
        }
        let mut help = doc.help.to_string();
        if doc.sample.is_some() {
            help.push_str(&format!(" Default: {}.", doc.default));
        }
        for line in wrap(&help, 74) {
            out.push_str(&format!("# {line}\n"));
        }
        let value = toml_literal(doc.sample.unwrap_or(doc.default));
        let hash = if doc.commented { "# " } else { "" };
        out.push_str(&format!("{hash}{} = {value}\n", doc.key));
    }
    out
}

/// The flag reference (docs/flags.md): every key, in its section, with its
/// value, default and help, from the same declarations as `--help` and the
/// sample configuration (`cargo test` checks that the file is current).
pub fn flags_markdown() -> String {
    let mut out = String::from(
        "# Every flag\n\n\
         Generated from the declarations in `src/config.rs` (`declare_keys!`), as \
         `--help` and `examples/deploy/braid-proxy.toml` are; `cargo test` checks that \
         this file is current (regenerate it with `BRAID_PROXY_WRITE_SAMPLE=1 cargo test \
         --test operations generated`). Each flag is also a key of the `--config` file: \
         its name without the two leading dashes. Durations take `250ms`, `1s`, `2m`, \
         `1h` or a number of seconds; sizes `512`, `64KiB`, `16MiB`, `1GiB`. The guide \
         is [configuration.md](configuration.md).\n",
    );
    let mut section = "";
    for doc in KEY_DOCS {
        if doc.section != section {
            section = doc.section;
            out.push_str(&format!(
                "\n## {section}\n\n| flag | default | meaning |\n|---|---|---|\n"
            ));
        }
        out.push_str(&format!(
            "| `--{}` | `{}` | {} |\n",
            doc.key,
            doc.default.replace('|', "\\|"),
            doc.help.replace('|', "\\|")
        ));
    }
    out
}

/// Greedy word wrap at `width` columns.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

/// A value as TOML writes it: numbers and booleans bare, the rest quoted.
fn toml_literal(value: &str) -> String {
    let bare = value.parse::<i64>().is_ok()
        || value.parse::<f64>().is_ok()
        || matches!(value, "true" | "false");
    if bare {
        value.to_string()
    } else {
        toml::Value::String(value.to_string()).to_string()
    }
}

fn bad(key: &'static str, reason: String) -> ConfigError {
    ConfigError::Value { key, reason }
}

fn positive_duration(v: &str) -> Result<Duration, String> {
    let d = parse_duration(v)?;
    if d.is_zero() {
        Err("must be more than zero".into())
    } else {
        Ok(d)
    }
}

fn at_most_a_day(d: Duration) -> Result<Duration, String> {
    if d > Duration::from_secs(24 * 3600) {
        Err("at most 24h".into())
    } else {
        Ok(d)
    }
}

fn at_most_an_hour(d: Duration) -> Result<Duration, String> {
    if d > Duration::from_secs(3600) {
        Err("at most 1h".into())
    } else {
        Ok(d)
    }
}

fn in_range(n: usize, lo: usize, hi: usize) -> Result<usize, String> {
    if n < lo || n > hi {
        Err(format!("{n} is not between {lo} and {hi}"))
    } else {
        Ok(n)
    }
}

fn admin_token(v: &str) -> Result<Option<String>, String> {
    let token = v.trim();
    if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the admin token must be at least 16 visible ASCII characters".into());
    }
    Ok(Some(token.to_string()))
}

fn log_format(v: &str) -> Result<LogFormat, String> {
    match v.trim() {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(format!("`{other}` is not text or json")),
    }
}

fn proxy_id(v: &str) -> Result<String, String> {
    let ok = !v.is_empty()
        && v.len() <= 128
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    if ok {
        Ok(v.to_string())
    } else {
        Err("use 1 to 128 of A-Z a-z 0-9 - . _".into())
    }
}

fn upstream_kind(v: &str) -> Result<UpstreamKind, String> {
    match v.trim() {
        "auto" => Ok(UpstreamKind::Auto),
        "braid" => Ok(UpstreamKind::Braid),
        "rest" => Ok(UpstreamKind::Rest),
        other => Err(format!("`{other}` is not auto, braid or rest")),
    }
}

fn upstream_purges(v: &str) -> Result<UpstreamPurges, String> {
    match v.trim() {
        "auto" => Ok(UpstreamPurges::Auto),
        "follow" => Ok(UpstreamPurges::Follow),
        "off" => Ok(UpstreamPurges::Off),
        other => Err(format!("`{other}` is not auto, follow or off")),
    }
}

fn multiplex_mode(v: &str) -> Result<MultiplexMode, String> {
    match v.trim() {
        "terminate" => Ok(MultiplexMode::Terminate),
        "relay" => Ok(MultiplexMode::Relay),
        other => Err(format!("`{other}` is not terminate or relay")),
    }
}

fn multiplexer_idle(v: &str) -> Result<Duration, String> {
    let idle = parse_duration(v)?;
    if idle < Duration::from_secs(1) {
        return Err(format!("{v} is shorter than 1s"));
    }
    Ok(idle)
}

fn parse_bool(v: &str) -> Result<bool, String> {
    match v.trim() {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        other => Err(format!("`{other}` is not true or false")),
    }
}

fn snapshot_ratio(v: &str) -> Result<f64, String> {
    let r: f64 = v
        .trim()
        .parse()
        .map_err(|_| format!("`{v}` is not a number"))?;
    if !(r > 0.0 && r <= 1.0) {
        return Err(format!("{r} is not in (0, 1]"));
    }
    Ok(r)
}

/// Comma-separated origins, each `*` or `scheme://host[:port]`.
fn cors_origins(v: &str) -> Result<Vec<String>, String> {
    let list: Vec<String> = v
        .split(',')
        .map(str::trim)
        .filter(|o| !o.is_empty())
        .map(String::from)
        .collect();
    for origin in &list {
        let ok = origin == "*"
            || ((origin.starts_with("http://") || origin.starts_with("https://"))
                && origin.parse::<Uri>().is_ok()
                && !origin
                    .trim_start_matches("https://")
                    .trim_start_matches("http://")
                    .contains('/'));
        if !ok {
            return Err(format!(
                "`{origin}` is not `*` or an origin like https://example.com"
            ));
        }
    }
    Ok(list)
}

/// Parses `host:port`; `localhost` is taken as 127.0.0.1.
/// A file's path, as given (it is read when the server starts).
fn file_path(v: &str) -> Result<Option<PathBuf>, String> {
    if v.trim().is_empty() {
        return Err("expected a file path".into());
    }
    Ok(Some(PathBuf::from(v)))
}

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

/// A request rate: a positive number (fractions allowed, at most a million).
fn parse_rps(s: &str) -> Result<Option<f64>, String> {
    let rate: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of requests a second"))?;
    if !(rate > 0.0 && rate <= 1_000_000.0) {
        return Err(format!("{rate} is not between 0 (excluded) and 1000000"));
    }
    Ok(Some(rate))
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
    fn every_declared_default_parses_and_the_multiplexer_bounds_agree() {
        // Config::default() parses every declared default.
        let d = Config::default();
        assert_eq!(d.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
        assert_eq!(d.connect_timeout, Duration::from_secs(5));
        assert_eq!(d.max_header_bytes, 16 * 1024);
        assert_eq!(d.history_bytes, 64 * 1024 * 1024);
        assert_eq!(d.snapshot_ratio, 0.9);
        assert_eq!(d.max_streams_per_connection, 10_000);
        assert!(d.upstream.is_none() && d.admin_listen.is_none() && d.admin_token.is_none());
        assert!(d.cors_origins.is_empty() && d.proxy_id.is_empty());
        assert!(d.trusted_downstream.contains([127, 0, 0, 9].into()));
        assert!(d
            .trusted_downstream
            .contains(std::net::Ipv6Addr::LOCALHOST.into()));
        assert!(!d.trusted_downstream.contains([10, 0, 0, 1].into()));
        assert_eq!(KEYS.len(), KEY_DOCS.len());
        let mut c = Config::default();
        for doc in KEY_DOCS {
            if let Some(sample) = doc.sample {
                c.set(doc.key, sample)
                    .unwrap_or_else(|e| panic!("sample of {}: {e}", doc.key));
            }
        }
        assert!(matches!(
            c.set("no-such-key", "1"),
            Err(ConfigError::NoSuchKey(_))
        ));
    }

    #[test]
    fn flags_once_lists_repeated_and_the_bare_bool() {
        use clap::Parser;
        let parse = |args: &[&str]| {
            let mut all = vec!["braid-proxy"];
            all.extend_from_slice(args);
            Config::from_args(Args::try_parse_from(all).expect("flags parse"))
        };
        let err =
            parse(&["--listen", "127.0.0.1:1", "--listen", "127.0.0.1:2"]).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "invalid value for `listen`: given more than once"
        );
        let c = parse(&[
            "--cors-origin",
            "https://a.test",
            "--cors-origin",
            "http://b.test:8080",
            "--upstream-h2c",
        ])
        .expect("accepted");
        assert_eq!(c.cors_origins, ["https://a.test", "http://b.test:8080"]);
        assert!(c.upstream_h2c);
        let err = parse(&["--cors-origin", "https://a.test/path"]).expect_err("refused");
        assert!(err.to_string().contains("`cors-origin`"), "{err}");
        // Flags override the file; a list in the file is a list.
        let mut t = Config::default();
        t.apply_toml(
            Path::new("t.toml"),
            "cors-origin = [\"https://a.test\", \"*\"]\nupstream-h2c = true\n",
        )
        .expect("parses");
        assert_eq!(t.cors_origins, ["https://a.test", "*"]);
        assert!(t.upstream_h2c);
        let err = t
            .apply_toml(Path::new("t.toml"), "cors-origin = [1]\n")
            .expect_err("refused");
        assert!(err.to_string().contains("expected a string"), "{err}");
        let err = t
            .apply_toml(Path::new("t.toml"), "listen = [\"127.0.0.1:1\"]\n")
            .expect_err("refused");
        assert!(err.to_string().contains("`listen`"), "{err}");
        let err = t
            .apply_toml(Path::new("t.toml"), "listne = \"127.0.0.1:1\"\n")
            .expect_err("refused");
        assert!(err.to_string().ends_with("unknown key `listne`"), "{err}");
    }

    #[test]
    fn trusted_downstream_ranges_from_flags_and_toml() {
        use clap::Parser;
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let args = Args::try_parse_from([
            "braid-proxy",
            "--trusted-downstream",
            "10.1.0.0/16",
            "--trusted-downstream",
            "fd00::/8,192.0.2.7",
        ])
        .expect("flags parse");
        let c = Config::from_args(args).expect("accepted");
        let trusted = &c.trusted_downstream;
        assert!(trusted.contains(ip("10.1.200.3")) && !trusted.contains(ip("10.2.0.1")));
        assert!(trusted.contains(ip("fd12::1")) && !trusted.contains(ip("fe80::1")));
        assert!(trusted.contains(ip("192.0.2.7")) && !trusted.contains(ip("192.0.2.8")));
        assert!(trusted.contains(ip("::ffff:10.1.0.1")), "IPv4-mapped");
        assert!(
            !trusted.contains(ip("127.0.0.1")),
            "the flag replaces the default"
        );
        let mut t = Config::default();
        t.apply_toml(
            Path::new("t.toml"),
            "trusted-downstream = [\"0.0.0.0/0\"]\n",
        )
        .expect("a list");
        assert!(t.trusted_downstream.contains(ip("203.0.113.1")));
        assert!(!t.trusted_downstream.contains(ip("::2")));
        t.apply_toml(Path::new("t.toml"), "trusted-downstream = \"::/0\"\n")
            .expect("a string");
        assert!(t.trusted_downstream.contains(ip("::2")));
        t.apply_toml(Path::new("t.toml"), "trusted-downstream = []\n")
            .expect("nobody");
        assert_eq!(t.trusted_downstream, TrustedPeers::default());
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "10.0.0/8",
            "example.com",
            "10.0.0.0/x",
        ] {
            let err = t.set("trusted-downstream", bad).expect_err(bad);
            assert!(err.to_string().contains("`trusted-downstream`"), "{err}");
        }
    }

    #[test]
    fn upstream_urls() {
        let u = Upstream::parse("http://127.0.0.1:9000/api/").unwrap();
        assert_eq!(u.prefix, "/api");
        assert_eq!(
            u.uri_for("/x?y=1").unwrap().to_string(),
            "http://127.0.0.1:9000/api/x?y=1"
        );
        let https = Upstream::parse("https://example.com/api").unwrap();
        assert!(https.is_https() && https.port() == 443);
        assert_eq!(
            https.uri_for("/x").unwrap().to_string(),
            "https://example.com/api/x"
        );
        assert_eq!(https.to_string(), "https://example.com/api");
        assert!(Upstream::parse("ftp://example.com").is_err());
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
        assert_eq!(c.upstream_purges, UpstreamPurges::Auto);
        c.set("upstream-purges", "off").unwrap();
        assert_eq!(c.upstream_purges, UpstreamPurges::Off);
        c.set("upstream-purges", "follow").unwrap();
        assert_eq!(c.upstream_purges, UpstreamPurges::Follow);
        assert!(c.set("upstream-purges", "sometimes").is_err());
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
