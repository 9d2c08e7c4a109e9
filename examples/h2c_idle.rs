//! Idle density of subscriptions carried as HTTP/2 streams over h2c
//! (issue 20, item 3's stretch goal): opens `--conns` prior-knowledge h2c
//! connections to a running proxy, `--streams` subscriptions on each, waits
//! for every one's first update, then reports the proxy's RSS growth per
//! subscription (VmRSS of `--pid`, after 10 warm-up subscriptions, before
//! and after).
//!
//! ```sh
//! cargo build --release --bin braid-proxy --example h2c_idle
//! target/release/braid-proxy --listen 127.0.0.1:18300 --max-subscriptions 110000 \
//!     --max-subscriptions-per-resource 110000 &
//! target/release/examples/h2c_idle --target 127.0.0.1:18300 --pid $! \
//!     --conns 400 --streams 250 --path /notes.txt
//! ```
//!
//! It exits non-zero when any subscription was refused or none opened.
//! Loopback only (the target must be 127.0.0.0/8 or ::1); every wait is
//! bounded.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

struct Args {
    target: SocketAddr,
    pid: u32,
    conns: usize,
    streams: usize,
    path: String,
}

fn args() -> Args {
    let mut a = Args {
        target: "127.0.0.1:8080".parse().expect("addr"),
        pid: 0,
        conns: 400,
        streams: 250,
        path: "/notes.txt".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--target" => a.target = parse(&flag, &value),
            "--pid" => a.pid = parse(&flag, &value),
            "--conns" => a.conns = parse(&flag, &value),
            "--streams" => a.streams = parse(&flag, &value),
            "--path" => a.path = value,
            _ => fail(&format!("unknown flag {flag}")),
        }
    }
    if !a.target.ip().is_loopback() {
        fail("--target must be a loopback address");
    }
    if a.pid == 0 {
        fail("--pid (the proxy's) is required");
    }
    a
}

fn parse<T: std::str::FromStr>(flag: &str, value: &str) -> T {
    value
        .parse()
        .unwrap_or_else(|_| fail(&format!("bad value for {flag}: {value}")))
}

fn fail(msg: &str) -> ! {
    eprintln!("h2c_idle: {msg}");
    std::process::exit(2);
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| fail(&format!("cannot read the proxy's status: {e}")));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| fail("no VmRSS"))
}

/// One h2c connection's request sender (its connection task spawned).
async fn connect(target: SocketAddr) -> http2::SendRequest<Empty<Bytes>> {
    let tcp = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(target))
        .await
        .unwrap_or_else(|_| fail("connect timed out"))
        .unwrap_or_else(|e| fail(&format!("connect: {e}")));
    let (send, conn) = http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(tcp))
        .await
        .unwrap_or_else(|e| fail(&format!("h2c handshake: {e}")));
    tokio::spawn(conn);
    send
}

/// Opens one subscription and reads its first data frame; the body is
/// returned to be held open. `None` when it was refused or broke.
async fn subscribe(send: &mut http2::SendRequest<Empty<Bytes>>, a: &Args) -> Option<Incoming> {
    let req = Request::get(format!("http://{}{}", a.target, a.path))
        .header("subscribe", "true")
        .body(Empty::new())
        .expect("request");
    send.ready().await.ok()?;
    let response = send.send_request(req).await.ok()?;
    if response.status().as_u16() != 209 {
        return None;
    }
    let mut body = response.into_body();
    loop {
        match body.frame().await? {
            Ok(frame) if frame.data_ref().is_some_and(|d| !d.is_empty()) => return Some(body),
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = Arc::new(args());
    let deadline = Instant::now() + Duration::from_secs(300);
    // Warm-up: the resource exists and the proxy's pools are touched.
    let mut warm = connect(a.target).await;
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(
            subscribe(&mut warm, &a)
                .await
                .unwrap_or_else(|| fail("a warm-up subscription failed")),
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = rss_kib(a.pid);
    let opened = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..a.conns {
        let (a, opened, refused) = (a.clone(), opened.clone(), refused.clone());
        let mut send = connect(a.target).await;
        tasks.push(tokio::spawn(async move {
            // Every stream of this connection at once, each held open.
            let mut pending = futures_util::stream::FuturesUnordered::new();
            for _ in 0..a.streams {
                let mut send = send.clone();
                let a = a.clone();
                pending.push(async move {
                    let body =
                        tokio::time::timeout(Duration::from_secs(120), subscribe(&mut send, &a))
                            .await
                            .ok()
                            .flatten();
                    (body, send)
                });
            }
            let mut bodies = Vec::with_capacity(a.streams);
            while let Some((body, _)) = futures_util::StreamExt::next(&mut pending).await {
                match body {
                    Some(body) => {
                        opened.fetch_add(1, Relaxed);
                        bodies.push(body);
                    }
                    None => {
                        refused.fetch_add(1, Relaxed);
                    }
                }
            }
            send.ready().await.ok();
            (send, bodies)
        }));
    }
    let mut conns = Vec::new();
    for task in tasks {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, task).await {
            Ok(Ok(conn)) => conns.push(conn),
            _ => fail("subscriptions did not open in time"),
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(a.pid);
    let n = opened.load(Relaxed);
    println!(
        "h2c: {n} subscriptions open over {} connections ({} refused): RSS {before} -> {after} KiB, {:.2} KiB each",
        a.conns,
        refused.load(Relaxed),
        (after.saturating_sub(before)) as f64 / n.max(1) as f64
    );
    drop((conns, held, warm));
    // A refusal means the figure is not of what was asked (raise the
    // proxy's --max-subscriptions, --max-streams-per-connection).
    if n == 0 || refused.load(Relaxed) > 0 {
        std::process::exit(1);
    }
}
