//! Owns finding and reading the watch's credentials: which kubeconfig (given, or the first of a
//! search list that exists: where kubeadm, kind and k3s put the kubelet's), which node (given,
//! or the client certificate's `CN=system:node:<name>`, else the hostname), and everything the
//! kubeconfig names read into memory at once.
//!
//! Reading every file once, into the kubeconfig itself (`client-certificate` becomes
//! `client-certificate-data`, and so on), gives a client built from one consistent snapshot, and a
//! fingerprint of exactly those bytes: when the kubelet's certificate rotation moves
//! `kubelet-client-current.pem` to a new file, the fingerprint changes and the watch reloads.
//! The kubelet keeps certificate and key in that one file; each is taken out of it separately,
//! so the client presents the certificate once.
//!
//! Everything here is blocking file work: call it off the async workers.

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use base64::Engine as _;
use kube::config::Kubeconfig;

/// The largest kubeconfig, certificate, key or token file read: real ones are a few KiB.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The prefix of a node's client certificate CN (the node authorizer's user name).
const NODE_USER_PREFIX: &str = "system:node:";

/// The first of `candidates` that is a file (following symlinks).
pub fn find_kubeconfig(candidates: &[PathBuf]) -> Option<PathBuf> {
    candidates.iter().find(|p| p.is_file()).cloned()
}

/// A kubeconfig read with every file it names.
pub struct Loaded {
    /// The kubeconfig, the files it named inlined as `*-data` (or `token`).
    pub kubeconfig: Kubeconfig,
    /// NAME of the client certificate's `CN=system:node:NAME`, if it has one.
    pub node_from_cert: Option<String>,
    /// The kubeconfig and the files it named, in the order read.
    pub files: Vec<PathBuf>,
    /// Of the contents of `files`: changes when any of them does.
    pub fingerprint: u64,
}

/// Reads the kubeconfig at `path` and every file its current context names.
pub fn load(path: &Path) -> Result<Loaded> {
    let mut reader = Files::default();
    let text = reader.read(path)?;
    let text = std::str::from_utf8(&text).context("the kubeconfig is not UTF-8")?;
    let mut kubeconfig = Kubeconfig::from_yaml(text).context("parsing the kubeconfig")?;
    let dir = path.parent().unwrap_or(Path::new("/"));
    let absolute = |p: &str| -> PathBuf { dir.join(p) };

    let context_name = kubeconfig
        .current_context
        .clone()
        .filter(|c| !c.is_empty())
        .ok_or_else(|| anyhow!("the kubeconfig has no current-context"))?;
    let context = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == context_name)
        .and_then(|c| c.context.clone())
        .ok_or_else(|| anyhow!("the kubeconfig has no context {context_name:?}"))?;

    let mut node_from_cert = None;
    if let Some(user) = &context.user
        && let Some(auth) = kubeconfig
            .auth_infos
            .iter_mut()
            .find(|a| &a.name == user)
            .and_then(|a| a.auth_info.as_mut())
    {
        let certs = match (
            &auth.client_certificate_data,
            auth.client_certificate.take(),
        ) {
            (Some(data), _) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(data.trim())
                    .context("client-certificate-data is not base64")?,
            ),
            (None, Some(file)) => {
                let pem = reader.read(&absolute(&file))?;
                let certs = pem_blocks(&pem, |label| label == "CERTIFICATE");
                if certs.is_empty() {
                    bail!("{file} holds no certificate");
                }
                auth.client_certificate_data =
                    Some(base64::engine::general_purpose::STANDARD.encode(&certs));
                Some(certs)
            }
            (None, None) => None,
        };
        if let Some(certs) = certs {
            node_from_cert = node_of_certificate(&certs);
        }
        if auth.client_key_data.is_none()
            && let Some(file) = auth.client_key.take()
        {
            let pem = reader.read(&absolute(&file))?;
            let key = pem_blocks(&pem, |label| label.ends_with("PRIVATE KEY"));
            if key.is_empty() {
                bail!("{file} holds no private key");
            }
            let key = base64::engine::general_purpose::STANDARD.encode(&key);
            auth.client_key_data = Some(secrecy::SecretString::from(key));
        }
        if auth.token.is_none()
            && let Some(file) = auth.token_file.take()
        {
            let token = reader.read(&absolute(&file))?;
            let token = String::from_utf8(token).context("the token file is not UTF-8")?;
            auth.token = Some(secrecy::SecretString::from(token.trim().to_string()));
        }
    }
    if let Some(cluster) = kubeconfig
        .clusters
        .iter_mut()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.as_mut())
        && cluster.certificate_authority_data.is_none()
        && let Some(file) = cluster.certificate_authority.take()
    {
        let ca = reader.read(&absolute(&file))?;
        cluster.certificate_authority_data =
            Some(base64::engine::general_purpose::STANDARD.encode(ca));
    }
    Ok(Loaded {
        kubeconfig,
        node_from_cert,
        fingerprint: reader.hasher.finish(),
        files: reader.files,
    })
}

/// The fingerprint [`load`] would give now for the same `files` (a file that cannot be read
/// counts as changed).
pub fn fingerprint(files: &[PathBuf]) -> Option<u64> {
    let mut reader = Files::default();
    for f in files {
        reader.read(f).ok()?;
    }
    Some(reader.hasher.finish())
}

/// Reads files with a size cap, remembering them and hashing their contents.
#[derive(Default)]
struct Files {
    files: Vec<PathBuf>,
    hasher: DefaultHasher,
}

impl Files {
    fn read(&mut self, path: &Path) -> Result<Vec<u8>> {
        let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut bytes = Vec::new();
        f.take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .with_context(|| format!("reading {}", path.display()))?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            bail!("{} is larger than {MAX_FILE_BYTES} bytes", path.display());
        }
        self.hasher.write(path.as_os_str().as_encoded_bytes());
        self.hasher.write(&bytes);
        self.files.push(path.to_path_buf());
        Ok(bytes)
    }
}

/// The PEM blocks of `pem` whose label `keep` accepts, as PEM text.
fn pem_blocks(pem: &[u8], keep: impl Fn(&str) -> bool) -> Vec<u8> {
    let text = String::from_utf8_lossy(pem);
    let mut out = String::new();
    let mut rest = text.as_ref();
    while let Some(start) = rest.find("-----BEGIN ") {
        let block = &rest[start..];
        let Some(label_end) = block["-----BEGIN ".len()..].find("-----") else {
            break;
        };
        let label = &block["-----BEGIN ".len().."-----BEGIN ".len() + label_end];
        let end_marker = format!("-----END {label}-----");
        let Some(end) = block.find(&end_marker) else {
            break;
        };
        let whole = &block[..end + end_marker.len()];
        if keep(label) {
            out.push_str(whole);
            out.push('\n');
        }
        rest = &block[whole.len()..];
    }
    out.into_bytes()
}

/// NAME of the first certificate's subject `CN=system:node:NAME` in `pem`.
pub fn node_of_certificate(pem: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(pem);
    let body = text
        .split("-----BEGIN CERTIFICATE-----")
        .nth(1)?
        .split("-----END CERTIFICATE-----")
        .next()?;
    let b64: String = body.chars().filter(|c| !c.is_whitespace()).collect();
    let der = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    let cn = subject_common_name(&der)?;
    cn.strip_prefix(NODE_USER_PREFIX)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
}

/// One DER element: its tag, its contents and what follows it.
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |l, b| (l << 8) | *b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// The subject's common name (OID 2.5.4.3) of a DER certificate (RFC 5280 section 4.1).
fn subject_common_name(der: &[u8]) -> Option<String> {
    const SEQUENCE: u8 = 0x30;
    const SET: u8 = 0x31;
    const COMMON_NAME: [u8; 3] = [0x55, 0x04, 0x03];
    let (tag, cert, _) = der_element(der)?;
    if tag != SEQUENCE {
        return None;
    }
    let (tag, tbs, _) = der_element(cert)?;
    if tag != SEQUENCE {
        return None;
    }
    let mut fields = tbs;
    // version [0] is optional; then serialNumber, signature, issuer, validity, subject.
    if fields.first() == Some(&0xa0) {
        fields = der_element(fields)?.2;
    }
    for _ in 0..4 {
        fields = der_element(fields)?.2;
    }
    let (tag, mut subject, _) = der_element(fields)?;
    if tag != SEQUENCE {
        return None;
    }
    while !subject.is_empty() {
        let (tag, mut rdn, rest) = der_element(subject)?;
        subject = rest;
        if tag != SET {
            return None;
        }
        while !rdn.is_empty() {
            let (_, attr, rest) = der_element(rdn)?;
            rdn = rest;
            let (oid_tag, oid, value) = der_element(attr)?;
            if oid_tag == 0x06 && oid == COMMON_NAME {
                // UTF8String, PrintableString, IA5String or T61String: the bytes as text.
                let (_, text, _) = der_element(value)?;
                return std::str::from_utf8(text).ok().map(str::to_string);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use minicri_tests::pki::{TestPki, node_client_pem};

    #[test]
    fn the_first_existing_candidate_is_the_kubeconfig() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a"),
            dir.path().join("b"),
            dir.path().join("c"),
        );
        std::fs::write(&b, "x").unwrap();
        std::fs::write(&c, "x").unwrap();
        assert_eq!(find_kubeconfig(&[a.clone(), b.clone(), c.clone()]), Some(b));
        assert_eq!(find_kubeconfig(std::slice::from_ref(&a)), None);
        // A directory is not a kubeconfig; a symlink to a file is.
        std::fs::create_dir(&a).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&c, &link).unwrap();
        assert_eq!(find_kubeconfig(&[a, link.clone()]), Some(link));
    }

    #[test]
    fn the_node_name_is_the_certificates_cn_after_system_node() {
        let dir = tempfile::tempdir().unwrap();
        let pki = TestPki::create(dir.path()).unwrap();
        let (cert, key) = node_client_pem(&pki, "system:node:worker-7").unwrap();
        assert_eq!(
            node_of_certificate(cert.as_bytes()).as_deref(),
            Some("worker-7")
        );
        // The kubelet's rotated file: certificate and key in one.
        let both = format!("{cert}{key}");
        assert_eq!(
            node_of_certificate(both.as_bytes()).as_deref(),
            Some("worker-7")
        );
        // Not a node's certificate, or not a certificate at all.
        let (other, _) = node_client_pem(&pki, "admin").unwrap();
        assert_eq!(node_of_certificate(other.as_bytes()), None);
        assert_eq!(node_of_certificate(key.as_bytes()), None);
        assert_eq!(node_of_certificate(b"garbage"), None);
    }

    #[test]
    fn truncated_or_hostile_der_is_refused_without_panicking() {
        assert_eq!(der_element(&[]), None);
        assert_eq!(der_element(&[0x30]), None);
        // A length longer than the input, and length forms of 0 and 5 bytes.
        assert_eq!(der_element(&[0x30, 0x05, 1, 2]), None);
        assert_eq!(der_element(&[0x30, 0x80, 1]), None);
        assert_eq!(der_element(&[0x30, 0x85, 1, 1, 1, 1, 1, 1]), None);
        assert_eq!(
            der_element(&[0x30, 0x81, 0x02, 7, 8, 9]),
            Some((0x30, &[7u8, 8][..], &[9u8][..]))
        );
        let dir = tempfile::tempdir().unwrap();
        let pki = TestPki::create(dir.path()).unwrap();
        let (cert, _) = node_client_pem(&pki, "system:node:n").unwrap();
        let b64: String = cert.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        for cut in 0..der.len() {
            assert_eq!(subject_common_name(&der[..cut]), None, "cut at {cut}");
        }
        assert_eq!(subject_common_name(&der).as_deref(), Some("system:node:n"));
    }

    #[test]
    fn load_inlines_the_files_and_the_fingerprint_follows_them() {
        let dir = tempfile::tempdir().unwrap();
        let pki = TestPki::create(dir.path()).unwrap();
        let (cert, key) = node_client_pem(&pki, "system:node:node-1").unwrap();
        let pki_dir = dir.path().join("pki");
        std::fs::create_dir(&pki_dir).unwrap();
        std::fs::write(pki_dir.join("client-1.pem"), format!("{cert}{key}")).unwrap();
        std::os::unix::fs::symlink("client-1.pem", pki_dir.join("current.pem")).unwrap();
        let kubeconfig = dir.path().join("kubelet.conf");
        // Relative paths are relative to the kubeconfig's directory, as kubectl reads them.
        std::fs::write(
            &kubeconfig,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n    certificate-authority: ca.pem\nusers:\n- name: u\n  user:\n    client-certificate: pki/current.pem\n    client-key: pki/current.pem\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n",
        )
        .unwrap();
        let loaded = load(&kubeconfig).unwrap();
        assert_eq!(loaded.node_from_cert.as_deref(), Some("node-1"));
        assert_eq!(
            loaded.files,
            vec![
                kubeconfig.clone(),
                pki_dir.join("current.pem"),
                pki_dir.join("current.pem"),
                dir.path().join("ca.pem")
            ]
        );
        let auth = loaded.kubeconfig.auth_infos[0].auth_info.as_ref().unwrap();
        assert!(auth.client_certificate.is_none() && auth.client_key.is_none());
        let certs = base64::engine::general_purpose::STANDARD
            .decode(auth.client_certificate_data.as_ref().unwrap())
            .unwrap();
        let certs = String::from_utf8(certs).unwrap();
        assert_eq!(certs.matches("BEGIN CERTIFICATE").count(), 1);
        assert!(!certs.contains("PRIVATE KEY"));
        assert_eq!(fingerprint(&loaded.files), Some(loaded.fingerprint));

        // The rotation: a new file, the symlink moved.
        let (cert2, key2) = node_client_pem(&pki, "system:node:node-1").unwrap();
        std::fs::write(pki_dir.join("client-2.pem"), format!("{cert2}{key2}")).unwrap();
        std::os::unix::fs::symlink("client-2.pem", pki_dir.join("next.pem")).unwrap();
        std::fs::rename(pki_dir.join("next.pem"), pki_dir.join("current.pem")).unwrap();
        assert_ne!(fingerprint(&loaded.files), Some(loaded.fingerprint));
        assert_ne!(load(&kubeconfig).unwrap().fingerprint, loaded.fingerprint);
        // A file gone: changed too (and loading says which).
        std::fs::remove_file(dir.path().join("ca.pem")).unwrap();
        assert_eq!(fingerprint(&loaded.files), None);
        let err = format!("{:#}", load(&kubeconfig).err().unwrap());
        assert!(err.contains("ca.pem"), "{err}");
    }
}
