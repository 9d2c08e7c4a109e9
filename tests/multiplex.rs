//! braid-http's multiplexing served by the proxy, against a real origin on
//! 127.0.0.1:0: many subscriptions in one stream with one watcher, requests
//! that arrive before their multiplexer, 409/424, DELETE, CORS, bounds, and
//! a stalled multiplexer that gets collapsed updates instead of a queue.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use common::origin::Origin;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

/// Sends one request on a fresh connection.
async fn send(addr: SocketAddr, req: Request<Full<Bytes>>) -> Response<Incoming> {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    timeout(WAIT, sender.send_request(req))
        .await
        .expect("answer in time")
        .expect("answer")
}

fn request(method: &str, path: &str, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "proxy.test");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::new())).expect("request")
}

/// A request with `Multiplex-Version: 1.0`, as every multiplexer request has.
fn versioned(method: &str, path: &str) -> Request<Full<Bytes>> {
    request(method, path, &[("multiplex-version", "1.0")])
}

fn through(mux: &str, rid: &str, path: &str) -> Request<Full<Bytes>> {
    let value = format!("/.well-known/multiplexer/{mux}/{rid}");
    request(
        "GET",
        path,
        &[
            ("subscribe", "true"),
            ("multiplex-version", "1.0"),
            ("multiplex-through", &value),
        ],
    )
}

async fn open(addr: SocketAddr, mux: &str) -> Mux {
    let path = format!("/.well-known/multiplexer/{mux}");
    let response = send(addr, versioned("POST", &path)).await;
    assert_eq!(response.status(), 200);
    let h = response.headers();
    assert_eq!(h["multiplex-version"], "1.0");
    assert_eq!(h["cache-control"], "no-store");
    assert_eq!(h["incremental"], "?1");
    Mux {
        body: response.into_body(),
        buf: BytesMut::new(),
        texts: HashMap::new(),
        closed: Vec::new(),
    }
}

/// The reading side of a multiplexer: every request's bytes, in order.
struct Mux {
    body: Incoming,
    buf: BytesMut,
    texts: HashMap<String, String>,
    closed: Vec<String>,
}

impl Mux {
    /// Parses whatever whole frames are buffered; false when more is needed.
    fn parse_one(&mut self) -> bool {
        let start = self
            .buf
            .iter()
            .position(|b| *b != b'\r' && *b != b'\n')
            .unwrap_or(self.buf.len());
        let Some(nl) = self.buf[start..].iter().position(|b| *b == b'\n') else {
            return false;
        };
        let line = String::from_utf8_lossy(&self.buf[start..start + nl + 1]).to_string();
        let words: Vec<&str> = line.trim_end().split(' ').collect();
        match words.as_slice() {
            ["start", "response", rid] => {
                self.texts.entry(rid.to_string()).or_default();
                self.buf.advance(start + nl + 1);
            }
            ["close", "response", rid] => {
                self.closed.push(rid.to_string());
                self.buf.advance(start + nl + 1);
            }
            [n, "bytes", "for", "response", rid] => {
                let n: usize = n.parse().expect("length");
                if self.buf.len() < start + nl + 1 + n {
                    return false;
                }
                self.buf.advance(start + nl + 1);
                let data = self.buf.split_to(n);
                self.texts
                    .entry(rid.to_string())
                    .or_default()
                    .push_str(&String::from_utf8_lossy(&data));
            }
            _ => panic!("not a multiplexer frame: {line:?}"),
        }
        true
    }

    /// Reads until `done` holds, or fails after the timeout.
    async fn until(&mut self, what: &str, done: impl Fn(&Mux) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            while self.parse_one() {}
            if done(self) {
                return;
            }
            let frame = tokio::time::timeout_at(deadline, self.body.frame())
                .await
                .unwrap_or_else(|_| panic!("timed out waiting for {what}; got {:?}", self.texts))
                .unwrap_or_else(|| panic!("multiplexer ended waiting for {what}"))
                .expect("frame");
            if let Ok(data) = frame.into_data() {
                self.buf.extend_from_slice(&data);
            }
        }
    }

    /// Reads until the body ends; true when it did within the timeout.
    async fn ends(&mut self) -> bool {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.body.frame()).await {
                Err(_) => return false,
                Ok(None) | Ok(Some(Err(_))) => return true,
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// An origin holding `body` at `path`, and a proxy in front of it.
async fn setup(path: &str, body: impl Into<Bytes>) -> (Origin, SocketAddr, SocketAddr) {
    let origin = Origin::default();
    origin.set(path, body);
    let (addr, admin) = common::proxy_for(origin.start().await, |_| {}).await;
    (origin, addr, admin)
}

async fn refresh(admin: SocketAddr, path: &str) {
    let response = send(
        admin,
        request("POST", &format!("/refresh?path={path}"), &[]),
    )
    .await;
    assert!(
        response.status().is_success(),
        "refresh: {}",
        response.status()
    );
}

async fn expect_293(addr: SocketAddr, req: Request<Full<Bytes>>) {
    let wanted = req.headers()["multiplex-through"].clone();
    let response = send(addr, req).await;
    assert_eq!(response.status(), 293);
    let h = response.headers();
    assert_eq!(h["multiplex-version"], "1.0");
    assert_eq!(h["multiplex-through"], wanted);
    assert_eq!(h["cache-control"], "no-store");
}

#[tokio::test]
async fn a_dozen_subscriptions_share_one_stream_and_one_watcher() {
    let (origin, addr, admin) = setup("/doc", "version one").await;
    let mut mux = open(addr, "m12").await;
    for i in 0..12 {
        expect_293(addr, through("m12", &format!("r{i}"), "/doc")).await;
    }
    mux.until("twelve snapshots", |m| {
        (0..12).all(|i| {
            m.texts.get(&format!("r{i}")).is_some_and(|t| {
                t.starts_with("HTTP/1.1 209 Subscription\r\n") && t.contains("version one")
            })
        })
    })
    .await;
    let before = origin.gets.load(Ordering::SeqCst);
    assert!(before <= 2, "one fetch seeds the state: {before} GETs");
    origin.set("/doc", "version two");
    refresh(admin, "/doc").await;
    mux.until("twelve patches", |m| {
        (0..12).all(|i| {
            m.texts
                .get(&format!("r{i}"))
                .is_some_and(|t| t.contains("Version: \"e2\"\r\nParents: \"e1\""))
        })
    })
    .await;
    let spent = origin.gets.load(Ordering::SeqCst) - before;
    assert!(
        spent <= 2,
        "one watcher for twelve subscribers: {spent} GETs"
    );
}

#[tokio::test]
async fn a_request_that_comes_before_its_multiplexer_is_held() {
    let (_, addr, _) = setup("/doc", "early").await;
    let early = tokio::spawn(async move { send(addr, through("late", "r1", "/doc")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut mux = open(addr, "late").await;
    let answer = early.await.expect("task");
    assert_eq!(answer.status(), 293);
    mux.until("the early request's snapshot", |m| {
        m.texts.get("r1").is_some_and(|t| t.contains("early"))
    })
    .await;
}

#[tokio::test]
async fn unknown_multiplexers_are_424_and_duplicates_409() {
    let (_, addr, _) = setup("/doc", "x").await;
    let started = std::time::Instant::now();
    let answer = send(addr, through("nowhere", "r1", "/doc")).await;
    assert_eq!(answer.status(), 424);
    assert_eq!(answer.headers()["bad-multiplexer"], "nowhere");
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "held first"
    );

    let _mux = open(addr, "dup").await;
    let again = send(addr, versioned("POST", "/.well-known/multiplexer/dup")).await;
    assert_eq!(again.status(), 409);
    let body = again.into_body().collect().await.expect("body").to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(json["error"], "Multiplexer already exists");

    expect_293(addr, through("dup", "same", "/doc")).await;
    let twice = send(addr, through("dup", "same", "/doc")).await;
    assert_eq!(twice.status(), 409);
    let body = twice.into_body().collect().await.expect("body").to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(json["error"], "Request already multiplexed");

    // The MULTIPLEX method creates one too, and the same id is taken.
    let method = send(addr, versioned("MULTIPLEX", "/dup")).await;
    assert_eq!(method.status(), 409);
    let fresh = send(addr, versioned("MULTIPLEX", "/viamethod")).await;
    assert_eq!(fresh.status(), 200);
    assert_eq!(fresh.headers()["multiplex-version"], "1.0");
}

#[tokio::test]
async fn delete_ends_a_request_then_the_multiplexer() {
    let (_, addr, _) = setup("/doc", "x").await;
    let mut mux = open(addr, "del").await;
    expect_293(addr, through("del", "a", "/doc")).await;
    // An absolute URL in Multiplex-Through names the same multiplexer.
    let absolute = request(
        "GET",
        "/doc",
        &[
            ("subscribe", "true"),
            ("multiplex-version", "1.0"),
            (
                "multiplex-through",
                "http://proxy.test/.well-known/multiplexer/del/b",
            ),
        ],
    );
    assert_eq!(send(addr, absolute).await.status(), 293);
    mux.until("both snapshots", |m| {
        m.texts.contains_key("a") && m.texts.get("b").is_some_and(|t| t.contains("x"))
    })
    .await;

    let gone = send(addr, versioned("DELETE", "/.well-known/multiplexer/del/a")).await;
    assert_eq!(gone.status(), 200);
    assert_eq!(gone.headers()["multiplex-version"], "1.0");
    let unknown = send(addr, versioned("DELETE", "/.well-known/multiplexer/del/a")).await;
    assert_eq!(unknown.status(), 404);
    assert_eq!(unknown.headers()["bad-request"], "a");

    let whole = send(addr, versioned("DELETE", "/.well-known/multiplexer/del")).await;
    assert_eq!(whole.status(), 200);
    assert!(mux.ends().await, "the multiplexer's stream ends");
    let missing = send(addr, versioned("DELETE", "/.well-known/multiplexer/del/b")).await;
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.headers()["bad-multiplexer"], "del");
}

#[tokio::test]
async fn a_plain_get_travels_whole_and_closes() {
    let (_, addr, _) = setup("/plain", "plain body").await;
    let mut mux = open(addr, "plain").await;
    let req = request(
        "GET",
        "/plain",
        &[
            ("multiplex-version", "1.0"),
            ("multiplex-through", "/.well-known/multiplexer/plain/p"),
        ],
    );
    expect_293(addr, req).await;
    mux.until("the whole answer and its close", |m| {
        m.closed.iter().any(|c| c == "p")
    })
    .await;
    let text = &mux.texts["p"];
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("content-length: 10\r\n"), "{text}");
    assert!(text.ends_with("\r\n\r\nplain body"), "{text}");
}

#[tokio::test]
async fn malformed_and_over_bound_requests_are_refused() {
    let origin = Origin::default();
    let (addr, _) = common::proxy_for(origin.start().await, |_| {}).await;
    let no_version = send(addr, request("POST", "/.well-known/multiplexer/x", &[])).await;
    assert_eq!(no_version.status(), 400);
    let long = format!("/.well-known/multiplexer/{}", "a".repeat(65));
    let too_long = send(addr, versioned("POST", &long)).await;
    assert_eq!(too_long.status(), 400);
    let odd = send(addr, versioned("POST", "/.well-known/multiplexer/a.b")).await;
    assert_eq!(odd.status(), 400);
    let body = odd.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body.iter().filter(|b| **b == b'\n').count(), 1, "one line");
}

#[tokio::test]
async fn the_configured_bounds_give_503s_with_retry_after() {
    let origin = Origin::default();
    origin.set("/doc", "one");
    let (addr, _) = common::proxy_for(origin.start().await, |c| {
        c.max_multiplexers = 1;
        c.max_multiplexed_requests = 1;
    })
    .await;
    let _first = open(addr, "first").await;
    let second = send(addr, versioned("POST", "/.well-known/multiplexer/second")).await;
    assert_eq!(second.status(), 503, "one multiplexer at most");
    assert!(second.headers().contains_key("retry-after"));
    expect_293(addr, through("first", "r1", "/doc")).await;
    let full = send(addr, through("first", "r2", "/doc")).await;
    assert_eq!(full.status(), 503, "one request per multiplexer at most");
    assert!(full.headers().contains_key("retry-after"));
    let body = full.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body.iter().filter(|b| **b == b'\n').count(), 1, "one line");
}

#[tokio::test]
async fn preflights_allow_the_multiplexing_methods_and_headers() {
    let origin = Origin::default();
    let (addr, _) = common::proxy_for(origin.start().await, |c| {
        c.cors_origins = vec!["http://page.test".into()]
    })
    .await;
    let preflight = send(
        addr,
        request(
            "OPTIONS",
            "/.well-known/multiplexer/c",
            &[
                ("origin", "http://page.test"),
                ("access-control-request-method", "MULTIPLEX"),
                (
                    "access-control-request-headers",
                    "multiplex-version, multiplex-through",
                ),
            ],
        ),
    )
    .await;
    assert_eq!(preflight.status(), 204);
    let h = preflight.headers();
    let methods = h["access-control-allow-methods"].to_str().expect("ascii");
    for m in ["POST", "DELETE", "MULTIPLEX"] {
        assert!(methods.contains(m), "{methods}");
    }
    let allowed = h["access-control-allow-headers"].to_str().expect("ascii");
    assert!(allowed.contains("Multiplex-Through") && allowed.contains("Multiplex-Version"));
    let created = send(
        addr,
        request(
            "POST",
            "/.well-known/multiplexer/c",
            &[("origin", "http://page.test"), ("multiplex-version", "1.0")],
        ),
    )
    .await;
    let exposed = created.headers()["access-control-expose-headers"]
        .to_str()
        .expect("ascii");
    assert!(exposed.contains("Multiplex-Version"), "{exposed}");
}

/// A multiplexer whose reader stops holds no queue: while it is stalled
/// the proxy stops polling its subscriptions, and when it reads again each
/// gets the newest state in far fewer updates than there were changes.
#[tokio::test]
async fn a_stalled_multiplexer_gets_collapsed_updates() {
    const CHANGES: usize = 12;
    let origin = Origin::default();
    let doc = |n: usize| -> Bytes {
        let c = b'a' + (n % 26) as u8;
        let mut body = vec![c; 256 * 1024];
        body.extend_from_slice(format!("end{n}").as_bytes());
        Bytes::from(body)
    };
    origin.set("/big", doc(0));
    let (addr, admin) = common::proxy_for(origin.start().await, |c| {
        c.max_body_bytes = 4 * 1024 * 1024;
    })
    .await;
    let mut mux = open(addr, "slow").await;
    for rid in ["s0", "s1", "s2"] {
        expect_293(addr, through("slow", rid, "/big")).await;
    }
    mux.until("first snapshots", |m| {
        ["s0", "s1", "s2"]
            .iter()
            .all(|r| m.texts.get(*r).is_some_and(|t| t.contains("end0")))
    })
    .await;
    // Not reading now: every change is 256 KiB, far more than the socket
    // buffers hold.
    for n in 1..=CHANGES {
        origin.set("/big", doc(n));
        refresh(admin, "/big").await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let last = format!("Version: \"e{}\"", CHANGES + 1);
    mux.until("the newest state everywhere", |m| {
        ["s0", "s1", "s2"]
            .iter()
            .all(|r| m.texts.get(*r).is_some_and(|t| t.contains(&last)))
    })
    .await;
    for rid in ["s0", "s1", "s2"] {
        let updates = mux.texts[rid].matches("Version: \"").count();
        assert!(
            updates < CHANGES,
            "{rid}: {updates} updates for {CHANGES} changes: not collapsed"
        );
    }
}

/// A plain GET through multiplexer `mux` as request `rid`.
fn plain_through(mux: &str, rid: &str, path: &str) -> Request<Full<Bytes>> {
    let value = format!("/.well-known/multiplexer/{mux}/{rid}");
    request(
        "GET",
        path,
        &[("multiplex-version", "1.0"), ("multiplex-through", &value)],
    )
}

/// braid-http's client takes a response that says nothing of multiplexing
/// as is (a 500 from before the server's multiplexing code, "random 500
/// error while multiplexing"), and reports a 293 with another
/// Multiplex-Version as a protocol error ("failing to establish multiplexed
/// request because of version"). So a 5xx and an upstream's own 293 are
/// answered directly, as the upstream gave them, not wrapped in the stream;
/// the request id stays free for the client's next try.
#[tokio::test]
async fn upstream_errors_and_an_upstream_293_are_answered_directly() {
    let origin = common::serve(|req| {
        let (status, extra, body) = match req.uri().path() {
            "/boom" => (500, None, ""),
            "/odd" => (293, Some(("multiplex-version", "wrong")), "ok"),
            _ => (200, None, "fine"),
        };
        let mut b = Response::builder().status(status);
        if let Some((k, v)) = extra {
            b = b.header(k, v);
        }
        b.body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("response")
    })
    .await;
    let (addr, _) = common::proxy_for(origin, |_| {}).await;
    let mut mux = open(addr, "direct").await;

    let boom = send(addr, plain_through("direct", "r", "/boom")).await;
    assert_eq!(boom.status(), 500);
    assert!(boom.headers().get("multiplex-version").is_none());
    assert!(boom.headers().get("multiplex-through").is_none());

    let odd = send(addr, plain_through("direct", "r", "/odd")).await;
    assert_eq!(odd.status(), 293);
    assert_eq!(odd.headers()["multiplex-version"], "wrong");
    assert_eq!(common::body_of(odd).await, "ok");

    // The id was never taken: the same request id is multiplexed now, and
    // the first response the stream carries is this one.
    expect_293(addr, plain_through("direct", "r", "/fine")).await;
    mux.until("the fine answer", |m| m.closed.iter().any(|c| c == "r"))
        .await;
    let text = &mux.texts["r"];
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.ends_with("\r\n\r\nfine"), "{text}");
    assert_eq!(mux.texts.len(), 1, "nothing else went into the stream");
}

/// `--multiplex relay`: the upstream's own multiplexer serves the client.
/// Creating, multiplexed requests (with their headers) and DELETEs all
/// reach the upstream as the client sent them, and its answers (a 293, its
/// multiplexer's stream, its 409) come back as it gave them.
#[tokio::test]
async fn relay_mode_passes_multiplexing_to_the_upstream() {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log = seen.clone();
    let origin = common::serve(move |req| {
        let through = req
            .headers()
            .get("multiplex-through")
            .map(|v| v.to_str().unwrap_or("?").to_string());
        log.lock().unwrap().push(format!(
            "{} {} {}",
            req.method(),
            req.uri().path(),
            through.as_deref().unwrap_or("-")
        ));
        let (status, body) = match (req.method().as_str(), through) {
            ("POST", _) if req.uri().path().ends_with("/taken") => (409, "taken upstream"),
            ("POST", _) => (200, "\r\nstart response r1\r\n"),
            (_, Some(_)) => (293, "Ok."),
            _ => (200, "deleted"),
        };
        Response::builder()
            .status(status)
            .header("multiplex-version", "1.0")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("response")
    })
    .await;
    let (addr, _) = common::proxy_for(origin, |c| {
        c.multiplex = braid_proxy::config::MultiplexMode::Relay;
    })
    .await;

    let created = send(addr, versioned("POST", "/.well-known/multiplexer/m1")).await;
    assert_eq!(created.status(), 200);
    assert_eq!(
        common::body_of(created).await,
        "\r\nstart response r1\r\n",
        "the upstream's multiplexer stream, as it sent it"
    );
    let taken = send(addr, versioned("POST", "/.well-known/multiplexer/taken")).await;
    assert_eq!(taken.status(), 409);
    assert_eq!(common::body_of(taken).await, "taken upstream");
    let answered = send(addr, through("m1", "r1", "/doc")).await;
    assert_eq!(answered.status(), 293);
    assert_eq!(answered.headers()["multiplex-version"], "1.0");
    let deleted = send(addr, versioned("DELETE", "/.well-known/multiplexer/m1/r1")).await;
    assert_eq!(deleted.status(), 200);

    assert_eq!(
        *seen.lock().unwrap(),
        [
            "POST /.well-known/multiplexer/m1 -",
            "POST /.well-known/multiplexer/taken -",
            "GET /doc /.well-known/multiplexer/m1/r1",
            "DELETE /.well-known/multiplexer/m1/r1 -",
        ]
    );
}
