//! Braid writes onto a plain origin. A `PUT` or `PATCH` that carries Braid
//! patches (`Content-Range`, `Patches: N`) is never passed to an origin that
//! is not known to speak Braid: the proxy applies the patches to the
//! current document itself and writes the whole new body back with a `PUT`
//! under `If-Match` (or `If-Unmodified-Since`), one write at a time per
//! resource. A patch that cannot apply, or whose `Parents` are not the
//! current version, is refused before the origin is written to; an origin
//! that answers 412 makes a 409. Subscribers get the writer's patches.
//! The rules are in spec/writes.md.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::braid::BraidRequest;
use crate::braid::{self, DecodeError, DecodeLimits, Patch, PatchError, RangeUnit, VersionList};
use crate::config::Config;
use crate::error::Refusal;
use crate::feed::poll::{BodyFailure, Watchers};
use crate::floor::body::{Body, RequestBody};
use crate::floor::rules::Timing;
use crate::metrics::Metrics;
use crate::state::{self, Change, Head, Resource, State, Ticket};
use crate::upstream;

/// How often the proxy looks again when the origin's document is not the
/// state it holds, before it gives up with 503.
const SETTLE_ATTEMPTS: usize = 4;

/// Request headers that describe the patch, or a precondition of the
/// client's, and so are not sent with the whole-body `PUT`.
const PATCH_HEADERS: [&str; 12] = [
    "content-range",
    "patches",
    "version",
    "parents",
    "content-length",
    "content-type",
    "content-encoding",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
    "if-range",
];

/// Patch writes to plain origins, shared by all requests.
pub struct Writes {
    watchers: Arc<Watchers>,
    max_header_bytes: usize,
    /// One lock per resource with a patch write under way or waiting.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Whether a request carries Braid patches: a `PUT` or `PATCH` with
/// `Content-Range`, `Patches`, or a patch media type (see [`patch_media_type`]).
pub fn carries_patches<B>(req: &Request<B>) -> bool {
    let h = req.headers();
    matches!(*req.method(), Method::PUT | Method::PATCH)
        && (h.contains_key(header::CONTENT_RANGE)
            || h.contains_key("patches")
            || patch_media_type(req).is_some())
}

/// The request's media type when it says the body is a patch rather than a
/// document: a `+patch` type (range-patch §2.2), or on a `PUT` a JSON Patch
/// or JSON Merge Patch. (A `PATCH` in those types is the origin's own
/// business and passes through.)
fn patch_media_type<B>(req: &Request<B>) -> Option<String> {
    let value = req.headers().get(header::CONTENT_TYPE)?.to_str().ok()?;
    let media = value.split(';').next()?.trim().to_ascii_lowercase();
    let json_patch = matches!(
        media.as_str(),
        "application/json-patch+json" | "application/merge-patch+json"
    );
    (media.ends_with("+patch") || (json_patch && req.method() == Method::PUT)).then_some(media)
}

/// What the proxy learned of the origin's current document.
struct Current {
    /// The resource's head, which is the origin's current document.
    head: Arc<Head>,
    /// The precondition that names it at the origin, if the origin gave a validator.
    precondition: Option<(HeaderName, HeaderValue)>,
}

impl Writes {
    pub fn new(watchers: Arc<Watchers>, config: &Config) -> Writes {
        Writes {
            watchers,
            max_header_bytes: config.max_header_bytes,
            locks: Mutex::default(),
        }
    }

    /// Applies a patch write to `resource` of a plain origin.
    pub async fn apply(
        &self,
        req: Request<RequestBody>,
        braid: &BraidRequest,
        resource: Arc<Resource>,
        config: &Config,
    ) -> Result<Response<Body>, Refusal> {
        if let Some(media) = patch_media_type(&req) {
            return Err(Refusal::UnsupportedPatchType(format!(
                "patches in {media} are not applied by the proxy for this origin; send range patches (Content-Range or Patches) or the whole body"
            )));
        }
        let parents = braid
            .parents
            .clone()
            .filter(|p| !p.is_empty())
            .ok_or_else(|| {
                Refusal::PreconditionRequired(
                    "a patch write needs Parents: the version the patches were made against".into(),
                )
            })?;
        let (parts, incoming) = req.into_parts();
        let patches = self.read_patches(&parts.headers, incoming).await?;
        let lock = self.lock_for(resource.key());
        let wait = self.watchers.response_timeout * 4;
        let Ok(_one) = tokio::time::timeout(wait, lock.lock()).await else {
            return Err(Refusal::Unavailable {
                reason: "too many patch writes to this resource at once; retry".into(),
                retry_after: Duration::from_secs(1),
            });
        };
        let write = Write {
            writes: self,
            resource: &resource,
            config,
        };
        let result = write.run(parts, braid, &parents, patches).await;
        let metrics = &self.watchers.metrics;
        match &result {
            Ok(response) if response.status().is_success() => {
                Metrics::inc(&metrics.patch_writes_total)
            }
            Err(Refusal::Conflict { .. }) => Metrics::inc(&metrics.patch_conflicts_total),
            _ => {}
        }
        result
    }

    /// The lock of one resource's patch writes; entries no request holds are dropped.
    fn lock_for(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.retain(|_, lock| Arc::strong_count(lock) > 1);
        locks.entry(key.to_string()).or_default().clone()
    }

    /// Reads and checks the patches of a request, before the origin is asked anything.
    async fn read_patches(
        &self,
        headers: &HeaderMap,
        incoming: RequestBody,
    ) -> Result<Vec<Patch>, Refusal> {
        let limit = self.watchers.max_body_bytes;
        let too_large = || {
            Refusal::ContentTooLarge(format!(
                "the patch is larger than max-body-bytes ({limit} bytes)"
            ))
        };
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let content = match self.watchers.read_body(incoming).await {
            Ok(content) => content,
            Err(BodyFailure::TooLarge) => return Err(too_large()),
            Err(BodyFailure::Broken(reason)) => {
                return Err(Refusal::BadRequest(format!(
                    "the request body did not arrive: {reason}"
                )))
            }
        };
        let patches = match (headers.get(header::CONTENT_RANGE), headers.get("patches")) {
            (Some(_), Some(_)) => {
                return Err(Refusal::BadPatch(
                    "a request has Content-Range or Patches, not both".into(),
                ))
            }
            (Some(range), None) => {
                let (unit, range) =
                    braid::parse_content_range(range.as_bytes()).map_err(bad_patch)?;
                vec![Patch {
                    unit,
                    range,
                    content,
                }]
            }
            (None, Some(count)) => {
                let count = count
                    .to_str()
                    .ok()
                    .and_then(|c| c.trim().parse::<usize>().ok())
                    .ok_or_else(|| {
                        Refusal::BadPatch("malformed Patches header: expected a number".into())
                    })?;
                let limits = DecodeLimits {
                    max_header_block: self.max_header_bytes,
                    max_content_length: limit,
                    max_patches: braid::MAX_PATCHES,
                };
                braid::decode_patches(&content, count, &limits).map_err(bad_patch)?
            }
            (None, None) => return Err(Refusal::BadPatch("no patches in the request".into())),
        };
        canonical(patches)
    }
}

/// Checks that every patch is in a unit the proxy applies, with a `[a:b]`
/// range, and writes the ranges in their canonical form.
fn canonical(patches: Vec<Patch>) -> Result<Vec<Patch>, Refusal> {
    let unit = patches.first().map(|p| p.unit);
    patches
        .into_iter()
        .map(|p| {
            if p.unit == RangeUnit::Json {
                return Err(unknown_unit("json"));
            }
            if Some(p.unit) != unit {
                return Err(Refusal::BadPatch(
                    "the patches of one write must share one unit".into(),
                ));
            }
            let (a, b) = p.span().ok_or_else(|| {
                Refusal::BadPatch(format!(
                    "malformed patch range {:?}: expected [a:b] with a <= b",
                    p.range
                ))
            })?;
            Ok(match p.unit {
                RangeUnit::Text => Patch::text(a, b, p.content),
                _ => Patch::bytes(a, b, p.content),
            })
        })
        .collect()
}

fn unknown_unit(unit: &str) -> Refusal {
    Refusal::BadPatch(format!(
        "unknown range unit {unit}: the proxy applies text and bytes patches only"
    ))
}

fn bad_patch(e: DecodeError) -> Refusal {
    match e {
        DecodeError::UnknownUnit(unit) => unknown_unit(&unit),
        DecodeError::ContentLengthTooLarge { limit, .. } => Refusal::ContentTooLarge(format!(
            "the patches are larger than max-body-bytes ({limit} bytes)"
        )),
        e => Refusal::BadPatch(format!("malformed patch: {e}")),
    }
}

fn patch_error(e: PatchError) -> Refusal {
    match e {
        PatchError::OutOfBounds { .. } => Refusal::RangeNotSatisfiable(e.to_string()),
        e => Refusal::BadPatch(e.to_string()),
    }
}

/// One patch write, made while holding its resource's lock.
struct Write<'a> {
    writes: &'a Writes,
    resource: &'a Arc<Resource>,
    config: &'a Config,
}

impl Write<'_> {
    async fn run(
        &self,
        parts: Parts,
        braid: &BraidRequest,
        parents: &VersionList,
        patches: Vec<Patch>,
    ) -> Result<Response<Body>, Refusal> {
        let Current { head, precondition } = self.current().await?;
        let State::Present {
            body: old,
            content_type,
            language,
            ..
        } = &head.state
        else {
            return Err(conflict(
                "the resource does not exist at the origin; PUT a whole body to create it",
                &head,
            ));
        };
        let precondition = precondition.ok_or_else(|| {
            Refusal::PreconditionRequired(
                "the origin gives no ETag or Last-Modified for this resource, so a patch cannot be written safely; PUT the whole body".into(),
            )
        })?;
        if head.version != *parents {
            return Err(conflict(
                &format!(
                    "Parents {} are not the current version; nothing was written",
                    parents.to_header_value()
                ),
                &head,
            ));
        }
        let new = braid::apply_patches(old, &patches).map_err(patch_error)?;
        let limit = self.writes.watchers.max_body_bytes;
        if new.len() > limit {
            return Err(Refusal::ContentTooLarge(format!(
                "the patched document would be larger than max-body-bytes ({limit} bytes)"
            )));
        }
        let new = Bytes::from(new);
        let content_type = content_type.clone().or_else(|| {
            let given = parts.headers.get(header::CONTENT_TYPE)?;
            given.to_str().ok().map(str::to_string)
        });
        let put = self.put(parts, new.clone(), content_type.as_deref(), precondition);
        let response = match put.await {
            Ok(response) => response,
            Err(e) => {
                // The write may or may not have landed: look again.
                self.resource.refresh();
                return Err(e);
            }
        };
        let status = response.status();
        if status == StatusCode::PRECONDITION_FAILED {
            let now = self.current().await?;
            return Err(conflict(
                "the document changed at the origin (412 Precondition Failed); nothing was written",
                &now.head,
            ));
        }
        if !status.is_success() {
            self.resource.refresh();
            return Ok(upstream::downstream_response(response, self.config));
        }
        // Answers to requests sent before now may show the document before
        // this write: they are not recorded (see Resource::record).
        self.resource.landed();
        let etag = match text(response.headers(), header::ETAG) {
            Some(etag) => Some(Some(etag)),
            None => self.etag_after_write(&new).await,
        };
        let recorded = match etag {
            Some(etag) => {
                let state = State::Present {
                    body: new,
                    content_type,
                    etag,
                    language: language.clone(),
                };
                Some(self.record(&head, braid, state, patches))
            }
            // Another write followed ours before the proxy could look.
            None => {
                self.resource.refresh();
                None
            }
        };
        let mut response = upstream::downstream_response(response, self.config);
        let headers = response.headers_mut();
        let current = self.resource.head().version.clone();
        for (name, version) in [
            ("version", recorded.as_ref()),
            ("current-version", Some(&current)),
        ] {
            if let Some(v) = version
                .filter(|v| !v.is_empty())
                .and_then(|v| HeaderValue::from_str(&v.to_header_value()).ok())
            {
                headers.insert(name, v);
            }
        }
        Ok(response)
    }

    /// Records a written state as the version after `parents`, with the
    /// writer's patches. The writer's `Version` is kept when the origin
    /// names the state with a strong ETag and the id is new; otherwise the
    /// version is the proxy's usual one for the state. Returns the version.
    fn record(
        &self,
        parents: &Head,
        braid: &BraidRequest,
        state: State,
        patches: Vec<Patch>,
    ) -> VersionList {
        let strong = matches!(&state, State::Present { etag: Some(e), .. } if state::strong_etag(e).is_some());
        let writers = braid
            .version
            .clone()
            .filter(|v| strong && v.iter().count() == 1 && self.resource.seq_of(v).is_none());
        let derived = state::derived_version(&state);
        let version = writers.clone().unwrap_or_else(|| derived.clone());
        let w = &self.writes.watchers;
        let change = Change {
            state,
            version: writers,
            patches: Some(patches),
        };
        if self
            .resource
            .publish_on(&parents.version, change, &w.history, &w.tuning, &w.metrics)
        {
            return version;
        }
        // The watcher recorded something first (most likely this very
        // write, under the origin's version): have it look again.
        self.resource.refresh();
        derived
    }

    /// Brings the resource up to date with the origin: asks the origin
    /// (under the resource's own request headers), and when its answer is
    /// not the state held, records that answer as the current state.
    async fn current(&self) -> Result<Current, Refusal> {
        for _ in 0..SETTLE_ATTEMPTS {
            let head = self.resource.head();
            let held_etag = match &head.state {
                State::Present { etag: Some(e), .. } if state::strong_etag(e).is_some() => {
                    Some(e.as_str())
                }
                _ => None,
            };
            let sent = SystemTime::now();
            let ticket = Ticket::take();
            let response = self.get(held_etag).await?;
            let timing = Timing {
                request_time: sent,
                response_time: SystemTime::now(),
            };
            let headers = response.headers().clone();
            let status = response.status();
            let same = match status {
                StatusCode::NOT_MODIFIED => held_etag.is_some(),
                StatusCode::OK => {
                    let body = self.read(response).await?;
                    let same = matches!(&head.state, State::Present { body: held, etag, .. }
                        if *held == body && *etag == text(&headers, header::ETAG));
                    if !same {
                        // The proxy was behind the origin: this is the current state.
                        self.writes.watchers.absorb_fetched(
                            self.resource, status, &headers, body, (timing, ticket), false,
                        );
                        continue;
                    }
                    true
                }
                StatusCode::NOT_FOUND | StatusCode::GONE => {
                    if !matches!(head.state, State::Missing { .. }) {
                        self.writes.watchers.absorb_fetched(
                            self.resource, status, &headers, Bytes::new(), (timing, ticket), false,
                        );
                    }
                    true
                }
                other => {
                    return Err(Refusal::UpstreamBroken(format!(
                        "the origin answered {} to the proxy's GET; patches cannot be applied without the current document",
                        other.as_u16()
                    )))
                }
            };
            if same {
                let precondition = precondition(&headers, held_etag);
                return Ok(Current {
                    head: self.resource.head(),
                    precondition,
                });
            }
        }
        Err(Refusal::Unavailable {
            reason: "the document kept changing at the origin while the proxy looked; retry".into(),
            retry_after: Duration::from_secs(1),
        })
    }

    /// After a write whose answer had no ETag: the ETag of the written
    /// state from a fresh GET (`Some(None)` when it has none), or `None`
    /// when the origin already holds another body.
    async fn etag_after_write(&self, written: &Bytes) -> Option<Option<String>> {
        let response = self.get(None).await.ok()?;
        if response.status() != StatusCode::OK {
            return None;
        }
        let etag = text(response.headers(), header::ETAG);
        let body = self.read(response).await.ok()?;
        (body == *written).then_some(etag)
    }

    /// A GET of the resource, conditional on `etag` when given.
    async fn get(&self, etag: Option<&str>) -> Result<Response<Incoming>, Refusal> {
        let watchers = &self.writes.watchers;
        let etag = etag.and_then(|e| HeaderValue::from_str(e).ok());
        let req = watchers.plain_get(self.resource, etag)?;
        watchers.client.send(req).await
    }

    /// Reads a body from the origin, up to `--max-body-bytes`.
    async fn read(&self, response: Response<Incoming>) -> Result<Bytes, Refusal> {
        match self
            .writes
            .watchers
            .read_body(crate::floor::body::incoming(response.into_body()))
            .await {
            Ok(body) => Ok(body),
            Err(BodyFailure::TooLarge) => Err(Refusal::ContentTooLarge(format!(
                "the document is larger than max-body-bytes ({} bytes); the proxy cannot apply patches to it",
                self.writes.watchers.max_body_bytes
            ))),
            Err(BodyFailure::Broken(reason)) => Err(Refusal::UpstreamBroken(reason)),
        }
    }

    /// The whole-body PUT: the client's request with the patch headers
    /// replaced by the new body, its type and the precondition.
    async fn put(
        &self,
        mut parts: Parts,
        body: Bytes,
        content_type: Option<&str>,
        (name, value): (HeaderName, HeaderValue),
    ) -> Result<Response<Incoming>, Refusal> {
        parts.method = Method::PUT;
        let headers = &mut parts.headers;
        for name in PATCH_HEADERS {
            headers.remove(name);
        }
        headers.remove(header::EXPECT);
        headers.insert(name, value);
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        if let Some(v) = content_type.and_then(|t| HeaderValue::from_str(t).ok()) {
            headers.insert(header::CONTENT_TYPE, v);
        }
        let req = Request::from_parts(parts, Full::new(body));
        let out = upstream::upstream_request(req, &self.writes.watchers.client, self.config)?;
        self.writes.watchers.client.send(out).await
    }
}

/// The precondition that names the origin's current document: `If-Match`
/// with its strong ETag, else `If-Unmodified-Since` with its Last-Modified.
fn precondition(headers: &HeaderMap, held_etag: Option<&str>) -> Option<(HeaderName, HeaderValue)> {
    let etag = text(headers, header::ETAG).or(held_etag.map(str::to_string));
    if let Some(v) = etag
        .filter(|e| state::strong_etag(e).is_some())
        .and_then(|e| HeaderValue::from_str(&e).ok())
    {
        return Some((header::IF_MATCH, v));
    }
    let date = headers.get(header::LAST_MODIFIED)?;
    httpdate::parse_http_date(date.to_str().ok()?).ok()?;
    Some((header::IF_UNMODIFIED_SINCE, date.clone()))
}

/// A 409 naming the current version.
fn conflict(reason: &str, head: &Head) -> Refusal {
    Refusal::Conflict {
        reason: reason.to_string(),
        current: head.version.to_header_value(),
    }
}

fn text(headers: &HeaderMap, name: HeaderName) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}
