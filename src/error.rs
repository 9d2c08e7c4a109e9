//! Every error the proxy answers a client with, mapped to a status and a
//! one-line plain-text reason in one place ([`Refusal::into_response`]).

use std::time::Duration;

use http::{header, HeaderValue, Response, StatusCode};

use crate::floor::body::{self, Body};

/// Why a request is answered by the proxy itself with an error.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// A malformed request: the message names what was wrong.
    #[error("{0}")]
    BadRequest(String),
    /// An absolute-form request URI naming a host other than this proxy.
    #[error("absolute-form request for another host: this is a reverse proxy, not an open proxy")]
    ForeignHost,
    #[error("CONNECT is not supported: this is a reverse proxy, not an open proxy")]
    Connect,
    #[error("{0}")]
    HeadersTooLarge(String),
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    #[error("upstream error: {0}")]
    UpstreamBroken(String),
    #[error("upstream timed out after {0:?} waiting for a response")]
    UpstreamTimeout(Duration),
    /// The upstream's subscription stream for this request just ended on a
    /// malformed update: not asked again until `retry_after` has passed.
    /// (What was malformed is logged, not told: it quotes upstream bytes.)
    #[error("the upstream's subscription stream was malformed; retry later")]
    UpstreamMalformed { retry_after: Duration },
    #[error("{reason}")]
    Unavailable {
        reason: String,
        retry_after: Duration,
    },
    #[error("loop detected: this proxy ({0}) is already in Via")]
    Loop(String),
    #[error("not found")]
    NotFound,
    /// A malformed multiplexer request (version, ids, path).
    #[error("{0}")]
    BadMultiplexer(String),
    /// A request for a multiplexer that does not exist: 424 for a request
    /// through it, 404 for a DELETE (braid-http's statuses), with
    /// `Bad-Multiplexer` naming it.
    #[error("multiplexer {id} does not exist")]
    UnknownMultiplexer { id: String, status: StatusCode },
    /// A DELETE of a request the multiplexer does not hold (`Bad-Request` names it).
    #[error("request {0} does not exist in this multiplexer")]
    UnknownMultiplexedRequest(String),
    /// A multiplexer or multiplexed request id already in use: braid-http's
    /// client reads the JSON body's `error` to tell the two apart.
    #[error("{{\"error\":{},\"details\":{}}}", serde_json::Value::from(*error), serde_json::Value::from(details.as_str()))]
    MultiplexConflict {
        error: &'static str,
        details: String,
    },
    #[error("method not allowed")]
    MethodNotAllowed(&'static str),
    /// A patch write that would lose an update: its `Parents` are not the
    /// current version, or the origin answered 412. `current` is the
    /// `Current-Version` header value (empty when unknown).
    #[error("{reason}")]
    Conflict { reason: String, current: String },
    /// A patch the proxy cannot read: framing, `Patches` count, unit, range syntax.
    #[error("{0}")]
    BadPatch(String),
    /// A patch range past the end of the current document.
    #[error("{0}")]
    RangeNotSatisfiable(String),
    /// A request body (or the document it would make) over `--max-body-bytes`.
    #[error("{0}")]
    ContentTooLarge(String),
    /// A patch write the proxy cannot make safely (no `Parents`, or an
    /// origin without validators).
    #[error("{0}")]
    PreconditionRequired(String),
    /// A patch in a media type the proxy does not apply.
    #[error("{0}")]
    UnsupportedPatchType(String),
}

impl Refusal {
    /// The status this refusal is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::BadRequest(_) | Refusal::ForeignHost => StatusCode::BAD_REQUEST,
            Refusal::Connect | Refusal::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Refusal::UpstreamUnreachable(_)
            | Refusal::UpstreamBroken(_)
            | Refusal::UpstreamMalformed { .. } => StatusCode::BAD_GATEWAY,
            Refusal::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Refusal::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Loop(_) => StatusCode::LOOP_DETECTED,
            Refusal::NotFound | Refusal::UnknownMultiplexedRequest(_) => StatusCode::NOT_FOUND,
            Refusal::BadMultiplexer(_) => StatusCode::BAD_REQUEST,
            Refusal::UnknownMultiplexer { status, .. } => *status,
            Refusal::MultiplexConflict { .. } => StatusCode::CONFLICT,
            Refusal::Conflict { .. } => StatusCode::CONFLICT,
            Refusal::BadPatch(_) => StatusCode::BAD_REQUEST,
            Refusal::RangeNotSatisfiable(_) => StatusCode::RANGE_NOT_SATISFIABLE,
            Refusal::ContentTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::PreconditionRequired(_) => StatusCode::PRECONDITION_REQUIRED,
            Refusal::UnsupportedPatchType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }

    /// A response with the status and a one-line `text/plain` reason.
    pub fn into_response(self) -> Response<Body> {
        let status = self.status();
        let mut response = Response::new(body::full(format!("{self}\n")));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        match self {
            Refusal::Unavailable { retry_after, .. }
            | Refusal::UpstreamMalformed { retry_after, .. } => {
                headers.insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(retry_after.as_secs().max(1)),
                );
            }
            Refusal::Connect => {
                headers.insert(
                    header::ALLOW,
                    HeaderValue::from_static("GET, HEAD, PUT, POST, PATCH, DELETE, OPTIONS"),
                );
            }
            Refusal::MethodNotAllowed(allow) => {
                headers.insert(header::ALLOW, HeaderValue::from_static(allow));
            }
            Refusal::UnknownMultiplexer { id, .. } => {
                if let Ok(v) = HeaderValue::from_str(&id) {
                    headers.insert("bad-multiplexer", v);
                }
            }
            Refusal::UnknownMultiplexedRequest(id) => {
                if let Ok(v) = HeaderValue::from_str(&id) {
                    headers.insert("bad-request", v);
                }
            }
            Refusal::MultiplexConflict { .. } => {
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
            }
            Refusal::Conflict { current, .. } if !current.is_empty() => {
                if let Ok(v) = HeaderValue::from_str(&current) {
                    headers.insert("current-version", v);
                }
            }
            _ => {}
        }
        response
    }
}

/// Describes a hyper client error in a few words, walking its sources.
pub fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![err.to_string()];
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}
