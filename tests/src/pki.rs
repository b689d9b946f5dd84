//! Owns [`TestPki`]: a throwaway certificate authority for tests, with a server certificate for
//! 127.0.0.1 (and any other addresses asked for) and a client certificate for mutual TLS, written
//! as PEM files into a directory, and more client certificates on demand ([`node_client_pem`]: a
//! kubelet's, `CN=system:node:NAME`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// The PEM files of one test PKI.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate: trust it to reach the server; the server trusts it for clients.
    pub ca: PathBuf,
    /// The CA's private key (for [`node_client_pem`]).
    pub ca_key: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TestPki {
    /// Generates a CA, a server certificate for `127.0.0.1` and a client certificate, and writes
    /// them into `dir` as `ca.pem`, `server.pem`, `server.key`, `client.pem` and `client.key`.
    pub fn create(dir: &Path) -> Result<TestPki> {
        Self::create_for(dir, &[])
    }

    /// [`TestPki::create`] with a server certificate valid for `ips` too.
    pub fn create_for(dir: &Path, ips: &[std::net::IpAddr]) -> Result<TestPki> {
        let ca_key = KeyPair::generate()?;
        let ca_key_pem = ca_key.serialize_pem();
        let ca = CertifiedIssuer::self_signed(ca_params()?, ca_key)?;

        let leaf = |name: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose| -> Result<_> {
            let mut params = CertificateParams::new(sans)?;
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            params.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            sign(params, &ca)
        };
        let sans = std::iter::once("127.0.0.1".to_string())
            .chain(ips.iter().map(ToString::to_string))
            .collect();
        let (server_pem, server_key) =
            leaf("127.0.0.1", sans, ExtendedKeyUsagePurpose::ServerAuth)?;
        let (client_pem, client_key) = leaf(
            "minicri test node",
            vec![],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;

        let write = |name: &str, text: &str| -> Result<PathBuf> {
            let path = dir.join(name);
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        };
        Ok(TestPki {
            ca: write("ca.pem", &ca.pem())?,
            ca_key: write("ca.key", &ca_key_pem)?,
            server_cert: write("server.pem", &server_pem)?,
            server_key: write("server.key", &server_key)?,
            client_cert: write("client.pem", &client_pem)?,
            client_key: write("client.key", &client_key)?,
        })
    }
}

/// The test CA's parameters: the same each time, so that its key alone makes it an issuer again.
fn ca_params() -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "minicri test CA");
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

/// A fresh key and `params` signed by `issuer`: (certificate PEM, key PEM).
fn sign(params: CertificateParams, issuer: &Issuer<'_, KeyPair>) -> Result<(String, String)> {
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A new client certificate with subject `CN=<common_name>` (a node's is
/// `system:node:<name>`) and a new key, signed by `pki`'s CA: (certificate PEM, key PEM).
pub fn node_client_pem(pki: &TestPki, common_name: &str) -> Result<(String, String)> {
    let key = std::fs::read_to_string(&pki.ca_key)
        .with_context(|| format!("reading {}", pki.ca_key.display()))?;
    let issuer = Issuer::new(ca_params()?, KeyPair::from_pem(&key)?);
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "system:nodes");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    sign(params, &issuer)
}
