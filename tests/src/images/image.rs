//! Images and indexes: configs and manifests (OCI or Docker schema 2) built from layers
//! ([`ImageBuilder`]), OCI indexes and Docker manifest lists ([`IndexBuilder`]), and what a push
//! returns.

use super::*;

/// A single-platform image under construction.
#[derive(Debug, Clone)]
pub struct ImageBuilder {
    layers: Vec<Layer>,
    platform: Platform,
    format: Format,
    cmd: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    env: Vec<String>,
    user: Option<String>,
    working_dir: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    stop_signal: Option<String>,
    created: String,
}

impl Default for ImageBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ImageBuilder {
    /// No layers, linux/amd64, OCI, `Cmd ["/bin/sh"]`, `Env [PATH=...]`.
    pub fn new() -> Self {
        ImageBuilder {
            layers: Vec::new(),
            platform: Platform::linux_amd64(),
            format: Format::Oci,
            cmd: Some(vec!["/bin/sh".into()]),
            entrypoint: None,
            env: vec![DEFAULT_PATH.into()],
            user: None,
            working_dir: None,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            stop_signal: None,
            created: CREATED.into(),
        }
    }

    /// [`ImageBuilder::new`] with the gzip busybox layer as its base.
    pub fn busybox() -> Self {
        let layer = busybox_layer(Compression::Gzip)
            .unwrap_or_else(|e| panic!("building the busybox layer: {e}"));
        Self::new().layer(layer)
    }

    /// Adds a layer on top.
    pub fn layer(mut self, layer: Layer) -> Self {
        self.layers.push(layer);
        self
    }

    pub fn layers(mut self, layers: impl IntoIterator<Item = Layer>) -> Self {
        self.layers.extend(layers);
        self
    }

    pub fn platform(mut self, platform: Platform) -> Self {
        self.platform = platform;
        self
    }

    pub fn format(mut self, format: Format) -> Self {
        self.format = format;
        self
    }

    /// `config.Cmd`; an empty slice removes it.
    pub fn cmd(mut self, cmd: &[&str]) -> Self {
        self.cmd = (!cmd.is_empty()).then(|| cmd.iter().map(|s| s.to_string()).collect());
        self
    }

    /// `config.Entrypoint`; an empty slice removes it.
    pub fn entrypoint(mut self, entrypoint: &[&str]) -> Self {
        self.entrypoint =
            (!entrypoint.is_empty()).then(|| entrypoint.iter().map(|s| s.to_string()).collect());
        self
    }

    /// Adds `KEY=VALUE` to `config.Env` (replacing an earlier value of the same key).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        let prefix = format!("{key}=");
        self.env.retain(|e| !e.starts_with(&prefix));
        self.env.push(format!("{key}={value}"));
        self
    }

    /// `config.User`: "1000", "1000:1001", "minicri", "minicri:extra", ...
    pub fn user(mut self, user: &str) -> Self {
        self.user = Some(user.to_string());
        self
    }

    /// `config.WorkingDir`.
    pub fn working_dir(mut self, dir: &str) -> Self {
        self.working_dir = Some(dir.to_string());
        self
    }

    /// `config.StopSignal`.
    pub fn stop_signal(mut self, signal: &str) -> Self {
        self.stop_signal = Some(signal.to_string());
        self
    }

    /// `config.Labels[key] = value`.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }

    /// A manifest annotation (OCI format only; Docker manifests have none).
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_string(), value.to_string());
        self
    }

    /// The config's and history's `created` (default [`CREATED`]).
    pub fn created(mut self, created: &str) -> Self {
        self.created = created.to_string();
        self
    }

    /// Makes the config and manifest.
    pub fn build(&self) -> Result<Image> {
        let mut container = serde_json::Map::new();
        container.insert("Env".into(), json!(self.env));
        if let Some(cmd) = &self.cmd {
            container.insert("Cmd".into(), json!(cmd));
        }
        if let Some(entrypoint) = &self.entrypoint {
            container.insert("Entrypoint".into(), json!(entrypoint));
        }
        if let Some(user) = &self.user {
            container.insert("User".into(), json!(user));
        }
        if let Some(dir) = &self.working_dir {
            container.insert("WorkingDir".into(), json!(dir));
        }
        if let Some(signal) = &self.stop_signal {
            container.insert("StopSignal".into(), json!(signal));
        }
        if !self.labels.is_empty() {
            container.insert("Labels".into(), json!(self.labels));
        }
        let history: Vec<Value> = self
            .layers
            .iter()
            .map(|l| json!({ "created": self.created, "created_by": l.created_by }))
            .collect();
        let mut config = json!({
            "created": self.created,
            "author": "minicri-tests",
            "architecture": self.platform.architecture,
            "os": self.platform.os,
            "config": Value::Object(container),
            "rootfs": {
                "type": "layers",
                "diff_ids": self.layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>(),
            },
            "history": history,
        });
        if let Some(variant) = &self.platform.variant {
            config["variant"] = json!(variant);
        }
        let config = serde_json::to_vec(&config)?;
        let config_digest = sha256_digest(&config);

        let layers: Vec<Value> = self
            .layers
            .iter()
            .map(|l| json!({ "mediaType": l.media_type(self.format), "digest": l.digest, "size": l.size }))
            .collect();
        let mut manifest = json!({
            "schemaVersion": 2,
            "mediaType": self.format.manifest_media_type(),
            "config": {
                "mediaType": self.format.config_media_type(),
                "digest": config_digest,
                "size": config.len(),
            },
            "layers": layers,
        });
        if self.format == Format::Oci && !self.annotations.is_empty() {
            manifest["annotations"] = json!(self.annotations);
        }
        let manifest = serde_json::to_vec_pretty(&manifest)?;
        Ok(Image {
            format: self.format,
            platform: self.platform.clone(),
            user: self.user.clone(),
            layers: self.layers.clone(),
            config_digest,
            config: config.into(),
            manifest_digest: sha256_digest(&manifest),
            manifest: manifest.into(),
        })
    }

    /// Builds and pushes to `reference` ("name:tag", "name@sha256:..." or "name" for latest;
    /// a leading "<registry addr>/" is accepted).
    pub async fn push(&self, client: &RegistryClient, reference: &str) -> Result<PushedImage> {
        self.build()?.push(client, reference).await
    }
}

/// A built single-platform image.
#[derive(Debug, Clone)]
pub struct Image {
    pub format: Format,
    pub platform: Platform,
    pub user: Option<String>,
    pub layers: Vec<Layer>,
    /// The config JSON.
    pub config: Bytes,
    /// Its digest, the image ID.
    pub config_digest: String,
    /// The manifest JSON.
    pub manifest: Bytes,
    pub manifest_digest: String,
}

impl Image {
    pub fn manifest_media_type(&self) -> &'static str {
        self.format.manifest_media_type()
    }

    /// Pushes the blobs (skipping those the repository has), then the manifest under the tag
    /// or digest of `reference`.
    pub async fn push(&self, client: &RegistryClient, reference: &str) -> Result<PushedImage> {
        let (repository, tag) = client.split_reference(reference)?;
        for layer in &self.layers {
            client.push_layer(&repository, layer).await?;
        }
        client
            .push_blob_bytes(&repository, &self.config_digest, self.config.clone())
            .await?;
        let target = tag.clone().unwrap_or_else(|| self.manifest_digest.clone());
        let digest = client
            .put_manifest(
                &repository,
                &target,
                self.manifest_media_type(),
                self.manifest.clone(),
            )
            .await?;
        ensure!(
            digest == self.manifest_digest,
            "registry computed manifest digest {digest}, expected {}",
            self.manifest_digest
        );
        Ok(self.pushed(client, &repository, tag))
    }

    fn pushed(
        &self,
        client: &RegistryClient,
        repository: &str,
        tag: Option<String>,
    ) -> PushedImage {
        let registry = client.addr().to_string();
        let reference = match &tag {
            Some(tag) => format!("{registry}/{repository}:{tag}"),
            None => format!("{registry}/{repository}@{}", self.manifest_digest),
        };
        PushedImage {
            reference,
            registry,
            repository: repository.to_string(),
            tag,
            manifest_digest: self.manifest_digest.clone(),
            manifest_media_type: self.manifest_media_type().to_string(),
            manifest_size: self.manifest.len() as u64,
            config_digest: self.config_digest.clone(),
            config_media_type: self.format.config_media_type().to_string(),
            config_size: self.config.len() as u64,
            layers: self
                .layers
                .iter()
                .map(|l| LayerInfo {
                    digest: l.digest.clone(),
                    size: l.size,
                    diff_id: l.diff_id.clone(),
                    media_type: l.media_type(self.format).to_string(),
                })
                .collect(),
            platform: self.platform.clone(),
            user: self.user.clone(),
        }
    }
}

/// A layer as the manifest and config name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// Digest of the blob.
    pub digest: String,
    /// Size of the blob.
    pub size: u64,
    /// Digest of the uncompressed tar.
    pub diff_id: String,
    pub media_type: String,
}

/// What was pushed for one single-platform image.
#[derive(Debug, Clone)]
pub struct PushedImage {
    /// `127.0.0.1:PORT/name:tag`, or `127.0.0.1:PORT/name@sha256:...` when pushed by digest
    /// (the platform images of an index).
    pub reference: String,
    /// `127.0.0.1:PORT`.
    pub registry: String,
    /// `name`, e.g. `minicri-test/busybox`.
    pub repository: String,
    pub tag: Option<String>,
    pub manifest_digest: String,
    pub manifest_media_type: String,
    pub manifest_size: u64,
    /// The image ID.
    pub config_digest: String,
    pub config_media_type: String,
    pub config_size: u64,
    /// Bottom first.
    pub layers: Vec<LayerInfo>,
    pub platform: Platform,
    /// `config.User`.
    pub user: Option<String>,
}

impl PushedImage {
    /// `127.0.0.1:PORT/name@sha256:<manifest digest>`.
    pub fn digest_reference(&self) -> String {
        format!(
            "{}/{}@{}",
            self.registry, self.repository, self.manifest_digest
        )
    }
    /// The image ID (config digest).
    pub fn image_id(&self) -> &str {
        &self.config_digest
    }
    /// Sum of the layer blob sizes.
    pub fn layers_size(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }
    /// Every blob digest: config and layers.
    pub fn blob_digests(&self) -> Vec<String> {
        std::iter::once(self.config_digest.clone())
            .chain(self.layers.iter().map(|l| l.digest.clone()))
            .collect()
    }
}

/// A multi-platform image (OCI index or Docker manifest list) under construction.
#[derive(Debug, Clone)]
pub struct IndexBuilder {
    format: Format,
    images: Vec<Image>,
    annotations: BTreeMap<String, String>,
}

impl IndexBuilder {
    /// An empty OCI index ([`Format::Oci`]) or Docker manifest list ([`Format::Docker`]).
    pub fn new(format: Format) -> Self {
        IndexBuilder {
            format,
            images: Vec::new(),
            annotations: BTreeMap::new(),
        }
    }

    /// Adds a platform image (its own platform goes into the index entry).
    pub fn image(mut self, image: Image) -> Self {
        self.images.push(image);
        self
    }

    /// An index annotation (OCI only).
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_string(), value.to_string());
        self
    }

    /// The index JSON and its digest.
    pub fn build(&self) -> Result<(Bytes, String)> {
        let manifests: Vec<Value> = self
            .images
            .iter()
            .map(|image| {
                json!({
                    "mediaType": image.manifest_media_type(),
                    "digest": image.manifest_digest,
                    "size": image.manifest.len(),
                    "platform": image.platform.to_json(),
                })
            })
            .collect();
        let mut index = json!({
            "schemaVersion": 2,
            "mediaType": self.format.index_media_type(),
            "manifests": manifests,
        });
        if self.format == Format::Oci && !self.annotations.is_empty() {
            index["annotations"] = json!(self.annotations);
        }
        let index = serde_json::to_vec_pretty(&index)?;
        let digest = sha256_digest(&index);
        Ok((index.into(), digest))
    }

    /// Pushes every platform image by digest, then the index under `reference`.
    pub async fn push(&self, client: &RegistryClient, reference: &str) -> Result<PushedIndex> {
        let (repository, tag) = client.split_reference(reference)?;
        let mut manifests = Vec::new();
        for image in &self.images {
            manifests.push(
                image
                    .push(client, &format!("{repository}@{}", image.manifest_digest))
                    .await?,
            );
        }
        let (index, digest) = self.build()?;
        let target = tag.clone().unwrap_or_else(|| digest.clone());
        let got = client
            .put_manifest(
                &repository,
                &target,
                self.format.index_media_type(),
                index.clone(),
            )
            .await?;
        ensure!(
            got == digest,
            "registry computed index digest {got}, expected {digest}"
        );
        let registry = client.addr().to_string();
        let reference = match &tag {
            Some(tag) => format!("{registry}/{repository}:{tag}"),
            None => format!("{registry}/{repository}@{digest}"),
        };
        Ok(PushedIndex {
            reference,
            registry,
            repository,
            tag,
            digest,
            media_type: self.format.index_media_type().to_string(),
            size: index.len() as u64,
            manifests,
        })
    }
}

/// What was pushed for a multi-platform image.
#[derive(Debug, Clone)]
pub struct PushedIndex {
    /// `127.0.0.1:PORT/name:tag`.
    pub reference: String,
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// Digest of the index / manifest list.
    pub digest: String,
    pub media_type: String,
    pub size: u64,
    /// The platform images, in index order.
    pub manifests: Vec<PushedImage>,
}

impl PushedIndex {
    /// The image for `architecture` ("amd64", "arm64").
    pub fn for_arch(&self, architecture: &str) -> Option<&PushedImage> {
        self.manifests
            .iter()
            .find(|m| m.platform.architecture == architecture)
    }
    /// `127.0.0.1:PORT/name@sha256:<index digest>`.
    pub fn digest_reference(&self) -> String {
        format!("{}/{}@{}", self.registry, self.repository, self.digest)
    }
}
