//! The proxy as a faithful HTTP intermediary (RFC 9110/9111), over real
//! sockets on 127.0.0.1:0: what it answers from shared state is what the
//! origin said, only where a shared cache may reuse it, and never another
//! credential's or variant's view.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use braid_proxy::config::{Config, Upstream};
use braid_proxy::listen::server::Server;
use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(5);

/// What the origin saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    path: String,
    headers: HeaderMap,
}

type Answer = dyn Fn(&Request<Incoming>, usize) -> Response<Full<Bytes>> + Send + Sync;

/// An origin whose answers a test chooses, logging every request.
#[derive(Clone)]
struct Origin {
    seen: Arc<Mutex<Vec<Seen>>>,
    addr: SocketAddr,
}

impl Origin {
    async fn start(
        answer: impl Fn(&Request<Incoming>, usize) -> Response<Full<Bytes>> + Send + Sync + 'static,
    ) -> Origin {
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let log = seen.clone();
        let answer: Arc<Answer> = Arc::new(answer);
        let addr = common::serve(move |req| {
            let n = {
                let mut log = log.lock().expect("lock");
                log.push(Seen {
                    method: req.method().to_string(),
                    path: req.uri().path().to_string(),
                    headers: req.headers().clone(),
                });
                log.len()
            };
            answer(&req, n)
        })
        .await;
        Origin { seen, addr }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    fn count(&self) -> usize {
        self.seen.lock().expect("lock").len()
    }
}

fn respond(headers: &[(&str, &str)], body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut b = Response::builder();
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(body.into())).expect("response")
}

fn header<'a>(req: &'a Request<Incoming>, name: &str) -> &'a str {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

struct Proxy {
    addr: SocketAddr,
    admin: SocketAddr,
}

async fn proxy(origin: &Origin, tune: impl FnOnce(&mut Config)) -> Proxy {
    let mut config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
        upstream: Some(Upstream::parse(&format!("http://{}", origin.addr)).expect("upstream")),
        poll_interval: Duration::from_millis(100),
        proxy_id: "faithful".into(),
        ..Config::default()
    };
    tune(&mut config);
    let server = Server::bind(config).await.expect("bind proxy");
    let addr = server.local_addr().expect("addr");
    let admin = server.admin_addr().expect("admin addr");
    tokio::spawn(server.run(std::future::pending()));
    Proxy { addr, admin }
}

/// One request with `Connection: close`; the whole answer as text.
async fn send(addr: SocketAddr, method: &str, path: &str, extra: &[(&str, &str)]) -> String {
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nHost: site.test\r\nConnection: close\r\n");
    for (k, v) in extra {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut out))
        .await
        .expect("answer within the wait")
        .expect("read");
    String::from_utf8_lossy(&out).to_lowercase()
}

async fn get(addr: SocketAddr, path: &str, extra: &[(&str, &str)]) -> String {
    send(addr, "GET", path, extra).await
}

/// The body of an answer read by [`send`] (lowercased).
fn body(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("")
}

/// Opens a subscription and reads until `until` appears; returns the socket and text.
async fn subscribe_until(
    addr: SocketAddr,
    path: &str,
    extra: &[(&str, &str)],
    until: &str,
) -> (TcpStream, String) {
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: site.test\r\nSubscribe: true\r\n");
    for (k, v) in extra {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let text = read_until(&mut stream, until).await;
    (stream, text)
}

async fn read_until(stream: &mut TcpStream, until: &str) -> String {
    let mut text = String::new();
    let mut buf = [0u8; 8192];
    let done = tokio::time::timeout(WAIT, async {
        while !text.contains(until) {
            let n = stream.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
    .await;
    assert!(
        done.is_ok() && text.contains(until),
        "waiting for {until:?}, got:\n{text}"
    );
    text
}

async fn metric(p: &Proxy, name: &str) -> f64 {
    let text = get(p.admin, "/metrics", &[]).await;
    let prefix = format!("braid_proxy_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}

#[tokio::test]
async fn state_served_gets_replay_the_origins_headers() {
    let origin = Origin::start(|_, _| {
        respond(
            &[
                ("content-type", "text/html"),
                ("cache-control", "max-age=60"),
                ("etag", "\"v1\""),
                ("last-modified", "Tue, 01 Dec 2026 10:00:00 GMT"),
                ("content-language", "en"),
                ("link", "</style.css>; rel=preload"),
                ("content-security-policy", "default-src 'self'"),
                ("x-frame-options", "DENY"),
                ("x-content-type-options", "nosniff"),
                ("strict-transport-security", "max-age=31536000"),
                ("content-disposition", "attachment; filename=\"up.html\""),
                ("x-custom", "kept"),
                ("vary", "Accept-Language"),
            ],
            "<p>hello</p>",
        )
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    let first = get(p.addr, "/page", &[("accept-language", "en")]).await;
    assert!(first.starts_with("http/1.1 200"), "{first}");
    let second = get(p.addr, "/page", &[("accept-language", "en")]).await;
    assert_eq!(origin.count(), 1, "the second GET is answered from state");
    for expected in [
        "content-type: text/html",
        "cache-control: max-age=60",
        "etag: \"v1\"",
        "last-modified: tue, 01 dec 2026 10:00:00 gmt",
        "content-language: en",
        "link: </style.css>; rel=preload",
        "content-security-policy: default-src 'self'",
        "x-frame-options: deny",
        "x-content-type-options: nosniff",
        "strict-transport-security: max-age=31536000",
        "content-disposition: attachment; filename=\"up.html\"",
        "x-custom: kept",
        "vary: accept-language\r\n",
        "via: 1.1 faithful",
        "age: ",
        "version: \"v1\"",
        "cache-status: \"faithful\"; hit",
    ] {
        assert!(
            second.contains(expected),
            "missing {expected:?} in:\n{second}"
        );
    }
    assert_eq!(body(&second), "<p>hello</p>");
}

#[tokio::test]
async fn no_cache_and_zero_lifetimes_revalidate_every_time() {
    for cc in ["no-cache", "max-age=0, must-revalidate", "s-maxage=0"] {
        let origin = Origin::start(move |req, _| {
            if header(req, "if-none-match") == "\"e1\"" {
                let mut r = respond(&[("etag", "\"e1\""), ("cache-control", cc)], "");
                *r.status_mut() = http::StatusCode::NOT_MODIFIED;
                return r;
            }
            respond(&[("etag", "\"e1\""), ("cache-control", cc)], "body")
        })
        .await;
        let p = proxy(&origin, |_| {}).await;
        get(p.addr, "/r", &[]).await;
        let second = get(p.addr, "/r", &[]).await;
        assert_eq!(origin.count(), 2, "{cc}: the second GET goes to the origin");
        let seen = origin.seen();
        assert_eq!(
            seen[1].headers.get("if-none-match").map(|v| v.as_bytes()),
            Some(&b"\"e1\""[..]),
            "{cc}: it revalidates with the stored validator"
        );
        assert!(second.starts_with("http/1.1 200"), "{second}");
        assert_eq!(body(&second), "body", "{cc}: the stored body after the 304");
        assert!(second.contains("fwd=stale; fwd-status=304"), "{second}");
    }
}

#[tokio::test]
async fn max_age_is_honoured_without_refetching() {
    let origin =
        Origin::start(|_, _| respond(&[("cache-control", "max-age=60")], "long-lived")).await;
    let p = proxy(&origin, |_| {}).await;
    for _ in 0..5 {
        let answer = get(p.addr, "/long", &[]).await;
        assert_eq!(body(&answer), "long-lived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(origin.count(), 1, "fresh for 60 s: one origin request");
    // A client's own no-cache revalidates.
    get(p.addr, "/long", &[("cache-control", "no-cache")]).await;
    assert_eq!(origin.count(), 2);
}

#[tokio::test]
async fn private_set_cookie_pages_are_never_shared() {
    let origin = Origin::start(|_, n| {
        let token = format!("csrf-{n}");
        let cookie = format!("session={n}");
        respond(
            &[
                ("cache-control", "private, no-store"),
                ("set-cookie", cookie.as_str()),
            ],
            token,
        )
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    let a = get(p.addr, "/form", &[]).await;
    let b = get(p.addr, "/form", &[]).await;
    assert_ne!(body(&a), body(&b), "each visitor gets their own token");
    assert!(b.contains("detail=\"not stored: no-store\""), "{b}");
    // Subscriptions too: each subscriber has its own watcher.
    let (_s1, one) = subscribe_until(p.addr, "/form", &[], "csrf-").await;
    let (_s2, two) = subscribe_until(p.addr, "/form", &[], "csrf-").await;
    let token = |t: &str| t.split("csrf-").nth(1).map(|s| s[..1].to_string());
    assert_ne!(token(&one), token(&two), "{one}\n---\n{two}");
}

#[tokio::test]
async fn credentials_never_see_each_others_state() {
    let origin = Origin::start(|req, _| {
        let who = match (header(req, "authorization"), header(req, "cookie")) {
            ("", "") => "anonymous".to_string(),
            (auth, "") => format!("user {auth}"),
            (_, cookie) => format!("cookie {cookie}"),
        };
        respond(&[("cache-control", "public, max-age=60")], who)
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    let alice = get(p.addr, "/me", &[("authorization", "Bearer alice")]).await;
    let bob = get(p.addr, "/me", &[("authorization", "Bearer bob")]).await;
    let anon = get(p.addr, "/me", &[]).await;
    let carol = get(p.addr, "/me", &[("cookie", "id=carol")]).await;
    assert_eq!(body(&alice), "user bearer alice");
    assert_eq!(body(&bob), "user bearer bob");
    assert_eq!(body(&anon), "anonymous");
    assert_eq!(body(&carol), "cookie id=carol");
    // Subscriptions: each credential gets its own view; equal ones share.
    let (_a, sa) =
        subscribe_until(p.addr, "/me", &[("authorization", "Bearer alice")], "alice").await;
    let (_b, sb) = subscribe_until(p.addr, "/me", &[("authorization", "Bearer bob")], "bob").await;
    let (_n, sn) = subscribe_until(p.addr, "/me", &[], "anonymous").await;
    assert!(!sa.contains("bob") && !sb.contains("alice") && !sn.contains("bearer"));
    let before = metric(&p, "resources").await;
    let (_a2, again) =
        subscribe_until(p.addr, "/me", &[("authorization", "Bearer alice")], "alice").await;
    assert!(again.contains("user Bearer alice"), "{again}");
    assert_eq!(
        metric(&p, "resources").await,
        before,
        "a second alice shares her resource and its watcher"
    );
}

#[tokio::test]
async fn vary_keeps_variants_apart_for_gets_and_subscriptions() {
    let origin = Origin::start(|req, _| {
        let lang = header(req, "accept-language").to_string();
        let text = if lang.starts_with("fr") {
            "bonjour"
        } else {
            "hello"
        };
        respond(
            &[("cache-control", "max-age=60"), ("vary", "Accept-Language")],
            text,
        )
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    assert_eq!(
        body(&get(p.addr, "/hi", &[("accept-language", "en")]).await),
        "hello"
    );
    assert_eq!(
        body(&get(p.addr, "/hi", &[("accept-language", "fr")]).await),
        "bonjour"
    );
    assert_eq!(
        body(&get(p.addr, "/hi", &[("accept-language", "en")]).await),
        "hello"
    );
    assert_eq!(
        body(&get(p.addr, "/hi", &[("accept-language", "fr")]).await),
        "bonjour"
    );
    assert_eq!(origin.count(), 2, "one origin request per variant");
    let (_en, en) = subscribe_until(p.addr, "/hi", &[("accept-language", "en")], "hello").await;
    let (_fr, fr) = subscribe_until(p.addr, "/hi", &[("accept-language", "fr")], "bonjour").await;
    assert!(!en.contains("bonjour") && !fr.contains("hello"));
    // Vary: * is never shared.
    let star = Origin::start(|_, n| {
        respond(
            &[("vary", "*"), ("cache-control", "max-age=60")],
            format!("n{n}"),
        )
    })
    .await;
    let q = proxy(&star, |_| {}).await;
    let one = get(q.addr, "/s", &[]).await;
    let two = get(q.addr, "/s", &[]).await;
    assert_ne!(body(&one), body(&two));
}

#[tokio::test]
async fn watchers_fetch_under_the_clients_identity() {
    let origin = Origin::start(|req, _| {
        // An origin that trusts requests without X-Forwarded-For as internal.
        let internal = req.headers().get("x-forwarded-for").is_none();
        let tenant = header(req, "x-forwarded-host").to_string();
        respond(
            &[("cache-control", "max-age=60")],
            if internal {
                "internal secrets".to_string()
            } else {
                format!("public page of {tenant}")
            },
        )
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    let (_s, text) =
        subscribe_until(p.addr, "/home", &[("accept-language", "de")], "public page").await;
    assert!(text.contains("public page of site.test"), "{text}");
    let watcher = origin
        .seen()
        .into_iter()
        .next()
        .expect("the watcher's request");
    for name in [
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "via",
        "accept-language",
    ] {
        assert!(
            watcher.headers.contains_key(name),
            "watcher request lacks {name}: {watcher:?}"
        );
    }
    // Another tenant's host is another state.
    let mut stream = TcpStream::connect(p.addr).await.expect("connect");
    stream
        .write_all(b"GET /home HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.expect("read");
    assert!(String::from_utf8_lossy(&out).contains("public page of other.test"));
}

#[tokio::test]
async fn unique_queries_cannot_grow_state_past_the_cap() {
    let big = Bytes::from(vec![b'x'; 256 * 1024]);
    let origin = Origin::start(move |_, _| {
        let mut r = respond(&[("cache-control", "max-age=60")], big.clone());
        r.headers_mut()
            .insert("content-type", "text/plain".parse().expect("value"));
        r
    })
    .await;
    let cap = 2 * 1024 * 1024;
    let p = proxy(&origin, |c| c.state_bytes = cap).await;
    for i in 0..40 {
        let answer = get(p.addr, &format!("/big?q={i}"), &[]).await;
        assert!(answer.starts_with("http/1.1 200"));
    }
    let held = metric(&p, "state_bytes").await;
    assert!(held <= cap as f64, "state bytes {held} over the cap {cap}");
    assert!(metric(&p, "state_evictions_total").await > 0.0);
}

#[tokio::test]
async fn content_encoding_is_kept_and_subscriptions_get_identity() {
    let origin = Origin::start(|req, _| {
        if header(req, "accept-encoding").contains("gzip") {
            respond(
                &[
                    ("content-encoding", "gzip"),
                    ("vary", "Accept-Encoding"),
                    ("cache-control", "max-age=60"),
                ],
                Bytes::from_static(b"\x1f\x8bfake-gzip"),
            )
        } else {
            respond(
                &[("vary", "Accept-Encoding"), ("cache-control", "max-age=60")],
                "plain text",
            )
        }
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    get(p.addr, "/z", &[("accept-encoding", "gzip")]).await;
    let again = get(p.addr, "/z", &[("accept-encoding", "gzip")]).await;
    assert!(again.contains("content-encoding: gzip"), "{again}");
    assert_eq!(origin.count(), 1);
    let (_s, text) =
        subscribe_until(p.addr, "/z", &[("accept-encoding", "gzip")], "plain text").await;
    assert!(!text.contains("fake-gzip"), "{text}");
}

#[tokio::test]
async fn an_error_answer_costs_one_origin_request() {
    let origin = Origin::start(|_, _| {
        let mut r = respond(&[], "broken");
        *r.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
        r
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    let answer = get(p.addr, "/err", &[]).await;
    assert!(answer.starts_with("http/1.1 500"), "{answer}");
    assert_eq!(origin.count(), 1);
}

#[tokio::test]
async fn weak_etags_and_if_modified_since_get_304() {
    let origin = Origin::start(|_, _| {
        respond(
            &[
                ("etag", "W/\"e1\""),
                ("last-modified", "Tue, 01 Dec 2026 10:00:00 GMT"),
                ("cache-control", "max-age=60"),
                ("x-meta", "m"),
            ],
            "content",
        )
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    get(p.addr, "/w", &[]).await;
    let inm = get(p.addr, "/w", &[("if-none-match", "W/\"e1\"")]).await;
    assert!(inm.starts_with("http/1.1 304"), "{inm}");
    assert!(inm.contains("etag: w/\"e1\"") && inm.contains("cache-control: max-age=60"));
    let strong = get(p.addr, "/w", &[("if-none-match", "\"e1\"")]).await;
    assert!(
        strong.starts_with("http/1.1 304"),
        "weak comparison: {strong}"
    );
    let ims = get(
        p.addr,
        "/w",
        &[("if-modified-since", "Wed, 02 Dec 2026 10:00:00 GMT")],
    )
    .await;
    assert!(ims.starts_with("http/1.1 304"), "{ims}");
    let older = get(
        p.addr,
        "/w",
        &[("if-modified-since", "Mon, 30 Nov 2026 10:00:00 GMT")],
    )
    .await;
    assert!(older.starts_with("http/1.1 200"), "{older}");
    assert_eq!(origin.count(), 1);
}

#[tokio::test]
async fn unsafe_methods_invalidate_the_url_and_its_location() {
    let origin = Origin::start(|req, n| {
        if req.method() == http::Method::POST {
            let mut r = respond(&[("location", "/other")], "");
            *r.status_mut() = http::StatusCode::CREATED;
            return r;
        }
        respond(&[("cache-control", "max-age=60")], format!("n{n}"))
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    get(p.addr, "/list", &[]).await;
    get(p.addr, "/other", &[]).await;
    assert_eq!(origin.count(), 2);
    get(p.addr, "/list", &[]).await;
    assert_eq!(origin.count(), 2, "fresh: from state");
    let posted = send(p.addr, "POST", "/list", &[("content-length", "0")]).await;
    assert!(posted.starts_with("http/1.1 201"), "{posted}");
    get(p.addr, "/list", &[]).await;
    get(p.addr, "/other", &[]).await;
    let methods: Vec<String> = origin
        .seen()
        .iter()
        .map(|s| format!("{} {}", s.method, s.path))
        .collect();
    assert_eq!(
        methods.len(),
        5,
        "both URLs were fetched again: {methods:?}"
    );
}

#[tokio::test]
async fn concurrent_revalidations_share_one_origin_request() {
    let origin = Origin::start(|req, _| {
        if !header(req, "if-none-match").is_empty() {
            std::thread::sleep(Duration::from_millis(300));
            return {
                let mut r = respond(&[("etag", "\"e1\""), ("cache-control", "max-age=0")], "");
                *r.status_mut() = http::StatusCode::NOT_MODIFIED;
                r
            };
        }
        respond(
            &[("etag", "\"e1\""), ("cache-control", "max-age=0")],
            "shared",
        )
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    get(p.addr, "/c", &[]).await;
    let addr = p.addr;
    let tasks: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { get(addr, "/c", &[]).await }))
        .collect();
    for t in tasks {
        let answer = t.await.expect("task");
        assert_eq!(body(&answer), "shared");
    }
    assert_eq!(origin.count(), 2, "one fetch, one shared revalidation");
}

#[tokio::test]
async fn every_answer_carries_via() {
    let origin = Origin::start(|_, _| respond(&[("content-type", "text/plain")], "v")).await;
    let p = proxy(&origin, |_| {}).await;
    let refused = get(p.addr, "/x", &[("parents", "not a version list")]).await;
    assert!(
        refused.starts_with("http/1.1 400") && refused.contains("via: 1.1 faithful"),
        "{refused}"
    );
    let passed = send(p.addr, "DELETE", "/x", &[]).await;
    assert!(passed.contains("via: 1.1 faithful"), "{passed}");
    let (_s, sub) = subscribe_until(p.addr, "/x", &[], "\r\n\r\n").await;
    assert!(sub.to_lowercase().contains("via: 1.1 faithful"), "{sub}");
}

#[tokio::test]
async fn snapshots_carry_the_representation_headers() {
    let origin = Origin::start(|_, _| {
        respond(
            &[
                ("content-type", "text/plain; charset=utf-8"),
                ("content-language", "fr"),
            ],
            "bonjour",
        )
    })
    .await;
    let p = proxy(&origin, |_| {}).await;
    let (_s, text) = subscribe_until(p.addr, "/fr", &[], "bonjour").await;
    let (head, body) = text.split_once("\r\n\r\n").expect("a 209 head");
    assert!(
        head.to_lowercase().contains("content-language: fr"),
        "{head}"
    );
    assert!(
        body.to_lowercase().contains("content-language: fr"),
        "the snapshot says it: {body}"
    );
    assert!(
        body.to_lowercase()
            .contains("content-type: text/plain; charset=utf-8"),
        "{body}"
    );
}

#[tokio::test]
async fn copies_of_answers_in_flight_share_a_budget() {
    // The copy budget is a quarter of --state-bytes: 512 KiB here, so a
    // 600 KB answer streams through without being stored.
    let big = Bytes::from(vec![b'y'; 600_000]);
    let origin =
        Origin::start(move |_, _| respond(&[("cache-control", "max-age=60")], big.clone())).await;
    let p = proxy(&origin, |c| c.state_bytes = 2 * 1024 * 1024).await;
    let first = get(p.addr, "/huge", &[]).await;
    assert_eq!(body(&first).len(), 600_000, "the client gets it all");
    assert!(
        first.contains("not stored: busy"),
        "{}",
        &first[..first.find("\r\n\r\n").unwrap_or(0)]
    );
    get(p.addr, "/huge", &[]).await;
    assert_eq!(origin.count(), 2, "nothing was stored");
}
