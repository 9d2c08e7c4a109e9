//! TLS to an `https://` upstream (issue 47): the trust anchors (the
//! system's roots and `--upstream-ca`), the client certificate of
//! `--upstream-client-cert`/`--upstream-client-key`, SNI, ALPN, and
//! [`Connector`], the connector the upstream client's pools use.
//!
//! Verification cannot be turned off. A certificate that does not verify
//! fails the connection with the reason (`TLS handshake with NAME failed:
//! invalid peer certificate: ...`), which the upstream client answers with
//! 502 and logs as the upstream's failure.
//!
//! The system's roots come from rustls-native-certs: the store the
//! operating system keeps (`/etc/ssl/certs` on Debian, updated with its
//! `ca-certificates` package, and where a site adds its own CAs), read
//! once at start (docs/design.md, "Dependencies").

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tracing::{debug, warn};

use crate::config::{Config, Upstream};
use crate::floor::body::BoxError;
use crate::tls::{provider, read_certs, read_key, read_roots};

/// The TLS an `https://` upstream is reached with: one client
/// configuration per ALPN offer, and the name its certificate must carry
/// (sent as SNI when it is a DNS name).
#[derive(Clone)]
pub struct UpstreamTls {
    /// Offers `http/1.1` only (pass-through requests stay on HTTP/1.1,
    /// src/upstream.rs says why).
    http1: TlsConnector,
    /// Offers `h2` and `http/1.1`: subscriptions and polls share one h2
    /// connection when the upstream chooses it.
    h2: TlsConnector,
    name: ServerName<'static>,
    handshake_timeout: Duration,
}

impl UpstreamTls {
    /// The TLS of `upstream` when it is `https://`; an error naming the
    /// file that does not load, or saying that there is nothing to trust.
    pub fn from_config(
        upstream: &Upstream,
        config: &Config,
    ) -> Result<Option<UpstreamTls>, String> {
        if !upstream.is_https() {
            return Ok(None);
        }
        let host = upstream.authority.host();
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| format!("--upstream {upstream}: `{host}` cannot be verified: {e}"))?;
        let mut roots = RootCertStore::empty();
        let system = rustls_native_certs::load_native_certs();
        for e in &system.errors {
            warn!(error = %e, "a system root certificate store could not be read");
        }
        let (_, unusable) = roots.add_parsable_certificates(system.certs);
        if unusable > 0 {
            debug!(unusable, "system root certificates skipped");
        }
        if let Some(path) = &config.upstream_ca {
            read_roots("upstream-ca", path, &mut roots)?;
        }
        if roots.is_empty() {
            return Err(format!(
                "--upstream {upstream}: no certificate to verify it against: the system has no \
                 root certificates and --upstream-ca is not set"
            ));
        }
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots);
        let mut client = match (&config.upstream_client_cert, &config.upstream_client_key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs("upstream-client-cert", cert)?;
                let key_der = read_key("upstream-client-key", key)?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    format!(
                        "--upstream-client-key {}: not usable with --upstream-client-cert {}: {e}",
                        key.display(),
                        cert.display()
                    )
                })?
            }
            _ => builder.with_no_client_auth(),
        };
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        let http1 = TlsConnector::from(Arc::new(client.clone()));
        client.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let h2 = TlsConnector::from(Arc::new(client));
        Ok(Some(UpstreamTls {
            http1,
            h2,
            name,
            handshake_timeout: config.connect_timeout,
        }))
    }
}

/// Connects to the upstream: TCP by the given [`HttpConnector`], then,
/// for an `https://` upstream, TLS.
#[derive(Clone)]
pub struct Connector {
    tcp: HttpConnector,
    tls: Option<(TlsConnector, ServerName<'static>, Duration)>,
}

impl Connector {
    /// A connector over `tcp`; with `tls`, offering h2 by ALPN when `h2`.
    pub fn new(mut tcp: HttpConnector, tls: Option<&UpstreamTls>, h2: bool) -> Connector {
        let tls = tls.map(|t| {
            let connector = if h2 { &t.h2 } else { &t.http1 };
            (connector.clone(), t.name.clone(), t.handshake_timeout)
        });
        if tls.is_some() {
            // The URIs say https; the TLS is this connector's.
            tcp.enforce_http(false);
        }
        Connector { tcp, tls }
    }
}

impl tower::Service<Uri> for Connector {
    type Response = UpstreamStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<UpstreamStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.tcp.call(uri);
        let tls = self.tls.clone();
        Box::pin(async move {
            let tcp = connecting.await?;
            let Some((connector, name, timeout)) = tls else {
                return Ok(UpstreamStream::Plain(tcp));
            };
            let handshake = connector.connect(name.clone(), tcp.into_inner());
            match tokio::time::timeout(timeout, handshake).await {
                Ok(Ok(stream)) => Ok(UpstreamStream::Tls(Box::new(TokioIo::new(stream)))),
                Ok(Err(e)) => {
                    debug!(upstream = ?name, error = %e, "TLS handshake with the upstream failed");
                    Err(format!("TLS handshake with {} failed: {e}", name.to_str()).into())
                }
                Err(_) => Err(format!(
                    "no TLS handshake with {} within {timeout:?}",
                    name.to_str()
                )
                .into()),
            }
        })
    }
}

/// A connection to the upstream, plain or TLS.
pub enum UpstreamStream {
    Plain(TokioIo<TcpStream>),
    /// Boxed: a TLS session is a kilobyte, a TCP stream a few words.
    Tls(Box<TokioIo<TlsStream<TcpStream>>>),
}

impl Connection for UpstreamStream {
    fn connected(&self) -> Connected {
        match self {
            UpstreamStream::Plain(tcp) => tcp.connected(),
            UpstreamStream::Tls(tls) => {
                let (_, session) = tls.inner().get_ref();
                if session.alpn_protocol() == Some(b"h2") {
                    Connected::new().negotiated_h2()
                } else {
                    Connected::new()
                }
            }
        }
    }
}

impl hyper::rt::Read for UpstreamStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamStream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for UpstreamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamStream::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            UpstreamStream::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpstreamStream::Plain(s) => s.is_write_vectored(),
            UpstreamStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_flush(cx),
            UpstreamStream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamStream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}
