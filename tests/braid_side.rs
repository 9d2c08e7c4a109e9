//! The Braid side against a real origin on 127.0.0.1:0, over raw sockets:
//! the refresh hook, plain GETs from state (304), subscription caps, CORS,
//! and origin bodies over the limit (multiplexing: tests/multiplex.rs).

mod common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use braid_proxy::config::Config;
use common::origin::Origin;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(5);

struct Proxy {
    addr: SocketAddr,
    admin: SocketAddr,
}

async fn proxy(origin: SocketAddr, tune: impl FnOnce(&mut Config)) -> Proxy {
    let (addr, admin) = common::proxy_for(origin, tune).await;
    Proxy { addr, admin }
}

/// Sends raw request bytes and reads until `until` appears in the reply (or the connection ends).
async fn exchange(addr: SocketAddr, request: &str, until: &str) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let text = read_until(&mut stream, until, String::new()).await;
    (stream, text)
}

async fn read_until(stream: &mut TcpStream, until: &str, mut text: String) -> String {
    let mut buf = [0u8; 8192];
    let result = tokio::time::timeout(WAIT, async {
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
        result.is_ok(),
        "timed out waiting for {until:?}; got so far:\n{text}"
    );
    text
}

fn get(path: &str, extra: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n")
}

#[tokio::test]
async fn refresh_hook_revalidates_at_once() {
    let origin = Origin::with_cache_control("max-age=60");
    origin.set("/doc", "first version of the document\n");
    let addr = origin.start().await;
    let p = proxy(addr, |_| {}).await;
    let (mut sub, text) =
        exchange(p.addr, &get("/doc", "Subscribe: true\r\n"), "first version").await;
    assert!(text.starts_with("HTTP/1.1 209 Subscription\r\n"), "{text}");

    origin.set("/doc", "second version of the document\n");
    let (_, answer) = exchange(
        p.admin,
        "POST /refresh?path=/doc HTTP/1.1\r\nHost: x\r\n\r\n",
        "\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
    let text = read_until(&mut sub, "Parents: \"e1\"", String::new()).await;
    assert!(text.contains("Version: \"e2\""), "{text}");
    assert!(
        text.contains("Content-Range: text ["),
        "a small edit arrives as a patch: {text}"
    );

    let (_, untracked) = exchange(
        p.admin,
        "POST /refresh?path=/other HTTP/1.1\r\nHost: x\r\n\r\n",
        "\r\n\r\n",
    )
    .await;
    assert!(untracked.contains("not tracked"), "{untracked}");
    let (_, bad) = exchange(
        p.admin,
        "POST /refresh HTTP/1.1\r\nHost: x\r\n\r\n",
        "\r\n\r\n",
    )
    .await;
    assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
}

#[tokio::test]
async fn plain_get_is_served_from_state_with_304() {
    let origin = Origin::with_cache_control("max-age=60");
    origin.set("/doc", "hello");
    let addr = origin.start().await;
    let p = proxy(addr, |c| c.poll_interval = Duration::from_secs(60)).await;
    let (_, first) = exchange(p.addr, &get("/doc", "Connection: close\r\n"), "hello").await;
    assert!(first.contains("etag: \"e1\""), "{first}");
    assert!(
        first.contains("; fwd=uri-miss; fwd-status=200; stored"),
        "{first}"
    );
    let gets = origin.gets.load(Ordering::SeqCst);
    // The origin said max-age=60: the next GET is answered from state.
    let (_, from_state) = exchange(p.addr, &get("/doc", "Connection: close\r\n"), "hello").await;
    assert!(
        from_state.contains("version: \"e1\"") && from_state.contains("etag: \"e1\""),
        "{from_state}"
    );
    assert!(
        from_state.contains("repr-digest: sha-256=:"),
        "{from_state}"
    );
    assert!(
        from_state.contains("cache-control: max-age=60"),
        "{from_state}"
    );
    assert!(from_state.contains("; hit; ttl="), "{from_state}");
    let (_, second) = exchange(
        p.addr,
        &get("/doc", "If-None-Match: \"e1\"\r\nConnection: close\r\n"),
        "\r\n\r\n",
    )
    .await;
    assert!(second.starts_with("HTTP/1.1 304"), "{second}");
    assert_eq!(
        origin.gets.load(Ordering::SeqCst),
        gets,
        "a fresh state is not asked of the origin again"
    );
}

#[tokio::test]
async fn caps_answer_503_with_retry_after() {
    let origin = Origin::with_cache_control("max-age=60");
    origin.set("/doc", "capped");
    let addr = origin.start().await;
    let p = proxy(addr, |c| c.max_subscriptions_per_resource = 1).await;
    let (_first, ok) = exchange(p.addr, &get("/doc", "Subscribe: true\r\n"), "capped").await;
    assert!(ok.starts_with("HTTP/1.1 209"), "{ok}");
    let (_, refused) = exchange(p.addr, &get("/doc", "Subscribe: true\r\n"), "\r\n\r\n").await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 5"),
        "{refused}"
    );
}

#[tokio::test]
async fn cors_preflight_and_exposed_headers() {
    let origin = Origin::with_cache_control("max-age=60");
    origin.set("/doc", "cors");
    let addr = origin.start().await;
    let p = proxy(addr, |c| {
        c.cors_origins = vec!["https://app.example".into()]
    })
    .await;
    let preflight = "OPTIONS /doc HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\nAccess-Control-Request-Method: GET\r\nAccess-Control-Request-Headers: subscribe, parents\r\n\r\n";
    let (_, answer) = exchange(p.addr, preflight, "\r\n\r\n").await;
    let lower = answer.to_ascii_lowercase();
    assert!(answer.starts_with("HTTP/1.1 204"), "{answer}");
    assert!(
        lower.contains("access-control-allow-origin: https://app.example"),
        "{answer}"
    );
    assert!(
        lower.contains("access-control-allow-headers: subscribe, version, parents"),
        "{answer}"
    );
    let (_, sub) = exchange(
        p.addr,
        &get("/doc", "Origin: https://app.example\r\nSubscribe: true\r\n"),
        "cors",
    )
    .await;
    assert!(
        sub.to_ascii_lowercase()
            .contains("access-control-expose-headers: version, parents, current-version"),
        "{sub}"
    );
    let (_, other) = exchange(
        p.addr,
        &get(
            "/doc",
            "Origin: https://evil.example\r\nConnection: close\r\n",
        ),
        "cors",
    )
    .await;
    assert!(
        !other
            .to_ascii_lowercase()
            .contains("access-control-allow-origin"),
        "{other}"
    );
}

#[tokio::test]
async fn an_origin_body_over_the_limit_gives_an_error_update() {
    let origin = Origin::with_cache_control("max-age=60");
    origin.set("/big", vec![b'x'; 4096]);
    let addr = origin.start().await;
    let p = proxy(addr, |c| c.max_body_bytes = 1024).await;
    let (_, text) = exchange(
        p.addr,
        &get("/big", "Subscribe: true\r\n"),
        "max-body-bytes",
    )
    .await;
    assert!(
        text.contains("HTTP/1.1 502 Bad Gateway\r\nVersion: "),
        "{text}"
    );
    // A plain GET of it streams through from the origin instead.
    let (_, plain) = exchange(
        p.addr,
        &get("/big", "Connection: close\r\n"),
        &"x".repeat(4096),
    )
    .await;
    assert!(
        plain.starts_with("HTTP/1.1 200"),
        "{}",
        &plain[..200.min(plain.len())]
    );
}

#[tokio::test]
async fn silent_and_half_sent_connections_are_closed_after_the_header_read_timeout() {
    let origin = Origin::with_cache_control("max-age=60");
    let origin_addr = origin.start().await;
    let proxy = proxy(origin_addr, |c| {
        c.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    for (what, sent) in [
        ("nothing", ""),
        ("part of a request head", "GET / HTTP/1.1\r\nHost: x\r\n"),
        ("part of the h2c preface", "PRI * HTTP/2.0\r\n"),
        (
            "the h2c preface and no request",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ),
    ] {
        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        stream.write_all(sent.as_bytes()).await.expect("write");
        let started = std::time::Instant::now();
        let mut buf = [0u8; 1024];
        // The proxy may answer 408 before closing; read until the end.
        let closed = tokio::time::timeout(WAIT, async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => continue,
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a connection that sent {what} stays open");
        assert!(
            started.elapsed() >= Duration::from_millis(250),
            "a connection that sent {what} was closed before the timeout"
        );
    }
}

/// `braid_proxy_<name>` from the admin listener's metrics.
async fn metric(admin: SocketAddr, name: &str) -> f64 {
    let response = common::get(admin, "/metrics", &[]).await;
    let text = String::from_utf8_lossy(&common::body_of(response).await).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("braid_proxy_{name} ")))
        .unwrap_or_else(|| panic!("no metric {name}"))
        .trim()
        .parse()
        .expect("a number")
}

#[tokio::test]
async fn the_private_cap_refuses_with_503_and_its_count_never_drifts() {
    let origin = Origin::with_cache_control("private");
    origin.set("/page", "for one reader");
    let addr = origin.start().await;
    let p = proxy(addr, |c| {
        c.max_private_resources = 1;
        c.poll_interval = Duration::from_millis(100);
        c.resource_idle = Duration::from_millis(200);
    })
    .await;
    // A credentialed subscription holds the one private slot.
    let credentials = "Subscribe: true\r\nAuthorization: Bearer a\r\n";
    let (held, ok) = exchange(p.addr, &get("/page", credentials), "for one reader").await;
    assert!(ok.starts_with("HTTP/1.1 209"), "{ok}");
    assert_eq!(metric(p.admin, "resources_private").await, 1.0);
    // An anonymous subscription finds the answer private: it needs a slot too.
    let (_, refused) = exchange(p.addr, &get("/page", "Subscribe: true\r\n"), "retry later").await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("(limit 1)"), "the cap is named: {refused}");
    // Both gone and idle: the count is back to 0, never below.
    drop(held);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let private = metric(p.admin, "resources_private").await;
        assert!(private >= 0.0, "the gauge went below 0: {private}");
        if private == 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still {private} private; {} subscriptions, {} resources",
            metric(p.admin, "subscriptions").await,
            metric(p.admin, "resources").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And a credentialed subscription is served again.
    let (_again, ok) = exchange(
        p.addr,
        &get("/page", "Subscribe: true\r\nAuthorization: Bearer b\r\n"),
        "for one reader",
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 209"), "{ok}");
    assert!(metric(p.admin, "resources_private").await <= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_state_over_the_state_cap_is_refused_and_the_count_stays_near_it() {
    // A 1.5 MiB document at every URL: each subscription is new state.
    let body = bytes::Bytes::from(vec![b'x'; 1536 * 1024]);
    let origin =
        common::serve(move |_| http::Response::new(http_body_util::Full::new(body.clone()))).await;
    let cap = 4 * 1024 * 1024;
    let (addr, admin) = common::proxy_for(origin, |c| c.state_bytes = cap).await;
    let (mut held, mut refused) = (Vec::new(), Vec::new());
    for i in 0..6 {
        let path = format!("/doc{i}");
        let response = common::get(addr, &path, &[("subscribe", "true")]).await;
        match response.status().as_u16() {
            209 => held.push(response),
            503 => {
                let text = common::body_of(response).await;
                refused.push(String::from_utf8_lossy(&text).into_owned());
            }
            other => panic!("subscription {i}: {other}"),
        }
    }
    assert!(!held.is_empty(), "the first ones fit");
    assert!(
        !refused.is_empty(),
        "six 1.5 MiB variants do not fit in 4 MiB"
    );
    for reason in &refused {
        assert!(reason.contains("--state-bytes"), "{reason}");
        assert_eq!(reason.trim_end().lines().count(), 1, "{reason}");
    }
    // Held bytes stay within the cap plus the one document that crossed it
    // (body and its snapshot frame).
    let bytes = metric(admin, "state_bytes").await;
    assert!(bytes <= (cap + 2 * 1536 * 1024) as f64, "{bytes}");
    assert_eq!(
        metric(admin, "state_refusals_total").await,
        refused.len() as f64
    );
}
