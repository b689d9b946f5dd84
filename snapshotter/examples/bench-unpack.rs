//! Unpack benchmark: applies gzip layers through a snapshotter and reports the time and throughput.
//!
//! Usage: `bench-unpack <overlay|copy> <root> <layer.tar.gz>=<diff_id>...` (layers bottom first).
//! `hack/bench-unpack.sh` builds the layers and runs this next to `tar -xzf`.

use std::fs::File;
use std::io::BufReader;
use std::time::Instant;

use minicri_snapshotter::{Backend, LayerSpec, LocalSnapshotter, Options, Snapshotter};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        eprintln!("usage: bench-unpack <overlay|copy> <root> <layer.tar.gz>=<diff_id>...");
        std::process::exit(2);
    }
    let backend = match args[0].as_str() {
        "overlay" => Backend::Overlay,
        "copy" => Backend::Copy,
        other => panic!("unknown backend {other}"),
    };
    let s = LocalSnapshotter::open(
        &args[1],
        backend,
        Options {
            sync_on_commit: false,
            ..Default::default()
        },
    )
    .expect("open snapshotter");
    let mut parent: Option<String> = None;
    let mut total_bytes = 0u64;
    let start = Instant::now();
    for arg in &args[2..] {
        let (path, diff_id) = arg.split_once('=').expect("layer=diff_id");
        let t = Instant::now();
        let mut f = BufReader::with_capacity(1 << 20, File::open(path).expect("open layer"));
        let spec = LayerSpec {
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip",
            diff_id,
            parent: parent.as_deref(),
            user: Some("bench"),
            ..Default::default()
        };
        let applied = s.apply_layer(&spec, &mut f).expect("apply layer");
        let secs = t.elapsed().as_secs_f64();
        println!(
            "  {path}: {:.0} MB in {secs:.2} s ({:.0} MB/s uncompressed)",
            applied.size as f64 / 1e6,
            applied.size as f64 / 1e6 / secs
        );
        total_bytes += applied.size;
        parent = Some(applied.chain_id);
    }
    let secs = start.elapsed().as_secs_f64();
    // CPU time tells the work apart from waiting when other jobs share the machine.
    // SAFETY: getrusage fills the zeroed struct it is given.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let cpu = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    println!(
        "{:?}: {:.0} MB in {secs:.2} s ({:.0} MB/s uncompressed), cpu user {:.2} s sys {:.2} s",
        backend,
        total_bytes as f64 / 1e6,
        total_bytes as f64 / 1e6 / secs,
        cpu(usage.ru_utime),
        cpu(usage.ru_stime)
    );
}
