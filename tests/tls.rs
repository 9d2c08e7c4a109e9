//! TLS in and out (issue 47), over real sockets on 127.0.0.1:0 with
//! certificates made here by rcgen: subscriptions over h2 and HTTP/1.1 on
//! a TLS listener, an HTTPS origin (verified, and refused when it does not
//! verify), a tier over TLS with and without client certificates, a reload
//! under open subscriptions, and bad files at start.

mod common;
#[path = "common/npm.rs"]
mod npm;

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use braid_proxy::config::{Config, Upstream};
use braid_proxy::listen::server::Server;
use braid_proxy::tls::ServerTls;
use bytes::Bytes;
use common::origin::Origin;
use http::{Request, Response, Version};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(10);

/// A certificate authority made for one test, and what it signs.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A certificate with its key.
struct Issued {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("CA certificate");
        Ca { cert, key }
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    fn server(&self) -> Issued {
        self.issue(
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate (a tier's).
    fn client(&self) -> Issued {
        self.issue(
            vec!["edge.test".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    fn issue(&self, names: Vec<String>, usage: ExtendedKeyUsagePurpose) -> Issued {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(names).expect("params");
        params.extended_key_usages = vec![usage];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("certificate");
        Issued { cert, key }
    }

    fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }
}

impl Issued {
    fn chain(&self) -> Vec<CertificateDer<'static>> {
        vec![self.cert.der().clone()]
    }

    fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::try_from(self.key.serialize_der()).expect("key DER")
    }

    /// Writes `<name>.pem` and `<name>-key.pem` into `dir`.
    fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{name}.pem"));
        let key = dir.join(format!("{name}-key.pem"));
        std::fs::write(&cert, self.cert.pem()).expect("write certificate");
        std::fs::write(&key, self.key.serialize_pem()).expect("write key");
        (cert, key)
    }
}

/// A fresh directory for one test's PEM files, removed when the test is done
/// with it (also when it fails), so that runs leave nothing in the temp dir.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(test: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("braid-proxy-tls-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    Scratch(dir)
}

fn write_ca(ca: &Ca, dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(format!("{name}.pem"));
    std::fs::write(&path, ca.cert.pem()).expect("write CA");
    path
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    braid_proxy::tls::provider()
}

/// A TLS client configuration trusting `roots`, offering `alpn`, with a
/// client certificate when given.
fn client_config(
    roots: &[CertificateDer<'static>],
    alpn: &[&[u8]],
    identity: Option<&Issued>,
) -> Arc<rustls::ClientConfig> {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store.add(root.clone()).expect("root");
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(store);
    let mut config = match identity {
        Some(id) => builder
            .with_client_auth_cert(id.chain(), id.key_der())
            .expect("client certificate"),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

/// A TLS connection to `addr`, verified as `localhost`.
async fn connect(addr: SocketAddr, config: Arc<rustls::ClientConfig>) -> std::io::Result<Tls> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").expect("name");
    tokio::time::timeout(
        WAIT,
        tokio_rustls::TlsConnector::from(config).connect(name, tcp),
    )
    .await
    .expect("handshake in time")
}

/// A request for `path` with `headers` over `tls`, by HTTP/2 when ALPN chose it.
async fn send(tls: Tls, path: &str, headers: &[(&str, &str)]) -> hyper::Result<Response<Incoming>> {
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let mut req = Request::builder().uri(format!("https://localhost{path}"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let io = TokioIo::new(tls);
    let answer = async {
        if h2 {
            let req = req
                .version(Version::HTTP_2)
                .body(Empty::<Bytes>::new())
                .expect("request");
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            sender.send_request(req).await
        } else {
            let req = req
                .uri(path)
                .header("host", "localhost")
                .body(Empty::<Bytes>::new())
                .expect("request");
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            sender.send_request(req).await
        }
    };
    tokio::time::timeout(WAIT, answer)
        .await
        .expect("answered in time")
}

/// A subscription's body as it streams. (Updates may be patches: tests
/// wait for versions, the origin's ETags, rather than for whole texts.)
struct Stream {
    body: Incoming,
    seen: Vec<u8>,
}

impl Stream {
    /// Reads until `text` has been seen, within the test's wait.
    async fn until(&mut self, text: &str) {
        let found = async {
            while !String::from_utf8_lossy(&self.seen).contains(text) {
                match self.body.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.seen.extend_from_slice(&data);
                        }
                    }
                    other => panic!(
                        "the stream ended before {text:?} ({:?}); it had: {}",
                        other.map(|r| r.map(|_| ())),
                        String::from_utf8_lossy(&self.seen)
                    ),
                }
            }
        };
        tokio::time::timeout(WAIT, found).await.unwrap_or_else(|_| {
            panic!(
                "no {text:?} in time; the stream had: {}",
                String::from_utf8_lossy(&self.seen)
            )
        });
    }
}

/// Subscribes to `path` over `tls`; checks the 209 and the protocol.
async fn subscribe(tls: Tls, path: &str, version: Version) -> Stream {
    let response = send(tls, path, &[("subscribe", "true")])
        .await
        .expect("response");
    assert_eq!(response.status().as_u16(), 209, "{response:?}");
    assert_eq!(response.version(), version);
    Stream {
        body: response.into_body(),
        seen: Vec::new(),
    }
}

/// A proxy configuration in front of `upstream`, polling every 30 s
/// (changes are told by refresh).
fn config_for(upstream: &str) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_listen: Some("127.0.0.1:0".parse().expect("addr")),
        upstream: Some(Upstream::parse(upstream).expect("upstream")),
        poll_interval: Duration::from_secs(30),
        ..Config::default()
    }
}

/// A running proxy.
struct Proxy {
    addr: SocketAddr,
    admin: SocketAddr,
    tls: Option<Arc<ServerTls>>,
}

impl Proxy {
    /// Tells the proxy that `path` changed (the admin listener's refresh).
    async fn refresh(&self, path: &str) {
        let response =
            common::request(self.admin, "POST", &format!("/refresh?path={path}"), &[]).await;
        assert!(response.status().is_success(), "{response:?}");
    }
}

/// Binds and runs a proxy.
async fn start(config: Config) -> Proxy {
    let server = Server::bind(config).await.expect("bind proxy");
    let proxy = Proxy {
        addr: server.local_addr().expect("addr"),
        admin: server.admin_addr().expect("admin"),
        tls: server.tls(),
    };
    tokio::spawn(server.run(std::future::pending()));
    proxy
}

/// Serves `origin` over TLS with `server`'s certificate, offering h2 and
/// http/1.1 by ALPN (and asking for a client certificate when
/// `client_ca` is given); records the version of every request.
async fn https_origin(origin: Origin, server: &Issued) -> (SocketAddr, Arc<Mutex<Vec<Version>>>) {
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(server.chain(), server.key_der())
        .expect("origin certificate");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind origin");
    let addr = listener.local_addr().expect("addr");
    let versions = Arc::new(Mutex::new(Vec::new()));
    let seen = versions.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, origin, seen) = (acceptor.clone(), origin.clone(), seen.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    seen.lock().expect("lock").push(req.version());
                    std::future::ready(Ok::<_, std::convert::Infallible>(origin.answer(req)))
                });
                let io = TokioIo::new(tls);
                let _ = if h2 {
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(io, service)
                        .await
                } else {
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await
                };
            });
        }
    });
    (addr, versions)
}

/// A plain origin with `/doc` = `body`, and a proxy in front of it whose
/// listener has a certificate of `ca`, written into `dir`; the
/// certificate's and the key's files.
async fn tls_proxy(ca: &Ca, dir: &Path, body: &str) -> (Origin, Proxy, PathBuf, PathBuf) {
    let (cert, key) = ca.server().write(dir, "server");
    let origin = Origin::default();
    origin.set("/doc", body.to_string());
    let origin_addr = origin.start().await;
    let mut config = config_for(&format!("http://{origin_addr}"));
    config.tls_cert = Some(cert.clone());
    config.tls_key = Some(key.clone());
    (origin, start(config).await, cert, key)
}

#[tokio::test]
async fn subscriptions_over_h2_and_http1_on_a_tls_listener() {
    let ca = Ca::new("listener CA");
    let dir = scratch("listener");
    let (origin, proxy, _, _) = tls_proxy(&ca, &dir, "first").await;
    let addr = proxy.addr;

    let roots = [ca.der()];
    let h2 = connect(addr, client_config(&roots, &[b"h2", b"http/1.1"], None))
        .await
        .expect("TLS");
    assert_eq!(h2.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let mut over_h2 = subscribe(h2, "/doc", Version::HTTP_2).await;
    let h1 = connect(addr, client_config(&roots, &[b"http/1.1"], None))
        .await
        .expect("TLS");
    let mut over_h1 = subscribe(h1, "/doc", Version::HTTP_11).await;
    // No ALPN at all is HTTP/1.1 too.
    let bare = connect(addr, client_config(&roots, &[], None))
        .await
        .expect("TLS");
    let mut bare = subscribe(bare, "/doc", Version::HTTP_11).await;
    for stream in [&mut over_h2, &mut over_h1, &mut bare] {
        stream.until("first").await;
    }
    origin.set("/doc", "second");
    proxy.refresh("/doc").await;
    for stream in [&mut over_h2, &mut over_h1, &mut bare] {
        stream.until("\"e2\"").await;
    }

    // Plain HTTP on the TLS port is not served: a readable 400 with its
    // reason (a TLS alert would show as garbage), and the connection closed.
    for request in [
        "GET /doc HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET /doc HTTP/1.1\r\nHost: a\r\nSubscribe: true\r\n\r\n",
        "PUT /doc HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    ] {
        let plain = common::exchange(addr, request.into()).await;
        assert!(plain.starts_with("HTTP/1.1 400 "), "{plain}");
        assert!(
            plain.ends_with("\r\n\r\nthis port speaks HTTPS: the request was sent as plain HTTP\n"),
            "{plain}"
        );
        assert!(!plain.contains("first"), "{plain}");
    }
    // Bytes that are neither TLS nor HTTP get no HTTP answer (at most a TLS
    // alert, or a reset), and the connection is closed.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"\0\0\0\0 not a request\r\n\r\n")
            .await
            .expect("write");
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out));
        assert!(read.await.is_ok(), "the connection was not closed");
        assert!(
            !out.starts_with(b"HTTP/"),
            "{}",
            String::from_utf8_lossy(&out)
        );
    }
    // The listener still serves TLS afterwards, and the PUT changed nothing.
    let h1 = connect(addr, client_config(&roots, &[b"http/1.1"], None))
        .await
        .expect("TLS");
    subscribe(h1, "/doc", Version::HTTP_11)
        .await
        .until("second")
        .await;
}

/// A proxy in front of the HTTPS origin at `origin`, named `host` in
/// `--upstream`, trusting `ca` by `--upstream-ca` (written into `dir`).
async fn https_proxy(host: &str, origin: SocketAddr, ca: &Ca, dir: &Path) -> Proxy {
    let mut config = config_for(&format!("https://{host}:{}", origin.port()));
    config.upstream_ca = Some(write_ca(ca, dir, "ca"));
    start(config).await
}

/// A plain HTTP/1.1 subscription to `/doc` at `addr` sees `first`, then
/// the origin's next version (`"e2"`) once `told` (the tier that polls the
/// origin) is told of it.
async fn follows_a_change(addr: SocketAddr, first: &str, origin: &Origin, told: &Proxy) {
    let (mut stream, head) = common::wire::subscribe_raw(addr, "/doc").await;
    assert!(head.starts_with("HTTP/1.1 209"), "{head}");
    let mut seen = head.into_bytes();
    common::wire::read_until(&mut stream, &mut seen, |s| s.contains(first)).await;
    origin.set("/doc", "changed at the origin");
    told.refresh("/doc").await;
    common::wire::read_until(&mut stream, &mut seen, |s| s.contains("\"e2\"")).await;
}

#[tokio::test]
async fn an_https_origin_is_verified_and_followed_over_h2() {
    let dir = scratch("origin");
    let ca = Ca::new("origin CA");
    let origin = Origin::default();
    origin.set("/doc", "over TLS");
    let (origin_addr, versions) = https_origin(origin.clone(), &ca.server()).await;
    let proxy = https_proxy("localhost", origin_addr, &ca, &dir).await;
    let addr = proxy.addr;

    // Pass-through: HTTP/1.1 to the origin.
    let response = common::get(addr, "/doc", &[]).await;
    assert_eq!(response.status(), 200);
    assert_eq!(common::body_of(response).await, "over TLS");
    assert_eq!(
        versions.lock().expect("lock").as_slice(),
        [Version::HTTP_11]
    );

    // A subscription: the watcher's polls go over h2, which ALPN chose.
    follows_a_change(addr, "over TLS", &origin, &proxy).await;
    let seen = versions.lock().expect("lock").clone();
    assert!(
        seen.len() > 2 && seen[1..].iter().all(|v| *v == Version::HTTP_2),
        "{seen:?}"
    );
}

#[tokio::test]
async fn an_origin_whose_certificate_does_not_verify_is_a_502_with_the_reason() {
    let dir = scratch("unverified");
    let trusted = Ca::new("trusted CA");
    let stranger = Ca::new("stranger CA");
    let origin = Origin::default();
    origin.set("/doc", "secret");
    let (origin_addr, versions) = https_origin(origin, &stranger.server()).await;
    let proxy = https_proxy("localhost", origin_addr, &trusted, &dir).await;
    let addr = proxy.addr;

    for headers in [&[][..], &[("subscribe", "true")][..]] {
        let response = common::get(addr, "/doc", headers).await;
        assert_eq!(response.status(), 502, "{headers:?}");
        let body = String::from_utf8_lossy(&common::body_of(response).await).into_owned();
        assert!(
            body.contains("certificate") && !body.contains("secret"),
            "{body}"
        );
    }
    assert!(versions.lock().expect("lock").is_empty());

    // A name the certificate does not carry fails the same way.
    let dir = scratch("wrong-name");
    let ca = Ca::new("origin CA");
    let origin = Origin::default();
    origin.set("/doc", "secret");
    let (origin_addr, _) = https_origin(
        origin,
        &ca.issue(
            vec!["elsewhere.test".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        ),
    )
    .await;
    let proxy = https_proxy("127.0.0.1", origin_addr, &ca, &dir).await;
    let addr = proxy.addr;
    let response = common::get(addr, "/doc", &[]).await;
    assert_eq!(response.status(), 502);
    let body = String::from_utf8_lossy(&common::body_of(response).await).into_owned();
    assert!(body.contains("certificate"), "{body}");
}

/// `/readyz` of a proxy whose https upstream presents a certificate that
/// does not verify turns red by itself, with no client request: its probe
/// is a TLS handshake, not a bare TCP connect (which such an upstream
/// accepts). With a certificate that verifies, it stays green.
#[tokio::test]
async fn readiness_follows_the_upstream_s_certificate_not_only_its_port() {
    let dir = scratch("readiness");
    let trusted = Ca::new("trusted CA");
    let stranger = Ca::new("stranger CA");
    let (bad_addr, _) = https_origin(Origin::default(), &stranger.server()).await;
    let (good_addr, _) = https_origin(Origin::default(), &trusted.server()).await;
    let bad = https_proxy("localhost", bad_addr, &trusted, &dir).await;
    let good = https_proxy("localhost", good_addr, &trusted, &dir).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let reason = loop {
        let answer = common::get(bad.admin, "/readyz", &[]).await;
        let status = answer.status().as_u16();
        let body = String::from_utf8_lossy(&common::body_of(answer).await).into_owned();
        if status == 503 {
            break body;
        }
        assert_eq!(status, 200, "{body}");
        assert!(
            std::time::Instant::now() < deadline,
            "/readyz stayed green with an upstream certificate that does not verify"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(reason.contains("certificate"), "{reason}");
    for _ in 0..5 {
        let answer = common::get(good.admin, "/readyz", &[]).await;
        assert_eq!(answer.status(), 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_tier_over_tls_serves_only_edges_with_a_client_certificate() {
    let dir = scratch("tier");
    let ca = Ca::new("tier CA");
    let ca_file = write_ca(&ca, &dir, "ca");
    let (shield_cert, shield_key) = ca.server().write(&dir, "shield");
    let edge_identity = ca.client();
    let (edge_cert, edge_key) = edge_identity.write(&dir, "edge");

    let origin = Origin::default();
    origin.set("/doc", "from the origin");
    let origin_addr = origin.start().await;
    let mut shield = config_for(&format!("http://{origin_addr}"));
    shield.tls_cert = Some(shield_cert);
    shield.tls_key = Some(shield_key);
    shield.tls_client_ca = Some(ca_file.clone());
    let shield = start(shield).await;
    let shield_addr = shield.addr;
    assert!(shield
        .tls
        .as_ref()
        .expect("TLS")
        .requires_client_certificates());

    // An edge with a certificate follows the shield.
    let upstream = format!("https://localhost:{}", shield_addr.port());
    let mut edge = config_for(&upstream);
    edge.upstream_ca = Some(ca_file.clone());
    edge.upstream_client_cert = Some(edge_cert);
    edge.upstream_client_key = Some(edge_key);
    let edge_addr = start(edge).await.addr;
    follows_a_change(edge_addr, "from the origin", &origin, &shield).await;

    // An edge without one is refused: 502 to its clients.
    let mut bare_edge = config_for(&upstream);
    bare_edge.upstream_ca = Some(ca_file);
    let bare_addr = start(bare_edge).await.addr;
    let response = common::get(bare_addr, "/doc", &[]).await;
    assert_eq!(response.status(), 502);

    // And so is any client without one (TLS 1.3 ends the handshake on
    // the client's side first: the refusal comes with the first request).
    let roots = [ca.der()];
    let refused = match connect(shield_addr, client_config(&roots, &[b"http/1.1"], None)).await {
        Err(_) => true,
        Ok(tls) => send(tls, "/doc", &[]).await.is_err(),
    };
    assert!(refused, "a client without a certificate was served");
    // With one, it is served.
    let tls = connect(
        shield_addr,
        client_config(&roots, &[b"h2"], Some(&edge_identity)),
    )
    .await
    .expect("TLS");
    let response = send(tls, "/doc", &[]).await.expect("response");
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn a_reload_keeps_open_subscriptions_streaming() {
    let dir = scratch("reload");
    let old_ca = Ca::new("old CA");
    let (origin, proxy, cert, key) = tls_proxy(&old_ca, &dir, "before").await;
    let addr = proxy.addr;
    let tls = proxy.tls.clone().expect("TLS");

    let old_roots = [old_ca.der()];
    let mut streams = Vec::new();
    for alpn in [&b"h2"[..], b"http/1.1"] {
        let conn = connect(addr, client_config(&old_roots, &[alpn], None))
            .await
            .expect("TLS");
        let version = if alpn == b"h2" {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let mut stream = subscribe(conn, "/doc", version).await;
        stream.until("before").await;
        streams.push(stream);
    }

    // New files in place, then the reload SIGHUP calls.
    let new_ca = Ca::new("new CA");
    new_ca.server().write(&dir, "server");
    tls.reload().expect("reload");
    origin.set("/doc", "after the reload");
    proxy.refresh("/doc").await;
    for stream in &mut streams {
        stream.until("\"e2\"").await;
    }
    // New connections get the new certificate.
    let new_roots = [new_ca.der()];
    assert!(connect(addr, client_config(&old_roots, &[b"h2"], None))
        .await
        .is_err());
    let conn = connect(addr, client_config(&new_roots, &[b"h2"], None))
        .await
        .expect("the new certificate");
    subscribe(conn, "/doc", Version::HTTP_2)
        .await
        .until("after the reload")
        .await;

    // A file that does not load: an error naming it, and the loaded
    // certificate stays.
    std::fs::write(&cert, "not a certificate").expect("write");
    let error = tls.reload().expect_err("a broken certificate file");
    assert!(error.contains(&cert.display().to_string()), "{error}");
    new_ca.server().write(&dir, "server");
    std::fs::remove_file(&key).expect("remove key");
    let error = tls.reload().expect_err("a missing key file");
    assert!(error.contains(&key.display().to_string()), "{error}");
    connect(addr, client_config(&new_roots, &[b"h2"], None))
        .await
        .expect("still the loaded certificate");
    origin.set("/doc", "still streaming");
    proxy.refresh("/doc").await;
    for stream in &mut streams {
        stream.until("\"e3\"").await;
    }
}

#[tokio::test]
async fn a_tls_file_that_does_not_load_is_a_startup_error_naming_it() {
    let dir = scratch("startup");
    let ca = Ca::new("startup CA");
    let (cert, key) = ca.server().write(&dir, "server");
    let missing = dir.join("missing.pem");
    let garbage = dir.join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\nnot base64!\n").expect("write");
    let other_key = dir.join("other-key.pem");
    std::fs::write(
        &other_key,
        KeyPair::generate().expect("key").serialize_pem(),
    )
    .expect("write");

    // A passphrase-protected key (the PEM label is what tells it; the
    // body is not read).
    let encrypted = dir.join("encrypted-key.pem");
    std::fs::write(
        &encrypted,
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n",
    )
    .expect("write");

    // (what is wrong, the key set to the file, the file, words the error says)
    let cases = [
        ("missing cert", "tls-cert", &missing, "cannot read it"),
        ("missing key", "tls-key", &missing, "cannot read it"),
        ("garbage cert", "tls-cert", &garbage, "not valid PEM"),
        (
            "a key of another certificate",
            "tls-key",
            &other_key,
            "not usable with",
        ),
        ("key as cert", "tls-cert", &key, "no CERTIFICATE"),
        ("cert as key", "tls-key", &cert, "no private key in it"),
        (
            "encrypted key",
            "tls-key",
            &encrypted,
            "the private key is encrypted",
        ),
        (
            "missing client CA",
            "tls-client-ca",
            &missing,
            "cannot read it",
        ),
    ];
    for (case, flag, named, says) in cases {
        let mut config = config_for("http://127.0.0.1:9");
        config.tls_cert = Some(cert.clone());
        config.tls_key = Some(key.clone());
        config
            .set(flag, named.to_str().expect("UTF-8 path"))
            .expect("set");
        let error = match Server::bind(config).await {
            Ok(_) => panic!("{case}: started"),
            Err(e) => e.to_string(),
        };
        assert!(
            error.contains(&named.display().to_string()),
            "{case}: {error}"
        );
        assert!(error.contains(says), "{case}: {error}");
    }
    let mut config = config_for("https://localhost:9");
    config.upstream_ca = Some(missing.clone());
    let error = Server::bind(config)
        .await
        .err()
        .expect("a missing upstream CA");
    assert!(error.to_string().contains("--upstream-ca"), "{error}");

    // The binary says which file, and stops.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_braid-proxy"))
        .args(["--listen", "127.0.0.1:0", "--tls-key"])
        .arg(&key)
        .arg("--tls-cert")
        .arg(&missing)
        .output()
        .expect("run the binary");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("--tls-cert {}", missing.display())),
        "{stderr}"
    );
}

/// A child process, killed when the test ends, whatever happened.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sighup_reloads_the_certificate_of_the_running_binary() {
    use std::io::{BufRead, BufReader};
    let dir = scratch("sighup");
    let old_ca = Ca::new("old CA");
    let (cert, key) = old_ca.server().write(&dir, "server");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_braid-proxy"))
        .args(["--listen", "127.0.0.1:0", "--heartbeat", "0s"])
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the binary");
    let mut child = Running(child);
    let mut out = BufReader::new(child.0.stdout.take().expect("stdout"));
    let mut banner = String::new();
    out.read_line(&mut banner).expect("banner");
    let addr: SocketAddr = banner
        .trim()
        .strip_prefix("braid-proxy listening on https://")
        .unwrap_or_else(|| panic!("banner: {banner}"))
        .parse()
        .expect("address");
    // The demo's hints name the listener's scheme.
    let mut hints = String::new();
    for _ in 0..3 {
        out.read_line(&mut hints).expect("the demo's hints");
    }
    assert_eq!(
        hints.matches(&format!("https://{addr}/")).count(),
        3,
        "{hints}"
    );
    assert!(!hints.contains("http://"), "{hints}");
    // The log lines, as they come.
    let stderr = child.0.stderr.take().expect("stderr");
    let (lines, logged) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let logged_within = |text: &str| {
        let deadline = std::time::Instant::now() + WAIT;
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match logged.recv_timeout(left) {
                Ok(line) if line.contains(text) => return line,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        panic!("no log line with {text:?}");
    };
    let pid = child.0.id().to_string();
    let hup = || {
        let sent = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .expect("kill");
        assert!(sent.success());
    };

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        // The demo's clock changes every second.
        let old_roots = [old_ca.der()];
        let conn = connect(addr, client_config(&old_roots, &[b"h2"], None))
            .await
            .expect("TLS");
        let mut clock = subscribe(conn, "/clock", Version::HTTP_2).await;
        clock.until("Version").await;

        let new_ca = Ca::new("new CA");
        new_ca.server().write(&dir, "server");
        hup();
        logged_within("TLS certificate reloaded");
        let new_roots = [new_ca.der()];
        connect(addr, client_config(&new_roots, &[b"h2"], None))
            .await
            .expect("the new certificate");
        assert!(connect(addr, client_config(&old_roots, &[b"h2"], None))
            .await
            .is_err());
        // The subscription opened before goes on.
        let before = clock.seen.len();
        let more = tokio::time::timeout(WAIT, async {
            while clock.seen.len() < before + 1 {
                let frame = clock.body.frame().await.expect("open").expect("frame");
                if let Ok(data) = frame.into_data() {
                    clock.seen.extend_from_slice(&data);
                }
            }
        })
        .await;
        assert!(more.is_ok(), "no update after the reload");

        // A broken file: an error line naming it, the process goes on.
        std::fs::write(&cert, "garbage").expect("write");
        hup();
        let line = logged_within("TLS reload failed");
        assert!(line.contains(&cert.display().to_string()), "{line}");
        connect(addr, client_config(&new_roots, &[b"h2"], None))
            .await
            .expect("still the loaded certificate");
    });
}

#[test]
fn the_braid_http_client_over_https() {
    let conformance = npm::ensure_node_packages();
    let dir = scratch("node");
    let ca = Ca::new("node CA");
    ca.server().write(&dir, "server");
    let ca_file = write_ca(&ca, &dir, "ca");
    run_node(
        &conformance,
        "tls/braid-http-over-https.test.js",
        &[
            ("BRAID_TLS_DIR", dir.as_os_str()),
            ("NODE_EXTRA_CA_CERTS", ca_file.as_os_str()),
        ],
    );
}

#[test]
fn chromium_holds_more_than_six_subscriptions_over_h2() {
    use base64::Engine as _;
    use sha2::Digest as _;
    let conformance = npm::ensure_node_packages();
    let dir = scratch("chromium");
    let ca = Ca::new("chromium CA");
    let server = ca.server();
    server.write(&dir, "server");
    // Chromium accepts the server's key by its SubjectPublicKeyInfo hash.
    let spki = base64::engine::general_purpose::STANDARD
        .encode(sha2::Sha256::digest(server.key.public_key_der()));
    run_node(
        &conformance,
        "tls/chromium-h2.test.js",
        &[
            ("BRAID_TLS_DIR", dir.as_os_str()),
            ("BRAID_TLS_SPKI", std::ffi::OsStr::new(&spki)),
        ],
    );
}

/// Runs one Node test file of `conformance-tests/` against the built
/// binary, with `env`; fails with it.
fn run_node(conformance: &Path, file: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let mut node = std::process::Command::new("node");
    node.arg("--test")
        .arg(conformance.join(file))
        .current_dir(conformance)
        .env("BRAID_PROXY_BIN", env!("CARGO_BIN_EXE_braid-proxy"))
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        // Its own process group: on timeout, node and the proxies it
        // started are killed together.
        .process_group(0);
    let mut child = node
        .spawn()
        .expect("run node (Node.js >= 20 is needed, as for the conformance suite)");
    let status = npm::wait_or_kill(&mut child, Duration::from_secs(120), file);
    assert!(status.success(), "{file} failed: {status}");
}

/// The versions named in a stream's bytes, in order.
fn versions_in(seen: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(seen)
        .lines()
        .filter_map(|l| l.strip_prefix("Version: ").or(l.strip_prefix("version: ")))
        .map(str::to_string)
        .collect()
}

/// A subscription over TLS and HTTP/1.1 that hyper serves (a `Connection`
/// option keeps a request off the fast path), for reference.
async fn subscribe_through_hyper(tls: Tls, path: &str) -> Stream {
    let headers = [
        ("subscribe", "true"),
        ("connection", "keep-alive, x-hop"),
        ("x-hop", "1"),
    ];
    let response = send(tls, path, &headers).await.expect("response");
    assert_eq!(response.status().as_u16(), 209, "{response:?}");
    Stream {
        body: response.into_body(),
        seen: Vec::new(),
    }
}

/// HTTP/1.1 subscriptions over TLS take the fast path and, caught up,
/// park: each change is then encrypted and written to every one of them
/// by the sweep, and they get the same bytes as a subscription hyper
/// serves over TLS. Changes larger than a session's send bound (16 KiB)
/// are begun by the sweep and finished by each subscriber's own task.
#[tokio::test]
async fn http1_subscriptions_over_tls_park_and_are_swept() {
    let ca = Ca::new("sweep CA");
    let dir = scratch("sweep");
    let (origin, proxy, _, _) = tls_proxy(&ca, &dir, "v1").await;
    let roots = [ca.der()];
    let h1 = client_config(&roots, &[b"http/1.1"], None);
    let mut parked = Vec::new();
    for _ in 0..8 {
        let conn = connect(proxy.addr, h1.clone()).await.expect("TLS");
        let mut stream = subscribe(conn, "/doc", Version::HTTP_11).await;
        stream.until("v1").await;
        parked.push(stream);
    }
    let conn = connect(proxy.addr, h1.clone()).await.expect("TLS");
    let mut reference = subscribe_through_hyper(conn, "/doc").await;
    reference.until("v1").await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while common::wire::metric(proxy.admin, "subscriptions_parked").await != 8.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the TLS subscribers did not park"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let swept_before = common::wire::metric(proxy.admin, "sweep_seconds_count").await;
    for n in 2..=7u32 {
        // Small changes, then ones far beyond the session's send bound.
        let body = if n < 5 {
            format!("v{n}")
        } else {
            format!("v{n}:{}", format!("{n:x}").repeat(60_000 + n as usize))
        };
        origin.set("/doc", body);
        proxy.refresh("/doc").await;
        let version = format!("\"e{n}\"");
        for stream in parked.iter_mut().chain([&mut reference]) {
            stream.until(&version).await;
        }
    }
    let want: Vec<String> = (1..=7).map(|n| format!("\"e{n}\"")).collect();
    assert_eq!(versions_in(&reference.seen), want);
    for stream in &parked {
        assert_eq!(
            stream.seen, reference.seen,
            "the sweep's bytes are what hyper's path sends"
        );
    }
    let swept = common::wire::metric(proxy.admin, "sweep_seconds_count").await - swept_before;
    assert!(swept >= 6.0, "{swept} sweeps for 6 changes");
}

/// A stalled reader over TLS (its socket full, encrypted bytes left in its
/// session) catches up to the current version when it reads again, with
/// every version it sees newer than the one before; readers that keep up
/// are not held back by it.
#[tokio::test]
async fn a_stalled_tls_subscriber_catches_up_and_never_goes_back() {
    let ca = Ca::new("stall CA");
    let dir = scratch("stall");
    let (origin, proxy, _, _) = tls_proxy(&ca, &dir, "v1").await;
    let roots = [ca.der()];
    let h1 = client_config(&roots, &[b"http/1.1"], None);
    let conn = connect(proxy.addr, h1.clone()).await.expect("TLS");
    let mut stalled = subscribe(conn, "/doc", Version::HTTP_11).await;
    stalled.until("v1").await;
    let conn = connect(proxy.addr, h1.clone()).await.expect("TLS");
    let mut reader = subscribe(conn, "/doc", Version::HTTP_11).await;
    reader.until("v1").await;
    // Each version 1.5 MB of fresh bytes: a few of them fill the stalled
    // reader's socket on loopback.
    let last = 12u32;
    for n in 2..=last {
        let block: String = (0..1_500_000u32)
            .map(|i| char::from(b'a' + ((i.wrapping_mul(2_654_435_761) ^ n) % 26) as u8))
            .collect();
        origin.set("/doc", format!("v{n}:{block}"));
        proxy.refresh("/doc").await;
        reader.until(&format!("\"e{n}\"")).await;
        // Keep only the tail: the versions are what is checked.
        let keep = reader.seen.len().saturating_sub(4096);
        reader.seen.drain(..keep);
    }
    stalled.until(&format!("\"e{last}\"")).await;
    let seen: Vec<u32> = versions_in(&stalled.seen)
        .iter()
        .map(|v| {
            v.trim_matches(|c| c == '"' || c == 'e')
                .parse()
                .expect("eN")
        })
        .collect();
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "versions went back or repeated: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&last));
}

/// On an HTTP/1.1 TLS connection, a first request the fast path does not
/// take reaches hyper whole (its bytes were read to look at it), and a
/// connection whose fast-path response ended goes on to hyper for its
/// next request.
#[tokio::test]
async fn a_tls_connection_serves_requests_before_and_after_the_fast_path() {
    let ca = Ca::new("replay CA");
    let dir = scratch("replay");
    let (_origin, proxy, _, _) = tls_proxy(&ca, &dir, "plain").await;
    let roots = [ca.der()];
    let h1 = client_config(&roots, &[b"http/1.1"], None);

    type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;
    let open = || async {
        let conn = connect(proxy.addr, h1.clone()).await.expect("TLS");
        let (sender, driver) = hyper::client::conn::http1::handshake(TokioIo::new(conn))
            .await
            .expect("HTTP/1.1");
        tokio::spawn(driver);
        sender
    };
    let get = |path: &str, subscribe: Option<&str>| {
        let mut req = Request::builder().uri(path).header("host", "localhost");
        if let Some(value) = subscribe {
            req = req.header("subscribe", value);
        }
        req.body(Empty::<Bytes>::new()).expect("request")
    };
    let get_doc = |sender: &mut Sender| {
        let sent = sender.send_request(get("/doc", None));
        async move {
            let response = sent.await.expect("GET");
            assert_eq!(response.status(), 200);
            let body = response.into_body().collect().await.expect("body");
            assert_eq!(body.to_bytes(), "plain");
        }
    };

    // A GET, then a subscription, on one connection.
    let mut sender = open().await;
    get_doc(&mut sender).await;
    let response = sender
        .send_request(get("/doc", Some("true")))
        .await
        .expect("subscription");
    assert_eq!(response.status().as_u16(), 209);
    drop(response);

    // A subscription request the fast path answers with a refusal (a
    // bad `Subscribe` value), then a GET.
    let mut sender = open().await;
    let response = sender
        .send_request(get("/doc", Some("maybe")))
        .await
        .expect("subscription");
    assert_eq!(response.status(), 400);
    response.into_body().collect().await.expect("body");
    sender.ready().await.expect("the connection stays open");
    get_doc(&mut sender).await;
}

/// A parked TLS subscriber still gets its heartbeats (its task takes it
/// back from the sweep for each and writes it through the session), and
/// the updates after them.
#[tokio::test]
async fn a_parked_tls_subscriber_keeps_its_heartbeats() {
    let ca = Ca::new("heartbeat CA");
    let dir = scratch("heartbeat");
    let (origin, proxy, _, _) = tls_proxy(&ca, &dir, "v1").await;
    let roots = [ca.der()];
    let conn = connect(proxy.addr, client_config(&roots, &[b"http/1.1"], None))
        .await
        .expect("TLS");
    let headers = [("subscribe", "true"), ("heartbeats", "100ms")];
    let response = send(conn, "/doc", &headers).await.expect("response");
    assert_eq!(response.status().as_u16(), 209, "{response:?}");
    let mut body = response.into_body();
    let mut beats = 0;
    let mut parked = false;
    let counted = async {
        while beats < 3 || !parked {
            let frame = body.frame().await.expect("open").expect("frame");
            if frame.data_ref().is_some_and(|d| d.as_ref() == b"\r\n") {
                beats += 1;
            }
            parked =
                parked || common::wire::metric(proxy.admin, "subscriptions_parked").await == 1.0;
        }
    };
    tokio::time::timeout(WAIT, counted)
        .await
        .expect("three heartbeats while parked");
    origin.set("/doc", "v2");
    proxy.refresh("/doc").await;
    let mut stream = Stream {
        body,
        seen: Vec::new(),
    };
    stream.until("\"e2\"").await;
}

/// A client that comes back resumes its TLS session (no certificate, no
/// signature), however many other clients connected in between: the
/// listener issues stateless tickets, where rustls's stateful cache would
/// have forgotten it after 256 others. A new certificate (SIGHUP) starts
/// afresh: a ticket from before is not taken after it.
#[tokio::test]
async fn a_returning_client_resumes_by_ticket_however_many_came_between() {
    use rustls::HandshakeKind;
    let ca = Ca::new("resumption CA");
    let dir = scratch("resumption");
    let (_origin, proxy, _, _) = tls_proxy(&ca, &dir, "resumed").await;
    let roots = [ca.der()];
    // Each configuration has its own session cache (rustls's default
    // resumption: in memory).
    let visit = |config: Arc<rustls::ClientConfig>| {
        let addr = proxy.addr;
        async move {
            let tls = connect(addr, config).await.expect("TLS");
            let kind = tls.get_ref().1.handshake_kind();
            // Reading the answer reads the tickets sent after the handshake.
            let response = send(tls, "/doc", &[]).await.expect("GET");
            assert_eq!(response.status(), 200);
            assert_eq!(common::body_of(response).await, "resumed");
            kind
        }
    };
    let returning = client_config(&roots, &[b"http/1.1"], None);
    assert_eq!(visit(returning.clone()).await, Some(HandshakeKind::Full));
    for _ in 0..300 {
        let other = client_config(&roots, &[b"http/1.1", b"h2"], None);
        assert_eq!(visit(other).await, Some(HandshakeKind::Full));
    }
    assert_eq!(visit(returning.clone()).await, Some(HandshakeKind::Resumed));

    // After a reload the old tickets are refused: one full handshake, then
    // resumption again.
    ca.server().write(&dir, "server");
    let tls = proxy.tls.clone().expect("a TLS listener");
    tls.reload().expect("reload");
    assert_eq!(visit(returning.clone()).await, Some(HandshakeKind::Full));
    assert_eq!(visit(returning).await, Some(HandshakeKind::Resumed));
}
