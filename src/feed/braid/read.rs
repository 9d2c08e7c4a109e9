//! Reading the upstream's 209 body: framing it into the session's window
//! of updates as received ([`Received`]), announcing each read to the
//! subscribers, ending on a malformed update, and, with
//! `--hold-upstream-breaks`, resuming a broken stream.

use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tracing::{debug, warn};

use crate::braid::{self, FrameError, Framer, Piece, VersionList};
use crate::config::Config;
use crate::floor::sync::lock;
use crate::metrics::Metrics;

use super::*;

/// The updates a session received, oldest first, bounded in count and bytes.
#[derive(Default)]
pub(super) struct Received {
    /// Sequence number of `entries[0]`; entries count from 0 for the stream's first.
    pub(super) first: u64,
    pub(super) entries: VecDeque<Entry>,
    pub(super) bytes: usize,
    /// Entries that are updates (not blank lines).
    pub(super) updates: usize,
    /// Set once the stream did not frame: nobody joins any more, and the
    /// session is ending.
    pub(super) malformed: bool,
    /// What the session's model holds ([`Model::weight`]), counted with
    /// the window's bytes.
    pub(super) model: usize,
    /// What the framer's read buffer holds (an update being read), counted
    /// with the window's bytes; and how much of it is not framed yet.
    pub(super) partial: (usize, usize),
    /// Blank lines framed since the newest update.
    pub(super) blanks_since_update: usize,
    /// How many blank lines the upstream writes after an update, as it did
    /// after the one before the newest; `None` before that is known.
    pub(super) blanks_after_updates: Option<usize>,
    /// An update was framed.
    pub(super) seen_update: bool,
    /// When the newest update was framed (the operator's page shows it).
    pub(super) last_update: Option<Instant>,
}

/// The blank lines braid-http's server writes after every update, expected
/// after an upstream's first update (the next ones expect what it did).
pub(super) const USUAL_BLANKS_AFTER_UPDATE: usize = 2;

impl Received {
    /// Learns how many blank lines the upstream writes after an update.
    pub(super) fn framed(&mut self, update: bool) {
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
    pub(super) fn lacks_blank_lines(&self) -> bool {
        self.blanks_since_update
            < self
                .blanks_after_updates
                .unwrap_or(USUAL_BLANKS_AFTER_UPDATE)
    }
}

/// Bytes of the stream as received: one update, a blank line, or (once
/// unframeable) a chunk.
pub(super) struct Entry {
    pub(super) raw: Bytes,
    pub(super) version: Option<VersionList>,
    /// A blank line (heartbeat): counted in bytes, not against `--history-len`.
    pub(super) blank: bool,
    /// How the model applied it (`None`: not understood, or not an update).
    pub(super) applied: Option<Arc<Applied>>,
}

impl Over {
    pub(super) fn describe(&self) -> String {
        match self {
            Over::Ended => "ended by the upstream".to_string(),
            Over::Broken(e) => format!("broken: {e}"),
            Over::Malformed(e) => format!("ended on a malformed update: {e}"),
            Over::Full => {
                "the proxy's state went over --state-bytes while its first update was read"
                    .to_string()
            }
            Over::Silent(d) => format!("no byte for {d:?} (heartbeats stopped)"),
            Over::NoSubscribers => "its last subscriber left".to_string(),
            Over::Closing => "the proxy shuts down".to_string(),
        }
    }
}

impl Received {
    /// Appends an entry, dropping the oldest beyond `--history-len`
    /// updates, `--max-body-bytes` bytes, or while all windows together
    /// hold more than `--history-bytes` (the newest always stays).
    /// `total` counts the bytes of all windows.
    pub(super) fn push(&mut self, entry: Entry, config: &Config, total: &AtomicUsize) {
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
    pub(super) fn extend_last(
        &mut self,
        more: &[u8],
        total: &AtomicUsize,
    ) -> Option<(Bytes, Bytes)> {
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
    pub(super) fn release(&mut self, total: &AtomicUsize) {
        total.fetch_sub(std::mem::take(&mut self.bytes), Relaxed);
        total.fetch_sub(std::mem::take(&mut self.model), Relaxed);
        total.fetch_sub(std::mem::take(&mut self.partial).0, Relaxed);
    }

    /// Counts what the framer holds now, and notes how much is unframed.
    pub(super) fn count_partial(&mut self, framer: &Framer, total: &AtomicUsize) {
        let held = framer.held();
        total.fetch_add(held, Relaxed);
        total.fetch_sub(
            std::mem::replace(&mut self.partial, (held, framer.buffered())).0,
            Relaxed,
        );
    }

    /// Counts what the session's model holds now (`now` bytes) with the window.
    pub(super) fn count_model(&mut self, now: usize, total: &AtomicUsize) {
        total.fetch_add(now, Relaxed);
        total.fetch_sub(std::mem::replace(&mut self.model, now), Relaxed);
    }
}

impl Entry {
    pub(super) fn weight(&self) -> usize {
        self.raw.len() + if self.blank { BLANK_OVERHEAD } else { 0 }
    }
}

/// How long a 209 stream may send nothing before it counts as silent:
/// from the `Heartbeats` its head announced, later than braid-http's client
/// gives up (1.2 × N + 3 s without a byte), so that its own timer tells it.
pub(super) fn silence_limit(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("heartbeats")
        .and_then(|v| braid::parse_heartbeats(v.as_bytes()).ok())
        .filter(|d| !d.is_zero())
        .map(|d| d * 2 + Duration::from_secs(5))
}

impl Relays {
    /// Reads the upstream body into the session's window until it is over;
    /// with `--hold-upstream-breaks`, first tries (for that long) to resume
    /// an ended or broken stream from the last version the upstream sent.
    pub(super) async fn read(
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
            self.remember_malformed(&lock(&session.opened).key);
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
    pub(super) async fn follow(
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
    pub(super) fn take(
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
        if let Some(over) = self.refused_while_opening(session) {
            return Some(over);
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
                        .or_else(|| self.refused_while_opening(session))
                    {
                        return Some(over);
                    }
                }
            }
        }
        None
    }

    /// [`Over::Full`] for a session whose opener is not answered yet, once
    /// the bytes read (counted as they are) put the proxy over the cap.
    fn refused_while_opening(&self, session: &Session) -> Option<Over> {
        if session.admitted.load(Relaxed) || !self.registry.is_full() {
            return None;
        }
        session.refused_full.store(true, Relaxed);
        Some(Over::Full)
    }

    /// Whether the newest entry is an update subscribers have not heard of
    /// yet that lacks blank lines its upstream usually writes after one.
    pub(super) fn awaits_blank_lines(session: &Session) -> bool {
        let announced = session.tick.borrow().end;
        let window = lock(&session.window);
        window.lacks_blank_lines()
            && !window.malformed
            && window.entries.back().is_some_and(|e| !e.blank)
            && window.first + window.entries.len() as u64 > announced
    }

    /// True (and the session ended) when its last subscriber has left;
    /// decided under the lock a joiner takes, so none comes in between.
    pub(super) fn none_left(&self, session: &Session) -> bool {
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
    pub(super) async fn resume(&self, session: &Session) -> Option<(Incoming, Option<Duration>)> {
        let deadline = tokio::time::Instant::now() + self.config.hold_upstream_breaks;
        let (uri, mut headers) = lock(&session.opened).request.clone()?;
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
    pub(super) fn absorb(
        &self,
        session: &Session,
        framer: &mut Framer,
        data: &[u8],
    ) -> Option<Over> {
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
                Ok(None) => {
                    window.count_partial(framer, &self.window_bytes);
                    return None;
                }
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
    pub(super) fn announce(session: &Session) {
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
}
