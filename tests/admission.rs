//! Admission reserves what it admits: subscriptions that arrive together,
//! each making a new state, cannot take the proxy past `--state-bytes`
//! (each reserves its body and snapshot before the body is read).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::wire::metric;
use http::Response;
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1024 * 1024;

/// Opens a subscription and reads its status line; the stream is kept
/// (and not read further) so that the subscription stays open.
async fn open(proxy: std::net::SocketAddr, path: String) -> (u16, TcpStream) {
    let mut stream = TcpStream::connect(proxy).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut byte))
            .await
            .expect("answered in time")
            .expect("read");
        assert_eq!(n, 1, "closed before a status line");
        line.push(byte[0]);
    }
    let status = String::from_utf8_lossy(&line)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    (status, stream)
}

/// An origin where every path is its own 1 MiB document, answered slowly
/// enough that a burst of requests is all in before any body is.
async fn megabyte_origin() -> std::net::SocketAddr {
    let body = Bytes::from(vec![b'x'; MIB]);
    common::serve_async(move |req| {
        let body = body.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Response::builder()
                .header(
                    "etag",
                    format!("\"{}\"", req.uri().path().trim_start_matches('/')),
                )
                .header("content-type", "application/octet-stream")
                .body(Full::new(body))
                .expect("response")
        }
    })
    .await
}

const CAP: usize = 8 * MIB;

fn capped(c: &mut braid_proxy::config::Config) {
    c.state_bytes = CAP;
    c.history_bytes = MIB as u64;
}

/// Opens 20 subscriptions at once, one per document, none read past its
/// status line: some are refused, and what the proxy holds stays within
/// the cap (each state holds its body and its snapshot, 2 MiB).
async fn burst(proxy: std::net::SocketAddr, admin: std::net::SocketAddr) {
    let opened = futures_util::future::join_all((0..20).map(|i| open(proxy, format!("/doc{i}"))));
    let opened = opened.await;
    let admitted = opened.iter().filter(|(status, _)| *status == 209).count();
    let refused = opened.iter().filter(|(status, _)| *status == 503).count();
    assert_eq!(admitted + refused, 20, "209 or 503 only");
    assert!(
        refused > 0,
        "all {admitted} were admitted into a cap of 8 MiB"
    );
    assert!(admitted >= 1, "none admitted");
    let held = metric(admin, "state_bytes").await as usize;
    assert!(
        held <= CAP + CAP / 10,
        "{held} bytes held against a cap of {CAP} with {admitted} subscriptions open"
    );
    drop(opened);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_new_polled_states_stays_within_the_state_cap() {
    let origin = megabyte_origin().await;
    let (proxy, admin) = common::proxy_for(origin, capped).await;
    burst(proxy, admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_new_relayed_sessions_stays_within_the_state_cap() {
    // An edge behind a shield: each subscription opens a relayed session
    // whose first update is the whole 1 MiB document.
    let origin = megabyte_origin().await;
    let (shield, _) = common::proxy_for(origin, |_| {}).await;
    let (edge, admin) = common::proxy_for(shield, capped).await;
    burst(edge, admin).await;
}
