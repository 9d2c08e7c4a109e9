//! No hidden queue below the cursor: with `TCP_NOTSENT_LOWAT` set on client
//! sockets, a subscriber that stops reading while many large updates go by
//! finds, when it reads again, only what its own receive buffer took plus
//! one collapsed update, not a backlog of stale ones kept in the proxy's
//! kernel send buffer. Real sockets on 127.0.0.1:0.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use braid_proxy::config::{Config, Upstream};
use braid_proxy::server::Server;
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

    // The subscriber reads the head and the first snapshot, then stops.
    let mut sub = TcpStream::connect(proxy).await.expect("connect");
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
    assert!(
        updates <= 6,
        "a stalled reader got {updates} updates on resuming, where its receive buffer plus one collapsed update should be a handful"
    );
}
