//! Integration tests of plain pass-through proxying (issue "Foundation").
//!
//! Every test starts a real origin (a small hyper server on 127.0.0.1:0 that
//! records the requests it got) and the proxy in-process, then talks to the
//! proxy with hyper's client or with raw bytes over a `TcpStream`.
//!
//! A plain GET may be answered from the proxy's shared resource state (the
//! Braid side), which makes its own requests to the origin. Tests of pure
//! pass-through therefore use other methods or [`support::personal_get`]
//! (a GET with credentials, which is never shared); a few tests check that
//! both GET routes agree on bodies, statuses and upstream failures.
//!
//! Sections:
//! - `support`: origin, proxy, clients, bodies and the raw HTTP/1.1 helper.
//! - `pass_through`: bodies, statuses, end-to-end headers, methods, queries, prefixes.
//! - `hop_by_hop`: hop-by-hop stripping both ways, `Via`, `X-Forwarded-*`, `Host`.
//! - `streaming`: responses and uploads flow before the other side has finished.
//! - `upstream_failures`: 502 and 504.
//! - `refusals`: open-proxy refusals, header limits, dot segments, loops.
//! - `h2c`: HTTP/2 with prior knowledge.
//! - `shutdown`: graceful shutdown.
//! - `config`: configuration errors and precedence, in-process and via the binary.

mod support {
    use std::convert::Infallible;
    use std::future::Future;
    use std::net::SocketAddr;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll};
    use std::time::Duration;

    use braid_proxy::config::{Config, Upstream};
    use braid_proxy::listen::server::Server;
    use bytes::Bytes;
    use http::{HeaderMap, Method, Request, Response, Uri};
    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Full};
    use hyper::body::{Frame, Incoming};
    use hyper::service::service_fn;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::{mpsc, oneshot};
    use tokio::task::JoinHandle;

    pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
    /// The body type of every request the tests send and every response the origin sends.
    pub type TestBody = BoxBody<Bytes, BoxError>;
    pub type TestClient = Client<HttpConnector, TestBody>;

    /// The longest any single wait in these tests may take.
    pub const WAIT: Duration = Duration::from_secs(5);
    /// The proxy id every test proxy runs with.
    pub const PROXY_ID: &str = "test-proxy-7";

    /// Awaits `fut`, failing the test if it takes longer than [`WAIT`].
    pub async fn within<F: Future>(what: &str, fut: F) -> F::Output {
        match tokio::time::timeout(WAIT, fut).await {
            Ok(output) => output,
            Err(_) => panic!("timed out after {WAIT:?}: {what}"),
        }
    }

    // ---------------------------------------------------------------- bodies

    pub fn full(bytes: impl Into<Bytes>) -> TestBody {
        Full::new(bytes.into())
            .map_err(|never| match never {})
            .boxed()
    }

    pub fn empty() -> TestBody {
        full(Bytes::new())
    }

    /// A body fed chunk by chunk through a channel; it ends when the sender is dropped.
    pub struct ChannelBody {
        rx: mpsc::Receiver<Bytes>,
    }

    impl hyper::body::Body for ChannelBody {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.rx
                .poll_recv(cx)
                .map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes))))
        }
    }

    /// A streaming body and the sender that feeds it.
    pub fn channel_body() -> (mpsc::Sender<Bytes>, TestBody) {
        let (tx, rx) = mpsc::channel(8);
        (tx, ChannelBody { rx }.boxed())
    }

    /// `0..=255` repeated until `len` bytes.
    pub fn binary_bytes(len: usize) -> Bytes {
        (0..len)
            .map(|i| (i % 256) as u8)
            .collect::<Vec<u8>>()
            .into()
    }

    /// Reads the next data frame of a body, skipping non-data frames.
    pub async fn next_data(body: &mut Incoming) -> Option<Bytes> {
        while let Some(frame) = body.frame().await {
            let frame = frame.expect("a body frame");
            if let Ok(data) = frame.into_data() {
                return Some(data);
            }
        }
        None
    }

    // ---------------------------------------------------------------- origin

    /// What the origin saw of one request.
    #[derive(Debug, Clone)]
    pub struct Seen {
        pub method: Method,
        pub uri: Uri,
        pub headers: HeaderMap,
    }

    impl Seen {
        pub fn path_and_query(&self) -> &str {
            self.uri.path_and_query().map(|p| p.as_str()).unwrap_or("")
        }
    }

    /// A hyper HTTP/1.1 origin on 127.0.0.1:0 that records every request head.
    pub struct Origin {
        pub addr: SocketAddr,
        seen: Arc<Mutex<Vec<Seen>>>,
        accept_loop: JoinHandle<()>,
    }

    impl Origin {
        pub async fn start<F, Fut>(handler: F) -> Origin
        where
            F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Response<TestBody>> + Send + 'static,
        {
            let listener = TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind the origin");
            let addr = listener.local_addr().expect("origin address");
            let seen = Arc::new(Mutex::new(Vec::new()));
            let handler = Arc::new(handler);
            let recorder = seen.clone();
            let accept_loop = tokio::spawn(async move {
                // Runs until the origin is dropped (which aborts it) or accept fails.
                while let Ok((stream, _)) = listener.accept().await {
                    let handler = handler.clone();
                    let recorder = recorder.clone();
                    tokio::spawn(async move {
                        let service = service_fn(move |req: Request<Incoming>| {
                            recorder.lock().expect("origin record lock").push(Seen {
                                method: req.method().clone(),
                                uri: req.uri().clone(),
                                headers: req.headers().clone(),
                            });
                            let response = (*handler)(req);
                            async move { Ok::<_, Infallible>(response.await) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
            Origin {
                addr,
                seen,
                accept_loop,
            }
        }

        /// An origin answering with [`echo`].
        pub async fn echo() -> Origin {
            Origin::start(echo).await
        }

        pub fn url(&self) -> String {
            format!("http://{}", self.addr)
        }

        pub fn seen(&self) -> Vec<Seen> {
            self.seen.lock().expect("origin record lock").clone()
        }

        /// The one request the origin got; fails unless there was exactly one.
        pub fn only_request(&self) -> Seen {
            let seen = self.seen();
            assert_eq!(
                seen.len(),
                1,
                "expected the origin to get exactly one request, got {seen:#?}"
            );
            seen.into_iter().next().expect("one request")
        }
    }

    impl Drop for Origin {
        fn drop(&mut self) {
            self.accept_loop.abort();
        }
    }

    /// Echoes the request body back. The status is taken from `x-want-status`
    /// (default 200); the response carries `x-echo-method`, `x-echo-uri`,
    /// `x-origin: echo` and two `set-cookie` headers.
    pub async fn echo(req: Request<Incoming>) -> Response<TestBody> {
        let status = req
            .headers()
            .get("x-want-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u16>().ok())
            .unwrap_or(200);
        let method = req.method().to_string();
        let uri = req.uri().to_string();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        Response::builder()
            .status(status)
            .header("x-echo-method", method)
            .header("x-echo-uri", uri)
            .header("x-origin", "echo")
            .header("set-cookie", "a=1; Path=/")
            .header("set-cookie", "b=2; Path=/")
            .body(full(body))
            .expect("echo response")
    }

    /// A TCP listener that accepts connections and never answers on them.
    pub struct SilentOrigin {
        pub addr: SocketAddr,
        task: JoinHandle<()>,
    }

    impl SilentOrigin {
        pub async fn start() -> SilentOrigin {
            let listener = TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind the silent origin");
            let addr = listener.local_addr().expect("silent origin address");
            let task = tokio::spawn(async move {
                let mut held = Vec::new();
                while let Ok((stream, _)) = listener.accept().await {
                    held.push(stream);
                }
            });
            SilentOrigin { addr, task }
        }
    }

    impl Drop for SilentOrigin {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// An address nothing listens on: bind a port, then free it.
    pub async fn closed_port() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a port to free");
        let addr = listener.local_addr().expect("freed address");
        drop(listener);
        addr
    }

    // ----------------------------------------------------------------- proxy

    /// The proxy running in-process on 127.0.0.1:0.
    pub struct Proxy {
        pub addr: SocketAddr,
        shutdown: Option<oneshot::Sender<()>>,
        task: JoinHandle<Result<(), BoxError>>,
    }

    impl Proxy {
        /// Starts a proxy for `upstream` (a URL) with test defaults, adjusted by `configure`.
        pub async fn start(upstream: &str, configure: impl FnOnce(&mut Config)) -> Proxy {
            let mut config = Config {
                listen: "127.0.0.1:0".parse().expect("listen address"),
                upstream: Some(Upstream::parse(upstream).expect("upstream URL")),
                proxy_id: PROXY_ID.to_string(),
                shutdown_grace: Duration::from_secs(3),
                ..Config::default()
            };
            configure(&mut config);
            let server = Server::bind(config).await.expect("bind the proxy");
            let addr = server.local_addr().expect("proxy address");
            let (tx, rx) = oneshot::channel::<()>();
            let task = tokio::spawn(server.run(async {
                let _ = rx.await;
            }));
            Proxy {
                addr,
                shutdown: Some(tx),
                task,
            }
        }

        /// A proxy in front of `origin` with the default test configuration.
        pub async fn for_origin(origin: &Origin) -> Proxy {
            Proxy::start(&origin.url(), |_| {}).await
        }

        pub fn url(&self, path_and_query: &str) -> String {
            format!("http://{}{}", self.addr, path_and_query)
        }

        /// Triggers graceful shutdown.
        pub fn begin_shutdown(&mut self) {
            if let Some(tx) = self.shutdown.take() {
                let _ = tx.send(());
            }
        }

        /// Waits for the server task to end and returns what `Server::run` returned.
        pub async fn finished(&mut self) -> Result<(), BoxError> {
            within("the proxy's server task to end", &mut self.task)
                .await
                .expect("the proxy's server task panicked")
        }
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    // --------------------------------------------------------------- clients

    pub fn http1_client() -> TestClient {
        Client::builder(TokioExecutor::new()).build_http()
    }

    pub fn h2c_client() -> TestClient {
        Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http()
    }

    /// Sends a request and collects the whole response.
    pub async fn fetch(
        client: &TestClient,
        req: Request<TestBody>,
    ) -> (http::response::Parts, Bytes) {
        let what = format!("{} {}", req.method(), req.uri());
        within(&format!("the response to {what}"), async {
            let response = client
                .request(req)
                .await
                .unwrap_or_else(|e| panic!("{what} through the proxy failed: {e:?}"));
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .unwrap_or_else(|e| panic!("reading the body of {what} failed: {e:?}"))
                .to_bytes();
            (parts, body)
        })
        .await
    }

    /// `GET url` with an empty body. A plain GET like this one may be
    /// answered from the proxy's shared resource state.
    pub fn get(url: &str) -> Request<TestBody> {
        Request::get(url).body(empty()).expect("GET request")
    }

    /// Credentials that make a GET personal, so the proxy passes it through
    /// instead of answering it from shared state.
    pub const PERSONAL: (&str, &str) = ("authorization", "Bearer passthrough-test");

    /// `GET url` carrying [`PERSONAL`] credentials: always a pass-through.
    pub fn personal_get(url: &str) -> Request<TestBody> {
        Request::get(url)
            .header(PERSONAL.0, PERSONAL.1)
            .body(empty())
            .expect("GET request")
    }

    /// Every value of a header, as strings.
    pub fn values(headers: &HeaderMap, name: &str) -> Vec<String> {
        headers
            .get_all(name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect()
    }

    /// The single value of a header; fails if it is missing.
    pub fn value(headers: &HeaderMap, name: &str) -> String {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_else(|| panic!("header `{name}` missing from {headers:#?}"))
    }

    // ---------------------------------------------------------- raw HTTP/1.1

    /// A response read off a raw socket.
    #[derive(Debug)]
    pub struct RawResponse {
        pub status: u16,
        pub headers: Vec<(String, String)>,
        pub body: Vec<u8>,
    }

    impl RawResponse {
        pub fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }

        pub fn body_text(&self) -> String {
            String::from_utf8_lossy(&self.body).into_owned()
        }
    }

    /// Writes `request` verbatim to the proxy and reads one response: up to
    /// its `Content-Length`, or to end of stream when it has none.
    pub async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> RawResponse {
        within("a raw HTTP/1.1 exchange with the proxy", async {
            let mut stream = TcpStream::connect(addr)
                .await
                .expect("connect to the proxy");
            // The proxy may refuse before it has read everything; that is fine.
            let _ = stream.write_all(request).await;
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            loop {
                if let Some(response) = parse_raw(&buf, false) {
                    return response;
                }
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            parse_raw(&buf, true).unwrap_or_else(|| {
                panic!(
                    "no complete HTTP response from the proxy; got {:?}",
                    String::from_utf8_lossy(&buf)
                )
            })
        })
        .await
    }

    fn parse_raw(buf: &[u8], at_eof: bool) -> Option<RawResponse> {
        let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&buf[..head_end]);
        let mut lines = head.split("\r\n");
        let status_line = lines.next()?;
        let status = status_line.split_whitespace().nth(1)?.parse().ok()?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        let rest = &buf[head_end + 4..];
        let length = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse::<usize>().ok());
        let body = match length {
            Some(n) if rest.len() >= n => rest[..n].to_vec(),
            Some(_) => return None,
            None if at_eof => rest.to_vec(),
            None => return None,
        };
        Some(RawResponse {
            status,
            headers,
            body,
        })
    }
}

// ============================================================================

mod pass_through {
    use crate::support::*;
    use bytes::Bytes;
    use http::{Method, Request, StatusCode};

    async fn post_and_echo(body: Bytes) {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();
        let req = Request::post(proxy.url("/upload"))
            .header("content-type", "application/octet-stream")
            .body(full(body.clone()))
            .expect("request");
        let (parts, echoed) = fetch(&client, req).await;
        assert_eq!(parts.status, StatusCode::OK);
        assert_eq!(
            echoed.len(),
            body.len(),
            "echoed body length differs from the sent one"
        );
        assert!(echoed == body, "echoed body differs from the sent bytes");
        assert_eq!(origin.only_request().method, Method::POST);
    }

    #[tokio::test]
    async fn binary_body_is_byte_identical() {
        post_and_echo(binary_bytes(256 * 64)).await;
    }

    #[tokio::test]
    async fn five_megabyte_body_is_byte_identical() {
        post_and_echo(binary_bytes(5 * 1024 * 1024 + 17)).await;
    }

    #[tokio::test]
    async fn empty_body_stays_empty() {
        post_and_echo(Bytes::new()).await;
    }

    /// An origin answering GETs: `/blob` with 5 MB of binary bytes, and
    /// `/status/<code>` with that status and a short body.
    async fn get_origin() -> Origin {
        Origin::start(|req: Request<hyper::body::Incoming>| async move {
            let path = req.uri().path().to_string();
            if path == "/blob" {
                return http::Response::builder()
                    .header("content-type", "application/octet-stream")
                    .body(full(binary_bytes(5 * 1024 * 1024 + 3)))
                    .expect("blob response");
            }
            let status = path
                .strip_prefix("/status/")
                .and_then(|s| s.parse::<u16>().ok())
                .unwrap_or(200);
            http::Response::builder()
                .status(status)
                .header("content-type", "text/plain")
                .body(full(format!("GET status {status}")))
                .expect("status response")
        })
        .await
    }

    #[tokio::test]
    async fn get_bodies_and_statuses_pass_through_on_both_routes() {
        let origin = get_origin().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();
        let blob = binary_bytes(5 * 1024 * 1024 + 3);
        for (kind, req) in [
            ("plain GET", get(&proxy.url("/blob"))),
            ("personal GET", personal_get(&proxy.url("/blob"))),
        ] {
            let (parts, body) = fetch(&client, req).await;
            assert_eq!(parts.status, StatusCode::OK, "{kind} /blob");
            assert_eq!(body.len(), blob.len(), "{kind}: body length changed");
            assert!(body == blob, "{kind}: the binary body was changed");
        }
        for status in [200u16, 201, 404, 418, 500] {
            let path = format!("/status/{status}");
            for (kind, req) in [
                ("plain GET", get(&proxy.url(&path))),
                ("personal GET", personal_get(&proxy.url(&path))),
            ] {
                let (parts, body) = fetch(&client, req).await;
                assert_eq!(
                    parts.status.as_u16(),
                    status,
                    "{kind} {path}: status changed"
                );
                assert_eq!(
                    body,
                    format!("GET status {status}").as_bytes(),
                    "{kind} {path}: body changed"
                );
            }
        }
    }

    #[tokio::test]
    async fn status_codes_pass_through() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();
        for status in [200u16, 201, 404, 418, 500] {
            let req = Request::post(proxy.url("/status"))
                .header("x-want-status", status.to_string())
                .body(full(format!("body of a {status}")))
                .expect("request");
            let (parts, body) = fetch(&client, req).await;
            assert_eq!(parts.status.as_u16(), status, "status {status} was changed");
            assert_eq!(
                body,
                format!("body of a {status}").as_bytes(),
                "the body of the {status} response was changed"
            );
        }
        assert_eq!(
            origin.seen().len(),
            5,
            "every request should reach the origin"
        );
    }

    #[tokio::test]
    async fn end_to_end_headers_pass_unchanged() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();
        let req = Request::get(proxy.url("/headers"))
            .header("x-custom", "some value, with: punctuation")
            .header("x-multi", "first")
            .header("x-multi", "second")
            .header("authorization", "Bearer abc.def")
            .header("accept", "application/json")
            .header("user-agent", "passthrough-test/1")
            .header("cookie", "session=42")
            .body(empty())
            .expect("request");
        let (parts, _) = fetch(&client, req).await;
        assert_eq!(parts.status, StatusCode::OK);

        let seen = origin.only_request().headers;
        assert_eq!(value(&seen, "x-custom"), "some value, with: punctuation");
        assert_eq!(values(&seen, "x-multi"), ["first", "second"]);
        assert_eq!(value(&seen, "authorization"), "Bearer abc.def");
        assert_eq!(value(&seen, "accept"), "application/json");
        assert_eq!(value(&seen, "user-agent"), "passthrough-test/1");
        assert_eq!(value(&seen, "cookie"), "session=42");

        assert_eq!(value(&parts.headers, "x-origin"), "echo");
        assert_eq!(
            values(&parts.headers, "set-cookie"),
            ["a=1; Path=/", "b=2; Path=/"],
            "both set-cookie headers should reach the client in order"
        );
    }

    #[tokio::test]
    async fn obs_text_header_bytes_pass_unchanged() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let request = b"POST /latin HTTP/1.1\r\nHost: proxy.test\r\nX-Latin: caf\xe9\r\n\
Content-Length: 0\r\nConnection: close\r\n\r\n";
        let response = raw_exchange(proxy.addr, request).await;
        assert_eq!(response.status, 200, "got {response:?}");
        let seen = origin.only_request().headers;
        assert_eq!(
            seen.get("x-latin").map(|v| v.as_bytes()),
            Some(&b"caf\xe9"[..]),
            "a header value with a non-ASCII byte should arrive byte for byte"
        );
    }

    #[tokio::test]
    async fn every_method_and_query_string_arrives_unchanged() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();
        let methods = [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
            Method::OPTIONS,
        ];
        let target = "/items/a%20b/%E2%9C%93?a=1&b=two%20words&empty=&a=2&x=%2Fslash";
        for method in &methods {
            let req = Request::builder()
                .method(method.clone())
                .uri(proxy.url(target))
                .header(PERSONAL.0, PERSONAL.1)
                .body(full(format!("{method} body")))
                .expect("request");
            let (parts, body) = fetch(&client, req).await;
            assert_eq!(
                parts.status,
                StatusCode::OK,
                "{method} was not passed through"
            );
            assert_eq!(value(&parts.headers, "x-echo-method"), method.as_str());
            assert_eq!(body, format!("{method} body").as_bytes());
        }
        let seen = origin.seen();
        assert_eq!(seen.len(), methods.len());
        for (request, method) in seen.iter().zip(&methods) {
            assert_eq!(&request.method, method, "the method was changed");
            assert_eq!(
                request.path_and_query(),
                target,
                "the path or query of a {method} was changed"
            );
        }
    }

    #[tokio::test]
    async fn upstream_path_prefix_is_prepended() {
        let origin = Origin::echo().await;
        let proxy = Proxy::start(&format!("{}/api", origin.url()), |_| {}).await;
        let client = http1_client();
        for (sent, expected) in [
            ("/x?y=1", "/api/x?y=1"),
            ("/", "/api/"),
            ("/a/b", "/api/a/b"),
        ] {
            let (parts, _) = fetch(&client, personal_get(&proxy.url(sent))).await;
            assert_eq!(parts.status, StatusCode::OK);
            let seen = origin.seen();
            let last = seen.last().expect("the origin got the request");
            assert_eq!(
                last.path_and_query(),
                expected,
                "`{sent}` should map to `{expected}` under the /api prefix"
            );
        }
    }
}

// ============================================================================

mod hop_by_hop {
    use crate::support::*;
    use http::{Request, Response, StatusCode};

    /// Request headers a proxy must not forward.
    const REQUEST_HOP_HEADERS: [&str; 6] = [
        "connection",
        "x-hop",
        "x-other-hop",
        "keep-alive",
        "te",
        "proxy-authorization",
    ];

    #[tokio::test]
    async fn request_hop_by_hop_headers_do_not_reach_the_origin() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();
        let req = Request::get(proxy.url("/hop"))
            .header(PERSONAL.0, PERSONAL.1)
            .header("connection", "X-Hop, x-other-hop")
            .header("x-hop", "1")
            .header("x-other-hop", "2")
            .header("keep-alive", "timeout=5, max=100")
            .header("te", "trailers")
            .header("proxy-authorization", "Basic dXNlcjpwYXNz")
            .header("x-end-to-end", "kept")
            .body(empty())
            .expect("request");
        let (parts, _) = fetch(&client, req).await;
        assert_eq!(parts.status, StatusCode::OK);
        let seen = origin.only_request().headers;
        for name in REQUEST_HOP_HEADERS {
            assert!(
                !seen.contains_key(name),
                "hop-by-hop request header `{name}` reached the origin: {seen:#?}"
            );
        }
        assert_eq!(value(&seen, "x-end-to-end"), "kept");
    }

    async fn hop_response(_req: Request<hyper::body::Incoming>) -> Response<TestBody> {
        Response::builder()
            .header("connection", "x-secret")
            .header("x-secret", "s3cr3t")
            .header("keep-alive", "timeout=5")
            .header("proxy-authenticate", "Basic realm=\"origin\"")
            .header("trailer", "x-checksum")
            .header("x-kept", "yes")
            .body(full("hop"))
            .expect("hop response")
    }

    #[tokio::test]
    async fn response_hop_by_hop_headers_do_not_reach_the_client() {
        let origin = Origin::start(hop_response).await;
        let proxy = Proxy::for_origin(&origin).await;
        let (parts, body) = fetch(&http1_client(), personal_get(&proxy.url("/hop"))).await;
        assert_eq!(parts.status, StatusCode::OK);
        assert_eq!(body, "hop");
        let headers = &parts.headers;
        for name in ["x-secret", "keep-alive", "proxy-authenticate", "trailer"] {
            assert!(
                !headers.contains_key(name),
                "hop-by-hop response header `{name}` reached the client: {headers:#?}"
            );
        }
        for connection in values(headers, "connection") {
            assert!(
                !connection.to_ascii_lowercase().contains("x-secret"),
                "the origin's Connection header reached the client: {connection}"
            );
        }
        assert_eq!(value(headers, "x-kept"), "yes");
        assert!(
            values(headers, "via")
                .iter()
                .any(|v| v.contains(&format!("1.1 {PROXY_ID}"))),
            "the response should carry `Via: 1.1 {PROXY_ID}`: {headers:#?}"
        );
    }

    #[tokio::test]
    async fn via_and_forwarded_headers_are_added() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();

        // A first request without prior forwarding headers.
        fetch(&client, personal_get(&proxy.url("/plain"))).await;
        // A second one that already went through another proxy.
        let req = Request::get(proxy.url("/forwarded"))
            .header(PERSONAL.0, PERSONAL.1)
            .header("via", "1.0 edge-cache")
            .header("x-forwarded-for", "203.0.113.7")
            .body(empty())
            .expect("request");
        fetch(&client, req).await;

        let seen = origin.seen();
        assert_eq!(seen.len(), 2);
        let plain = &seen[0].headers;
        assert_eq!(values(plain, "via"), [format!("1.1 {PROXY_ID}")]);
        assert_eq!(value(plain, "x-forwarded-for"), "127.0.0.1");
        assert_eq!(value(plain, "x-forwarded-proto"), "http");
        assert_eq!(value(plain, "x-forwarded-host"), proxy.addr.to_string());

        let forwarded = &seen[1].headers;
        let via = values(forwarded, "via").join(", ");
        assert_eq!(
            via,
            format!("1.0 edge-cache, 1.1 {PROXY_ID}"),
            "this proxy's Via entry should follow the existing one"
        );
        assert_eq!(
            values(forwarded, "x-forwarded-for"),
            ["203.0.113.7, 127.0.0.1"],
            "the client's address should be appended to X-Forwarded-For"
        );
    }

    #[tokio::test]
    async fn http_1_0_requests_get_a_1_0_via_entry() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let response = raw_exchange(
            proxy.addr,
            b"GET /old HTTP/1.0\r\nHost: proxy.test\r\nAuthorization: Bearer x\r\n\r\n",
        )
        .await;
        assert_eq!(response.status, 200, "got {response:?}");
        let seen = origin.only_request().headers;
        assert_eq!(values(&seen, "via"), [format!("1.0 {PROXY_ID}")]);
    }

    #[tokio::test]
    async fn every_x_forwarded_for_line_is_kept() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let request = b"GET /xff HTTP/1.1\r\nHost: proxy.test\r\nAuthorization: Bearer x\r\n\
X-Forwarded-For: 198.51.100.1\r\nX-Forwarded-For: 198.51.100.2\r\nConnection: close\r\n\r\n";
        let response = raw_exchange(proxy.addr, request).await;
        assert_eq!(response.status, 200, "got {response:?}");
        let seen = origin.only_request().headers;
        assert_eq!(
            values(&seen, "x-forwarded-for").join(", "),
            "198.51.100.1, 198.51.100.2, 127.0.0.1",
            "two X-Forwarded-For lines mean the same as one comma-joined line"
        );
    }

    #[tokio::test]
    async fn host_naming_another_host_changes_nothing_upstream() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();
        let req = Request::get(proxy.url("/host"))
            .header(PERSONAL.0, PERSONAL.1)
            .header("host", "other.example.com")
            .body(empty())
            .expect("request");
        let (parts, _) = fetch(&client, req).await;
        assert_eq!(parts.status, StatusCode::OK);
        let seen = origin.only_request();
        assert_eq!(seen.path_and_query(), "/host");
        assert_eq!(
            values(&seen.headers, "host"),
            [origin.addr.to_string()],
            "the origin should see its own authority as Host"
        );
        assert_eq!(
            value(&seen.headers, "x-forwarded-host"),
            "other.example.com"
        );
    }
}

// ============================================================================

mod streaming {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use crate::support::*;
    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use tokio::sync::{mpsc, oneshot};

    #[tokio::test]
    async fn response_bytes_arrive_before_the_origin_finishes() {
        let (release_tx, release_rx) = oneshot::channel::<()>();
        let release = Arc::new(Mutex::new(Some(release_rx)));
        let finished = Arc::new(AtomicBool::new(false));
        let origin = {
            let finished = finished.clone();
            Origin::start(move |_req| {
                let release = release.lock().expect("release lock").take();
                let finished = finished.clone();
                async move {
                    let (tx, body) = channel_body();
                    tokio::spawn(async move {
                        let _ = tx.send(Bytes::from_static(b"first chunk")).await;
                        if let Some(release) = release {
                            let _ = release.await;
                        }
                        let _ = tx.send(Bytes::from_static(b" and the rest")).await;
                        finished.store(true, Ordering::SeqCst);
                    });
                    Response::new(body)
                }
            })
            .await
        };
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();

        let response = within(
            "response headers while the origin is still sending",
            client.request(personal_get(&proxy.url("/stream"))),
        )
        .await
        .expect("streamed response");
        assert_eq!(response.status(), StatusCode::OK);
        let mut body = response.into_body();
        let first = within("the first chunk", next_data(&mut body)).await;
        assert_eq!(first.as_deref(), Some(&b"first chunk"[..]));
        assert!(
            !finished.load(Ordering::SeqCst),
            "the origin should still be holding its body open"
        );

        release_tx.send(()).expect("release the origin");
        let rest = within("the rest of the body", body.collect())
            .await
            .expect("the rest of the body")
            .to_bytes();
        assert_eq!(rest, " and the rest");
        assert!(finished.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn expect_100_continue_upload_passes_through() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let request = b"POST /expect HTTP/1.1\r\nHost: proxy.test\r\nExpect: 100-continue\r\n\
Content-Length: 5\r\nConnection: close\r\n\r\nhello";
        let response = raw_exchange(proxy.addr, request).await;
        // raw_exchange stops at the first response head: an interim 100 without a body.
        let final_part = match response.status {
            100 => response.body_text(),
            other => panic!("expected an interim 100 Continue first, got {other}: {response:?}"),
        };
        assert!(
            final_part.starts_with("HTTP/1.1 200"),
            "the final response should be the origin's 200, got {final_part:?}"
        );
        assert!(final_part.ends_with("\r\n\r\nhello"), "got {final_part:?}");
        assert_eq!(origin.only_request().method, http::Method::POST);
    }

    #[tokio::test]
    async fn upload_bytes_arrive_before_the_client_finishes() {
        let (first_tx, mut first_rx) = mpsc::unbounded_channel::<Bytes>();
        let origin = Origin::start(move |req: Request<Incoming>| {
            let first_tx = first_tx.clone();
            async move {
                let mut body = req.into_body();
                let mut received = Vec::new();
                if let Some(first) = next_data(&mut body).await {
                    received.extend_from_slice(&first);
                    let _ = first_tx.send(first);
                }
                while let Some(chunk) = next_data(&mut body).await {
                    received.extend_from_slice(&chunk);
                }
                Response::new(full(received))
            }
        })
        .await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = http1_client();

        let (body_tx, body) = channel_body();
        let req = Request::post(proxy.url("/upload"))
            .body(body)
            .expect("request");
        let in_flight = tokio::spawn(async move { fetch(&client, req).await });

        body_tx
            .send(Bytes::from_static(b"part one"))
            .await
            .expect("send the first chunk");
        let first = within(
            "the origin to receive the first chunk while the upload is open",
            first_rx.recv(),
        )
        .await;
        assert_eq!(first.as_deref(), Some(&b"part one"[..]));

        body_tx
            .send(Bytes::from_static(b", part two"))
            .await
            .expect("send the second chunk");
        drop(body_tx);
        let (parts, echoed) = within("the upload's response", in_flight)
            .await
            .expect("the upload task");
        assert_eq!(parts.status, StatusCode::OK);
        assert_eq!(echoed, "part one, part two");
    }
}

// ============================================================================

mod upstream_failures {
    use std::time::{Duration, Instant};

    use crate::support::*;
    use http::{Request, StatusCode};

    /// One request of each route kind: a plain GET (shared state), a
    /// personal GET and a POST (both pass-through).
    fn each_route(proxy: &Proxy, path: &str) -> Vec<(&'static str, Request<TestBody>)> {
        vec![
            ("plain GET", get(&proxy.url(path))),
            ("personal GET", personal_get(&proxy.url(path))),
            (
                "POST",
                Request::post(proxy.url(path))
                    .body(full("payload"))
                    .expect("request"),
            ),
        ]
    }

    #[tokio::test]
    async fn closed_upstream_port_gives_502_with_a_text_reason() {
        let addr = closed_port().await;
        let proxy = Proxy::start(&format!("http://{addr}"), |_| {}).await;
        let client = http1_client();
        for (kind, req) in each_route(&proxy, "/down") {
            let (parts, body) = fetch(&client, req).await;
            assert_eq!(parts.status, StatusCode::BAD_GATEWAY, "{kind}");
            let content_type = value(&parts.headers, "content-type");
            assert!(
                content_type.starts_with("text/plain"),
                "{kind}: a 502 should be text/plain, got {content_type}"
            );
            let text = String::from_utf8_lossy(&body);
            assert!(
                text.contains("upstream") && text.contains("unreachable"),
                "{kind}: the 502 body should say what failed, got {text:?}"
            );
            assert!(
                text.trim().lines().count() == 1 && text.len() < 1024,
                "{kind}: the 502 body should be one short line, got {text:?}"
            );
        }
    }

    #[tokio::test]
    async fn silent_origin_gives_504_after_the_response_timeout() {
        let silent = SilentOrigin::start().await;
        let proxy = Proxy::start(&format!("http://{}", silent.addr), |c| {
            c.response_timeout = Duration::from_millis(500);
        })
        .await;
        let client = http1_client();
        for (kind, req) in each_route(&proxy, "/slow") {
            let started = Instant::now();
            let (parts, body) = fetch(&client, req).await;
            let elapsed = started.elapsed();
            assert_eq!(parts.status, StatusCode::GATEWAY_TIMEOUT, "{kind}");
            assert!(
                elapsed >= Duration::from_millis(450) && elapsed < Duration::from_secs(3),
                "{kind}: the 504 should come after about 500 ms, came after {elapsed:?}"
            );
            assert!(value(&parts.headers, "content-type").starts_with("text/plain"));
            let text = String::from_utf8_lossy(&body);
            assert!(
                text.contains("timed out"),
                "{kind}: the 504 body should say what failed, got {text:?}"
            );
        }
    }
}

// ============================================================================

mod refusals {
    use crate::support::*;

    /// Sends raw bytes to a fresh proxy and checks the status, and that the origin saw nothing.
    async fn refused(
        request: &[u8],
        expected: u16,
        configure: impl FnOnce(&mut braid_proxy::config::Config),
    ) -> RawResponse {
        let origin = Origin::echo().await;
        let proxy = Proxy::start(&origin.url(), configure).await;
        let response = raw_exchange(proxy.addr, request).await;
        assert_eq!(
            response.status,
            expected,
            "expected {expected} for {:?}, got {response:?}",
            String::from_utf8_lossy(&request[..request.len().min(120)])
        );
        assert!(
            origin.seen().is_empty(),
            "a refused request reached the origin: {:#?}",
            origin.seen()
        );
        response
    }

    fn request_with_headers(extra: &[(String, String)]) -> Vec<u8> {
        let mut text = String::from("GET /limits HTTP/1.1\r\nHost: proxy.test\r\n");
        for (name, value) in extra {
            text.push_str(&format!("{name}: {value}\r\n"));
        }
        text.push_str("Connection: close\r\n\r\n");
        text.into_bytes()
    }

    fn numbered_headers(n: usize) -> Vec<(String, String)> {
        (0..n)
            .map(|i| (format!("X-Header-{i}"), "v".to_string()))
            .collect()
    }

    #[tokio::test]
    async fn absolute_form_for_another_host_is_400() {
        let response = refused(
            b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n",
            400,
            |_| {},
        )
        .await;
        assert!(
            response.body_text().contains("not an open proxy"),
            "the 400 should explain itself, got {:?}",
            response.body_text()
        );
    }

    #[tokio::test]
    async fn absolute_form_naming_the_proxy_itself_is_served() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let request = format!(
            "GET http://{0}/self?q=1 HTTP/1.1\r\nHost: {0}\r\nAuthorization: Bearer x\r\nConnection: close\r\n\r\n",
            proxy.addr
        );
        let response = raw_exchange(proxy.addr, request.as_bytes()).await;
        assert_eq!(response.status, 200, "got {response:?}");
        assert_eq!(origin.only_request().path_and_query(), "/self?q=1");
    }

    #[tokio::test]
    async fn connect_is_405() {
        let response = refused(
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
            405,
            |_| {},
        )
        .await;
        assert!(
            response.header("allow").is_some(),
            "a 405 should carry Allow"
        );
    }

    #[tokio::test]
    async fn too_many_headers_is_431() {
        let request = request_with_headers(&numbered_headers(40));
        refused(&request, 431, |c| c.max_headers = 20).await;
    }

    /// The default limit (100, hyper's own, which the proxy then leaves
    /// unnamed) holds as a named one does.
    #[tokio::test]
    async fn the_default_header_limit_is_100() {
        let origin = Origin::echo().await;
        let proxy = Proxy::start(&origin.url(), |_| {}).await;
        // Host + Connection + 98 others = 100 headers: sent on (the echo
        // origin, with the forwarding headers added, may refuse them itself).
        let response = raw_exchange(proxy.addr, &request_with_headers(&numbered_headers(98))).await;
        assert!(
            response
                .header("cache-status")
                .is_some_and(|v| v.contains("fwd-status=")),
            "100 headers should reach the origin: {response:?}"
        );
        let request = request_with_headers(&numbered_headers(99));
        refused(&request, 431, |_| {}).await;
    }

    /// A subscription (which the proxy may parse itself, src/net/fastpath.rs)
    /// is held to the same limit.
    #[tokio::test]
    async fn too_many_headers_on_a_subscription_is_431() {
        let mut text =
            String::from("GET /limits HTTP/1.1\r\nHost: proxy.test\r\nSubscribe: true\r\n");
        for (name, value) in numbered_headers(30) {
            text.push_str(&format!("{name}: {value}\r\n"));
        }
        text.push_str("\r\n");
        refused(text.as_bytes(), 431, |c| c.max_headers = 20).await;
    }

    #[tokio::test]
    async fn headers_up_to_the_limit_are_accepted() {
        let origin = Origin::echo().await;
        let proxy = Proxy::start(&origin.url(), |c| c.max_headers = 20).await;
        // Host + Connection + Authorization + 17 others = 20 headers.
        let mut headers = numbered_headers(17);
        headers.push(("Authorization".into(), "Bearer x".into()));
        let request = request_with_headers(&headers);
        let response = raw_exchange(proxy.addr, &request).await;
        assert_eq!(
            response.status, 200,
            "20 headers with max-headers 20: {response:?}"
        );
        assert_eq!(origin.seen().len(), 1);
    }

    #[tokio::test]
    async fn a_20_kb_header_is_431() {
        let request = request_with_headers(&[("X-Big".into(), "a".repeat(20 * 1024))]);
        refused(&request, 431, |_| {}).await;
    }

    #[tokio::test]
    async fn a_header_block_just_over_the_limit_is_431() {
        // Fits in the connection's read buffer, so the proxy's own check must refuse it.
        let request = request_with_headers(&[("X-Big".into(), "a".repeat(16 * 1024 + 64))]);
        let response = refused(&request, 431, |_| {}).await;
        assert!(
            response.body_text().contains("too large"),
            "the 431 should explain itself, got {:?}",
            response.body_text()
        );
    }

    #[tokio::test]
    async fn dot_dot_segments_are_400() {
        for path in ["/a/../etc/passwd", "/a/%2e%2E/b", "/a/./b"] {
            let request =
                format!("GET {path} HTTP/1.1\r\nHost: proxy.test\r\nConnection: close\r\n\r\n");
            refused(request.as_bytes(), 400, |_| {}).await;
        }
    }

    #[tokio::test]
    async fn via_naming_this_proxy_is_508() {
        let request = format!(
            "GET /loop HTTP/1.1\r\nHost: proxy.test\r\nVia: 1.1 edge, 1.1 {PROXY_ID}\r\nConnection: close\r\n\r\n"
        );
        let response = refused(request.as_bytes(), 508, |_| {}).await;
        assert!(
            response.body_text().contains("loop"),
            "the 508 should explain itself, got {:?}",
            response.body_text()
        );
    }
}

// ============================================================================

mod h2c {
    use crate::support::*;
    use http::{Request, StatusCode, Version};

    #[tokio::test]
    async fn prior_knowledge_h2c_passes_through() {
        let origin = Origin::echo().await;
        let proxy = Proxy::for_origin(&origin).await;
        let client = h2c_client();
        let payload = binary_bytes(256 * 300);
        let req = Request::put(proxy.url("/h2/item?rev=3&x=a%20b"))
            .header("x-want-status", "201")
            .header("x-custom", "over h2")
            .body(full(payload.clone()))
            .expect("request");
        let (parts, body) = fetch(&client, req).await;
        assert_eq!(
            parts.version,
            Version::HTTP_2,
            "the client should speak h2c"
        );
        assert_eq!(parts.status, StatusCode::CREATED);
        assert!(body == payload, "the h2c body differs from the sent bytes");
        assert_eq!(value(&parts.headers, "x-origin"), "echo");
        assert_eq!(
            values(&parts.headers, "set-cookie"),
            ["a=1; Path=/", "b=2; Path=/"]
        );

        let seen = origin.only_request();
        assert_eq!(seen.method, http::Method::PUT);
        assert_eq!(seen.path_and_query(), "/h2/item?rev=3&x=a%20b");
        assert_eq!(value(&seen.headers, "x-custom"), "over h2");
        assert_eq!(values(&seen.headers, "host"), [origin.addr.to_string()]);
        assert_eq!(
            value(&seen.headers, "x-forwarded-host"),
            proxy.addr.to_string()
        );
        assert_eq!(value(&seen.headers, "x-forwarded-for"), "127.0.0.1");
        assert!(
            values(&seen.headers, "via")
                .iter()
                .any(|v| v.ends_with(PROXY_ID)),
            "the origin should see this proxy in Via: {:#?}",
            seen.headers
        );
    }

    #[tokio::test]
    async fn h2c_header_limits_apply_too() {
        let origin = Origin::echo().await;
        let proxy = Proxy::start(&origin.url(), |c| c.max_headers = 20).await;
        let client = h2c_client();

        let mut many = Request::post(proxy.url("/h2/many"));
        for i in 0..40 {
            many = many.header(format!("x-header-{i}"), "v");
        }
        let (parts, body) = fetch(&client, many.body(full("x")).expect("request")).await;
        assert_eq!(
            parts.status,
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "40 headers over h2c with max-headers 20: {body:?}"
        );

        let big = Request::post(proxy.url("/h2/big"))
            .header("x-big", "a".repeat(16 * 1024 + 64))
            .body(full("x"))
            .expect("request");
        let (parts, _) = fetch(&client, big).await;
        assert_eq!(parts.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        assert!(
            origin.seen().is_empty(),
            "a refused h2c request reached the origin"
        );
    }
}

// ============================================================================

mod shutdown {
    use std::time::Duration;

    use crate::support::*;
    use http::{Response, StatusCode};
    use tokio::net::TcpStream;
    use tokio::sync::mpsc;

    #[tokio::test]
    async fn in_flight_request_completes_and_new_connections_are_refused() {
        let (arrived_tx, mut arrived_rx) = mpsc::unbounded_channel::<()>();
        let origin = Origin::start(move |_req| {
            let arrived_tx = arrived_tx.clone();
            async move {
                let _ = arrived_tx.send(());
                tokio::time::sleep(Duration::from_millis(300)).await;
                Response::new(full("slow but complete"))
            }
        })
        .await;
        let mut proxy = Proxy::for_origin(&origin).await;
        let url = proxy.url("/slow");
        let in_flight =
            tokio::spawn(async move { fetch(&http1_client(), personal_get(&url)).await });

        within("the slow request to reach the origin", arrived_rx.recv())
            .await
            .expect("the origin saw the request");
        proxy.begin_shutdown();

        let (parts, body) = within("the in-flight request", in_flight)
            .await
            .expect("the in-flight request task");
        assert_eq!(
            parts.status,
            StatusCode::OK,
            "the in-flight request should complete"
        );
        assert_eq!(body, "slow but complete");

        proxy
            .finished()
            .await
            .expect("Server::run should end without an error");

        let connect = within(
            "a connection attempt after shutdown",
            TcpStream::connect(proxy.addr),
        )
        .await;
        assert!(
            connect.is_err(),
            "the proxy should refuse new connections after shutdown"
        );
    }
}

// ============================================================================

mod config {
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use braid_proxy::config::{Args, Config};
    use clap::Parser;

    /// Writes `text` to a file under cargo's per-target temporary directory.
    fn temp_file(name: &str, text: &str) -> PathBuf {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("passthrough-{}-{name}", std::process::id()));
        std::fs::write(&path, text).expect("write the temporary config file");
        path
    }

    fn toml_error(text: &str) -> String {
        let mut config = Config::default();
        config
            .apply_toml(Path::new("test.toml"), text)
            .expect_err("the TOML should be refused")
            .to_string()
    }

    #[test]
    fn unknown_file_key_is_named() {
        let message = toml_error("listen = \"127.0.0.1:9999\"\nno-such-key = 1\n");
        assert!(
            message.contains("no-such-key"),
            "the error should name the key, got {message:?}"
        );
    }

    #[test]
    fn bad_file_duration_names_poll_interval() {
        let message = toml_error("poll-interval = \"soon\"\n");
        assert!(
            message.contains("poll-interval"),
            "the error should name the key, got {message:?}"
        );
    }

    #[test]
    fn bad_flag_duration_names_poll_interval() {
        let args = Args::try_parse_from(["braid-proxy", "--poll-interval", "soon"])
            .expect("clap accepts any string");
        let message = Config::from_args(args)
            .expect_err("`soon` is not a duration")
            .to_string();
        assert!(
            message.contains("poll-interval"),
            "the error should name the flag, got {message:?}"
        );
    }

    #[test]
    fn flags_override_the_file() {
        let path = temp_file(
            "override.toml",
            "poll-interval = \"5s\"\nmax-headers = 50\nproxy-id = \"from-file\"\n",
        );
        let path_text = path.to_str().expect("utf-8 temp path");
        let args = Args::try_parse_from([
            "braid-proxy",
            "--config",
            path_text,
            "--poll-interval",
            "250ms",
            "--proxy-id",
            "from-flag",
        ])
        .expect("valid flags");
        let config = Config::from_args(args).expect("valid configuration");
        let _ = std::fs::remove_file(&path);
        assert_eq!(
            config.poll_interval,
            Duration::from_millis(250),
            "the flag wins"
        );
        assert_eq!(config.proxy_id, "from-flag", "the flag wins");
        assert_eq!(config.max_headers, 50, "a key only in the file is kept");
    }

    /// Runs the built binary, killing it if it is still running after 10 s.
    fn run_binary(args: &[&str]) -> (Option<i32>, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_braid-proxy"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the braid-proxy binary");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if child.try_wait().expect("poll the binary").is_some() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("braid-proxy {args:?} was still running after 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().expect("the binary's output");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    }

    /// Flags that keep the binary off real ports should validation ever let it start.
    const SAFE: [&str; 4] = [
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
    ];

    #[test]
    fn binary_exits_2_naming_a_bad_file_key() {
        let path = temp_file("bad-key.toml", "heartbeat = \"5s\"\nbogus-setting = true\n");
        let path_text = path.to_str().expect("utf-8 temp path");
        let mut args = SAFE.to_vec();
        args.extend(["--config", path_text]);
        let (code, stderr) = run_binary(&args);
        let _ = std::fs::remove_file(&path);
        assert_eq!(
            code,
            Some(2),
            "exit code for a bad config file; stderr: {stderr}"
        );
        assert!(
            stderr.contains("bogus-setting"),
            "stderr should name the key, got {stderr:?}"
        );
    }

    #[test]
    fn binary_exits_2_naming_a_bad_flag_value() {
        let mut args = SAFE.to_vec();
        args.extend(["--poll-interval", "soon"]);
        let (code, stderr) = run_binary(&args);
        assert_eq!(code, Some(2), "exit code for a bad flag; stderr: {stderr}");
        assert!(
            stderr.contains("poll-interval"),
            "stderr should name the flag, got {stderr:?}"
        );
    }
}
