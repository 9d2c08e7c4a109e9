//! The subscriber side: `GET` + `Subscribe` answered with a long-lived 209
//! whose body is a cursor into the resource's shared history, plus plain
//! GETs served from the proxy's state, heartbeats, caps and CORS.
//!
//! A subscriber holds no queue: only the last seq it was sent, a watch
//! receiver of the resource's head, and (maybe) a heartbeat receiver. hyper
//! pulls the next frame only when the connection has room, so a slow
//! reader finds a later head when it next pulls and gets one collapsed
//! update (or a snapshot) for everything it missed.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use tokio::sync::watch;

use crate::braid::{BraidRequest, VersionList};
use crate::deliver::cursor::{Cursor, Parts};
use crate::deliver::direct::{Handle, Link};
use crate::deliver::window::NONE;
use crate::error::Refusal;
use crate::floor::body::{self, Body};
use crate::floor::phase::CachePhase;
use crate::floor::rules;
use crate::metrics::Metrics;
use crate::state::{Head, History, Resource, State, Stored};

/// Shared heartbeat tickers, one per interval in milliseconds: every idle
/// subscriber with that interval observes the same tick. A ticker ticks
/// twice per interval, and a subscriber's heartbeat is due at the second
/// tick after its last write ([`crate::deliver::cursor`]): its first
/// heartbeat comes between half the interval and the interval after its
/// 209, and it is never silent longer than the interval it asked for
/// (clients count 1.5 intervals of silence as a dead stream).
#[derive(Default)]
pub struct Heartbeats {
    tickers: Mutex<HashMap<u64, watch::Sender<u64>>>,
}

/// A heartbeat interval as honoured: rounded up to whole milliseconds,
/// within [`crate::braid::MIN_HEARTBEAT`] and [`crate::braid::MAX_HEARTBEAT`]
/// (the bounds a Braid upstream is asked within too).
fn honoured_heartbeat(interval: Duration) -> Duration {
    let ms = Duration::from_millis((interval.as_secs_f64() * 1000.0).ceil() as u64);
    ms.clamp(crate::braid::MIN_HEARTBEAT, crate::braid::MAX_HEARTBEAT)
}

impl Heartbeats {
    /// A receiver ticking twice every `interval` ([`honoured_heartbeat`]).
    pub fn ticker(self: &Arc<Self>, interval: Duration) -> watch::Receiver<u64> {
        let ms = honoured_heartbeat(interval).as_millis() as u64;
        let mut tickers = self.tickers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = tickers.get(&ms) {
            return tx.subscribe();
        }
        let (tx, rx) = watch::channel(0u64);
        tickers.insert(ms, tx.clone());
        let this = self.clone();
        tokio::spawn(async move {
            let period = Duration::from_millis(ms) / crate::deliver::cursor::TICKS_PER_BEAT as u32;
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let mut tickers = this.tickers.lock().unwrap_or_else(|p| p.into_inner());
                if tx.receiver_count() == 0 {
                    tickers.remove(&ms);
                    return;
                }
                drop(tickers);
                tx.send_modify(|n| *n += 1);
            }
        });
        rx
    }
}

/// Everything a subscription stream needs, shared by all of them.
pub struct Subscriptions {
    pub history: Arc<History>,
    pub metrics: Arc<Metrics>,
    pub heartbeats: Arc<Heartbeats>,
    pub default_heartbeat: Duration,
    pub max_total: usize,
    pub max_per_resource: usize,
    pub closing: watch::Receiver<bool>,
}

/// Counts a subscription in the gauge for as long as it lives.
struct Counted(Arc<Metrics>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.subscriptions.fetch_sub(1, Relaxed);
    }
}

impl Subscriptions {
    /// Checks the caps; `Ok` reserves a slot (released when the guard drops).
    fn admit(&self, resource: &Resource) -> Result<Counted, Refusal> {
        let busy = |what: &str| {
            Metrics::inc(&self.metrics.subscriptions_rejected_total);
            Err(Refusal::Unavailable {
                reason: format!("too many subscriptions {what}; retry later"),
                retry_after: Duration::from_secs(5),
            })
        };
        // The caller's own receiver is already counted among the subscribers.
        if resource.subscribers() > self.max_per_resource {
            return busy("to this resource");
        }
        let before = self.metrics.subscriptions.fetch_add(1, Relaxed);
        let counted = Counted(self.metrics.clone());
        if before >= self.max_total as i64 {
            return busy("on this proxy");
        }
        Ok(counted)
    }

    /// The 209 response for a subscription to `resource`, which has a state.
    pub fn respond(
        &self,
        resource: Arc<Resource>,
        head: watch::Receiver<Arc<Head>>,
        request: &BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let counted = self.admit(&resource)?;
        let resource_rules = resource.answer_rules();
        Metrics::inc(&self.metrics.subscriptions_total);
        let current = head.borrow().clone();
        let at = match &request.parents {
            Some(parents) if !parents.is_empty() => resource.seq_of(parents),
            _ => None,
        };
        let interval = request.heartbeats.unwrap_or(self.default_heartbeat);
        let heartbeat = (!interval.is_zero()).then(|| self.heartbeats.ticker(interval));
        let link = Arc::new(Link::default());
        let window = resource.window(&self.history, &self.metrics);
        let handle = Handle {
            window: window.clone(),
            parked: resource.direct.clone(),
            link: link.clone(),
            metrics: self.metrics.clone(),
            heartbeat: heartbeat.clone(),
            closing: self.closing.clone(),
        };
        let body = Cursor::body(Parts {
            window,
            changes: head,
            link,
            at: at.unwrap_or(NONE),
            heartbeat,
            closing: self.closing.clone(),
            metrics: self.metrics.clone(),
            held: Box::new((counted, resource)),
            relayed: false,
        });
        let mut response = Response::new(body);
        response.extensions_mut().insert(handle);
        *response.status_mut() = StatusCode::from_u16(209).unwrap_or(StatusCode::OK);
        response
            .extensions_mut()
            .insert(hyper::ext::ReasonPhrase::from_static(b"Subscription"));
        let h = response.headers_mut();
        h.insert(
            "subscribe",
            request
                .subscribe_echo
                .clone()
                .unwrap_or(HeaderValue::from_static("true")),
        );
        // What the origin said about sharing travels to the next tier: its
        // `Vary` names before Braid's own, and `private` for an answer that
        // is one client's (spec/braid-wire.md §5.1).
        let rules = resource_rules;
        h.insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static(if rules.personal {
                "private, no-cache, no-transform, no-store"
            } else {
                "no-cache, no-transform, no-store"
            }),
        );
        h.insert("x-accel-buffering", HeaderValue::from_static("no"));
        h.insert(header::VARY, subscription_vary(&rules.vary));
        if let Some(v) = &request.heartbeats_echo {
            h.insert("heartbeats", v.clone());
        }
        if let Ok(v) = HeaderValue::from_str(&current.version.to_header_value()) {
            if !current.version.is_empty() {
                h.insert("current-version", v);
            }
        }
        if let State::Present {
            content_type,
            language,
            ..
        } = &current.state
        {
            for (name, value) in [
                (header::CONTENT_TYPE, content_type),
                (header::CONTENT_LANGUAGE, language),
            ] {
                if let Some(v) = value.as_deref().and_then(|v| HeaderValue::from_str(v).ok()) {
                    h.insert(name, v);
                }
            }
        }
        Ok(response)
    }
}

/// A 209's `Vary`: the origin's names, then Braid's request headers.
fn subscription_vary(vary: &rules::Vary) -> HeaderValue {
    const BRAID: &str = "Version, Parents, Subscribe";
    match vary {
        rules::Vary::Any => HeaderValue::from_static("*"),
        rules::Vary::None => HeaderValue::from_static(BRAID),
        rules::Vary::Names(names) => {
            let mut line = String::new();
            for name in names {
                line.push_str(name.as_str());
                line.push_str(", ");
            }
            line.push_str(BRAID);
            HeaderValue::from_str(&line).unwrap_or(HeaderValue::from_static("*"))
        }
    }
}

/// The origin's 401 or 403 as a plain answer, when `head` is one
/// ([`State::Denied`]): what a subscription request gets in place of a
/// 209 (a 209 whose stream ends after one denial would have braid-http's
/// `retry` reconnect for ever; it gives up on a plain 401 or 403).
pub fn denial(head: &Head) -> Option<Response<Body>> {
    let State::Denied {
        status,
        headers,
        body: denied,
    } = &head.state
    else {
        return None;
    };
    let mut response = Response::new(body::full(denied.clone()));
    *response.status_mut() = StatusCode::from_u16(*status).ok()?;
    let h = response.headers_mut();
    for (name, value) in headers {
        h.append(name.clone(), value.clone());
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(denied.len()));
    Some(response)
}

/// A plain GET or HEAD answered from stored state: the origin's status and
/// end-to-end headers, with `Age`, the Braid headers (`Version`,
/// `Current-Version`, `Repr-Digest`) when the body is the resource's head,
/// and `Cache-Status`; the origin's `Vary` is kept as it is. 304
/// when the client's own `If-None-Match` (weak comparison) or
/// `If-Modified-Since` matches.
pub fn serve_stored<B>(
    req: &Request<B>,
    stored: &Stored,
    head: &Head,
    outcome: CachePhase,
    cache_id: &str,
) -> Response<Body> {
    let current = stored.version.as_ref().filter(|v| **v == head.version);
    let prepared = stored
        .prepared
        .get_or_init(|| prepare(stored, current, head, cache_id));
    let fits = prepared.cache_id == cache_id
        && match (&prepared.digest, current) {
            (Some(digest), Some(_)) => *digest == head.digest,
            (None, None) => true,
            _ => false,
        };
    if fits && !not_modified(req, stored, prepared.etag.as_deref(), &prepared.headers) {
        return answer_prepared(req, stored, prepared, outcome, cache_id);
    }
    // A 304, or a head other than the one the prepared headers name.
    serve_built(req, stored, current, head, outcome, cache_id)
}

/// The stored headers a plain GET is answered with, an `ETag` made from
/// the version when the origin gave none, and the `ETag` answered.
fn answer_headers(stored: &Stored, current: Option<&VersionList>) -> (HeaderMap, Option<String>) {
    let mut headers = stored.headers.clone();
    // A version the origin gave no ETag for gets one (the Braid version).
    if !headers.contains_key(header::ETAG) {
        if let Some(v) = current
            .and_then(|v| v.first())
            .and_then(|v| HeaderValue::from_str(&format!("\"{}\"", v.as_str())).ok())
        {
            headers.insert(header::ETAG, v);
        }
    }
    let etag = headers
        .get(header::ETAG)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (headers, etag)
}

/// Whether the client's own `If-None-Match` (weak comparison) or
/// `If-Modified-Since` matches the stored answer: then a 304.
fn not_modified<B>(
    req: &Request<B>,
    stored: &Stored,
    etag: Option<&str>,
    headers: &HeaderMap,
) -> bool {
    let rh = req.headers();
    stored.status == StatusCode::OK
        && match rh.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) {
            Some(inm) => rules::if_none_match(inm, etag),
            None => rh
                .get(header::IF_MODIFIED_SINCE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|ims| {
                    // Without Last-Modified, the Date of the stored answer.
                    let modified = headers
                        .get(header::LAST_MODIFIED)
                        .or_else(|| headers.get(header::DATE));
                    rules::not_modified_since(modified, ims)
                }),
        }
}

/// `Version`, `Current-Version` and `Repr-Digest` of a body that is the head's.
fn add_braid_headers(headers: &mut HeaderMap, current: Option<&VersionList>, head: &Head) {
    if let Some(version) = current {
        let value = version.to_header_value();
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static("version"), v.clone());
            headers.insert(HeaderName::from_static("current-version"), v);
        }
        if let Ok(v) = HeaderValue::from_str(&head.digest) {
            if !head.digest.is_empty() {
                headers.insert(HeaderName::from_static("repr-digest"), v);
            }
        }
    }
}

/// The headers every non-304 answer from `stored` shares, in the order
/// [`serve_built`] sets them, `Age` and the last `Cache-Status` entry
/// holding placeholders.
fn prepare(
    stored: &Stored,
    current: Option<&VersionList>,
    head: &Head,
    cache_id: &str,
) -> crate::state::Prepared {
    let (mut headers, etag) = answer_headers(stored, current);
    headers.insert(header::AGE, HeaderValue::from_static("0"));
    add_braid_headers(&mut headers, current, head);
    if let Some(v) = CachePhase::Revalidated.header_value(cache_id) {
        headers.append(HeaderName::from_static("cache-status"), v);
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(stored.body.len()));
    crate::state::Prepared {
        headers,
        etag,
        cache_id: cache_id.to_string(),
        digest: current.map(|_| head.digest.clone()),
        last_hit: Mutex::new(None),
    }
}

/// A non-304 answer from the prepared headers: `Age` and `Cache-Status`
/// set in place, the body shared.
fn answer_prepared<B>(
    req: &Request<B>,
    stored: &Stored,
    prepared: &crate::state::Prepared,
    outcome: CachePhase,
    cache_id: &str,
) -> Response<Body> {
    let age = stored.freshness().age(std::time::SystemTime::now());
    let mut headers = prepared.headers.clone();
    // Set in place: an insert would first make room for one more entry,
    // and a full map (12 of 16 slots, say) is rebuilt to do so.
    let (mut age_slot, mut status_slot) = (None, None);
    for (name, value) in headers.iter_mut() {
        if name == header::AGE {
            age_slot = Some(value);
        } else if name.as_str() == "cache-status" {
            status_slot = Some(value);
        }
    }
    let (age_value, status) = match outcome {
        CachePhase::Hit { ttl } => hit_values(prepared, age, ttl, cache_id),
        _ => (HeaderValue::from(age), outcome.header_value(cache_id)),
    };
    if let Some(slot) = age_slot {
        *slot = age_value;
    }
    if let (Some(slot), Some(v)) = (status_slot, status) {
        *slot = v;
    }
    let mut response = if req.method() == Method::HEAD {
        Response::new(body::empty())
    } else {
        Response::new(body::full(stored.body.clone()))
    };
    *response.status_mut() = stored.status;
    *response.headers_mut() = headers;
    response.extensions_mut().insert(outcome);
    response
}

/// The `Age` and `Cache-Status` values of a hit: the last hit's when it
/// said the same age and ttl (shared bytes, nothing formatted).
fn hit_values(
    prepared: &crate::state::Prepared,
    age: u64,
    ttl: i64,
    cache_id: &str,
) -> (HeaderValue, Option<HeaderValue>) {
    let outcome = CachePhase::Hit { ttl };
    let Ok(mut last) = prepared.last_hit.try_lock() else {
        return (HeaderValue::from(age), outcome.header_value(cache_id));
    };
    if let Some((a, t, age_value, status)) = last.as_ref() {
        if (*a, *t) == (age, ttl) {
            return (age_value.clone(), Some(status.clone()));
        }
    }
    let age_value = HeaderValue::from(age);
    let status = outcome.header_value(cache_id);
    if let Some(status) = &status {
        *last = Some((age, ttl, age_value.clone(), status.clone()));
    }
    (age_value, status)
}

/// [`serve_stored`] built from the stored headers, for the answers the
/// prepared headers do not fit.
fn serve_built<B>(
    req: &Request<B>,
    stored: &Stored,
    current: Option<&VersionList>,
    head: &Head,
    outcome: CachePhase,
    cache_id: &str,
) -> Response<Body> {
    let (mut headers, etag) = answer_headers(stored, current);
    let not_modified = not_modified(req, stored, etag.as_deref(), &headers);
    let age = rules::current_age(&stored.headers, stored.timing, std::time::SystemTime::now());
    headers.insert(header::AGE, HeaderValue::from(age));
    add_braid_headers(&mut headers, current, head);
    if let Some(v) = outcome.header_value(cache_id) {
        headers.append(HeaderName::from_static("cache-status"), v);
    }
    let mut response = if not_modified {
        for name in [
            header::CONTENT_TYPE,
            header::CONTENT_ENCODING,
            header::CONTENT_LANGUAGE,
        ] {
            headers.remove(name);
        }
        let mut r = Response::new(body::empty());
        *r.status_mut() = StatusCode::NOT_MODIFIED;
        r
    } else {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(stored.body.len()));
        let mut r = if req.method() == Method::HEAD {
            Response::new(body::empty())
        } else {
            Response::new(body::full(stored.body.clone()))
        };
        *r.status_mut() = stored.status;
        r
    };
    *response.headers_mut() = headers;
    response.extensions_mut().insert(outcome);
    response
}

/// CORS for browsers: the configured origins, the Braid request headers in
/// preflights, and the Braid response headers exposed.
pub struct Cors {
    origins: Vec<String>,
}

const CORS_ALLOW_HEADERS: &str = "Subscribe, Version, Parents, Peer, Heartbeats, Merge-Type, Content-Range, Patches, Multiplex-Through, Multiplex-Version, Content-Type, Cache-Control";
const CORS_EXPOSE_HEADERS: &str = "Version, Parents, Current-Version, Heartbeats, Subscribe, Retry-After, Multiplex-Version, Multiplex-Through, Bad-Multiplexer, Bad-Request, Repr-Digest, ETag, Content-Range, Patches";
const CORS_ALLOW_METHODS: &str = "GET, HEAD, PUT, POST, PATCH, DELETE, OPTIONS, MULTIPLEX";

impl Cors {
    pub fn new(origins: Vec<String>) -> Cors {
        Cors { origins }
    }

    /// The `Access-Control-Allow-Origin` value for a request's `Origin`, if allowed.
    fn allow(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        let origin = headers.get(header::ORIGIN)?;
        if self.origins.iter().any(|o| o == "*") {
            return Some(HeaderValue::from_static("*"));
        }
        let text = origin.to_str().ok()?;
        self.origins
            .iter()
            .any(|o| o.eq_ignore_ascii_case(text))
            .then(|| origin.clone())
    }

    /// Answers a preflight from an allowed origin.
    pub fn preflight<B>(&self, req: &Request<B>) -> Option<Response<Body>> {
        if req.method() != Method::OPTIONS
            || !req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        {
            return None;
        }
        let allow = self.allow(req.headers())?;
        let mut r = Response::new(body::empty());
        *r.status_mut() = StatusCode::NO_CONTENT;
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static(CORS_ALLOW_METHODS),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(CORS_ALLOW_HEADERS),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        Some(r)
    }

    /// Adds the CORS headers to a response for an allowed origin.
    pub fn decorate(&self, request_headers: &HeaderMap, response: &mut Response<Body>) {
        let Some(allow) = self.allow(request_headers) else {
            return;
        };
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static(CORS_EXPOSE_HEADERS),
        );
        h.append(header::VARY, HeaderValue::from_static("Origin"));
    }

    pub fn enabled(&self) -> bool {
        !self.origins.is_empty()
    }
}
