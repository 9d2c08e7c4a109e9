//! The GET path from state (RFC 9111 as a shared cache, with the Braid
//! extensions spec/caching.md names): a plain GET or HEAD is answered from
//! a live upstream subscription's model, from stored state while it is
//! fresh, after one revalidation shared by concurrent requests, or from
//! the origin, whose answer then seeds the state.

use std::fmt::Write as _;
use std::sync::Arc;

use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};

use super::range;
use crate::braid::BraidRequest;
use crate::config::{Config, UpstreamKind};
use crate::error::Refusal;
use crate::feed::braid::Relays;
use crate::feed::poll::Watchers;
use crate::floor::body::{self, Body, RequestBody};
use crate::floor::phase::{CachePhase, Fwd};
use crate::floor::rules::{self, Reuse, Timing};
use crate::metrics::Metrics;
use crate::serve::subscribe;
use crate::state::{Key, Kind, Registry, Resource, State, Stored, Ticket};
use crate::upstream::{self, UpstreamClient};

/// What the GET path reads and records: shared with the router.
pub struct Gets {
    pub config: Config,
    pub client: UpstreamClient,
    pub metrics: Arc<Metrics>,
    pub registry: Arc<Registry>,
    pub watchers: Arc<Watchers>,
    pub relays: Arc<Relays>,
    /// Bytes of origin answers being copied into state while they stream.
    pub copies: Arc<body::CopyBudget>,
    /// The cache lock of first contact: concurrent first GETs of a variant
    /// nothing is tracked for wait on one origin request.
    pub first: FirstContact,
}

/// One lock per variant being fetched for the first time, held by the
/// request that went to the origin until its answer is stored; the map
/// holds them weakly, so it is as large as the first fetches in flight.
#[derive(Default)]
pub struct FirstContact {
    locks: std::sync::Mutex<std::collections::HashMap<String, std::sync::Weak<FetchLock>>>,
}

type FetchLock = tokio::sync::Mutex<()>;

/// How many times a GET is answered again after waiting on another's
/// fetch (first contact, then the variant that answer named).
const MAX_WAITS: u8 = 3;

/// The locks a fetch holds until its answer is stored.
type Held = Vec<tokio::sync::OwnedMutexGuard<()>>;

impl FirstContact {
    /// The lock of `key`'s first fetch (made if there is none).
    fn lock_of(&self, key: &Key) -> Arc<FetchLock> {
        let name = format!("{}\n{}", key.path, key.secondary);
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(held) = locks.get(&name).and_then(std::sync::Weak::upgrade) {
            return held;
        }
        if locks.len() >= 1024 {
            locks.retain(|_, weak| weak.strong_count() > 0);
        }
        let made = Arc::new(FetchLock::default());
        locks.insert(name, Arc::downgrade(&made));
        made
    }
}

impl Gets {
    /// The registry key of a request (its variant), and the host it named.
    pub fn request_key<B>(&self, req: &Request<B>) -> (Key, String) {
        let host = upstream::client_host(req).unwrap_or_default();
        let key = self
            .registry
            .key_for(&crate::state::path_of(req), req.headers(), &host);
        (key, host)
    }

    /// What the upstream of the resource `key` names is: forced by
    /// `--upstream-kind`, else as its own answers told (a live relayed
    /// subscription of the URL says Braid; a variant of the URL known to
    /// be plain says plain for a variant not known yet).
    pub fn kind_of(&self, key: &Key) -> Kind {
        let inner = self;
        match inner.config.upstream_kind {
            UpstreamKind::Braid => Kind::Braid,
            UpstreamKind::Rest => Kind::Plain,
            UpstreamKind::Auto
                if inner.registry.is_braid(&key.path) || inner.relays.has_live(&key.path) =>
            {
                Kind::Braid
            }
            UpstreamKind::Auto => inner.registry.kind_of(key),
        }
    }

    /// A plain GET or HEAD, answered as a shared cache would (RFC 9111):
    /// from stored state where it is fresh for this request, after a
    /// revalidation where it is not, and from the origin otherwise, whose
    /// answer then seeds the state.
    pub async fn get(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        braid: BraidRequest,
    ) -> Result<Response<Body>, Refusal> {
        let to_a_tier = from_a_tier_below(&req);
        let mut response = self.answer(req, braid, 0).await?;
        if !self.config.keep_surrogate_key && !to_a_tier {
            // Meant for this cache (purging by tag), not for clients.
            const SURROGATE_KEY: HeaderName = HeaderName::from_static("surrogate-key");
            response.headers_mut().remove(SURROGATE_KEY);
        }
        Ok(response)
    }

    /// See [`Gets::get`]. `waits`: how many times this request waited on
    /// another's fetch and is being answered again after it (under the
    /// `Vary` that answer named, or from what it stored); bounded.
    async fn answer(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        braid: BraidRequest,
        waits: u8,
    ) -> Result<Response<Body>, Refusal> {
        let last_try = waits >= MAX_WAITS;
        let inner = self;
        let request_cc = rules::request_cache_control(req.headers());
        let h = req.headers();
        // A GET with Range is answered from a reusable stored 200 (ranges
        // of it, RFC 9110 §14), else passed through as it is.
        let ranged = req.method() == Method::GET && h.contains_key(header::RANGE);
        let bypass = request_cc.no_store
            || (ranged && (braid.version.is_some() || braid.parents.is_some()))
            || [header::IF_MATCH, header::IF_UNMODIFIED_SINCE]
                .iter()
                .any(|name| h.contains_key(name));
        if bypass {
            // Preconditions other than If-None-Match, If-Modified-Since
            // and If-Range are the origin's to evaluate.
            let response = upstream::pass_through(req, &self.client, &self.config).await?;
            return Ok(CachePhase::Bypass.mark(response, &inner.config.proxy_id));
        }
        let (mut key, host) = self.request_key(&req);
        if braid.parents.is_none() && !ranged {
            // A live upstream subscription of this variant validates its
            // model: plain GETs, and GETs of the version it holds.
            let version = braid.version.as_ref();
            let proxy_id = &inner.config.proxy_id;
            if let Some(response) = inner.relays.answer_live(&req, &key, version, proxy_id) {
                return Ok(response);
            }
        }
        let kind = self.kind_of(&key);
        if kind != Kind::Plain {
            // A Braid server's answer depends on the version asked for
            // (`Vary: Version, Parents`, whether it says so or not): it is
            // that version's, stored under what the request named.
            key.secondary.push_str(&named_versions(&braid));
        }
        let resource = inner.registry.get(&key);
        if let Some(resource) = &resource {
            let at = (&key, host.as_str());
            if let Some(response) =
                self.answer_from_state(&req, &braid, resource, &request_cc, at, false)
            {
                return Ok(response);
            }
        }
        if ranged {
            if request_cc.only_if_cached {
                return Ok(only_if_cached_miss());
            }
            // Nothing reusable stored: the origin answers the range.
            let response = upstream::pass_through(req, &self.client, &self.config).await?;
            return Ok(CachePhase::Bypass.mark(response, &inner.config.proxy_id));
        }
        if braid.version.is_some() && kind == Kind::Plain {
            // A version the proxy does not hold: the origin's to answer.
            let response = upstream::pass_through(req, &self.client, &self.config).await?;
            return Ok(CachePhase::VersionNotHeld.mark(response, &inner.config.proxy_id));
        }
        if request_cc.only_if_cached {
            return Ok(only_if_cached_miss());
        }
        // First contact: concurrent first requests of this variant share
        // one origin request (a cache lock) until its answer says whether
        // it may be shared; the lock holds no state (and no private slot).
        if resource.is_none() && req.method() == Method::GET {
            let lock = inner.first.lock_of(&key);
            if let Ok(guard) = lock.clone().try_lock_owned() {
                // The first: it asks the origin, the others wait for it.
                return self.fetch(req, key, host, None, Some(guard)).await;
            }
            let waited = tokio::time::timeout(inner.config.response_timeout, lock.lock_owned())
                .await
                .ok();
            drop(waited);
            // Another request's answer came while this one waited: it is
            // answered as any request for a tracked variant (or under the
            // `Vary` that answer named); none tracked, that answer could
            // not be stored, and this request asks on its own, holding
            // nobody up (hit-for-pass).
            let rekeyed = self.request_key(&req).0.vary != key.vary;
            if !last_try && (rekeyed || inner.registry.get(&key).is_some()) {
                return Box::pin(self.answer(req, braid, waits + 1)).await;
            }
            return self.fetch(req, key, host, None, None).await;
        }
        let guard = match &resource {
            Some(resource)
                if !resource
                    .uncacheable
                    .load(std::sync::atomic::Ordering::Relaxed) =>
            {
                let arrived = resource.validation().generation;
                let lock = resource.fetching.clone().lock_owned();
                let guard = tokio::time::timeout(inner.config.response_timeout, lock)
                    .await
                    .ok();
                // The answer it waited for named a `Vary` its key was not
                // made under: this request is a variant of its own now,
                // perhaps one that answer just stored (concurrent first
                // requests of one view share one origin request).
                if !last_try && self.request_key(&req).0.vary != key.vary {
                    drop(guard);
                    return Box::pin(self.answer(req, braid, waits + 1)).await;
                }
                // Another request fetched while this one waited: its answer
                // may do (as validated for this request when the origin
                // answered after it arrived, else if it is fresh).
                let validated = resource.validation().generation != arrived;
                let at = (&key, host.as_str());
                if let Some(response) =
                    self.answer_from_state(&req, &braid, resource, &request_cc, at, validated)
                {
                    return Ok(response);
                }
                // The answer it waited for could not be stored: requests
                // no longer queue behind each other for this variant.
                if resource
                    .uncacheable
                    .load(std::sync::atomic::Ordering::Relaxed)
                {
                    None
                } else {
                    guard
                }
            }
            _ => None,
        };
        self.fetch(req, key, host, resource, guard).await
    }

    /// The stored answer, if it may answer this request without the origin:
    /// fresh, or stale within its `stale-while-revalidate` (one background
    /// revalidation then starts unless one runs). A `Range` applies to it.
    /// `at` is the variant's key and the request's host.
    fn answer_from_state<B>(
        self: &Arc<Self>,
        req: &Request<B>,
        braid: &BraidRequest,
        resource: &Arc<Resource>,
        request_cc: &rules::CacheControl,
        at: (&Key, &str),
        validated_since_arrival: bool,
    ) -> Option<Response<Body>> {
        let stored = resource.stored().filter(|s| !s.invalid)?;
        let head = resource.head();
        if let Some(wanted) = &braid.version {
            if stored.version.as_ref() != Some(wanted) {
                return None;
            }
        }
        // Never older than the newest version the proxy knows: the
        // polled head's, or a live upstream subscription's.
        if stored.version.as_ref().is_some_and(|v| *v != head.version) {
            return None;
        }
        // An answer to a request that named its version is that version's
        // whatever came since; one that named only `Parents` runs to the
        // newest version the origin had, so it is held against the live one.
        let live = match braid.version {
            Some(_) => None,
            None => self.relays.newest_version(req, at.0),
        };
        if let Some(live) = live {
            let said = stored
                .headers
                .get("version")
                .and_then(|v| crate::braid::VersionList::parse_named(v.as_bytes(), "Version").ok());
            if said.as_ref() != Some(&live) {
                return None;
            }
        }
        let outcome = if validated_since_arrival {
            // The origin answered while this request waited for that fetch:
            // its answer is as current as one this request would get.
            CachePhase::Revalidated
        } else {
            let now = std::time::SystemTime::now();
            match stored.reuse(request_cc, now) {
                Reuse::Fresh { ttl } => CachePhase::Hit { ttl },
                Reuse::Revalidate => {
                    let ttl = rules::stale_while_revalidate(
                        stored.status,
                        &stored.headers,
                        stored.timing,
                        request_cc,
                        now,
                    )?;
                    self.revalidate_in_background(req, at, resource);
                    CachePhase::StaleWhileRevalidate { ttl }
                }
            }
        };
        Metrics::inc(&self.metrics.cache_hits_total);
        let response = subscribe::serve_stored(req, &stored, &head, outcome, &self.config.proxy_id);
        Some(range::answer(req, &stored.body, response))
    }

    /// Starts one revalidation of a stale stored answer that went out under
    /// `stale-while-revalidate` (RFC 5861 §3), unless a fetch of the
    /// variant is under way (it is the revalidation). Clients never wait
    /// for it: it holds the variant's `fetching` lock, which they only try.
    fn revalidate_in_background<B>(
        self: &Arc<Self>,
        req: &Request<B>,
        (key, host): (&Key, &str),
        resource: &Arc<Resource>,
    ) {
        let Ok(guard) = resource.fetching.clone().try_lock_owned() else {
            return;
        };
        let mut out = Request::new(body::no_request_body());
        *out.method_mut() = Method::GET;
        *out.uri_mut() = req.uri().clone();
        *out.version_mut() = req.version();
        let mut headers = req.headers().clone();
        for name in [
            header::RANGE,
            header::IF_RANGE,
            header::IF_NONE_MATCH,
            header::IF_MODIFIED_SINCE,
            header::CACHE_CONTROL,
            header::CONTENT_LENGTH,
        ] {
            headers.remove(name);
        }
        *out.headers_mut() = headers;
        if let Some(conn) = req.extensions().get::<upstream::ConnInfo>() {
            out.extensions_mut().insert(*conn);
        }
        let (inner, key, host, resource) = (
            self.clone(),
            key.clone(),
            host.to_string(),
            resource.clone(),
        );
        let limit = inner.config.response_timeout;
        tokio::spawn(async move {
            use http_body_util::BodyExt;
            let fetched = fetch(inner, out, key, host, Some(resource), Some(guard));
            let drain = async move {
                // Read through, so that a streamed answer is stored.
                let mut body = fetched.await.ok()?.into_body();
                while let Some(frame) = body.frame().await {
                    frame.ok()?;
                }
                Some(())
            };
            let _ = tokio::time::timeout(limit.saturating_mul(2), drain).await;
        });
    }

    /// Sends a GET to the origin for a stored answer that cannot be reused
    /// (a conditional request with its validators) or for none, and stores
    /// what comes back where RFC 9111 allows: a 304 refreshes the stored
    /// answer; a storable answer is streamed to the client as it is stored.
    fn fetch(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        key: Key,
        host: String,
        resource: Option<Arc<Resource>>,
        guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    ) -> impl std::future::Future<Output = Result<Response<Body>, Refusal>> + Send + 'static {
        fetch(self.clone(), req, key, host, resource, guard)
    }
}

/// See [`Gets::fetch`].
async fn fetch(
    inner: Arc<Gets>,
    req: Request<RequestBody>,
    key: Key,
    host: String,
    resource: Option<Arc<Resource>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
) -> Result<Response<Body>, Refusal> {
    let config = &inner.config;
    let request_cc = rules::request_cache_control(req.headers());
    let stored = resource.as_ref().and_then(|r| r.stored());
    let mut probe = Request::new(());
    *probe.method_mut() = req.method().clone();
    *probe.headers_mut() = req.headers().clone();
    let versioned = versioned_suffix(req.headers(), &key);
    let template = upstream::watcher_template(&req, config);
    let credentials = req.headers().contains_key(header::AUTHORIZATION);
    let mut out = upstream::upstream_request(req, &inner.client, config)?;
    let validators = stored.as_deref().and_then(|s| revalidate_with(&mut out, s));
    let revalidating = validators.is_some();
    let sent = std::time::SystemTime::now();
    // What may replace an origin's error (RFC 5861 §4).
    let fallback = stored.as_ref().filter(|s| {
        let head = resource.as_ref().map(|r| r.head());
        !s.invalid
            && s.version
                .as_ref()
                .is_none_or(|v| head.is_some_and(|h| *v == h.version))
            && rules::stale_if_error(
                s.status,
                &s.headers,
                s.timing,
                &request_cc,
                config.stale_if_error.as_secs(),
                sent,
            )
            .is_some()
    });
    let stale_if_error = |fwd_status: Option<StatusCode>| {
        let (stored, resource) = (fallback?, resource.as_ref()?);
        Some(subscribe::serve_stored(
            &probe,
            stored,
            &resource.head(),
            CachePhase::StaleIfError {
                fwd_status: fwd_status.map(|s| s.as_u16()),
            },
            &config.proxy_id,
        ))
    };
    let ticket = Ticket::take();
    let response = match inner.client.send(out).await {
        Ok(response) => response,
        Err(refusal) => return stale_if_error(None).ok_or(refusal),
    };
    if rules::is_origin_error(response.status()) {
        if let Some(answer) = stale_if_error(Some(response.status())) {
            return Ok(answer);
        }
    }
    // A Braid server names its versions: the proxy adds none of its own
    // (issue 19), and the resource is known to be a Braid server's.
    let braid_answer = crate::feed::braid::braid_signs(response.headers())
        || config.upstream_kind == UpstreamKind::Braid
        || inner.registry.is_braid(&key.path);
    let timing = Timing {
        request_time: sent,
        response_time: std::time::SystemTime::now(),
    };
    let status = response.status();
    if let (true, StatusCode::NOT_MODIFIED, Some(resource)) = (revalidating, status, &resource) {
        let (etag, modified) = validators.unwrap_or_default();
        // A 304 about an answer no longer stored (a newer one was recorded
        // meanwhile) merges nothing; the client gets the newer one.
        let asked = (ticket, etag.as_ref(), modified.as_ref());
        inner
            .watchers
            .not_modified(resource, response.headers(), timing, asked);
        resource.validated(Some(sent));
        Metrics::inc(&inner.metrics.cache_revalidated_total);
        if let Some(answer) = from_stored(&probe, resource, CachePhase::Revalidated, config) {
            return Ok(answer);
        }
    }
    if let (true, StatusCode::OK, Some(resource), Some(old)) =
        (probe.method() == Method::HEAD, status, &resource, &stored)
    {
        // A 200 to a HEAD freshens the stored GET answer it describes, and
        // invalidates one it does not (RFC 9111 §4.3.5).
        let describes = old.status == StatusCode::OK
            && rules::head_updates(&old.headers, old.body.len(), response.headers());
        if describes {
            if let Some(recording) = resource.record(ticket) {
                let mut updated = Stored::clone(old);
                updated.headers = rules::merge_not_modified(&old.headers, response.headers());
                updated.timing = timing;
                updated.invalid = false;
                resource.set_stored(Some(updated));
                drop(recording);
                resource.validated(Some(sent));
                let outcome = CachePhase::Stored {
                    fwd: Fwd::Stale,
                    status: 200,
                };
                if let Some(answer) = from_stored(&probe, resource, outcome, config) {
                    return Ok(answer);
                }
            }
        } else {
            resource.invalidate();
        }
    }
    let fwd = if stored.is_some() {
        Fwd::Stale
    } else if resource.is_some() {
        Fwd::Miss
    } else {
        Fwd::UriMiss
    };
    let not_stored = if probe.method() == Method::HEAD {
        Some("head")
    } else {
        rules::unstorable(&request_cc, status, response.headers(), credentials)
    };
    let declared = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let not_stored = not_stored.or_else(|| {
        declared
            .is_some_and(|n| n > config.max_body_bytes)
            .then_some("too large")
    });
    // The copy kept while the answer streams through counts against a
    // budget shared by all requests in flight; over it, the answer is only
    // passed on.
    let copy_limit = declared.unwrap_or(config.max_body_bytes);
    let copy = match not_stored {
        None => inner.copies.reserve(copy_limit),
        Some(_) => None,
    };
    let not_stored = not_stored.or_else(|| copy.is_none().then_some("busy"));
    let mut response = upstream::downstream_response(response, config);
    let (target, first_held) = match not_stored {
        Some(reason) => (Err(reason), None),
        None => {
            let at = (&key, host.as_str(), versioned.as_str());
            store_target(&inner, at, &probe, response.headers(), template, &resource)
        }
    };
    let (target, guard): (_, Held) = match target {
        Ok((t, Some(lock))) => (
            Ok(t),
            [Some(lock), first_held].into_iter().flatten().collect(),
        ),
        Ok((t, None)) => (Ok(t), [guard, first_held].into_iter().flatten().collect()),
        Err(reason) => (Err(reason), guard.into_iter().collect()),
    };
    let phase = match target {
        Err(reason) => {
            if let Some(resource) = &resource {
                resource
                    .uncacheable
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
            Metrics::inc(&inner.metrics.cache_not_stored_total);
            CachePhase::NotStored {
                fwd,
                status: status.as_u16(),
                reason,
            }
        }
        Ok(target) => {
            let headers = response.headers().clone();
            let encoded = headers.contains_key(header::CONTENT_ENCODING);
            // The version this answer will have: the head's when it is the
            // head's ETag (a written version keeps the writer's id).
            let head = target.head();
            let same_etag = matches!(&head.state, State::Present { etag: Some(e), .. }
                if headers.get(header::ETAG).is_some_and(|v| v.as_bytes() == e.as_bytes()));
            if braid_answer {
                target.learn_kind(Kind::Braid);
                inner.registry.learn_braid(&key.path);
            }
            let announced = if same_etag {
                Some(head.version.clone())
            } else {
                crate::state::announced_version(&headers)
            }
            .filter(|_| status == StatusCode::OK && !encoded && !braid_answer);
            if status == StatusCode::OK
                && !encoded
                && !braid_answer
                && announced.is_none()
                && declared.is_some()
            {
                // The version is a hash of the body: read it (it is
                // within max-body-bytes) so this answer can name it.
                Metrics::inc(&inner.metrics.cache_misses_total);
                let held = fetch_whole(
                    inner.clone(),
                    response,
                    probe,
                    target,
                    (timing, ticket),
                    fwd,
                    guard,
                );
                let answer = held.await;
                drop(copy);
                return answer;
            }
            if let Some(v) =
                announced.and_then(|v| HeaderValue::from_str(&v.to_header_value()).ok())
            {
                let h = response.headers_mut();
                h.insert(HeaderName::from_static("version"), v.clone());
                h.insert(HeaderName::from_static("current-version"), v);
            }
            if status == StatusCode::NO_CONTENT || declared == Some(0) {
                // No body to wait for (a 204's is never polled).
                inner.watchers.absorb_fetched(
                    &target,
                    status,
                    &headers,
                    bytes::Bytes::new(),
                    (timing, ticket),
                    true,
                );
                target.validated(Some(timing.request_time));
                drop(guard);
                Metrics::inc(&inner.metrics.cache_misses_total);
                let phase = CachePhase::Stored {
                    fwd,
                    status: status.as_u16(),
                };
                return Ok(phase.mark(response, &config.proxy_id));
            }
            let watchers = inner.watchers.clone();
            let body = std::mem::replace(response.body_mut(), body::empty());
            let done: body::OnComplete = Box::new(move |bytes| {
                watchers.absorb_fetched(&target, status, &headers, bytes, (timing, ticket), true);
                target.validated(Some(timing.request_time));
            });
            *response.body_mut() = body::tee(body, copy_limit, (guard, copy), done);
            CachePhase::Stored {
                fwd,
                status: status.as_u16(),
            }
        }
    };
    Metrics::inc(&inner.metrics.cache_misses_total);
    Ok(phase.mark(response, &config.proxy_id))
}

/// What a request named of its versions, when its key was made with them
/// (a resource not known to be plain, see `Gets::answer`); empty otherwise.
fn versioned_suffix(headers: &HeaderMap, key: &Key) -> String {
    let versioned = BraidRequest::parse(headers)
        .map(|b| named_versions(&b))
        .unwrap_or_default();
    match key.secondary.ends_with(&versioned) {
        true => versioned,
        false => String::new(),
    }
}

/// Makes `out` a revalidation of `stored` when it has validators (its
/// own, not the client's); returns them.
fn revalidate_with<B>(
    out: &mut Request<B>,
    stored: &Stored,
) -> Option<(Option<HeaderValue>, Option<HeaderValue>)> {
    // A same-second Last-Modified is not sent: a 304 to it proves nothing.
    let (etag, modified) = rules::revalidation_validators(&stored.headers);
    if etag.is_none() && modified.is_none() {
        return None;
    }
    let h = out.headers_mut();
    h.remove(header::IF_NONE_MATCH);
    h.remove(header::IF_MODIFIED_SINCE);
    if let Some(etag) = &etag {
        h.insert(header::IF_NONE_MATCH, etag.clone());
    }
    if let Some(modified) = &modified {
        h.insert(header::IF_MODIFIED_SINCE, modified.clone());
    }
    Some((etag, modified))
}

/// A fetching lock held until an answer is stored.
type HeldLock = tokio::sync::OwnedMutexGuard<()>;

/// Where a storable answer goes, with the lock it holds until stored; or
/// why it cannot be stored.
type Target = Result<(Arc<Resource>, Option<HeldLock>), &'static str>;

/// The resource a storable answer goes into (the variant its `Vary` makes
/// of the request, under the versions the request named: `at` is the key
/// looked up, the host and that suffix), with the lock of that variant
/// when it is not the one waited on, and the first-contact lock of a new
/// variant key; `Err` with the reason when it cannot be tracked.
fn store_target(
    inner: &Arc<Gets>,
    (key, host, versioned): (&Key, &str, &str),
    probe: &Request<()>,
    answer: &HeaderMap,
    template: HeaderMap,
    resource: &Option<Arc<Resource>>,
) -> (Target, Option<HeldLock>) {
    let mut first_held = None;
    let vary = rules::vary(answer);
    if vary != key.vary {
        // Requests of the variant this answer goes under that come before
        // it is stored wait for it, as at first contact (the lock is taken
        // before the `Vary` is recorded, so none of them can miss it).
        let mut next = Key {
            path: key.path.clone(),
            secondary: rules::secondary_key(probe.headers(), host, &vary),
            vary: vary.clone(),
        };
        next.secondary.push_str(versioned);
        first_held = inner.first.lock_of(&next).try_lock_owned().ok();
    }
    let mut key = inner
        .registry
        .learn_vary(&key.path, &vary, probe.headers(), host);
    // A versioned answer stays under the versions its request named, as it
    // was looked up: never the present's variant.
    key.secondary.push_str(versioned);
    // An answer that goes into another resource than the one waited on
    // (its `Vary` made another key) holds that one's lock until stored,
    // taken under the registry's lock as it is found, so that requests of
    // its variant wait for it rather than ask again.
    let target = inner
        .registry
        .get_or_create(
            &key,
            || template,
            |r| match resource {
                Some(w) if Arc::ptr_eq(w, r) => None,
                _ => r.fetching.clone().try_lock_owned().ok(),
            },
        )
        .map(|(r, _, lock)| (r, lock))
        .map_err(|_| match inner.registry.is_full() {
            true => "state full",
            false => "private cap",
        });
    (target, first_held)
}

/// What a request named of its versions (`Version`, `Parents`), as a
/// suffix of its key: an answer to it is that version's, not the present
/// (every Braid answer varies by them, spec/caching.md). Empty when it
/// named none. Its names are not header names, so a `Vary` naming
/// `Version` cannot make a key end the same way.
fn named_versions(braid: &BraidRequest) -> String {
    let mut out = String::new();
    for (name, value) in [("version", &braid.version), ("parents", &braid.parents)] {
        if let Some(v) = value {
            let _ = write!(out, "\n:{name}:{}", v.to_header_value());
        }
    }
    out
}

/// Whether a request comes from a downstream tier: a `--trusted-downstream`
/// peer announcing this proxy's `Surrogate-Capability`. Its answers keep
/// `Surrogate-Key`, so that a tag purge reaches what that tier stores
/// (spec/tiers.md).
pub fn from_a_tier_below<B>(req: &Request<B>) -> bool {
    let trusted = req
        .extensions()
        .get::<upstream::ConnInfo>()
        .is_some_and(|c| c.trusted);
    trusted
        && req
            .headers()
            .get_all("surrogate-capability")
            .iter()
            .any(|v| v.as_bytes() == rules::SURROGATE_CAPABILITY.as_bytes())
}

/// Reads a storable 200 whole (its length is declared and within
/// `--max-body-bytes`), stores it, and answers from the stored state,
/// so the answer carries the version derived from the body.
async fn fetch_whole(
    inner: Arc<Gets>,
    response: Response<Body>,
    probe: Request<()>,
    target: Arc<Resource>,
    sent: (Timing, Ticket),
    fwd: Fwd,
    guard: Held,
) -> Result<Response<Body>, Refusal> {
    use http_body_util::BodyExt;
    let (parts, body) = response.into_parts();
    let limit = inner.config.max_body_bytes;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let read = async move {
        use bytes::Buf;
        let mut body = body;
        let mut buf = bytes::BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("origin body failed: {e}"))?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.remaining() > limit {
                    return Err("origin body is larger than its Content-Length".to_string());
                }
                buf.extend_from_slice(data.chunk());
            }
        }
        Ok::<_, String>(body::compact(buf))
    };
    let bytes = match tokio::time::timeout(inner.config.response_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(reason)) => return Err(Refusal::UpstreamBroken(reason)),
        Err(_) => return Err(Refusal::UpstreamTimeout(inner.config.response_timeout)),
    };
    inner
        .watchers
        .absorb_fetched(&target, parts.status, &parts.headers, bytes, sent, true);
    target.validated(Some(sent.0.request_time));
    drop(guard);
    from_stored(
        &probe,
        &target,
        CachePhase::Stored { fwd, status: 200 },
        &inner.config,
    )
    .ok_or_else(|| Refusal::UpstreamBroken("origin answer could not be stored".into()))
}

/// `resource`'s stored answer to `probe`, if it has one, as `outcome` says.
fn from_stored(
    probe: &Request<()>,
    resource: &Resource,
    outcome: CachePhase,
    config: &Config,
) -> Option<Response<Body>> {
    let stored = resource.stored()?;
    let head = resource.head();
    Some(subscribe::serve_stored(
        probe,
        &stored,
        &head,
        outcome,
        &config.proxy_id,
    ))
}

/// The answer to `only-if-cached` when nothing stored will do (RFC 9111 §5.2.1.7).
fn only_if_cached_miss() -> Response<Body> {
    let mut response = Response::new(body::full(
        "nothing stored for this request (only-if-cached)\n",
    ));
    *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
    response
}
