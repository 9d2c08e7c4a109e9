//! The CDN-grade cache (issue 39), over real sockets: stale-if-error and
//! stale-while-revalidate (RFC 5861), the admin listener's purge by URL and
//! by tag, and byte ranges answered from stored state (RFC 9110 §14). The
//! origins here count the requests they get, to show which answers came
//! from state.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use common::{body_of, get, proxy_for, request};

/// How a [`Scripted`] origin answers now.
#[derive(Clone)]
struct Script {
    status: u16,
    body: &'static str,
    headers: Vec<(&'static str, String)>,
    /// Answers wait for a permit of [`Scripted::gate`].
    held: bool,
}

/// An origin whose answer the test changes as it goes, which counts its
/// requests and can be stopped (its listener and connections closed).
#[derive(Clone)]
struct Scripted {
    script: Arc<Mutex<Script>>,
    requests: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
    tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Scripted {
    fn new(body: &'static str, headers: &[(&'static str, &str)]) -> Scripted {
        Scripted {
            script: Arc::new(Mutex::new(Script {
                status: 200,
                body,
                headers: headers.iter().map(|(n, v)| (*n, v.to_string())).collect(),
                held: false,
            })),
            requests: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
            tasks: Arc::default(),
        }
    }

    fn change(&self, f: impl FnOnce(&mut Script)) {
        f(&mut self.script.lock().expect("lock"));
    }

    fn requests(&self) -> usize {
        self.requests.load(SeqCst)
    }

    async fn start(&self) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind origin");
        let addr = listener.local_addr().expect("addr");
        let origin = self.clone();
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let origin2 = origin.clone();
                let conn = tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let origin = origin2.clone();
                        async move { Ok::<_, std::convert::Infallible>(origin.answer(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                origin.tasks.lock().expect("lock").push(conn.abort_handle());
            }
        });
        self.tasks.lock().expect("lock").push(accept.abort_handle());
        addr
    }

    /// Closes the listener and every connection: the origin is down.
    fn stop(&self) {
        for task in self.tasks.lock().expect("lock").drain(..) {
            task.abort();
        }
    }

    async fn answer(&self, _req: Request<Incoming>) -> Response<Full<Bytes>> {
        self.requests.fetch_add(1, SeqCst);
        let script = self.script.lock().expect("lock").clone();
        if script.held {
            let _permit = self.gate.acquire().await.expect("gate");
        }
        let mut response = Response::builder().status(script.status);
        for (name, value) in &script.headers {
            response = response.header(*name, value.as_str());
        }
        response
            .body(Full::new(Bytes::from_static(script.body.as_bytes())))
            .expect("response")
    }
}

fn header(response: &Response<Incoming>, name: &str) -> String {
    response
        .headers()
        .get_all(name)
        .iter()
        .map(|v| v.to_str().expect("text"))
        .collect::<Vec<_>>()
        .join(", ")
}

async fn text(response: Response<Incoming>) -> String {
    String::from_utf8_lossy(&body_of(response).await).into_owned()
}

/// `POST` on the admin listener: status and body.
async fn admin_post(admin: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let response = request(admin, "POST", path, headers).await;
    let status = response.status().as_u16();
    (status, text(response).await)
}

// ---------------------------------------------------------------------------
// stale-if-error (RFC 5861 §4)

/// Already stale when stored (`Age` past `max-age`), within 60 s of it.
const STALE_SIE: [(&str, &str); 2] = [
    ("cache-control", "max-age=1, stale-if-error=60"),
    ("age", "5"),
];

#[tokio::test]
async fn stale_if_error_answers_from_state_when_the_origin_is_down() {
    let origin = Scripted::new("kept", &STALE_SIE);
    let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
    let first = get(proxy, "/doc", &[]).await;
    assert_eq!(first.status(), 200);
    assert_eq!(text(first).await, "kept");
    origin.stop();
    let answer = get(proxy, "/doc", &[]).await;
    assert_eq!(answer.status(), 200, "stale answer instead of the error");
    let status = header(&answer, "cache-status");
    assert!(
        status.contains("fwd=stale") && status.contains("detail=\"stale-if-error\""),
        "{status}"
    );
    assert!(!status.contains("fwd-status"), "no answer came: {status}");
    assert_eq!(text(answer).await, "kept");
}

#[tokio::test]
async fn stale_if_error_answers_from_state_instead_of_a_503() {
    let origin = Scripted::new("kept", &STALE_SIE);
    let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
    assert_eq!(text(get(proxy, "/doc", &[]).await).await, "kept");
    origin.change(|s| {
        s.status = 503;
        s.body = "down";
        s.headers.clear();
    });
    let answer = get(proxy, "/doc", &[]).await;
    assert_eq!(answer.status(), 200);
    let status = header(&answer, "cache-status");
    assert!(
        status.contains("fwd=stale; fwd-status=503; detail=\"stale-if-error\""),
        "{status}"
    );
    assert_eq!(text(answer).await, "kept");
    assert_eq!(origin.requests(), 2, "the origin was asked, and erred");
    // A 404 is not an error stale-if-error covers: it goes to the client.
    origin.change(|s| s.status = 404);
    assert_eq!(get(proxy, "/doc", &[]).await.status(), 404);
    stale_if_error_never_passes_must_revalidate().await;
}

/// (Part of the 503 test.) An origin's error goes through where the stored
/// answer says must-revalidate, whatever the operator's default.
async fn stale_if_error_never_passes_must_revalidate() {
    let origin = Scripted::new(
        "strict",
        &[
            (
                "cache-control",
                "max-age=1, stale-if-error=60, must-revalidate",
            ),
            ("age", "5"),
        ],
    );
    let (proxy, _admin) = proxy_for(origin.start().await, |c| {
        c.stale_if_error = Duration::from_secs(600);
    })
    .await;
    assert_eq!(text(get(proxy, "/doc", &[]).await).await, "strict");
    origin.change(|s| s.status = 503);
    assert_eq!(get(proxy, "/doc", &[]).await.status(), 503);
}

#[tokio::test]
async fn the_operators_stale_if_error_covers_origins_that_name_none() {
    let plain = [("cache-control", "max-age=1"), ("age", "5")];
    // Off by default: the error goes through.
    let origin = Scripted::new("plain", &plain);
    let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
    assert_eq!(text(get(proxy, "/doc", &[]).await).await, "plain");
    origin.change(|s| s.status = 503);
    assert_eq!(get(proxy, "/doc", &[]).await.status(), 503);
    // With --stale-if-error, the stored answer replaces it.
    let origin = Scripted::new("plain", &plain);
    let (proxy, _admin) = proxy_for(origin.start().await, |c| {
        c.stale_if_error = Duration::from_secs(60);
    })
    .await;
    assert_eq!(text(get(proxy, "/doc", &[]).await).await, "plain");
    origin.change(|s| s.status = 503);
    let answer = get(proxy, "/doc", &[]).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(text(answer).await, "plain");
    // A client's own stale-if-error=0 declines it.
    let declined = get(proxy, "/doc", &[("cache-control", "stale-if-error=0")]).await;
    assert_eq!(declined.status(), 503);
}

// ---------------------------------------------------------------------------
// stale-while-revalidate (RFC 5861 §3)

#[tokio::test]
async fn stale_while_revalidate_answers_at_once_and_revalidates_once() {
    let origin = Scripted::new(
        "old",
        &[
            ("cache-control", "max-age=1, stale-while-revalidate=60"),
            ("age", "5"),
            ("etag", "\"v1\""),
        ],
    );
    let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
    assert_eq!(text(get(proxy, "/doc", &[]).await).await, "old");
    assert_eq!(origin.requests(), 1);
    // From now on the origin holds its answers until the gate opens.
    origin.change(|s| {
        s.held = true;
        s.body = "new";
        s.headers = vec![
            ("cache-control", "max-age=600".into()),
            ("etag", "\"v2\"".into()),
        ];
    });
    let clients: Vec<_> = (0..4)
        .map(|_| tokio::spawn(async move { get(proxy, "/doc", &[]).await }))
        .collect();
    for client in clients {
        let answer = tokio::time::timeout(Duration::from_secs(5), client)
            .await
            .expect("answered while the origin holds its answer")
            .expect("task");
        assert_eq!(answer.status(), 200);
        let status = header(&answer, "cache-status");
        assert!(
            status.contains("hit") && status.contains("detail=\"stale-while-revalidate\""),
            "{status}"
        );
        assert_eq!(text(answer).await, "old");
    }
    // Exactly one background revalidation reached the origin.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while origin.requests() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no background request"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(origin.requests(), 2, "one revalidation for all clients");
    // Once it lands, the new answer is served fresh from state.
    origin.gate.add_permits(100);
    let mut body = String::new();
    for _ in 0..100 {
        let answer = get(proxy, "/doc", &[]).await;
        body = text(answer).await;
        if body == "new" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(body, "new");
    let hit = get(proxy, "/doc", &[]).await;
    assert!(header(&hit, "cache-status").contains("hit; ttl="));
    assert_eq!(origin.requests(), 2, "the revalidated answer is reused");
    stale_while_revalidate_never_passes_no_cache_or_must_revalidate().await;
}

/// (Part of the SWR test.) Where the answer's directives forbid stale
/// answers, the client waits for the origin.
async fn stale_while_revalidate_never_passes_no_cache_or_must_revalidate() {
    for strict in [
        "no-cache",
        "must-revalidate",
        "proxy-revalidate",
        "s-maxage=1",
    ] {
        let cc = format!("max-age=1, stale-while-revalidate=60, {strict}");
        let origin = Scripted::new("doc", &[("cache-control", cc.as_str()), ("age", "5")]);
        let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
        assert_eq!(text(get(proxy, "/doc", &[]).await).await, "doc");
        let again = get(proxy, "/doc", &[]).await;
        assert!(
            !header(&again, "cache-status").contains("stale-while-revalidate"),
            "{strict}"
        );
        assert_eq!(
            origin.requests(),
            2,
            "{strict}: the client waited for the origin"
        );
    }
}

// ---------------------------------------------------------------------------
// Purge (admin listener)

#[tokio::test]
async fn purge_by_path_drops_every_variant() {
    let origin = Scripted::new(
        "doc",
        &[
            ("cache-control", "max-age=3600"),
            ("vary", "accept-language"),
        ],
    );
    let (proxy, admin) = proxy_for(origin.start().await, |_| {}).await;
    for lang in ["en", "fr", "en", "fr"] {
        let answer = get(proxy, "/doc", &[("accept-language", lang)]).await;
        assert_eq!(text(answer).await, "doc");
    }
    assert_eq!(origin.requests(), 2, "one per variant");
    let other = get(proxy, "/other", &[]).await;
    assert_eq!(other.status(), 200);
    assert_eq!(origin.requests(), 3);
    let (status, body) = admin_post(admin, "/purge?path=/doc", &[]).await;
    assert_eq!((status, body.as_str()), (200, "purged 2\n"));
    assert_eq!(common::wire::metric(admin, "cache_purged_total").await, 2.0);
    for lang in ["en", "fr"] {
        let answer = get(proxy, "/doc", &[("accept-language", lang)]).await;
        assert!(
            !header(&answer, "cache-status").contains("hit"),
            "{lang} was purged"
        );
    }
    assert_eq!(origin.requests(), 5, "both variants went to the origin");
    // The other URL is still stored.
    let other = get(proxy, "/other", &[]).await;
    assert!(header(&other, "cache-status").contains("hit"));
    assert_eq!(origin.requests(), 5);
    let (status, body) = admin_post(admin, "/purge?path=/nothing", &[]).await;
    assert_eq!((status, body.as_str()), (200, "purged 0\n"));
    let (status, _) = admin_post(admin, "/purge", &[]).await;
    assert_eq!(status, 400);
    assert_eq!(
        request(admin, "GET", "/purge?path=/doc", &[])
            .await
            .status(),
        405
    );
}

/// An origin whose answer's tags depend on the path.
async fn tagged_origin() -> (SocketAddr, Arc<AtomicUsize>) {
    let requests = Arc::new(AtomicUsize::new(0));
    let count = requests.clone();
    let addr = common::serve(move |req| {
        count.fetch_add(1, SeqCst);
        let mut response = Response::builder().header("cache-control", "max-age=3600");
        response = match req.uri().path() {
            "/x" => response.header("surrogate-key", "t1 t2"),
            "/y" => response.header("cache-tag", "t2, t3"),
            _ => response,
        };
        response
            .body(Full::new(Bytes::from(req.uri().path().to_string())))
            .expect("response")
    })
    .await;
    (addr, requests)
}

#[tokio::test]
async fn purge_by_tag_drops_what_lists_it_and_clients_never_see_surrogate_key() {
    let (addr, requests) = tagged_origin().await;
    let (proxy, admin) = proxy_for(addr, |c| {
        c.admin_token = Some("a-token-of-sixteen-chars".into())
    })
    .await;
    for path in ["/x", "/y", "/z", "/x", "/y", "/z"] {
        let answer = get(proxy, path, &[]).await;
        assert_eq!(answer.status(), 200);
        assert!(
            answer.headers().get("surrogate-key").is_none(),
            "Surrogate-Key is stripped from {path}"
        );
        if path == "/y" {
            assert_eq!(header(&answer, "cache-tag"), "t2, t3");
        }
    }
    assert_eq!(requests.load(SeqCst), 3);
    // The admin token guards purges as it does /metrics.
    let (status, _) = admin_post(admin, "/purge?tag=t2", &[]).await;
    assert_eq!(status, 401);
    let auth = [("authorization", "Bearer a-token-of-sixteen-chars")];
    let (status, body) = admin_post(admin, "/purge?tag=t2", &auth).await;
    assert_eq!((status, body.as_str()), (200, "purged 2\n"));
    let (status, body) = admin_post(admin, "/purge?tag=t1", &auth).await;
    assert_eq!((status, body.as_str()), (200, "purged 0\n"));
    let z = get(proxy, "/z", &[]).await;
    assert!(header(&z, "cache-status").contains("hit"), "untagged stays");
    assert_eq!(requests.load(SeqCst), 3);
    for path in ["/x", "/y"] {
        let answer = get(proxy, path, &[]).await;
        assert!(!header(&answer, "cache-status").contains("hit"), "{path}");
    }
    assert_eq!(requests.load(SeqCst), 5);
    // Tags are still read from the re-fetched answers.
    let (_, body) = admin_post(admin, "/purge?tag=t1", &auth).await;
    assert_eq!(body, "purged 1\n");
    keep_surrogate_key_passes_it_on().await;
}

/// (Part of the tag test.) `--keep-surrogate-key` passes it on.
async fn keep_surrogate_key_passes_it_on() {
    let (addr, _requests) = tagged_origin().await;
    let (proxy, _admin) = proxy_for(addr, |c| c.keep_surrogate_key = true).await;
    for _ in 0..2 {
        let answer = get(proxy, "/x", &[]).await;
        assert_eq!(header(&answer, "surrogate-key"), "t1 t2");
    }
}

#[tokio::test]
async fn a_purged_resource_with_subscribers_is_fetched_again_for_them() {
    let origin = common::origin::Origin::default();
    origin.set("/doc", "hello");
    let (proxy, admin) = proxy_for(origin.start().await, |c| {
        c.heartbeat = Duration::ZERO;
    })
    .await;
    let mut sub = TcpStream::connect(proxy).await.expect("connect");
    sub.write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
        .await
        .expect("write");
    let mut seen = Vec::new();
    common::wire::read_until(&mut sub, &mut seen, |t| t.contains("hello")).await;
    origin.set("/doc", "hello, world");
    let (status, body) = admin_post(admin, "/purge?path=/doc", &[]).await;
    assert_eq!((status, body.as_str()), (200, "purged 1\n"));
    // Polls are 30 s apart here: only the purge can bring the change.
    common::wire::read_until(&mut sub, &mut seen, |t| t.contains(", world")).await;
}

// ---------------------------------------------------------------------------
// Ranges and HEAD from state (RFC 9110 §14)

const LAST_MODIFIED: &str = "Sat, 05 Dec 2026 10:00:00 GMT";

async fn ranged_proxy() -> (Scripted, SocketAddr) {
    let origin = Scripted::new(
        "0123456789",
        &[
            ("cache-control", "max-age=3600"),
            ("etag", "\"r1\""),
            ("last-modified", LAST_MODIFIED),
            ("content-type", "text/plain"),
        ],
    );
    let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
    assert_eq!(text(get(proxy, "/r", &[]).await).await, "0123456789");
    assert_eq!(origin.requests(), 1);
    (origin, proxy)
}

#[tokio::test]
async fn single_ranges_come_from_state() {
    let (origin, proxy) = ranged_proxy().await;
    for (range, content_range, body) in [
        ("bytes=0-1", "bytes 0-1/10", "01"),
        ("bytes=5-", "bytes 5-9/10", "56789"),
        ("bytes=-3", "bytes 7-9/10", "789"),
        ("bytes=8-100", "bytes 8-9/10", "89"),
        ("bytes=0-1, 50-60", "bytes 0-1/10", "01"),
    ] {
        let answer = get(proxy, "/r", &[("range", range)]).await;
        assert_eq!(answer.status(), StatusCode::PARTIAL_CONTENT, "{range}");
        assert_eq!(header(&answer, "content-range"), content_range);
        assert_eq!(header(&answer, "content-length"), body.len().to_string());
        assert_eq!(header(&answer, "etag"), "\"r1\"");
        assert!(header(&answer, "cache-status").contains("hit"));
        assert_eq!(text(answer).await, body, "{range}");
    }
    // Invalid syntax: the header is ignored.
    for range in ["bytes=5-1", "bytes=x-y", "lines=1-2"] {
        let answer = get(proxy, "/r", &[("range", range)]).await;
        assert_eq!(answer.status(), 200, "{range}");
        assert_eq!(text(answer).await, "0123456789");
    }
    assert_eq!(origin.requests(), 1, "no range went to the origin");
    a_stale_answer_leaves_ranges_to_the_origin().await;
}

#[tokio::test]
async fn multiple_ranges_are_multipart_from_state() {
    let (origin, proxy) = ranged_proxy().await;
    let answer = get(proxy, "/r", &[("range", "bytes=0-1,-2")]).await;
    assert_eq!(answer.status(), 206);
    let content_type = header(&answer, "content-type");
    let boundary = content_type
        .strip_prefix("multipart/byteranges; boundary=")
        .unwrap_or_else(|| panic!("{content_type}"))
        .to_string();
    assert!(answer.headers().get("content-range").is_none());
    let body = text(answer).await;
    let expected = format!(
        "\r\n--{boundary}\r\nContent-Type: text/plain\r\nContent-Range: bytes 0-1/10\r\n\r\n01\
         \r\n--{boundary}\r\nContent-Type: text/plain\r\nContent-Range: bytes 8-9/10\r\n\r\n89\
         \r\n--{boundary}--\r\n"
    );
    assert_eq!(body, expected);
    // Overlapping or too many ranges: the whole answer.
    for range in [
        "bytes=0-5,3-8".to_string(),
        format!(
            "bytes={}",
            (0..17)
                .map(|i| format!("{i}-{i}"))
                .collect::<Vec<_>>()
                .join(",")
        ),
    ] {
        let answer = get(proxy, "/r", &[("range", &range)]).await;
        assert_eq!(answer.status(), 200);
        assert_eq!(text(answer).await, "0123456789");
    }
    assert_eq!(origin.requests(), 1);
}

#[tokio::test]
async fn unsatisfiable_ranges_get_416_from_state() {
    let (origin, proxy) = ranged_proxy().await;
    for range in ["bytes=10-", "bytes=20-30", "bytes=-0"] {
        let answer = get(proxy, "/r", &[("range", range)]).await;
        assert_eq!(
            answer.status(),
            StatusCode::RANGE_NOT_SATISFIABLE,
            "{range}"
        );
        assert_eq!(header(&answer, "content-range"), "bytes */10");
        assert!(body_of(answer).await.is_empty());
    }
    assert_eq!(origin.requests(), 1);
}

#[tokio::test]
async fn if_range_picks_the_range_or_the_whole() {
    let (origin, proxy) = ranged_proxy().await;
    for (if_range, status, body) in [
        ("\"r1\"", 206, "23"),
        ("\"r0\"", 200, "0123456789"),
        ("W/\"r1\"", 200, "0123456789"),
        (LAST_MODIFIED, 206, "23"),
        ("Sat, 05 Dec 2026 09:00:00 GMT", 200, "0123456789"),
    ] {
        let answer = get(
            proxy,
            "/r",
            &[("range", "bytes=2-3"), ("if-range", if_range)],
        )
        .await;
        assert_eq!(answer.status().as_u16(), status, "{if_range}");
        assert_eq!(text(answer).await, body, "{if_range}");
    }
    assert_eq!(origin.requests(), 1);
}

#[tokio::test]
async fn head_from_state_has_the_get_headers_and_no_body() {
    let (origin, proxy) = ranged_proxy().await;
    let got = get(proxy, "/r", &[]).await;
    let head = request(proxy, "HEAD", "/r", &[("range", "bytes=0-1")]).await;
    assert_eq!(head.status(), 200, "Range is for GET only");
    for name in ["content-length", "content-type", "etag", "last-modified"] {
        assert_eq!(header(&head, name), header(&got, name), "{name}");
    }
    assert!(header(&head, "cache-status").contains("hit"));
    assert!(body_of(head).await.is_empty());
    assert_eq!(origin.requests(), 1);
}

/// (Part of the single-range test.) Nothing reusable stored: the range
/// goes to the origin as before.
async fn a_stale_answer_leaves_ranges_to_the_origin() {
    let origin = Scripted::new(
        "0123456789",
        &[("cache-control", "max-age=1"), ("age", "5")],
    );
    let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
    assert_eq!(text(get(proxy, "/r", &[]).await).await, "0123456789");
    let answer = get(proxy, "/r", &[("range", "bytes=0-1")]).await;
    assert!(header(&answer, "cache-status").contains("fwd=bypass"));
    assert_eq!(origin.requests(), 2);
}

#[tokio::test]
async fn a_head_answer_freshens_the_stored_get_answer() {
    let origin = Scripted::new(
        "body",
        &[("cache-control", "max-age=1"), ("age", "5"), ("x-a", "1")],
    );
    let (proxy, _admin) = proxy_for(origin.start().await, |_| {}).await;
    assert_eq!(text(get(proxy, "/doc", &[]).await).await, "body");
    origin.change(|s| {
        s.headers = vec![("cache-control", "max-age=600".into()), ("x-b", "2".into())];
    });
    // The stale answer sends the HEAD to the origin; its 200 updates the
    // stored headers (RFC 9111 §4.3.5), kept ones included.
    let head = request(proxy, "HEAD", "/doc", &[]).await;
    assert_eq!(head.status(), 200);
    assert_eq!(
        (header(&head, "x-a"), header(&head, "x-b")),
        ("1".into(), "2".into())
    );
    assert_eq!(header(&head, "content-length"), "4");
    assert_eq!(origin.requests(), 2);
    let got = get(proxy, "/doc", &[]).await;
    assert!(
        header(&got, "cache-status").contains("hit"),
        "freshened by the HEAD"
    );
    assert_eq!(header(&got, "x-b"), "2");
    assert_eq!(text(got).await, "body");
    assert_eq!(origin.requests(), 2);
    // A HEAD's 200 naming another ETag describes another answer: the
    // stored one is invalidated, and the next GET goes to the origin.
    origin.change(|s| {
        s.body = "changed";
        s.headers.push(("etag", "\"other\"".into()));
    });
    let head = request(proxy, "HEAD", "/doc", &[("cache-control", "no-cache")]).await;
    assert_eq!(header(&head, "etag"), "\"other\"");
    assert_eq!(origin.requests(), 3);
    let got = get(proxy, "/doc", &[]).await;
    assert_eq!(
        text(got).await,
        "changed",
        "the stored answer was invalidated"
    );
    assert_eq!(origin.requests(), 4);
}
