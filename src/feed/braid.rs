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

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{header, HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::{watch, Notify};
use tracing::{debug, warn};

use crate::braid::BraidRequest;
use crate::braid::{self, FrameError, Framer, Patch, Piece, VersionList};
use crate::config::{Config, UpstreamKind};
use crate::deliver::cursor::{Cursor, Parts};
use crate::deliver::direct;
use crate::deliver::window::{Frozen, Step, Window};
use crate::error::Refusal;
use crate::floor::body::{Body, RequestBody};
use crate::floor::headers;
use crate::floor::rules::{self, Timing, Vary};
use crate::floor::sync::lock;
use crate::metrics::Metrics;
use crate::state::{Key, Registry, Ticket};
use crate::upstream::{self, UpstreamClient};

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
    /// The relay key ([`relay_key`]); re-made once the 209 names a `Vary`.
    key: Mutex<String>,
    /// Its answer is one client's (`private`, `Set-Cookie`, `Vary: *`): nobody joins.
    exclusive: AtomicBool,
    /// The key of the representation it carries ([`view_key`]), for plain
    /// GETs; `None` when its request asked for a peer's or a version's view.
    view: Mutex<Option<String>>,
    /// The `Parents` the opening request carried.
    opened_with: Option<VersionList>,
    /// The 209's status line and headers, once it came.
    head: Mutex<Option<RelayedHead>>,
    /// The opener's request as sent upstream, for a resume (`--hold-upstream-breaks`).
    request: Mutex<Option<(http::Uri, HeaderMap)>>,
    window: Mutex<Received>,
    tick: watch::Sender<Tick>,
    subscribers: AtomicUsize,
    /// Woken when a subscriber leaves.
    left: Notify,
    /// Its parked HTTP/1.1 subscribers, written to directly ([`direct`]).
    direct: Arc<direct::Parked>,
    /// Its window as subscribers follow it: one for all of them.
    followed: std::sync::OnceLock<Arc<dyn Window>>,
    /// The representation the updates build, where understood.
    model: Mutex<Model>,
    /// Collapsed updates built for laggards: (end they were built for, by start).
    collapsed: Mutex<(u64, HashMap<u64, Option<Bytes>>)>,
    /// When a write through this proxy last succeeded: GETs go upstream
    /// until the next update shows it (or [`WRITE_SETTLE`] passes).
    written: Mutex<Option<Instant>>,
}

/// How long after a write through this proxy plain GETs skip the model
/// when no update has come since (a write that changed nothing sends none).
const WRITE_SETTLE: Duration = Duration::from_secs(2);

/// What a session's updates say the resource is now, when it can tell.
#[derive(Default)]
struct Model {
    /// The 209 declared no `Merge-Type`: one server-authoritative history,
    /// so laggards may be sent one update to the newest version.
    linear: bool,
    known: Option<Known>,
}

/// A representation built from the upstream's updates.
#[derive(Clone)]
struct Known {
    version: VersionList,
    /// The status of the newest update (`None`: 200).
    status: Option<u16>,
    body: Bytes,
    /// The representation headers its last snapshot carried (`Content-Type`, ...).
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

/// How an update took the model from its parents to its version.
enum Applied {
    /// The whole body.
    Snapshot,
    /// These patches against the previous version.
    Patches(Vec<Patch>),
}

impl Model {
    /// Bytes it holds: the representation's body and headers. A body that
    /// shares an update's bytes is counted too: the window may drop or
    /// replace that update while the model keeps them.
    fn weight(&self) -> usize {
        self.known.as_ref().map_or(0, |k| {
            k.body.len()
                + k.headers
                    .iter()
                    .map(|(n, v)| n.as_str().len() + v.len() + 32)
                    .sum::<usize>()
        })
    }

    /// The update bytes its body shares were replaced by `new` (the same
    /// bytes and more): share those instead, so the old ones are freed.
    fn rebase(&mut self, old: &Bytes, new: &Bytes) {
        let Some(known) = self.known.as_mut() else {
            return;
        };
        let (start, end) = (old.as_ptr() as usize, old.as_ptr() as usize + old.len());
        let body = known.body.as_ptr() as usize;
        if known.body.is_empty() || body < start || body + known.body.len() > end {
            return;
        }
        let at = body - start;
        if new.get(at..at + known.body.len()) == Some(&known.body[..]) {
            known.body = new.slice(at..at + known.body.len());
        }
    }

    /// Applies one update received; what it did, or `None` when the
    /// update cannot be applied (the model is unknown from then on, until
    /// a snapshot).
    fn understand(&mut self, raw: &Bytes, max_body: usize) -> Option<Applied> {
        let applied = self.apply(raw, max_body);
        if applied.is_none() {
            self.known = None;
        }
        applied
    }

    fn apply(&mut self, raw: &Bytes, max_body: usize) -> Option<Applied> {
        if !self.linear {
            return None;
        }
        let mut decoder = braid::Decoder::new(braid::DecodeLimits {
            max_content_length: max_body,
            ..braid::DecodeLimits::default()
        });
        decoder.push(raw);
        let update = decoder.next_update().ok()??;
        if update.version.is_empty() {
            return None;
        }
        match update.body {
            braid::Body::Snapshot(_)
                if update
                    .extra_headers
                    .iter()
                    .any(|(name, _)| name == header::CONTENT_ENCODING) =>
            {
                // A coded body: patches of it mean nothing here.
                None
            }
            braid::Body::Snapshot(body) => {
                let headers = update
                    .extra_headers
                    .into_iter()
                    .filter(|(name, _)| SNAPSHOT_HEADERS.contains(&name.as_str()))
                    .collect();
                // The update's own bytes end with its body: share them
                // rather than keep a second copy.
                let body = match raw.len().checked_sub(body.len()) {
                    Some(at) if raw[at..] == body[..] => raw.slice(at..),
                    _ => body,
                };
                self.known = Some(Known {
                    version: update.version,
                    status: update.status,
                    body,
                    headers,
                });
                Some(Applied::Snapshot)
            }
            braid::Body::Patches(patches) => {
                let known = self.known.as_mut()?;
                let ok_status = known.status.unwrap_or(200) == 200;
                // A patch is to a 200's body, and says 200 if anything
                // (braid-http 1.4's server starts every update with
                // `HTTP 200 OK`).
                let patch_ok = update.status.unwrap_or(200) == 200;
                if update.parents != known.version || !ok_status || !patch_ok {
                    return None;
                }
                if patches.iter().any(|p| p.unit == braid::RangeUnit::Json) {
                    return None;
                }
                let body = braid::apply_patches(&known.body, &patches).ok()?;
                if body.len() > max_body {
                    return None;
                }
                known.body = Bytes::from(body);
                known.version = update.version;
                Some(Applied::Patches(patches))
            }
        }
    }
}

/// Headers of a snapshot update that describe the representation, kept
/// with the model for GETs and collapsed snapshots.
const SNAPSHOT_HEADERS: [&str; 2] = ["content-type", "content-language"];

#[derive(Clone)]
struct RelayedHead {
    status: StatusCode,
    reason: Option<hyper::ext::ReasonPhrase>,
    headers: HeaderMap,
}

/// The updates a session received, oldest first, bounded in count and bytes.
#[derive(Default)]
struct Received {
    /// Sequence number of `entries[0]`; entries count from 0 for the stream's first.
    first: u64,
    entries: VecDeque<Entry>,
    bytes: usize,
    /// Entries that are updates (not blank lines).
    updates: usize,
    /// Set once the stream did not frame: nobody joins any more, and the
    /// session is ending.
    malformed: bool,
    /// What the session's model holds ([`Model::weight`]), counted with
    /// the window's bytes.
    model: usize,
    /// Blank lines framed since the newest update.
    blanks_since_update: usize,
    /// How many blank lines the upstream writes after an update, as it did
    /// after the one before the newest; `None` before that is known.
    blanks_after_updates: Option<usize>,
    /// An update was framed.
    seen_update: bool,
    /// When the newest update was framed (the operator's page shows it).
    last_update: Option<Instant>,
}

/// The blank lines braid-http's server writes after every update, expected
/// after an upstream's first update (the next ones expect what it did).
const USUAL_BLANKS_AFTER_UPDATE: usize = 2;

impl Received {
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
    /// How the model applied it (`None`: not understood, or not an update).
    applied: Option<Arc<Applied>>,
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

/// Why an upstream stream is over.
enum Over {
    Ended,
    Broken(String),
    /// The upstream sent what does not frame as an update.
    Malformed(String),
    Silent(Duration),
    NoSubscribers,
    Closing,
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
                if s.exclusive.load(Relaxed) || *lock(&s.key) != rkey {
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
            key: Mutex::new(rkey.to_string()),
            exclusive: AtomicBool::new(false),
            view: Mutex::new(None),
            opened_with: braid.parents.clone().filter(|p| !p.is_empty()),
            head: Mutex::new(None),
            request: Mutex::new(None),
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
        if *lock(&session.key) != rkey {
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
        *lock(&session.request) = Some((out.uri().clone(), headers::owned_headers(out.headers())));
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
        *lock(&session.head) = Some(RelayedHead {
            status: parts.status,
            reason: parts.extensions.get::<hyper::ext::ReasonPhrase>().cloned(),
            headers: headers::owned_headers(&parts.headers),
        });
        session.subscribers.fetch_add(1, Relaxed);
        session.tick.send_modify(|t| t.opened = Some(true));
        self.metrics.upstream_subscriptions.fetch_add(1, Relaxed);
        tokio::spawn(self.clone().read(session.clone(), body, silence));
        Ok(Relayed::Answer(self.respond(session, 0)?))
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
        *lock(&session.key) = relay_key(&key, opener);
        let own_view = ["peer", "merge-type", "version"]
            .iter()
            .any(|name| opener.contains_key(*name));
        *lock(&session.view) = (!own_view).then(|| view_key(&key, opener));
    }

    /// A plain GET (or HEAD) answered from the model of a live session
    /// that carries the request's variant: the upstream's subscription
    /// counts as validation (spec/caching.md). `None` when there is none,
    /// its model is unknown, or a write through this proxy has not shown
    /// up in it yet.
    pub fn answer_live<B>(
        &self,
        req: &Request<B>,
        key: &Key,
        version: Option<&VersionList>,
        proxy_id: &str,
    ) -> Option<Response<Body>> {
        if self.urls_followed.load(Relaxed) == 0 {
            return None;
        }
        let known = {
            let sessions = lock(&self.sessions);
            // The view key is built only for a URL with sessions.
            let list = sessions.get(&key.path)?;
            let view = view_key(key, req.headers());
            list.iter().find_map(|s| s.live_view(&view))?
        };
        // A `Version:` GET is answered when it names the version held.
        if version.is_some_and(|v| *v != known.version) {
            return None;
        }
        Metrics::inc(&self.metrics.cache_hits_total);
        Some(serve_known(req, &known, proxy_id))
    }

    /// The newest version a live upstream subscription of this request's
    /// variant and representation has received, if there is one: a stored
    /// answer of another version is older than what that subscription's
    /// subscribers have, and is not served (spec/caching.md §2).
    pub fn newest_version<B>(&self, req: &Request<B>, key: &Key) -> Option<VersionList> {
        if self.urls_followed.load(Relaxed) == 0 {
            return None;
        }
        let sessions: Vec<Arc<Session>> = {
            let sessions = lock(&self.sessions);
            let list = sessions.get(&key.path)?;
            let view = view_key(key, req.headers());
            list.iter()
                .filter(|s| {
                    let rkey = lock(&s.key);
                    rkey.strip_prefix(view.as_str())
                        .is_some_and(|rest| rest.starts_with('\n'))
                })
                .cloned()
                .collect()
        };
        sessions.iter().find_map(|s| {
            let tick = s.tick.borrow().clone();
            if tick.ended || tick.opened != Some(true) {
                return None;
            }
            let window = lock(&s.window);
            window.entries.iter().rev().find_map(|e| e.version.clone())
        })
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
                session = session.path,
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
        if let Over::Malformed(_) = over {
            self.remember_malformed(&lock(&session.key));
            warn!(
                session = session.path,
                why = over.describe(),
                "upstream subscription over on a malformed update; its subscribers' streams end"
            );
        } else {
            debug!(
                session = session.path,
                why = over.describe(),
                "upstream subscription over"
            );
        }
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
        let mut framer = Framer::new(
            self.config.max_body_bytes + UPDATE_HEADER_ROOM,
            UPDATE_HEADER_ROOM,
        );
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
            if let Some(over) = self.absorb(session, framer, &data) {
                return Some(over);
            }
        }
        for _ in 0..64 {
            match futures_util::FutureExt::now_or_never(body.frame())? {
                None => return Some(Over::Ended),
                Some(Err(e)) => return Some(Over::Broken(e.to_string())),
                Some(Ok(frame)) => {
                    if let Some(over) = frame
                        .into_data()
                        .ok()
                        .and_then(|data| self.absorb(session, framer, &data))
                    {
                        return Some(over);
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
            && !window.malformed
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
            if window.malformed {
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
            let mut req = Request::new(crate::floor::body::empty());
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

    /// Frames new bytes into the window. What does not frame (malformed,
    /// or over a limit) goes no further: it ends the upstream
    /// subscription (`Some`), and subscribers resume from the last good
    /// update on their next request.
    fn absorb(&self, session: &Session, framer: &mut Framer, data: &[u8]) -> Option<Over> {
        let mut window = lock(&session.window);
        if window.malformed {
            return Some(Over::Malformed("the stream stopped framing".into()));
        }
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
                Ok(None) => return None,
                Ok(Some(Piece::Blank(raw))) if after_update => {
                    window.framed(false);
                    if let Some((old, new)) = window.extend_last(&raw, &self.window_bytes) {
                        lock(&session.model).rebase(&old, &new);
                    }
                    continue;
                }
                Ok(Some(Piece::Blank(raw))) => {
                    window.framed(false);
                    Entry {
                        raw,
                        version: None,
                        blank: true,
                        applied: None,
                    }
                }
                Ok(Some(Piece::Update(update))) => {
                    window.framed(true);
                    window.last_update = Some(Instant::now());
                    Metrics::inc(&self.metrics.upstream_updates_total);
                    // An in-stream error status without a `Version` (a 403
                    // among the updates) is news, not a new representation:
                    // the model stays as it was.
                    let event = update.version.is_none()
                        && update.status.is_some_and(|s| !(200..300).contains(&s));
                    let applied = if event {
                        None
                    } else {
                        let mut model = lock(&session.model);
                        let applied = model
                            .understand(&update.raw, self.config.max_body_bytes)
                            .map(Arc::new);
                        window.count_model(model.weight(), &self.window_bytes);
                        applied
                    };
                    *lock(&session.written) = None;
                    Entry {
                        raw: update.raw,
                        version: update.version,
                        blank: false,
                        applied,
                    }
                }
                Err(e) => {
                    window.malformed = true;
                    lock(&session.model).known = None;
                    window.count_model(0, &self.window_bytes);
                    if let FrameError::Unreadable { block, .. } = &e {
                        // The upstream's own words, handed on as the
                        // stream's last bytes: its clients fail to read
                        // them as they would without the proxy, and stop
                        // (a clean end would make them retry a server
                        // that is broken). Never stored or applied.
                        let last = Entry {
                            raw: block.clone(),
                            version: None,
                            blank: false,
                            applied: None,
                        };
                        window.push(last, &self.config, &self.window_bytes);
                    }
                    return Some(Over::Malformed(e.to_string()));
                }
            };
            after_update = !entry.blank;
            window.push(entry, &self.config, &self.window_bytes);
        }
    }

    /// Tells the subscribers how far the window goes now.
    fn announce(session: &Session) {
        let end = {
            let window = lock(&session.window);
            window.first + window.entries.len() as u64
        };
        if session.tick.send_if_modified(|t| {
            if t.end == end {
                return false;
            }
            t.prev = std::mem::replace(&mut t.end, end);
            true
        }) {
            session.direct.published();
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
        let head = lock(&session.head).clone().ok_or_else(|| {
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

impl Over {
    fn describe(&self) -> String {
        match self {
            Over::Ended => "ended by the upstream".to_string(),
            Over::Broken(e) => format!("broken: {e}"),
            Over::Malformed(e) => format!("ended on a malformed update: {e}"),
            Over::Silent(d) => format!("no byte for {d:?} (heartbeats stopped)"),
            Over::NoSubscribers => "its last subscriber left".to_string(),
            Over::Closing => "the proxy shuts down".to_string(),
        }
    }
}

impl Session {
    /// Its model, when it is live, linear, known, settled after writes,
    /// and carries the representation `view` names.
    fn live_view(&self, view: &str) -> Option<Known> {
        if self.exclusive.load(Relaxed) || lock(&self.view).as_deref() != Some(view) {
            return None;
        }
        {
            let tick = self.tick.borrow();
            if tick.ended || tick.opened != Some(true) {
                return None;
            }
        }
        if lock(&self.written).is_some_and(|at| at.elapsed() < WRITE_SETTLE) {
            return None;
        }
        let model = lock(&self.model);
        model.known.clone().filter(|_| model.linear)
    }

    /// One update taking a subscriber at entry `from` to `end` (the newest
    /// announced) when it is more than one update behind, or fell out of
    /// the window, and the stream is linear: the understood patches
    /// composed, or a snapshot of the model. Built once per (from, end)
    /// and shared by every laggard there; `None`: send what was received.
    fn collapsed(&self, from: u64, end: u64, metrics: &Metrics) -> Option<Bytes> {
        {
            let mut cache = lock(&self.collapsed);
            if cache.0 != end {
                *cache = (end, HashMap::new());
            }
            if let Some(hit) = cache.1.get(&from) {
                return hit.clone();
            }
        }
        let built = self.collapse(from, end);
        if built.is_some() {
            Metrics::inc(&metrics.collapsed_total);
        }
        let mut cache = lock(&self.collapsed);
        if cache.0 == end {
            cache.1.insert(from, built.clone());
        }
        built
    }

    fn collapse(&self, from: u64, end: u64) -> Option<Bytes> {
        let window = lock(&self.window);
        let model = lock(&self.model);
        if !model.linear || window.malformed {
            return None;
        }
        let fell_out = from < window.first;
        let start = usize::try_from(from.saturating_sub(window.first)).ok()?;
        let stop = usize::try_from(end.checked_sub(window.first)?)
            .ok()?
            .min(window.entries.len());
        let behind: Vec<&Entry> = window
            .entries
            .range(start.min(stop)..stop)
            .filter(|e| !e.blank)
            .collect();
        if behind.len() <= 1 && !fell_out {
            return None;
        }
        // An update without a `Version` (an in-stream status such as a 403,
        // or an unversioned message) changes no version, so no collapse
        // can stand for it: one still in the window is sent as received.
        if !fell_out && behind.iter().any(|e| e.version.is_none()) {
            return None;
        }
        // The newest update it is to be taken to.
        let newest = window
            .entries
            .range(..stop)
            .rev()
            .find(|e| !e.blank)?
            .version
            .clone()?;
        // The version the subscriber has: the update before `from`.
        let have = if fell_out {
            None
        } else if from == 0 {
            self.opened_with.clone()
        } else {
            window
                .entries
                .range(..start)
                .rev()
                .find(|e| !e.blank)
                .and_then(|e| e.version.clone())
        };
        let mut composed: Option<Vec<Patch>> = None;
        let mut patches_do = have.is_some();
        for entry in &behind {
            match entry.applied.as_deref() {
                Some(Applied::Patches(p)) if patches_do => {
                    composed = match composed {
                        None => Some(p.clone()),
                        Some(done) => braid::compose(&done, p).ok(),
                    };
                    patches_do = composed.is_some();
                }
                _ => patches_do = false,
            }
        }
        let snapshot = model
            .known
            .as_ref()
            .filter(|k| k.version == newest)
            .map(|k| (braid::Body::Snapshot(k.body.clone()), k));
        let composed = composed.filter(|patches| {
            patches_do
                && snapshot.as_ref().map_or(true, |(_, known)| {
                    braid::patches_wire_len(patches) <= known.body.len() + 128
                })
        });
        let (body, known) = match composed {
            Some(patches) => (braid::Body::Patches(patches), None),
            None => {
                let (body, known) = snapshot?;
                (body, Some(known))
            }
        };
        Some(braid::encode(&braid::Update {
            status: known.and_then(|k| k.status),
            version: newest,
            parents: have.unwrap_or_default(),
            body,
            extra_headers: known.map(|k| k.headers.clone()).unwrap_or_default(),
        }))
    }

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

impl Received {
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
    /// Returns the entry's bytes before and after, so that what shares the
    /// old ones (the model's body) can follow them into the new.
    fn extend_last(&mut self, more: &[u8], total: &AtomicUsize) -> Option<(Bytes, Bytes)> {
        let last = self.entries.back_mut()?;
        let mut joined = Vec::with_capacity(last.raw.len() + more.len());
        joined.extend_from_slice(&last.raw);
        joined.extend_from_slice(more);
        let old = std::mem::replace(&mut last.raw, Bytes::from(joined));
        self.bytes += more.len();
        total.fetch_add(more.len(), Relaxed);
        Some((old, last.raw.clone()))
    }

    /// Gives the window's bytes back to the total (the session is over).
    fn release(&mut self, total: &AtomicUsize) {
        total.fetch_sub(std::mem::take(&mut self.bytes), Relaxed);
        total.fetch_sub(std::mem::take(&mut self.model), Relaxed);
    }

    /// Counts what the session's model holds now (`now` bytes) with the window.
    fn count_model(&mut self, now: usize, total: &AtomicUsize) {
        total.fetch_add(now, Relaxed);
        total.fetch_sub(std::mem::replace(&mut self.model, now), Relaxed);
    }
}

impl Entry {
    fn weight(&self) -> usize {
        self.raw.len() + if self.blank { BLANK_OVERHEAD } else { 0 }
    }
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

/// Holds a subscriber's place in its session; leaving wakes the reader.
struct Subscriber {
    session: Arc<Session>,
    metrics: Arc<Metrics>,
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.metrics.subscriptions.fetch_sub(1, Relaxed);
        self.session.subscribers.fetch_sub(1, Relaxed);
        self.session.left.notify_one();
    }
}

/// A session's window: positions are entry numbers; the head is the end
/// its reader last announced (entries framed after it are not visible yet).
struct SessionWindow {
    session: std::sync::Weak<Session>,
    metrics: Arc<Metrics>,
    name: String,
}

impl Window for SessionWindow {
    fn name(&self) -> &str {
        &self.name
    }

    fn head(&self) -> Option<u64> {
        let session = self.session.upgrade()?;
        let tick = session.tick.borrow();
        (!tick.ended).then_some(tick.end)
    }

    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        let session = self.session.upgrade()?;
        let (end, prev, ended) = {
            let tick = session.tick.borrow();
            (tick.end, tick.prev, tick.ended)
        };
        Some(Box::new(SessionAt {
            session,
            end,
            prev,
            ended,
            metrics: self.metrics.clone(),
        }))
    }

    fn step_now(&self, at: u64) -> Option<(Step, bool)> {
        let session = self.session.upgrade()?;
        let (end, prev, ended) = {
            let tick = session.tick.borrow();
            (tick.end, tick.prev, tick.ended)
        };
        Some((session_step(&session, end, prev, &self.metrics, at), ended))
    }
}

/// What takes a subscriber at `at` toward `end` (the announced end; `prev`
/// the one before it): a laggard of a linear stream gets one collapsed
/// update to the end, any other the next entry as received.
fn session_step(session: &Session, end: u64, prev: u64, metrics: &Metrics, at: u64) -> Step {
    if at >= end {
        return Step::Stay;
    }
    if at < prev {
        if let Some(bytes) = session.collapsed(at, end, metrics) {
            return Step::Write {
                bytes,
                to: end,
                updates: 1,
                snapshot: false,
            };
        }
    }
    let window = lock(&session.window);
    let entry = at
        .checked_sub(window.first)
        .and_then(|i| usize::try_from(i).ok())
        .and_then(|i| window.entries.get(i));
    match entry {
        Some(entry) => Step::Write {
            bytes: entry.raw.clone(),
            to: at + 1,
            updates: 1,
            snapshot: false,
        },
        None => Step::Lost,
    }
}

/// A session's window at one announced end.
struct SessionAt {
    session: Arc<Session>,
    end: u64,
    /// The end before the latest announce: who is behind it lags.
    prev: u64,
    ended: bool,
    metrics: Arc<Metrics>,
}

impl Frozen for SessionAt {
    fn head(&self) -> u64 {
        self.end
    }

    fn step(&self, at: u64) -> Step {
        session_step(&self.session, self.end, self.prev, &self.metrics, at)
    }

    /// The newest entry, as received: what a subscriber lacking only it is sent.
    fn usual(&self) -> Option<Bytes> {
        let window = lock(&self.session.window);
        let last = self.end.checked_sub(1)?.checked_sub(window.first)?;
        window
            .entries
            .get(usize::try_from(last).ok()?)
            .map(|e| e.raw.clone())
    }

    fn over(&self) -> bool {
        self.ended
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

/// Whether an answer carries a header only a Braid server sends: a Braid
/// header, or the marks braidify (braid-http's server) puts on every answer,
/// a plain GET's included: `Range-Request-Allow-Methods`,
/// `Range-Request-Allow-Units`, and a `Vary` naming `Version` or `Parents`
/// (a plain origin has no such request headers to vary by).
pub fn braid_signs(headers: &HeaderMap) -> bool {
    [
        "version",
        "current-version",
        "parents",
        "subscribe",
        "patches",
        "range-request-allow-methods",
        "range-request-allow-units",
    ]
    .iter()
    .any(|h| headers.contains_key(*h))
        || headers.get_all(http::header::VARY).iter().any(|line| {
            line.to_str().is_ok_and(|line| {
                line.split(',').map(str::trim).any(|name| {
                    name.eq_ignore_ascii_case("version") || name.eq_ignore_ascii_case("parents")
                })
            })
        })
}

/// The key under which requests share a session: the resource variant
/// (host, path, the `Vary`'d values, credentials), plus `Accept`,
/// `Accept-Encoding` and the Braid request headers but `Parents` (where a
/// request starts is decided by the window).
pub fn relay_key(key: &Key, headers: &HeaderMap) -> String {
    let mut out = view_key(key, headers);
    add_values(
        &mut out,
        headers,
        &["peer", "merge-type", "subscribe", "heartbeats", "version"],
    );
    out
}

/// The key of the representation a request gets: its variant and its
/// content negotiation (`Accept`, `Accept-Encoding`); the relay key is
/// this plus the Braid request headers.
fn view_key(key: &Key, headers: &HeaderMap) -> String {
    let mut out = format!("{}\n{}", key.path, key.secondary);
    add_values(&mut out, headers, &["accept", "accept-encoding"]);
    out
}

/// Appends `name:value,value,` lines for each of `names`.
fn add_values(out: &mut String, headers: &HeaderMap, names: &[&str]) {
    for name in names {
        out.push('\n');
        out.push_str(name);
        out.push(':');
        for v in headers.get_all(*name) {
            out.push_str(&String::from_utf8_lossy(v.as_bytes()));
            out.push(',');
        }
    }
}

/// A 209's `Vary` without Braid's own request headers (braid-http's
/// server names `Version, Parents, Subscribe`), which every relay key has.
fn subscription_vary(headers: &HeaderMap) -> Vary {
    match rules::vary(headers) {
        Vary::Names(names) => {
            let names: Vec<_> = names
                .into_iter()
                .filter(|n| !matches!(n.as_str(), "version" | "parents" | "subscribe"))
                .collect();
            if names.is_empty() {
                Vary::None
            } else {
                Vary::Names(names)
            }
        }
        other => other,
    }
}

/// A GET answered from a live model: its status and representation
/// headers, `Version`, `Current-Version`, `Repr-Digest`, an `ETag` naming
/// the version, and `Cache-Status`; 304 when `If-None-Match` names it.
fn serve_known<B>(req: &Request<B>, known: &Known, proxy_id: &str) -> Response<Body> {
    let status = known
        .status
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    let mut response = Response::new(crate::floor::body::empty());
    let h = response.headers_mut();
    for (name, value) in &known.headers {
        h.insert(name.clone(), value.clone());
    }
    let version = http::HeaderValue::from_str(&known.version.to_header_value()).ok();
    let etag = match known.version.iter().collect::<Vec<_>>().as_slice() {
        [one] => http::HeaderValue::from_str(&format!("\"{}\"", one.as_str())).ok(),
        _ => None,
    };
    if let Some(v) = version {
        h.insert("version", v.clone());
        h.insert("current-version", v);
    }
    if let Ok(v) = http::HeaderValue::from_str(&crate::state::repr_digest(&known.body)) {
        h.insert("repr-digest", v);
    }
    if let Ok(v) = http::HeaderValue::from_str(&format!(
        "\"{proxy_id}\"; hit; detail=\"live upstream subscription\""
    )) {
        h.insert("cache-status", v);
    }
    let tag = etag.as_ref().and_then(|v| v.to_str().ok());
    let matched = req
        .headers()
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| rules::if_none_match(v, tag));
    if let Some(etag) = etag {
        h.insert(header::ETAG, etag);
    }
    if matched && status == StatusCode::OK {
        *response.status_mut() = StatusCode::NOT_MODIFIED;
        for name in [header::CONTENT_TYPE, header::CONTENT_LANGUAGE] {
            response.headers_mut().remove(name);
        }
        return response;
    }
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_LENGTH,
        http::HeaderValue::from(known.body.len()),
    );
    if req.method() != http::Method::HEAD {
        *response.body_mut() = crate::floor::body::full(known.body.clone());
    }
    response
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
