//! Compiles the crate's `.proto` files into Rust (prost messages plus tonic
//! servers and clients) without a system `protoc`: `protox` parses the files
//! into a descriptor set in pure Rust and `tonic-prost-build` generates code
//! from it. The descriptor set is also written to `$OUT_DIR/descriptors.bin`.

use std::path::PathBuf;

/// The proto files to compile, relative to this crate's root, which is also
/// the only include directory (so files import each other as e.g.
/// `import "cri/api.proto";`). Every file must declare a `package`; each
/// package becomes one generated `$OUT_DIR/<package>.rs`, pulled in from
/// `src/lib.rs` with `tonic::include_proto!("<package>")`.
///
/// `minicri/admin.proto` is minicri's own admin API (package `minicri.v1`).
const PROTOS: &[&str] = &["cri/api.proto", "minicri/admin.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);

    println!("cargo:rerun-if-changed=build.rs");
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }

    let fds = protox::compile(PROTOS, [&root])?;
    // The descriptors themselves, for the protobuf JSON mapping at run time (`src/lib.rs`).
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("descriptors.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Servers only implement what they override; every other RPC
        // answers Status::unimplemented.
        .generate_default_stubs(true)
        // AuthConfig carries registry secrets; src/lib.rs gives it a
        // redacting Debug so request logging cannot leak them.
        .skip_debug([".runtime.v1.AuthConfig"])
        .compile_fds(fds)?;

    Ok(())
}
