//! Owns the `minicri-testimg` command: pushes minicri's test images to a registry, either the
//! documented standard set (`push-standard`) or one big image of random layers for benchmarks
//! (`push-big`). It prints what it pushed: reference, manifest digest, config digest.
//! `push-files` pushes gzip tar files made elsewhere as an image's layers (the benchmark's
//! realistic image). `pull` asks a CRI runtime (minicri, or containerd's CRI plugin) to pull an
//! image and prints how long it took (used by hack/bench-pull.sh, so the benchmark needs no
//! crictl). `proxy` serves a view of a registry whose blob responses are rate-limited each on
//! its own (or all together), to watch a pull go by or to cap single streams, and can write how
//! many blob bytes it served. `registry` runs the tests' registry (Debian's docker-registry on a
//! free port) until interrupted (hack/demo-pull-release.sh).
//! Build it with `--release` for big layers: making random gzip layers is ~25x slower in a
//! debug build.

use anyhow::Result;
use clap::{Parser, Subcommand};
use minicri_tests::images::{
    Compression, PushedImage, PushedIndex, RegistryClient, push_big_image, push_standard_set_with,
};

#[derive(Parser)]
#[command(
    name = "minicri-testimg",
    about = "Push minicri's test images to a registry"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct RegistryArgs {
    /// Registry host:port (plain HTTP).
    #[arg(long, default_value = "127.0.0.1:5000")]
    registry: String,
    /// Basic-auth user.
    #[arg(long, requires = "password")]
    username: Option<String>,
    /// Basic-auth password.
    #[arg(long, env = "MINICRI_TESTIMG_PASSWORD", requires = "username")]
    password: Option<String>,
}

impl RegistryArgs {
    fn client(&self) -> RegistryClient {
        let client = RegistryClient::new(&self.registry);
        match (&self.username, &self.password) {
            (Some(user), Some(password)) => client.with_basic_auth(user, password),
            _ => client,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Push the standard set (minicri-test/busybox:oci, ...:docker, multi, index, list, zstd,
    /// plain, user:uid/name/uidgid, shared-a, shared-b).
    PushStandard {
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Push NAME: the busybox base plus N layers of M MiB of random bytes each.
    PushBig {
        #[command(flatten)]
        registry: RegistryArgs,
        /// Repository and tag, e.g. minicri-test/big:latest ("latest" if no tag).
        #[arg(long)]
        name: String,
        /// Number of random layers.
        #[arg(long, default_value_t = 1)]
        layers: u64,
        /// Size of each random layer's file, MiB.
        #[arg(long, default_value_t = 64)]
        layer_mib: u64,
        /// Layer compression: gzip, zstd or none.
        #[arg(long, default_value = "gzip")]
        compression: Compression,
        /// Seed of the first layer's random bytes (the next layers use seed+1, ...).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Push NAME: the busybox base plus the given gzip-compressed tar files as layers, as they
    /// are (for images made with GNU tar, which keeps hard links).
    PushFiles {
        #[command(flatten)]
        registry: RegistryArgs,
        /// Repository and tag, e.g. bench/usr:1 ("latest" if no tag).
        #[arg(long)]
        name: String,
        /// The layers, bottom first.
        #[arg(required = true)]
        layers: Vec<std::path::PathBuf>,
    },
    /// Push NAME: busybox whose entrypoint sleeps (2^31-1 s): a sandbox image for runtimes that
    /// need one (containerd's `sandbox_image` in hack/bench-cri.sh); SIGKILL stops it.
    PushSleeper {
        #[command(flatten)]
        registry: RegistryArgs,
        /// Repository and tag, e.g. minicri-test/sleeper:latest.
        #[arg(long)]
        name: String,
    },
    /// Ask the CRI runtime at SOCKET to pull IMAGE (PullImage); print the image id and seconds.
    Pull {
        #[arg(long)]
        socket: std::path::PathBuf,
        image: String,
    },
    /// Serve a rate-limited proxy of the registry UPSTREAM until interrupted, to watch a slow
    /// pull (`minicri pulls --watch`). Prints the proxy's host:port.
    Proxy {
        /// Registry host:port (plain HTTP).
        #[arg(long, default_value = "127.0.0.1:5000")]
        upstream: String,
        /// MiB per second of each blob response (each connection on its own, as object stores
        /// and CDNs cap single streams).
        #[arg(long, default_value_t = 10.0)]
        rate_mib: f64,
        /// MiB per second of all blob responses together (a link's capacity); none by default.
        #[arg(long)]
        link_rate_mib: Option<f64>,
        /// Rewrite this file every 200 ms with `blob_bytes_served N`: the blob body bytes the
        /// proxy has served.
        #[arg(long)]
        stats: Option<std::path::PathBuf>,
    },
    /// Run a test registry (docker-registry on a free 127.0.0.1 port, storage in a temporary
    /// directory) until interrupted. Prints its host:port.
    Registry,
}

fn print_image(image: &PushedImage) {
    println!(
        "{}\tmanifest={}\tconfig={}\tlayers={}",
        image.reference,
        image.manifest_digest,
        image.config_digest,
        image.layers.len()
    );
}

fn print_index(index: &PushedIndex) {
    println!(
        "{}\tindex={}\tmedia-type={}",
        index.reference, index.digest, index.media_type
    );
    for image in &index.manifests {
        println!(
            "  {}\tmanifest={}\tconfig={}",
            image.platform, image.manifest_digest, image.config_digest
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Pull { socket, image } => {
            use minicri_proto::runtime::v1 as cri;
            let channel = tonic::transport::Endpoint::try_from("http://[::]:50051")?
                .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                    let socket = socket.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(socket).await?,
                        ))
                    }
                }))
                .await?;
            let mut client = cri::image_service_client::ImageServiceClient::new(channel);
            let start = std::time::Instant::now();
            let r = client
                .pull_image(cri::PullImageRequest {
                    image: Some(cri::ImageSpec {
                        image: image.clone(),
                        ..Default::default()
                    }),
                    auth: None,
                    sandbox_config: None,
                })
                .await?
                .into_inner();
            println!("{}	{:.3}", r.image_ref, start.elapsed().as_secs_f64());
        }
        Command::Proxy {
            upstream,
            rate_mib,
            link_rate_mib,
            stats,
        } => {
            let mib = |m: f64| (m * 1024.0 * 1024.0) as u64;
            let proxy = minicri_tests::proxy::Proxy::start(&upstream)?;
            proxy.faults().set_rate_limit(Some(mib(rate_mib)));
            proxy.faults().set_link_rate(link_rate_mib.map(mib));
            println!("{}", proxy.addr());
            let write_stats = async {
                let Some(path) = stats else {
                    return std::future::pending::<std::io::Result<()>>().await;
                };
                loop {
                    let text = format!("blob_bytes_served {}\n", proxy.total_blob_bytes());
                    let tmp = path.with_extension("tmp");
                    std::fs::write(&tmp, text)?;
                    std::fs::rename(&tmp, &path)?;
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
            };
            tokio::select! {
                r = tokio::signal::ctrl_c() => r?,
                r = write_stats => r?,
            }
        }
        Command::Registry => {
            let registry = minicri_tests::registry::Registry::start();
            println!("{}", registry.addr());
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                r = tokio::signal::ctrl_c() => r?,
                _ = term.recv() => {}
            }
            drop(registry);
        }
        Command::PushStandard { registry } => {
            let set = push_standard_set_with(&registry.client()).await?;
            for image in set.images() {
                print_image(image);
            }
            for index in set.indexes() {
                print_index(index);
            }
        }
        Command::PushSleeper { registry, name } => {
            let image = minicri_tests::images::sleeper_image()?
                .push(&registry.client(), &name)
                .await?;
            print_image(&image);
        }
        Command::PushFiles {
            registry,
            name,
            layers,
        } => {
            let image =
                minicri_tests::images::push_gzip_files_image(&registry.client(), &name, &layers)
                    .await?;
            print_image(&image);
        }
        Command::PushBig {
            registry,
            name,
            layers,
            layer_mib,
            compression,
            seed,
        } => {
            let image = push_big_image(
                &registry.client(),
                &name,
                layers,
                layer_mib,
                compression,
                seed,
            )
            .await?;
            print_image(&image);
            for layer in &image.layers {
                println!("  layer {}\tsize={}", layer.digest, layer.size);
            }
        }
    }
    Ok(())
}
