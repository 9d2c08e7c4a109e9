//! Hostile input at every seam (issue 44): a hostile client and a hostile
//! upstream, on real sockets. Nothing a client sends is read by an origin
//! as another client's request, a client's broken body is the client's
//! error, what an upstream sends is bounded and checked before it is
//! relayed, and held bytes count against `--state-bytes`.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_proxy::config::Config;
use common::wire::{metric, rest_of, subscribe_raw};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(10);

/// An origin as careless as Python's `http.server` with a handler that
/// never reads request bodies: it reads request heads only, answers each
/// with the path it read (`path=/x`, `Cache-Control: max-age=600`), and
/// keeps the connection open. Whatever body a request carried is read as
/// the next request. Returns its address and the paths it was asked for.
async fn careless_origin() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        let head = String::from_utf8_lossy(&head).into_owned();
                        let path = head.split(' ').nth(1).unwrap_or("?").to_string();
                        let close = head.to_ascii_lowercase().contains("connection: close");
                        log.lock().expect("lock").push(path.clone());
                        let body = format!("path={path}");
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncache-control: max-age=600\r\n\r\n{body}",
                            body.len()
                        );
                        if stream.write_all(answer.as_bytes()).await.is_err() || close {
                            return;
                        }
                    }
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    (addr, seen)
}

async fn proxy(origin: SocketAddr, tune: impl FnOnce(&mut Config)) -> (SocketAddr, SocketAddr) {
    common::proxy_for(origin, tune).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_on_a_get_is_never_read_as_another_request() {
    let (origin, seen) = careless_origin().await;
    let (addr, _) = proxy(origin, |_| {}).await;
    for method in ["GET", "HEAD", "OPTIONS", "DELETE"] {
        let smuggled = format!("GET /smuggled-{method} HTTP/1.1\r\nHost: x\r\n\r\n");
        let answer = common::exchange(
            addr,
            format!(
                "{method} /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{smuggled}",
                smuggled.len()
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{method}: {answer}");
        // Other clients, on the proxy's pooled connections to the origin.
        for n in 0..4 {
            let victim = format!("/victim-{method}-{n}");
            let response = common::get(addr, &victim, &[]).await;
            let body = common::body_of(response).await;
            assert_eq!(
                body,
                format!("path={victim}"),
                "after a {method} with a body"
            );
        }
    }
    let seen = seen.lock().expect("lock").clone();
    assert!(
        !seen.iter().any(|p| p.starts_with("/smuggled")),
        "the origin read a client's body as a request: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_body_is_not_stored_and_a_subscription_with_one_is_refused() {
    let (origin, seen) = careless_origin().await;
    let (addr, _) = proxy(origin, |_| {}).await;
    let ask = |body: &str| {
        format!(
            "GET /search HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    assert!(common::exchange(addr, ask("q=1"))
        .await
        .starts_with("HTTP/1.1 200"));
    assert!(common::exchange(addr, ask("q=2"))
        .await
        .starts_with("HTTP/1.1 200"));
    // A plain GET is not answered from what a GET with a body was given.
    common::body_of(common::get(addr, "/search", &[]).await).await;
    assert_eq!(
        seen.lock().expect("lock").len(),
        3,
        "each went to the origin"
    );
    // That plain GET's answer is stored as usual.
    common::body_of(common::get(addr, "/search", &[]).await).await;
    assert_eq!(seen.lock().expect("lock").len(), 3, "a hit");
    let refused = common::exchange(
        addr,
        "GET /search HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc"
            .to_string(),
    )
    .await;
    assert!(refused.starts_with("HTTP/1.1 400"), "{refused}");
    assert!(refused.contains("must not carry a body"), "{refused}");
}

async fn readyz(admin: SocketAddr) -> u16 {
    common::get(admin, "/readyz", &[]).await.status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_broken_body_is_the_clients_error_and_readiness_stays() {
    // An origin that reads request bodies (hyper's), answering after the whole body.
    let origin = common::serve_async(|req: http::Request<hyper::body::Incoming>| async move {
        use http_body_util::BodyExt;
        let ok = req.into_body().collect().await.is_ok();
        http::Response::new(http_body_util::Full::new(bytes::Bytes::from(if ok {
            "read"
        } else {
            "broken"
        })))
    })
    .await;
    let (addr, admin) = proxy(origin, |_| {}).await;
    assert_eq!(readyz(admin).await, 200);
    // Three bytes of a promised 100,000, then gone.
    for _ in 0..3 {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(stream);
    }
    // A chunk size that is not hex.
    let answer = common::exchange(
        addr,
        "POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\nzz\r\n"
            .to_string(),
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 400"),
        "a bad chunk size is the client's error: {answer}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        assert_eq!(
            readyz(admin).await,
            200,
            "one client's body is not the upstream's health"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(admin, "upstream_errors_total").await, 0.0);
    // And the upstream still serves whole bodies.
    let answer = common::exchange(
        addr,
        "POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"
            .to_string(),
    )
    .await;
    assert!(answer.ends_with("read"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_header_bytes_count_against_the_state_cap() {
    // Answers with 200 KB of headers each; 40 distinct URLs is 8 MB of headers.
    let filler = "x".repeat(8 * 1024);
    let origin = common::serve(move |req| {
        let mut response = http::Response::builder()
            .header("cache-control", "max-age=600")
            .header("etag", format!("\"{}\"", req.uri().path().len()));
        for i in 0..25 {
            response = response.header(format!("x-filler-{i}"), filler.as_str());
        }
        response
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                b"small",
            )))
            .expect("response")
    })
    .await;
    let cap = 2 * 1024 * 1024;
    let (addr, admin) = proxy(origin, |c| {
        c.state_bytes = cap;
        c.max_header_bytes = 512 * 1024;
    })
    .await;
    for n in 0..40 {
        let response = common::get(addr, &format!("/h{n}"), &[]).await;
        assert_eq!(response.status().as_u16(), 200);
        common::body_of(response).await;
    }
    let held = metric(admin, "state_bytes").await;
    assert!(
        held >= 200_000.0,
        "the headers of what is stored are counted: {held}"
    );
    assert!(
        held <= cap as f64,
        "idle answers are evicted to keep under the cap: {held} > {cap}"
    );
    assert!(metric(admin, "state_evictions_total").await > 0.0);
}

/// A Braid upstream written by hand: answers every request with a 209 head
/// and then `stream(path)` (raw bytes), and stays open. Returns its address
/// and how many requests it was sent.
async fn raw_braid_upstream(
    stream: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static,
) -> (SocketAddr, Arc<Mutex<usize>>) {
    let asked: Arc<Mutex<usize>> = Arc::default();
    let count = asked.clone();
    let addr = common::wire::raw_upstream(move |head| {
        *count.lock().expect("lock") += 1;
        let path = head.split(' ').nth(1).unwrap_or("/");
        // Not chunked: the body runs until the connection closes.
        let mut answer =
            b"HTTP/1.1 209 Multiresponse\r\nsubscribe: true\r\nconnection: close\r\n\r\n".to_vec();
        answer.extend(stream(path));
        answer
    })
    .await;
    (addr, asked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_upstream_updates_end_the_subscription_and_are_not_relayed() {
    let good = "Version: \"v1\"\r\nContent-Length: 4\r\n\r\ngood\r\n";
    let bad = [
        "Version: not-json\r\nContent-Length: 3\r\n\r\nBAD\r\n",
        "Version: \"v2\"\r\nContent-Length: -5\r\n\r\nBAD\r\n",
        "Version: \"v2\"\r\nParents: \"v1\"\r\nContent-Range: text [5:2]\r\nContent-Length: 3\r\n\r\nBAD\r\n",
        "\u{1}\u{2}BAD binary garbage\r\n\r\n",
    ];
    let (upstream, asked) = raw_braid_upstream(move |path| {
        let n: usize = path.trim_start_matches("/m").parse().unwrap_or(0);
        format!("{good}{}", bad[n % bad.len()]).into_bytes()
    })
    .await;
    let (addr, _) = proxy(upstream, |c| {
        c.upstream_kind = braid_proxy::config::UpstreamKind::Braid;
    })
    .await;
    for n in 0..bad.len() {
        let path = format!("/m{n}");
        let (mut first, head) = subscribe_raw(addr, &path).await;
        assert!(head.starts_with("HTTP/1.1 209"), "{head}");
        let got = rest_of(&mut first).await;
        let text = String::from_utf8_lossy(&got);
        assert!(text.contains("good"), "the good update is relayed: {text}");
        assert!(
            !text.contains("BAD"),
            "nothing malformed is relayed ({path}): {text}"
        );
        // One who comes later does not get it either: for a while the
        // upstream is not asked again (clients that retry at once cannot
        // make the proxy hammer it); they are told to come back later.
        let (mut later, head) = subscribe_raw(addr, &path).await;
        assert!(head.starts_with("HTTP/1.1 502"), "{head}");
        assert!(head.to_ascii_lowercase().contains("retry-after:"), "{head}");
        let text = String::from_utf8_lossy(&rest_of(&mut later).await).into_owned();
        assert!(
            !text.contains("BAD"),
            "nor to a later subscriber ({path}): {text}"
        );
        assert!(
            text.contains("malformed"),
            "the reason, in one line: {text}"
        );
        assert_eq!(*asked.lock().expect("lock"), n + 1, "asked once per path");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_upstream_header_block_is_cut_off_at_its_limit() {
    // One update whose header lines never end: 8 MB of them.
    let (upstream, _) = raw_braid_upstream(|_| {
        let mut body = b"Version: \"v1\"\r\n".to_vec();
        while body.len() < 8 * 1024 * 1024 {
            body.extend_from_slice(
                b"X-More: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
            );
        }
        body
    })
    .await;
    let (addr, _) = proxy(upstream, |c| {
        c.upstream_kind = braid_proxy::config::UpstreamKind::Braid;
    })
    .await;
    let (mut stream, head) = subscribe_raw(addr, "/endless").await;
    assert!(head.starts_with("HTTP/1.1 209"), "{head}");
    let started = Instant::now();
    let got = rest_of(&mut stream).await;
    assert!(
        started.elapsed() < WAIT,
        "the subscription ends at the header limit, not when the upstream stops"
    );
    assert!(
        !String::from_utf8_lossy(&got).contains("X-More"),
        "none of it is relayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_sessions_count_against_the_state_cap_and_new_ones_are_refused() {
    // Each resource is one 1 MiB snapshot.
    let (upstream, asked) = raw_braid_upstream(|_| {
        let body = "y".repeat(1024 * 1024);
        format!(
            "Version: \"v1\"\r\nContent-Length: {}\r\n\r\n{body}\r\n",
            body.len()
        )
        .into_bytes()
    })
    .await;
    let cap = 8 * 1024 * 1024;
    let (addr, admin) = proxy(upstream, |c| {
        c.upstream_kind = braid_proxy::config::UpstreamKind::Braid;
        c.state_bytes = cap;
    })
    .await;
    // Subscribers that never read, each on its own resource.
    let mut held = Vec::new();
    let mut refused = None;
    for n in 0..40 {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET /big{n} HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut head = [0u8; 12];
        tokio::time::timeout(WAIT, stream.read_exact(&mut head))
            .await
            .expect("answered in time")
            .expect("read");
        let status = String::from_utf8_lossy(&head[9..12]).into_owned();
        if status == "503" {
            refused = Some(n);
            break;
        }
        assert_eq!(status, "209");
        held.push(stream);
        // Its first update is in before the next one asks.
        let deadline = Instant::now() + WAIT;
        while metric(admin, "state_bytes").await < (n as f64 + 1.0) * 1024.0 * 1024.0 {
            if metric(admin, "state_bytes").await > cap as f64 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let refused = refused.expect("new relayed state is refused once the cap is reached");
    // Each session holds its window and the representation it builds
    // (2 MiB counted): no more than the cap's worth get in.
    assert!(
        refused <= 5,
        "refused only after {refused} sessions of 1 MiB under an 8 MiB cap"
    );
    assert!(*asked.lock().expect("lock") <= 5);
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_purge_covers_the_empty_query_and_status_hides_path_parameters() {
    let origin = common::origin::Origin::with_cache_control("max-age=600");
    origin.set("/a", "one");
    origin.set("/s;jsessionid=S3CR3T", "two");
    let addr_origin = origin.start().await;
    let (addr, admin) = proxy(addr_origin, |_| {}).await;
    for path in ["/a", "/a?"] {
        common::body_of(common::get(addr, path, &[]).await).await;
    }
    let _subscription = subscribe_raw(addr, "/s;jsessionid=S3CR3T").await;
    let status = common::body_of(common::get(admin, "/status", &[]).await).await;
    let status = String::from_utf8_lossy(&status).into_owned();
    assert!(
        !status.contains("S3CR3T"),
        "path parameters are hidden: {status}"
    );
    assert!(
        status.contains("jsessionid"),
        "their names are shown: {status}"
    );
    let purged = common::body_of(common::request(admin, "POST", "/purge?path=/a", &[]).await).await;
    assert!(
        String::from_utf8_lossy(&purged).contains('2'),
        "both /a and /a? are purged: {purged:?}"
    );
    for path in ["/a", "/a?"] {
        let again = common::get(addr, path, &[]).await;
        assert!(
            again.headers().get("age").is_none(),
            "{path} is not served from state"
        );
    }
}

/// An origin that answers `Vary: X-Tenant`, storable for ten minutes, with
/// `tenant=<the bytes of X-Tenant it got, in hex>;`.
async fn tenant_echoing_origin() -> SocketAddr {
    common::serve(|req| {
        let tenant: String = req
            .headers()
            .get("x-tenant")
            .map(|v| v.as_bytes().iter().map(|b| format!("{b:02x}")).collect())
            .unwrap_or_default();
        http::Response::builder()
            .header("vary", "X-Tenant")
            .header("cache-control", "max-age=600")
            .header("content-type", "text/plain")
            .body(http_body_util::Full::new(bytes::Bytes::from(format!(
                "tenant={tenant};"
            ))))
            .expect("response")
    })
    .await
}

/// `tenant=<hex>;` for a value's bytes.
fn tenant_body(value: &[u8]) -> String {
    let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
    format!("tenant={hex};")
}

/// Sends a request head whose `X-Tenant` is `tenant`, byte for byte, on a
/// raw connection (clients refuse bytes that are not ASCII), with `extra`
/// header lines; returns the stream.
async fn send_tenant(addr: SocketAddr, path: &str, tenant: &[u8], extra: &str) -> TcpStream {
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{extra}X-Tenant: ").into_bytes();
    head.extend_from_slice(tenant);
    head.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(&head).await.expect("write");
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vary_keys_hold_the_exact_bytes_of_a_value_for_gets_and_subscriptions() {
    let origin = tenant_echoing_origin().await;
    let (addr, _) = proxy(origin, |_| {}).await;
    let pairs: [(&[u8], &[u8]); 3] = [
        (b"a b", b"a  b"),
        (b"\xe9vil", b"\xe8vil"),
        (b"a,b", b"a, b"),
    ];
    for (i, (first, second)) in pairs.iter().enumerate() {
        // GET: the first value is stored, the second is another variant.
        for tenant in [first, second] {
            let mut stream = send_tenant(addr, &format!("/g{i}"), tenant, "").await;
            let answer = String::from_utf8_lossy(&rest_of(&mut stream).await).into_owned();
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(
                answer.ends_with(&tenant_body(tenant)),
                "GET with X-Tenant {:?}: {answer}",
                String::from_utf8_lossy(tenant)
            );
        }
        // Subscribe: the first value's state exists (its GET stored it);
        // the second's subscription gets its own.
        for tenant in [first, second] {
            let mut stream =
                send_tenant(addr, &format!("/g{i}"), tenant, "Subscribe: true\r\n").await;
            let mut seen = Vec::new();
            common::wire::read_until(&mut stream, &mut seen, |t| {
                t.contains("tenant=") && t[t.find("tenant=").unwrap_or(0)..].contains(';')
            })
            .await;
            let seen = String::from_utf8_lossy(&seen).into_owned();
            assert!(seen.starts_with("HTTP/1.1 209"), "{seen}");
            assert!(
                seen.contains(&tenant_body(tenant)),
                "subscription with X-Tenant {:?}: {seen}",
                String::from_utf8_lossy(tenant)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_braid_upstream_is_asked_for_heartbeats_no_faster_than_the_proxys_floor() {
    let heads: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = heads.clone();
    let upstream = common::wire::raw_upstream(move |head| {
        log.lock().expect("lock").push(head.to_ascii_lowercase());
        b"HTTP/1.1 209 Multiresponse\r\nsubscribe: true\r\nconnection: close\r\n\r\n\
          Version: \"v1\"\r\nContent-Length: 2\r\n\r\nhi\r\n"
            .to_vec()
    })
    .await;
    let (addr, _) = proxy(upstream, |c| {
        c.set("upstream-kind", "braid").expect("kind");
    })
    .await;
    for (i, asked) in ["0.001", "0.000001s", "1ms", "0", "5s"].iter().enumerate() {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "GET /h{i} HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\nHeartbeats: {asked}\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut seen = Vec::new();
        common::wire::read_until(&mut stream, &mut seen, |t| t.contains("hi")).await;
    }
    let heads = heads.lock().expect("lock").clone();
    assert_eq!(heads.len(), 5, "{heads:?}");
    let asked_for = |path: &str| -> Option<String> {
        let head = heads
            .iter()
            .find(|h| h.starts_with(&format!("get {path} ")))
            .unwrap_or_else(|| panic!("no request for {path}: {heads:?}"));
        head.lines()
            .find_map(|l| l.strip_prefix("heartbeats: "))
            .map(|v| v.trim().to_string())
    };
    for path in ["/h0", "/h1", "/h2"] {
        let value = asked_for(path).unwrap_or_else(|| panic!("{path}: no heartbeats asked"));
        let interval = braid_proxy::braid::parse_heartbeats(value.as_bytes()).expect("parses");
        assert_eq!(interval, Duration::from_millis(10), "{path}: {value}");
    }
    assert_eq!(asked_for("/h3"), None, "Heartbeats: 0 asks for none");
    assert_eq!(asked_for("/h4").as_deref(), Some("5s"));
}

/// Sends `body` as a POST over h2c with a `Content-Length` line for each of
/// `lengths`; the status, or `None` when the stream was reset.
async fn h2c_post(addr: SocketAddr, lengths: &[&str], body: &'static [u8]) -> Option<u16> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2c handshake");
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/p"));
    for length in lengths {
        req = req.header("content-length", *length);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from_static(body)))
        .expect("request");
    let response = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("answered in time");
    response.ok().map(|r| r.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_content_lengths_are_refused_and_never_forwarded() {
    let heads: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = heads.clone();
    let upstream = common::wire::raw_upstream(move |head| {
        log.lock().expect("lock").push(head.to_ascii_lowercase());
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok".to_vec()
    })
    .await;
    let (addr, _) = proxy(upstream, |_| {}).await;
    // The HTTP/1.1 fast path (a subscription that arrived whole), and
    // hyper's HTTP/1.1 path with a list (hyper's own 400).
    let refused = [
        "GET /s HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
        "POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\nConnection: close\r\n\r\nhello",
    ];
    for request in refused {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut seen = Vec::new();
        common::wire::read_until(&mut stream, &mut seen, |t| t.contains("\r\n\r\n")).await;
        let answer = String::from_utf8_lossy(&seen).into_owned();
        assert!(answer.starts_with("HTTP/1.1 400"), "{request:?}: {answer}");
    }
    // The proxy's own 400 says why, in one line.
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(refused[0].as_bytes())
        .await
        .expect("write");
    let mut seen = Vec::new();
    common::wire::read_until(&mut stream, &mut seen, |t| {
        t.split_once("\r\n\r\n")
            .is_some_and(|(_, body)| body.ends_with('\n'))
    })
    .await;
    let answer = String::from_utf8_lossy(&seen).into_owned();
    let reason = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    assert!(
        reason.contains("Content-Length") && reason.lines().count() == 1,
        "a one-line reason: {answer}"
    );
    // HTTP/2: a 400, or the stream reset by h2's own check.
    for lengths in [&["5", "5"][..], &["5, 5"]] {
        let status = h2c_post(addr, lengths, b"hello").await;
        assert!(
            matches!(status, None | Some(400)),
            "{lengths:?}: {status:?}"
        );
    }
    // hyper's HTTP/1.1 path folds two equal lines into one length before
    // the proxy sees the request: one line goes on, never two.
    let folded = "POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
    let answer = common::exchange(addr, folded.to_string()).await;
    assert!(
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.1 400"),
        "{answer}"
    );
    for head in heads.lock().expect("lock").iter() {
        let lines = head
            .lines()
            .filter(|l| l.starts_with("content-length:"))
            .collect::<Vec<_>>();
        assert!(
            lines.len() <= 1 && !head.contains("5, 5"),
            "forwarded: {head}"
        );
        assert!(
            !head.starts_with("get /s "),
            "a refused request went on: {head}"
        );
    }
}
