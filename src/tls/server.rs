//! TLS on the client listener (issue 47): the certificate and key of
//! `--tls-cert`/`--tls-key`, client certificates required by
//! `--tls-client-ca`, ALPN (`h2`, `http/1.1`), the handshake of each
//! accepted connection, and `SIGHUP`, which re-reads the files.
//!
//! The listener layer calls [`ServerTls::accept`] on each accepted TCP
//! stream and serves what comes back with hyper, HTTP/2 when ALPN chose
//! `h2` and HTTP/1.1 otherwise; nothing above it knows the bytes were
//! encrypted. What carries over from plain connections, and what does not:
//!
//! - `TCP_NOTSENT_LOWAT` is a socket option, set before the handshake, so
//!   it holds as before; and rustls's own buffer of encrypted bytes waiting
//!   for the socket is bounded by [`SEND_BUFFER`] (rustls's default is
//!   64 KiB), so a stalled subscriber's updates still wait in the shared
//!   window, where they collapse, and not below the cursor.
//! - h2 write coalescing wraps the TLS stream as it wraps a TCP one: the
//!   frames one update wakes are encrypted and written together.
//! - Heartbeats are the subscription body's, on every kind of connection.
//! - The HTTP/1.1 subscription fast path (`src/listen/fastpath.rs`) and direct
//!   delivery (`src/deliver/direct.rs`) serve TLS clients too, through
//!   [`TlsSocket`](super::socket::TlsSocket): the session under a lock
//!   that each write or read takes for a moment, so the sweep of a window
//!   hands every parked subscriber's session the one shared chunk to
//!   encrypt. Under TLS the request head cannot be peeked at, so the
//!   client's first bytes are read; when they are not a whole
//!   subscription request, hyper reads them again first
//!   (`src/listen/replay.rs`). h2 connections keep tokio-rustls's stream.
//!
//! A certificate that does not load is an error naming its file at start;
//! on reload the error is logged and the loaded certificate stays. A
//! reload changes what new handshakes use; open connections keep theirs.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tracing::{error, info};

use crate::config::Config;
use crate::tls::{provider, read_certs, read_key, read_roots, unusable};

/// Encrypted bytes rustls may hold for one connection beyond what the
/// kernel took (the bound of a plain connection's write buffer).
pub const SEND_BUFFER: usize = 16 * 1024;

/// The ALPN protocols the listener offers, preferred first.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The files the listener's TLS comes from.
#[derive(Debug, Clone)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
}

impl Files {
    /// Reads the files and builds a server configuration from them.
    fn load(&self, provider: &Arc<CryptoProvider>) -> Result<ServerConfig, String> {
        let chain = read_certs("tls-cert", &self.cert)?;
        let key = read_key("tls-key", &self.key)?;
        let certified =
            rustls::sign::CertifiedKey::from_der(chain, key, provider).map_err(|e| {
                unusable(
                    "tls-key",
                    &self.key,
                    format!("not usable with --tls-cert {}: {e}", self.cert.display()),
                )
            })?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = RootCertStore::empty();
                read_roots("tls-client-ca", path, &mut roots)?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| unusable("tls-client-ca", path, e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config =
            builder.with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(certified)));
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        // Resumption by stateless tickets (RFC 5077's construction, keys
        // rotated every 6 hours, in memory only), so that any number of
        // clients coming back, a reconnect storm after a network blip
        // included, skip the certificate and its signature, and the proxy
        // keeps nothing per session (rustls's stateful cache holds 256).
        // A new ticketer per load: a reload may change what clients must
        // present (--tls-client-ca), and a session resumed across it would
        // skip that check, so tickets issued before a reload are not taken
        // after it (those clients make one full handshake).
        config.ticketer = rustls::crypto::aws_lc_rs::Ticketer::new()
            .map_err(|e| format!("TLS session tickets: {e}"))?;
        Ok(config)
    }
}

/// The listener's TLS: the configuration new handshakes use, replaced as
/// a whole by [`ServerTls::reload`].
pub struct ServerTls {
    files: Files,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<ServerConfig>>,
}

impl ServerTls {
    /// The listener's TLS when `--tls-cert` is set; an error naming the
    /// file that does not load.
    pub fn from_config(config: &Config) -> Result<Option<Arc<ServerTls>>, String> {
        let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
            return Ok(None);
        };
        let files = Files {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: config.tls_client_ca.clone(),
        };
        let provider = provider();
        let loaded = files.load(&provider)?;
        Ok(Some(Arc::new(ServerTls {
            files,
            provider,
            current: RwLock::new(Arc::new(loaded)),
        })))
    }

    /// Whether clients must present a certificate (`--tls-client-ca`).
    pub fn requires_client_certificates(&self) -> bool {
        self.files.client_ca.is_some()
    }

    fn current(&self) -> Arc<ServerConfig> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Re-reads the certificate, the key and the client CA file; new
    /// handshakes use them from now on. On an error the loaded ones stay,
    /// and the error (naming the file) is logged and returned.
    pub fn reload(&self) -> Result<(), String> {
        match self.files.load(&self.provider) {
            Ok(mut fresh) => {
                // Sessions resumed across the reload stay resumable.
                let old = self.current();
                fresh.session_storage = old.session_storage.clone();
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
                info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
                Ok(())
            }
            Err(e) => {
                error!(error = %e, "TLS reload failed; the loaded certificate stays");
                Err(e)
            }
        }
    }

    /// Reloads on every `SIGHUP`, until the task is aborted.
    pub async fn reload_on_sighup(self: Arc<Self>) {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(hangups) => hangups,
            Err(e) => {
                error!(error = %e, "SIGHUP cannot be handled: the TLS files will not be reloaded");
                return;
            }
        };
        while hangups.recv().await.is_some() {
            let _ = self.reload();
        }
    }

    /// The TLS handshake of an accepted connection: the stream to serve,
    /// and whether ALPN chose h2.
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<(TlsStream<TcpStream>, bool)> {
        let mut stream = TlsAcceptor::from(self.current()).accept(tcp).await?;
        let (_, session) = stream.get_mut();
        session.set_buffer_limit(Some(SEND_BUFFER));
        let h2 = session.alpn_protocol() == Some(b"h2");
        Ok((stream, h2))
    }
}
