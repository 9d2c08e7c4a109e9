//! What the origin last said about a resource ([`State`]): nothing yet, a
//! representation, its absence, an error, or a refusal of its
//! subscribers' credentials.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// What the origin last said about a resource.
#[derive(Debug, Clone)]
pub enum State {
    /// Nothing fetched yet.
    Unknown,
    /// A representation: status 200.
    Present {
        body: Bytes,
        content_type: Option<String>,
        etag: Option<String>,
        /// The origin's `Content-Language`, carried by snapshots.
        language: Option<String>,
    },
    /// 404 or 410: the resource is gone (for now).
    Missing { status: u16 },
    /// The origin's answer could not be used (e.g. over the body limit).
    Error { status: u16, reason: String },
    /// 401 or 403: the origin refused the credentials (or their absence)
    /// the resource's requests carry. Its answer as the subscribers it
    /// concerns get it: status, the headers in [`DENIAL_HEADERS`], body.
    /// Final: their streams end after it, and nobody polls it again.
    Denied {
        status: u16,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Bytes,
    },
}

/// The headers of a 401 or 403 a [`State::Denied`] keeps: what describes
/// its body and what tells the client how to authenticate. Not
/// `Retry-After`: braid-http retries an answer that carries one.
pub const DENIAL_HEADERS: [HeaderName; 3] = [
    http::header::CONTENT_TYPE,
    http::header::CONTENT_LANGUAGE,
    http::header::WWW_AUTHENTICATE,
];

impl State {
    /// The origin's 401 or 403 answer (see [`State::Denied`]).
    pub fn denied(status: StatusCode, headers: &HeaderMap, body: Bytes) -> State {
        let kept = DENIAL_HEADERS
            .iter()
            .flat_map(|name| {
                // Copied: a parsed value is a slice of its connection's
                // read buffer, which it would keep alive.
                headers.get_all(name).iter().filter_map(|v| {
                    Some((name.clone(), HeaderValue::from_bytes(v.as_bytes()).ok()?))
                })
            })
            .collect();
        State::Denied {
            status: status.as_u16(),
            headers: kept,
            body,
        }
    }

    /// Whether no update can follow this state for its subscribers: the
    /// origin refused their credentials.
    pub fn is_final(&self) -> bool {
        matches!(self, State::Denied { .. })
    }
}
