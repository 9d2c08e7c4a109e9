//! Shared by the integration tests: a tiny HTTP/1 server on 127.0.0.1:0.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use braid_proxy::config::{Config, Upstream};
use braid_proxy::listen::server::Server;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

pub mod origin;
pub mod tier;
pub mod wire;

/// Serves `answer` on a fresh loopback port until the test ends; returns the address.
pub async fn serve<F>(answer: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync + 'static,
{
    serve_async(move |req| std::future::ready(answer(req))).await
}

/// As [`serve`], for an answer that awaits (reads the request body, or
/// streams its response).
pub async fn serve_async<F, Fut, B>(answer: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind origin");
    let addr = listener.local_addr().expect("addr");
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let answer = answer.clone();
                    async move { Ok::<_, Infallible>(answer(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// Starts a proxy in front of `origin` on 127.0.0.1:0, polling only every
/// 30 s (changes arrive by refresh, write-through or the proxy's own
/// writes); `tune` adjusts the configuration. Returns (listener, admin).
pub async fn proxy_for(
    origin: SocketAddr,
    tune: impl FnOnce(&mut Config),
) -> (SocketAddr, SocketAddr) {
    let mut config = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
        upstream: Some(Upstream::parse(&format!("http://{origin}")).expect("upstream")),
        poll_interval: Duration::from_secs(30),
        ..Config::default()
    };
    tune(&mut config);
    let server = Server::bind(config).await.expect("bind proxy");
    let addr = server.local_addr().expect("addr");
    let admin = server.admin_addr().expect("admin addr");
    tokio::spawn(server.run(std::future::pending()));
    (addr, admin)
}

/// Sends a GET with `headers` on a new connection, bounded in time.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response<Incoming> {
    request(addr, "GET", path, headers).await
}

/// Sends a request without a body on a new connection, bounded in time.
/// `Host` is the address, unless `headers` names one.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Response<Incoming> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut req = Request::builder().method(method).uri(path);
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        req = req.header("host", addr.to_string());
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req
        .body(http_body_util::Empty::<Bytes>::new())
        .expect("request");
    tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .expect("answered in time")
        .expect("response")
}

/// Writes `request` (whole, with `Connection: close`) on a new connection;
/// the whole answer as text, bounded in time.
pub async fn exchange(addr: SocketAddr, request: String) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out))
        .await
        .expect("answer in time")
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

/// A header's value as text, if it has one.
pub fn header_text(headers: &http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The whole body of a response.
pub async fn body_of(response: Response<Incoming>) -> Bytes {
    use http_body_util::BodyExt;
    response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
}

/// Starts the built binary as `command` says (stdout piped) and reads its
/// first line, the listening banner: returns the child, the client address
/// the banner names (the text line or, with `--log-format json`, the
/// banner event), and the banner line.
pub fn spawn_proxy(command: &mut std::process::Command) -> (std::process::Child, String, String) {
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the binary");
    let stdout = child.stdout.as_mut().expect("stdout");
    let mut banner = Vec::new();
    // Byte by byte, so that nothing after the banner is taken from the pipe.
    let mut byte = [0u8; 1];
    while std::io::Read::read(stdout, &mut byte).expect("banner") == 1 && byte[0] != b'\n' {
        banner.push(byte[0]);
    }
    let banner = String::from_utf8(banner).expect("UTF-8 banner");
    let addr = match banner.strip_prefix("braid-proxy listening on http://") {
        Some(addr) => addr.to_string(),
        None => {
            let event: serde_json::Value = serde_json::from_str(&banner)
                .unwrap_or_else(|e| panic!("the banner is neither text nor JSON ({e}): {banner}"));
            event["listen"]
                .as_str()
                .and_then(|l| l.strip_prefix("http://"))
                .unwrap_or_else(|| panic!("the banner event names no address: {banner}"))
                .to_string()
        }
    };
    (child, addr, banner)
}
