//! The host travels between tiers: origin ← first tier ← edge (← third
//! tier), all on 127.0.0.1:0 in this process. Each tier keys on the host
//! its client asked for and tells the origin with `X-Forwarded-Host`; a
//! tier takes a downstream's `X-Forwarded-Host` only from a peer in
//! `--trusted-downstream` (default: loopback), and overwrites a
//! stranger's (SECURITY.md, "The forwarded host").

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use braid_proxy::braid::{self, DecodeLimits, Decoder};
use braid_proxy::config::Config;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

const WAIT: Duration = Duration::from_secs(10);
const TENANT_A: &str = "tenant-a.example";
const TENANT_B: &str = "tenant-b.example";

/// An origin that answers `host=<the X-Forwarded-Host it got, or Host>`,
/// storable for ten minutes, and logs the `X-Forwarded-Host` of every
/// request (`-` for none).
#[derive(Clone)]
struct Origin {
    addr: SocketAddr,
    forwarded_hosts: Arc<Mutex<Vec<String>>>,
}

impl Origin {
    async fn start() -> Origin {
        let forwarded_hosts: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = forwarded_hosts.clone();
        let addr = common::serve(move |req: Request<Incoming>| {
            let header = |name: &str| common::header_text(req.headers(), name);
            let forwarded = header("x-forwarded-host");
            log.lock()
                .expect("lock")
                .push(forwarded.clone().unwrap_or_else(|| "-".into()));
            let host = forwarded.or_else(|| header("host")).unwrap_or_default();
            let etag = format!("\"{host}\"");
            if header("if-none-match").as_deref() == Some(etag.as_str()) {
                return Response::builder()
                    .status(304)
                    .header("etag", etag)
                    .body(Full::new(Bytes::new()))
                    .expect("response");
            }
            Response::builder()
                .header("content-type", "text/plain")
                .header("cache-control", "max-age=600")
                .header("etag", etag)
                .body(Full::new(Bytes::from(format!("host={host}"))))
                .expect("response")
        })
        .await;
        Origin {
            addr,
            forwarded_hosts,
        }
    }

    /// The distinct `X-Forwarded-Host` values the origin has seen, sorted.
    fn saw(&self) -> Vec<String> {
        let mut seen = self.forwarded_hosts.lock().expect("lock").clone();
        seen.sort();
        seen.dedup();
        seen
    }
}

/// Starts a tier in front of `upstream` (another tier or the origin),
/// polling a plain origin every 200 ms; `tune` adjusts its configuration.
async fn tier(id: &str, upstream: SocketAddr, tune: impl FnOnce(&mut Config)) -> SocketAddr {
    let (addr, _admin) = common::proxy_for(upstream, |c| {
        c.poll_interval = Duration::from_millis(200);
        c.heartbeat = Duration::ZERO;
        c.proxy_id = id.to_string();
        tune(c);
    })
    .await;
    addr
}

/// Trusts only 10.0.0.0/8: the loopback peers of these tests are strangers.
fn distrust_loopback(c: &mut Config) {
    c.set("trusted-downstream", "10.0.0.0/8")
        .expect("an address range");
}

/// origin ← first ← edge, every tier with its default trust (loopback).
async fn two_tiers() -> (Origin, SocketAddr) {
    let origin = Origin::start().await;
    let first = tier("first", origin.addr, |_| {}).await;
    let edge = tier("edge", first, |_| {}).await;
    (origin, edge)
}

/// Sends a GET to `addr` on a new connection with `Host: host` and
/// `extra` headers, bounded in time.
async fn send(
    addr: SocketAddr,
    path: &str,
    host: &str,
    extra: &[(&str, &str)],
) -> Response<Incoming> {
    let mut headers = vec![("host", host)];
    headers.extend_from_slice(extra);
    common::get(addr, path, &headers).await
}

/// The status and body of a GET of `path` at `addr` for `host`.
async fn get(addr: SocketAddr, path: &str, host: &str, extra: &[(&str, &str)]) -> (u16, String) {
    let response = send(addr, path, host, extra).await;
    let status = response.status().as_u16();
    let body = tokio::time::timeout(WAIT, common::body_of(response))
        .await
        .expect("body in time");
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Subscribes to `path` at `addr` for `host`; the body of the first update.
async fn first_update(addr: SocketAddr, path: &str, host: &str) -> String {
    let response = send(addr, path, host, &[("subscribe", "true")]).await;
    assert_eq!(response.status().as_u16(), 209, "subscription of {host}");
    let mut body = response.into_body();
    let mut decoder = Decoder::new(DecodeLimits::default());
    let update = tokio::time::timeout(WAIT, async {
        loop {
            if let Some(update) = decoder.next_update().expect("well-formed update") {
                return update;
            }
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        decoder.push(&data);
                    }
                }
                other => panic!("the stream of {host} ended before an update: {other:?}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no update for {host} in time"));
    let bytes = match update.body {
        braid::Body::Snapshot(b) => b.to_vec(),
        braid::Body::Patches(p) => braid::apply_patches(b"", &p).expect("patches apply"),
    };
    String::from_utf8_lossy(&bytes).into_owned()
}

fn body_for(host: &str) -> String {
    format!("host={host}")
}

#[tokio::test]
async fn each_tenant_gets_its_own_answer_through_two_tiers_one_after_another() {
    let (origin, edge) = two_tiers().await;
    for round in 0..2 {
        for host in [TENANT_A, TENANT_B] {
            let (status, body) = get(edge, "/doc", host, &[]).await;
            assert_eq!(status, 200, "round {round}, {host}");
            assert_eq!(
                body,
                body_for(host),
                "round {round}: {host} got another view"
            );
        }
    }
    assert_eq!(origin.saw(), [TENANT_A, TENANT_B], "hosts the origin saw");
}

#[tokio::test]
async fn each_tenant_gets_its_own_answer_through_two_tiers_at_once() {
    let (origin, edge) = two_tiers().await;
    for round in 0..3 {
        let path = format!("/doc{round}");
        let (a, b) = tokio::join!(
            get(edge, &path, TENANT_A, &[]),
            get(edge, &path, TENANT_B, &[])
        );
        assert_eq!(a, (200, body_for(TENANT_A)), "round {round}");
        assert_eq!(b, (200, body_for(TENANT_B)), "round {round}");
    }
    assert_eq!(origin.saw(), [TENANT_A, TENANT_B], "hosts the origin saw");
}

#[tokio::test]
async fn each_tenants_subscription_follows_its_own_view_through_two_tiers() {
    let (origin, edge) = two_tiers().await;
    let (a, b) = tokio::join!(
        first_update(edge, "/live", TENANT_A),
        first_update(edge, "/live", TENANT_B)
    );
    assert_eq!(a, body_for(TENANT_A));
    assert_eq!(b, body_for(TENANT_B));
    // One after another too: a second subscriber of each joins its own.
    for host in [TENANT_B, TENANT_A] {
        assert_eq!(first_update(edge, "/live", host).await, body_for(host));
    }
    assert_eq!(origin.saw(), [TENANT_A, TENANT_B], "hosts the origin saw");
}

#[tokio::test]
async fn each_tenant_gets_its_own_answer_through_three_tiers() {
    let origin = Origin::start().await;
    let first = tier("first", origin.addr, |_| {}).await;
    // Subscriptions between tiers over h2c, as deployed (docs/tiers.md).
    let edge = tier("edge", first, |c| c.upstream_h2c = true).await;
    let third = tier("third", edge, |c| c.upstream_h2c = true).await;
    for host in [TENANT_A, TENANT_B] {
        assert_eq!(get(third, "/doc", host, &[]).await, (200, body_for(host)));
    }
    let (a, b) = tokio::join!(
        first_update(third, "/live", TENANT_A),
        first_update(third, "/live", TENANT_B)
    );
    assert_eq!(a, body_for(TENANT_A));
    assert_eq!(b, body_for(TENANT_B));
    assert_eq!(origin.saw(), [TENANT_A, TENANT_B], "hosts the origin saw");
}

#[tokio::test]
async fn an_untrusted_clients_forwarded_host_is_overwritten() {
    let origin = Origin::start().await;
    let first = tier("first", origin.addr, distrust_loopback).await;
    let forged = [("x-forwarded-host", TENANT_B)];
    assert_eq!(
        get(first, "/doc", TENANT_A, &forged).await,
        (200, body_for(TENANT_A))
    );
    let update = first_update(first, "/live", TENANT_A).await;
    assert_eq!(update, body_for(TENANT_A));
    assert_eq!(origin.saw(), [TENANT_A], "hosts the origin saw");
}

#[tokio::test]
async fn an_edge_overwrites_an_untrusted_clients_forwarded_host_and_the_first_tier_keeps_it() {
    let origin = Origin::start().await;
    let first = tier("first", origin.addr, |_| {}).await;
    let edge = tier("edge", first, distrust_loopback).await;
    let forged = [("x-forwarded-host", TENANT_B)];
    assert_eq!(
        get(edge, "/doc", TENANT_A, &forged).await,
        (200, body_for(TENANT_A))
    );
    assert_eq!(
        get(edge, "/doc", TENANT_B, &[]).await,
        (200, body_for(TENANT_B))
    );
    assert_eq!(origin.saw(), [TENANT_A, TENANT_B], "hosts the origin saw");
}

#[tokio::test]
async fn a_trusted_peers_first_forwarded_host_counts_and_a_malformed_one_is_refused() {
    let origin = Origin::start().await;
    let first = tier("first", origin.addr, |_| {}).await;
    let listed = [("x-forwarded-host", "tenant-a.example, tenant-b.example")];
    assert_eq!(
        get(first, "/doc", "127.0.0.1", &listed).await,
        (200, body_for(TENANT_A))
    );
    for bad in [
        "a b",
        "tenant-a.example/x",
        "user@tenant-a.example",
        "h:port",
        "",
    ] {
        let (status, body) = get(first, "/doc", "127.0.0.1", &[("x-forwarded-host", bad)]).await;
        assert_eq!(status, 400, "X-Forwarded-Host {bad:?}: {body}");
    }
    assert_eq!(origin.saw(), [TENANT_A], "hosts the origin saw");
}

/// Forwarding claims a client may write, each with a value no proxy on
/// the way would set, and the header it was written in.
const CLAIMS: &[(&str, &str)] = &[
    ("forwarded", "for=6.6.6.6;host=evil.example;proto=https"),
    ("x-forwarded-for", "6.6.6.6"),
    ("x-forwarded-proto", "https"),
    ("x-forwarded-port", "6666"),
    ("x-forwarded-scheme", "https"),
    ("x-forwarded-server", "evil.example"),
    ("x-forwarded-prefix", "/evil"),
    ("x-forwarded-ssl", "on"),
    ("x-real-ip", "6.6.6.6"),
    ("x-host", "evil.example"),
    ("x-original-host", "evil.example"),
    ("x-original-url", "/evil"),
];

/// The headers of one request (lowercase name, value), in order.
type Headers = Vec<(String, String)>;

/// An origin that records the headers of every request it answers, and
/// answers `ok`, storable for ten minutes.
async fn header_recording_origin() -> (SocketAddr, Arc<Mutex<Vec<Headers>>>) {
    let seen: Arc<Mutex<Vec<Headers>>> = Arc::default();
    let log = seen.clone();
    let addr = common::serve(move |req: Request<Incoming>| {
        let headers = req
            .headers()
            .iter()
            .map(|(n, v)| {
                let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
                (n.as_str().to_string(), v)
            })
            .collect();
        log.lock().expect("lock").push(headers);
        Response::builder()
            .header("content-type", "text/plain")
            .header("cache-control", "max-age=600")
            .header("etag", "\"ok\"")
            .body(Full::new(Bytes::from_static(b"ok")))
            .expect("response")
    })
    .await;
    (addr, seen)
}

/// The values of `name` in one recorded request.
fn values<'a>(request: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    request
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

#[tokio::test]
async fn a_strangers_forwarding_claims_never_reach_the_origin() {
    let (origin, seen) = header_recording_origin().await;
    let first = tier("first", origin, distrust_loopback).await;
    assert_eq!(get(first, "/doc", TENANT_A, CLAIMS).await.0, 200);
    // A subscription's watcher asks under the client's headers too.
    let mut subscribing = CLAIMS.to_vec();
    subscribing.push(("subscribe", "true"));
    let response = send(first, "/live", TENANT_A, &subscribing).await;
    assert_eq!(response.status().as_u16(), 209);
    drop(response);
    let seen = seen.lock().expect("lock").clone();
    assert!(
        seen.len() >= 2,
        "{} requests reached the origin",
        seen.len()
    );
    for request in &seen {
        for (name, forged) in CLAIMS {
            assert!(
                !values(request, name).contains(forged),
                "{name}: {forged} reached the origin: {request:?}"
            );
        }
        let text = format!("{request:?}");
        for forged in ["6.6.6.6", "evil", "6666"] {
            assert!(
                !text.contains(forged),
                "{forged} reached the origin: {text}"
            );
        }
        // What the proxy knows itself, instead.
        assert_eq!(values(request, "x-forwarded-for"), ["127.0.0.1"]);
        assert_eq!(values(request, "x-forwarded-proto"), ["http"]);
        assert_eq!(values(request, "x-forwarded-host"), [TENANT_A]);
    }
}

#[tokio::test]
async fn a_trusted_peers_forwarding_claims_pass() {
    let (origin, seen) = header_recording_origin().await;
    let first = tier("first", origin, |_| {}).await;
    assert_eq!(get(first, "/doc", TENANT_A, CLAIMS).await.0, 200);
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let request = &seen[0];
    for (name, written) in CLAIMS {
        let expected = match *name {
            // The trusted peer is appended to the list it sent.
            "x-forwarded-for" => "6.6.6.6, 127.0.0.1",
            _ => written,
        };
        assert_eq!(values(request, name), [expected], "{name}: {request:?}");
    }
}

#[tokio::test]
async fn userinfo_in_the_authority_is_refused_and_never_forwarded() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let (origin, seen) = header_recording_origin().await;
    let first = tier("first", origin, |_| {}).await;
    // HTTP/1.1: an absolute-form target naming this proxy, and a Host.
    for request in [
        format!(
            "GET http://user:pw@{first}/doc HTTP/1.1\r\nHost: {first}\r\nConnection: close\r\n\r\n"
        ),
        "GET /doc HTTP/1.1\r\nHost: user:pw@tenant-a.example\r\nConnection: close\r\n\r\n"
            .to_string(),
    ] {
        let answer = common::exchange(first, request.clone()).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{request:?}: {answer}");
        assert!(answer.contains("userinfo"), "the reason: {answer}");
    }
    // HTTP/2: `:authority`.
    let stream = tokio::net::TcpStream::connect(first)
        .await
        .expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2c handshake");
    tokio::spawn(conn);
    let req = Request::builder()
        .uri(format!("http://user:pw@{TENANT_A}/doc"))
        .body(http_body_util::Empty::<Bytes>::new())
        .expect("request");
    let response = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("answered in time")
        .expect("response");
    assert_eq!(response.status().as_u16(), 400);
    let seen = seen.lock().expect("lock").clone();
    assert!(
        !format!("{seen:?}").contains('@'),
        "userinfo reached the origin: {seen:?}"
    );
}
