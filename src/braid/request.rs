//! A request's Braid headers (`Subscribe`, `Parents`, `Version`,
//! `Heartbeats`, `Merge-Type` with `Peer`), parsed once and validated: a
//! malformed one is a 400 naming it.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};

use super::{is_stream, parse_heartbeats, parse_subscribe, HeaderError, VersionList};
use crate::error::Refusal;
use crate::floor::body::Body;

/// What a subscription request asked for, parsed and validated.
#[derive(Debug, Default)]
pub struct BraidRequest {
    pub subscribe: bool,
    pub parents: Option<VersionList>,
    pub version: Option<VersionList>,
    pub heartbeats: Option<Duration>,
    /// `Peer` together with `Merge-Type: simpleton`: a per-peer stream.
    pub peer_specific: bool,
    /// Echo of the request's `Subscribe` value.
    pub subscribe_echo: Option<HeaderValue>,
    /// The request said `Subscribe: stream`, the drafts' value since
    /// November 2026; its upstream request says `true` ([`speak_upstream`]).
    pub stream: bool,
    /// Echo of the request's `Heartbeats` value.
    pub heartbeats_echo: Option<HeaderValue>,
}

impl BraidRequest {
    /// Parses the Braid request headers; a malformed one is a 400 naming it.
    pub fn parse(headers: &HeaderMap) -> Result<BraidRequest, Refusal> {
        // Names made once: a `&str` name is parsed again at every lookup.
        static SUBSCRIBE: HeaderName = HeaderName::from_static("subscribe");
        static PARENTS: HeaderName = HeaderName::from_static("parents");
        static VERSION: HeaderName = HeaderName::from_static("version");
        static HEARTBEATS: HeaderName = HeaderName::from_static("heartbeats");
        static MERGE_TYPE: HeaderName = HeaderName::from_static("merge-type");
        static PEER: HeaderName = HeaderName::from_static("peer");
        let mut out = BraidRequest::default();
        // Most requests carry none of them: one pass over the names says so.
        let braid_name = |name: &HeaderName| {
            matches!(
                name.as_str(),
                "subscribe" | "parents" | "version" | "heartbeats" | "merge-type"
            )
        };
        if !headers.keys().any(braid_name) {
            return Ok(out);
        }
        if let Some(v) = headers.get(&SUBSCRIBE) {
            out.subscribe = parse_subscribe(v.as_bytes()).map_err(bad)?;
            out.stream = is_stream(v.as_bytes());
            out.subscribe_echo = Some(v.clone());
        }
        if let Some(v) = headers.get(&PARENTS) {
            out.parents = Some(VersionList::parse(v.as_bytes()).map_err(bad)?);
        }
        if let Some(v) = headers.get(&VERSION) {
            out.version = Some(VersionList::parse_named(v.as_bytes(), "Version").map_err(bad)?);
        }
        if let Some(v) = headers.get(&HEARTBEATS) {
            out.heartbeats = Some(parse_heartbeats(v.as_bytes()).map_err(bad)?);
            out.heartbeats_echo = Some(v.clone());
        }
        let simpleton = headers
            .get(&MERGE_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("simpleton"));
        out.peer_specific = simpleton && headers.contains_key(&PEER);
        Ok(out)
    }
}

/// A `Subscribe: stream` request goes upstream saying `Subscribe: true`,
/// which every Braid server so far reads as a subscription (braid-http
/// 1.3.80's server takes only `true` for a boolean; a braid-proxy older than
/// this one refuses `stream` with a 400), and the stream it opens is the
/// same; the client's 209 says `stream` again ([`answer_in_own_dialect`]).
/// So one upstream subscription serves `true` and `stream` subscribers
/// alike (spec/braid-wire.md §10.1).
pub fn speak_upstream<B>(req: &mut Request<B>, braid: &BraidRequest) {
    if braid.stream {
        req.headers_mut()
            .insert("subscribe", HeaderValue::from_static("true"));
    }
}

/// A relayed 209 to a `Subscribe: stream` request says `Subscribe` as the
/// client did, whatever the upstream (asked with `true`) echoed.
pub fn answer_in_own_dialect(response: &mut Response<Body>, braid: &BraidRequest) {
    if let (true, Some(echo)) = (braid.stream, &braid.subscribe_echo) {
        if response.status().as_u16() == 209 {
            response.headers_mut().insert("subscribe", echo.clone());
        }
    }
}

fn bad(e: HeaderError) -> Refusal {
    Refusal::BadRequest(e.to_string())
}
