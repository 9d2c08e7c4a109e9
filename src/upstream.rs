//! Pass-through proxying: the upstream client pool, the request filter
//! (open-proxy refusals, header limits, loop detection), hop-by-hop header
//! handling, `Via` and `X-Forwarded-*`, and the mapping of upstream failures
//! to 502 and 504.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, Version};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tracing::debug;

use crate::config::{Config, Upstream};
use crate::error::{describe, Refusal};
use crate::floor::body::{self, Body, ClientFault};
use crate::floor::headers::{owned_headers, strip_hop_by_hop};
use crate::metrics::Metrics;
use crate::tls::client::{Connector, UpstreamTls};

/// Facts about the connection a request arrived on, put in its extensions.
#[derive(Debug, Clone, Copy)]
pub struct ConnInfo {
    pub peer: SocketAddr,
    pub local: SocketAddr,
    /// The peer is in `--trusted-downstream` (decided at accept): its
    /// `X-Forwarded-Host` names the host its own client asked for.
    pub trusted: bool,
}

/// Pooled HTTP clients bound to the one configured upstream. Cheap to clone.
///
/// Pass-through requests and the watchers' requests use separate pools.
/// With `--upstream-h2c` the watchers share one HTTP/2 connection, and so
/// share its flow-control window: a pass-through download to a slow client
/// on that connection would stop every subscription on it. Pass-through
/// therefore always goes over HTTP/1.1.
#[derive(Clone)]
pub struct UpstreamClient {
    pass: Client<Connector, Body>,
    /// Keeps no idle connection: for requests that carry a body on a
    /// method whose body an origin may leave unread (see [`needs_own_connection`]).
    once: Client<Connector, Body>,
    watch: Client<Connector, Body>,
    /// How readiness probes reach the upstream: a connection as the pools
    /// make them (TCP, and for an https upstream the TLS handshake, so a
    /// certificate that stops verifying turns `/readyz` red), then closed.
    prober: Connector,
    upstream: Arc<Upstream>,
    response_timeout: Duration,
    metrics: Arc<Metrics>,
    /// The outcome of the latest requests and probes, for `/readyz`.
    pub health: Arc<UpstreamHealth>,
    /// Where the upstream declares range writes on every answer.
    pub declares: Arc<RangeWrites>,
    /// Turns true once an answer carried [`crate::floor::headers::PURGE_FEED`]: the
    /// upstream is a braid-proxy serving a purge feed (spec/tiers.md).
    pub announces_purge_feed: Arc<tokio::sync::watch::Sender<bool>>,
}

/// What the upstream's answers declared about range writes, by directory
/// (the path up to its last `/`): whether some carried
/// `Range-Request-Allow-Methods` naming `PUT` (a braidify server sets it on
/// every answer, before its handler runs), and whether some did not.
/// At most [`MAX_DIRECTORIES`] directories are remembered.
#[derive(Debug, Default)]
pub struct RangeWrites {
    dirs: std::sync::Mutex<std::collections::HashMap<String, Declared>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Declared {
    yes: bool,
    no: bool,
}

/// Most directories [`RangeWrites`] remembers.
const MAX_DIRECTORIES: usize = 4096;

/// The directory of a path: up to and including its last `/`.
fn directory(path: &str) -> &str {
    let path = path.split('?').next().unwrap_or(path);
    path.rfind('/').map_or("/", |i| &path[..=i])
}

impl RangeWrites {
    fn observe(&self, path: &str, status: http::StatusCode, headers: &HeaderMap) {
        // A multiplexer's 293 (sent before a braidify server's own headers)
        // and errors (from whatever fails) say nothing about the resource.
        if status.as_u16() == 293 || status.is_server_error() {
            return;
        }
        let declares = headers
            .get_all("range-request-allow-methods")
            .iter()
            .any(|v| {
                v.as_bytes()
                    .split(|b| *b == b',')
                    .any(|m| m.trim_ascii().eq_ignore_ascii_case(b"PUT"))
            });
        let dir = directory(path);
        let mut dirs = self.dirs.lock().unwrap_or_else(|p| p.into_inner());
        let seen = Declared {
            yes: declares,
            no: !declares,
        };
        if let Some(entry) = dirs.get_mut(dir) {
            entry.yes |= seen.yes;
            entry.no |= seen.no;
        } else if dirs.len() < MAX_DIRECTORIES {
            dirs.insert(dir.to_string(), seen);
        }
    }

    /// Every answer the upstream gave from `path`'s directory (at least
    /// one) declared that it takes range writes by `PUT`: a patch `PUT` to
    /// a resource there whose kind is not known yet is the upstream's to
    /// apply, as it says.
    pub fn declared_for(&self, path: &str) -> bool {
        let dirs = self.dirs.lock().unwrap_or_else(|p| p.into_inner());
        dirs.get(directory(path)).is_some_and(|d| d.yes && !d.no)
    }
}

/// Whether the upstream answers: the time of the latest success and of the
/// latest failure (with its reason), from requests and from probes.
#[derive(Debug, Default)]
pub struct UpstreamHealth {
    state: std::sync::Mutex<HealthState>,
}

#[derive(Debug, Default, Clone)]
pub struct HealthState {
    pub last_ok: Option<std::time::Instant>,
    pub last_failure: Option<(std::time::Instant, String)>,
}

impl UpstreamHealth {
    /// Records a success; logs the recovery when the upstream was down.
    pub fn ok(&self) {
        let mut state = self.lock();
        if let (Some((failed, _)), ok) = (&state.last_failure, state.last_ok) {
            if ok.is_none_or(|ok| *failed > ok) {
                tracing::info!(target: "upstream", "upstream answers again");
            }
        }
        state.last_ok = Some(std::time::Instant::now());
    }

    /// Records a failure, `reason` a whole sentence naming the upstream
    /// (`/readyz` and `/status` show it as it is). It is logged once when
    /// the upstream goes from answering to failing (or the reason
    /// changes), not on every attempt.
    pub fn failed(&self, reason: String) {
        let mut state = self.lock();
        let was_down = match (&state.last_failure, state.last_ok) {
            (Some((failed, previous)), ok) => {
                ok.is_none_or(|ok| *failed > ok) && *previous == reason
            }
            (None, _) => false,
        };
        if !was_down {
            tracing::warn!(target: "upstream", %reason, "upstream failing");
        }
        state.last_failure = Some((std::time::Instant::now(), reason));
    }

    pub fn snapshot(&self) -> HealthState {
        self.lock().clone()
    }

    /// The reason the upstream counts as down: its latest outcome was a
    /// failure. `None` while the latest outcome was a success, or before any.
    pub fn down(&self) -> Option<String> {
        let state = self.lock();
        match (&state.last_failure, state.last_ok) {
            (Some((failed, reason)), ok) if ok.is_none_or(|ok| *failed > ok) => {
                Some(reason.clone())
            }
            _ => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HealthState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl UpstreamClient {
    /// An error names a TLS file of an https upstream that does not load.
    pub fn new(
        upstream: Upstream,
        config: &Config,
        metrics: Arc<Metrics>,
    ) -> Result<UpstreamClient, String> {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(config.connect_timeout));
        tcp.set_nodelay(true);
        tcp.enforce_http(true);
        // TLS hook (issue 47, src/tls/client.rs): an https upstream is
        // reached over TLS; its watchers' connection offers h2 by ALPN
        // (what --upstream-h2c gives a plain one), pass-through's does not.
        let tls = UpstreamTls::from_config(&upstream, config)?;
        let h2c = config.upstream_h2c && tls.is_none();
        let pool = |h2c: bool, idle: usize, h2: bool| {
            let connector = Connector::new(tcp.clone(), tls.as_ref(), h2);
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(idle)
                .pool_timer(TokioTimer::new())
                .timer(TokioTimer::new())
                .http2_only(h2c)
                .http2_initial_connection_window_size(16 * 1024 * 1024)
                .http2_keep_alive_interval(Duration::from_secs(30))
                .http2_keep_alive_while_idle(true)
                .build(connector)
        };
        Ok(UpstreamClient {
            prober: Connector::new(tcp.clone(), tls.as_ref(), false),
            pass: pool(false, 64, false),
            once: pool(false, 0, false),
            watch: pool(h2c, 64, true),
            upstream: Arc::new(upstream),
            response_timeout: config.response_timeout,
            metrics,
            health: Arc::default(),
            declares: Arc::default(),
            announces_purge_feed: Arc::new(tokio::sync::watch::Sender::new(false)),
        })
    }

    /// The configured upstream.
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// Checks that the upstream accepts connections within `timeout` (a
    /// TCP connect, and for an https upstream the TLS handshake, its
    /// certificate verified), recording the outcome in
    /// [`UpstreamClient::health`].
    pub async fn probe(&self, timeout: Duration) {
        use tower::Service as _;
        let target = self.upstream.authority.as_str();
        let uri = match self.uri_for("/") {
            Ok(uri) => uri,
            Err(e) => {
                return self.health.failed(format!(
                    "upstream unreachable: no address for {target}: {e:?}"
                ))
            }
        };
        let mut prober = self.prober.clone();
        match tokio::time::timeout(timeout, prober.call(uri)).await {
            Ok(Ok(_)) => self.health.ok(),
            Ok(Err(e)) => self.health.failed(format!(
                "upstream unreachable: cannot connect to {target}: {e}"
            )),
            Err(_) => self.health.failed(format!(
                "upstream unreachable: no connection to {target} within {timeout:?}"
            )),
        }
    }

    /// Builds the upstream URI for a client's path and query.
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, Refusal> {
        self.upstream
            .uri_for(path_and_query)
            .map_err(|e| Refusal::BadRequest(format!("bad request target: {e}")))
    }

    /// Sends a client's request whose URI was made by
    /// [`UpstreamClient::uri_for`], bounded by the response timeout (time to
    /// response headers).
    /// A request marked by [`upstream_request`] as needing a connection of
    /// its own goes on one that is closed after it.
    pub async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, Refusal> {
        let pool = if req.extensions().get::<OwnConnection>().is_some() {
            &self.once
        } else {
            &self.pass
        };
        self.send_on(pool, req).await
    }

    /// Sends a watcher's request (a poll or a subscription), like [`UpstreamClient::send`].
    pub async fn send_watch(&self, req: Request<Body>) -> Result<Response<Incoming>, Refusal> {
        self.send_on(&self.watch, req).await
    }

    async fn send_on(
        &self,
        client: &Client<Connector, Body>,
        mut req: Request<Body>,
    ) -> Result<Response<Incoming>, Refusal> {
        Metrics::inc(&self.metrics.upstream_requests_total);
        req.headers_mut().insert(
            header::HOST,
            HeaderValue::from_str(self.upstream.authority.as_str())
                .map_err(|_| Refusal::BadRequest("bad upstream authority".into()))?,
        );
        let fault = req.extensions_mut().remove::<ClientFault>();
        let path = req.uri().path().to_string();
        let sent = std::time::Instant::now();
        let outcome = match tokio::time::timeout(self.response_timeout, client.request(req)).await {
            // The client's own body failed: its error, not the upstream's.
            Ok(Err(e)) if fault.as_ref().is_some_and(|f| f.reason().is_some()) => {
                let why = fault.as_ref().and_then(|f| f.reason()).unwrap_or_default();
                debug!(error = %describe(&e), "request body failed while forwarded");
                return Err(Refusal::BadRequest(format!(
                    "the request body could not be read: {why}"
                )));
            }
            Ok(Ok(response)) => Ok(response),
            Ok(Err(e)) if e.is_connect() => {
                Metrics::inc(&self.metrics.upstream_connect_errors_total);
                Err(Refusal::UpstreamUnreachable(describe(&e)))
            }
            Ok(Err(e)) => {
                Metrics::inc(&self.metrics.upstream_broken_total);
                Err(Refusal::UpstreamBroken(describe(&e)))
            }
            Err(_) => {
                Metrics::inc(&self.metrics.upstream_timeouts_total);
                Err(Refusal::UpstreamTimeout(self.response_timeout))
            }
        };
        match &outcome {
            Ok(response) => {
                self.declares
                    .observe(&path, response.status(), response.headers());
                if response
                    .headers()
                    .contains_key(crate::floor::headers::PURGE_FEED)
                {
                    self.announces_purge_feed
                        .send_if_modified(|seen| !std::mem::replace(seen, true));
                }
                self.metrics
                    .upstream_response_seconds
                    .observe(sent.elapsed().as_secs_f64());
                self.health.ok();
            }
            Err(refusal) => {
                Metrics::inc(&self.metrics.upstream_errors_total);
                self.health.failed(refusal.to_string());
            }
        }
        outcome
    }
}

/// Checks a request before anything else looks at it: the open-proxy
/// refusals, header limits, the request target and loops.
pub fn request_filter<B>(req: &Request<B>, config: &Config) -> Result<(), Refusal> {
    if req.method() == Method::CONNECT {
        return Err(Refusal::Connect);
    }
    // HTTP/2 always carries :scheme and :authority, so only HTTP/1 absolute-form is a proxy request.
    if req.version() < Version::HTTP_2 && req.uri().scheme().is_some() {
        let local = req.extensions().get::<ConnInfo>().map(|c| c.local);
        let names_us = match (req.uri().authority(), local) {
            (Some(authority), Some(local)) => authority_is(authority, local),
            _ => false,
        };
        if !names_us {
            return Err(Refusal::ForeignHost);
        }
    }
    check_header_limits(req.headers(), config)?;
    check_content_length(req.headers())?;
    check_no_userinfo(req)?;
    check_path(req.uri().path())?;
    trusted_forwarded_host(req)?;
    if via_names(req.headers(), &config.proxy_id) {
        return Err(Refusal::Loop(config.proxy_id.clone()));
    }
    Ok(())
}

fn authority_is(authority: &http::uri::Authority, local: SocketAddr) -> bool {
    let port = authority.port_u16().unwrap_or(80);
    if port != local.port() {
        return false;
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") && local.ip().is_loopback()
        || host.parse::<std::net::IpAddr>().ok() == Some(local.ip())
}

fn check_header_limits(headers: &HeaderMap, config: &Config) -> Result<(), Refusal> {
    if headers.len() > config.max_headers {
        return Err(Refusal::HeadersTooLarge(format!(
            "too many request headers: {} (limit {})",
            headers.len(),
            config.max_headers
        )));
    }
    let size: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if size > config.max_header_bytes {
        return Err(Refusal::HeadersTooLarge(format!(
            "request headers too large: {size} bytes (limit {})",
            config.max_header_bytes
        )));
    }
    Ok(())
}

/// Refuses a `Content-Length` that is not one line of decimal digits: two
/// lines (even equal ones, which hyper's parser folds into one length and
/// would forward both of) or a list (`5, 5`) are a request whose framing
/// another server in the chain may read differently (RFC 9112 §6.3 lets a
/// recipient refuse them; nginx answers 400).
fn check_content_length(headers: &HeaderMap) -> Result<(), Refusal> {
    let mut lines = headers.get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = lines.next() else {
        return Ok(());
    };
    if lines.next().is_some() {
        return Err(Refusal::BadRequest(
            "more than one Content-Length header: a request has at most one".into(),
        ));
    }
    if first.is_empty() || !first.as_bytes().iter().all(u8::is_ascii_digit) {
        return Err(Refusal::BadRequest(
            "Content-Length must be one decimal number".into(),
        ));
    }
    Ok(())
}

/// Refuses a request whose authority (`:authority`, an absolute-form
/// target, or `Host`) carries userinfo (`user:pw@host`): RFC 9113 §8.3.1
/// forbids it in `:authority`, RFC 9110 §4.2.4 says to treat it as an
/// error (it is how a link hides its real host), and `Host` has no room
/// for it. Refused rather than stripped, so that no credential in it is
/// ever keyed on, logged as a host or sent upstream as `X-Forwarded-Host`.
fn check_no_userinfo<B>(req: &Request<B>) -> Result<(), Refusal> {
    let in_target = req
        .uri()
        .authority()
        .is_some_and(|a| a.as_str().contains('@'));
    let in_host = req
        .headers()
        .get_all(header::HOST)
        .iter()
        .any(|h| h.as_bytes().contains(&b'@'));
    if in_target || in_host {
        return Err(Refusal::BadRequest(
            "the request's authority carries userinfo (user@host): not allowed (RFC 9110 §4.2.4)"
                .into(),
        ));
    }
    Ok(())
}

/// Refuses paths that could climb out of the upstream's path prefix.
fn check_path(path: &str) -> Result<(), Refusal> {
    if !path.starts_with('/') {
        return Err(Refusal::BadRequest(
            "request target must start with /".into(),
        ));
    }
    let climbs = path.split('/').any(is_dot_segment);
    // An encoded slash next to dots could turn into a `..` segment upstream.
    let encoded_climb = path.contains("..")
        && path
            .as_bytes()
            .windows(3)
            .any(|w| w.eq_ignore_ascii_case(b"%2f"));
    if climbs || encoded_climb {
        return Err(Refusal::BadRequest(
            "request path must not contain . or .. segments".into(),
        ));
    }
    Ok(())
}

/// Whether a path segment is `.` or `..`, each dot maybe written `%2e`
/// (either case).
fn is_dot_segment(segment: &str) -> bool {
    let mut rest = segment.as_bytes();
    let mut dots = 0;
    while !rest.is_empty() {
        if rest[0] == b'.' {
            rest = &rest[1..];
        } else if rest.len() >= 3 && rest[..3].eq_ignore_ascii_case(b"%2e") {
            rest = &rest[3..];
        } else {
            return false;
        }
        dots += 1;
    }
    dots == 1 || dots == 2
}

/// True when one of the `Via` entries was added by the proxy with this id.
pub fn via_names(headers: &HeaderMap, id: &str) -> bool {
    headers
        .get_all(header::VIA)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|entry| second_token(entry.as_bytes()) == Some(id.as_bytes()))
}

/// The second whitespace-separated token of a `Via` entry (the received-by
/// name after the protocol); `split_whitespace().nth(1)` without the
/// iterator machinery (a `Via` value is visible ASCII, spaces and tabs).
fn second_token(entry: &[u8]) -> Option<&[u8]> {
    let space = |s: &[u8]| s.iter().take_while(|b| b.is_ascii_whitespace()).count();
    let token = |s: &[u8]| s.iter().take_while(|b| !b.is_ascii_whitespace()).count();
    let rest = &entry[space(entry)..];
    let first = token(rest);
    if first == 0 {
        return None;
    }
    let rest = &rest[first..];
    let rest = &rest[space(rest)..];
    let second = token(rest);
    (second > 0).then(|| &rest[..second])
}

/// The `Via` entry this proxy adds for a message of the given version.
fn via_entry(version: Version, id: &str) -> String {
    let protocol = match version {
        Version::HTTP_10 => "1.0",
        Version::HTTP_2 => "2",
        _ => "1.1",
    };
    format!("{protocol} {id}")
}

/// Adds this proxy's entry to `Via`, as one comma-joined line with the
/// entries already there (some origins read only the first line).
pub fn append_via(headers: &mut HeaderMap, version: Version, id: &str) {
    let mut entries: Vec<&str> = headers
        .get_all(header::VIA)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let own = via_entry(version, id);
    entries.push(&own);
    if let Ok(v) = HeaderValue::from_str(&entries.join(", ")) {
        headers.insert(header::VIA, v);
    }
}

/// The host a request is for, the one it is keyed on and that goes
/// upstream as `X-Forwarded-Host`: a trusted downstream tier's
/// `X-Forwarded-Host` (see [`trusted_forwarded_host`]), else the host the
/// request itself named (its absolute-form authority, else `Host`). So
/// every tier keys on the host the outermost client asked for.
pub fn client_host<B>(req: &Request<B>) -> Option<String> {
    match trusted_forwarded_host(req) {
        Ok(Some(host)) => Some(host.to_string()),
        // A malformed one is refused by `request_filter` before any use.
        Ok(None) | Err(_) => named_host(req),
    }
}

/// The `X-Forwarded-Host` of a request from a trusted downstream tier
/// (`ConnInfo::trusted`): its first value, the outermost client's. None
/// from anyone else, or when there is none; an error when the first value
/// is not a `host[:port]`.
pub fn trusted_forwarded_host<B>(req: &Request<B>) -> Result<Option<&str>, Refusal> {
    let trusted = req
        .extensions()
        .get::<ConnInfo>()
        .is_some_and(|c| c.trusted);
    let Some(value) = req.headers().get(X_FORWARDED_HOST).filter(|_| trusted) else {
        return Ok(None);
    };
    let first = value.as_bytes().split(|b| *b == b',').next().unwrap_or(b"");
    let first = first.trim_ascii();
    match std::str::from_utf8(first) {
        Ok(host) if is_host_and_port(host) => Ok(Some(host)),
        _ => Err(Refusal::BadRequest(format!(
            "X-Forwarded-Host {:?} is not a host[:port]",
            String::from_utf8_lossy(first)
        ))),
    }
}

const X_FORWARDED_HOST: &str = "x-forwarded-host";

/// `host[:port]`: a DNS name or IPv4 address (letters, digits, `-`, `.`,
/// `_`) or a bracketed IPv6 address, and an optional decimal port.
fn is_host_and_port(s: &str) -> bool {
    let (host, port) = match s.rsplit_once(':') {
        Some((host, port)) if !host.starts_with('[') || host.ends_with(']') => (host, Some(port)),
        _ => (s, None),
    };
    let port_ok =
        port.is_none_or(|p| p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok());
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host.len() <= 253
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        }
    };
    port_ok && host_ok
}

/// The host a request named: its absolute-form authority, else `Host`.
fn named_host<B>(req: &Request<B>) -> Option<String> {
    req.uri()
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| {
            req.headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })
}

/// The headers of a request the proxy sends upstream on behalf of a
/// client's: its end-to-end headers, then `Via` and `X-Forwarded-*`.
fn forwarded_headers(
    mut headers: HeaderMap,
    version: Version,
    conn: Option<&ConnInfo>,
    host: Option<String>,
    config: &Config,
) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    if let Some(asked) = headers.remove(HEARTBEATS) {
        if let Some(clamped) = crate::braid::heartbeats_upstream(&asked) {
            headers.insert(HEARTBEATS, clamped);
        }
    }
    append_via(&mut headers, version, &config.proxy_id);
    // TLS hook (issue 47): a TLS listener's clients came over https.
    forwarding(&mut headers, conn, host, config.tls_cert.is_some());
    headers.append(
        "surrogate-capability",
        HeaderValue::from_static(crate::floor::rules::SURROGATE_CAPABILITY),
    );
    headers
}

/// The headers a watcher started by `req` sends with every request: the
/// client's identity (credentials, `Accept-*`, the headers the origin may
/// vary on) and forwarding headers, so the origin grants the shared state
/// no more than it grants that client. Headers about this one request
/// (conditionals, ranges, Braid subscription headers, a body) are left out.
pub fn watcher_template<B>(req: &Request<B>, config: &Config) -> HeaderMap {
    let mut headers = forwarded_headers(
        req.headers().clone(),
        req.version(),
        req.extensions().get::<ConnInfo>(),
        client_host(req),
        config,
    );
    for name in [
        "if-none-match",
        "if-modified-since",
        "if-match",
        "if-unmodified-since",
        "if-range",
        "range",
        "subscribe",
        "parents",
        "version",
        "heartbeats",
        "peer",
        "content-length",
        "content-type",
        "content-range",
        "patches",
        "expect",
        "cache-control",
        "pragma",
        "multiplex-through",
        "multiplex-version",
        "accept-encoding",
    ] {
        headers.remove(name);
    }
    owned_headers(&headers)
}

/// Builds the upstream request for a client request: same method, path,
/// query, end-to-end headers and (streamed) body, plus `Via` and `X-Forwarded-*`.
pub fn upstream_request<B>(
    req: Request<B>,
    client: &UpstreamClient,
    config: &Config,
) -> Result<Request<Body>, Refusal>
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<crate::floor::body::BoxError>,
{
    let host = client_host(&req);
    let own_connection = needs_own_connection(&req);
    let (parts, incoming) = req.into_parts();
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let uri = client.uri_for(target)?;
    let headers = forwarded_headers(
        parts.headers,
        parts.version,
        parts.extensions.get::<ConnInfo>(),
        host,
        config,
    );
    let (forwarded, fault) = body::client_stream(incoming);
    let mut out = Request::new(forwarded);
    *out.method_mut() = parts.method;
    *out.uri_mut() = uri;
    *out.headers_mut() = headers;
    out.extensions_mut().insert(fault);
    if own_connection {
        out.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        out.extensions_mut().insert(OwnConnection);
    }
    Ok(out)
}

/// Marks an upstream request that goes on a connection of its own.
#[derive(Debug, Clone, Copy)]
struct OwnConnection;

/// Whether a request carries a body on a method whose body has no
/// defined meaning (GET, HEAD, OPTIONS, DELETE, TRACE): an origin may
/// answer without reading it and then read it as the next request on the
/// same connection. Such a request is sent on a connection that is
/// closed after it (SECURITY.md, "Request smuggling"), so no other
/// client's request can follow it there.
pub fn needs_own_connection<B: http_body::Body>(req: &Request<B>) -> bool {
    body_is_meaningless(req.method()) && !req.body().is_end_stream()
}

/// The methods whose request content has no generally defined semantics
/// (RFC 9110 §9.3).
pub fn body_is_meaningless(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::DELETE | Method::TRACE
    )
}

/// Whether a request header is a forwarding claim: something a proxy in
/// front of the origin says about the client or the request's way there
/// (who asked, over which scheme, for which host, port or path prefix),
/// which an origin may build links, redirects or access decisions on.
/// `Forwarded` (RFC 7239), every `X-Forwarded-*`, `X-Real-IP`, `X-Host`,
/// and the rewriting headers some frameworks honour (`X-Original-Host`,
/// `X-Original-URL`, `X-Rewrite-URL`).
pub fn is_forwarding_claim(name: &HeaderName) -> bool {
    let name = name.as_str();
    name.starts_with("x-forwarded-")
        || matches!(
            name,
            "forwarded"
                | "x-real-ip"
                | "x-host"
                | "x-original-host"
                | "x-original-url"
                | "x-rewrite-url"
        )
}

/// The one trust rule for forwarding claims (SECURITY.md, "Forwarding
/// headers"): from a peer outside `--trusted-downstream` (or with no
/// connection known) every claim the client wrote is removed, and the
/// proxy says only what it knows itself: `X-Forwarded-For` the peer's
/// address, `X-Forwarded-Proto` the listener's scheme, `X-Forwarded-Host`
/// the request's host. From a trusted peer (a tier below, which set them
/// for its own client) they pass: its `X-Forwarded-For` gets the peer
/// appended, its `X-Forwarded-Proto` stays, and `X-Forwarded-Host` is its
/// first value (`host`, from [`client_host`]).
fn forwarding(headers: &mut HeaderMap, conn: Option<&ConnInfo>, host: Option<String>, https: bool) {
    let trusted = conn.is_some_and(|c| c.trusted);
    if !trusted {
        let claims: Vec<HeaderName> = headers
            .keys()
            .filter(|name| is_forwarding_claim(name))
            .cloned()
            .collect();
        for name in claims {
            headers.remove(name);
        }
    }
    if let Some(conn) = conn {
        let ip = conn.peer.ip().to_string();
        // Every earlier line counts: several header lines are one comma-joined list.
        let mut value = Vec::new();
        for prior in headers.get_all(X_FORWARDED_FOR) {
            value.extend_from_slice(prior.as_bytes());
            value.extend_from_slice(b", ");
        }
        value.extend_from_slice(ip.as_bytes());
        if let Ok(v) = HeaderValue::from_bytes(&value) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    }
    if !headers.contains_key(X_FORWARDED_PROTO) {
        let proto = if https { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    }
    // A trusted tier's first value is `host` already; the rest of its
    // list (the hosts the tiers in between were asked for) is not passed.
    headers.remove(X_FORWARDED_HOST);
    if let Some(v) = host.and_then(|h| HeaderValue::from_str(&h).ok()) {
        headers.insert(X_FORWARDED_HOST, v);
    }
}

const HEARTBEATS: &str = "heartbeats";
const X_FORWARDED_FOR: &str = "x-forwarded-for";
const X_FORWARDED_PROTO: &str = "x-forwarded-proto";

/// Turns an upstream response into the client's: hop-by-hop headers out,
/// `Via` in, body streamed as it arrives.
pub fn downstream_response(response: Response<Incoming>, config: &Config) -> Response<Body> {
    let (mut parts, incoming) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    append_via(&mut parts.headers, parts.version, &config.proxy_id);
    parts.version = Version::HTTP_11;
    Response::from_parts(parts, body::stream(incoming))
}

/// Plain pass-through of one request.
pub async fn pass_through(
    req: Request<crate::floor::body::RequestBody>,
    client: &UpstreamClient,
    config: &Config,
) -> Result<Response<Body>, Refusal> {
    let out = upstream_request(req, client, config)?;
    let response = client.send(out).await?;
    Ok(downstream_response(response, config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_writes_are_declared_by_directory() {
        let writes = RangeWrites::default();
        let mut marked = HeaderMap::new();
        marked.insert(
            "range-request-allow-methods",
            HeaderValue::from_static("PATCH, PUT"),
        );
        let plain = HeaderMap::new();
        let ok = http::StatusCode::OK;
        writes.observe("/docs/a", ok, &marked);
        writes.observe("/docs/b?x=1", ok, &marked);
        writes.observe(
            "/docs/c",
            http::StatusCode::from_u16(293).expect("status"),
            &plain,
        );
        writes.observe("/docs/d", http::StatusCode::BAD_GATEWAY, &plain);
        writes.observe("/api/a", ok, &marked);
        writes.observe("/api/b", ok, &plain);
        assert!(writes.declared_for("/docs/new"));
        assert!(!writes.declared_for("/api/new"), "one answer without it");
        assert!(!writes.declared_for("/other/new"), "nothing seen");
        assert!(!writes.declared_for("/docs/sub/new"), "another directory");
        assert_eq!(directory("/a"), "/");
        assert_eq!(directory("/a/b?c=/d"), "/a/");
    }

    #[test]
    fn hop_by_hop_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-authorization", HeaderValue::from_static("basic x"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn dot_segments_are_refused() {
        assert!(check_path("/a/b").is_ok());
        assert!(check_path("/a/../b").is_err());
        assert!(check_path("/a/%2E%2e/b").is_err());
        assert!(check_path("/a/./b").is_err());
        assert!(check_path("/a..b/c").is_ok());
    }

    /// The rule as first written, with allocations, against the one used.
    fn check_path_as_written(path: &str) -> bool {
        let climbs = path.split('/').any(|segment| {
            let s = segment.to_ascii_lowercase().replace("%2e", ".");
            s == ".." || s == "."
        });
        let encoded_climb = path.to_ascii_lowercase().contains("%2f") && path.contains("..");
        path.starts_with('/') && !climbs && !encoded_climb
    }

    #[test]
    fn dot_segments_as_first_written() {
        for path in [
            "/",
            "//",
            "/.",
            "/..",
            "/...",
            "/a/.%2E/",
            "/%2e",
            "/%2E%2e%2e",
            "/%2",
            "/%2e.",
            "/x%2e",
            "/.x",
            "/a/%2F/..b",
            "/a/%2f",
            "/a/..%2F",
            "/é/../",
            "/%2e/%2f",
            "a/b",
            "/a/%2%2ee/",
            "/a/%%2e/",
        ] {
            assert_eq!(
                check_path(path).is_ok(),
                check_path_as_written(path),
                "{path}"
            );
        }
    }

    #[test]
    fn second_token_as_split_whitespace() {
        for entry in [
            "",
            " ",
            "1.1",
            "1.1 ",
            " 1.1  shield ",
            "1.1\tshield\t(comment)",
            "1.1 a b",
            "\t\t",
            "HTTP/1.1 edge-1",
            "x  ",
        ] {
            assert_eq!(
                second_token(entry.as_bytes()),
                entry.split_whitespace().nth(1).map(str::as_bytes),
                "{entry:?}"
            );
        }
    }

    #[test]
    fn forwarded_hosts_from_trusted_peers_only() {
        let request = |trusted: bool, forwarded: &[&str]| {
            let mut req = Request::get("/doc").header(header::HOST, "tier-1:8080");
            for value in forwarded {
                req = req.header(X_FORWARDED_HOST, *value);
            }
            let mut req = req.body(()).expect("request");
            req.extensions_mut().insert(ConnInfo {
                peer: "10.0.0.2:5000".parse().expect("addr"),
                local: "10.0.0.1:8080".parse().expect("addr"),
                trusted,
            });
            req
        };
        let host = |trusted, forwarded| client_host(&request(trusted, forwarded));
        assert_eq!(host(true, &["a.example"]).as_deref(), Some("a.example"));
        assert_eq!(
            host(true, &[" a.example , b"]).as_deref(),
            Some("a.example")
        );
        assert_eq!(
            host(true, &["a.example:81", "b"]).as_deref(),
            Some("a.example:81")
        );
        assert_eq!(host(true, &[]).as_deref(), Some("tier-1:8080"));
        assert_eq!(host(false, &["a.example"]).as_deref(), Some("tier-1:8080"));
        assert!(trusted_forwarded_host(&request(false, &["a b"])).is_ok());
        for bad in [
            "", "a b", "a/b", "u@a", "a:", "a:x", "a:65536", "::1", "[::1", "a:+80",
        ] {
            assert!(
                trusted_forwarded_host(&request(true, &[bad])).is_err(),
                "{bad:?}"
            );
        }
        for good in [
            "a",
            "a-b.c_d",
            "192.0.2.1:65535",
            "[::1]",
            "[2001:db8::1]:8080",
        ] {
            assert!(is_host_and_port(good), "{good:?}");
        }
    }

    #[test]
    fn via_loop() {
        let mut h = HeaderMap::new();
        h.insert(
            header::VIA,
            HeaderValue::from_static("1.1 edge-1, 1.1 shield"),
        );
        assert!(via_names(&h, "shield"));
        assert!(!via_names(&h, "edge"));
    }

    #[test]
    fn via_is_one_line_with_the_callers_entries() {
        let mut h = HeaderMap::new();
        append_via(&mut h, Version::HTTP_11, "edge");
        assert_eq!(h.get(header::VIA).expect("via"), "1.1 edge");
        let mut h = HeaderMap::new();
        h.append(header::VIA, HeaderValue::from_static("1.1 lb"));
        h.append(header::VIA, HeaderValue::from_static("2 edge-1"));
        append_via(&mut h, Version::HTTP_11, "shield");
        assert_eq!(h.get_all(header::VIA).iter().count(), 1);
        assert_eq!(
            h.get(header::VIA).expect("via"),
            "1.1 lb, 2 edge-1, 1.1 shield"
        );
        assert!(via_names(&h, "edge-1") && via_names(&h, "shield"));
    }
}
