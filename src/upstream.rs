//! Watchers: how the proxy learns that a resource changed. One watcher task
//! per resource polls the origin with conditional requests while the
//! resource has subscribers, revalidates at once when woken (write-through,
//! the refresh hook, a plain GET of a stale state), backs off on errors, and
//! ends after the resource has been idle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use tracing::{debug, warn};

use crate::body;
use crate::metrics::Metrics;
use crate::proxy::UpstreamClient;
use crate::resource::{History, Registry, Resource, State, Tuning};

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
    pub response_timeout: Duration,
    pub via: HeaderValue,
}

/// Longest wait between polls after repeated errors.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl Watchers {
    /// Runs the one watcher of `resource` until the resource is dropped.
    pub async fn watch(self: Arc<Self>, resource: Arc<Resource>) {
        let mut backoff: Option<Duration> = None;
        let mut woken = true; // the creator wants a first state
        let mut validators = Validators::default();
        loop {
            if woken || resource.subscribers() > 0 {
                let ok = self.poll_once(&resource, &mut validators).await;
                resource.validated(ok);
                backoff = if ok {
                    None
                } else {
                    Some(backoff.map_or(self.poll_interval, |b| (b * 2).min(MAX_BACKOFF)))
                };
            }
            let wait = if resource.subscribers() > 0 {
                backoff.unwrap_or(self.poll_interval)
            } else {
                self.poll_interval
                    .min(self.resource_idle)
                    .max(Duration::from_millis(10))
            };
            woken = tokio::select! {
                _ = tokio::time::sleep(wait) => false,
                _ = resource.wake.notified() => true,
            };
            if !woken && self.registry.remove_if_idle(&resource, self.resource_idle) {
                debug!(resource = resource.key(), "resource idle; watcher ends");
                return;
            }
        }
    }

    /// One conditional request; publishes what changed. False on failure.
    async fn poll_once(&self, resource: &Resource, validators: &mut Validators) -> bool {
        let uri = match self.client.uri_for(resource.key()) {
            Ok(uri) => uri,
            Err(_) => return false,
        };
        let mut req = Request::new(body::empty());
        *req.method_mut() = Method::GET;
        *req.uri_mut() = uri;
        let headers = req.headers_mut();
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        headers.insert(header::VIA, self.via.clone());
        if resource.head().seq > 0 {
            if let Some(etag) = &validators.etag {
                headers.insert(header::IF_NONE_MATCH, etag.clone());
            } else if let Some(date) = &validators.last_modified {
                headers.insert(header::IF_MODIFIED_SINCE, date.clone());
            }
        }
        let response = match self.client.send(req).await {
            Ok(r) => r,
            Err(e) => {
                warn!(resource = resource.key(), error = %e, "poll failed");
                return false;
            }
        };
        let status = response.status();
        if status == StatusCode::NOT_MODIFIED {
            Metrics::inc(&self.metrics.polls_not_modified_total);
            return true;
        }
        let state = match status {
            StatusCode::OK => {
                let headers = response.headers();
                let content_type = text_header(headers, header::CONTENT_TYPE);
                let etag = text_header(headers, header::ETAG);
                let declared = headers
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok());
                validators.etag = headers.get(header::ETAG).cloned();
                validators.last_modified = headers.get(header::LAST_MODIFIED).cloned();
                if declared.is_some_and(|n| n > self.max_body_bytes as u64) {
                    too_large(self.max_body_bytes)
                } else {
                    match self.read_body(response.into_body()).await {
                        Ok(body) => State::Present {
                            body,
                            content_type,
                            etag,
                        },
                        Err(BodyFailure::TooLarge) => too_large(self.max_body_bytes),
                        Err(BodyFailure::Broken(reason)) => {
                            warn!(resource = resource.key(), %reason, "origin body failed");
                            return false;
                        }
                    }
                }
            }
            StatusCode::NOT_FOUND | StatusCode::GONE => {
                *validators = Validators::default();
                State::Missing {
                    status: status.as_u16(),
                }
            }
            other => {
                warn!(
                    resource = resource.key(),
                    status = other.as_u16(),
                    "origin answered a poll with an unusable status"
                );
                return false;
            }
        };
        if let State::Error { reason, .. } = &state {
            warn!(resource = resource.key(), %reason, "origin body not tracked");
        }
        resource.publish(state, &self.history, &self.tuning, &self.metrics);
        true
    }

    /// Reads a body up to the limit, bounded in time by the response timeout.
    async fn read_body(&self, body: hyper::body::Incoming) -> Result<Bytes, BodyFailure> {
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

enum BodyFailure {
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
