//! Watchers: how the proxy learns that a resource changed. One watcher task
//! per resource, however many subscribers it has.
//!
//! While a resource has subscribers, its watcher first asks the upstream
//! for a Braid subscription (`Subscribe: true`). A 209 makes the upstream a
//! Braid upstream: the watcher holds that one subscription, decodes its
//! updates and publishes them with the upstream's version ids, reopening it
//! with `Parents:` set to the last version received when it ends or breaks.
//! Any other answer is taken as a plain resource, and the watcher polls it
//! with conditional requests instead. Either way it revalidates when woken
//! (write-through, the refresh hook, a plain GET of a stale state), backs
//! off on errors, and ends after the resource has been idle.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tracing::{debug, warn};

use crate::body;
use crate::braid::{self, DecodeError, DecodeLimits, Decoder, Update, VersionList};
use crate::cache::{self, Timing};
use crate::metrics::Metrics;
use crate::proxy::UpstreamClient;
use crate::resource::{Change, History, Registry, Resource, State, Stored, Tuning};

/// What a watcher needs, shared by all of them.
pub struct Watchers {
    pub client: UpstreamClient,
    pub registry: Arc<Registry>,
    pub history: Arc<History>,
    pub tuning: Tuning,
    pub metrics: Arc<Metrics>,
    pub poll_interval: Duration,
    pub resource_idle: Duration,
    pub max_body_bytes: usize,
    pub max_header_bytes: usize,
    pub response_timeout: Duration,
    /// The heartbeat interval asked of a Braid upstream.
    pub upstream_heartbeat: Duration,
    /// Set when the proxy shuts down: every watcher ends.
    pub closing: tokio::sync::watch::Receiver<bool>,
}

/// Longest wait between attempts after repeated errors.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// First wait before reopening a Braid upstream subscription.
const FIRST_RECONNECT: Duration = Duration::from_millis(100);
/// A Braid upstream subscription open this long was healthy: the next
/// reconnect starts the backoff over.
const HEALTHY_FOR: Duration = Duration::from_secs(2);
/// Longest a write-through or refresh waits for a Braid upstream's update.
const WRITE_WAIT: Duration = Duration::from_secs(1);
/// How often a polled resource with subscribers asks again whether the
/// upstream speaks Braid (it may have answered 200 or 404 from a load
/// balancer or a restarting tier).
const REPROBE: Duration = Duration::from_secs(300);

/// How the upstream tells this resource's changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Not asked yet, or every answer so far was an error.
    Unknown,
    /// It answered `Subscribe` with 209.
    Braid,
    /// It answered `Subscribe` with a plain response: poll it.
    Poll,
}

/// One watcher's own state.
struct Watch {
    resource: Arc<Resource>,
    validators: Validators,
    mode: Mode,
    /// Consecutive Braid subscription failures, for the backoff.
    failures: u32,
    /// Ask the upstream for a fresh snapshot (no `Parents`) next time.
    resync: bool,
    /// A Braid upstream subscription was opened before (the next is a reconnect).
    subscribed_before: bool,
    /// When the upstream last answered `Subscribe` with something but 209.
    polled_since: Instant,
}

/// How a Braid upstream subscription attempt ended.
enum Followed {
    /// The resource has had no subscribers for the idle time.
    Idle,
    /// Try again after this long.
    Retry(Duration),
    /// The upstream answered with a plain response, which was used as a poll.
    Polled,
}

/// Why an open upstream subscription was closed.
enum End {
    Idle,
    Closed,
    /// Nothing, not even a heartbeat, for three heartbeat intervals.
    Silent,
    Broken(String),
    /// The stream cannot be followed from here: reopen it for a snapshot.
    Resync(&'static str),
    /// An update over `max-body-bytes`: recorded as an error; poll from now on.
    TooLarge,
}

/// Counts an open upstream subscription in the gauge while it lives.
struct Open<'a>(&'a Metrics);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.upstream_subscriptions.fetch_sub(1, Relaxed);
    }
}

impl Watchers {
    /// Runs the one watcher of `resource` until it has had no subscribers
    /// for `--resource-idle`. Its requests carry the resource's template
    /// headers (the creating client's identity and forwarding headers).
    pub async fn watch(self: Arc<Self>, resource: Arc<Resource>) {
        let validators = resource
            .stored()
            .filter(|s| !s.from_stream)
            .map(|s| Validators {
                etag: s.headers.get(header::ETAG).cloned(),
                last_modified: s.headers.get(header::LAST_MODIFIED).cloned(),
            })
            .unwrap_or_default();
        let mut w = Watch {
            resource,
            validators,
            mode: Mode::Unknown,
            failures: 0,
            resync: false,
            subscribed_before: false,
            polled_since: Instant::now(),
        };
        let mut poll_backoff: Option<Duration> = None;
        let mut woken = true; // the creator wants a first state
        loop {
            if self.shutting_down() {
                return;
            }
            let subscribed = w.resource.subscribers() > 0;
            let mut braid_retry = None;
            let probe = w.mode != Mode::Poll || w.polled_since.elapsed() >= REPROBE;
            if subscribed && probe {
                match self.follow(&mut w).await {
                    Followed::Idle => {}
                    Followed::Retry(delay) => braid_retry = Some(delay),
                    Followed::Polled => poll_backoff = None,
                }
            } else if woken || subscribed {
                let ok = self.poll_once(&mut w).await;
                w.resource.validated(ok);
                poll_backoff = if ok {
                    None
                } else {
                    Some(poll_backoff.map_or(self.poll_interval, |b| (b * 2).min(MAX_BACKOFF)))
                };
            }
            let wait = if let Some(delay) = braid_retry {
                delay
            } else if w.resource.subscribers() > 0 {
                poll_backoff.unwrap_or(self.poll_interval)
            } else {
                self.poll_interval
                    .min(self.resource_idle)
                    .max(Duration::from_millis(10))
            };
            woken = self.pause(&w, wait, braid_retry.is_some()).await;
            if !woken && self.registry.watcher_done(&w.resource, self.resource_idle) {
                debug!(resource = w.resource.key(), "resource idle; watcher ends");
                return;
            }
        }
    }

    /// True once the proxy shuts down (or is gone).
    fn shutting_down(&self) -> bool {
        *self.closing.borrow() || self.closing.has_changed().is_err()
    }

    /// Waits `wait` or until woken; true when woken. Waiting out a Braid
    /// reconnect backoff is not cut short: a wake then only answers the
    /// waiting request at once (the state cannot be revalidated yet).
    async fn pause(&self, w: &Watch, wait: Duration, backing_off: bool) -> bool {
        let until = tokio::time::Instant::now() + wait;
        let mut closing = self.closing.clone();
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => return false,
                _ = closing.changed() => return false,
                _ = w.resource.wake.notified() => {
                    if !backing_off {
                        return true;
                    }
                    w.resource.validated(false);
                }
            }
        }
    }

    /// Opens a Braid subscription to the upstream and follows it until it
    /// ends, breaks, or the resource goes idle.
    async fn follow(&self, w: &mut Watch) -> Followed {
        let head = w.resource.head();
        let mut parents =
            (!w.resync && head.seq > 0 && !head.version.is_empty()).then(|| head.version.clone());
        w.resync = false;
        let sent = SystemTime::now();
        let response = loop {
            let response = match self.send(w, Some(parents.as_ref())).await {
                Ok(response) => response,
                Err(reason) => {
                    warn!(resource = w.resource.key(), %reason, "upstream subscription failed");
                    return self.failed(w);
                }
            };
            let status = response.status().as_u16();
            if parents.is_some() && matches!(status, 309 | 410 | 432) {
                // It cannot resume from our version: start over from a snapshot.
                debug!(
                    resource = w.resource.key(),
                    status, "upstream cannot resume; asking for a snapshot"
                );
                Metrics::inc(&self.metrics.upstream_resyncs_total);
                parents = None;
                continue;
            }
            break response;
        };
        if response.status().as_u16() != 209 {
            let ok = self.absorb_plain(w, response, sent).await;
            w.resource.validated(ok);
            if !ok {
                return self.failed(w);
            }
            if w.mode != Mode::Poll {
                debug!(
                    resource = w.resource.key(),
                    "upstream answered Subscribe without 209; polling it"
                );
            }
            w.mode = Mode::Poll;
            w.resource.set_braid_upstream(false);
            w.polled_since = Instant::now();
            return Followed::Polled;
        }
        if w.mode != Mode::Braid {
            debug!(
                resource = w.resource.key(),
                "upstream speaks Braid; following its subscription"
            );
        }
        w.mode = Mode::Braid;
        w.resource.set_braid_upstream(true);
        if std::mem::replace(&mut w.subscribed_before, true) {
            Metrics::inc(&self.metrics.upstream_reconnects_total);
        }
        let opened = Instant::now();
        let end = self.stream(w, response).await;
        if opened.elapsed() >= HEALTHY_FOR {
            w.failures = 0;
        }
        match end {
            End::Idle => return Followed::Idle,
            End::Closed => debug!(resource = w.resource.key(), "upstream subscription ended"),
            // An upstream that sends no heartbeats: reopen quietly.
            End::Silent => debug!(resource = w.resource.key(), "upstream subscription silent"),
            End::Broken(reason) => {
                warn!(resource = w.resource.key(), %reason, "upstream subscription broke")
            }
            End::Resync(reason) => {
                warn!(
                    resource = w.resource.key(),
                    reason, "upstream update not usable here; asking for a snapshot"
                );
                Metrics::inc(&self.metrics.upstream_resyncs_total);
                w.resync = true;
            }
            End::TooLarge => {
                w.mode = Mode::Poll;
                w.polled_since = Instant::now();
                return Followed::Polled;
            }
        }
        self.failed(w)
    }

    /// Records a failed or ended subscription; the delay before the next one.
    fn failed(&self, w: &mut Watch) -> Followed {
        w.resource.validated(false);
        let exp = FIRST_RECONNECT.saturating_mul(1u32 << w.failures.min(16));
        w.failures = w.failures.saturating_add(1);
        Followed::Retry(jitter(exp.min(MAX_BACKOFF)))
    }

    /// Reads an open upstream subscription, publishing every update.
    async fn stream(&self, w: &mut Watch, response: Response<Incoming>) -> End {
        let resource = w.resource.clone();
        let content_type = text_header(response.headers(), header::CONTENT_TYPE);
        let mut body = response.into_body();
        let mut decoder = Decoder::new(DecodeLimits {
            max_header_block: self.max_header_bytes,
            max_content_length: self.max_body_bytes,
            ..DecodeLimits::default()
        });
        self.metrics.upstream_subscriptions.fetch_add(1, Relaxed);
        let _open = Open(&self.metrics);
        resource.set_live(true);
        // Set when a request waits on this watcher: the time by which it is
        // answered (a write-through's wait for the pushed update, or the
        // first state of a new resource).
        let mut validate_by = None;
        if resource.head().seq == 0 {
            validate_by = Some(tokio::time::Instant::now() + self.response_timeout);
        } else {
            resource.validated(true);
        }
        let silence = self.upstream_heartbeat * 3;
        let mut heard = tokio::time::Instant::now();
        let idle_check = self
            .resource_idle
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        let mut tick = tokio::time::interval(idle_check);
        let mut closing = self.closing.clone();
        let end = loop {
            let answer_at = validate_by.unwrap_or_else(|| heard + silence);
            tokio::select! {
                frame = body.frame() => match frame {
                    None => break End::Closed,
                    Some(Err(e)) => break End::Broken(e.to_string()),
                    Some(Ok(frame)) => {
                        heard = tokio::time::Instant::now();
                        let Ok(data) = frame.into_data() else { continue };
                        decoder.push(&data);
                        match self.drain(w, &mut decoder, content_type.as_deref()) {
                            Ok(true) if validate_by.take().is_some() => resource.validated(true),
                            Ok(_) => {}
                            Err(end) => break end,
                        }
                    }
                },
                _ = tokio::time::sleep_until(heard + silence) => break End::Silent,
                _ = resource.wake.notified() => {
                    // A write went through: give the upstream a moment to push it.
                    let limit = WRITE_WAIT.min(self.poll_interval);
                    validate_by.get_or_insert(tokio::time::Instant::now() + limit);
                }
                _ = tokio::time::sleep_until(answer_at), if validate_by.is_some() => {
                    validate_by = None;
                    resource.validated(true);
                }
                _ = closing.changed() => break End::Idle,
                _ = tick.tick() => {
                    if resource.subscribers() == 0 && resource.idle_for() >= self.resource_idle {
                        break End::Idle;
                    }
                }
            }
        };
        resource.set_live(false);
        end
    }

    /// Publishes every complete update the decoder holds. True when one
    /// changed the state.
    fn drain(
        &self,
        w: &mut Watch,
        decoder: &mut Decoder,
        content_type: Option<&str>,
    ) -> Result<bool, End> {
        let mut changed = false;
        loop {
            match decoder.next_update() {
                Ok(Some(update)) => {
                    Metrics::inc(&self.metrics.upstream_updates_total);
                    changed |= self.absorb_update(w, update, content_type)?;
                }
                Ok(None) => return Ok(changed),
                Err(DecodeError::ContentLengthTooLarge { .. }) => {
                    warn!(
                        resource = w.resource.key(),
                        "upstream update over max-body-bytes"
                    );
                    self.publish(&w.resource, Change::derived(too_large(self.max_body_bytes)));
                    return Err(End::TooLarge);
                }
                Err(DecodeError::TooManyPatches { .. }) => {
                    return Err(End::Resync("an update with too many patches"))
                }
                Err(e) => return Err(End::Broken(format!("malformed update: {e}"))),
            }
        }
    }

    /// Publishes one upstream update under the upstream's version. Patches
    /// apply to the current state when their parents are its version; a
    /// snapshot replaces it, and the subscribers get a local diff.
    fn absorb_update(
        &self,
        w: &mut Watch,
        update: Update,
        content_type: Option<&str>,
    ) -> Result<bool, End> {
        let head = w.resource.head();
        if head.seq > 0 && !update.version.is_empty() && update.version == head.version {
            // Already have it. (An id seen earlier is not dropped: content
            // that went back to an earlier state has that state's id again.)
            return Ok(false);
        }
        let version = Some(update.version).filter(|v| !v.is_empty());
        // The update's own Content-Type, else the 209's, else the one held.
        let held_type = match &head.state {
            State::Present { content_type, .. } => content_type.as_deref(),
            _ => None,
        };
        let content_type = update
            .extra_headers
            .iter()
            .find(|(name, _)| name == header::CONTENT_TYPE)
            .and_then(|(_, v)| v.to_str().ok())
            .or(content_type)
            .or(held_type)
            .map(str::to_string);
        let digest = update
            .extra_headers
            .iter()
            .find(|(name, _)| name == "repr-digest")
            .and_then(|(_, v)| v.to_str().ok())
            .map(str::to_string);
        let change = match update.body {
            braid::Body::Snapshot(body) => Change {
                state: state_of(update.status, body, content_type),
                version,
                patches: None,
            },
            braid::Body::Patches(patches) => {
                let State::Present {
                    body: old,
                    content_type: old_type,
                    ..
                } = &head.state
                else {
                    return Err(End::Resync("patches to a state that has no body"));
                };
                if update.status.is_some_and(|s| s != 200) {
                    return Err(End::Resync("patches with a status other than 200"));
                }
                if !update.parents.is_empty() && update.parents != head.version {
                    return Err(End::Resync("patches whose parents are not our version"));
                }
                let new = braid::apply_patches(old, &patches)
                    .map_err(|_| End::Resync("patches that do not apply to our state"))?;
                // They applied, so every range parsed: pass them on canonical.
                let patches: Vec<braid::Patch> = patches
                    .into_iter()
                    .map(|mut p| {
                        if let Some((a, b)) = p.span() {
                            p.range = format!("[{a}:{b}]");
                        }
                        p
                    })
                    .collect();
                if new.len() > self.max_body_bytes {
                    self.publish(&w.resource, Change::derived(too_large(self.max_body_bytes)));
                    return Err(End::TooLarge);
                }
                Change {
                    state: State::Present {
                        body: Bytes::from(new),
                        content_type: old_type.clone(),
                        etag: None,
                    },
                    version,
                    patches: Some(patches),
                }
            }
        };
        if let (Some(claimed), State::Present { body, .. }) = (&digest, &change.state) {
            if !digest_matches(claimed, body) {
                return Err(End::Resync("a body that does not match its Repr-Digest"));
            }
        }
        let changed = self.publish(&w.resource, change);
        self.store_streamed(&w.resource);
        Ok(changed)
    }

    /// Stores the head learned from a Braid upstream for plain GETs; it is
    /// reused only while that subscription is live.
    fn store_streamed(&self, resource: &Resource) {
        let head = resource.head();
        let State::Present { content_type, .. } = &head.state else {
            resource.set_stored(None);
            return;
        };
        let mut headers = http::HeaderMap::new();
        if let Some(v) = content_type
            .as_deref()
            .and_then(|ct| HeaderValue::from_str(ct).ok())
        {
            headers.insert(header::CONTENT_TYPE, v);
        }
        resource.set_stored(Some(Stored {
            status: StatusCode::OK,
            headers,
            body: head.body(),
            timing: Timing::now(),
            version: Some(head.version.clone()),
            from_stream: true,
            invalid: false,
        }));
        self.registry.enforce_cap();
    }

    fn publish(&self, resource: &Resource, change: Change) -> bool {
        resource.publish(change, &self.history, &self.tuning, &self.metrics)
    }

    /// Sends a GET for the resource: a Braid subscription when `subscribe`
    /// is `Some` (with those parents), else a conditional poll.
    async fn send(
        &self,
        w: &Watch,
        subscribe: Option<Option<&VersionList>>,
    ) -> Result<Response<Incoming>, String> {
        let mut req = self
            .plain_get(&w.resource, None)
            .map_err(|e| e.to_string())?;
        let headers = req.headers_mut();
        match subscribe {
            Some(parents) => {
                headers.insert("subscribe", HeaderValue::from_static("true"));
                let secs = self.upstream_heartbeat.as_secs_f64().ceil().max(1.0) as u64;
                if let Ok(v) = HeaderValue::from_str(&format!("{secs}s")) {
                    headers.insert("heartbeats", v);
                }
                if let Some(v) =
                    parents.and_then(|p| HeaderValue::from_str(&p.to_header_value()).ok())
                {
                    headers.insert("parents", v);
                }
            }
            None if w.resource.head().seq > 0 => {
                if let Some(etag) = &w.validators.etag {
                    headers.insert(header::IF_NONE_MATCH, etag.clone());
                } else if let Some(date) = &w.validators.last_modified {
                    headers.insert(header::IF_MODIFIED_SINCE, date.clone());
                }
            }
            None => {}
        }
        self.client.send_watch(req).await.map_err(|e| e.to_string())
    }

    /// A GET of `resource` as its watcher sends it: the resource's template
    /// headers (the creating client's identity and forwarding headers),
    /// no content coding, and `If-None-Match` when given.
    pub fn plain_get(
        &self,
        resource: &Resource,
        if_none_match: Option<HeaderValue>,
    ) -> Result<Request<crate::body::Body>, crate::error::Refusal> {
        let mut req = Request::new(body::empty());
        *req.method_mut() = Method::GET;
        *req.uri_mut() = self.client.uri_for(resource.key())?;
        *req.headers_mut() = resource.template.clone();
        let headers = req.headers_mut();
        // Patches are made of the decoded text: ask for no content coding.
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        if let Some(etag) = if_none_match {
            headers.insert(header::IF_NONE_MATCH, etag);
        }
        Ok(req)
    }

    /// One conditional request; publishes what changed. False on failure.
    async fn poll_once(&self, w: &mut Watch) -> bool {
        let sent = SystemTime::now();
        match self.send(w, None).await {
            Ok(response) => self.absorb_plain(w, response, sent).await,
            Err(reason) => {
                warn!(resource = w.resource.key(), %reason, "poll failed");
                false
            }
        }
    }

    /// Publishes what a plain (non-209) response to the watcher says. False
    /// when unusable.
    async fn absorb_plain(
        &self,
        w: &mut Watch,
        response: Response<Incoming>,
        sent: SystemTime,
    ) -> bool {
        let resource = w.resource.clone();
        let status = response.status();
        let timing = Timing {
            request_time: sent,
            response_time: SystemTime::now(),
        };
        if status == StatusCode::NOT_MODIFIED {
            Metrics::inc(&self.metrics.polls_not_modified_total);
            self.not_modified(&resource, response.headers(), timing);
            return true;
        }
        if !matches!(
            status,
            StatusCode::OK | StatusCode::NOT_FOUND | StatusCode::GONE
        ) {
            warn!(
                resource = resource.key(),
                status = status.as_u16(),
                "origin answered with an unusable status"
            );
            return false;
        }
        if let Err(refusal) = self.check_shareable(&resource, response.headers()) {
            warn!(resource = resource.key(), %refusal, "cannot track this resource");
            return false;
        }
        w.validators = Validators {
            etag: response.headers().get(header::ETAG).cloned(),
            last_modified: response.headers().get(header::LAST_MODIFIED).cloned(),
        };
        let declared = response
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let (parts, body) = response.into_parts();
        let body = if declared.is_some_and(|n| n > self.max_body_bytes as u64) {
            Err(BodyFailure::TooLarge)
        } else {
            self.read_body(body).await
        };
        let body = match body {
            Ok(body) => body,
            Err(BodyFailure::TooLarge) => {
                warn!(
                    resource = resource.key(),
                    "origin body over max-body-bytes; not tracked"
                );
                self.publish(&resource, Change::derived(too_large(self.max_body_bytes)));
                return true;
            }
            Err(BodyFailure::Broken(reason)) => {
                warn!(resource = resource.key(), %reason, "origin body failed");
                return false;
            }
        };
        // The watcher asked for no content coding; a stored copy for plain
        // GETs is only kept where that does not change the variant.
        let for_gets = !matches!(
            cache::vary(&parts.headers),
            cache::Vary::Names(ref names) if names.contains(&header::ACCEPT_ENCODING)
        );
        self.absorb_fetched(
            &resource,
            parts.status,
            &parts.headers,
            body,
            timing,
            for_gets,
        );
        true
    }

    /// Detaches `resource` when the origin's answer shows that it is not
    /// shareable under its key: a `Vary` other than the one the key was
    /// made with, or a private answer to a request without credentials.
    fn check_shareable(
        &self,
        resource: &Arc<Resource>,
        headers: &http::HeaderMap,
    ) -> Result<(), crate::error::Refusal> {
        let vary = cache::vary(headers);
        let cc = cache::CacheControl::parse(headers);
        let personal = cc.private || cc.no_store || headers.contains_key(header::SET_COOKIE);
        if vary != resource.vary {
            self.registry.record_vary(resource.key(), &vary);
        }
        if vary != resource.vary || (personal && !resource.private) {
            self.registry.detach(resource)?;
        }
        Ok(())
    }

    /// Records a 304: the stored answer's headers are updated (RFC 9111
    /// §4.3.4) and its age starts over.
    pub fn not_modified(&self, resource: &Resource, headers: &http::HeaderMap, timing: Timing) {
        if resource.written_since(timing.request_time) {
            return;
        }
        if let Some(stored) = resource.stored().filter(|s| !s.from_stream) {
            let mut updated = Stored::clone(&stored);
            updated.headers = cache::merge_not_modified(&stored.headers, headers);
            updated.timing = timing;
            updated.invalid = false;
            resource.set_stored(Some(updated));
        }
    }

    /// Records a complete answer from the origin, from a watcher's poll or
    /// a client's GET: publishes the state to subscribers (a 200 without
    /// content coding, 404 or 410) and, when `for_gets`, stores it for
    /// plain GETs. The one path every plain answer takes into the state.
    pub fn absorb_fetched(
        &self,
        resource: &Resource,
        status: StatusCode,
        headers: &http::HeaderMap,
        body: Bytes,
        timing: Timing,
        for_gets: bool,
    ) {
        if resource.written_since(timing.request_time) {
            // Asked before a write through the proxy landed: this answer may
            // undo the write for subscribers. The next poll tells.
            debug!(
                resource = resource.key(),
                "answer predates a write; not recorded"
            );
            resource.wake.notify_one();
            return;
        }
        let encoded = headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| !v.trim().eq_ignore_ascii_case("identity"));
        let state = match status {
            StatusCode::OK if !encoded => Some(State::Present {
                body: body.clone(),
                content_type: text_header(headers, header::CONTENT_TYPE),
                etag: text_header(headers, header::ETAG),
            }),
            StatusCode::NOT_FOUND | StatusCode::GONE => Some(State::Missing {
                status: status.as_u16(),
            }),
            _ => None,
        };
        // A Braid server names its version; tiers then share ids.
        let version = headers
            .get("version")
            .and_then(|v| VersionList::parse_named(v.as_bytes(), "Version").ok())
            .filter(|v| !v.is_empty() && status == StatusCode::OK);
        let changed = match state {
            Some(state) => self.publish(
                resource,
                Change {
                    state,
                    version,
                    patches: None,
                },
            ),
            None => false,
        };
        let head = resource.head();
        let body_is_head = status == StatusCode::OK && !encoded && head.seq > 0;
        if for_gets {
            resource.set_stored(Some(Stored {
                status,
                headers: cache::stored_headers(headers),
                body: if body_is_head { head.body() } else { body },
                timing,
                version: body_is_head.then(|| head.version.clone()),
                from_stream: false,
                invalid: false,
            }));
            resource.uncacheable.store(false, Relaxed);
        } else if changed {
            resource.invalidate();
        }
        self.registry.enforce_cap();
    }

    /// Reads a body up to the limit, bounded in time by the response timeout.
    pub(crate) async fn read_body(&self, body: Incoming) -> Result<Bytes, BodyFailure> {
        let limited = http_body_util::Limited::new(body, self.max_body_bytes);
        match tokio::time::timeout(self.response_timeout, limited.collect()).await {
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(e))
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some() =>
            {
                Err(BodyFailure::TooLarge)
            }
            Ok(Err(e)) => Err(BodyFailure::Broken(e.to_string())),
            Err(_) => Err(BodyFailure::Broken(format!(
                "body not received within {:?}",
                self.response_timeout
            ))),
        }
    }
}

/// Whether a `Repr-Digest` value agrees with a body. Only its `sha-256`
/// member is checked; a value without one agrees with anything.
fn digest_matches(claimed: &str, body: &[u8]) -> bool {
    let ours = crate::resource::repr_digest(body);
    claimed
        .split(',')
        .map(str::trim)
        .filter(|member| member.starts_with("sha-256="))
        .all(|member| member == ours)
}

/// The state an upstream snapshot update stands for.
fn state_of(status: Option<u16>, body: Bytes, content_type: Option<String>) -> State {
    match status.unwrap_or(200) {
        200 => State::Present {
            body,
            content_type,
            etag: None,
        },
        status @ (404 | 410) => State::Missing { status },
        status => State::Error {
            status,
            reason: String::from_utf8_lossy(&body).trim_end().to_string(),
        },
    }
}

/// Spreads reconnects of many resources (and many edges) apart: adds up to
/// a quarter of `delay`.
fn jitter(delay: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    delay + delay.mul_f64(f64::from(nanos % 1000) / 4000.0)
}

pub(crate) enum BodyFailure {
    TooLarge,
    Broken(String),
}

fn too_large(limit: usize) -> State {
    State::Error {
        status: 502,
        reason: format!("origin body is larger than max-body-bytes ({limit} bytes)"),
    }
}

fn text_header(headers: &http::HeaderMap, name: header::HeaderName) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The validators of the last representation, for conditional polls.
#[derive(Default)]
struct Validators {
    etag: Option<HeaderValue>,
    last_modified: Option<HeaderValue>,
}

/// Waits until a revalidation newer than `since` has completed, or `limit` passes.
pub async fn await_validation(resource: &Resource, since: u64, limit: Duration) -> bool {
    let mut rx = resource.validations();
    let deadline = Instant::now() + limit;
    loop {
        if rx.borrow_and_update().generation > since {
            return true;
        }
        match tokio::time::timeout_at(deadline.into(), rx.changed()).await {
            Ok(Ok(())) => continue,
            _ => return false,
        }
    }
}
