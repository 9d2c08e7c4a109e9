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
    unchunk(&text[start..])
}

/// The data of chunked bytes (what follows a response head), to the
/// terminating chunk or to the end of the bytes.
pub fn unchunk(chunked: &[u8]) -> Vec<u8> {
    let mut rest = chunked;
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

/// An upstream written by hand on 127.0.0.1:0: for each connection it
/// reads the request head, writes what `answer(head)` gives (the whole
/// response, raw), and keeps the connection open until the proxy closes
/// it. Returns its address.
pub async fn raw_upstream(answer: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> SocketAddr {
    raw_upstream_in_parts(move |head| vec![answer(head)], Duration::ZERO).await
}

/// [`raw_upstream`] that writes its answer in parts, `gap` apart, so that
/// the proxy reads them apart.
pub async fn raw_upstream_in_parts(
    answer: impl Fn(&str) -> Vec<Vec<u8>> + Send + Sync + 'static,
    gap: Duration,
) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answer = std::sync::Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match socket.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                for (i, part) in answer(&String::from_utf8_lossy(&head)).iter().enumerate() {
                    if i > 0 {
                        tokio::time::sleep(gap).await;
                    }
                    if socket.write_all(part).await.is_err() {
                        return;
                    }
                }
                let mut sink = [0u8; 1024];
                while let Ok(n) = socket.read(&mut sink).await {
                    if n == 0 {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Opens a subscription on a connection of its own (closed once the
/// response ends, so that its end can be read); returns the stream after
/// the response head, and the head.
pub async fn subscribe_raw(addr: SocketAddr, path: &str) -> (TcpStream, String) {
    use tokio::io::AsyncWriteExt;
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nSubscribe: true\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    // One byte at a time, so that nothing after the head is read.
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !head.ends_with(b"\r\n\r\n") {
        assert!(Instant::now() < deadline, "no head in time");
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte))
            .await
            .expect("read in time")
            .expect("read");
        assert_eq!(
            n,
            1,
            "closed before a head: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    (stream, String::from_utf8_lossy(&head).into_owned())
}

/// Everything a stream sends until it ends, bounded in time.
pub async fn rest_of(stream: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    out
}
