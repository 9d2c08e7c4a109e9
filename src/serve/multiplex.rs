//! braid-http's multiplexing (Multiplex-Version 1.0), terminated by the
//! proxy: one long-lived response (the multiplexer) carries the responses of
//! many requests, so a browser's six connections per host stop limiting
//! how many subscriptions a page can hold. See spec/multiplex.md.
//!
//! - `POST /.well-known/multiplexer/<m>` (or `MULTIPLEX /<m>`) opens
//!   multiplexer `m`: a 200 whose body is a sequence of frames.
//! - A request carrying `Multiplex-Through: /.well-known/multiplexer/<m>/<r>`
//!   is answered `293` at once; its real response (status line, headers and
//!   body, as HTTP/1.1 would write them without chunking) travels inside `m`
//!   as `start response r`, `N bytes for response r` + N bytes, and
//!   `close response r`.
//! - `DELETE /.well-known/multiplexer/<m>/<r>` ends request `r`;
//!   `DELETE /.well-known/multiplexer/<m>` ends the whole multiplexer
//!   (`MULTIPLEX /<m>/<r>` ends a request too, as braid-http's server has it).
//!
//! Flow control: the multiplexer holds no queue. Its body polls the inner
//! bodies round-robin, one frame at a time, and only when hyper asks for
//! the next frame, which it does only while the connection's write buffer
//! has room. An inner subscription body is a cursor into the resource's
//! shared window, so one polled late collapses what it missed into one
//! update, exactly as it does on a connection of its own.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body as _, Frame};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use crate::error::Refusal;
use crate::floor::body::{self, Body, BoxError, Chunk};

/// The protocol version this module speaks.
pub const VERSION: &str = "1.0";

const WELL_KNOWN: &str = "/.well-known/multiplexer/";

/// Bounds and timers of the multiplexers of one proxy.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Open multiplexers on this proxy.
    pub max_multiplexers: usize,
    /// Requests open at once inside one multiplexer.
    pub max_requests: usize,
    /// Longest multiplexer or request id accepted.
    pub max_id_len: usize,
    /// How long a request for a multiplexer that does not exist yet is held
    /// before it is answered 424 (the client sends them optimistically).
    pub wait_for_creation: Duration,
    /// A multiplexer with no request for this long ends.
    pub idle: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_multiplexers: 1024,
            max_requests: 256,
            max_id_len: 64,
            wait_for_creation: Duration::from_millis(500),
            idle: Duration::from_secs(60),
        }
    }
}

/// What a request asks of the multiplexing layer, decided from its method,
/// path and headers alone.
#[derive(Debug, PartialEq, Eq)]
pub enum Intent {
    /// Open multiplexer `0`.
    Create(String),
    /// End request `request` of multiplexer `mux`, or the whole multiplexer.
    Delete {
        mux: String,
        request: Option<String>,
    },
    /// Answer this request through multiplexer `mux` as request `request`.
    Through { mux: String, request: String },
}

/// Classifies a request; `None` for an ordinary request. A malformed
/// multiplexer request is a 400 naming what is wrong.
pub fn classify<B>(req: &Request<B>, limits: &Limits) -> Result<Option<Intent>, Refusal> {
    static MULTIPLEX_VERSION: HeaderName = HeaderName::from_static("multiplex-version");
    static MULTIPLEX_THROUGH: HeaderName = HeaderName::from_static("multiplex-through");
    let path = req.uri().path();
    let version_ok = req
        .headers()
        .get(&MULTIPLEX_VERSION)
        .is_some_and(|v| v.as_bytes() == VERSION.as_bytes());
    let on_well_known = path.starts_with(WELL_KNOWN);
    if req.method().as_str() == "MULTIPLEX" || on_well_known {
        if !version_ok {
            return Err(Refusal::BadMultiplexer(format!(
                "multiplexer requests need Multiplex-Version: {VERSION}"
            )));
        }
        let rest = if on_well_known {
            &path[WELL_KNOWN.len()..]
        } else {
            path.trim_start_matches('/')
        };
        let mut parts = rest.split('/').filter(|p| !p.is_empty());
        let mux = checked_id(parts.next(), "multiplexer", limits)?;
        let request = parts
            .next()
            .map(|r| checked_id(Some(r), "request", limits))
            .transpose()?;
        // As braid-http's server does, any method naming a request ends it;
        // DELETE naming only the multiplexer ends the multiplexer.
        return Ok(Some(match (req.method(), request) {
            (_, Some(request)) => Intent::Delete {
                mux,
                request: Some(request),
            },
            (&Method::DELETE, None) => Intent::Delete { mux, request: None },
            (_, None) => Intent::Create(mux),
        }));
    }
    // braid-http ignores Multiplex-Through without the version it speaks.
    if !version_ok {
        return Ok(None);
    }
    let Some(through) = req.headers().get(&MULTIPLEX_THROUGH) else {
        return Ok(None);
    };
    let text = through
        .to_str()
        .map_err(|_| Refusal::BadMultiplexer("Multiplex-Through is not ASCII".into()))?;
    // Relative (`/.well-known/...`) or absolute (`http://host/.well-known/...`).
    let at = text.find(WELL_KNOWN).ok_or_else(|| {
        Refusal::BadMultiplexer(format!(
            "Multiplex-Through must name {WELL_KNOWN}<multiplexer>/<request>"
        ))
    })?;
    let mut parts = text[at + WELL_KNOWN.len()..].split('/');
    let mux = checked_id(parts.next(), "multiplexer", limits)?;
    let request = checked_id(parts.next(), "request", limits)?;
    Ok(Some(Intent::Through { mux, request }))
}

/// Whether a request takes part in multiplexing at all (a multiplexer URL
/// or method, or `Multiplex-Through`), judged without validating it: with
/// `--multiplex relay` such requests go to the upstream as they are.
pub fn is_multiplexing<B>(req: &Request<B>) -> bool {
    req.method().as_str() == "MULTIPLEX"
        || req.uri().path().starts_with(WELL_KNOWN)
        || req.headers().contains_key("multiplex-through")
}

/// An id as braid-http makes them: base64url characters, bounded length.
fn checked_id(id: Option<&str>, what: &str, limits: &Limits) -> Result<String, Refusal> {
    let id = id.unwrap_or_default();
    if id.is_empty() || id.len() > limits.max_id_len {
        return Err(Refusal::BadMultiplexer(format!(
            "{what} id must be 1 to {} characters",
            limits.max_id_len
        )));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Refusal::BadMultiplexer(format!(
            "{what} id may hold only A-Z a-z 0-9 - _"
        )));
    }
    Ok(id.to_string())
}

/// Whether the response to a multiplexed request goes into the multiplexer
/// (answered `293` here), or straight back to the request as it is.
///
/// braid-http's server multiplexes whatever its handler answers, but a
/// failure before its multiplexing code runs (a 500 from middleware) comes
/// back as a plain response, which its client returns as is, and a `293`
/// carrying a wrong `Multiplex-Version` is a protocol error it reports. The
/// proxy keeps both visible: a 5xx (from the upstream, or the proxy's own
/// 502/503/504) and an upstream's own `293` are answered directly, as the
/// upstream gave them, instead of being wrapped inside the stream.
pub fn belongs_inside(status: StatusCode) -> bool {
    !(status.is_server_error() || status.as_u16() == 293)
}

/// Removes the multiplexing headers from a request about to be served
/// inside a multiplexer.
pub fn strip<B>(req: &mut Request<B>) {
    let h = req.headers_mut();
    h.remove("multiplex-through");
    h.remove("multiplex-version");
}

/// The open multiplexers of one proxy: a cheap clonable handle.
#[derive(Clone)]
pub struct Multiplexers {
    inner: Arc<Open>,
}

struct Open {
    limits: Limits,
    open: Mutex<HashMap<String, Arc<Shared>>>,
    /// Woken whenever a multiplexer is created, for requests that came first.
    created: Notify,
}

/// One multiplexer, shared by its body (polled by the connection's task)
/// and the requests that add to it or end it (other tasks).
struct Shared {
    id: String,
    state: Mutex<MuxState>,
}

#[derive(Default)]
struct MuxState {
    /// Requests in the order they arrived; the body serves them round-robin.
    requests: Vec<Muxed>,
    /// Request ids reserved by requests still being routed.
    reserved: Vec<String>,
    /// Set when the multiplexer must end (DELETE, shutdown).
    ended: bool,
    waker: Option<Waker>,
    /// When the multiplexer last had no request at all.
    idle_since: Option<Instant>,
}

impl MuxState {
    fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    fn holds(&self, request: &str) -> bool {
        self.reserved.iter().any(|r| r == request) || self.requests.iter().any(|r| r.id == request)
    }
}

/// One request inside a multiplexer: what is left to send of it.
struct Muxed {
    id: String,
    /// The `start response` line and the response head, not yet sent.
    preamble: Option<Bytes>,
    body: Body,
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, MuxState> {
    shared.state.lock().unwrap_or_else(|p| p.into_inner())
}

impl Multiplexers {
    pub fn new(limits: Limits) -> Multiplexers {
        Multiplexers {
            inner: Arc::new(Open {
                limits,
                open: Mutex::default(),
                created: Notify::new(),
            }),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    fn open(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Shared>>> {
        self.inner.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, id: &str) -> Option<Arc<Shared>> {
        self.open().get(id).cloned()
    }

    /// Number of open multiplexers.
    pub fn len(&self) -> usize {
        self.open().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Opens multiplexer `id`: the 200 whose body carries its requests.
    pub fn create(&self, id: String) -> Result<Response<Body>, Refusal> {
        let shared = {
            let mut open = self.open();
            if open.contains_key(&id) {
                return Err(Refusal::MultiplexConflict {
                    error: "Multiplexer already exists",
                    details: format!("Cannot create duplicate multiplexer with ID '{id}'"),
                });
            }
            if open.len() >= self.inner.limits.max_multiplexers {
                return Err(Refusal::Unavailable {
                    reason: "too many multiplexers on this proxy; retry later".into(),
                    retry_after: Duration::from_secs(5),
                });
            }
            let shared = Arc::new(Shared {
                id: id.clone(),
                state: Mutex::new(MuxState {
                    idle_since: Some(Instant::now()),
                    ..MuxState::default()
                }),
            });
            open.insert(id, shared.clone());
            shared
        };
        self.inner.created.notify_waiters();
        let body = MuxBody {
            shared,
            registry: self.clone(),
            next: 0,
            held: Some(Chunk::plain(Bytes::from_static(b"\r\n"))),
            idle: Box::pin(tokio::time::sleep(self.inner.limits.idle)),
        };
        let mut response = Response::new(http_body_util::BodyExt::boxed_unsync(body));
        let h = response.headers_mut();
        h.insert("multiplex-version", HeaderValue::from_static(VERSION));
        h.insert("incremental", HeaderValue::from_static("?1"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        h.insert("x-accel-buffering", HeaderValue::from_static("no"));
        Ok(response)
    }

    /// Ends request `request` of multiplexer `mux`, or the whole multiplexer.
    pub fn delete(&self, mux: &str, request: Option<&str>) -> Result<Response<Body>, Refusal> {
        let Some(shared) = self.get(mux) else {
            return Err(Refusal::UnknownMultiplexer {
                id: mux.to_string(),
                status: StatusCode::NOT_FOUND,
            });
        };
        let removed = {
            let mut state = lock(&shared);
            match request {
                None => {
                    state.ended = true;
                    state.wake();
                    Vec::new()
                }
                Some(request) => {
                    let Some(at) = state.requests.iter().position(|r| r.id == request) else {
                        return Err(Refusal::UnknownMultiplexedRequest(request.to_string()));
                    };
                    let inner = state.requests.remove(at);
                    if state.requests.is_empty() && state.reserved.is_empty() {
                        state.idle_since = Some(Instant::now());
                    }
                    state.wake();
                    vec![inner]
                }
            }
        };
        if request.is_none() {
            self.open().remove(mux);
        }
        // The inner bodies (subscription cursors) are dropped outside the lock.
        drop(removed);
        let mut response = Response::new(body::empty());
        response
            .headers_mut()
            .insert("multiplex-version", HeaderValue::from_static(VERSION));
        Ok(response)
    }

    /// Reserves request id `request` in multiplexer `mux`, waiting up to
    /// `wait_for_creation` for a multiplexer that does not exist yet.
    pub async fn reserve(&self, mux: &str, request: &str) -> Result<Reservation, Refusal> {
        let deadline = Instant::now() + self.inner.limits.wait_for_creation;
        let shared = loop {
            let created = self.inner.created.notified();
            tokio::pin!(created);
            created.as_mut().enable();
            if let Some(shared) = self.get(mux) {
                break shared;
            }
            if tokio::time::timeout_at(deadline, created).await.is_err() {
                return Err(Refusal::UnknownMultiplexer {
                    id: mux.to_string(),
                    status: StatusCode::FAILED_DEPENDENCY,
                });
            }
        };
        {
            let mut state = lock(&shared);
            if state.ended {
                return Err(Refusal::UnknownMultiplexer {
                    id: mux.to_string(),
                    status: StatusCode::FAILED_DEPENDENCY,
                });
            }
            if state.holds(request) {
                return Err(Refusal::MultiplexConflict {
                    error: "Request already multiplexed",
                    details: format!(
                        "Cannot multiplex request with duplicate ID '{request}' for multiplexer '{mux}'"
                    ),
                });
            }
            if state.requests.len() + state.reserved.len() >= self.inner.limits.max_requests {
                return Err(Refusal::Unavailable {
                    reason: format!(
                        "too many requests in multiplexer {mux} (at most {}); retry later",
                        self.inner.limits.max_requests
                    ),
                    retry_after: Duration::from_secs(1),
                });
            }
            state.reserved.push(request.to_string());
            state.idle_since = None;
        }
        Ok(Reservation {
            shared,
            request: request.to_string(),
            through: format!("{WELL_KNOWN}{mux}/{request}"),
            done: false,
        })
    }

    /// Ends every multiplexer (the proxy is shutting down).
    pub fn close_all(&self) {
        let all: Vec<_> = self.open().drain().map(|(_, s)| s).collect();
        for shared in all {
            let mut state = lock(&shared);
            state.ended = true;
            state.wake();
        }
    }
}

/// A request id held in a multiplexer while its request is routed; released
/// if dropped without [`Reservation::attach`].
pub struct Reservation {
    shared: Arc<Shared>,
    request: String,
    through: String,
    done: bool,
}

impl Reservation {
    /// Puts `response` into the multiplexer and returns the 293 that tells
    /// the client where its response went.
    pub fn attach(mut self, response: Response<Body>) -> Response<Body> {
        let (parts, inner_body) = response.into_parts();
        let mut preamble = BytesMut::new();
        preamble.put_slice(format!("start response {}\r\n", self.request).as_bytes());
        let head = encode_head(parts.status, parts.extensions.get(), &parts.headers);
        frame_header(&mut preamble, head.len(), &self.request);
        preamble.put_slice(&head);
        {
            let mut state = lock(&self.shared);
            state.reserved.retain(|r| *r != self.request);
            if !state.ended {
                state.requests.push(Muxed {
                    id: self.request.clone(),
                    preamble: Some(preamble.freeze()),
                    body: inner_body,
                });
                state.wake();
            }
        }
        self.done = true;
        let mut answer = Response::new(body::full("Ok."));
        *answer.status_mut() = StatusCode::from_u16(293).unwrap_or(StatusCode::OK);
        answer
            .extensions_mut()
            .insert(hyper::ext::ReasonPhrase::from_static(
                b"Responded via multiplexer",
            ));
        let h = answer.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.through) {
            h.insert("multiplex-through", v);
        }
        h.insert("multiplex-version", HeaderValue::from_static(VERSION));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        answer
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            let mut state = lock(&self.shared);
            state.reserved.retain(|r| *r != self.request);
            if state.requests.is_empty() && state.reserved.is_empty() {
                state.idle_since = Some(Instant::now());
            }
        }
    }
}

/// The response head of an inner response, as HTTP/1.1 writes it. The body
/// is sent as is (no chunking): the frames delimit it.
fn encode_head(
    status: StatusCode,
    reason: Option<&hyper::ext::ReasonPhrase>,
    headers: &HeaderMap,
) -> Bytes {
    let mut out = BytesMut::with_capacity(256);
    let reason = reason
        .map(|r| String::from_utf8_lossy(r.as_bytes()).into_owned())
        .or_else(|| status.canonical_reason().map(str::to_string))
        .unwrap_or_else(|| "unknown".into());
    out.put_slice(format!("HTTP/1.1 {} {reason}\r\n", status.as_u16()).as_bytes());
    for (name, value) in headers {
        if name == header::TRANSFER_ENCODING || name == header::CONNECTION {
            continue;
        }
        out.put_slice(name.as_str().as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    }
    out.put_slice(b"\r\n");
    out.freeze()
}

fn frame_header(out: &mut BytesMut, len: usize, request: &str) {
    out.put_slice(format!("{len} bytes for response {request}\r\n").as_bytes());
}

/// The body of a multiplexer response.
struct MuxBody {
    shared: Arc<Shared>,
    registry: Multiplexers,
    /// Index of the request to try first on the next poll (round-robin).
    next: usize,
    /// Data whose frame header has been sent: goes out before anything else.
    held: Option<Chunk>,
    idle: Pin<Box<Sleep>>,
}

impl http_body::Body for MuxBody {
    type Data = Chunk;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Chunk>, BoxError>>> {
        let this = &mut *self;
        if let Some(held) = this.held.take() {
            return Poll::Ready(Some(Ok(Frame::data(held))));
        }
        let mut finished = Vec::new();
        let out = {
            let mut state = lock(&this.shared);
            if state.ended {
                return Poll::Ready(None);
            }
            state.waker = Some(cx.waker().clone());
            let out = next_frame(&mut state, &mut this.next, cx, &mut finished);
            if out.is_none() && state.requests.is_empty() && state.reserved.is_empty() {
                let since = *state.idle_since.get_or_insert_with(Instant::now);
                let deadline = since + this.registry.inner.limits.idle;
                if this.idle.deadline() != deadline {
                    this.idle.as_mut().reset(deadline);
                }
                if this.idle.as_mut().poll(cx).is_ready() {
                    state.ended = true;
                    return Poll::Ready(None);
                }
            }
            out
        };
        drop(finished);
        match out {
            Some((header, data)) => {
                this.held = data;
                Poll::Ready(Some(Ok(Frame::data(Chunk::plain(header)))))
            }
            None => Poll::Pending,
        }
    }
}

/// Polls the requests once each, from `next` round-robin, and returns the
/// first frame any of them has (a framing header, and the data to follow
/// it). Finished requests are moved to `finished` (dropped by the caller
/// outside the lock) and leave a `close response` frame.
fn next_frame(
    state: &mut MuxState,
    next: &mut usize,
    cx: &mut Context<'_>,
    finished: &mut Vec<Muxed>,
) -> Option<(Bytes, Option<Chunk>)> {
    let n = state.requests.len();
    // A request that yielded something other than data (trailers, an empty
    // chunk) may have more at once; poll again soon rather than wait for a
    // wake-up it will not send.
    let mut again = false;
    for step in 0..n {
        let at = (*next + step) % n;
        let inner = &mut state.requests[at];
        if let Some(preamble) = inner.preamble.take() {
            *next = at + 1;
            return Some((preamble, None));
        }
        match Pin::new(&mut inner.body).poll_frame(cx) {
            Poll::Pending => continue,
            Poll::Ready(Some(Ok(frame))) => {
                // Trailers have no place in the framing; empty chunks need none.
                let data = match frame.into_data() {
                    Ok(data) if bytes::Buf::remaining(&data) > 0 => data,
                    _ => {
                        again = true;
                        continue;
                    }
                };
                let mut header = BytesMut::new();
                frame_header(&mut header, bytes::Buf::remaining(&data), &inner.id);
                *next = at + 1;
                return Some((header.freeze(), Some(data)));
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => {
                let inner = state.requests.remove(at);
                let close = Bytes::from(format!("close response {}\r\n", inner.id));
                finished.push(inner);
                if state.requests.is_empty() && state.reserved.is_empty() {
                    state.idle_since = Some(Instant::now());
                }
                *next = at;
                return Some((close, None));
            }
        }
    }
    if again {
        cx.waker().wake_by_ref();
    }
    None
}

impl Drop for MuxBody {
    fn drop(&mut self) {
        // The client went away (or the multiplexer ended): forget it, and
        // end its requests' bodies, which releases their subscriptions.
        let mut open = self.registry.open();
        if open
            .get(&self.shared.id)
            .is_some_and(|s| Arc::ptr_eq(s, &self.shared))
        {
            open.remove(&self.shared.id);
        }
        drop(open);
        let requests = {
            let mut state = lock(&self.shared);
            state.ended = true;
            std::mem::take(&mut state.requests)
        };
        drop(requests);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Buf;
    use http_body_util::BodyExt;

    #[test]
    fn the_default_limits_are_the_configs_defaults() {
        let (d, mux) = (crate::config::Config::default(), Limits::default());
        assert_eq!(
            (
                d.max_multiplexers,
                d.max_multiplexed_requests,
                d.multiplexer_idle
            ),
            (mux.max_multiplexers, mux.max_requests, mux.idle)
        );
    }

    fn req(method: &str, path: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request")
    }

    fn intent(method: &str, path: &str, headers: &[(&str, &str)]) -> Option<Intent> {
        classify(&req(method, path, headers), &Limits::default())
            .ok()
            .flatten()
    }

    fn delete(mux: &str, request: Option<&str>) -> Option<Intent> {
        Some(Intent::Delete {
            mux: mux.into(),
            request: request.map(Into::into),
        })
    }

    #[test]
    fn classifies_every_form() {
        let v = ("multiplex-version", "1.0");
        let create = Some(Intent::Create("abc".into()));
        assert_eq!(intent("POST", "/.well-known/multiplexer/abc", &[v]), create);
        assert_eq!(intent("MULTIPLEX", "/abc", &[v]), create);
        let del = intent("DELETE", "/.well-known/multiplexer/abc/r", &[v]);
        assert_eq!(del, delete("abc", Some("r")));
        assert_eq!(intent("MULTIPLEX", "/m/r", &[v]), delete("m", Some("r")));
        assert_eq!(
            intent("DELETE", "/.well-known/multiplexer/m", &[v]),
            delete("m", None)
        );
        let through = Some(Intent::Through {
            mux: "m".into(),
            request: "r".into(),
        });
        for value in [
            "/.well-known/multiplexer/m/r",
            "https://host:1/.well-known/multiplexer/m/r",
        ] {
            assert_eq!(
                intent("GET", "/doc", &[v, ("multiplex-through", value)]),
                through
            );
        }
        // Without the version, Multiplex-Through is ignored (as braid-http does).
        let old = [("multiplex-through", "/.well-known/multiplexer/m/r")];
        assert_eq!(intent("GET", "/doc", &old), None);
        let l = Limits::default();
        assert!(classify(&req("POST", "/.well-known/multiplexer/abc", &[]), &l).is_err());
        assert!(classify(&req("POST", "/.well-known/multiplexer/a.b", &[v]), &l).is_err());
    }

    #[tokio::test]
    async fn bounds_give_503s() {
        let muxes = Multiplexers::new(Limits {
            max_multiplexers: 1,
            max_requests: 1,
            ..Limits::default()
        });
        let _first = muxes.create("one".into()).expect("created");
        let refused = muxes
            .create("two".into())
            .map(|_| ())
            .expect_err("over the bound");
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        let _held = muxes.reserve("one", "r1").await.expect("reserved");
        let full = muxes
            .reserve("one", "r2")
            .await
            .map(|_| ())
            .expect_err("full");
        assert_eq!(full.status(), StatusCode::SERVICE_UNAVAILABLE);
        let dup = muxes
            .reserve("one", "r1")
            .await
            .map(|_| ())
            .expect_err("taken");
        assert_eq!(dup.status(), StatusCode::CONFLICT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_multiplexer_without_requests_ends_after_the_idle_time() {
        let muxes = Multiplexers::new(Limits {
            idle: Duration::from_secs(2),
            ..Limits::default()
        });
        let response = muxes.create("idle".into()).expect("created");
        assert_eq!(muxes.len(), 1);
        let mut body = response.into_body();
        let first = body.frame().await.expect("frame").expect("ok");
        assert_eq!(first.into_data().ok().map(|c| c.remaining()), Some(2));
        let started = Instant::now();
        assert!(body.frame().await.is_none(), "ends");
        assert!(started.elapsed() >= Duration::from_secs(2));
        drop(body);
        assert!(muxes.is_empty(), "forgotten once its body is gone");
    }
}
