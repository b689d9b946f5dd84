//! TLS for the test API server, as a real one authenticates a kubelet: a server certificate for
//! 127.0.0.1 from a test CA, and client certificates required and checked against that CA.
//! Each connection's client certificate is known by its fingerprint (SHA-256 of its DER, hex),
//! which requests record; a revoked fingerprint gets 401 Unauthorized on every request.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::pki::TestPki;

/// Accepts TLS connections that present a client certificate signed by the test CA.
pub(super) fn acceptor(pki: &TestPki) -> Result<tokio_rustls::TlsAcceptor> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs(&pki.ca)? {
        roots.add(cert).context("adding the test CA")?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
        .build()
        .context("client certificate verifier")?;
    let key = PrivateKeyDer::from_pem_file(&pki.server_key)
        .with_context(|| format!("reading {}", pki.server_key.display()))?;
    let config = rustls::ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(&pki.server_cert)?, key)
        .context("server certificate")?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", path.display()))
}

/// The fingerprint of a DER certificate: SHA-256, hex.
pub fn fingerprint_der(der: &[u8]) -> String {
    hex::encode(Sha256::digest(der))
}

/// The fingerprint of the first certificate in a PEM text (the file the kubelet keeps).
pub fn fingerprint_pem(pem: &str) -> Result<String> {
    let cert = CertificateDer::from_pem_slice(pem.as_bytes()).context("no certificate")?;
    Ok(fingerprint_der(&cert))
}
