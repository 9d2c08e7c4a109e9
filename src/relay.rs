//! Relaying a Braid upstream: the proxy as a wire that fans out.
//!
//! A client's subscription request is sent upstream as the client made it
//! (its end-to-end and Braid request headers, plus `Via` and
//! `X-Forwarded-*`). A 209 opens a [`Session`]: its status line and headers
//! are relayed at once, and every update of its body is kept as received
//! (framed by [`braid::Framer`], indexed by the `Version` the upstream
//! gave it) in the session's window and sent byte for byte to each
//! subscriber. A later request joins a live session only when it is
//! equivalent (same [`relay key`](relay_key): variant, `Accept`,
//! credentials, Braid request headers) and the window holds where it
//! starts: the whole stream for a request like the opener's, or the
//! update whose `Version` is its `Parents`. Anything else opens its own.
//!
//! The lifecycle is the upstream's: when the upstream stream ends, breaks,
//! or its heartbeats stop, the session ends and so do its subscribers'
//! streams (after what the window still had for them); clients resume with
//! `Parents`. When the last subscriber leaves, the upstream subscription is
//! closed at once. Any answer but 209 reaches the client as the upstream
//! gave it, except that, while the upstream's kind is not known yet, a 200
//! without any Braid header shows a plain origin, which the router then
//! polls ([`crate::upstream`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU8, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{header, HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;
use tokio::sync::{watch, Notify};
use tracing::debug;

use crate::body::{Body, Chunk, RequestBody};
use crate::braid::{self, Framer, Piece, VersionList};
use crate::cache::Timing;
use crate::config::{Config, UpstreamKind};
use crate::direct;
use crate::error::Refusal;
use crate::metrics::Metrics;
use crate::proxy::{self, UpstreamClient};
use crate::resource::Key;
use crate::subscribe::BraidRequest;

/// The relays of one proxy: its live sessions and what it knows of its upstream.
pub struct Relays {
    client: UpstreamClient,
    config: Config,
    metrics: Arc<Metrics>,
    /// The kind learned in `auto` mode (see [`Learned`]).
    learned: AtomicU8,
    sessions: Mutex<HashMap<String, Vec<Arc<Session>>>>,
    /// Bytes held by all sessions' windows, bounded by `--history-bytes`.
    window_bytes: AtomicUsize,
    closing: watch::Receiver<bool>,
}

/// What `auto` learned: nothing yet, a Braid upstream, or a plain one.
#[repr(u8)]
enum Learned {
    Nothing = 0,
    Braid = 1,
    Rest = 2,
}

/// How a subscription request was answered.
pub enum Relayed {
    /// The answer for the client: a relayed 209, or the upstream's other answer.
    Answer(Response<Body>),
    /// A plain origin answered (kind not known before): the router serves
    /// the subscription from this answer and polls from then on.
    Plain {
        /// The identity headers of the request, for the resource's watcher.
        template: HeaderMap,
        response: Response<Incoming>,
        timing: Timing,
    },
    /// An equivalent request just found a plain origin: serve this one
    /// from the polled resource too, without a request of its own.
    Poll {
        /// The identity headers of the request, for the resource's watcher.
        template: HeaderMap,
    },
}

/// One upstream subscription and everything it sent.
pub struct Session {
    key: String,
    /// The `Parents` the opening request carried.
    opened_with: Option<VersionList>,
    /// The 209's status line and headers, once it came.
    head: Mutex<Option<RelayedHead>>,
    /// The opener's request as sent upstream, for a resume (`--hold-upstream-breaks`).
    request: Mutex<Option<(http::Uri, HeaderMap)>>,
    window: Mutex<Window>,
    tick: watch::Sender<Tick>,
    subscribers: AtomicUsize,
    /// Woken when a subscriber leaves.
    left: Notify,
    /// Its parked HTTP/1.1 subscribers, written to directly ([`direct`]).
    direct: Arc<direct::Parked>,
}

#[derive(Clone)]
struct RelayedHead {
    status: StatusCode,
    reason: Option<hyper::ext::ReasonPhrase>,
    headers: HeaderMap,
}

/// The updates a session received, oldest first, bounded in count and bytes.
#[derive(Default)]
struct Window {
    /// Sequence number of `entries[0]`; entries count from 0 for the stream's first.
    first: u64,
    entries: VecDeque<Entry>,
    bytes: usize,
    /// Entries that are updates (not blank lines).
    updates: usize,
    /// Set once a part of the stream could not be framed: nobody joins any more.
    opaque: bool,
    /// Blank lines framed since the newest update.
    blanks_since_update: usize,
    /// How many blank lines the upstream writes after an update, as it did
    /// after the one before the newest; `None` before that is known.
    blanks_after_updates: Option<usize>,
    /// An update was framed.
    seen_update: bool,
}

/// The blank lines braid-http's server writes after every update, expected
/// after an upstream's first update (the next ones expect what it did).
const USUAL_BLANKS_AFTER_UPDATE: usize = 2;

impl Window {
    /// Learns how many blank lines the upstream writes after an update.
    fn framed(&mut self, update: bool) {
        if !update {
            self.blanks_since_update += 1;
            return;
        }
        if self.seen_update {
            self.blanks_after_updates = Some(self.blanks_since_update);
        }
        self.seen_update = true;
        self.blanks_since_update = 0;
    }

    /// Whether the newest update still lacks blank lines its upstream
    /// usually writes after it.
    fn lacks_blank_lines(&self) -> bool {
        self.blanks_since_update
            < self
                .blanks_after_updates
                .unwrap_or(USUAL_BLANKS_AFTER_UPDATE)
    }
}

/// Bytes of the stream as received: one update, a blank line, or (once
/// unframeable) a chunk.
struct Entry {
    raw: Bytes,
    version: Option<VersionList>,
    /// A blank line (heartbeat): counted in bytes, not against `--history-len`.
    blank: bool,
}

/// How long a session whose opener found a plain origin stays findable,
/// for requests already on their way (later ones see the learned kind).
const PLAIN_LINGER: Duration = Duration::from_secs(2);

/// How long an update waits for the blank lines its upstream usually
/// writes after it, when they did not come in the same read.
const BLANK_LINES_WAIT: Duration = Duration::from_millis(20);

/// What a blank entry costs in the window's byte count, beyond its bytes.
const BLANK_OVERHEAD: usize = 64;

/// What subscribers watch: how far the stream got and whether it ended.
#[derive(Debug, Clone, Default)]
struct Tick {
    /// `None` while the upstream has not answered; `Some(true)` once it answered 209.
    opened: Option<bool>,
    /// Sequence number after the newest entry.
    end: u64,
    ended: bool,
    /// The opener's answer showed a plain origin: the resource is polled.
    plain: bool,
}

/// Why an upstream stream is over.
enum Over {
    Ended,
    Broken(String),
    Silent(Duration),
    NoSubscribers,
    Closing,
}

impl Relays {
    pub fn new(
        client: UpstreamClient,
        config: Config,
        metrics: Arc<Metrics>,
        closing: watch::Receiver<bool>,
    ) -> Relays {
        Relays {
            client,
            config,
            metrics,
            learned: AtomicU8::new(Learned::Nothing as u8),
            sessions: Mutex::default(),
            window_bytes: AtomicUsize::new(0),
            closing,
        }
    }

    /// Whether subscriptions go to the relay (the upstream is not known to be plain).
    pub fn relays(&self) -> bool {
        match self.config.upstream_kind {
            UpstreamKind::Braid => true,
            UpstreamKind::Rest => false,
            UpstreamKind::Auto => self.learned.load(Relaxed) != Learned::Rest as u8,
        }
    }

    /// Whether the upstream is known to speak Braid.
    pub fn is_braid(&self) -> bool {
        match self.config.upstream_kind {
            UpstreamKind::Braid => true,
            UpstreamKind::Rest => false,
            UpstreamKind::Auto => self.learned.load(Relaxed) == Learned::Braid as u8,
        }
    }

    /// Live sessions (each is one open upstream subscription or one being opened).
    pub fn sessions(&self) -> usize {
        lock(&self.sessions).values().map(Vec::len).sum()
    }

    /// Learns from any upstream answer (a plain GET's too) that the
    /// upstream speaks Braid, when it carries a Braid header.
    pub fn observe(&self, headers: &HeaderMap) {
        if self.config.upstream_kind == UpstreamKind::Auto && braid_signs(headers) {
            self.learn(Learned::Braid);
        }
    }

    fn learn(&self, what: Learned) {
        let _ = self
            .learned
            .compare_exchange(Learned::Nothing as u8, what as u8, Relaxed, Relaxed);
    }

    /// Answers a subscription request: joins an equivalent live session
    /// whose window holds where it starts, or sends it upstream.
    pub async fn subscribe(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        braid: &BraidRequest,
        key: &Key,
    ) -> Result<Relayed, Refusal> {
        let rkey = relay_key(key, req.headers());
        let deadline = tokio::time::Instant::now() + self.config.response_timeout;
        // Let the I/O that is already in (such as the close of a client
        // that left just before this request came) be processed first, so
        // that a session whose last subscriber has gone is not joined.
        tokio::task::yield_now().await;
        loop {
            let (session, opener) = self.find_or_open(&rkey, braid);
            if opener {
                return self.open(req, session).await;
            }
            // Wait (bounded) for the session being opened to answer.
            let mut tick = session.tick.subscribe();
            let opened = tokio::time::timeout_at(deadline, async {
                loop {
                    if let Some(opened) = tick.borrow_and_update().opened {
                        return opened;
                    }
                    if tick.changed().await.is_err() {
                        return false;
                    }
                }
            })
            .await
            .unwrap_or(false);
            if !opened && tick.borrow().plain {
                let template = proxy::watcher_template(&req, &self.config);
                return Ok(Relayed::Poll { template });
            }
            if opened {
                if let Some(start) = self.join(&session, braid) {
                    return Ok(Relayed::Answer(self.respond(session, start)?));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                // The session being opened never answered: ask on our own.
                let session = self.register(&rkey, braid);
                return self.open(req, session).await;
            }
        }
    }

    /// An equivalent session to join, or a new one this request opens (true).
    /// Looks and registers under one lock, so that two first requests
    /// arriving together open one session, not two.
    fn find_or_open(&self, rkey: &str, braid: &BraidRequest) -> (Arc<Session>, bool) {
        let mut sessions = lock(&self.sessions);
        if let Some(list) = sessions.get(rkey) {
            for s in list {
                let tick = s.tick.borrow();
                if tick.plain {
                    // Its opener found a plain origin: served from the polled resource.
                    return (s.clone(), false);
                }
                if tick.ended || tick.opened == Some(false) || s.deserted(&tick) {
                    continue;
                }
                if tick.opened.is_none() || s.start_for(braid).is_some() {
                    return (s.clone(), false);
                }
            }
        }
        let session = Self::new_session(rkey, braid);
        sessions
            .entry(rkey.to_string())
            .or_default()
            .push(session.clone());
        (session, true)
    }

    fn register(&self, rkey: &str, braid: &BraidRequest) -> Arc<Session> {
        let session = Self::new_session(rkey, braid);
        lock(&self.sessions)
            .entry(rkey.to_string())
            .or_default()
            .push(session.clone());
        session
    }

    fn new_session(rkey: &str, braid: &BraidRequest) -> Arc<Session> {
        Arc::new(Session {
            key: rkey.to_string(),
            opened_with: braid.parents.clone().filter(|p| !p.is_empty()),
            head: Mutex::new(None),
            request: Mutex::new(None),
            window: Mutex::default(),
            tick: watch::channel(Tick::default()).0,
            subscribers: AtomicUsize::new(0),
            left: Notify::new(),
            direct: Arc::default(),
        })
    }

    fn unregister(&self, session: &Arc<Session>) {
        let mut sessions = lock(&self.sessions);
        if let Some(list) = sessions.get_mut(&session.key) {
            list.retain(|s| !Arc::ptr_eq(s, session));
            if list.is_empty() {
                sessions.remove(&session.key);
            }
        }
    }

    /// Adds a subscriber to a live session at the place its request starts
    /// from, if the window holds it.
    fn join(&self, session: &Arc<Session>, braid: &BraidRequest) -> Option<u64> {
        let _sessions = lock(&self.sessions);
        let tick = session.tick.borrow();
        if tick.ended || session.deserted(&tick) {
            return None;
        }
        drop(tick);
        let start = session.start_for(braid)?;
        session.subscribers.fetch_add(1, Relaxed);
        Some(start)
    }

    /// Sends the opener's request upstream and relays the answer.
    async fn open(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        session: Arc<Session>,
    ) -> Result<Relayed, Refusal> {
        let template = proxy::watcher_template(&req, &self.config);
        // Should this request be cancelled (its client gone) before the
        // upstream answers, the session must not stay pending.
        let _pending = Pending {
            relays: self,
            session: session.clone(),
        };
        let failed = |this: &Self| {
            session.tick.send_modify(|t| t.opened = Some(false));
            this.unregister(&session);
        };
        let out = match proxy::upstream_request(req, &self.client, &self.config) {
            Ok(out) => out,
            Err(refusal) => {
                failed(self);
                return Err(refusal);
            }
        };
        *lock(&session.request) = Some((out.uri().clone(), out.headers().clone()));
        let sent = SystemTime::now();
        let response = match self.client.send_watch(out).await {
            Ok(response) => response,
            Err(refusal) => {
                failed(self);
                return Err(refusal);
            }
        };
        let status = response.status();
        let braid_signs = braid_signs(response.headers());
        if status.as_u16() == 209 {
            self.learn(Learned::Braid);
        } else {
            if braid_signs {
                self.learn(Learned::Braid);
            }
            // Not known to be Braid: a plain answer (200, or 404/410 for
            // a resource that does not exist yet) from what must be a plain
            // origin is the first state of a polled resource. Only a 200
            // teaches the kind: a Braid server's 404 may carry no Braid header.
            let plain = !braid_signs
                && matches!(status.as_u16(), 200 | 404 | 410)
                && !self.is_braid()
                && self.config.upstream_kind == UpstreamKind::Auto;
            if plain && status == StatusCode::OK {
                debug!("upstream answered Subscribe with a plain 200: polling it");
                self.learn(Learned::Rest);
            }
            // Waiting equivalent requests learn it with the failure: set first.
            session.tick.send_modify(|t| t.plain = plain);
            if !plain {
                failed(self);
                return Ok(Relayed::Answer(proxy::downstream_response(
                    response,
                    &self.config,
                )));
            }
            // Requests already on their way to the relay find it for a
            // moment longer, and are served from the polled resource this
            // answer seeds, without requests of their own.
            session.tick.send_modify(|t| t.opened = Some(false));
            let (relays, gone) = (self.clone(), session.clone());
            tokio::spawn(async move {
                tokio::time::sleep(PLAIN_LINGER).await;
                relays.unregister(&gone);
            });
            let timing = Timing {
                request_time: sent,
                response_time: SystemTime::now(),
            };
            return Ok(Relayed::Plain {
                template,
                response,
                timing,
            });
        }
        let (mut parts, body) = response.into_parts();
        proxy::strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::CONTENT_LENGTH);
        proxy::append_via(&mut parts.headers, parts.version, &self.config.proxy_id);
        let silence = silence_limit(&parts.headers);
        *lock(&session.head) = Some(RelayedHead {
            status: parts.status,
            reason: parts.extensions.get::<hyper::ext::ReasonPhrase>().cloned(),
            headers: parts.headers,
        });
        session.subscribers.fetch_add(1, Relaxed);
        session.tick.send_modify(|t| t.opened = Some(true));
        self.metrics.upstream_subscriptions.fetch_add(1, Relaxed);
        tokio::spawn(self.clone().read(session.clone(), body, silence));
        Ok(Relayed::Answer(self.respond(session, 0)?))
    }

    /// Reads the upstream body into the session's window until it is over;
    /// with `--hold-upstream-breaks`, first tries (for that long) to resume
    /// an ended or broken stream from the last version the upstream sent.
    async fn read(
        self: Arc<Self>,
        session: Arc<Session>,
        mut body: Incoming,
        mut silence: Option<Duration>,
    ) {
        let over = loop {
            let over = self.follow(&session, body, silence).await;
            if !matches!(over, Over::Ended | Over::Broken(_) | Over::Silent(_))
                || self.config.hold_upstream_breaks.is_zero()
            {
                break over;
            }
            debug!(
                session = session.key,
                why = over.describe(),
                "holding downstream streams; resuming upstream"
            );
            match self.resume(&session).await {
                Some((next, next_silence)) => {
                    Metrics::inc(&self.metrics.upstream_reconnects_total);
                    body = next;
                    silence = next_silence;
                }
                None => break over,
            }
        };
        debug!(
            session = session.key,
            why = over.describe(),
            "upstream subscription over"
        );
        self.metrics.upstream_subscriptions.fetch_sub(1, Relaxed);
        {
            let _sessions = lock(&self.sessions);
            session.tick.send_modify(|t| t.ended = true);
        }
        // Parked subscribers go back to their tasks, which send what is
        // left and end.
        session.direct.close();
        self.unregister(&session);
        // Subscribers still draining keep reading it; its bytes no longer count.
        lock(&session.window).release(&self.window_bytes);
    }

    /// Reads one upstream stream into the session's window.
    async fn follow(
        &self,
        session: &Session,
        mut body: Incoming,
        silence: Option<Duration>,
    ) -> Over {
        let mut framer = Framer::new(self.config.max_body_bytes + 64 * 1024);
        let mut closing = self.closing.clone();
        let mut heard = tokio::time::Instant::now();
        loop {
            let quiet = async {
                match silence {
                    Some(limit) => tokio::time::sleep_until(heard + limit).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                frame = body.frame() => match frame {
                    None => return Over::Ended,
                    Some(Err(e)) => return Over::Broken(e.to_string()),
                    Some(Ok(frame)) => {
                        heard = tokio::time::Instant::now();
                        let mut over = self.take(session, &mut framer, frame, &mut body);
                        // An upstream that writes its update and each blank
                        // line after it apart (braid-http's server does:
                        // one HTTP chunk each, and the client hands over one
                        // chunk at a time) may have them read apart: wait a
                        // little for as many as it wrote after the update
                        // before, so that they go out together (a client may
                        // take the update as complete before blank lines
                        // sent apart arrive).
                        let deadline = tokio::time::Instant::now() + BLANK_LINES_WAIT;
                        while over.is_none() && Self::awaits_blank_lines(session) {
                            over = match tokio::time::timeout_at(deadline, body.frame()).await {
                                Err(_) => break,
                                Ok(None) => Some(Over::Ended),
                                Ok(Some(Err(e))) => Some(Over::Broken(e.to_string())),
                                Ok(Some(Ok(frame))) => self.take(session, &mut framer, frame, &mut body),
                            };
                        }
                        Self::announce(session);
                        if let Some(over) = over {
                            return over;
                        }
                    }
                },
                _ = quiet => return Over::Silent(silence.unwrap_or_default()),
                _ = session.left.notified() => {
                    if self.none_left(session) {
                        return Over::NoSubscribers;
                    }
                }
                _ = closing.changed() => return Over::Closing,
            }
        }
    }

    /// Frames `frame` and every frame the same read brought (hyper yields
    /// one frame per HTTP chunk), so that subscribers hear of them at once;
    /// `Some` when the stream ended among them.
    fn take(
        &self,
        session: &Session,
        framer: &mut Framer,
        frame: Frame<Bytes>,
        body: &mut Incoming,
    ) -> Option<Over> {
        if let Ok(data) = frame.into_data() {
            self.absorb(session, framer, &data);
        }
        for _ in 0..64 {
            match futures_util::FutureExt::now_or_never(body.frame())? {
                None => return Some(Over::Ended),
                Some(Err(e)) => return Some(Over::Broken(e.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.absorb(session, framer, &data);
                    }
                }
            }
        }
        None
    }

    /// Whether the newest entry is an update subscribers have not heard of
    /// yet that lacks blank lines its upstream usually writes after one.
    fn awaits_blank_lines(session: &Session) -> bool {
        let announced = session.tick.borrow().end;
        let window = lock(&session.window);
        window.lacks_blank_lines()
            && !window.opaque
            && window.entries.back().is_some_and(|e| !e.blank)
            && window.first + window.entries.len() as u64 > announced
    }

    /// True (and the session ended) when its last subscriber has left;
    /// decided under the lock a joiner takes, so none comes in between.
    fn none_left(&self, session: &Session) -> bool {
        let _sessions = lock(&self.sessions);
        let none = session.subscribers.load(Relaxed) == 0;
        if none {
            session.tick.send_modify(|t| t.ended = true);
        }
        none
    }

    /// Asks the upstream again, with the opener's request and `Parents` =
    /// the last version the upstream sent, until it answers 209 or
    /// `--hold-upstream-breaks` has passed. `None` when it cannot resume
    /// (no version to resume from, a stream it could not frame, refusals).
    async fn resume(&self, session: &Session) -> Option<(Incoming, Option<Duration>)> {
        let deadline = tokio::time::Instant::now() + self.config.hold_upstream_breaks;
        let (uri, mut headers) = lock(&session.request).clone()?;
        let parents = {
            let window = lock(&session.window);
            if window.opaque {
                return None;
            }
            window
                .entries
                .iter()
                .rev()
                .find_map(|e| e.version.clone().filter(|v| !v.is_empty()))?
        };
        headers.insert(
            "parents",
            http::HeaderValue::from_str(&parents.to_header_value()).ok()?,
        );
        let mut wait = Duration::from_millis(100);
        let mut closing = self.closing.clone();
        while tokio::time::Instant::now() < deadline {
            let mut req = Request::new(crate::body::empty());
            *req.uri_mut() = uri.clone();
            *req.headers_mut() = headers.clone();
            let answer = tokio::time::timeout_at(deadline, self.client.send_watch(req)).await;
            if let Ok(Ok(response)) = answer {
                if response.status().as_u16() == 209 {
                    let silence = silence_limit(response.headers());
                    return Some((response.into_body(), silence));
                }
                if response.status().is_client_error() {
                    return None;
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(wait.min(deadline - tokio::time::Instant::now())) => {}
                _ = session.left.notified() => {
                    if self.none_left(session) {
                        return None;
                    }
                }
                _ = closing.changed() => return None,
            }
            wait = (wait * 2).min(Duration::from_secs(2));
        }
        None
    }

    /// Frames new bytes into the window; what cannot be framed is kept unframed.
    fn absorb(&self, session: &Session, framer: &mut Framer, data: &[u8]) {
        let mut window = lock(&session.window);
        if window.opaque {
            window.push(
                Entry {
                    raw: Bytes::copy_from_slice(data),
                    version: None,
                    blank: false,
                },
                &self.config,
                &self.window_bytes,
            );
        } else {
            framer.push(data);
            // Blank lines that come in the same read as the update before
            // them stay with it (an update subscribers have not heard of
            // yet), so that what the upstream wrote together goes out
            // together: a client may take an update as complete before
            // blank lines sent apart arrive.
            let announced = session.tick.borrow().end;
            let mut after_update = window.entries.back().is_some_and(|e| !e.blank)
                && window.first + window.entries.len() as u64 > announced;
            loop {
                let entry = match framer.next_piece() {
                    Ok(None) => break,
                    Ok(Some(Piece::Blank(raw))) if after_update => {
                        window.framed(false);
                        window.extend_last(&raw, &self.window_bytes);
                        continue;
                    }
                    Ok(Some(Piece::Blank(raw))) => {
                        window.framed(false);
                        Entry {
                            raw,
                            version: None,
                            blank: true,
                        }
                    }
                    Ok(Some(Piece::Update(update))) => {
                        window.framed(true);
                        Metrics::inc(&self.metrics.upstream_updates_total);
                        Entry {
                            raw: update.raw,
                            version: update.version,
                            blank: false,
                        }
                    }
                    Err(e) => {
                        debug!(session = session.key, error = %e, "passing the rest through unframed");
                        window.opaque = true;
                        Entry {
                            raw: framer.take_rest(),
                            version: None,
                            blank: false,
                        }
                    }
                };
                after_update = !entry.blank && !window.opaque;
                window.push(entry, &self.config, &self.window_bytes);
                if window.opaque {
                    break;
                }
            }
        }
    }

    /// Tells the subscribers how far the window goes now.
    fn announce(session: &Session) {
        let end = {
            let window = lock(&session.window);
            window.first + window.entries.len() as u64
        };
        if session
            .tick
            .send_if_modified(|t| std::mem::replace(&mut t.end, end) != end)
        {
            session.direct.published();
        }
    }

    /// The 209 for a subscriber starting at `start`.
    fn respond(&self, session: Arc<Session>, start: u64) -> Result<Response<Body>, Refusal> {
        let guard = Subscriber {
            session: session.clone(),
            metrics: self.metrics.clone(),
            opened: None,
        };
        let before = self.metrics.subscriptions.fetch_add(1, Relaxed);
        let busy = if before >= self.config.max_subscriptions as i64 {
            Some("on this proxy")
        } else if session.subscribers.load(Relaxed) > self.config.max_subscriptions_per_resource {
            Some("to this resource")
        } else {
            None
        };
        if let Some(what) = busy {
            Metrics::inc(&self.metrics.subscriptions_rejected_total);
            drop(guard);
            return Err(Refusal::Unavailable {
                reason: format!("too many subscriptions {what}; retry later"),
                retry_after: Duration::from_secs(5),
            });
        }
        Metrics::inc(&self.metrics.subscriptions_total);
        let head = lock(&session.head).clone().ok_or_else(|| {
            Refusal::UpstreamBroken("the upstream subscription has no head".into())
        })?;
        let tick = session.tick.subscribe();
        let mut guard = guard;
        guard.opened = Some(std::time::Instant::now());
        tracing::info!(target: "subscription", resource = guard.path(), relayed = true, "subscription open");
        let link = Arc::new(direct::Link::default());
        let handle = direct::Handle {
            source: Arc::new(SessionSource {
                session: Arc::downgrade(&session),
            }),
            parked: session.direct.clone(),
            link: link.clone(),
            metrics: self.metrics.clone(),
            heartbeat: None,
            closing: self.closing.clone(),
        };
        let cursor = Cursor {
            link,
            next: start,
            tick,
            closing: self.closing.clone(),
            metrics: self.metrics.clone(),
            guard,
        };
        let stream = futures_util::stream::unfold(cursor, Cursor::next);
        let mut response = Response::new(StreamBody::new(stream).boxed_unsync());
        response.extensions_mut().insert(handle);
        *response.status_mut() = head.status;
        *response.headers_mut() = head.headers;
        if let Some(reason) = head.reason {
            response.extensions_mut().insert(reason);
        }
        Ok(response)
    }
}

impl Over {
    fn describe(&self) -> String {
        match self {
            Over::Ended => "ended by the upstream".to_string(),
            Over::Broken(e) => format!("broken: {e}"),
            Over::Silent(d) => format!("no byte for {d:?} (heartbeats stopped)"),
            Over::NoSubscribers => "its last subscriber left".to_string(),
            Over::Closing => "the proxy shuts down".to_string(),
        }
    }
}

impl Session {
    /// Open, and every subscriber has left: it is closing upstream, and a
    /// new request opens its own (the upstream sees it, as it would
    /// without the proxy).
    fn deserted(&self, tick: &Tick) -> bool {
        tick.opened == Some(true) && self.subscribers.load(Relaxed) == 0
    }

    /// Where a request would start in this session's window, if it can join.
    fn start_for(&self, braid: &BraidRequest) -> Option<u64> {
        let window = lock(&self.window);
        if window.opaque {
            return None;
        }
        let parents = braid.parents.clone().filter(|p| !p.is_empty());
        if parents == self.opened_with && window.first == 0 {
            return Some(0);
        }
        let wanted = parents?;
        window
            .entries
            .iter()
            .enumerate()
            .rev()
            .find(|(_, e)| e.version.as_ref() == Some(&wanted))
            .map(|(i, _)| window.first + i as u64 + 1)
    }
}

impl Window {
    /// Appends an entry, dropping the oldest beyond `--history-len`
    /// updates, `--max-body-bytes` bytes, or while all windows together
    /// hold more than `--history-bytes` (the newest always stays).
    /// `total` counts the bytes of all windows.
    fn push(&mut self, entry: Entry, config: &Config, total: &AtomicUsize) {
        let weight = entry.weight();
        self.bytes += weight;
        total.fetch_add(weight, Relaxed);
        self.updates += usize::from(!entry.blank);
        self.entries.push_back(entry);
        let budget = usize::try_from(config.history_bytes).unwrap_or(usize::MAX);
        while self.entries.len() > 1
            && (self.updates > config.history_len.max(1)
                || self.bytes > config.max_body_bytes
                || total.load(Relaxed) > budget)
        {
            if let Some(old) = self.entries.pop_front() {
                self.bytes -= old.weight();
                total.fetch_sub(old.weight(), Relaxed);
                self.updates -= usize::from(!old.blank);
                self.first += 1;
            }
        }
    }

    /// Appends bytes to the newest entry (an update not yet visible to
    /// subscribers: the tick moves after the whole read is framed).
    fn extend_last(&mut self, more: &[u8], total: &AtomicUsize) {
        if let Some(last) = self.entries.back_mut() {
            let mut joined = Vec::with_capacity(last.raw.len() + more.len());
            joined.extend_from_slice(&last.raw);
            joined.extend_from_slice(more);
            last.raw = Bytes::from(joined);
            self.bytes += more.len();
            total.fetch_add(more.len(), Relaxed);
        }
    }

    /// Gives the window's bytes back to the total (the session is over).
    fn release(&mut self, total: &AtomicUsize) {
        total.fetch_sub(std::mem::take(&mut self.bytes), Relaxed);
    }
}

impl Entry {
    fn weight(&self) -> usize {
        self.raw.len() + if self.blank { BLANK_OVERHEAD } else { 0 }
    }
}

/// Fails a session still being opened when its opener goes away.
struct Pending<'a> {
    relays: &'a Relays,
    session: Arc<Session>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let cancelled = self.session.tick.send_if_modified(|t| {
            let pending = t.opened.is_none();
            if pending {
                t.opened = Some(false);
            }
            pending
        });
        if cancelled {
            self.relays.unregister(&self.session);
        }
    }
}

/// Holds a subscriber's place in its session; leaving wakes the reader.
struct Subscriber {
    session: Arc<Session>,
    metrics: Arc<Metrics>,
    /// Set once the subscription is accepted (and its open logged).
    opened: Option<std::time::Instant>,
}

impl Subscriber {
    /// The URL of the session's resource (the first line of its key).
    fn path(&self) -> &str {
        self.session.key.split('\n').next().unwrap_or_default()
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Some(opened) = self.opened {
            tracing::info!(
                target: "subscription",
                resource = self.path(),
                duration_ms = opened.elapsed().as_millis() as u64,
                relayed = true,
                "subscription closed"
            );
        }
        self.metrics.subscriptions.fetch_sub(1, Relaxed);
        self.session.subscribers.fetch_sub(1, Relaxed);
        self.session.left.notify_one();
    }
}

/// A relayed subscriber: the next entry it needs.
struct Cursor {
    /// Its position (the next entry) as direct delivery may advance it.
    link: Arc<direct::Link>,
    next: u64,
    tick: watch::Receiver<Tick>,
    closing: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    guard: Subscriber,
}

impl Cursor {
    async fn next(mut self) -> Option<(Result<Frame<Chunk>, crate::body::BoxError>, Cursor)> {
        loop {
            if *self.closing.borrow() {
                return None;
            }
            let advanced = self.link.at.load(Acquire);
            if advanced != direct::NONE {
                self.next = self.next.max(advanced);
            }
            let tick = self.tick.borrow_and_update().clone();
            if self.next < tick.end {
                let bytes = {
                    let window = lock(&self.guard.session.window);
                    if self.next < window.first {
                        // Fell out of the window: end; the client resumes with Parents.
                        return None;
                    }
                    let at = (self.next - window.first) as usize;
                    window.entries.get(at).map(|e| e.raw.clone())
                };
                let bytes = bytes?;
                self.next += 1;
                self.link.at.store(self.next, Release);
                Metrics::inc(&self.metrics.updates_sent_total);
                let chunk = Chunk::counted(bytes, &self.metrics);
                return Some((Ok(Frame::data(chunk)), self));
            }
            if tick.ended {
                return None;
            }
            tokio::select! {
                changed = self.tick.changed() => if changed.is_err() { return None },
                _ = self.closing.changed() => return None,
            }
        }
    }
}

/// A session as a source of direct delivery: positions are entry numbers,
/// and a subscriber is written the entries it lacks, as received.
struct SessionSource {
    session: std::sync::Weak<Session>,
}

impl direct::Source for SessionSource {
    fn head(&self) -> Option<u64> {
        let session = self.session.upgrade()?;
        let tick = session.tick.borrow();
        (!tick.ended).then_some(tick.end)
    }

    fn pass(&self) -> Option<Box<dyn direct::Pass>> {
        let session = self.session.upgrade()?;
        let end = {
            let tick = session.tick.borrow();
            if tick.ended {
                return None;
            }
            tick.end
        };
        Some(Box::new(RelayedPass {
            session,
            end,
            framed: Mutex::default(),
        }))
    }
}

/// One sweep of a session: the entries from each position laggards are at
/// to the announced end, joined in one chunk, built once per position.
struct RelayedPass {
    session: Arc<Session>,
    end: u64,
    /// `None`: the position fell out of the window (its task ends it).
    framed: Mutex<HashMap<u64, Option<(Bytes, u64)>>>,
}

impl direct::Pass for RelayedPass {
    fn head(&self) -> u64 {
        self.end
    }

    fn step(&self, at: u64) -> direct::Step {
        let (session, end) = (&self.session, self.end);
        let mut framed = lock(&self.framed);
        let framed = framed.entry(at).or_insert_with(|| {
            let window = lock(&session.window);
            let from = usize::try_from(at.checked_sub(window.first)?).ok()?;
            let to = usize::try_from(end - window.first).ok()?;
            let entries = window.entries.range(from..to.min(window.entries.len()));
            let count = entries.len() as u64;
            let joined: Vec<u8> = entries.flat_map(|e| e.raw.iter().copied()).collect();
            (!joined.is_empty()).then(|| (direct::chunk(&joined), count))
        });
        match framed {
            Some((chunk, updates)) => direct::Step::Write {
                chunk: chunk.clone(),
                updates: *updates,
                snapshot: false,
            },
            None => direct::Step::HandBack,
        }
    }
}

/// How long a 209 stream may send nothing before it counts as silent:
/// from the `Heartbeats` its head announced, later than braid-http's client
/// gives up (1.2 × N + 3 s without a byte), so that its own timer tells it.
fn silence_limit(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("heartbeats")
        .and_then(|v| braid::parse_heartbeats(v.as_bytes()).ok())
        .filter(|d| !d.is_zero())
        .map(|d| d * 2 + Duration::from_secs(5))
}

/// Whether an answer carries a header only a Braid server sends.
fn braid_signs(headers: &HeaderMap) -> bool {
    [
        "version",
        "current-version",
        "parents",
        "subscribe",
        "patches",
    ]
    .iter()
    .any(|h| headers.contains_key(*h))
}

/// The key under which requests share a session: the resource variant
/// (host, path, the `Vary`'d values, credentials), plus `Accept`,
/// `Accept-Encoding` and the Braid request headers but `Parents` (where a
/// request starts is decided by the window).
pub fn relay_key(key: &Key, headers: &HeaderMap) -> String {
    let mut out = format!("{}\n{}", key.path, key.secondary);
    for name in [
        "accept",
        "accept-encoding",
        "peer",
        "merge-type",
        "subscribe",
        "heartbeats",
        "version",
    ] {
        out.push('\n');
        out.push_str(name);
        out.push(':');
        for v in headers.get_all(name) {
            out.push_str(&String::from_utf8_lossy(v.as_bytes()));
            out.push(',');
        }
    }
    out
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_tells_requests_apart_by_what_the_upstream_may_answer_differently() {
        let key = Key {
            path: "/doc".into(),
            secondary: "host".into(),
            vary: Default::default(),
        };
        let with = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.insert(*n, http::HeaderValue::from_static(v));
            }
            relay_key(&key, &h)
        };
        let base = with(&[("subscribe", "true")]);
        assert_eq!(base, with(&[("subscribe", "true"), ("parents", "\"v1\"")]));
        assert_eq!(base, with(&[("subscribe", "true"), ("x-other", "1")]));
        for other in [
            ("accept", "text/plain"),
            ("peer", "p"),
            ("merge-type", "simpleton"),
            ("heartbeats", "5s"),
            ("version", "\"v1\""),
            ("accept-encoding", "gzip"),
        ] {
            assert_ne!(base, with(&[("subscribe", "true"), other]), "{other:?}");
        }
        assert_ne!(base, with(&[("subscribe", "?1")]));
    }
}
