//! Purges flow down the tree: every braid-proxy serves a Braid
//! subscription of the purges and refreshes it performed, and follows its
//! upstream's when the upstream is a braid-proxy (spec/tiers.md).
//!
//! Serving ([`Purges::serve`]): `GET /.well-known/braid-proxy/purges` with
//! `Subscribe` on the main listener, to `--trusted-downstream` peers only.
//! Each update is one purge (`{"action":"purge","tag":"news"}`), versioned
//! `"<boot>-<seq>"`: a sequence number and this process's boot id, so a
//! restarted node is told apart. The last [`MAX_ENTRIES`] updates (at
//! most [`MAX_WINDOW_BYTES`]) are kept; a subscriber whose `Parents` is
//! in that window gets what came after it, any other `Parents` one reset
//! update (`{"action":"purge","all":true}`, no `Parents`).
//!
//! Following ([`Purges::follow`]): once the upstream named its feed
//! (the `Purge-Feed` header a braid-proxy puts on its answers to a
//! downstream tier), one subscription to the upstream's feed, resumed with `Parents` after a break. Each update is applied by
//! the caller's function (the admin listener's own path, which also
//! publishes it on this tier's feed, so it travels further down). An
//! update whose `Parents` is not the version applied last (a reset, a
//! restarted upstream, the first open) means purges may have been
//! missed: everything stored is purged. Nothing read from a downstream is
//! ever applied, so a purge never travels upward or sideways.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::braid::{self, DecodeLimits, Decoder, Update, VersionId, VersionList};
use crate::config::{Config, UpstreamPurges};
use crate::floor::body::{self, Body, BoxError, Chunk};
use crate::floor::sync::lock;
use crate::upstream::{self, ConnInfo, UpstreamClient};

/// Where a braid-proxy serves its purge feed, on its main listener.
pub const FEED_PATH: &str = "/.well-known/braid-proxy/purges";
/// Updates kept for subscribers that resume.
pub const MAX_ENTRIES: usize = 1024;
/// Bytes of updates kept for subscribers that resume.
pub const MAX_WINDOW_BYTES: usize = 1 << 20;
/// Longest path or tag a purge carries, in bytes.
pub const MAX_VALUE_BYTES: usize = 4096;
/// Longest update body read from an upstream's feed.
const MAX_UPDATE_BYTES: usize = 2 * MAX_VALUE_BYTES;
/// Longest update header block read from an upstream's feed.
const MAX_UPDATE_HEAD: usize = 2048;
/// Feed subscribers served at once (then 503); not counted in
/// `--max-subscriptions`.
pub const MAX_READERS: usize = 4096;
/// The heartbeat a follower asks for.
const FOLLOWER_HEARTBEAT: Duration = Duration::from_secs(5);
/// The heartbeat of a feed subscriber that asks for none.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(25);
/// First and longest wait before asking the upstream's feed again.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// Most bytes of updates sent in one chunk.
const MAX_CHUNK: usize = 64 * 1024;

/// One purge or refresh, as performed and as carried on the feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Purge {
    /// Every stored variant of a path and query.
    Path(String),
    /// Every stored answer whose `Surrogate-Key` or `Cache-Tag` lists it.
    Tag(String),
    /// Revalidate every variant of a path and query (`POST /refresh`).
    Refresh(String),
    /// Everything stored: purges may have been missed.
    All,
}

/// The JSON body of one update.
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct WireBody {
    action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tag: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    all: bool,
}

impl Purge {
    /// Why this purge cannot travel on the feed, if it cannot: a path
    /// that does not start with `/`, an empty tag, a value over
    /// [`MAX_VALUE_BYTES`] or holding a control character.
    pub fn check(&self) -> Result<(), String> {
        let (value, what) = match self {
            Purge::All => return Ok(()),
            Purge::Path(p) | Purge::Refresh(p) => (p, "path"),
            Purge::Tag(t) => (t, "tag"),
        };
        if value.len() > MAX_VALUE_BYTES {
            return Err(format!("the {what} is longer than {MAX_VALUE_BYTES} bytes"));
        }
        if value.chars().any(char::is_control) {
            return Err(format!("the {what} holds a control character"));
        }
        match self {
            Purge::Tag(t) if t.trim().is_empty() => Err("the tag is empty".into()),
            Purge::Path(p) | Purge::Refresh(p) if !p.starts_with('/') => {
                Err("the path does not start with /".into())
            }
            _ => Ok(()),
        }
    }

    fn to_json(&self) -> String {
        let mut wire = WireBody {
            action: "purge".into(),
            ..WireBody::default()
        };
        match self {
            Purge::Path(p) => wire.path = Some(p.clone()),
            Purge::Tag(t) => wire.tag = Some(t.clone()),
            Purge::Refresh(p) => {
                wire.action = "refresh".into();
                wire.path = Some(p.clone());
            }
            Purge::All => wire.all = true,
        }
        serde_json::to_string(&wire).unwrap_or_default()
    }

    /// Reads one update's body; unknown fields are ignored, an unknown
    /// action or an unusable value is an error.
    fn from_json(body: &[u8]) -> Result<Purge, String> {
        let wire: WireBody =
            serde_json::from_slice(body).map_err(|e| format!("not a purge: {e}"))?;
        let purge = match (wire.action.as_str(), wire.path, wire.tag, wire.all) {
            ("purge", None, None, true) => Purge::All,
            ("purge", Some(path), None, false) => Purge::Path(path),
            ("purge", None, Some(tag), false) => Purge::Tag(tag),
            ("refresh", Some(path), None, false) => Purge::Refresh(path),
            (action, ..) => {
                return Err(format!(
                    "action `{}` with these fields is not one this proxy knows",
                    action.chars().take(32).collect::<String>()
                ))
            }
        };
        purge.check()?;
        Ok(purge)
    }

    /// This purge in a downstream tier's terms: its upstream serves the
    /// tier's paths under `prefix` (the upstream URL's path). `None` for a
    /// path outside it, which is no URL of that tier.
    fn below_prefix(self, prefix: &str) -> Option<Purge> {
        let strip = |p: String| -> Option<String> {
            if prefix.is_empty() {
                return Some(p);
            }
            let rest = p.strip_prefix(prefix)?;
            if rest.starts_with('/') {
                Some(rest.to_string())
            } else if rest.is_empty() || rest.starts_with('?') {
                Some(format!("/{rest}"))
            } else {
                None
            }
        };
        match self {
            Purge::Path(p) => strip(p).map(Purge::Path),
            Purge::Refresh(p) => strip(p).map(Purge::Refresh),
            other => Some(other),
        }
    }
}

/// A feed version: this process's boot id and a sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
struct At {
    boot: String,
    seq: u64,
}

impl At {
    fn id(&self) -> String {
        format!("{}-{}", self.boot, self.seq)
    }

    fn version(&self) -> VersionList {
        VersionId::new(self.id()).map_or_else(|_| VersionList::default(), VersionList::single)
    }

    fn parse(id: &str) -> Option<At> {
        let (boot, seq) = id.rsplit_once('-')?;
        let fine =
            !boot.is_empty() && boot.len() <= 64 && boot.bytes().all(|b| b.is_ascii_alphanumeric());
        let seq = seq.parse().ok().filter(|_| fine && !seq.starts_with('+'))?;
        Some(At {
            boot: boot.to_string(),
            seq,
        })
    }

    /// The single version a header or update names, if it is a feed version.
    fn of_list(list: &VersionList) -> Option<At> {
        let mut ids = list.iter();
        let first = ids.next()?;
        if ids.next().is_some() {
            return None;
        }
        At::parse(first.as_str())
    }

    /// The feed version a `Parents` or `Current-Version` value names.
    fn of_header(value: &HeaderValue) -> Option<At> {
        VersionList::parse(value.as_bytes())
            .ok()
            .and_then(|l| At::of_list(&l))
    }
}

/// A boot id: 16 hex digits, different at every start.
fn boot_id() -> String {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    hash.update(now.as_nanos().to_le_bytes());
    hash.update(std::process::id().to_le_bytes());
    static STARTS: AtomicU64 = AtomicU64::new(0);
    hash.update(STARTS.fetch_add(1, Relaxed).to_le_bytes());
    let marker = 0u8;
    hash.update((std::ptr::addr_of!(marker) as usize).to_le_bytes());
    hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The updates kept for subscribers that resume.
#[derive(Default)]
struct Log {
    /// (sequence number, encoded update), oldest first.
    entries: VecDeque<(u64, Bytes)>,
    bytes: usize,
}

/// Counters shown in `/metrics`.
#[derive(Default)]
struct Counts {
    published: AtomicU64,
    received: AtomicU64,
    resyncs: AtomicU64,
    ignored: AtomicU64,
    following: AtomicBool,
}

/// This proxy's purge feed, served and followed.
pub struct Purges {
    boot: String,
    log: Mutex<Log>,
    /// The newest sequence number published (0: none yet).
    head: watch::Sender<u64>,
    readers: Arc<AtomicUsize>,
    counts: Counts,
    client: UpstreamClient,
    config: Config,
    closing: watch::Receiver<bool>,
}

/// Counts one feed subscriber while its stream lives.
struct Reader(Arc<AtomicUsize>);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Purges {
    pub fn new(client: UpstreamClient, config: Config, closing: watch::Receiver<bool>) -> Purges {
        Purges {
            boot: boot_id(),
            log: Mutex::default(),
            head: watch::Sender::new(0),
            readers: Arc::default(),
            counts: Counts::default(),
            client,
            config,
            closing,
        }
    }

    fn at(&self, seq: u64) -> At {
        At {
            boot: self.boot.clone(),
            seq,
        }
    }

    /// Appends a purge this proxy performed to its feed.
    pub fn publish(&self, purge: &Purge) {
        let mut log = lock(&self.log);
        let seq = *self.head.borrow() + 1;
        let update = Update {
            status: None,
            version: self.at(seq).version(),
            parents: self.at(seq - 1).version(),
            body: braid::Body::Snapshot(Bytes::from(purge.to_json())),
            extra_headers: Vec::new(),
        };
        let wire = braid::encode(&update);
        log.bytes += wire.len();
        log.entries.push_back((seq, wire));
        while log.entries.len() > MAX_ENTRIES
            || (log.bytes > MAX_WINDOW_BYTES && log.entries.len() > 1)
        {
            if let Some((_, gone)) = log.entries.pop_front() {
                log.bytes -= gone.len();
            }
        }
        // Under the log's lock: subscribers see versions in order.
        self.head.send_replace(seq);
        self.counts.published.fetch_add(1, Relaxed);
    }

    /// The updates after `at`, joined (at most [`MAX_CHUNK`] bytes, at least
    /// one update), and the sequence number they end at; `Err` when the
    /// window no longer holds the one right after `at`.
    fn after(&self, at: u64) -> Result<Option<(Bytes, u64)>, ()> {
        let log = lock(&self.log);
        let head = *self.head.borrow();
        if head <= at {
            return Ok(None);
        }
        let Some(first) = log.entries.front().map(|(seq, _)| *seq) else {
            return Err(());
        };
        if first > at + 1 {
            return Err(());
        }
        let mut out = BytesMut::new();
        let mut end = at;
        for (seq, wire) in log.entries.iter().skip((at + 1 - first) as usize) {
            if !out.is_empty() && out.len() + wire.len() > MAX_CHUNK {
                break;
            }
            out.extend_from_slice(wire);
            end = *seq;
        }
        Ok(Some((out.freeze(), end)))
    }

    /// Answers a request for [`FEED_PATH`]: the feed's 209 to a trusted
    /// downstream's subscription, its current version to a plain GET.
    pub fn serve<B>(self: &Arc<Self>, req: &Request<B>) -> Response<Body> {
        let trusted = req
            .extensions()
            .get::<ConnInfo>()
            .is_some_and(|c| c.trusted);
        if !trusted {
            return text(
                StatusCode::FORBIDDEN,
                "the purge feed is served to --trusted-downstream peers only\n",
                None,
            );
        }
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            let allow = (header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "the purge feed is read-only\n",
                Some(allow),
            );
        }
        let subscribe = req
            .headers()
            .get("subscribe")
            .is_some_and(|v| braid::parse_subscribe(v.as_bytes()).unwrap_or(false));
        // The start and the current version, read under the log's lock.
        let (head, start, reset) = {
            let log = lock(&self.log);
            let head = *self.head.borrow();
            let first = log.entries.front().map_or(head + 1, |(seq, _)| *seq);
            let parents = req.headers().get("parents").map(At::of_header);
            match parents {
                None => (head, head, false),
                Some(Some(p)) if p.boot == self.boot && p.seq <= head && p.seq + 1 >= first => {
                    (head, p.seq, false)
                }
                Some(_) => (head, head, true),
            }
        };
        let current = HeaderValue::from_str(&self.at(head).version().to_header_value())
            .unwrap_or_else(|_| HeaderValue::from_static("\"\""));
        if !subscribe || *req.method() == Method::HEAD {
            return text(
                StatusCode::OK,
                "braid-proxy purge feed: GET with Subscribe: true (spec/tiers.md)\n",
                Some((header::HeaderName::from_static("current-version"), current)),
            );
        }
        if self.readers.fetch_add(1, Relaxed) >= MAX_READERS {
            self.readers.fetch_sub(1, Relaxed);
            let retry = (header::RETRY_AFTER, HeaderValue::from_static("5"));
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many purge feed subscribers\n",
                Some(retry),
            );
        }
        let reader = Reader(self.readers.clone());
        let heartbeat = req
            .headers()
            .get("heartbeats")
            .and_then(|v| braid::parse_heartbeats(v.as_bytes()).ok())
            .filter(|d| !d.is_zero())
            .unwrap_or(DEFAULT_HEARTBEAT)
            .clamp(Duration::from_secs(1), Duration::from_secs(60));
        let first = reset.then(|| {
            braid::encode(&Update {
                status: None,
                version: self.at(head).version(),
                parents: VersionList::default(),
                body: braid::Body::Snapshot(Bytes::from(Purge::All.to_json())),
                extra_headers: Vec::new(),
            })
        });
        let body = self.stream(start, first, heartbeat, reader);
        let mut r = Response::new(body);
        *r.status_mut() = StatusCode::from_u16(209).unwrap_or(StatusCode::OK);
        let h = r.headers_mut();
        h.insert("subscribe", HeaderValue::from_static("true"));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        h.insert("current-version", current);
        if let Ok(v) = HeaderValue::from_str(&format!("{}s", heartbeat.as_secs())) {
            h.insert("heartbeats", v);
        }
        r
    }

    /// A subscriber's stream from `start`: `first` (a reset) if any, then
    /// every update published after `start`, heartbeats while there is
    /// none; it ends when the proxy shuts down or the subscriber fell
    /// behind the window (it resumes with `Parents` and gets a reset).
    fn stream(
        self: &Arc<Self>,
        start: u64,
        first: Option<Bytes>,
        heartbeat: Duration,
        reader: Reader,
    ) -> Body {
        struct State {
            purges: Arc<Purges>,
            at: u64,
            first: Option<Bytes>,
            heads: watch::Receiver<u64>,
            closing: watch::Receiver<bool>,
            heartbeat: Duration,
            _reader: Reader,
        }
        let state = State {
            purges: self.clone(),
            at: start,
            first,
            heads: self.head.subscribe(),
            closing: self.closing.clone(),
            heartbeat,
            _reader: reader,
        };
        let stream = futures_util::stream::unfold(state, |mut s| async move {
            if let Some(bytes) = s.first.take() {
                return Some((Ok(bytes), s));
            }
            loop {
                if *s.closing.borrow() {
                    return None;
                }
                // Marked seen before looking, so that a publish between the
                // look and the wait still wakes this subscriber.
                s.heads.borrow_and_update();
                match s.purges.after(s.at) {
                    Ok(Some((bytes, end))) => {
                        s.at = end;
                        return Some((Ok(bytes), s));
                    }
                    Ok(None) => {}
                    Err(()) => return None,
                }
                tokio::select! {
                    changed = s.heads.changed() => {
                        if changed.is_err() {
                            return None;
                        }
                    }
                    _ = s.closing.changed() => {}
                    _ = tokio::time::sleep(s.heartbeat) => {
                        return Some((Ok(braid::encode_heartbeat()), s));
                    }
                }
            }
        });
        use futures_util::StreamExt;
        let frames = stream
            .map(|bytes: Result<Bytes, BoxError>| bytes.map(|b| Frame::data(Chunk::plain(b))));
        http_body_util::StreamBody::new(frames).boxed_unsync()
    }

    /// `/metrics` lines of the feed.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        let c = &self.counts;
        let lines: [(&str, &str, &str, u64); 6] = [
            ("purge_feed_published_total", "counter", "Purges and refreshes published on this proxy's purge feed.", c.published.load(Relaxed)),
            ("purge_feed_received_total", "counter", "Purges and refreshes received from the upstream's purge feed and applied.", c.received.load(Relaxed)),
            ("purge_feed_resyncs_total", "counter", "Times everything stored was purged because purges from the upstream may have been missed (first open, a restarted upstream, a resume point gone).", c.resyncs.load(Relaxed)),
            ("purge_feed_ignored_total", "counter", "Updates of the upstream's purge feed ignored as malformed.", c.ignored.load(Relaxed)),
            ("purge_feed_following", "gauge", "1 while this proxy follows its upstream's purge feed.", u64::from(c.following.load(Relaxed))),
            ("purge_feed_subscribers", "gauge", "Downstream tiers following this proxy's purge feed.", self.readers.load(Relaxed) as u64),
        ];
        for (name, kind, help, value) in lines {
            let _ = writeln!(
                out,
                "# HELP braid_proxy_{name} {help}\n# TYPE braid_proxy_{name} {kind}\nbraid_proxy_{name} {value}"
            );
        }
    }

    /// Follows the upstream's purge feed until the proxy shuts down,
    /// handing every purge to `apply` (see the module docs).
    /// `announced` turns true once an answer of the upstream named its
    /// purge feed (`--upstream-purges auto` waits for it).
    pub async fn follow(
        self: Arc<Self>,
        mut announced: watch::Receiver<bool>,
        apply: impl Fn(&Purge) + Send + Sync + 'static,
    ) {
        let mode = self.config.upstream_purges;
        let mut closing = self.closing.clone();
        match mode {
            UpstreamPurges::Off => return,
            UpstreamPurges::Follow => {}
            UpstreamPurges::Auto => {
                tokio::select! {
                    seen = announced.wait_for(|seen| *seen) => if seen.is_err() { return },
                    _ = closing.wait_for(|c| *c) => return,
                }
            }
        }
        let mut last: Option<At> = None;
        let mut wait = RETRY_FIRST;
        loop {
            if *closing.borrow() {
                return;
            }
            match self.open(last.as_ref()).await {
                Opened::Feed(response, current) => {
                    self.counts.following.store(true, Relaxed);
                    let clean = self.read(response, current, &mut last, &apply).await;
                    self.counts.following.store(false, Relaxed);
                    wait = if clean {
                        RETRY_FIRST
                    } else {
                        (wait * 2).min(RETRY_MAX)
                    };
                }
                Opened::NotAFeed(why) if mode == UpstreamPurges::Auto => {
                    info!(
                        "the upstream serves no purge feed ({why}): purges made above this proxy do not reach it; not asking again"
                    );
                    return;
                }
                Opened::NotAFeed(why) => {
                    warn!(
                        "the upstream's purge feed is not there ({why}); asking again in {wait:?}"
                    );
                    wait = (wait * 2).min(RETRY_MAX);
                }
                Opened::Failed(why) => {
                    debug!(
                        "the upstream's purge feed could not be opened ({why}); again in {wait:?}"
                    );
                    wait = (wait * 2).min(RETRY_MAX);
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = closing.wait_for(|c| *c) => return,
            }
        }
    }

    /// Asks the upstream for its feed, from `last` when there is one.
    async fn open(&self, last: Option<&At>) -> Opened {
        let Ok(uri) = feed_uri(self.client.upstream()) else {
            return Opened::NotAFeed("no URL for it".into());
        };
        let mut req = Request::new(body::empty());
        *req.uri_mut() = uri;
        let h = req.headers_mut();
        h.insert("subscribe", HeaderValue::from_static("true"));
        if let Ok(v) = HeaderValue::from_str(&format!("{}s", FOLLOWER_HEARTBEAT.as_secs())) {
            h.insert("heartbeats", v);
        }
        if let Some(at) = last {
            if let Ok(v) = HeaderValue::from_str(&at.version().to_header_value()) {
                h.insert("parents", v);
            }
        }
        upstream::append_via(h, http::Version::HTTP_11, &self.config.proxy_id);
        let response = match self.client.send_watch(req).await {
            Ok(response) => response,
            Err(refusal) => return Opened::Failed(refusal.to_string()),
        };
        let status = response.status();
        match status.as_u16() {
            209 => {}
            // A balancer in front of tiers that are not up yet.
            502..=504 => return Opened::Failed(format!("status {status}")),
            _ => return Opened::NotAFeed(format!("status {status}")),
        }
        let current = response
            .headers()
            .get("current-version")
            .and_then(At::of_header);
        let Some(current) = current else {
            return Opened::NotAFeed("a 209 without a purge feed's Current-Version".into());
        };
        Opened::Feed(response, current)
    }

    /// Reads one feed stream (its `Current-Version` is `current`) until it
    /// ends; true when it ended cleanly (the upstream closed it), false
    /// when it broke, went silent or carried an update that does not frame.
    async fn read(
        &self,
        response: Response<hyper::body::Incoming>,
        current: At,
        last: &mut Option<At>,
        apply: &(impl Fn(&Purge) + Send + Sync),
    ) -> bool {
        let silence = response
            .headers()
            .get("heartbeats")
            .and_then(|v| braid::parse_heartbeats(v.as_bytes()).ok())
            .filter(|d| !d.is_zero())
            .map_or(Duration::from_secs(300), |d| d * 2 + Duration::from_secs(2));
        if last.is_none() {
            // Whatever is stored came from an upstream this proxy was not
            // following yet.
            self.resync(apply, "the feed opened for the first time");
            *last = Some(current);
        }
        let mut decoder = Decoder::new(DecodeLimits {
            max_header_block: MAX_UPDATE_HEAD,
            max_content_length: MAX_UPDATE_BYTES,
            max_patches: 1,
        });
        let mut closing = self.closing.clone();
        let mut body = response.into_body();
        loop {
            let frame = tokio::select! {
                frame = tokio::time::timeout(silence, body.frame()) => frame,
                _ = closing.wait_for(|c| *c) => return true,
            };
            let data = match frame {
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => data,
                    Err(_) => continue,
                },
                Ok(None) => return true,
                Ok(Some(Err(e))) => {
                    debug!(error = %e, "the upstream's purge feed broke; resuming");
                    return false;
                }
                Err(_) => {
                    warn!("the upstream's purge feed went silent for {silence:?}; resuming");
                    return false;
                }
            };
            decoder.push(&data);
            loop {
                match decoder.next_update() {
                    Ok(Some(update)) => {
                        if !self.take(update, last, apply) {
                            return false;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.counts.ignored.fetch_add(1, Relaxed);
                        warn!(error = %e, "the upstream's purge feed sent an update that does not frame; resuming from the last good one");
                        return false;
                    }
                }
            }
        }
    }

    /// Applies one update of the upstream's feed; false when its version
    /// is not a feed version (the stream is then resumed from `last`).
    fn take(
        &self,
        update: Update,
        last: &mut Option<At>,
        apply: &(impl Fn(&Purge) + Send + Sync),
    ) -> bool {
        let Some(version) = At::of_list(&update.version) else {
            self.counts.ignored.fetch_add(1, Relaxed);
            warn!(
                version = %update.version.to_header_value(),
                "an update of the upstream's purge feed has no feed version; resuming from the last good one"
            );
            return false;
        };
        let follows = last
            .as_ref()
            .is_some_and(|l| At::of_list(&update.parents).is_some_and(|p| p == *l));
        if !follows {
            self.resync(
                apply,
                "the upstream's feed does not continue from the version applied last",
            );
        }
        *last = Some(version);
        let purge = match (&update.status, &update.body) {
            (None | Some(200), braid::Body::Snapshot(body)) => Purge::from_json(body),
            _ => Err("not a snapshot update".into()),
        };
        match purge.map(|p| p.below_prefix(&self.client.upstream().prefix)) {
            Ok(Some(Purge::All)) if !follows => {}
            Ok(Some(purge)) => {
                self.counts.received.fetch_add(1, Relaxed);
                debug!(?purge, "purge from the upstream's feed");
                apply(&purge);
            }
            Ok(None) => {}
            Err(why) => {
                self.counts.ignored.fetch_add(1, Relaxed);
                warn!("ignored an update of the upstream's purge feed: {why}");
            }
        }
        true
    }

    /// Purges everything stored, as purges may have been missed.
    fn resync(&self, apply: &(impl Fn(&Purge) + Send + Sync), why: &str) {
        self.counts.resyncs.fetch_add(1, Relaxed);
        info!("purging everything stored: {why}");
        apply(&Purge::All);
    }
}

/// Where the upstream serves its feed: at its root, not under its prefix;
/// by its scheme, so that an https upstream without a port is asked on 443.
fn feed_uri(upstream: &crate::config::Upstream) -> Result<http::Uri, http::Error> {
    http::Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(FEED_PATH)
        .build()
}

/// How asking for the upstream's feed went.
enum Opened {
    /// The feed's stream and the version it is at.
    Feed(Response<hyper::body::Incoming>, At),
    /// An answer that is not a purge feed.
    NotAFeed(String),
    /// No answer, or a gateway's error: ask again later.
    Failed(String),
}

/// The feed's own short answers: a line of text, never stored, and one
/// more header when given.
fn text(
    status: StatusCode,
    line: &'static str,
    extra: Option<(header::HeaderName, HeaderValue)>,
) -> Response<Body> {
    let mut r = Response::new(body::full(line));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some((name, value)) = extra {
        h.insert(name, value);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn purges_round_trip_and_bad_bodies_are_errors() {
        for purge in [
            Purge::Path("/a?b=c".into()),
            Purge::Tag("news sport".into()),
            Purge::Refresh("/x".into()),
            Purge::All,
        ] {
            assert_eq!(Purge::from_json(purge.to_json().as_bytes()), Ok(purge));
        }
        for bad in [
            &b""[..],
            b"null",
            b"[1]",
            b"{\"action\":\"explode\",\"path\":\"/a\"}",
            b"{\"action\":\"purge\"}",
            b"{\"action\":\"purge\",\"path\":\"/a\",\"tag\":\"t\"}",
            b"{\"action\":\"purge\",\"path\":\"a\"}",
            b"{\"action\":\"purge\",\"path\":\"/a\\nb\"}",
            b"{\"action\":\"purge\",\"tag\":\"  \"}",
            b"{\"action\":\"refresh\",\"tag\":\"t\"}",
            b"\xff\xfe",
        ] {
            assert!(Purge::from_json(bad).is_err(), "{bad:?}");
        }
        let long = format!("{{\"action\":\"purge\",\"tag\":\"{}\"}}", "t".repeat(5000));
        assert!(Purge::from_json(long.as_bytes()).is_err());
        let extra = b"{\"action\":\"purge\",\"tag\":\"t\",\"later\":1}";
        assert_eq!(Purge::from_json(extra), Ok(Purge::Tag("t".into())));
    }

    #[test]
    fn versions_name_a_boot_and_a_number() {
        let at = At::parse("0a1b-17").expect("parses");
        assert_eq!((at.boot.as_str(), at.seq), ("0a1b", 17));
        assert_eq!(at.id(), "0a1b-17");
        for bad in ["17", "-17", "ab-", "ab-x", "a b-1", "ab-+1", "ab--1", ""] {
            assert!(At::parse(bad).is_none(), "{bad}");
        }
        assert_ne!(boot_id(), boot_id());
    }

    #[test]
    fn the_feed_is_asked_at_the_upstreams_root_by_its_scheme() {
        for (upstream, feed) in [
            (
                "http://shield:8080/api",
                "http://shield:8080/.well-known/braid-proxy/purges",
            ),
            (
                "https://shield/api",
                "https://shield/.well-known/braid-proxy/purges",
            ),
        ] {
            let upstream = crate::config::Upstream::parse(upstream).expect("upstream");
            assert_eq!(feed_uri(&upstream).expect("uri").to_string(), feed);
        }
    }

    #[test]
    fn paths_are_taken_out_of_the_upstreams_prefix() {
        let p = |s: &str| Purge::Path(s.into());
        assert_eq!(p("/api/a").below_prefix("/api"), Some(p("/a")));
        assert_eq!(p("/api").below_prefix("/api"), Some(p("/")));
        assert_eq!(p("/api?x").below_prefix("/api"), Some(p("/?x")));
        assert_eq!(p("/apix/a").below_prefix("/api"), None);
        assert_eq!(p("/other").below_prefix("/api"), None);
        assert_eq!(p("/a").below_prefix(""), Some(p("/a")));
        let t = Purge::Tag("t".into());
        assert_eq!(t.clone().below_prefix("/api"), Some(t));
    }
}
