//! A plain origin for the integration tests: path → (body, etag), strong
//! ETags `"e<n>"`, 304 on a matching `If-None-Match`, 404 otherwise; a
//! path may carry a `Surrogate-Key`; counts the requests it answers, in
//! all and per path.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;

#[derive(Clone, Default)]
pub struct Origin {
    docs: Arc<Mutex<HashMap<String, (Bytes, u64)>>>,
    /// `Surrogate-Key` by path, on its 200s.
    tags: Arc<Mutex<HashMap<String, &'static str>>>,
    /// Requests answered so far.
    pub gets: Arc<AtomicUsize>,
    /// Requests answered so far, by path.
    asked: Arc<Mutex<HashMap<String, usize>>>,
    /// `Cache-Control` on every 200, if any.
    pub cache_control: Option<&'static str>,
}

impl Origin {
    /// An origin whose 200s carry `Cache-Control: <cache_control>`.
    pub fn with_cache_control(cache_control: &'static str) -> Origin {
        Origin {
            cache_control: Some(cache_control),
            ..Origin::default()
        }
    }

    /// Stores `body` at `path` under the next ETag; returns its value
    /// (`e<n>`, without quotes).
    pub fn set(&self, path: &str, body: impl Into<Bytes>) -> String {
        let mut docs = self.docs.lock().expect("lock");
        let n = docs.get(path).map_or(1, |(_, n)| n + 1);
        docs.insert(path.to_string(), (body.into(), n));
        format!("e{n}")
    }

    /// The number of `path`'s current version (its ETag's), 0 if none.
    pub fn version(&self, path: &str) -> u64 {
        let docs = self.docs.lock().expect("lock");
        docs.get(path).map_or(0, |(_, n)| *n)
    }

    /// The body stored at `path` now, if any.
    pub fn body(&self, path: &str) -> Option<Bytes> {
        let docs = self.docs.lock().expect("lock");
        docs.get(path).map(|(body, _)| body.clone())
    }

    /// As [`Origin::set`], the 200s answering `path` listing `tag` in
    /// `Surrogate-Key`.
    pub fn set_tagged(&self, path: &str, body: impl Into<Bytes>, tag: &'static str) {
        self.tags
            .lock()
            .expect("lock")
            .insert(path.to_string(), tag);
        self.set(path, body);
    }

    /// Requests for `path` answered so far.
    pub fn asked(&self, path: &str) -> usize {
        self.asked
            .lock()
            .expect("lock")
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    /// Serves on a fresh loopback port; returns the address.
    pub async fn start(&self) -> SocketAddr {
        let origin = self.clone();
        super::serve(move |req| origin.answer(req)).await
    }

    /// The answer to one request (public for servers of other kinds, tests/tls.rs).
    pub fn answer(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        *self
            .asked
            .lock()
            .expect("lock")
            .entry(req.uri().path().to_string())
            .or_default() += 1;
        let doc = self
            .docs
            .lock()
            .expect("lock")
            .get(req.uri().path())
            .cloned();
        let Some((body, n)) = doc else {
            return Response::builder()
                .status(404)
                .body(Full::new(Bytes::new()))
                .expect("response");
        };
        let etag = format!("\"e{n}\"");
        if req
            .headers()
            .get("if-none-match")
            .and_then(|v| v.to_str().ok())
            == Some(&etag)
        {
            return Response::builder()
                .status(304)
                .header("etag", etag)
                .body(Full::new(Bytes::new()))
                .expect("response");
        }
        let mut response = Response::builder()
            .header("etag", etag)
            .header("content-type", "text/plain");
        if let Some(cc) = self.cache_control {
            response = response.header("cache-control", cc);
        }
        if let Some(tag) = self.tags.lock().expect("lock").get(req.uri().path()) {
            response = response.header("surrogate-key", *tag);
        }
        response.body(Full::new(body)).expect("response")
    }
}
