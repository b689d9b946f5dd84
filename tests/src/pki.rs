//! Owns [`TestPki`]: a throwaway certificate authority for tests, with a server certificate for
//! 127.0.0.1 (and any other addresses asked for) and a client certificate for mutual TLS, written
//! as PEM files into a directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The PEM files of one test PKI.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate: trust it to reach the server; the server trusts it for clients.
    pub ca: PathBuf,
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
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "minicri test CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

        let leaf = |name: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose| -> Result<_> {
            let mut params = CertificateParams::new(sans)?;
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            params.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &ca)?;
            Ok((cert.pem(), key.serialize_pem()))
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
            server_cert: write("server.pem", &server_pem)?,
            server_key: write("server.key", &server_key)?,
            client_cert: write("client.pem", &client_pem)?,
            client_key: write("client.key", &client_key)?,
        })
    }
}
