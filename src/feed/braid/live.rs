//! GETs answered from a live session's model: a live, healthy
//! subscription counts as validation (spec/caching.md), and a stored answer
//! is never older than what the subscribers have.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use http::{header, Request, Response, StatusCode};

use crate::braid::VersionList;
use crate::floor::body::Body;
use crate::floor::rules::{self};
use crate::floor::sync::lock;
use crate::metrics::Metrics;
use crate::state::Key;

use super::*;
use crate::floor::phase::CachePhase;

/// A GET answered from a live model: its status and representation
/// headers, `Version`, `Current-Version`, `Repr-Digest`, an `ETag` naming
/// the version, and `Cache-Status`; 304 when `If-None-Match` names it.
pub(super) fn serve_known<B>(req: &Request<B>, known: &Known, proxy_id: &str) -> Response<Body> {
    let status = known
        .status
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    let mut response = Response::new(crate::floor::body::empty());
    let h = response.headers_mut();
    for (name, value) in &known.headers {
        h.insert(name.clone(), value.clone());
    }
    let version = http::HeaderValue::from_str(&known.version.to_header_value()).ok();
    let etag = match known.version.iter().collect::<Vec<_>>().as_slice() {
        [one] => http::HeaderValue::from_str(&format!("\"{}\"", one.as_str())).ok(),
        _ => None,
    };
    if let Some(v) = version {
        h.insert("version", v.clone());
        h.insert("current-version", v);
    }
    if let Ok(v) = http::HeaderValue::from_str(&crate::state::repr_digest(&known.body)) {
        h.insert("repr-digest", v);
    }
    if let Some(v) = CachePhase::Live.header_value(proxy_id) {
        h.insert("cache-status", v);
    }
    let tag = etag.as_ref().and_then(|v| v.to_str().ok());
    let matched = req
        .headers()
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| rules::if_none_match(v, tag));
    if let Some(etag) = etag {
        h.insert(header::ETAG, etag);
    }
    response.extensions_mut().insert(CachePhase::Live);
    if matched && status == StatusCode::OK {
        *response.status_mut() = StatusCode::NOT_MODIFIED;
        for name in [header::CONTENT_TYPE, header::CONTENT_LANGUAGE] {
            response.headers_mut().remove(name);
        }
        return response;
    }
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_LENGTH,
        http::HeaderValue::from(known.body.len()),
    );
    if req.method() != http::Method::HEAD {
        *response.body_mut() = crate::floor::body::full(known.body.clone());
    }
    response
}

impl Relays {
    /// A plain GET (or HEAD) answered from the model of a live session
    /// that carries the request's variant: the upstream's subscription
    /// counts as validation (spec/caching.md). `None` when there is none,
    /// its model is unknown, or a write through this proxy has not shown
    /// up in it yet.
    pub fn answer_live<B>(
        &self,
        req: &Request<B>,
        key: &Key,
        version: Option<&VersionList>,
        proxy_id: &str,
    ) -> Option<Response<Body>> {
        if self.urls_followed.load(Relaxed) == 0 {
            return None;
        }
        let known = {
            let sessions = lock(&self.sessions);
            // The view key is built only for a URL with sessions.
            let list = sessions.get(&key.path)?;
            let view = view_key(key, req.headers());
            list.iter().find_map(|s| s.live_view(&view))?
        };
        // A `Version:` GET is answered when it names the version held.
        if version.is_some_and(|v| *v != known.version) {
            return None;
        }
        Metrics::inc(&self.metrics.cache_hits_total);
        Some(serve_known(req, &known, proxy_id))
    }

    /// The newest version a live upstream subscription of this request's
    /// variant and representation has received, if there is one: a stored
    /// answer of another version is older than what that subscription's
    /// subscribers have, and is not served (spec/caching.md §2).
    pub fn newest_version<B>(&self, req: &Request<B>, key: &Key) -> Option<VersionList> {
        if self.urls_followed.load(Relaxed) == 0 {
            return None;
        }
        let sessions: Vec<Arc<Session>> = {
            let sessions = lock(&self.sessions);
            let list = sessions.get(&key.path)?;
            let view = view_key(key, req.headers());
            list.iter()
                .filter(|s| {
                    let opened = lock(&s.opened);
                    opened
                        .key
                        .strip_prefix(view.as_str())
                        .is_some_and(|rest| rest.starts_with('\n'))
                })
                .cloned()
                .collect()
        };
        sessions.iter().find_map(|s| {
            let tick = s.tick.borrow().clone();
            if tick.ended || tick.opened != Some(true) {
                return None;
            }
            let window = lock(&s.window);
            window.entries.iter().rev().find_map(|e| e.version.clone())
        })
    }
}

impl Session {
    /// Its model, when it is live, linear, known, settled after writes,
    /// and carries the representation `view` names.
    pub(super) fn live_view(&self, view: &str) -> Option<Known> {
        if self.exclusive.load(Relaxed) || lock(&self.opened).view.as_deref() != Some(view) {
            return None;
        }
        {
            let tick = self.tick.borrow();
            if tick.ended || tick.opened != Some(true) {
                return None;
            }
        }
        if lock(&self.written).is_some_and(|at| at.elapsed() < WRITE_SETTLE) {
            return None;
        }
        let model = lock(&self.model);
        model.known.clone().filter(|_| model.linear)
    }
}
