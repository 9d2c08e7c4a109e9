//! TLS, both sides (issue 47): [`server`], the client listener's
//! (certificate, client certificates, ALPN, the handshake, `SIGHUP`
//! reload), and [`client`], an `https://` upstream's (roots, verification,
//! SNI, ALPN, the client certificate, the upstream client's connector).
//! Here: what both use, the crypto provider and the PEM files.
//!
//! The listener layer and the upstream client each reach their side
//! through one hook; nothing else in the proxy knows whether a byte was
//! encrypted.

pub mod client;
pub mod server;
pub mod socket;

use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

pub use server::ServerTls;

/// The cryptography of every TLS session of the proxy, both sides:
/// aws-lc-rs, whose key exchange includes the post-quantum hybrid
/// X25519MLKEM768 that browsers offer (docs/design.md, "Dependencies").
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A file that could not be used: the flag and the path, then why.
pub(crate) fn unusable(flag: &str, path: &Path, why: impl std::fmt::Display) -> String {
    format!("--{flag} {}: {why}", path.display())
}

/// Every certificate of a PEM file, in order; at least one.
pub fn read_certs(flag: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| unusable(flag, path, pem_error(e)))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| unusable(flag, path, pem_error(e)))?;
    if certs.is_empty() {
        return Err(unusable(flag, path, "no CERTIFICATE in it"));
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(flag: &str, path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        let reason = match e {
            rustls_pki_types::pem::Error::NoItemsFound if holds_encrypted_key(path) => {
                "the private key is encrypted (a passphrase is not supported): \
                 write it out unencrypted, readable only by the proxy's user \
                 (openssl pkey -in FILE -out FILE.key)"
                    .to_string()
            }
            rustls_pki_types::pem::Error::NoItemsFound => {
                "no private key in it (PKCS#8, PKCS#1 RSA or SEC1 EC, PEM)".to_string()
            }
            other => pem_error(other),
        };
        unusable(flag, path, reason)
    })
}

/// Whether a PEM file holds a passphrase-protected key: PKCS#8's
/// `ENCRYPTED PRIVATE KEY`, or OpenSSL's older `Proc-Type: 4,ENCRYPTED`.
fn holds_encrypted_key(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|pem| {
        let text = String::from_utf8_lossy(&pem);
        text.contains("-----BEGIN ENCRYPTED PRIVATE KEY-----")
            || text.contains("Proc-Type: 4,ENCRYPTED")
    })
}

/// The certificates of a PEM file as trust anchors.
pub fn read_roots(flag: &str, path: &Path, roots: &mut RootCertStore) -> Result<(), String> {
    for cert in read_certs(flag, path)? {
        roots
            .add(cert)
            .map_err(|e| unusable(flag, path, format!("not a CA certificate: {e}")))?;
    }
    Ok(())
}

/// A PEM error in words (the I/O error's own text when the file could
/// not be read).
fn pem_error(e: rustls_pki_types::pem::Error) -> String {
    match e {
        rustls_pki_types::pem::Error::Io(e) => format!("cannot read it: {e}"),
        rustls_pki_types::pem::Error::NoItemsFound => "no PEM item of the expected kind".into(),
        other => format!("not valid PEM: {other:?}"),
    }
}
