//! A Braid upstream behind the proxy (issue 19): what the upstream said is
//! relayed byte for byte and fanned out, its lifecycle is mirrored, and
//! nothing is invented. The upstream here is scripted on 127.0.0.1:0.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use braid_proxy::config::{Config, UpstreamKind};
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::sync::broadcast;

const WAIT: Duration = Duration::from_secs(10);

/// One scripted answer.
struct Script {
    status: u16,
    reason: Option<&'static str>,
    headers: Vec<(&'static str, String)>,
    /// Sent at once.
    body: Bytes,
    /// Ends the body after `body` (else it stays open, fed by `Upstream::push`).
    end: bool,
}

impl Script {
    fn stream(body: &[u8]) -> Script {
        Script {
            status: 209,
            reason: None,
            headers: Vec::new(),
            body: Bytes::copy_from_slice(body),
            end: false,
        }
    }
}

/// The scripted upstream: what it was asked, and how many of its streams
/// were closed by the proxy.
#[derive(Clone)]
struct Upstream {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<HeaderMap>>>,
    closed: Arc<AtomicUsize>,
    feed: broadcast::Sender<Bytes>,
}

/// Counts a dropped response body.
struct Closed(Arc<AtomicUsize>);

impl Drop for Closed {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

type Body = BoxBody<Bytes, std::convert::Infallible>;

impl Upstream {
    /// Answers the n-th request (from 0) with `script(n, headers)`.
    async fn start(
        script: impl Fn(usize, &HeaderMap) -> Script + Send + Sync + 'static,
    ) -> Upstream {
        let requests: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
        let closed: Arc<AtomicUsize> = Arc::default();
        let (feed, _) = broadcast::channel::<Bytes>(64);
        let (log, count, tx) = (requests.clone(), closed.clone(), feed.clone());
        let script = Arc::new(script);
        let addr = common::serve_async(move |req: Request<Incoming>| {
            let n = {
                let mut log = log.lock().expect("lock");
                log.push(req.headers().clone());
                log.len() - 1
            };
            let s = script(n, req.headers());
            let rx = tx.subscribe();
            let guard = Closed(count.clone());
            async move {
                let first = futures_util::stream::iter([Ok(Frame::data(s.body.clone()))]);
                let body: Body = if s.end {
                    Full::new(s.body).boxed()
                } else {
                    let rest =
                        futures_util::stream::unfold((rx, guard), |(mut rx, guard)| async move {
                            match rx.recv().await {
                                // Empty: the end (see `Upstream::end`).
                                Ok(bytes) if !bytes.is_empty() => {
                                    Some((Ok(Frame::data(bytes)), (rx, guard)))
                                }
                                _ => None,
                            }
                        });
                    let chained = futures_util::StreamExt::chain(first, rest);
                    BodyExt::boxed(StreamBody::new(chained))
                };
                let mut response = Response::builder().status(s.status);
                for (name, value) in &s.headers {
                    response = response.header(*name, value.as_str());
                }
                let mut response = response.body(body).expect("response");
                if let Some(reason) = s.reason {
                    response.extensions_mut().insert(
                        hyper::ext::ReasonPhrase::try_from(reason.as_bytes()).expect("reason"),
                    );
                }
                response
            }
        })
        .await;
        Upstream {
            addr,
            requests,
            closed,
            feed,
        }
    }

    fn push(&self, bytes: &[u8]) {
        let _ = self.feed.send(Bytes::copy_from_slice(bytes));
    }

    /// Ends every open stream.
    fn end(&self) {
        let _ = self.feed.send(Bytes::new());
    }

    fn requests(&self) -> Vec<HeaderMap> {
        self.requests.lock().expect("lock").clone()
    }
}

/// An upstream answering every request with a 209 whose body starts with
/// `body`, and a proxy in front of it.
async fn streaming(body: &'static [u8]) -> (Upstream, SocketAddr) {
    let upstream = Upstream::start(move |_, _| Script::stream(body)).await;
    let (addr, _) = proxy(&upstream, |_| {}).await;
    (upstream, addr)
}

async fn proxy(upstream: &Upstream, tune: impl FnOnce(&mut Config)) -> (SocketAddr, SocketAddr) {
    common::proxy_for(upstream.addr, |c| {
        c.resource_idle = Duration::from_secs(30);
        tune(c);
    })
    .await
}

use common::get;

async fn subscribe(addr: SocketAddr, path: &str, extra: &[(&str, &str)]) -> Response<Incoming> {
    let mut headers = vec![("subscribe", "true")];
    headers.extend_from_slice(extra);
    get(addr, path, &headers).await
}

/// `n` subscriptions to `/doc` sent at once; their 209 bodies.
async fn subscribe_at_once(
    addr: SocketAddr,
    n: usize,
    extra: &'static [(&'static str, &'static str)],
) -> Vec<Incoming> {
    let clients: Vec<_> = (0..n)
        .map(|_| tokio::spawn(async move { subscribe(addr, "/doc", extra).await }))
        .collect();
    let mut bodies = Vec::new();
    for c in clients {
        let response = c.await.expect("client");
        assert_eq!(response.status().as_u16(), 209);
        bodies.push(response.into_body());
    }
    bodies
}

/// Reads the body until it holds `want` bytes (or ends); what it read.
async fn read_bytes(body: &mut Incoming, want: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let _ = tokio::time::timeout(WAIT, async {
        while got.len() < want {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        got.extend_from_slice(&data);
                    }
                }
                _ => return,
            }
        }
    })
    .await;
    got
}

/// Whether the body ends (cleanly or not) within `limit`, discarding data.
async fn ends_within(body: &mut Incoming, limit: Duration) -> bool {
    tokio::time::timeout(limit, async {
        loop {
            match body.frame().await {
                Some(Ok(_)) => continue,
                _ => return,
            }
        }
    })
    .await
    .is_ok()
}

async fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !ok() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Updates in forms braid-http reads: a patch as the first update, a
/// status line per update, extra headers, Parents out of order, json and
/// binary patches, `:status`, the http-patches count, an empty Version.
const STREAM: &[u8] = b"HTTP/1.1 200 OK\r\nVersion: \"v1\"\r\nParents: \"z\", \"a\"\r\nX-Update: first\r\nContent-Length: 1\r\nContent-Range: text [0:0]\r\n\r\nA\r\n\r\n\
Version: \"v2\"\nParents: \"v1\"\nContent-Length: 6\nContent-Range: json .name\n\n\"name\"\n\n\
:status: 206\r\nVersion: \"v3\"\r\nParents: \"v2\"\r\nContent-Type: application/http-patches; count=2\r\n\r\n\
Content-Length: 2\r\nContent-Range: bytes [0:1]\r\n\r\n\x00\xff\r\n\
Content-Length: 0\r\nContent-Range: bytes [5:6]\r\n\r\n\r\n\
HTTP 404 Not Found\r\nVersion: \r\nContent-Length: 0\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_and_the_209_head_are_relayed_byte_for_byte() {
    let upstream = Upstream::start(|_, _| Script {
        reason: Some("Multiresponse"),
        headers: vec![
            ("x-origin", "kept".into()),
            ("current-version", "\"v3\"".into()),
        ],
        ..Script::stream(STREAM)
    })
    .await;
    let (addr, _) = proxy(&upstream, |_| {}).await;
    let response = subscribe(addr, "/doc", &[]).await;
    assert_eq!(response.status().as_u16(), 209);
    assert_eq!(
        response
            .extensions()
            .get::<hyper::ext::ReasonPhrase>()
            .map(|r| r.as_bytes().to_vec()),
        Some(b"Multiresponse".to_vec()),
        "the upstream's reason phrase"
    );
    assert_eq!(response.headers()["x-origin"], "kept");
    assert_eq!(response.headers()["current-version"], "\"v3\"");
    assert!(
        response.headers().get("content-type").is_none(),
        "nothing added"
    );
    let mut body = response.into_body();
    let got = read_bytes(&mut body, STREAM.len()).await;
    assert_eq!(got, STREAM, "the stream as the upstream sent it");
    // Later updates pass through as they come; what does not frame ends
    // the stream (issue 44): an update head that is not `name: value`
    // lines is its last bytes, whole, so that the client reports the
    // upstream's parse error (spec/braid-wire.md §10.3), and nothing after.
    let good = b"Version: \"v4\"\r\nParents: \"v3\"\r\nContent-Length: 2\r\n\r\nok\r\n";
    upstream.push(good);
    assert_eq!(read_bytes(&mut body, good.len()).await, good);
    upstream.push(b"this line has no colon, no length\r\n\r\nand the rest as it comes");
    let rest = tokio::time::timeout(WAIT, async {
        let mut rest = Vec::new();
        while let Some(Ok(frame)) = body.frame().await {
            rest.extend_from_slice(frame.data_ref().map_or(&[][..], |d| &d[..]));
        }
        rest
    })
    .await
    .expect("the stream ends");
    assert_eq!(
        String::from_utf8_lossy(&rest),
        "this line has no colon, no length\r\n\r\n",
        "the unreadable head, and nothing after it"
    );
    // Nobody joins a stream the proxy could not follow, and for a while
    // nobody makes it ask the upstream again: 502 with Retry-After.
    let second = subscribe(addr, "/doc", &[]).await;
    assert_eq!(second.status().as_u16(), 502);
    assert!(second.headers().contains_key("retry-after"));
    assert_eq!(upstream.requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equivalent_subscribers_share_one_upstream_subscription() {
    let (upstream, addr) = streaming(b"Version: \"v1\"\r\nContent-Length: 5\r\n\r\nhello").await;
    const N: usize = 8;
    let mut bodies = subscribe_at_once(addr, N, &[("heartbeats", "5s")]).await;
    let first = b"Version: \"v1\"\r\nContent-Length: 5\r\n\r\nhello";
    for body in &mut bodies {
        assert_eq!(read_bytes(body, first.len()).await, first);
    }
    // Every subscriber is caught up: the next update reaches each as received.
    let update = b"\r\n\r\nVersion: \"v2\"\r\nParents: \"v1\"\r\nContent-Length: 1\r\nContent-Range: text [5:5]\r\n\r\n!";
    upstream.push(update);
    for body in &mut bodies {
        assert_eq!(read_bytes(body, update.len()).await, update);
    }
    assert_eq!(
        upstream.requests().len(),
        1,
        "one upstream request for {N} subscribers"
    );
    // A request that differs in a Braid request header opens its own.
    let other = subscribe(addr, "/doc", &[("heartbeats", "5s"), ("peer", "p1")]).await;
    assert_eq!(other.status().as_u16(), 209);
    assert_eq!(upstream.requests().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_from_a_version_in_the_window_costs_no_upstream_request() {
    let (upstream, addr) = streaming(b"Version: \"v1\"\r\nContent-Length: 1\r\n\r\na").await;
    let first = subscribe(addr, "/doc", &[]).await;
    let mut first = first.into_body();
    let v2 = b"Version: \"v2\"\r\nParents: \"v1\"\r\nContent-Length: 1\r\nContent-Range: text [1:1]\r\n\r\nb";
    let v3 = b"Version: \"v3\"\r\nParents: \"v2\"\r\nContent-Length: 1\r\nContent-Range: text [2:2]\r\n\r\nc";
    let v1 = b"Version: \"v1\"\r\nContent-Length: 1\r\n\r\na";
    assert_eq!(read_bytes(&mut first, v1.len()).await, v1);
    // Read one at a time: a subscriber behind by two would get them collapsed.
    upstream.push(v2);
    assert_eq!(read_bytes(&mut first, v2.len()).await, v2);
    upstream.push(v3);
    assert_eq!(read_bytes(&mut first, v3.len()).await, v3);

    let resumed = subscribe(addr, "/doc", &[("parents", "\"v2\"")]).await;
    assert_eq!(resumed.status().as_u16(), 209);
    let mut resumed = resumed.into_body();
    assert_eq!(
        read_bytes(&mut resumed, v3.len()).await,
        v3,
        "only what it missed"
    );
    assert_eq!(upstream.requests().len(), 1, "answered from the window");

    // A version the proxy never got from the upstream goes to the upstream.
    let unknown = subscribe(addr, "/doc", &[("parents", "\"elsewhere\"")]).await;
    assert_eq!(unknown.status().as_u16(), 209);
    let requests = upstream.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1]["parents"], "\"elsewhere\"");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_end_ends_the_downstream_streams() {
    let upstream = Upstream::start(|_, _| Script {
        end: true,
        ..Script::stream(b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi")
    })
    .await;
    let (addr, _) = proxy(&upstream, |_| {}).await;
    let mut body = subscribe(addr, "/doc", &[]).await.into_body();
    assert_eq!(
        read_bytes(&mut body, 40).await,
        b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi"
    );
    assert!(ends_within(&mut body, Duration::from_secs(2)).await);
    // The client's resume reaches the upstream as it made it.
    let again = subscribe(addr, "/doc", &[("parents", "\"v1\"")]).await;
    assert_eq!(again.status().as_u16(), 209);
    assert_eq!(upstream.requests()[1]["parents"], "\"v1\"");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_upstream_heartbeats_end_the_downstream_streams() {
    // It promises a beat every 100 ms, then sends nothing.
    let upstream = Upstream::start(|_, _| Script {
        headers: vec![("heartbeats", "0.1s".into())],
        ..Script::stream(b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi")
    })
    .await;
    let (addr, _) = proxy(&upstream, |c| c.heartbeat = Duration::from_millis(100)).await;
    let response = subscribe(addr, "/doc", &[("heartbeats", "0.1s")]).await;
    assert_eq!(response.headers()["heartbeats"], "0.1s");
    let mut body = response.into_body();
    let started = std::time::Instant::now();
    // After 2 × 0.1 s + 5 s, later than braid-http's client (1.2 × N + 3 s)
    // gives up by itself: no proxy beats in between to hide the silence.
    assert!(ends_within(&mut body, Duration::from_secs(8)).await);
    assert!(started.elapsed() >= Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_subscriber_leaving_closes_the_upstream_subscription_at_once() {
    let (upstream, addr) = streaming(b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi").await;
    let a = subscribe(addr, "/doc", &[]).await;
    let b = subscribe(addr, "/doc", &[]).await;
    assert_eq!(upstream.requests().len(), 1);
    drop(a);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        upstream.closed.load(Ordering::SeqCst),
        0,
        "one subscriber is left"
    );
    drop(b);
    // --resource-idle is 30 s: closing must not wait for it.
    wait_for("the upstream stream is closed", || {
        upstream.closed.load(Ordering::SeqCst) == 1
    })
    .await;
}

/// A client that leaves and at once subscribes again (braid-http's
/// `forget()` then `get()`) is seen by the upstream twice, as it would be
/// without the proxy: a session whose last subscriber has gone is closing
/// and is not joined. (On one thread, so that the proxy's noticing the
/// close and its reading the next request come in the order the client
/// made them; across worker threads that order is a race no proxy that
/// fans out can always win.)
#[tokio::test]
async fn a_subscriber_that_leaves_and_comes_back_is_a_new_upstream_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (upstream, addr) = streaming(b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi").await;
    async fn raw_subscription(addr: SocketAddr) -> tokio::net::TcpStream {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
            .await
            .expect("write");
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !seen.ends_with(b"hi\r\n") {
            let n = tokio::time::timeout(WAIT, s.read(&mut buf))
                .await
                .expect("read in time")
                .expect("read");
            assert!(n > 0, "closed early");
            seen.extend_from_slice(&buf[..n]);
        }
        s
    }
    for round in 1..=5 {
        drop(raw_subscription(addr).await);
        drop(raw_subscription(addr).await);
        assert_eq!(
            upstream.requests().len(),
            2 * round,
            "every subscription after the last one left reached the upstream"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_and_plain_answers_reach_the_client_as_the_upstream_gave_them() {
    let upstream = Upstream::start(|n, _| match n {
        0 => Script {
            status: 503,
            headers: vec![("retry-after", "7".into()), ("x-why", "busy".into())],
            end: true,
            ..Script::stream(b"come back later")
        },
        1 => Script {
            status: 403,
            end: true,
            ..Script::stream(b"no")
        },
        _ => Script {
            status: 200,
            headers: vec![("content-type", "text/plain".into())],
            end: true,
            ..Script::stream(b"a plain answer")
        },
    })
    .await;
    let (addr, _) = proxy(&upstream, |c| c.upstream_kind = UpstreamKind::Braid).await;
    let response = subscribe(addr, "/doc", &[]).await;
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(response.headers()["retry-after"], "7");
    assert_eq!(response.headers()["x-why"], "busy");
    let body = common::body_of(response).await;
    assert_eq!(&body[..], b"come back later");
    assert_eq!(subscribe(addr, "/doc", &[]).await.status().as_u16(), 403);
    // A Braid upstream's 200 is its answer, not something to poll.
    let response = subscribe(addr, "/doc", &[]).await;
    assert_eq!(response.status().as_u16(), 200);
    let body = common::body_of(response).await;
    assert_eq!(&body[..], b"a plain answer");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        upstream.requests().len(),
        3,
        "one upstream request per client request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_braid_request_headers_go_upstream_as_the_client_sent_them() {
    let upstream = Upstream::start(|_, h| Script {
        headers: h
            .get("heartbeats")
            .map(|v| ("heartbeats", v.to_str().unwrap_or("").to_string()))
            .into_iter()
            .collect(),
        ..Script::stream(b"")
    })
    .await;
    let (addr, _) = proxy(&upstream, |_| {}).await;
    let response = get(
        addr,
        "/doc",
        &[
            ("subscribe", "?1"),
            ("heartbeats", "0.25s"),
            ("parents", "\"b\", \"a\""),
            ("peer", "\"p9\""),
            ("x-client", "mine"),
        ],
    )
    .await;
    assert_eq!(
        response.status().as_u16(),
        209,
        "the 209 comes before any update"
    );
    assert_eq!(response.headers()["heartbeats"], "0.25s");
    let sent = &upstream.requests()[0];
    assert_eq!(sent["subscribe"], "?1");
    assert_eq!(sent["heartbeats"], "0.25s");
    assert_eq!(sent["parents"], "\"b\", \"a\"");
    assert_eq!(sent["peer"], "\"p9\"");
    assert_eq!(sent["x-client"], "mine");
    assert!(sent.contains_key("via"));
    // braidify accepts a negative interval: so does the proxy, and reads
    // it as none, which it does not send on (braidify would beat every
    // millisecond); a value that is not a number is still a 400.
    for (value, status) in [("-1.9s", 209), ("soon", 400)] {
        let response = get(
            addr,
            "/doc",
            &[("subscribe", "true"), ("heartbeats", value)],
        )
        .await;
        assert_eq!(response.status().as_u16(), status, "Heartbeats: {value}");
    }
    let sent = upstream.requests();
    assert_eq!(sent.len(), 2, "the 400 is the proxy's own");
    assert!(!sent[1].contains_key("heartbeats"), "{:?}", sent[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_second_heartbeats_are_honoured_for_a_polled_origin() {
    let origin = common::serve(|_| Response::new(Full::new(Bytes::from_static(b"plain")))).await;
    let (addr, _) = common::proxy_for(origin, |_| {}).await;
    let response = get(
        addr,
        "/doc",
        &[("subscribe", "true"), ("heartbeats", "100ms")],
    )
    .await;
    assert_eq!(response.status().as_u16(), 209);
    assert_eq!(response.headers()["heartbeats"], "100ms");
    let mut body = response.into_body();
    let mut blank = 0;
    let _ = tokio::time::timeout(Duration::from_millis(900), async {
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                if data.as_ref() == b"\r\n" {
                    blank += 1;
                }
            }
        }
    })
    .await;
    assert!(blank >= 4, "about 8 beats in 900 ms at 100 ms, got {blank}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_gets_of_a_braid_upstream_carry_no_version_of_the_proxys_own() {
    let upstream = Upstream::start(|n, _| Script {
        status: 200,
        headers: if n == 0 {
            vec![("version", "corrupt-1".into())]
        } else {
            Vec::new()
        },
        end: true,
        ..Script::stream(b"ok")
    })
    .await;
    let (addr, _) = proxy(&upstream, |c| c.upstream_kind = UpstreamKind::Braid).await;
    let corrupt = get(addr, "/a", &[]).await;
    assert_eq!(
        corrupt.headers()["version"],
        "corrupt-1",
        "as the upstream sent it"
    );
    for _ in 0..2 {
        let plain = get(addr, "/b", &[]).await;
        assert_eq!(plain.status().as_u16(), 200);
        for name in ["version", "current-version", "etag", "repr-digest"] {
            assert!(plain.headers().get(name).is_none(), "no {name} added");
        }
        let body = common::body_of(plain).await;
        assert_eq!(&body[..], b"ok");
    }
    assert_eq!(
        upstream.requests().len(),
        3,
        "each GET is the upstream's to answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_breaks_are_resumed_upstream_from_the_last_version_it_sent() {
    let upstream = Upstream::start(|n, _| match n {
        0 => Script {
            end: true,
            ..Script::stream(b"Version: \"v1\"\r\nContent-Length: 1\r\n\r\na")
        },
        _ => Script::stream(
            b"Version: \"v2\"\r\nParents: \"v1\"\r\nContent-Length: 1\r\nContent-Range: text [1:1]\r\n\r\nb",
        ),
    })
    .await;
    let (addr, _) = proxy(&upstream, |c| {
        c.hold_upstream_breaks = Duration::from_secs(5)
    })
    .await;
    let mut body = subscribe(addr, "/doc", &[("x-client", "first")])
        .await
        .into_body();
    let want: &[u8] = b"Version: \"v1\"\r\nContent-Length: 1\r\n\r\naVersion: \"v2\"\r\nParents: \"v1\"\r\nContent-Length: 1\r\nContent-Range: text [1:1]\r\n\r\nb";
    assert_eq!(
        read_bytes(&mut body, want.len()).await,
        want,
        "one stream across the break"
    );
    let requests = upstream.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1]["parents"], "\"v1\"");
    assert_eq!(
        requests[1]["x-client"], "first",
        "the opener's request again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_subscribers_of_a_plain_origin_cost_one_request() {
    let gets = Arc::new(AtomicUsize::new(0));
    let count = gets.clone();
    let origin = common::serve(move |_| {
        count.fetch_add(1, Ordering::SeqCst);
        Response::new(Full::new(Bytes::from_static(b"plain")))
    })
    .await;
    // Polls every 30 s: only the subscribers' own requests reach the origin.
    // Rounds on fresh proxies: the joiners race the opener's seed.
    for round in 0..10 {
        gets.store(0, Ordering::SeqCst);
        let (addr, _) = common::proxy_for(origin, |_| {}).await;
        let mut bodies = subscribe_at_once(addr, 16, &[]).await;
        for body in &mut bodies {
            let got = read_bytes(body, 1).await;
            assert!(!got.is_empty());
        }
        assert_eq!(
            gets.load(Ordering::SeqCst),
            1,
            "round {round}: the first request's answer serves them all"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_given_up_before_the_upstream_answers_holds_nobody_up() {
    // The first request's answer comes after 1 s; the client gives up sooner.
    let upstream =
        Upstream::start(|_, _| Script::stream(b"Version: \"v1\"\r\nContent-Length: 1\r\n\r\na"))
            .await;
    let slow = Arc::new(AtomicUsize::new(0));
    let gate = slow.clone();
    let front = common::serve_async(move |req: Request<Incoming>| {
        let (gate, upstream) = (gate.clone(), upstream.addr);
        async move {
            if gate.fetch_add(1, Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            // Forward to the scripted upstream.
            let headers: Vec<(String, String)> = req
                .headers()
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_string()))
                .collect();
            let pairs: Vec<(&str, &str)> = headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let response = get(upstream, req.uri().path(), &pairs).await;
            let (parts, body) = response.into_parts();
            Response::from_parts(parts, body)
        }
    })
    .await;
    let (addr, _) = common::proxy_for(front, |_| {}).await;
    let first =
        tokio::time::timeout(Duration::from_millis(200), subscribe(addr, "/doc", &[])).await;
    assert!(first.is_err(), "the first client gave up");
    let started = std::time::Instant::now();
    let second = subscribe(addr, "/doc", &[]).await;
    assert_eq!(second.status().as_u16(), 209);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the second request did not wait on the abandoned one ({:?})",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_subscriptions_are_capped_per_resource() {
    let upstream = Upstream::start(|_, _| Script::stream(b"")).await;
    let (addr, _) = proxy(&upstream, |c| c.max_subscriptions_per_resource = 1).await;
    let first = subscribe(addr, "/doc", &[]).await;
    assert_eq!(first.status().as_u16(), 209);
    let second = subscribe(addr, "/doc", &[]).await;
    assert_eq!(second.status().as_u16(), 503);
    assert!(second.headers().contains_key("retry-after"));
    assert_eq!(upstream.requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blank_lines_written_apart_from_their_update_go_out_with_it() {
    // Like braid-http's server: every update is followed by two blank
    // lines, each written as a chunk of its own.
    let (upstream, addr) =
        streaming(b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi\r\n\r\n").await;
    let mut body = subscribe(addr, "/doc", &[]).await.into_body();
    let first = read_bytes(&mut body, 40).await;
    assert!(first.ends_with(b"hi\r\n\r\n"), "{first:?}");
    for n in 2..=4 {
        upstream.push(format!("Version: \"v{n}\"\r\nContent-Length: 3\r\n\r\nbye").as_bytes());
        // Each blank line apart in time, so that the proxy reads them apart.
        for _ in 0..2 {
            tokio::time::sleep(Duration::from_millis(2)).await;
            upstream.push(b"\r\n");
        }
        // The update arrives as one piece (one HTTP chunk, one frame) that
        // ends with its blank lines.
        let frame = tokio::time::timeout(WAIT, body.frame())
            .await
            .expect("an update in time")
            .expect("not ended")
            .expect("no error")
            .into_data()
            .expect("data");
        assert!(
            frame.starts_with(format!("Version: \"v{n}\"").as_bytes())
                && frame.ends_with(b"bye\r\n\r\n"),
            "update {n} came as {frame:?}"
        );
    }
}

/// Relayed subscriptions on the fast path park once caught up: the sweep
/// writes them every update, in order, with the bytes a subscriber served
/// through hyper (a `Connection` option keeps it off the fast path) gets
/// from its task; when the upstream ends, their streams end cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_relayed_subscribers_get_every_update_then_the_end() {
    use common::wire::{dechunk, metric, read_until, versions_in, versions_until};
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start(|_, _| {
        Script::stream(b"Version: \"v0\"\r\nContent-Length: 2\r\n\r\nhi\r\n\r\n")
    })
    .await;
    let (addr, admin) = proxy(&upstream, |_| {}).await;
    async fn raw(addr: SocketAddr, extra: &str) -> (tokio::net::TcpStream, Vec<u8>) {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!("GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n{extra}\r\n");
        s.write_all(head.as_bytes()).await.expect("write");
        let mut seen = Vec::new();
        read_until(&mut s, &mut seen, |t| t.contains("hi")).await;
        (s, seen)
    }
    let mut subs = Vec::new();
    for _ in 0..10 {
        subs.push(raw(addr, "").await);
    }
    let mut through_hyper = raw(addr, "Connection: keep-alive, x-hop\r\nX-Hop: 1\r\n").await;
    wait_for_metric(admin, "subscriptions_parked", 10.0).await;
    for n in 1..=10 {
        upstream.push(
            format!(
                "Version: \"v{n}\"\r\nParents: \"v{}\"\r\nContent-Length: 3\r\n\r\nu{n:02}\r\n\r\n",
                n - 1
            )
            .as_bytes(),
        );
        for (s, seen) in &mut subs {
            versions_until(s, seen, n + 1).await;
        }
        versions_until(&mut through_hyper.0, &mut through_hyper.1, n + 1).await;
    }
    // Written by the sweep: still parked.
    assert_eq!(metric(admin, "subscriptions_parked").await, 10.0);
    upstream.end();
    read_until(&mut through_hyper.0, &mut through_hyper.1, |t| {
        t.ends_with("0\r\n\r\n")
    })
    .await;
    let want: Vec<String> = (0..=10).map(|n| format!("\"v{n}\"")).collect();
    assert_eq!(versions_in(&through_hyper.1), want);
    let reference = dechunk(&through_hyper.1);
    for (s, seen) in &mut subs {
        // The terminating chunk: the stream ended cleanly.
        read_until(s, seen, |t| t.ends_with("0\r\n\r\n")).await;
        assert_eq!(versions_in(seen), want);
        assert_eq!(
            dechunk(seen),
            reference,
            "the sweep sends what the task path sends"
        );
    }
    wait_for_metric(admin, "subscriptions_parked", 0.0).await;
}

async fn wait_for_metric(admin: SocketAddr, name: &str, value: f64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while common::wire::metric(admin, name).await != value {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} never reached {value}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An upstream answering each subscription in the language asked for,
/// saying so in `Vary`; `/private` answers are `Cache-Control: private`.
async fn multilingual() -> Upstream {
    Upstream::start(|_, h| {
        let lang = h
            .get("accept-language")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("en")
            .to_string();
        let text = if lang.starts_with("fr") {
            "Bonjour"
        } else {
            "Hello"
        };
        let mut headers = vec![(
            "vary",
            "Accept-Language, Version, Parents, Subscribe".to_string(),
        )];
        if h.contains_key("x-private") {
            headers.push(("cache-control", "private".to_string()));
        }
        let body = format!(
            "Version: \"{lang}-1\"\r\nContent-Length: {}\r\n\r\n{text}",
            text.len()
        );
        Script {
            headers,
            ..Script::stream(body.as_bytes())
        }
    })
    .await
}

/// The first update of a relayed subscription to `path` in `lang`.
async fn first_update(addr: SocketAddr, path: &str, lang: &str, extra: &[(&str, &str)]) -> String {
    let mut headers = vec![("accept-language", lang)];
    headers.extend_from_slice(extra);
    let response = subscribe(addr, path, &headers).await;
    assert_eq!(response.status().as_u16(), 209);
    let mut body = response.into_body();
    let mut got = String::new();
    let _ = tokio::time::timeout(WAIT, async {
        while !got.contains("Bonjour") && !got.contains("Hello") {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        got.push_str(&String::from_utf8_lossy(&data));
                    }
                }
                _ => return,
            }
        }
    })
    .await;
    got.trim_end().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_sessions_are_never_shared_across_vary_values_or_private_answers() {
    let upstream = multilingual().await;
    let (addr, _) = proxy(&upstream, |_| {}).await;
    // Held open, so that later requests could join its session.
    let french = subscribe(addr, "/doc", &[("accept-language", "fr")]).await;
    let mut french = french.into_body();
    assert!(String::from_utf8_lossy(&read_bytes(&mut french, 40).await).ends_with("Bonjour"));
    let english = first_update(addr, "/doc", "en", &[]).await;
    assert!(
        english.ends_with("Hello"),
        "the English view, got {english:?}"
    );
    assert_eq!(upstream.requests().len(), 2);
    // Another French subscriber shares the French session.
    let again = first_update(addr, "/doc", "fr", &[]).await;
    assert!(again.ends_with("Bonjour"), "{again:?}");
    assert_eq!(upstream.requests().len(), 2, "joined the French session");
    // A private answer is one client's: nobody joins it.
    let private = subscribe(addr, "/private", &[("x-private", "1")]).await;
    let mut private = private.into_body();
    assert!(!read_bytes(&mut private, 20).await.is_empty());
    let second = first_update(addr, "/private", "en", &[("x-private", "1")]).await;
    assert!(second.ends_with("Hello"));
    assert_eq!(
        upstream.requests().len(),
        4,
        "its own upstream subscription"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_subscriptions_of_two_variants_each_get_their_own() {
    // Braid upstream and plain origin alike, on fresh proxies.
    let braid = multilingual().await;
    let plain = common::serve(|req| {
        let fr = req
            .headers()
            .get("accept-language")
            .is_some_and(|v| v.as_bytes().starts_with(b"fr"));
        Response::builder()
            .header("vary", "Accept-Language")
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from_static(if fr {
                b"Bonjour"
            } else {
                b"Hello"
            })))
            .expect("response")
    })
    .await;
    for origin in [braid.addr, plain] {
        for round in 0..20 {
            let (addr, _) = common::proxy_for(origin, |_| {}).await;
            let both = tokio::time::timeout(Duration::from_secs(3), async {
                tokio::join!(
                    first_update(addr, "/doc", "fr", &[]),
                    first_update(addr, "/doc", "en", &[])
                )
            })
            .await;
            let (fr, en) =
                both.unwrap_or_else(|_| panic!("round {round}: not both answered in 3 s"));
            assert!(fr.ends_with("Bonjour"), "round {round}: {fr:?}");
            assert!(en.ends_with("Hello"), "round {round}: {en:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_write_to_a_resource_not_known_yet_goes_to_a_braid_upstream() {
    // A Braid server: its GETs name versions; its PUTs take patches.
    let upstream = Upstream::start(|_, h| {
        let put = h.contains_key("content-range");
        Script {
            status: 200,
            headers: vec![("version", "\"v1\"".to_string())],
            end: true,
            ..Script::stream(if put { b"patched" } else { b"text" })
        }
    })
    .await;
    let (addr, _) = proxy(&upstream, |_| {}).await;
    let response = common::request(
        addr,
        "PUT",
        "/fresh",
        &[
            ("content-range", "text [0:0]"),
            ("content-length", "0"),
            ("parents", "\"v1\""),
            ("version", "\"v2\""),
        ],
    )
    .await;
    assert_eq!(response.status().as_u16(), 200, "not refused by the proxy");
    assert_eq!(&common::body_of(response).await[..], b"patched");
    let requests = upstream.requests();
    assert_eq!(requests.len(), 2, "one GET to learn, then the write");
    assert_eq!(
        requests[1]["content-range"], "text [0:0]",
        "the patch as sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_status_lists_a_relayed_subscription_and_its_subscribers() {
    let first = b"Version: \"v1\"\r\nContent-Length: 5\r\n\r\nhello";
    let upstream = Upstream::start(move |_, _| Script::stream(first)).await;
    let (addr, admin) = proxy(&upstream, |_| {}).await;
    let mut bodies = subscribe_at_once(addr, 3, &[]).await;
    for body in &mut bodies {
        assert_eq!(read_bytes(body, first.len()).await, first);
    }
    let status = common::body_of(get(admin, "/status", &[]).await).await;
    let status: serde_json::Value = serde_json::from_slice(&status).expect("JSON");
    let doc = status["resources"]
        .as_array()
        .and_then(|list| list.iter().find(|r| r["path"] == "/doc"))
        .unwrap_or_else(|| panic!("no /doc: {status}"));
    assert_eq!(doc["feed"], "braid", "{doc}");
    assert_eq!(doc["subscribers"], 3, "{doc}");
    assert_eq!(doc["version"], "\"v1\"", "{doc}");
    assert_eq!(doc["health"], "upstream stream live", "{doc}");
    // The update came a moment ago (read, at most, within this test).
    let ago = doc["last_change_secs_ago"]
        .as_f64()
        .unwrap_or_else(|| panic!("no last change: {doc}"));
    assert!((0.0..30.0).contains(&ago), "{doc}");
    assert_eq!(upstream.requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_upstream_subscription_over_the_state_cap_is_refused() {
    // Every URL's first update is a 1.5 MiB snapshot; the cap is 4 MiB:
    // one session holds it twice (window and model), a second does not fit.
    const DOC: usize = 1536 * 1024;
    const MIB: usize = 1024 * 1024;
    let doc = vec![b'x'; DOC];
    let mut update =
        format!("Version: \"v1\"\r\nContent-Length: {}\r\n\r\n", doc.len()).into_bytes();
    update.extend_from_slice(&doc);
    let upstream = Upstream::start(move |_, _| Script::stream(&update)).await;
    let (addr, admin) = proxy(&upstream, |c| c.state_bytes = 4 * MIB).await;
    let first = subscribe(addr, "/one", &[]).await;
    assert_eq!(first.status().as_u16(), 209);
    let mut body = first.into_body();
    assert!(read_bytes(&mut body, DOC).await.len() >= DOC);
    // Another URL: its session stops reading once over the cap, and its
    // opener gets 503 rather than a 209 the proxy cannot hold.
    let second = subscribe(addr, "/two", &[]).await;
    assert_eq!(second.status().as_u16(), 503);
    let reason = common::body_of(second).await;
    assert!(String::from_utf8_lossy(&reason).contains("--state-bytes"));
    let held = common::wire::metric(admin, "state_bytes").await as usize;
    assert!(
        held <= 4 * MIB + 4 * MIB / 10,
        "{held} bytes held against 4 MiB"
    );
    // A first update larger than the whole cap is refused the same way.
    let (small, _) = proxy(&upstream, |c| c.state_bytes = MIB).await;
    let too_big = subscribe(small, "/three", &[]).await;
    assert_eq!(too_big.status().as_u16(), 503);
}
