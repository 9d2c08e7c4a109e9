//! TLS for the load generators (`examples/fanout.rs --tls`,
//! `examples/handshakes.rs`): certificates made at run time with rcgen (a
//! CA and a server certificate for `localhost` and 127.0.0.1, written as
//! `ca.pem`, `cert.pem`, `key.pem`), and the client configuration every
//! connection of a run shares (rustls with the aws-lc-rs provider, ALPN
//! `http/1.1` only, session resumption off: every connection makes a full
//! handshake).
//!
//! Included by `#[path]` from both examples; not an example of its own.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// The server's key: ECDSA P-256 (rcgen's default, and what current
/// automated CAs issue by default) or RSA 2048.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum KeyKind {
    EcdsaP256,
    Rsa2048,
}

impl KeyKind {
    pub fn parse(s: &str) -> KeyKind {
        match s {
            "ecdsa" | "ecdsa-p256" | "p256" => KeyKind::EcdsaP256,
            "rsa" | "rsa2048" | "rsa-2048" => KeyKind::Rsa2048,
            other => panic!("--key ecdsa-p256|rsa2048, not {other}"),
        }
    }
}

/// The three PEM files of a run.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl CertFiles {
    pub fn in_dir(dir: &Path) -> CertFiles {
        CertFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }
    }
}

/// Makes a CA and a server certificate for `localhost` and 127.0.0.1
/// signed by it, and writes `ca.pem`, `cert.pem` (the server's certificate
/// alone: the CA is the trust anchor) and `key.pem` (PKCS#8) into `dir`.
pub fn write_certs(dir: &Path, kind: KeyKind) -> CertFiles {
    std::fs::create_dir_all(dir).expect("the certificates' directory");
    let ca_key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "braid-proxy bench CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = params.self_signed(&ca_key).expect("CA certificate");

    let key = match kind {
        KeyKind::EcdsaP256 => KeyPair::generate().expect("server key"),
        KeyKind::Rsa2048 => {
            KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048)
                .expect("RSA server key")
        }
    };
    let mut params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .expect("server params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params
        .signed_by(&key, &ca, &ca_key)
        .expect("server certificate");

    let files = CertFiles::in_dir(dir);
    std::fs::write(&files.ca, ca.pem()).expect("write ca.pem");
    std::fs::write(&files.cert, cert.pem()).expect("write cert.pem");
    std::fs::write(&files.key, key.serialize_pem()).expect("write key.pem");
    files
}

/// The key exchange groups the client offers (and so the one the server
/// can pick).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kx {
    /// X25519 alone: what nginx with OpenSSL 3.0 picks from any browser's
    /// offer, so both servers make the same key exchange.
    X25519,
    /// rustls's default list (X25519MLKEM768 first, with an X25519 share
    /// beside it, as current browsers send): rustls servers pick the
    /// hybrid, OpenSSL 3.0 picks X25519.
    Default,
}

impl Kx {
    pub fn parse(s: &str) -> Kx {
        match s {
            "x25519" => Kx::X25519,
            "default" | "browser" => Kx::Default,
            other => panic!("--kx x25519|default, not {other}"),
        }
    }
}

/// How the client treats the server's certificate.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Verify {
    /// The chain against the CA file, the name, and the handshake
    /// signature, as any client does.
    Full,
    /// Nothing checked (the handshake is the same on the server's side;
    /// the generator saves the ECDSA verification and the chain's
    /// parsing): for measuring a server's handshakes from one core.
    Off,
}

fn provider(kx: Kx) -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    if kx == Kx::X25519 {
        provider.kx_groups = vec![rustls::crypto::aws_lc_rs::kx_group::X25519];
    }
    Arc::new(provider)
}

/// The client configuration one run's connections share: TLS 1.3 and
/// 1.2 offered, ALPN `http/1.1` only, no session resumption (no session
/// store, no tickets kept: every handshake is a full one).
pub fn client_config(ca: Option<&Path>, verify: Verify, kx: Kx) -> Arc<ClientConfig> {
    let provider = provider(kx);
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("protocol versions");
    let mut config = match verify {
        Verify::Full => {
            let ca = ca.expect("a CA file to verify against");
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca).expect("read the CA file") {
                roots
                    .add(cert.expect("a PEM certificate"))
                    .expect("a CA certificate");
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        Verify::Off => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

/// The name connections verify and send as SNI.
pub fn server_name() -> ServerName<'static> {
    ServerName::try_from("localhost").expect("name")
}

/// What a handshake negotiated: `TLSv1_3 TLS13_AES_256_GCM_SHA384 X25519
/// http/1.1`.
pub fn describe(conn: &rustls::ClientConnection) -> String {
    let version = conn
        .protocol_version()
        .map_or("?".to_string(), |v| format!("{v:?}"));
    let suite = conn
        .negotiated_cipher_suite()
        .map_or("?".to_string(), |s| format!("{:?}", s.suite()));
    let group = conn
        .negotiated_key_exchange_group()
        .map_or("?".to_string(), |g| format!("{:?}", g.name()));
    let alpn = conn.alpn_protocol().map_or("no ALPN".to_string(), |p| {
        String::from_utf8_lossy(p).into_owned()
    });
    format!("{version} {suite} {group} {alpn}")
}

/// Accepts any certificate and signature (`Verify::Off`).
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
