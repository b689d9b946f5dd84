//! The registry HTTP API client the tests push and fetch with ([`RegistryClient`]).

use super::layer::Blob;
use super::*;

/// A minimal client of the registry HTTP API (distribution spec): blob upload, manifest
/// put/get, blob get. Plain HTTP to a local registry, optional basic auth, no proxy from the
/// environment.
#[derive(Clone)]
pub struct RegistryClient {
    addr: String,
    http: reqwest::Client,
    auth: Option<(String, String)>,
}

impl fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryClient")
            .field("addr", &self.addr)
            .field("auth", &self.auth.as_ref().map(|(u, _)| u))
            .finish()
    }
}

/// A manifest as the registry served it.
#[derive(Debug, Clone)]
pub struct FetchedManifest {
    /// The response's Content-Type.
    pub media_type: String,
    /// The `Docker-Content-Digest` header, if any.
    pub digest_header: Option<String>,
    pub body: Bytes,
}

impl FetchedManifest {
    /// The sha256 of the body.
    pub fn digest(&self) -> String {
        sha256_digest(&self.body)
    }
    pub fn json(&self) -> Result<Value> {
        Ok(serde_json::from_slice(&self.body)?)
    }
}

impl RegistryClient {
    /// A client for the registry at `addr` ("127.0.0.1:PORT"; an `http://` prefix is accepted).
    pub fn new(addr: &str) -> Self {
        let addr = addr
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .expect("building an HTTP client");
        RegistryClient {
            addr,
            http,
            auth: None,
        }
    }

    /// Sends basic auth with every request.
    pub fn with_basic_auth(mut self, user: &str, password: &str) -> Self {
        self.auth = Some((user.to_string(), password.to_string()));
        self
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The underlying reqwest client.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// A request with auth applied; `path_or_url` is "/v2/..." or an absolute URL.
    pub fn request(&self, method: reqwest::Method, path_or_url: &str) -> reqwest::RequestBuilder {
        let url = if path_or_url.starts_with("http://") || path_or_url.starts_with("https://") {
            path_or_url.to_string()
        } else {
            format!("{}{}", self.base_url(), path_or_url)
        };
        let req = self.http.request(method, url);
        match &self.auth {
            Some((user, password)) => req.basic_auth(user, Some(password)),
            None => req,
        }
    }

    /// ("name", Some(tag)), or ("name", None) for a digest reference ("name@sha256:...").
    pub fn split_reference(&self, reference: &str) -> Result<(String, Option<String>)> {
        let (repository, target) = self.split_reference_full(reference)?;
        Ok(if target.starts_with("sha256:") {
            (repository, None)
        } else {
            (repository, Some(target))
        })
    }

    /// ("name", "tag-or-digest"); "name" alone means tag "latest".
    pub fn split_reference_full(&self, reference: &str) -> Result<(String, String)> {
        let prefix = format!("{}/", self.addr);
        let reference = reference.strip_prefix(&prefix).unwrap_or(reference);
        let (repository, target) = if let Some((repo, digest)) = reference.split_once('@') {
            (repo, digest.to_string())
        } else {
            let last_slash = reference.rfind('/').map(|i| i + 1).unwrap_or(0);
            match reference[last_slash..].rfind(':') {
                Some(i) => (
                    &reference[..last_slash + i],
                    reference[last_slash + i + 1..].to_string(),
                ),
                None => (reference, "latest".to_string()),
            }
        };
        ensure!(
            !repository.is_empty() && !target.is_empty(),
            "bad reference {reference:?}"
        );
        Ok((repository.to_string(), target))
    }

    /// Whether the repository has the blob (`HEAD /v2/<name>/blobs/<digest>`).
    pub async fn blob_exists(&self, repository: &str, digest: &str) -> Result<bool> {
        let resp = self
            .request(
                reqwest::Method::HEAD,
                &format!("/v2/{repository}/blobs/{digest}"),
            )
            .send()
            .await?;
        match resp.status().as_u16() {
            200 => Ok(true),
            404 => Ok(false),
            code => bail!("HEAD blob {digest} in {repository}: HTTP {code}"),
        }
    }

    /// Pushes a layer's blob unless the repository has it.
    pub async fn push_layer(&self, repository: &str, layer: &Layer) -> Result<()> {
        match &layer.blob {
            Blob::Memory(data) => {
                self.push_blob_bytes(repository, &layer.digest, data.clone())
                    .await
            }
            Blob::File(path) => self.push_blob_file(repository, &layer.digest, path).await,
            Blob::Kept(path) => self.push_blob_file(repository, &layer.digest, path).await,
        }
    }

    /// Pushes a blob unless the repository has it: monolithic upload, `POST` then `PUT
    /// <location>?digest=`.
    pub async fn push_blob_bytes(&self, repository: &str, digest: &str, data: Bytes) -> Result<()> {
        if self.blob_exists(repository, digest).await? {
            return Ok(());
        }
        let len = data.len() as u64;
        self.upload(repository, digest, len, reqwest::Body::from(data))
            .await
    }

    /// Pushes a blob from a file, streamed, unless the repository has it.
    pub async fn push_blob_file(&self, repository: &str, digest: &str, path: &Path) -> Result<()> {
        if self.blob_exists(repository, digest).await? {
            return Ok(());
        }
        let file = tokio::fs::File::open(path)
            .await
            .with_context(|| format!("opening {}", path.display()))?;
        let len = file.metadata().await?.len();
        let stream = tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024);
        self.upload(repository, digest, len, reqwest::Body::wrap_stream(stream))
            .await
    }

    async fn upload(
        &self,
        repository: &str,
        digest: &str,
        len: u64,
        body: reqwest::Body,
    ) -> Result<()> {
        let resp = self
            .request(
                reqwest::Method::POST,
                &format!("/v2/{repository}/blobs/uploads/"),
            )
            .header(reqwest::header::CONTENT_LENGTH, "0")
            .send()
            .await?;
        if resp.status().as_u16() != 202 {
            bail!(
                "starting an upload to {repository}: HTTP {} {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }
        let location = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| anyhow!("upload to {repository}: no Location header"))?
            .to_string();
        let sep = if location.contains('?') { '&' } else { '?' };
        let url = format!("{location}{sep}digest={}", digest.replace(':', "%3A"));
        let resp = self
            .request(reqwest::Method::PUT, &url)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .header(reqwest::header::CONTENT_LENGTH, len.to_string())
            .body(body)
            .send()
            .await?;
        if resp.status().as_u16() != 201 {
            bail!(
                "uploading blob {digest} to {repository}: HTTP {} {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }
        Ok(())
    }

    /// `PUT /v2/<name>/manifests/<tag or digest>`; returns the registry's digest of it.
    pub async fn put_manifest(
        &self,
        repository: &str,
        reference: &str,
        media_type: &str,
        body: Bytes,
    ) -> Result<String> {
        let resp = self
            .request(
                reqwest::Method::PUT,
                &format!("/v2/{repository}/manifests/{reference}"),
            )
            .header(reqwest::header::CONTENT_TYPE, media_type)
            .body(body.clone())
            .send()
            .await?;
        if resp.status().as_u16() != 201 {
            bail!(
                "putting manifest {repository}:{reference}: HTTP {} {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }
        Ok(resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .unwrap_or_else(|| sha256_digest(&body)))
    }

    /// `GET /v2/<name>/manifests/<tag or digest>` accepting every manifest type.
    pub async fn get_manifest(&self, repository: &str, reference: &str) -> Result<FetchedManifest> {
        let resp = self
            .request(
                reqwest::Method::GET,
                &format!("/v2/{repository}/manifests/{reference}"),
            )
            .header(reqwest::header::ACCEPT, MANIFEST_MEDIA_TYPES.join(", "))
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!(
                "getting manifest {repository}:{reference}: HTTP {}",
                resp.status()
            );
        }
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(String::from)
        };
        let media_type = header("content-type").unwrap_or_default();
        let digest_header = header("docker-content-digest");
        Ok(FetchedManifest {
            media_type,
            digest_header,
            body: resp.bytes().await?,
        })
    }

    /// `GET /v2/<name>/blobs/<digest>`, the whole body.
    pub async fn get_blob(&self, repository: &str, digest: &str) -> Result<Bytes> {
        let resp = self
            .request(
                reqwest::Method::GET,
                &format!("/v2/{repository}/blobs/{digest}"),
            )
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!(
                "getting blob {digest} of {repository}: HTTP {}",
                resp.status()
            );
        }
        Ok(resp.bytes().await?)
    }

    /// `DELETE /v2/<name>/manifests/<digest>` (the test registries allow deletes).
    pub async fn delete_manifest(&self, repository: &str, digest: &str) -> Result<()> {
        let resp = self
            .request(
                reqwest::Method::DELETE,
                &format!("/v2/{repository}/manifests/{digest}"),
            )
            .send()
            .await?;
        if resp.status().as_u16() != 202 {
            bail!(
                "deleting manifest {repository}@{digest}: HTTP {}",
                resp.status()
            );
        }
        Ok(())
    }
}
