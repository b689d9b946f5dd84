//! The standard set of images every pull test can rely on ([`push_standard_set`]), and the big
//! and many-file images of the large-pull tests.

use super::layer::Blob;
use super::*;

/// OCI manifest, one gzip layer: the busybox rootfs.
pub const BUSYBOX_OCI: &str = "minicri-test/busybox:oci";
/// Docker schema 2 manifest, one gzip layer: the same busybox blob as [`BUSYBOX_OCI`].
pub const BUSYBOX_DOCKER: &str = "minicri-test/busybox:docker";
/// OCI, three gzip layers; see [`MULTI_FILES`].
pub const MULTI: &str = "minicri-test/multi:latest";
/// OCI image index: linux/amd64 and linux/arm64/v8 (OCI manifests).
pub const INDEX: &str = "minicri-test/index:latest";
/// Docker manifest list: linux/amd64 and linux/arm64/v8 (Docker schema 2 manifests).
pub const LIST: &str = "minicri-test/list:latest";
/// OCI, one zstd layer: the busybox rootfs.
pub const ZSTD: &str = "minicri-test/zstd:latest";
/// OCI, one uncompressed layer: the busybox rootfs.
pub const PLAIN: &str = "minicri-test/plain:latest";
/// Busybox with `User "1000"` (uid of `minicri`, primary gid 1000, supplementary 1001).
pub const USER_UID: &str = "minicri-test/user:uid";
/// Busybox with `User "minicri"` (resolves through /etc/passwd to 1000:1000).
pub const USER_NAME: &str = "minicri-test/user:name";
/// Busybox with `User "1000:1001"`.
pub const USER_UIDGID: &str = "minicri-test/user:uidgid";
/// Busybox plus a top layer with `/shared/who` = "a\n".
pub const SHARED_A: &str = "minicri-test/shared-a:latest";
/// Busybox plus a top layer with `/shared/who` = "b\n"; shares its base blob with SHARED_A.
pub const SHARED_B: &str = "minicri-test/shared-b:latest";

/// What a container of [`MULTI`] sees: `(path, Some(contents))` for files that exist (read
/// through symlinks and hard links), `(path, None)` for files deleted by whiteouts.
///
/// Layer 2 adds `/data/{a.txt,overwrite.txt,removed.txt,opaque/old.txt}`, a symlink
/// `/data/link.txt` → `a.txt` and `/etc/motd`. Layer 3 overwrites `/data/overwrite.txt`, adds
/// `/data/b.txt` and a hard link `/data/hard.txt` to it, deletes `/data/removed.txt` (whiteout)
/// and makes `/data/opaque` opaque with a new `/data/opaque/new.txt`.
pub const MULTI_FILES: &[(&str, Option<&str>)] = &[
    ("/data/a.txt", Some("a from layer 2\n")),
    ("/data/link.txt", Some("a from layer 2\n")),
    ("/data/overwrite.txt", Some("layer 3\n")),
    ("/data/b.txt", Some("b from layer 3\n")),
    ("/data/hard.txt", Some("b from layer 3\n")),
    ("/data/removed.txt", None),
    ("/data/opaque/old.txt", None),
    ("/data/opaque/new.txt", Some("new in layer 3\n")),
    ("/etc/motd", Some("minicri multi-layer test image\n")),
];

/// The standard set of test images, pushed by [`push_standard_set`].
///
/// Every image is linux/amd64 (except the arm64 members of the index and list), runs
/// `Cmd ["/bin/sh"]` with `Env [PATH=...]`, and has a label `org.minicri.test.image` naming it,
/// so every image has its own config (image ID) even where the layers are the same. All
/// busybox-based gzip images share one base layer blob.
///
/// | reference | format | contents |
/// |---|---|---|
/// | `minicri-test/busybox:oci` | OCI manifest | busybox rootfs, gzip |
/// | `minicri-test/busybox:docker` | Docker schema 2 | busybox rootfs, gzip (same blob) |
/// | `minicri-test/multi:latest` | OCI | busybox + 2 small gzip layers ([`MULTI_FILES`]); `WorkingDir /data`, `Env MULTI_LAYERS=3` |
/// | `minicri-test/index:latest` | OCI index | amd64 and arm64/v8 images: busybox + `/platform` = "linux/amd64\n" / "linux/arm64/v8\n" |
/// | `minicri-test/list:latest` | Docker manifest list | as the index, with Docker manifests |
/// | `minicri-test/zstd:latest` | OCI | busybox rootfs, zstd |
/// | `minicri-test/plain:latest` | OCI | busybox rootfs, uncompressed tar |
/// | `minicri-test/user:uid` | OCI | busybox, `User "1000"` |
/// | `minicri-test/user:name` | OCI | busybox, `User "minicri"` (uid 1000) |
/// | `minicri-test/user:uidgid` | OCI | busybox, `User "1000:1001"` |
/// | `minicri-test/shared-a:latest` | OCI | busybox + `/shared/who` = "a\n" |
/// | `minicri-test/shared-b:latest` | OCI | busybox + `/shared/who` = "b\n" |
///
/// The rootfs has users root (0), daemon (1), minicri (1000, home `/home/minicri`, also in
/// group extra 1001) and nobody (65534); see [`ETC_PASSWD`] and [`ETC_GROUP`].
#[derive(Debug, Clone)]
pub struct StandardSet {
    /// `127.0.0.1:PORT`.
    pub registry: String,
    pub busybox_oci: PushedImage,
    pub busybox_docker: PushedImage,
    pub multi: PushedImage,
    pub index: PushedIndex,
    pub list: PushedIndex,
    pub zstd: PushedImage,
    pub plain: PushedImage,
    pub user_uid: PushedImage,
    pub user_name: PushedImage,
    pub user_uidgid: PushedImage,
    pub shared_a: PushedImage,
    pub shared_b: PushedImage,
}

impl StandardSet {
    /// The single-platform images pushed under tags (not the index/list members).
    pub fn images(&self) -> Vec<&PushedImage> {
        vec![
            &self.busybox_oci,
            &self.busybox_docker,
            &self.multi,
            &self.zstd,
            &self.plain,
            &self.user_uid,
            &self.user_name,
            &self.user_uidgid,
            &self.shared_a,
            &self.shared_b,
        ]
    }

    /// The two multi-platform images.
    pub fn indexes(&self) -> Vec<&PushedIndex> {
        vec![&self.index, &self.list]
    }

    /// Every tagged reference (`127.0.0.1:PORT/minicri-test/...`).
    pub fn references(&self) -> Vec<String> {
        self.images()
            .iter()
            .map(|i| i.reference.clone())
            .chain(self.indexes().iter().map(|i| i.reference.clone()))
            .collect()
    }
}

/// The base image every standard member starts from, labelled with its name.
/// Busybox whose entrypoint sleeps for 2^31-1 seconds: a sandbox ("pause") image for a runtime
/// that runs one (PID 1 of its namespace ignores SIGTERM; SIGKILL stops it).
pub fn sleeper_image() -> Result<ImageBuilder> {
    Ok(standard("sleeper", Format::Oci)?
        .entrypoint(&["/bin/sleep", "2147483647"])
        .cmd(&[]))
}

fn standard(name: &str, format: Format) -> Result<ImageBuilder> {
    Ok(ImageBuilder::new()
        .layer(busybox_layer(Compression::Gzip)?)
        .format(format)
        .label("org.minicri.test.image", name))
}

fn platform_image(name: &str, format: Format, platform: Platform) -> Result<Image> {
    let marker = LayerBuilder::new()
        .created_by(&format!("minicri-tests: /platform marker for {platform}"))
        .file("platform", format!("{platform}\n"), 0o644)
        .build(Compression::Gzip)?;
    standard(name, format)?
        .layer(marker)
        .platform(platform)
        .build()
}

/// Pushes the standard set (see [`StandardSet`]) to the registry at `registry_addr`
/// ("127.0.0.1:PORT"), with basic auth when `auth` is given. Pushing again is cheap (existing
/// blobs are skipped) and gives the same digests.
pub async fn push_standard_set(
    registry_addr: &str,
    auth: Option<(&str, &str)>,
) -> Result<StandardSet> {
    let mut client = RegistryClient::new(registry_addr);
    if let Some((user, password)) = auth {
        client = client.with_basic_auth(user, password);
    }
    push_standard_set_with(&client).await
}

/// [`push_standard_set`] with a ready client.
pub async fn push_standard_set_with(client: &RegistryClient) -> Result<StandardSet> {
    let short = |r: &str| r.trim_start_matches("minicri-test/").to_string();

    let busybox_oci = standard(&short(BUSYBOX_OCI), Format::Oci)?
        .push(client, BUSYBOX_OCI)
        .await?;
    let busybox_docker = standard(&short(BUSYBOX_DOCKER), Format::Docker)?
        .push(client, BUSYBOX_DOCKER)
        .await?;

    let layer2 = LayerBuilder::new()
        .created_by("minicri-tests: multi layer 2")
        .dir("data", 0o755)
        .file("data/a.txt", "a from layer 2\n", 0o644)
        .file("data/overwrite.txt", "layer 2\n", 0o644)
        .file("data/removed.txt", "removed in layer 3\n", 0o644)
        .dir("data/opaque", 0o755)
        .file("data/opaque/old.txt", "hidden by layer 3\n", 0o644)
        .symlink("data/link.txt", "a.txt")
        .file("etc/motd", "minicri multi-layer test image\n", 0o644)
        .build(Compression::Gzip)?;
    let layer3 = LayerBuilder::new()
        .created_by("minicri-tests: multi layer 3")
        .dir("data", 0o755)
        .file("data/overwrite.txt", "layer 3\n", 0o644)
        .file("data/b.txt", "b from layer 3\n", 0o644)
        .hardlink("data/hard.txt", "data/b.txt")
        .whiteout("data/removed.txt")
        .dir("data/opaque", 0o755)
        .opaque("data/opaque")
        .file("data/opaque/new.txt", "new in layer 3\n", 0o644)
        .build(Compression::Gzip)?;
    let multi = standard(&short(MULTI), Format::Oci)?
        .layer(layer2)
        .layer(layer3)
        .working_dir("/data")
        .env("MULTI_LAYERS", "3")
        .push(client, MULTI)
        .await?;

    let mut index = IndexBuilder::new(Format::Oci);
    let mut list = IndexBuilder::new(Format::Docker);
    for platform in [Platform::linux_amd64(), Platform::linux_arm64()] {
        index = index.image(platform_image(
            &short(INDEX),
            Format::Oci,
            platform.clone(),
        )?);
        list = list.image(platform_image(&short(LIST), Format::Docker, platform)?);
    }
    let index = index.push(client, INDEX).await?;
    let list = list.push(client, LIST).await?;

    let zstd = ImageBuilder::new()
        .layer(busybox_layer(Compression::Zstd)?)
        .label("org.minicri.test.image", &short(ZSTD))
        .push(client, ZSTD)
        .await?;
    let plain = ImageBuilder::new()
        .layer(busybox_layer(Compression::None)?)
        .label("org.minicri.test.image", &short(PLAIN))
        .push(client, PLAIN)
        .await?;

    let user_uid = standard(&short(USER_UID), Format::Oci)?
        .user("1000")
        .push(client, USER_UID)
        .await?;
    let user_name = standard(&short(USER_NAME), Format::Oci)?
        .user("minicri")
        .push(client, USER_NAME)
        .await?;
    let user_uidgid = standard(&short(USER_UIDGID), Format::Oci)?
        .user("1000:1001")
        .push(client, USER_UIDGID)
        .await?;

    let mut shared = Vec::new();
    for (reference, who) in [(SHARED_A, "a"), (SHARED_B, "b")] {
        let top = LayerBuilder::new()
            .created_by(&format!("minicri-tests: shared-{who} top layer"))
            .dir("shared", 0o755)
            .file("shared/who", format!("{who}\n"), 0o644)
            .build(Compression::Gzip)?;
        shared.push(
            standard(&short(reference), Format::Oci)?
                .layer(top)
                .push(client, reference)
                .await?,
        );
    }
    let shared_b = shared.pop().expect("shared-b");
    let shared_a = shared.pop().expect("shared-a");

    Ok(StandardSet {
        registry: client.addr().to_string(),
        busybox_oci,
        busybox_docker,
        multi,
        index,
        list,
        zstd,
        plain,
        user_uid,
        user_name,
        user_uidgid,
        shared_a,
        shared_b,
    })
}

/// Pushes `reference`: the busybox base plus the gzip tar files `files` as they are (see
/// [`gzip_file_layer`]), for the benchmark's realistic image.
pub async fn push_gzip_files_image(
    client: &RegistryClient,
    reference: &str,
    files: &[std::path::PathBuf],
) -> Result<PushedImage> {
    let (repository, _) = client.split_reference(reference)?;
    let mut image = ImageBuilder::busybox().label("org.minicri.test.image", "files");
    for file in files {
        let path = file.clone();
        let layer = tokio::task::spawn_blocking(move || gzip_file_layer(&path))
            .await
            .context("layer thread")?
            .with_context(|| format!("reading {}", file.display()))?;
        client.push_layer(&repository, &layer).await?;
        image = image.layer(layer);
    }
    image.push(client, reference).await
}

/// Pushes `name:tag` made of the gzip busybox base plus `layers` layers of `layer_mib` MiB of
/// random bytes each (seeds `seed`, `seed+1`, ...), for large-pull tests and benchmarks. Each
/// layer is made in a temporary file, pushed, and removed before the next is made.
pub async fn push_big_image(
    client: &RegistryClient,
    reference: &str,
    layers: u64,
    layer_mib: u64,
    compression: Compression,
    seed: u64,
) -> Result<PushedImage> {
    let (repository, _) = client.split_reference(reference)?;
    let mut image = ImageBuilder::busybox().label("org.minicri.test.image", "big");
    for i in 0..layers {
        let layer =
            tokio::task::spawn_blocking(move || random_layer(layer_mib, compression, seed + i))
                .await
                .context("layer thread")??;
        client.push_layer(&repository, &layer).await?;
        // Keep only the digests: the pushed file is no longer needed.
        image = image.layer(Layer {
            blob: Blob::Memory(Bytes::new()),
            ..layer
        });
    }
    // The random layers are in the registry already (skipped by HEAD), so only the base,
    // the config and the manifest move now.
    image.push(client, reference).await
}
