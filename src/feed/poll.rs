//! Watchers: how the proxy learns that a plain origin's resource changed.
//! One watcher task per resource, however many subscribers it has.
//!
//! A watcher polls its resource with conditional requests while it has
//! subscribers, publishes what changed (the proxy is the Braid server
//! here: it names the versions and diffs), revalidates when woken
//! (write-through, the refresh hook, a plain GET of a stale state), backs
//! off on errors, and ends after the resource has been idle, or at once
//! when the origin refuses its credentials (401, 403: its subscribers are
//! sent that answer as their last update). A Braid
//! upstream is not watched: its subscriptions are relayed
//! ([`crate::feed::braid`]).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tracing::{debug, warn};

use super::pace::{spread, Budget, Cadence};
use crate::braid::VersionList;
use crate::floor::body;
use crate::floor::rules::{self, Timing};
use crate::metrics::Metrics;
use crate::state::{
    AnswerRules, Change, History, Registry, Resource, State, Stored, Ticket, Tuning,
};
use crate::upstream::UpstreamClient;

/// What a watcher needs, shared by all of them.
pub struct Watchers {
    pub client: UpstreamClient,
    pub registry: Arc<Registry>,
    pub history: Arc<History>,
    pub tuning: Tuning,
    pub metrics: Arc<Metrics>,
    pub poll_interval: Duration,
    /// Longest interval a quiet resource is polled at (`--poll-max-interval`).
    pub poll_max_interval: Duration,
    /// What the watchers may ask of the origin (`--origin-rps`, `Retry-After`).
    pub budget: Budget,
    pub resource_idle: Duration,
    pub max_body_bytes: usize,
    pub max_header_bytes: usize,
    pub response_timeout: Duration,
    /// Set when the proxy shuts down: every watcher ends.
    pub closing: tokio::sync::watch::Receiver<bool>,
    /// Bytes of origin bodies (and written bodies) being read now,
    /// counted against `--state-bytes` (the registry reads it).
    pub reading: Arc<std::sync::atomic::AtomicUsize>,
}

/// Longest wait between attempts after repeated errors.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One watcher's own state.
struct Watch {
    resource: Arc<Resource>,
    validators: Validators,
    /// Its interval: short while it changes, long while quiet.
    cadence: Cadence,
    /// Polls sent, for the spread of the next interval.
    turn: u64,
}

impl Watchers {
    /// Runs the one watcher of `resource` until it has had no subscribers
    /// for `--resource-idle`. While it has subscribers it polls, at an
    /// interval that starts at `--poll-interval` and doubles while the
    /// resource is quiet, up to `--poll-max-interval` (a change, a write,
    /// a refresh or a new subscriber brings it back), within the origin's
    /// budget ([`Budget`]). Without subscribers it polls only when woken:
    /// a new subscription wakes it and waits for that answer before its
    /// 209 names a version ([`Watchers::revalidate_for`]). Its requests
    /// carry the resource's template headers (the creating client's
    /// identity and forwarding headers). `seeded`: the resource's first
    /// state came from the client's own request, so the first poll waits
    /// one interval.
    pub async fn watch(self: Arc<Self>, resource: Arc<Resource>, seeded: bool) {
        let validators = resource
            .stored()
            .map(|s| Validators::of(&s.headers))
            .unwrap_or_default();
        let mut w = Watch {
            resource,
            validators,
            cadence: Cadence::new(self.poll_interval, self.poll_max_interval),
            turn: 0,
        };
        let mut poll_backoff: Option<Duration> = None;
        let mut woken = !seeded; // the creator wants a first state
        let mut skip = seeded;
        loop {
            if self.shutting_down() || w.resource.is_gone() {
                w.resource.set_poll_interval(None);
                return;
            }
            let subscribed = w.resource.subscribers() > 0;
            if !std::mem::take(&mut skip) && (woken || subscribed) {
                if woken {
                    // A write, a refresh or a new subscriber: the resource
                    // is expected to change, or someone waits for it.
                    w.cadence.reset();
                }
                let urgent = woken || w.cadence.lively();
                let offset = spread(w.cadence.current(), w.resource.id(), w.turn, (0.0, 0.5));
                let mut closing = self.closing.clone();
                tokio::select! {
                    _ = self.budget.admit(urgent, offset) => {}
                    _ = closing.changed() => continue,
                }
                w.turn += 1;
                let (heard, sent_at) = self.poll_once(&mut w).await;
                w.resource.validated(sent_at.filter(|_| heard.answered()));
                poll_backoff = match heard {
                    Heard::Changed => {
                        w.cadence.reset();
                        None
                    }
                    Heard::Same => {
                        if !woken {
                            w.cadence.quiet();
                        }
                        None
                    }
                    Heard::Unusable | Heard::Nothing => {
                        Some(poll_backoff.map_or(self.poll_interval, |b| (b * 2).min(MAX_BACKOFF)))
                    }
                };
            }
            let wait = if w.resource.subscribers() > 0 {
                match poll_backoff {
                    Some(backoff) => {
                        w.resource.set_poll_interval(Some(backoff));
                        spread(backoff, w.resource.id(), w.turn, (0.9, 1.1))
                    }
                    None => {
                        w.resource.set_poll_interval(Some(w.cadence.current()));
                        w.cadence.wait(w.resource.id(), w.turn)
                    }
                }
            } else {
                w.resource.set_poll_interval(None);
                self.poll_interval
                    .min(self.resource_idle)
                    .max(Duration::from_millis(10))
            };
            woken = self.pause(&w, wait).await;
            if !woken && self.registry.watcher_done(&w.resource, self.resource_idle) {
                debug!(resource = w.resource.key(), "resource idle; watcher ends");
                w.resource.set_poll_interval(None);
                return;
            }
        }
    }

    /// Before a new subscription's 209 names `resource`'s version: unless
    /// the origin answered a request sent within `--poll-interval` before
    /// `asked.0` (when the subscription arrived; its watcher is as current
    /// as that), or `asked.1` (the client's version is unknown here), the
    /// watcher is woken and this waits, up to `limit`, for the answer to a
    /// request sent since then. An idle resource's stored state is an old
    /// answer, not the present: named current, a client coming from
    /// another shield that saw newer would go back. True when the state is
    /// as current as such an answer (or needed none). `wake`: false when
    /// its watcher was just started and polls at once anyway.
    pub async fn revalidate_for(
        &self,
        resource: &Resource,
        asked: (SystemTime, bool),
        wake: bool,
        limit: Duration,
    ) -> bool {
        let (asked, parents_unknown) = asked;
        let recent = resource.validation().sent_at.is_some_and(|sent| {
            asked
                .duration_since(sent)
                .is_ok_and(|age| age < self.poll_interval)
        });
        if recent && !parents_unknown {
            return true;
        }
        if wake {
            resource.refresh();
        }
        let mut rx = resource.validations();
        let deadline = Instant::now() + limit;
        loop {
            if rx
                .borrow_and_update()
                .sent_at
                .is_some_and(|sent| sent >= asked)
            {
                return true;
            }
            match tokio::time::timeout_at(deadline.into(), rx.changed()).await {
                Ok(Ok(())) => continue,
                _ => return false,
            }
        }
    }

    /// Records the plain origin's answer to the request that created
    /// `resource` (a client's subscription) as its first state, so that
    /// request is answered from it and the origin is not asked twice.
    pub async fn seed(
        &self,
        resource: &Arc<Resource>,
        response: Response<Incoming>,
        timing: Timing,
        ticket: Ticket,
    ) {
        let mut w = Watch {
            resource: resource.clone(),
            validators: Validators::default(),
            cadence: Cadence::new(self.poll_interval, self.poll_max_interval),
            turn: 0,
        };
        let sent = (timing.request_time, ticket, Validators::default());
        let heard = self.absorb_plain(&mut w, response, sent).await;
        resource.validated(heard.answered().then_some(timing.request_time));
    }

    /// True once the proxy shuts down (or is gone).
    fn shutting_down(&self) -> bool {
        *self.closing.borrow() || self.closing.has_changed().is_err()
    }

    /// Waits `wait` or until woken; true when woken.
    async fn pause(&self, w: &Watch, wait: Duration) -> bool {
        let until = tokio::time::Instant::now() + wait;
        let mut closing = self.closing.clone();
        tokio::select! {
            _ = tokio::time::sleep_until(until) => false,
            _ = closing.changed() => false,
            _ = w.resource.wake.notified() => true,
        }
    }

    /// Sends a poll of the resource, conditional on a strong validator
    /// unless a refresh asked for the whole body; its answer, when it was
    /// sent, its ticket, and the validators it carried.
    async fn send(&self, w: &Watch) -> Result<(Response<Incoming>, Sent), String> {
        let mut req = self
            .plain_get(&w.resource, None)
            .map_err(|e| e.to_string())?;
        let headers = req.headers_mut();
        let mut asked = Validators::default();
        let refetch = w.resource.take_refetch();
        if w.resource.head().seq > 0 && !refetch {
            if let Some(etag) = &w.validators.etag {
                headers.insert(header::IF_NONE_MATCH, etag.clone());
                asked.etag = Some(etag.clone());
            } else if let Some(date) = &w.validators.last_modified {
                headers.insert(header::IF_MODIFIED_SINCE, date.clone());
                asked.last_modified = Some(date.clone());
            }
        }
        let sent = (SystemTime::now(), Ticket::take(), asked);
        Metrics::inc(&self.metrics.polls_total);
        let response = self
            .client
            .send_watch(req)
            .await
            .map_err(|e| e.to_string())?;
        Ok((response, sent))
    }

    /// A GET of `resource` as its watcher sends it: the resource's template
    /// headers (the creating client's identity and forwarding headers),
    /// no content coding, and `If-None-Match` when given.
    pub fn plain_get(
        &self,
        resource: &Resource,
        if_none_match: Option<HeaderValue>,
    ) -> Result<Request<crate::floor::body::Body>, crate::error::Refusal> {
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

    /// One poll; publishes what changed. What it heard, and when its
    /// request was sent (`None`: it could not be).
    async fn poll_once(&self, w: &mut Watch) -> (Heard, Option<SystemTime>) {
        match self.send(w).await {
            Ok((response, sent)) => {
                let at = sent.0;
                (self.absorb_plain(w, response, sent).await, Some(at))
            }
            Err(reason) => {
                // Logged once, where the failure enters: UpstreamHealth.
                debug!(resource = w.resource.key(), %reason, "poll failed");
                (Heard::Nothing, None)
            }
        }
    }

    /// Publishes what a plain (non-209) response to the watcher says.
    /// `sent`: when its request was sent, its ticket, and the validators
    /// it carried.
    async fn absorb_plain(&self, w: &mut Watch, response: Response<Incoming>, sent: Sent) -> Heard {
        let resource = w.resource.clone();
        let status = response.status();
        let (request_time, ticket, asked) = sent;
        let timing = Timing {
            request_time,
            response_time: SystemTime::now(),
        };
        if status == StatusCode::NOT_MODIFIED {
            Metrics::inc(&self.metrics.polls_not_modified_total);
            let sent = (ticket, asked.etag.as_ref(), asked.last_modified.as_ref());
            if !self.not_modified(&resource, response.headers(), timing, sent) {
                // Not about the representation held: ask unconditionally.
                w.validators = Validators::default();
                resource.wake.notify_one();
            }
            return Heard::Same;
        }
        if matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            if let Some(wait) = super::pace::retry_after(response.headers()) {
                // The origin is one: every watcher waits, not only this one.
                warn!(
                    resource = resource.key(),
                    status = status.as_u16(),
                    wait_ms = wait.min(super::pace::MAX_ORIGIN_PAUSE).as_millis() as u64,
                    "origin asked for fewer requests; every watcher pauses"
                );
                self.budget.pause(wait);
            }
        }
        if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return self.denied(&resource, response, ticket).await;
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
            // A 5xx says the upstream failed; anything else was its answer.
            return match status.is_server_error() {
                true => Heard::Nothing,
                false => Heard::Unusable,
            };
        }
        if let Err(refusal) = self.check_shareable(&resource, response.headers()) {
            warn!(resource = resource.key(), %refusal, "cannot track this resource");
            return Heard::Unusable;
        }
        w.validators = Validators::of(response.headers());
        let declared = response
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let (parts, body) = response.into_parts();
        let body = if declared.is_some_and(|n| n > self.max_body_bytes as u64) {
            Err(BodyFailure::TooLarge)
        } else {
            self.read_body(crate::floor::body::incoming(body)).await
        };
        let body = match body {
            Ok(body) => body,
            Err(BodyFailure::TooLarge) => {
                warn!(
                    resource = resource.key(),
                    "origin body over max-body-bytes; not tracked"
                );
                let mut changed = false;
                if let Some(recording) = resource.record(ticket) {
                    let change = Change::derived(too_large(self.max_body_bytes));
                    changed = recording.publish(change, &self.history, &self.tuning, &self.metrics);
                }
                return Heard::of(changed);
            }
            Err(BodyFailure::Broken(reason)) => {
                warn!(resource = resource.key(), %reason, "origin body failed");
                return Heard::Nothing;
            }
        };
        // The watcher asked for no content coding; a stored copy for plain
        // GETs is only kept where that does not change the variant.
        let for_gets = !matches!(
            rules::vary(&parts.headers),
            rules::Vary::Names(ref names) if names.contains(&header::ACCEPT_ENCODING)
        );
        let changed = self.absorb_fetched(
            &resource,
            parts.status,
            &parts.headers,
            body,
            (timing, ticket),
            for_gets,
        );
        Heard::of(changed)
    }

    /// Records a 401 or 403 to the watcher's poll: the origin refused the
    /// credentials (or their absence) this resource's requests carry. Its
    /// subscribers are sent the origin's answer as their last update
    /// ([`State::Denied`]: their streams then end), and the resource is
    /// forgotten, so that its watcher stops polling with that credential
    /// and the next request with it starts afresh at the origin.
    async fn denied(
        &self,
        resource: &Arc<Resource>,
        response: Response<Incoming>,
        ticket: Ticket,
    ) -> Heard {
        let (parts, body) = response.into_parts();
        let body = match self.read_body(crate::floor::body::incoming(body)).await {
            Ok(body) => body,
            // Its status is what matters; a body over the limit is not kept.
            Err(BodyFailure::TooLarge) => Bytes::new(),
            Err(BodyFailure::Broken(reason)) => {
                warn!(resource = resource.key(), %reason, "origin body failed");
                return Heard::Nothing;
            }
        };
        let Some(recording) = resource.record(ticket) else {
            // An answer to a later request is recorded: the next poll tells.
            resource.wake.notify_one();
            return Heard::Unusable;
        };
        debug!(
            resource = resource.key(),
            status = parts.status.as_u16(),
            "origin refused the credentials; its subscribers are told and the resource forgotten"
        );
        let state = State::denied(parts.status, &parts.headers, body);
        recording.publish(
            Change::derived(state),
            &self.history,
            &self.tuning,
            &self.metrics,
        );
        drop(recording);
        resource.set_stored(None);
        self.registry.forget(resource);
        Heard::Changed
    }

    /// Detaches `resource` when the origin's answer shows that it is not
    /// shareable under its key: a `Vary` other than the one the key was
    /// made with, or a private answer to a request without credentials.
    fn check_shareable(
        &self,
        resource: &Arc<Resource>,
        headers: &http::HeaderMap,
    ) -> Result<(), crate::error::Refusal> {
        let vary = rules::vary(headers);
        let cc = rules::CacheControl::parse(headers);
        let personal = cc.private || cc.no_store || headers.contains_key(header::SET_COOKIE);
        resource.set_answer_rules(AnswerRules {
            vary: vary.clone(),
            personal,
        });
        let mut keyed_under = resource.vary();
        if vary != keyed_under {
            // Its first answer named the `Vary`: it is the variant of the
            // request that made it, under which requests of the same view
            // find it (rather than each asking the origin again).
            let host = resource
                .template
                .get("x-forwarded-host")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            let moved = vary != rules::Vary::Any && self.registry.rekey(resource, &vary, host);
            if moved {
                keyed_under = vary.clone();
            } else {
                self.registry.record_vary(resource.key(), &vary);
            }
        }
        if vary != keyed_under || (personal && !resource.private) {
            self.registry.detach(resource)?;
        }
        Ok(())
    }

    /// Records a 304 to the request that took `sent.0` and carried the
    /// validators `sent.1` (`If-None-Match`) or `sent.2`
    /// (`If-Modified-Since`): the stored answer's headers are updated (RFC
    /// 9111 §4.3.4) and its age starts over, only when no later answer was
    /// recorded and the 304 is about the stored answer (its validator is
    /// the one asked with). False when it was not recorded.
    pub fn not_modified(
        &self,
        resource: &Resource,
        headers: &http::HeaderMap,
        timing: Timing,
        sent: (Ticket, Option<&HeaderValue>, Option<&HeaderValue>),
    ) -> bool {
        let (ticket, etag, modified) = sent;
        let Some(_recording) = resource.record(ticket) else {
            return false;
        };
        let Some(stored) = resource.stored() else {
            return false;
        };
        if !rules::not_modified_applies(&stored.headers, etag, modified, headers) {
            debug!(
                resource = resource.key(),
                "304 names another validator than the stored answer's; not merged"
            );
            return false;
        }
        let mut updated = Stored::clone(&stored);
        updated.headers = rules::merge_not_modified(&stored.headers, headers);
        updated.timing = timing;
        updated.invalid = false;
        resource.set_stored(Some(updated));
        true
    }

    /// Records a complete answer from the origin, from a watcher's poll or
    /// a client's GET: publishes the state to subscribers (a 200 without
    /// content coding, 404 or 410) and, when `for_gets`, stores it for
    /// plain GETs. The one path every plain answer takes into the state.
    /// `sent.1`: the ticket its request took when sent; an answer to a
    /// request sent before one whose answer (or a write) is recorded is not.
    /// True when it published a new version.
    pub fn absorb_fetched(
        &self,
        resource: &Resource,
        status: StatusCode,
        headers: &http::HeaderMap,
        body: Bytes,
        sent: (Timing, Ticket),
        for_gets: bool,
    ) -> bool {
        let (timing, ticket) = sent;
        let Some(recording) = resource.record(ticket) else {
            // Asked before a newer answer or a write through the proxy was
            // recorded: this one may undo it for subscribers. The next poll tells.
            debug!(
                resource = resource.key(),
                "answer to an earlier request than one recorded; not recorded"
            );
            resource.wake.notify_one();
            return false;
        };
        let encoded = headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| !v.trim().eq_ignore_ascii_case("identity"));
        let state = match status {
            StatusCode::OK if !encoded => Some(State::Present {
                body: body.clone(),
                content_type: text_header(headers, header::CONTENT_TYPE),
                etag: text_header(headers, header::ETAG),
                language: text_header(headers, header::CONTENT_LANGUAGE),
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
            Some(state) => recording.publish(
                Change {
                    state,
                    version,
                    patches: None,
                },
                &self.history,
                &self.tuning,
                &self.metrics,
            ),
            None => false,
        };
        let head = resource.head();
        let body_is_head = status == StatusCode::OK && !encoded && head.seq > 0;
        if for_gets {
            resource.set_stored(Some(Stored {
                status,
                headers: rules::stored_headers(headers),
                body: if body_is_head { head.body() } else { body },
                timing,
                version: body_is_head.then(|| head.version.clone()),
                invalid: false,
                prepared: Default::default(),
                freshness: Default::default(),
            }));
            resource.uncacheable.store(false, Relaxed);
        } else if changed {
            resource.invalidate();
        }
        drop(recording);
        self.registry.enforce_cap();
        changed
    }

    /// Reads a body up to the limit, bounded in time by the response
    /// timeout; what it has read so far counts against `--state-bytes`
    /// ([`Watchers::reading`]) until the caller has it.
    pub(crate) async fn read_body(
        &self,
        body: crate::floor::body::RequestBody,
    ) -> Result<Bytes, BodyFailure> {
        let mut counted = Reading {
            total: &self.reading,
            bytes: 0,
        };
        let mut body = body;
        let mut parts: Vec<Bytes> = Vec::new();
        let read = async {
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| BodyFailure::Broken(e.to_string()))?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if counted.bytes + data.len() > self.max_body_bytes {
                    return Err(BodyFailure::TooLarge);
                }
                counted.add(data.len());
                parts.push(data);
            }
            Ok(())
        };
        match tokio::time::timeout(self.response_timeout, read).await {
            Ok(Ok(())) => Ok(match parts.len() {
                1 => parts.pop().unwrap_or_default(),
                _ => Bytes::from(parts.concat()),
            }),
            Ok(Err(failure)) => Err(failure),
            Err(_) => Err(BodyFailure::Broken(format!(
                "body not received within {:?}",
                self.response_timeout
            ))),
        }
    }
}

/// The bytes of one body being read, counted in [`Watchers::reading`]
/// until dropped.
struct Reading<'a> {
    total: &'a std::sync::atomic::AtomicUsize,
    bytes: usize,
}

impl Reading<'_> {
    fn add(&mut self, n: usize) {
        self.bytes += n;
        self.total.fetch_add(n, Relaxed);
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Relaxed);
    }
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

/// What one poll heard from the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heard {
    /// An answer that made a new version (a 200, 404 or 410 with another
    /// state than the one held, a 401 or 403).
    Changed,
    /// An answer that showed the state held (a 304, or the same body).
    Same,
    /// An answer it could not use (another 4xx, a 3xx, one it cannot
    /// track): the upstream answered; the watcher backs off.
    Unusable,
    /// No answer: no connection, a timeout, a broken body, or a 5xx.
    Nothing,
}

impl Heard {
    fn of(changed: bool) -> Heard {
        match changed {
            true => Heard::Changed,
            false => Heard::Same,
        }
    }

    /// Whether the upstream answered, for readiness ([`Resource::unheard`]).
    fn answered(self) -> bool {
        self != Heard::Nothing
    }
}

/// When a poll was sent, its ticket, and the validators it carried.
type Sent = (SystemTime, Ticket, Validators);

/// The validators of the last representation, for conditional polls.
#[derive(Default)]
struct Validators {
    etag: Option<HeaderValue>,
    last_modified: Option<HeaderValue>,
}

impl Validators {
    /// Those an answer's headers give that a 304 may be trusted on: its
    /// ETag, and its Last-Modified only when strong (RFC 9110 §8.8.2.2; a
    /// same-second one is not sent, and the whole body is compared).
    fn of(headers: &http::HeaderMap) -> Validators {
        let (etag, last_modified) = rules::revalidation_validators(headers);
        Validators {
            etag,
            last_modified,
        }
    }
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
