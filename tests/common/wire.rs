//! Raw-socket reading for tests that look at the bytes on the wire.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Reads from `stream` into `seen` until `done(seen)` holds, bounded in time.
pub async fn read_until(stream: &mut TcpStream, seen: &mut Vec<u8>, done: impl Fn(&str) -> bool) {
    let mut buf = [0u8; 16 * 1024];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(&String::from_utf8_lossy(seen)) {
        assert!(
            Instant::now() < deadline,
            "timed out; got {:?}",
            String::from_utf8_lossy(seen)
        );
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("read in time")
            .expect("read");
        assert!(n > 0, "closed; got {:?}", String::from_utf8_lossy(seen));
        seen.extend_from_slice(&buf[..n]);
    }
}

/// The body of a chunked stream, from the end of the head to the
/// terminating chunk or to the end of the bytes.
pub fn dechunk(raw: &[u8]) -> Vec<u8> {
    let text = raw;
    let start = text
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    let mut rest = &text[start..];
    let mut out = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).expect("hex"), 16)
            .expect("chunk size");
        if size == 0 || rest.len() < eol + 2 + size + 2 {
            break;
        }
        out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
        rest = &rest[eol + 2 + size + 2..];
    }
    out
}

/// A metric's value from the admin listener's `/metrics`.
pub async fn metric(admin: SocketAddr, name: &str) -> f64 {
    let text = super::body_of(super::get(admin, "/metrics", &[]).await).await;
    let prefix = format!("braid_proxy_{name} ");
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_string()))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name}"))
}

/// Reads chunked updates from `stream` until `count` versions have come;
/// returns the versions in the order they came.
pub async fn versions_until(
    stream: &mut TcpStream,
    seen: &mut Vec<u8>,
    count: usize,
) -> Vec<String> {
    read_until(stream, seen, |t| {
        t.lines().filter(|l| l.starts_with("Version: ")).count() >= count
    })
    .await;
    versions_in(seen)
}

/// The `Version` of every update in `seen`, in order.
pub fn versions_in(seen: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(seen)
        .lines()
        .filter_map(|l| l.strip_prefix("Version: ").map(str::to_string))
        .collect()
}
