//! A poll in flight while a patch write lands must not undo the write for
//! subscribers: its answer may show the document from before the write.
//! Real sockets on 127.0.0.1:0.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_proxy::config::{Config, Upstream};
use braid_proxy::listen::server::Server;
use bytes::Bytes;
use http::{Method, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The origin's document: (version number, body).
type Doc = Arc<Mutex<(u64, String)>>;

/// Reads a subscription until `want` appears; returns everything read.
async fn subscribe_until(addr: SocketAddr, want: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"GET /doc HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n")
        .await
        .expect("write");
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(5);
    while !text.contains(want) {
        assert!(
            Instant::now() < deadline,
            "waiting for {want:?}, got:\n{text}"
        );
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("read in time")
            .expect("read");
        assert!(n > 0, "stream ended:\n{text}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poll_in_flight_during_a_patch_write_does_not_undo_it() {
    let doc: Doc = Arc::new(Mutex::new((1, "hello world".to_string())));
    let delay_next_get = Arc::new(AtomicBool::new(false));
    let gets = Arc::new(AtomicUsize::new(0));
    let (state, delay, count) = (doc.clone(), delay_next_get.clone(), gets.clone());
    // An origin that never answers 304 and, when asked, holds one GET's
    // answer (computed on arrival) for 400 ms.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let origin = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (state, delay, count) = (state.clone(), delay.clone(), count.clone());
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let (state, delay, count) = (state.clone(), delay.clone(), count.clone());
                        async move {
                            Ok::<_, std::convert::Infallible>(
                                answer(req, &state, &delay, &count).await,
                            )
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
        upstream: Some(Upstream::parse(&format!("http://{origin}")).expect("upstream")),
        // No poll of its own during the test: only the one the hook asks for.
        poll_interval: Duration::from_secs(60),
        heartbeat: Duration::ZERO,
        ..Config::default()
    };
    let server = Server::bind(config).await.expect("bind");
    let (proxy, admin) = (
        server.local_addr().expect("addr"),
        server.admin_addr().expect("admin"),
    );
    tokio::spawn(server.run(std::future::pending()));

    let _first = subscribe_until(proxy, "hello world").await;
    // A poll goes out and is held at the origin with the old document...
    let before = gets.load(Ordering::SeqCst);
    delay_next_get.store(true, Ordering::SeqCst);
    let refreshed = common::exchange(
        admin,
        "POST /refresh?path=/doc HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".into(),
    )
    .await;
    assert!(refreshed.starts_with("HTTP/1.1 202"), "{refreshed}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while gets.load(Ordering::SeqCst) == before {
        assert!(
            Instant::now() < deadline,
            "the poll never reached the origin"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...while a patch write lands.
    let put = common::exchange(
        proxy,
        "PUT /doc HTTP/1.1\r\nHost: x\r\nParents: \"v1\"\r\nContent-Range: text [5:5]\r\nContent-Length: 6\r\nConnection: close\r\n\r\n, dear".into(),
    )
    .await;
    assert!(put.starts_with("HTTP/1.1 200"), "{put}");
    assert_eq!(doc.lock().expect("lock").1, "hello, dear world");
    // The held answer (the document before the write) arrives now.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let late = subscribe_until(proxy, "\r\n\r\nhello").await;
    let late_body = late.rsplit("\r\n\r\n").next().unwrap_or_default();
    assert!(
        late.contains("hello, dear world"),
        "a new subscriber gets the written document, not the one the late poll saw: {late_body:?}\n{late}"
    );
}

/// The origin's answer: `If-Match` writes, GETs with the current ETag.
async fn answer(
    req: http::Request<hyper::body::Incoming>,
    state: &Doc,
    delay: &AtomicBool,
    count: &AtomicUsize,
) -> Response<Full<Bytes>> {
    let (n, body) = state.lock().expect("lock").clone();
    let etag = format!("\"v{n}\"");
    if req.method() == Method::PUT {
        if req.headers().get("if-match").map(|v| v.as_bytes()) != Some(etag.as_bytes()) {
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() = StatusCode::PRECONDITION_FAILED;
            return r;
        }
        let bytes = req.into_body().collect().await.expect("body").to_bytes();
        *state.lock().expect("lock") = (n + 1, String::from_utf8_lossy(&bytes).into_owned());
        return Response::builder()
            .header("etag", format!("\"v{}\"", n + 1))
            .body(Full::new(Bytes::new()))
            .expect("response");
    }
    count.fetch_add(1, Ordering::SeqCst);
    let response = Response::builder()
        .header("etag", etag)
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(body)))
        .expect("response");
    if delay.swap(false, Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    response
}
