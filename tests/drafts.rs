//! What the November 2026 Braid drafts changed on the wire (issue 48):
//! `Subscribe: stream` is a subscription at every tier, answered in the
//! client's own dialect, while the upstream is asked with the value every
//! Braid server so far understands (spec/braid-wire.md §1, §2, §10.1).
//! Real sockets on 127.0.0.1:0.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::broadcast;

use common::origin::Origin;
use common::wire::read_until;

/// A Braid server that speaks only the values of `Subscribe` older than
/// the drafts' `stream`, as braid-proxy did before it (and an application
/// on braid-http 1.3.80 that tests `req.subscribe` for `true`): `true` or
/// `?1` opens a stream (a 209 that
/// echoes the value, the snapshot `v1`, then whatever [`Legacy::push`]
/// sends); any other value is refused with a 400, as that braid-proxy did.
struct Legacy {
    addr: SocketAddr,
    /// The `Subscribe` value of every request, `-` for none.
    asked: Arc<Mutex<Vec<String>>>,
    feed: broadcast::Sender<Bytes>,
}

type Body = BoxBody<Bytes, std::convert::Infallible>;

impl Legacy {
    async fn start() -> Legacy {
        let asked: Arc<Mutex<Vec<String>>> = Arc::default();
        let (feed, _) = broadcast::channel::<Bytes>(16);
        let (log, tx) = (asked.clone(), feed.clone());
        let addr = common::serve_async(move |req: Request<Incoming>| {
            let value = common::header_text(req.headers(), "subscribe");
            log.lock()
                .expect("lock")
                .push(value.clone().unwrap_or_else(|| "-".into()));
            let rx = tx.subscribe();
            async move {
                let Some(value) = value else {
                    return answer(
                        200,
                        &[("version", "\"v1\"")],
                        Full::new("v1".into()).boxed(),
                    );
                };
                if value != "true" && value != "?1" {
                    let reason = "malformed Subscribe header: expected true, false, ?1 or ?0\n";
                    return answer(400, &[], Full::new(reason.into()).boxed());
                }
                let first = futures_util::stream::iter([Ok(Frame::data(Bytes::from_static(
                    b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nv1\r\n\r\n",
                )))]);
                let rest = futures_util::stream::unfold(rx, |mut rx| async move {
                    let bytes = rx.recv().await.ok()?;
                    Some((Ok(Frame::data(bytes)), rx))
                });
                let body = StreamBody::new(futures_util::StreamExt::chain(first, rest));
                let headers = [
                    ("subscribe", value.as_str()),
                    ("cache-control", "no-cache, no-transform, no-store"),
                    ("vary", "Version, Parents, Subscribe"),
                ];
                answer(209, &headers, BodyExt::boxed(body))
            }
        })
        .await;
        Legacy { addr, asked, feed }
    }

    /// Sends one snapshot update, version `v<n>`, on every open stream.
    fn push(&self, n: u32) {
        let body = format!("v{n}");
        let update = format!(
            "Version: \"v{n}\"\r\nContent-Length: {}\r\n\r\n{body}\r\n\r\n",
            body.len()
        );
        let _ = self.feed.send(Bytes::from(update));
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().expect("lock").clone()
    }
}

fn answer(status: u16, headers: &[(&str, &str)], body: Body) -> Response<Body> {
    let mut response = Response::builder().status(status);
    for (name, value) in headers {
        response = response.header(*name, *value);
    }
    response.body(body).expect("response")
}

/// Opens a subscription at `addr` with `Subscribe: <value>` on a raw
/// socket and reads until its answer's head and the update carrying
/// `want` are in; returns the socket and what was read.
async fn subscribe(addr: SocketAddr, path: &str, value: &str, want: &str) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nSubscribe: {value}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    read_until(&mut stream, &mut seen, |t| {
        t.contains("\r\n\r\n") && t[t.find("\r\n\r\n").unwrap_or(0)..].contains(want)
    })
    .await;
    (stream, String::from_utf8_lossy(&seen).into_owned())
}

/// The answer's head, header names in lower case.
fn head_of(seen: &str) -> String {
    let end = seen.find("\r\n\r\n").expect("a head");
    seen[..end].to_ascii_lowercase()
}

/// A 209 whose `Subscribe` is `value` and no other.
fn assert_subscription(seen: &str, value: &str) {
    let head = head_of(seen);
    assert!(head.starts_with("http/1.1 209 "), "not a 209: {head}");
    let said: Vec<&str> = head
        .lines()
        .filter_map(|l| l.strip_prefix("subscribe:").map(str::trim))
        .collect();
    assert_eq!(said, [value], "the 209's Subscribe: {head}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_stream_at_a_plain_origins_proxy_streams_updates() {
    let origin = Origin::default();
    origin.set("/clock", "tick 1");
    let (proxy, admin) = common::proxy_for(origin.start().await, |_| {}).await;
    let (mut stream, seen) = subscribe(proxy, "/clock", "stream", "tick 1").await;
    assert_subscription(&seen, "stream");
    assert!(seen.contains("Version: \"e1\""), "the snapshot: {seen}");
    // A change reaches the stream.
    origin.set("/clock", "tick 2");
    let refreshed = common::request(admin, "POST", "/refresh?path=/clock", &[]).await;
    assert!(refreshed.status().is_success());
    let mut more = seen.into_bytes();
    read_until(&mut stream, &mut more, |t| t.contains("Version: \"e2\"")).await;
    // Alongside it, a `Subscribe: true` client gets its own value back.
    let (_other, seen) = subscribe(proxy, "/clock", "true", "Version: \"e2\"").await;
    assert_subscription(&seen, "true");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_subscribe_value_is_refused_naming_stream() {
    let origin = Origin::default();
    origin.set("/doc", "x");
    let (proxy, _) = common::proxy_for(origin.start().await, |_| {}).await;
    let response = common::get(proxy, "/doc", &[("subscribe", "sometimes")]).await;
    assert_eq!(response.status().as_u16(), 400);
    let body = common::body_of(response).await;
    assert_eq!(
        String::from_utf8_lossy(&body).trim(),
        "malformed Subscribe header: expected stream, true, false, ?1 or ?0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_legacy_braid_upstream_is_asked_with_a_value_it_understands() {
    let origin = Legacy::start().await;
    let (proxy, _) = common::proxy_for(origin.addr, |_| {}).await;
    let (_stream, seen) = subscribe(proxy, "/doc", "stream", "Version: \"v1\"").await;
    assert_subscription(&seen, "stream");
    // Other values still go up as the client sent them.
    let (_other, seen) = subscribe(proxy, "/other", "?1", "Version: \"v1\"").await;
    assert_subscription(&seen, "?1");
    assert_eq!(origin.asked(), ["true", "?1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_stream_through_two_tiers_of_a_legacy_braid_origin() {
    let origin = Legacy::start().await;
    let (first, _) = common::proxy_for(origin.addr, |_| {}).await;
    let (edge, _) = common::proxy_for(first, |_| {}).await;
    let (mut stream, seen) = subscribe(edge, "/doc", "stream", "Version: \"v1\"").await;
    assert_subscription(&seen, "stream");
    assert!(seen.contains("\r\nv1\r\n"), "the snapshot: {seen}");
    origin.push(2);
    let mut more = seen.into_bytes();
    read_until(&mut stream, &mut more, |t| t.contains("Version: \"v2\"")).await;
    // A `Subscribe: true` client at the edge joins the same subscription
    // and hears its own value.
    let (_other, seen) = subscribe(edge, "/doc", "true", "Version: \"v2\"").await;
    assert_subscription(&seen, "true");
    origin.push(3);
    read_until(&mut stream, &mut more, |t| t.contains("Version: \"v3\"")).await;
    assert_eq!(
        origin.asked(),
        ["true"],
        "one upstream subscription, asked as the origin understands"
    );
}
