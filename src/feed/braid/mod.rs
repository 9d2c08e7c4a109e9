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
//! The session also *understands* what it relays, where it can: snapshots,
//! and patches in the units [`braid`] applies whose `Parents` are the
//! version it holds, build the current representation ([`Model`]). While
//! it is known and the stream is linear (the 209 declares no `Merge-Type`),
//! a subscriber more than one update behind gets one update to the newest
//! version (the patches composed, or a snapshot) instead of the backlog,
//! and plain GETs are answered from the model ([`Relays::answer_live`]).
//! An update it cannot apply makes the model unknown until the next
//! snapshot; meanwhile laggards get the updates as received.
//!
//! Keys say whose view it is: the 209's `Vary` is recorded for the URL and
//! the session is re-keyed under it, so a request with other values of
//! those headers never joins it; a `private`, `Set-Cookie` or `Vary: *`
//! answer is never joined at all.
//!
//! The lifecycle is the upstream's: when the upstream stream ends, breaks,
//! or its heartbeats stop, the session ends and so do its subscribers'
//! streams (after what the window still had for them); clients resume with
//! `Parents`. When the last subscriber leaves, the upstream subscription is
//! closed at once. Any answer but 209 reaches the client as the upstream
//! gave it, except that, for a resource not known to be Braid, a 200
//! without any Braid header shows a plain origin, which the router then
//! polls ([`crate::feed::poll`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{header, HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::sync::{watch, Notify};
use tracing::debug;

use crate::braid::BraidRequest;
use crate::braid::VersionList;
use crate::config::{Config, UpstreamKind};
use crate::deliver::cursor::{Cursor, Parts};
use crate::deliver::direct;
use crate::deliver::window::Window;
use crate::error::Refusal;
use crate::floor::body::{Body, RequestBody};
use crate::floor::headers;
use crate::floor::rules::{self, Timing, Vary};
use crate::floor::sync::lock;
use crate::metrics::Metrics;
use crate::state::{Registry, Ticket};
use crate::upstream::{self, UpstreamClient};

mod keys;
mod live;
mod model;
mod read;
mod window;

pub use keys::{braid_signs, relay_key};
use keys::{subscription_vary, view_key};
use model::{Applied, Known, Model};
use read::{silence_limit, Entry, Received};
use window::{SessionWindow, Subscriber};

/// The relays of one proxy: its live sessions and what it knows of its upstream.
pub struct Relays {
    client: UpstreamClient,
    config: Config,
    metrics: Arc<Metrics>,
    /// Where the `Vary` of each URL is kept, so keys follow the 209s.
    registry: Arc<Registry>,
    /// Live sessions by URL (path and query); each knows its full key.
    sessions: Mutex<HashMap<String, Vec<Arc<Session>>>>,
    /// Bytes held by all sessions' windows, bounded by `--history-bytes`.
    window_bytes: Arc<AtomicUsize>,
    /// Relay keys whose upstream stream just ended on a malformed update,
    /// with when they may be asked again (at most
    /// [`MAX_MALFORMED_KEYS`]): clients that retry at once do not make the
    /// proxy ask a broken upstream again and again.
    malformed: Mutex<HashMap<String, Instant>>,
    /// How many URLs have sessions (`sessions.len()`, kept under its lock):
    /// a GET of a proxy without any skips the sessions' lock.
    urls_followed: AtomicUsize,
    closing: watch::Receiver<bool>,
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
        /// Its place among the requests sent to the origin.
        ticket: Ticket,
        /// Held while the answer seeds the resource; equivalent requests
        /// wait for its drop, so that none polls for the same first answer.
        seeding: Seeding,
    },
    /// An equivalent request just found a plain origin: serve this one
    /// from the polled resource too, without a request of its own.
    Poll {
        /// The identity headers of the request, for the resource's watcher.
        template: HeaderMap,
    },
}

/// Held by the request whose plain answer seeds a resource; dropped (once
/// seeded, or with the request) it lets the session's waiters go on.
pub struct Seeding(Arc<Session>);

impl Drop for Seeding {
    fn drop(&mut self) {
        self.0.tick.send_modify(|t| t.seeded = true);
    }
}

/// One live session as the operator's page shows it ([`Relays::summaries`]).
#[derive(Debug, Clone)]
pub struct SessionSummary {
    /// The URL (path and query).
    pub path: String,
    pub subscribers: usize,
    /// Its answer is one client's: nobody else joins it.
    pub private: bool,
    /// The newest version in its window.
    pub version: Option<VersionList>,
    /// `None` while the upstream has not answered; `Some(true)` after a 209.
    pub opened: Option<bool>,
    pub ended: bool,
    /// Its opener found a plain origin: the resource is polled instead.
    pub plain: bool,
    /// How long ago the newest update came from the upstream.
    pub last_update: Option<Duration>,
}

/// One upstream subscription and everything it sent.
pub struct Session {
    /// The URL (path and query).
    path: String,
    /// What the opening exchange told. One lock: its fields are set
    /// together while the session opens (and re-keyed once, when the 209
    /// names a `Vary`), then only read, by requests looking for a session
    /// to join and by a resume.
    opened: Mutex<Opened>,
    /// Its answer is one client's (`private`, `Set-Cookie`, `Vary: *`): nobody joins.
    exclusive: AtomicBool,
    /// The `Parents` the opening request carried.
    opened_with: Option<VersionList>,
    /// Its opener was answered: from then on its reads are never refused.
    /// Until then (a subscription without `Parents`, whose first update is
    /// the whole state) it stops reading, and its opener gets 503, once the
    /// proxy is over `--state-bytes`: a burst of new sessions cannot read
    /// past the cap before any of them is counted.
    admitted: AtomicBool,
    /// It ended because the proxy was full while its first update was read.
    refused_full: AtomicBool,
    /// The updates received. Its own lock: taken per read of the upstream
    /// and per subscriber step, and only briefly.
    window: Mutex<Received>,
    /// How far the window goes, for subscribers to wake on.
    tick: watch::Sender<Tick>,
    subscribers: AtomicUsize,
    /// Woken when a subscriber leaves.
    left: Notify,
    /// Its parked HTTP/1.1 subscribers, written to directly ([`direct`]).
    direct: Arc<direct::Parked>,
    /// Its window as subscribers follow it: one for all of them.
    followed: std::sync::OnceLock<Arc<dyn Window>>,
    /// The representation the updates build, where understood. Apart from
    /// the window: GETs answered from it must not wait on subscribers'
    /// steps. Where both are taken (a read, a collapse), the window first.
    model: Mutex<Model>,
    /// Collapsed updates built for laggards: (end they were built for, by
    /// start). Apart: a collapse is built with neither of the others held
    /// longer than it needs.
    collapsed: Mutex<(u64, HashMap<u64, Option<Bytes>>)>,
    /// When a write through this proxy last succeeded: GETs go upstream
    /// until the next update shows it (or [`WRITE_SETTLE`] passes). Apart:
    /// set by writes, which take no other lock of the session.
    written: Mutex<Option<Instant>>,
}

/// What a session's opening exchange told ([`Session::opened`]).
#[derive(Default)]
struct Opened {
    /// The relay key ([`relay_key`]); re-made once the 209 names a `Vary`.
    key: String,
    /// The key of the representation it carries ([`view_key`]), for plain
    /// GETs; `None` when its request asked for a peer's or a version's view.
    view: Option<String>,
    /// The 209's status line and headers, once it came.
    head: Option<RelayedHead>,
    /// The opener's request as sent upstream, for a resume (`--hold-upstream-breaks`).
    request: Option<(http::Uri, HeaderMap)>,
}

/// How long after a write through this proxy plain GETs skip the model
/// when no update has come since (a write that changed nothing sends none).
const WRITE_SETTLE: Duration = Duration::from_secs(2);

#[derive(Clone)]
struct RelayedHead {
    status: StatusCode,
    reason: Option<hyper::ext::ReasonPhrase>,
    headers: HeaderMap,
}

/// How long a session whose opener found a plain origin stays findable,
/// for requests already on their way (later ones find the polled resource).
const PLAIN_LINGER: Duration = Duration::from_secs(2);

/// How long an update waits for the blank lines its upstream usually
/// writes after it, when they did not come in the same read.
const BLANK_LINES_WAIT: Duration = Duration::from_millis(20);

/// The largest header block of an update (or of one of its patches) read
/// from an upstream; an update may be this much larger than
/// `--max-body-bytes`.
pub const UPDATE_HEADER_ROOM: usize = 64 * 1024;

/// How long a relay key whose upstream stream was malformed is answered
/// 502 without asking the upstream again.
const MALFORMED_BACKOFF: Duration = Duration::from_secs(10);

/// Most relay keys remembered as malformed at once.
const MAX_MALFORMED_KEYS: usize = 4096;

/// What a blank entry costs in the window's byte count, beyond its bytes.
const BLANK_OVERHEAD: usize = 64;

/// What subscribers watch: how far the stream got and whether it ended.
#[derive(Debug, Clone, Default)]
struct Tick {
    /// `None` while the upstream has not answered; `Some(true)` once it answered 209.
    opened: Option<bool>,
    /// Sequence number after the newest entry.
    end: u64,
    /// `end` before the latest announce: a subscriber behind it was
    /// already behind when the newest entries came, so it lags (one that
    /// is not gets what one upstream read brought, as received).
    prev: u64,
    ended: bool,
    /// The opener's answer showed a plain origin: the resource is polled.
    plain: bool,
    /// That answer is in the resource (or its request is gone).
    seeded: bool,
}

/// How long a new session opened without `Parents` waits for the first
/// bytes of its first update before its opener is answered anyway.
const FIRST_UPDATE_GRACE: Duration = Duration::from_millis(250);

/// Why an upstream stream is over.
enum Over {
    Ended,
    Broken(String),
    /// The upstream sent what does not frame as an update.
    Malformed(String),
    /// The proxy went over `--state-bytes` while the session's first
    /// update was read, before its opener was answered.
    Full,
    Silent(Duration),
    NoSubscribers,
    Closing,
}

/// Fails a session still being opened when its opener goes away.
struct Opening<'a> {
    relays: &'a Relays,
    session: Arc<Session>,
}

impl Drop for Opening<'_> {
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

impl Relays {
    pub fn new(
        client: UpstreamClient,
        config: Config,
        metrics: Arc<Metrics>,
        registry: Arc<Registry>,
        closing: watch::Receiver<bool>,
    ) -> Relays {
        Relays {
            client,
            config,
            metrics,
            registry,
            sessions: Mutex::default(),
            window_bytes: Arc::default(),
            malformed: Mutex::default(),
            urls_followed: AtomicUsize::new(0),
            closing,
        }
    }

    /// Live sessions (each is one open upstream subscription or one being opened).
    pub fn sessions(&self) -> usize {
        lock(&self.sessions).values().map(Vec::len).sum()
    }

    /// What the operator's page shows of each live session (read-only).
    pub fn summaries(&self) -> Vec<SessionSummary> {
        let sessions: Vec<Arc<Session>> =
            lock(&self.sessions).values().flatten().cloned().collect();
        sessions
            .iter()
            .map(|s| {
                let tick = s.tick.borrow().clone();
                let window = lock(&s.window);
                SessionSummary {
                    path: s.path.clone(),
                    subscribers: s.subscribers.load(Relaxed),
                    private: s.exclusive.load(Relaxed),
                    version: window.entries.iter().rev().find_map(|e| e.version.clone()),
                    opened: tick.opened,
                    ended: tick.ended,
                    plain: tick.plain,
                    last_update: window.last_update.map(|at| at.elapsed()),
                }
            })
            .collect()
    }

    /// Bytes held by all sessions' windows (bounded by `--history-bytes`).
    pub fn window_bytes(&self) -> usize {
        self.window_bytes.load(Relaxed)
    }

    /// Whether a session of `path` is open: its upstream speaks Braid.
    pub fn has_live(&self, path: &str) -> bool {
        lock(&self.sessions)
            .get(path)
            .is_some_and(|list| list.iter().any(|s| s.tick.borrow().opened == Some(true)))
    }

    /// Answers a subscription request: joins an equivalent live session
    /// whose window holds where it starts, or sends it upstream.
    /// `known_braid`: the resource is known to be a Braid server's, so a
    /// plain answer is relayed, never polled.
    pub async fn subscribe(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        braid: &BraidRequest,
        known_braid: bool,
    ) -> Result<Relayed, Refusal> {
        let path = crate::state::path_of(&req);
        let host = upstream::client_host(&req).unwrap_or_default();
        let deadline = tokio::time::Instant::now() + self.config.response_timeout;
        // Let the I/O that is already in (such as the close of a client
        // that left just before this request came) be processed first, so
        // that a session whose last subscriber has gone is not joined.
        tokio::task::yield_now().await;
        loop {
            // Made again each time: a session's 209 may have named a Vary.
            let key = self.registry.key_for(&path, req.headers(), &host);
            let rkey = relay_key(&key, req.headers());
            self.refuse_if_malformed(&rkey)?;
            let (session, opener) = self.find_or_open(&path, &rkey, braid);
            if opener {
                return self.open(req, session, known_braid).await;
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
                // Served from the resource the opener's answer seeds: once
                // it is in, this request's own variant (its `Vary` may be
                // known by then) is either that resource or a new one.
                let _ = tokio::time::timeout_at(deadline, tick.wait_for(|t| t.seeded)).await;
                let template = upstream::watcher_template(&req, &self.config);
                return Ok(Relayed::Poll { template });
            }
            if opened {
                let key = self.registry.key_for(&path, req.headers(), &host);
                let rkey = relay_key(&key, req.headers());
                if let Some(start) = self.join(&session, braid, &rkey) {
                    return Ok(Relayed::Answer(self.respond(session, start)?));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                // The session being opened never answered: ask on our own.
                let session = self.register(&path, &rkey, braid);
                return self.open(req, session, known_braid).await;
            }
        }
    }

    /// The refusal for a request whose relay key's upstream stream was
    /// malformed less than [`MALFORMED_BACKOFF`] ago.
    fn refuse_if_malformed(&self, rkey: &str) -> Result<(), Refusal> {
        let mut malformed = lock(&self.malformed);
        let now = Instant::now();
        match malformed.get(rkey) {
            Some(until) if *until > now => Err(Refusal::UpstreamMalformed {
                retry_after: *until - now,
            }),
            Some(_) => {
                malformed.remove(rkey);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Remembers that `rkey`'s upstream stream ended on a malformed update.
    fn remember_malformed(&self, rkey: &str) {
        let mut malformed = lock(&self.malformed);
        let now = Instant::now();
        if malformed.len() >= MAX_MALFORMED_KEYS {
            malformed.retain(|_, until| *until > now);
        }
        if malformed.len() < MAX_MALFORMED_KEYS {
            malformed.insert(rkey.to_string(), now + MALFORMED_BACKOFF);
        }
    }

    /// An equivalent session to join, or a new one this request opens (true).
    /// Looks and registers under one lock, so that two first requests
    /// arriving together open one session, not two.
    fn find_or_open(&self, path: &str, rkey: &str, braid: &BraidRequest) -> (Arc<Session>, bool) {
        let mut sessions = lock(&self.sessions);
        if let Some(list) = sessions.get(path) {
            for s in list {
                if s.exclusive.load(Relaxed) || lock(&s.opened).key != rkey {
                    continue;
                }
                let tick = s.tick.borrow();
                if tick.ended || tick.opened == Some(false) || s.deserted(&tick) {
                    continue;
                }
                if tick.opened.is_none() || s.start_for(braid).is_some() {
                    return (s.clone(), false);
                }
            }
            // An opener of another variant just found a plain origin for
            // this URL: every variant is polled (its own, once that answer
            // is in), rather than asked upstream again.
            if let Some(plain) = list.iter().find(|s| s.tick.borrow().plain) {
                return (plain.clone(), false);
            }
        }
        let session = Self::new_session(path, rkey, braid);
        sessions
            .entry(path.to_string())
            .or_default()
            .push(session.clone());
        self.urls_followed.store(sessions.len(), Relaxed);
        (session, true)
    }

    fn register(&self, path: &str, rkey: &str, braid: &BraidRequest) -> Arc<Session> {
        let session = Self::new_session(path, rkey, braid);
        let mut sessions = lock(&self.sessions);
        sessions
            .entry(path.to_string())
            .or_default()
            .push(session.clone());
        self.urls_followed.store(sessions.len(), Relaxed);
        session
    }

    fn new_session(path: &str, rkey: &str, braid: &BraidRequest) -> Arc<Session> {
        Arc::new(Session {
            path: path.to_string(),
            opened: Mutex::new(Opened {
                key: rkey.to_string(),
                ..Opened::default()
            }),
            exclusive: AtomicBool::new(false),
            opened_with: braid.parents.clone().filter(|p| !p.is_empty()),
            admitted: AtomicBool::new(braid.parents.as_ref().is_some_and(|p| !p.is_empty())),
            refused_full: AtomicBool::new(false),
            window: Mutex::default(),
            tick: watch::channel(Tick::default()).0,
            subscribers: AtomicUsize::new(0),
            left: Notify::new(),
            direct: Arc::default(),
            followed: std::sync::OnceLock::new(),
            model: Mutex::default(),
            collapsed: Mutex::default(),
            written: Mutex::new(None),
        })
    }

    fn unregister(&self, session: &Arc<Session>) {
        let mut sessions = lock(&self.sessions);
        if let Some(list) = sessions.get_mut(&session.path) {
            list.retain(|s| !Arc::ptr_eq(s, session));
            if list.is_empty() {
                sessions.remove(&session.path);
            }
        }
        self.urls_followed.store(sessions.len(), Relaxed);
    }

    /// Adds a subscriber to a live session at the place its request starts
    /// from, if the window holds it.
    fn join(&self, session: &Arc<Session>, braid: &BraidRequest, rkey: &str) -> Option<u64> {
        let _sessions = lock(&self.sessions);
        let tick = session.tick.borrow();
        if tick.ended || session.deserted(&tick) || session.exclusive.load(Relaxed) {
            return None;
        }
        drop(tick);
        // Its 209 may have re-keyed it under a Vary this request differs in.
        if lock(&session.opened).key != rkey {
            return None;
        }
        let start = session.start_for(braid)?;
        session.subscribers.fetch_add(1, Relaxed);
        Some(start)
    }

    /// Sends the opener's request upstream and relays the answer.
    async fn open(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        session: Arc<Session>,
        known_braid: bool,
    ) -> Result<Relayed, Refusal> {
        let template = upstream::watcher_template(&req, &self.config);
        let opener_headers = req.headers().clone();
        let host = upstream::client_host(&req).unwrap_or_default();
        // Should this request be cancelled (its client gone) before the
        // upstream answers, the session must not stay pending.
        let _pending = Opening {
            relays: self,
            session: session.clone(),
        };
        let failed = |this: &Self| {
            session.tick.send_modify(|t| t.opened = Some(false));
            this.unregister(&session);
        };
        // Its window counts against --state-bytes: no new one over the cap.
        let out = self
            .registry
            .make_room()
            .and_then(|()| upstream::upstream_request(req, &self.client, &self.config));
        let out = match out {
            Ok(out) => out,
            Err(refusal) => {
                failed(self);
                return Err(refusal);
            }
        };
        lock(&session.opened).request =
            Some((out.uri().clone(), headers::owned_headers(out.headers())));
        let sent = SystemTime::now();
        let ticket = Ticket::take();
        let response = match self.client.send_watch(out).await {
            Ok(response) => response,
            Err(refusal) => {
                failed(self);
                return Err(refusal);
            }
        };
        let status = response.status();
        let braid_signs = braid_signs(response.headers());
        if status.as_u16() != 209 {
            // Not known to be Braid: a plain answer (200, or 404/410 for
            // a resource that does not exist yet) from what must be a plain
            // origin is the first state of a polled resource (the router
            // records the kind on it: a 200 teaches it, a 404 does not, as
            // a Braid server's 404 may carry no Braid header).
            let plain = !braid_signs
                && matches!(status.as_u16(), 200 | 404 | 410)
                && !known_braid
                && self.config.upstream_kind == UpstreamKind::Auto;
            if plain && status == StatusCode::OK {
                debug!("upstream answered Subscribe with a plain 200: polling it");
            }
            // Waiting equivalent requests learn it with the failure: set first.
            session.tick.send_modify(|t| t.plain = plain);
            if !plain {
                failed(self);
                return Ok(Relayed::Answer(upstream::downstream_response(
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
                ticket,
                seeding: Seeding(session.clone()),
            });
        }
        let (mut parts, body) = response.into_parts();
        self.learn_keys(&session, &parts.headers, &opener_headers, &host);
        lock(&session.model).linear = !parts.headers.contains_key("merge-type");
        headers::strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::CONTENT_LENGTH);
        upstream::append_via(&mut parts.headers, parts.version, &self.config.proxy_id);
        let silence = silence_limit(&parts.headers);
        lock(&session.opened).head = Some(RelayedHead {
            status: parts.status,
            reason: parts.extensions.get::<hyper::ext::ReasonPhrase>().cloned(),
            headers: headers::owned_headers(&parts.headers),
        });
        session.subscribers.fetch_add(1, Relaxed);
        session.tick.send_modify(|t| t.opened = Some(true));
        self.metrics.upstream_subscriptions.fetch_add(1, Relaxed);
        tokio::spawn(self.clone().read(session.clone(), body, silence));
        self.first_update(&session).await?;
        Ok(Relayed::Answer(self.respond(session, 0)?))
    }

    /// Waits (up to `--response-timeout`) until a session opened without
    /// `Parents` has read its first update, the whole state, counted as it
    /// was read: `Err` (503) when the proxy went over `--state-bytes`
    /// meanwhile and the session stopped. Marks it admitted.
    async fn first_update(&self, session: &Session) -> Result<(), Refusal> {
        if session.admitted.load(Relaxed) {
            return Ok(());
        }
        let mut tick = session.tick.subscribe();
        let started = tokio::time::Instant::now();
        let wait = async {
            loop {
                if tick.borrow_and_update().ended {
                    return;
                }
                let (seen, unframed) = {
                    let window = lock(&session.window);
                    (window.seen_update, window.partial.1)
                };
                // An upstream that sends no update at once (a Braid server
                // may wait for a change) is not waited for.
                if seen || (unframed == 0 && started.elapsed() >= FIRST_UPDATE_GRACE) {
                    return;
                }
                tokio::select! {
                    _ = tick.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
        };
        let _ = tokio::time::timeout(self.config.response_timeout, wait).await;
        session.admitted.store(true, Relaxed);
        if session.refused_full.load(Relaxed) {
            Metrics::inc(&self.metrics.state_refusals_total);
            return Err(Refusal::Unavailable {
                reason: format!(
                    "the proxy's state went over --state-bytes ({} bytes) while this subscription's first update was read; retry later",
                    self.config.state_bytes
                ),
                retry_after: Duration::from_secs(5),
            });
        }
        Ok(())
    }

    /// Keys the session by what its 209 says the answer depends on: the
    /// URL's `Vary` is recorded (Braid's own `Version`, `Parents` and
    /// `Subscribe` aside, which every subscription has in its key) and the
    /// session re-keyed under it; an answer for one client only
    /// (`private`, `Set-Cookie`, `Vary: *`) is never joined.
    fn learn_keys(&self, session: &Session, answer: &HeaderMap, opener: &HeaderMap, host: &str) {
        let vary = subscription_vary(answer);
        let cc = rules::CacheControl::parse(answer);
        let _sessions = lock(&self.sessions);
        self.registry.learn_braid(&session.path);
        self.registry.record_vary(&session.path, &vary);
        let key = self.registry.key_for(&session.path, opener, host);
        // One client's answer is shared by nobody; under a credential's
        // key, a `private` answer is shared by that credential's requests
        // alone, as the tier above shares it.
        let personal = (cc.private && !key.is_credentialed())
            || answer.contains_key(header::SET_COOKIE)
            || vary == Vary::Any;
        if personal {
            session.exclusive.store(true, Relaxed);
        }
        lock(&session.opened).key = relay_key(&key, opener);
        let own_view = ["peer", "merge-type", "version"]
            .iter()
            .any(|name| opener.contains_key(*name));
        lock(&session.opened).view = (!own_view).then(|| view_key(&key, opener));
    }

    /// The bytes all relayed windows hold now (counted against `--state-bytes`).
    pub fn window_counter(&self) -> Arc<AtomicUsize> {
        self.window_bytes.clone()
    }

    /// Records a write through this proxy to `path`: plain GETs go
    /// upstream until its sessions' next update.
    pub fn written(&self, path: &str) {
        if let Some(list) = lock(&self.sessions).get(path) {
            for s in list {
                *lock(&s.written) = Some(Instant::now());
            }
        }
    }

    /// The 209 for a subscriber starting at `start`.
    fn respond(&self, session: Arc<Session>, start: u64) -> Result<Response<Body>, Refusal> {
        let guard = Subscriber {
            session: session.clone(),
            metrics: self.metrics.clone(),
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
        let head = lock(&session.opened).head.clone().ok_or_else(|| {
            Refusal::UpstreamBroken("the upstream subscription has no head".into())
        })?;
        let link = Arc::new(direct::Link::default());
        let window = session
            .followed
            .get_or_init(|| {
                Arc::new(SessionWindow {
                    session: Arc::downgrade(&session),
                    metrics: self.metrics.clone(),
                    name: session.path.clone(),
                })
            })
            .clone();
        let handle = direct::Handle {
            window: window.clone(),
            parked: session.direct.clone(),
            link: link.clone(),
            metrics: self.metrics.clone(),
            heartbeat: None,
            closing: self.closing.clone(),
        };
        let body = Cursor::body(Parts {
            window,
            changes: session.tick.subscribe(),
            link,
            at: start,
            heartbeat: None,
            closing: self.closing.clone(),
            metrics: self.metrics.clone(),
            held: Box::new(guard),
            relayed: true,
        });
        let mut response = Response::new(body);
        response.extensions_mut().insert(handle);
        *response.status_mut() = head.status;
        *response.headers_mut() = head.headers;
        if let Some(reason) = head.reason {
            response.extensions_mut().insert(reason);
        }
        Ok(response)
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
        if window.malformed {
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
