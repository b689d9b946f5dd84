//! Manifest and index parsing as a pull does it (store/src/pull/procedure.rs `parse_manifest`, the
//! documents of store/src/manifest.rs): never panics on any bytes a registry may send; what
//! parses can be walked (platforms, media types, descriptors) without panicking either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minicri_store::Reference;
use minicri_store::manifest::{self, Platform};

fuzz_target!(|data: &[u8]| {
    let reference = Reference::parse("registry.example/app:v1").expect("valid");
    let Ok(doc) = minicri_store::pull::parse_manifest(&reference, data) else {
        return;
    };
    let want = Platform::parse("linux/amd64").expect("valid");
    for m in doc.manifests.iter().flatten() {
        if let Some(p) = &m.platform {
            let _ = want.matches(p);
        }
        let _ = minicri_store::Digest::parse(&m.digest);
    }
    for l in doc.layers.iter().flatten() {
        let _ = manifest::layer_compression(&l.media_type);
        let _ = minicri_store::Digest::parse(&l.digest);
    }
    // Image configs are parsed from registry bytes too.
    if let Ok(cfg) = serde_json::from_slice::<manifest::ImageConfigDoc>(data)
        && let Some(user) = cfg.config.as_ref().and_then(|c| c.user.as_deref())
    {
        let _ = manifest::user_of(user);
    }
});
