//! No hidden queue below the cursor: with `TCP_NOTSENT_LOWAT` set on client
//! sockets, a subscriber that stops reading while many large updates go by
//! finds, when it reads again, only what its own receive buffer took plus
//! one collapsed update, not a backlog of stale ones kept in the proxy's
//! kernel send buffer. Real sockets on 127.0.0.1:0.

mod common;

use common::wire::{dechunk, metric, read_until, versions_in, versions_until};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_proxy::config::{Config, Upstream};
use braid_proxy::listen::server::Server;
use bytes::Bytes;
use http::{Method, Response};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const UPDATES: usize = 100;
const DOC_BYTES: usize = 50_000;

/// A document of `DOC_BYTES` whose every byte changes with each version
/// (so each update is a snapshot of about 50 KB).
fn doc(n: usize) -> Bytes {
    let c = b'a' + (n % 26) as u8;
    let mut body = vec![c; DOC_BYTES];
    body.extend_from_slice(format!("\nversion {n}\n").as_bytes());
    Bytes::from(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_resumes_with_little_more_than_one_update() {
    let current = Arc::new(Mutex::new(0usize));
    let state = current.clone();
    let origin = common::serve(move |req| {
        let n = *state.lock().expect("lock");
        if req.method() == Method::PUT {
            *state.lock().expect("lock") = n + 1;
            return Response::new(Full::new(Bytes::new()));
        }
        Response::builder()
            .header("etag", format!("\"v{n}\""))
            .header("content-type", "application/octet-stream")
            .body(Full::new(doc(n)))
            .expect("response")
    })
    .await;
    let config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        upstream: Some(Upstream::parse(&format!("http://{origin}")).expect("upstream")),
        poll_interval: Duration::from_secs(30),
        heartbeat: Duration::ZERO,
        history_bytes: 64 * 1024 * 1024,
        notsent_lowat: 16 * 1024,
        ..Config::default()
    };
    let server = Server::bind(config).await.expect("bind");
    let proxy = server.local_addr().expect("addr");
    tokio::spawn(server.run(std::future::pending()));

    // The subscriber reads the head and the first snapshot, then stops. Its
    // own receive buffer is kept small (16 KiB, less than one update), so
    // that what is counted is what the proxy's side holds.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("SO_RCVBUF");
    let mut sub = socket.connect(proxy).await.expect("connect");
    sub.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
        .await
        .expect("write");
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&seen).contains("version 0\n") {
        assert!(Instant::now() < deadline, "no first snapshot");
        let n = tokio::time::timeout(Duration::from_secs(5), sub.read(&mut buf))
            .await
            .expect("read in time")
            .expect("read");
        assert!(n > 0, "stream ended");
        seen.extend_from_slice(&buf[..n]);
    }

    // 100 writes through the proxy, each a new 50 KB version (write-through).
    for _ in 0..UPDATES {
        let mut w = TcpStream::connect(proxy).await.expect("connect");
        w.write_all(
            b"PUT /big HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await
        .expect("write");
        let mut answer = Vec::new();
        w.read_to_end(&mut answer).await.expect("read");
        // Let the watcher publish this version before the next write.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Read again until the last version arrives; count what came.
    let last = format!("version {UPDATES}\n");
    let mut after = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !String::from_utf8_lossy(&after).contains(&last) {
        assert!(Instant::now() < deadline, "the last version never came");
        let n = tokio::time::timeout(Duration::from_secs(5), sub.read(&mut buf))
            .await
            .expect("read in time")
            .expect("read");
        assert!(n > 0, "stream ended");
        after.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&after);
    let updates = text.matches("\r\nversion: \"").count() + text.matches("Version: \"").count();
    // At most: the update the socket was taking when it filled (partly in
    // the client's buffer, the rest within the proxy's TCP_NOTSENT_LOWAT),
    // perhaps one more the kernel accepted before it filled, and the one
    // collapsed update to the newest version. Without the low-water mark the
    // kernel's send buffer holds dozens (48 in bench/README.md).
    assert!(
        updates <= 3,
        "a stalled reader got {updates} updates on resuming, where what the socket held plus one collapsed update was expected"
    );
}

// ---------------------------------------------------------------------------
// The HTTP/1.1 fast path (src/net/fastpath.rs): a subscription that arrives whole
// is written to the socket by the proxy itself. What it writes must be what
// hyper would have written, and the connection must behave as under hyper.

/// Tells the proxy that `path` changed (the refresh hook).
async fn refresh(admin: std::net::SocketAddr, path: &str) {
    let mut r = TcpStream::connect(admin).await.expect("connect");
    let request = format!(
        "POST /refresh?path={path} HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    r.write_all(request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    r.read_to_end(&mut answer).await.expect("read");
    assert!(
        answer.starts_with(b"HTTP/1.1 202"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
}

/// An origin with `/doc` = "hello", and a proxy (heartbeats off) in front.
async fn hello_proxy() -> (
    common::origin::Origin,
    std::net::SocketAddr,
    std::net::SocketAddr,
) {
    let origin = common::origin::Origin::default();
    origin.set("/doc", "hello");
    let (proxy, admin) = common::proxy_for(origin.start().await, |c| {
        c.heartbeat = Duration::ZERO;
    })
    .await;
    (origin, proxy, admin)
}

/// Subscribes to `/doc` with `extra` header lines; reads up to "hello".
async fn subscribe_hello(proxy: std::net::SocketAddr, extra: &str) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(proxy).await.expect("connect");
    let head = format!("GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n{extra}\r\n");
    s.write_all(head.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    read_until(&mut s, &mut seen, |t| t.contains("hello")).await;
    (s, seen)
}

/// The same subscription, once on the fast path and once through hyper (a
/// `Connection` option keeps it off the fast path): the same status line,
/// the same headers but `date`, and the same updates, byte for byte.
#[tokio::test]
async fn the_fast_path_writes_what_hyper_writes() {
    let (origin, proxy, admin) = hello_proxy().await;
    let mut streams = Vec::new();
    for connection in ["", "Connection: keep-alive, x-hop\r\nX-Hop: 1\r\n"] {
        streams.push(subscribe_hello(proxy, connection).await);
    }
    origin.set("/doc", "hello, world");
    refresh(admin, "/doc").await;
    for (s, seen) in &mut streams {
        read_until(s, seen, |t| t.contains(", world")).await;
    }
    let heads: Vec<Vec<String>> = streams
        .iter()
        .map(|(_, seen)| {
            let text = String::from_utf8_lossy(seen);
            let head = &text[..text.find("\r\n\r\n").expect("head")];
            let mut lines: Vec<String> = head
                .lines()
                .filter(|l| !l.to_ascii_lowercase().starts_with("date:"))
                .map(|l| l.to_ascii_lowercase())
                .collect();
            lines.sort();
            lines
        })
        .collect();
    assert_eq!(heads[0], heads[1]);
    assert!(heads[0].contains(&"http/1.1 209 subscription".to_string()));
    assert!(heads[0].contains(&"transfer-encoding: chunked".to_string()));
    assert_eq!(dechunk(&streams[0].1), dechunk(&streams[1].1));
    assert_eq!(metric(admin, "subscriptions").await, 2.0);
}

/// A client that goes away is noticed at once, with no read buffer: its
/// subscription (and cursor) is gone.
#[tokio::test]
async fn a_fast_path_subscriber_that_leaves_is_dropped() {
    let (_origin, proxy, admin) = hello_proxy().await;
    let (s, _) = subscribe_hello(proxy, "").await;
    assert_eq!(metric(admin, "subscriptions").await, 1.0);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(admin, "subscriptions").await != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the subscription outlived its client"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A refused subscription (malformed `Parents`) is answered with a length,
/// and the connection then serves the client's next request.
#[tokio::test]
async fn after_a_refusal_the_connection_serves_the_next_request() {
    let (_origin, proxy, _) = hello_proxy().await;
    let mut s = TcpStream::connect(proxy).await.expect("connect");
    s.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\nParents: not-quoted\r\n\r\n")
        .await
        .expect("write");
    let mut seen = Vec::new();
    read_until(&mut s, &mut seen, |t| {
        t.find("\r\n\r\n").is_some_and(|end| {
            let len: usize = t[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.parse().ok())
                .unwrap_or(usize::MAX);
            t.len() >= end + 4 + len
        })
    })
    .await;
    let text = String::from_utf8_lossy(&seen).to_string();
    assert!(text.starts_with("HTTP/1.1 400 "), "{text}");
    next_get_is_served(&mut s, "hello").await;
}

/// Sends a plain `GET /doc` on a connection that already answered a
/// request, and expects a 200 whose body ends with `body`.
async fn next_get_is_served(s: &mut TcpStream, body: &str) {
    s.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut next = Vec::new();
    read_until(s, &mut next, |t| t.ends_with(body)).await;
    assert!(next.starts_with(b"HTTP/1.1 200 OK\r\n"));
}

/// A relayed stream that the upstream ends is ended with the last chunk,
/// and the connection then serves the client's next request.
#[tokio::test]
async fn an_ended_stream_ends_cleanly_and_the_connection_is_reused() {
    let upstream = common::serve(|req| {
        if req.headers().contains_key("subscribe") {
            Response::builder()
                .status(209)
                .header("subscribe", "true")
                .body(Full::new(Bytes::from_static(
                    b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi\r\n\r\n",
                )))
                .expect("209")
        } else {
            Response::new(Full::new(Bytes::from_static(b"plain")))
        }
    })
    .await;
    let (proxy, _) = common::proxy_for(upstream, |c| {
        c.upstream_kind = braid_proxy::config::UpstreamKind::Braid;
    })
    .await;
    let mut s = TcpStream::connect(proxy).await.expect("connect");
    s.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
        .await
        .expect("write");
    let mut seen = Vec::new();
    read_until(&mut s, &mut seen, |t| t.ends_with("\r\n0\r\n\r\n")).await;
    assert!(seen.starts_with(b"HTTP/1.1 209 "));
    assert_eq!(
        dechunk(&seen),
        b"Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi\r\n\r\n"
    );
    next_get_is_served(&mut s, "plain").await;
}

/// A client that goes away while its subscription request waits on the
/// upstream gives the request up: the upstream request is dropped too, as
/// through hyper, and nothing waits on it.
#[tokio::test]
async fn a_request_whose_client_left_is_given_up() {
    struct Dropped(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let given_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = given_up.clone();
    let upstream = common::serve_async(move |_req| {
        let guard = Dropped(flag.clone());
        async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            drop(guard);
            Response::builder()
                .status(209)
                .body(Full::new(Bytes::new()))
                .expect("209")
        }
    })
    .await;
    let (proxy, _) = common::proxy_for(upstream, |c| {
        c.upstream_kind = braid_proxy::config::UpstreamKind::Braid;
    })
    .await;
    let mut s = TcpStream::connect(proxy).await.expect("connect");
    s.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!given_up.load(std::sync::atomic::Ordering::SeqCst));
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !given_up.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the upstream request outlived its client"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------
// Direct delivery (src/serve/direct.rs): caught-up fast-path subscriptions park,
// and one sweep per change writes it to all of them.

/// Twenty subscribers, parked once caught up, get every one of 15 changes,
/// in order, from the sweep: the same bytes as a subscriber served through
/// hyper (a `Connection` option keeps it off the fast path) gets from its task.
#[tokio::test]
async fn parked_subscribers_get_every_change_in_order() {
    let (origin, proxy, admin) = hello_proxy().await;
    let mut subs = Vec::new();
    for _ in 0..20 {
        subs.push(subscribe_hello(proxy, "").await);
    }
    let mut through_hyper =
        subscribe_hello(proxy, "Connection: keep-alive, x-hop\r\nX-Hop: 1\r\n").await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(admin, "subscriptions_parked").await != 20.0 {
        assert!(Instant::now() < deadline, "the subscribers did not park");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in 1..=15 {
        origin.set("/doc", format!("hello {n}"));
        refresh(admin, "/doc").await;
        // Let each change be swept before the next (no collapse wanted here).
        for (s, seen) in &mut subs {
            versions_until(s, seen, n + 1).await;
        }
        versions_until(&mut through_hyper.0, &mut through_hyper.1, n + 1).await;
    }
    let want: Vec<String> = (1..=16).map(|n| format!("\"e{n}\"")).collect();
    let reference = dechunk(&through_hyper.1);
    assert_eq!(versions_in(&through_hyper.1), want);
    for (_, seen) in &subs {
        assert_eq!(versions_in(seen), want);
        assert_eq!(
            dechunk(seen),
            reference,
            "the sweep's chunks carry what the task path sends"
        );
    }
    assert_eq!(metric(admin, "subscriptions_parked").await, 20.0);
    // The sweeps that wrote them are timed.
    let sweeps = metric(admin, "sweep_seconds_count").await;
    assert!(sweeps >= 1.0, "{sweeps} sweeps timed");
}

/// A parked subscription still gets its heartbeats, and updates after them.
#[tokio::test]
async fn parked_subscribers_keep_their_heartbeats() {
    let (origin, proxy, admin) = hello_proxy().await;
    let (mut s, mut seen) = subscribe_hello(proxy, "Heartbeats: 100ms\r\n").await;
    // Heartbeats are blank lines: chunks of "\r\n".
    read_until(&mut s, &mut seen, |t| {
        t.matches("2\r\n\r\n\r\n").count() >= 3
    })
    .await;
    origin.set("/doc", "hello again");
    refresh(admin, "/doc").await;
    read_until(&mut s, &mut seen, |t| t.contains("again")).await;
    read_until(&mut s, &mut seen, |t| {
        t[t.find("again").unwrap_or(0)..]
            .matches("2\r\n\r\n\r\n")
            .count()
            >= 2
    })
    .await;
}
