//! Tiers of proxies: a plain origin, a shield braid-proxy polling it, and
//! edge braid-proxies following the shield's Braid subscriptions, all on
//! 127.0.0.1:0 in this process. Subscribers are hyper clients on real
//! sockets whose streams are decoded with the crate's codec.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use braid_proxy::braid::{self, DecodeLimits, Decoder, VersionList};
use braid_proxy::config::Config;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use common::tier::{config, Tier};

const WAIT: Duration = Duration::from_secs(10);

/// The host every client names, at whichever edge: the one public name a
/// balancer serves. Each tier keys on the client's host, so clients of
/// different edges share the shield's state only if they name the same
/// one (tests/tiers_host.rs keeps different hosts apart).
const PUBLIC_HOST: &str = "docs.example";

/// The tests' plain origin (tests/common/origin.rs), which also records
/// every request's path and `Via`, and stores a numbered text on a PUT
/// (whose body it does not read).
#[derive(Clone, Default)]
struct Origin {
    inner: common::origin::Origin,
    requests: Arc<Mutex<Vec<(String, String)>>>,
}

impl Origin {
    /// Stores a new version of `path`; returns its ETag value.
    fn set(&self, path: &str, body: impl Into<Bytes>) -> String {
        self.inner.set(path, body)
    }

    /// Requests answered so far.
    fn gets(&self) -> usize {
        self.inner.gets.load(Ordering::SeqCst)
    }

    async fn start(&self) -> SocketAddr {
        let origin = self.clone();
        common::serve(move |req| origin.answer(req)).await
    }

    fn answer(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let via = req
            .headers()
            .get("via")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let path = req.uri().path().to_string();
        self.requests
            .lock()
            .expect("lock")
            .push((path.clone(), via));
        if req.method() != http::Method::PUT {
            return self.inner.answer(req);
        }
        self.inner.gets.fetch_add(1, Ordering::SeqCst);
        let n = self.inner.version(&path);
        self.set(&path, format!("written by PUT {n}\n"));
        Response::builder()
            .status(204)
            .body(Full::new(Bytes::new()))
            .expect("response")
    }
}

/// Sends one GET on a new connection; `subscribe` adds `Subscribe: true`.
async fn request(addr: SocketAddr, path: &str, subscribe: bool) -> Response<Incoming> {
    let headers: &[(&str, &str)] = if subscribe {
        &[("host", PUBLIC_HOST), ("subscribe", "true")]
    } else {
        &[("host", PUBLIC_HOST)]
    };
    common::get(addr, path, headers).await
}

async fn plain_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let response = request(addr, path, false).await;
    let status = response.status().as_u16();
    let body = common::body_of(response).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// What one subscriber saw.
#[derive(Debug, Default)]
struct Seen {
    body: Vec<u8>,
    version: VersionList,
    /// Every version received, in order.
    versions: Vec<String>,
}

/// Subscribes to `path` at `addr` and follows the stream until the
/// subscriber's version is `until`, checking that every update's parents
/// are the version it had (no gap) and that no version repeats.
async fn follow(addr: SocketAddr, path: &str, until: String) -> Seen {
    follow_held(addr, path, until).await.0
}

/// [`follow`], handing back the still open stream.
async fn follow_held(addr: SocketAddr, path: &str, until: String) -> (Seen, Incoming) {
    let mut seen = Seen::default();
    let response = request(addr, path, true).await;
    assert_eq!(response.status().as_u16(), 209, "subscription status");
    let mut body = response.into_body();
    let followed = tokio::time::timeout(WAIT, read_until(&mut body, &mut seen, &until)).await;
    assert!(
        matches!(followed, Ok(true)),
        "subscriber at {addr} never reached {until}; saw {:?}",
        seen.versions
    );
    (seen, body)
}

/// Reads updates into `seen` until its version is `until` (true) or the
/// stream ends (false). After a resume, a snapshot may start the stream.
async fn read_until(body: &mut Incoming, seen: &mut Seen, until: &str) -> bool {
    let mut decoder = Decoder::new(DecodeLimits::default());
    let mut first = true;
    loop {
        while let Some(update) = decoder.next_update().expect("well-formed update") {
            let id = update.version.to_header_value();
            assert!(
                !seen.versions.contains(&id),
                "version {id} delivered twice: {:?}",
                seen.versions
            );
            let snapshot = matches!(update.body, braid::Body::Snapshot(_));
            let resumed_from_snapshot = first && snapshot && update.parents.is_empty();
            if !seen.versions.is_empty() && !resumed_from_snapshot {
                assert_eq!(
                    update.parents, seen.version,
                    "update {id} does not follow the version the subscriber had"
                );
            }
            first = false;
            seen.body = match update.body {
                braid::Body::Snapshot(b) => b.to_vec(),
                braid::Body::Patches(p) => {
                    braid::apply_patches(&seen.body, &p).expect("patches apply")
                }
            };
            seen.version = update.version;
            seen.versions.push(id);
            if seen.version.to_header_value() == format!("\"{until}\"") {
                return true;
            }
        }
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    decoder.push(&data);
                }
            }
            _ => return false,
        }
    }
}

/// A client that retries as braid-http's does: when its stream ends or
/// its request fails, it subscribes again after a pause with `Parents`
/// set to the version it has. Returns what it saw and how often it resumed.
async fn follow_retrying(addr: SocketAddr, path: &str, until: String) -> (Seen, usize) {
    let mut seen = Seen::default();
    let mut resumes = 0;
    let done = tokio::time::timeout(WAIT * 2, async {
        loop {
            let stream = TcpStream::connect(addr).await;
            if let Ok(stream) = stream {
                if let Ok((mut sender, conn)) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
                {
                    tokio::spawn(conn);
                    let mut req = Request::get(path)
                        .header("host", PUBLIC_HOST)
                        .header("subscribe", "true");
                    if !seen.version.is_empty() {
                        req = req.header("parents", seen.version.to_header_value());
                    }
                    let req = req.body(Empty::<Bytes>::new()).expect("request");
                    if let Ok(response) = sender.send_request(req).await {
                        if response.status().as_u16() == 209 {
                            let mut body = response.into_body();
                            if read_until(&mut body, &mut seen, &until).await {
                                return;
                            }
                        }
                    }
                }
            }
            resumes += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        done.is_ok(),
        "retrying subscriber at {addr} never reached {until}; saw {:?}",
        seen.versions
    );
    (seen, resumes)
}

/// `per_tier` subscribers to `/doc` on each tier, each following to `until`.
fn subscribe_on(
    tiers: &[&Tier],
    per_tier: usize,
    until: &str,
) -> Vec<tokio::task::JoinHandle<Seen>> {
    let mut subscribers = Vec::new();
    for tier in tiers {
        for _ in 0..per_tier {
            subscribers.push(tokio::spawn(follow(tier.addr, "/doc", until.to_string())));
        }
    }
    subscribers
}

fn doc(n: usize) -> String {
    let mut text = String::new();
    for line in 0..200 {
        text.push_str(&format!("line {line}: the same words every time\n"));
    }
    text.push_str(&format!("edit number {n}\n"));
    text
}

/// Starts origin, shield and two edges (one over HTTP/1.1, one over h2c);
/// returns the origin's address too.
async fn chain(origin: &Origin) -> (SocketAddr, Tier, Tier, Tier) {
    let origin_addr = origin.start().await;
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let shield = Tier::start(config("shield", origin_addr, any)).await;
    let edge_a = Tier::start(config("edge-a", shield.addr, any)).await;
    // One edge speaks h2c to the shield: all its subscriptions on one connection.
    let edge_b = Tier::start(Config {
        upstream_h2c: true,
        ..config("edge-b", shield.addr, any)
    })
    .await;
    (origin_addr, shield, edge_a, edge_b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_tiers_share_versions_and_the_origin_sees_only_the_shield() {
    let origin = Origin::default();
    let mut last = origin.set("/doc", doc(0));
    let (_, shield, edge_a, edge_b) = chain(&origin).await;

    // Five subscribers on each edge, each following to the 6th version, and
    // one that stays (an edge closes its upstream subscription when the
    // last of its subscribers leaves).
    let target = "e6".to_string();
    let subscribers = subscribe_on(&[&edge_a, &edge_b], 5, &target);
    let mut stays = Vec::new();
    for edge in [&edge_a, &edge_b] {
        stays.push(tokio::spawn(follow_held(edge.addr, "/doc", target.clone())));
    }
    // Every subscription opens before the document changes.
    shield
        .wait_metric(
            "subscriptions",
            |v| v == 2.0,
            "one subscription per edge at the shield",
        )
        .await;
    for edge in [&edge_a, &edge_b] {
        edge.wait_metric("subscriptions", |v| v == 6.0, "six at each edge")
            .await;
        assert_eq!(edge.metric("upstream_subscriptions").await, 1.0);
    }
    for n in 1..=5 {
        last = origin.set("/doc", doc(n));
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(last, target);
    for s in subscribers {
        let seen = s.await.expect("subscriber");
        assert!(
            seen.body == doc(5).as_bytes(),
            "edge subscriber ended elsewhere"
        );
        assert_eq!(seen.versions.first().map(String::as_str), Some("\"e1\""));
    }

    let mut held = Vec::new();
    for stay in stays {
        held.push(stay.await.expect("subscriber").1);
    }
    // The origin's load: only the shield, about one poll per interval.
    let before = origin.gets();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let polls = origin.gets() - before;
    assert!(
        (3..=14).contains(&polls),
        "expected about 10 polls in 1 s at a 100 ms interval, got {polls}"
    );
    let requests = origin.requests.lock().expect("lock").clone();
    assert!(
        requests
            .iter()
            .all(|(_, via)| via.trim_end().ends_with(" shield")),
        "every origin request came from the shield: {requests:?}"
    );
    // Plain GETs at an edge are the shield's answer (from its state).
    let (status, body) = plain_get(edge_b.addr, "/doc").await;
    assert_eq!((status, body), (200, doc(5)));
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_converge_across_a_shield_restart() {
    let origin = Origin::default();
    origin.set("/doc", doc(0));
    let (origin_addr, shield, edge_a, edge_b) = chain(&origin).await;
    let shield_addr = shield.addr;

    // doc(n) is version e(n+1): the origin's first version is doc(0).
    // Their streams end with the shield's; they resume as braid-http's
    // clients do, with Parents.
    let target = "e9".to_string();
    let mut subscribers = Vec::new();
    for edge in [&edge_a, &edge_b] {
        for _ in 0..3 {
            subscribers.push(tokio::spawn(follow_retrying(
                edge.addr,
                "/doc",
                target.clone(),
            )));
        }
    }
    shield
        .wait_metric(
            "subscriptions",
            |v| v == 2.0,
            "one subscription per edge at the shield",
        )
        .await;
    for n in 1..=3 {
        origin.set("/doc", doc(n));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shield.kill().await;
    // Changes while the edges cannot reach the shield.
    for n in 4..=6 {
        origin.set("/doc", doc(n));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let shield = Tier::start(config("shield", origin_addr, shield_addr)).await;
    let mut last = String::new();
    for n in 7..=8 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        last = origin.set("/doc", doc(n));
    }
    assert_eq!(last, target);
    let mut held = Vec::new();
    for s in subscribers {
        let (seen, resumes) = s.await.expect("subscriber");
        assert!(
            seen.body == doc(8).as_bytes(),
            "edge subscriber ended elsewhere"
        );
        assert!(resumes >= 1, "the shield's end reached the client");
    }
    // Equivalent subscribers share one upstream subscription again.
    for edge in [&edge_a, &edge_b] {
        for _ in 0..2 {
            held.push(follow_held(edge.addr, "/doc", target.clone()).await.1);
        }
    }
    shield
        .wait_metric(
            "subscriptions",
            |v| v == 2.0,
            "the restarted shield has both edges back",
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_of_tiers_is_refused_not_hung() {
    // Two proxies naming each other as upstream: the watcher chain carries
    // Via, so the second hop back to the first is refused with 508.
    let a_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let a_addr = a_listener.local_addr().expect("addr");
    drop(a_listener);
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let b = Tier::start(config("tier-b", a_addr, any)).await;
    let a = Tier::start(config("tier-a", b.addr, a_addr)).await;
    // The tier that sees itself in Via refuses (508), and the refusal is
    // relayed back as it was given.
    let response = request(a.addr, "/x", true).await;
    assert_eq!(response.status().as_u16(), 508);
    assert!(b.metric("upstream_requests_total").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_on_one_host_need_no_proxy_ids() {
    // No --proxy-id anywhere: each instance's default id names its port.
    let origin = Origin::default();
    origin.set("/doc", doc(0));
    let origin_addr = origin.start().await;
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let shield = Tier::start(config("", origin_addr, any)).await;
    let edge = Tier::start(config("", shield.addr, any)).await;
    let response = request(edge.addr, "/doc", true).await;
    assert_eq!(response.status().as_u16(), 209, "no 508 between the tiers");
    let (status, body) = plain_get(edge.addr, "/doc").await;
    assert_eq!((status, body.as_str()), (200, doc(0).as_str()));
    // The origin's requests come through both tiers, each named by its port.
    let requests = origin.requests.lock().expect("lock").clone();
    let (_, via) = requests.last().expect("the origin was asked").clone();
    for port in [shield.addr.port(), edge.addr.port()] {
        assert!(
            via.contains(&format!(":{port}")),
            "both default ids in Via: {via}"
        );
    }
    // A proxy pointed at itself is still a loop: 508, not a hang.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let own = listener.local_addr().expect("addr");
    drop(listener);
    let selfie = Tier::start(config("", own, own)).await;
    let (status, _) = plain_get(selfie.addr, "/doc").await;
    assert_eq!(status, 508);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_edge_follows_more_resources_than_one_connection_has_streams_by_default() {
    // hyper's default cap is 200 concurrent streams per HTTP/2 connection;
    // an edge over h2c holds one stream per resource on one connection.
    let origin = Origin::default();
    const RESOURCES: usize = 300;
    for i in 0..RESOURCES {
        origin.set(&format!("/r{i}"), format!("resource {i}\n"));
    }
    let (_, shield, _, edge) = chain(&origin).await;
    let subscribers: Vec<_> = (0..RESOURCES)
        .map(|i| {
            let (addr, path) = (edge.addr, format!("/r{i}"));
            tokio::spawn(async move { follow_held(addr, &path, "e1".to_string()).await })
        })
        .collect();
    let mut held = Vec::new();
    for (i, s) in subscribers.into_iter().enumerate() {
        let (seen, body) = s.await.expect("subscriber");
        assert_eq!(seen.body, format!("resource {i}\n").as_bytes());
        held.push(body);
    }
    assert_eq!(
        edge.metric("upstream_subscriptions").await,
        RESOURCES as f64
    );
    assert_eq!(shield.metric("subscriptions").await, RESOURCES as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_edge_lets_go_of_its_upstream_subscriptions() {
    let origin = Origin::default();
    origin.set("/doc", doc(0));
    let (_, shield, edge_a, _edge_b) = chain(&origin).await;
    let (seen, _held) = follow_held(edge_a.addr, "/doc", "e1".to_string()).await;
    assert!(seen.body == doc(0).as_bytes());
    assert_eq!(shield.metric("subscriptions").await, 1.0);
    edge_a.kill().await;
    shield
        .wait_metric(
            "subscriptions",
            |v| v == 0.0,
            "the stopped edge's subscription ends",
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_an_edge_is_in_the_edges_next_get() {
    let origin = Origin::default();
    origin.set("/doc", doc(0));
    let origin_addr = origin.start().await;
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    // Long poll intervals: only the write-through can make the change known.
    let shield = Tier::start(Config {
        poll_interval: Duration::from_secs(30),
        ..config("shield", origin_addr, any)
    })
    .await;
    let edge = Tier::start(Config {
        poll_interval: Duration::from_secs(30),
        ..config("edge", shield.addr, any)
    })
    .await;
    let seen = follow(edge.addr, "/doc", "e1".to_string()).await;
    assert!(seen.body == doc(0).as_bytes());
    for round in 1..=3 {
        let stream = TcpStream::connect(edge.addr).await.expect("connect");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let put = Request::put("/doc")
            .header("host", "edge")
            .body(Empty::<Bytes>::new())
            .expect("request");
        let response = sender.send_request(put).await.expect("PUT answered");
        assert_eq!(response.status().as_u16(), 204);
        let (status, body) = plain_get(edge.addr, "/doc").await;
        assert_eq!(status, 200);
        let expected = origin.inner.body("/doc").expect("/doc");
        assert_eq!(body.as_bytes(), &expected[..], "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_not_held_up_by_connections_that_sent_no_request() {
    let origin = Origin::default();
    let origin_addr = origin.start().await;
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let proxy = Tier::start(Config {
        shutdown_grace: Duration::from_secs(20),
        header_read_timeout: Duration::from_secs(20),
        ..config("p", origin_addr, any)
    })
    .await;
    let _silent = TcpStream::connect(proxy.addr).await.expect("connect");
    let mut preface_only = TcpStream::connect(proxy.addr).await.expect("connect");
    tokio::io::AsyncWriteExt::write_all(&mut preface_only, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    proxy.kill().await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "shutdown took {:?} with a silent and a preface-only connection open",
        started.elapsed()
    );
}

/// A GET with credentials (so it passes through every tier) whose client
/// reads nothing: its download stalls with the socket buffers full.
async fn stalled_download(
    addr: SocketAddr,
    path: &str,
) -> (
    hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    Response<Incoming>,
) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("receive buffer");
    let stream = socket.connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::get(path)
        .header("host", PUBLIC_HOST)
        .header("authorization", "Bearer x")
        .body(Empty::<Bytes>::new())
        .expect("request");
    let response = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("answered in time")
        .expect("response");
    (sender, response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_downloads_through_an_h2c_edge_do_not_stall_its_subscriptions() {
    let origin = Origin::default();
    origin.set("/doc", doc(0));
    origin.set("/big", vec![b'x'; 16 << 20]);
    let (_, _shield, _, edge) = chain(&origin).await; // this edge uses h2c
    let seen = follow(edge.addr, "/doc", "e1".to_string()).await;
    assert!(seen.body == doc(0).as_bytes());
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stalled_download(edge.addr, "/big").await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let next = origin.set("/doc", doc(1));
    let seen = follow(edge.addr, "/doc", next).await;
    assert!(seen.body == doc(1).as_bytes());
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_content_type_reaches_an_edge_that_subscribed_while_the_resource_was_missing() {
    let origin = Origin::default();
    let (_, shield, edge, _) = chain(&origin).await;
    // The origin answers 404 now: the 209s carry no Content-Type.
    let response = request(edge.addr, "/doc", true).await;
    assert_eq!(response.status().as_u16(), 209);
    let keep = tokio::spawn(async move {
        let mut body = response.into_body();
        while let Some(Ok(_)) = body.frame().await {}
    });
    shield
        .wait_metric(
            "subscriptions",
            |v| v == 1.0,
            "the edge follows the missing resource",
        )
        .await;
    let created = origin.set("/doc", doc(0));
    let _ = follow(edge.addr, "/doc", created).await;
    for tier in [&shield, &edge] {
        let response = request(tier.addr, "/doc", false).await;
        assert_eq!(
            response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("text/plain"),
            "plain GET at {}",
            tier.addr
        );
    }
    keep.abort();
}

/// A subscriber on a raw socket with a small receive buffer, so that when
/// it stops reading the proxy soon finds its socket full. It decodes the
/// chunked 209 body itself and keeps what it saw.
struct RawSubscriber {
    stream: TcpStream,
    /// Received and not yet taken apart (head, chunk framing).
    raw: Vec<u8>,
    head_read: bool,
    decoder: Decoder,
    seen: Seen,
}

impl RawSubscriber {
    async fn open(addr: SocketAddr, path: &str) -> RawSubscriber {
        use tokio::io::AsyncWriteExt;
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
        let mut stream = socket.connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nSubscribe: true\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        RawSubscriber {
            stream,
            raw: Vec::new(),
            head_read: false,
            decoder: Decoder::new(DecodeLimits::default()),
            seen: Seen::default(),
        }
    }

    /// Reads until the subscriber has version `until`; returns how many
    /// updates that took. Checks every update follows the version it had.
    async fn read_until(&mut self, until: &str) -> usize {
        use tokio::io::AsyncReadExt;
        let want = format!("\"{until}\"");
        let mut updates = 0;
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            while let Some(update) = self.decoder.next_update().expect("well-formed update") {
                updates += 1;
                let snapshot = matches!(update.body, braid::Body::Snapshot(_));
                if !snapshot || !update.parents.is_empty() {
                    assert_eq!(update.parents, self.seen.version, "an update out of line");
                }
                self.seen.body = match update.body {
                    braid::Body::Snapshot(b) => b.to_vec(),
                    braid::Body::Patches(p) => {
                        braid::apply_patches(&self.seen.body, &p).expect("patches apply")
                    }
                };
                self.seen.version = update.version;
                self.seen.versions.push(self.seen.version.to_header_value());
                if self.seen.version.to_header_value() == want {
                    return updates;
                }
            }
            let n = tokio::time::timeout_at(deadline, self.stream.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("never reached {until}; saw {:?}", self.seen.versions))
                .expect("read");
            assert!(n > 0, "stream ended before {until}");
            self.raw.extend_from_slice(&buf[..n]);
            self.unchunk();
        }
    }

    /// Moves the complete chunks of `raw` into the decoder.
    fn unchunk(&mut self) {
        if !self.head_read {
            let Some(end) = self.raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                return;
            };
            assert!(self.raw.starts_with(b"HTTP/1.1 209"), "a 209");
            self.raw.drain(..end + 4);
            self.head_read = true;
        }
        loop {
            let Some(eol) = self.raw.windows(2).position(|w| w == b"\r\n") else {
                return;
            };
            let line = std::str::from_utf8(&self.raw[..eol]).expect("chunk size");
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .expect("hex chunk size");
            if self.raw.len() < eol + 2 + size + 2 {
                return;
            }
            self.decoder.push(&self.raw[eol + 2..eol + 2 + size]);
            self.raw.drain(..eol + 2 + size + 2);
        }
    }
}

/// 50,000 bytes in 500 lines, every line different from version to version.
fn big(n: usize) -> String {
    let letter = char::from(b'a' + (n % 26) as u8);
    let line: String = std::iter::repeat_n(letter, 99).collect();
    (0..500).map(|_| format!("{line}\n")).collect()
}

/// Sets `/doc` at the origin and has the shield poll it at once.
async fn change(origin: &Origin, shield: &Tier, body: String) -> String {
    let version = origin.set("/doc", body);
    let response = common::request(shield.admin, "POST", "/refresh?path=/doc", &[]).await;
    assert_eq!(response.status().as_u16(), 202, "refresh hook");
    version
}

/// A shield that only polls when told (the refresh hook), and an edge.
async fn shield_and_edge(origin: &Origin) -> (Tier, Tier) {
    let origin_addr = origin.start().await;
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let shield = Tier::start(Config {
        poll_interval: Duration::from_secs(3600),
        ..config("shield", origin_addr, any)
    })
    .await;
    let edge = Tier::start(config("edge", shield.addr, any)).await;
    (shield, edge)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_readers_at_an_edge_resume_with_at_most_three_updates() {
    let origin = Origin::default();
    origin.set("/doc", big(0));
    let (shield, edge) = shield_and_edge(&origin).await;
    let mut stalled = Vec::new();
    for _ in 0..5 {
        let mut s = RawSubscriber::open(edge.addr, "/doc").await;
        assert_eq!(s.read_until("e1").await, 1);
        stalled.push(s);
    }
    // A reader that keeps up sees every version.
    let (mut keeps_up, mut body) = follow_held(edge.addr, "/doc", "e1".into()).await;
    const UPDATES: usize = 40;
    for n in 1..=UPDATES {
        let version = change(&origin, &shield, big(n)).await;
        assert!(
            tokio::time::timeout(WAIT, read_until(&mut body, &mut keeps_up, &version))
                .await
                .expect("in time"),
            "the reader that keeps up reaches {version}"
        );
    }
    assert_eq!(
        keeps_up.versions.len(),
        UPDATES + 1,
        "every version, in order"
    );
    let last = format!("e{}", UPDATES + 1);
    for mut s in stalled {
        let updates = s.read_until(&last).await;
        assert!(
            updates <= 3,
            "a stalled reader resumed with {updates} updates: {:?}",
            s.seen.versions
        );
        assert_eq!(s.seen.body, big(UPDATES).as_bytes(), "and converged");
    }
    assert!(edge.metric("collapsed_total").await >= 1.0);
}

/// A GET of `/doc` at `addr` naming `Version: version`.
async fn version_get(addr: SocketAddr, version: &str) -> Response<Incoming> {
    common::get(addr, "/doc", &[("host", PUBLIC_HOST), ("version", version)]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_of_the_version_a_subscribed_edge_holds_costs_the_shield_nothing() {
    let origin = Origin::default();
    origin.set("/doc", doc(0));
    let (shield, edge) = shield_and_edge(&origin).await;
    let (_seen, _body) = follow_held(edge.addr, "/doc", "e1".into()).await;
    // The edge asks for the shield's purge feed once (src/purges.rs),
    // after the shield's first answer: counted before, not below.
    edge.wait_following().await;
    let before = shield.metric("requests_total").await;
    for _ in 0..5 {
        let response = version_get(edge.addr, "\"e1\"").await;
        assert_eq!(response.status().as_u16(), 200);
        let status = response.headers()["cache-status"].to_str().expect("text");
        assert!(status.contains("\"edge\"; hit"), "{status}");
        assert_eq!(response.headers()["version"], "\"e1\"");
        assert_eq!(&common::body_of(response).await[..], doc(0).as_bytes());
    }
    assert_eq!(
        shield.metric("requests_total").await,
        before,
        "none at the shield"
    );
    // Another version is not what the edge holds: the shield's to answer.
    let response = version_get(edge.addr, "\"e9\"").await;
    let status = response.headers()["cache-status"].to_str().expect("text");
    assert!(!status.contains("\"edge\"; hit"), "{status}");
    assert!(
        shield.metric("requests_total").await > before,
        "asked the shield"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gets_at_a_subscribed_edge_cost_the_shield_nothing() {
    let origin = Origin::default();
    origin.set("/doc", doc(0));
    let (shield, edge) = shield_and_edge(&origin).await;
    let (mut seen, mut body) = follow_held(edge.addr, "/doc", "e1".into()).await;
    // The edge asks for the shield's purge feed once (src/purges.rs),
    // after the shield's first answer: counted before, not below.
    edge.wait_following().await;
    let before = shield.metric("requests_total").await;
    for _ in 0..20 {
        let response = request(edge.addr, "/doc", false).await;
        assert_eq!(response.status().as_u16(), 200);
        let status = response.headers()["cache-status"].to_str().expect("text");
        assert!(status.contains("\"edge\"; hit"), "{status}");
        assert_eq!(response.headers()["version"], "\"e1\"");
        assert_eq!(response.headers()["content-type"], "text/plain");
        let got = common::body_of(response).await;
        assert_eq!(&got[..], doc(0).as_bytes());
    }
    assert_eq!(
        shield.metric("requests_total").await,
        before,
        "20 GETs at the edge, none at the shield"
    );
    // A change at the origin is in the edge's next GETs within the feed's latency.
    let version = change(&origin, &shield, doc(1)).await;
    assert!(
        tokio::time::timeout(WAIT, read_until(&mut body, &mut seen, &version))
            .await
            .expect("in time")
    );
    let (status, text) = plain_get(edge.addr, "/doc").await;
    assert_eq!((status, text), (200, doc(1)));
    // A write through the edge: its next GET shows it, whatever the feed's pace.
    let response = common::request(edge.addr, "PUT", "/doc", &[]).await;
    assert_eq!(response.status().as_u16(), 204);
    let (_, text) = plain_get(edge.addr, "/doc").await;
    assert_eq!(text, "written by PUT 2\n");
}
