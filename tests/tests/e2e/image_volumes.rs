//! Black-box tests of image volumes (CRI `Mount.image`, Kubernetes' `image` volume source): a
//! container reads another image mounted read-only, whole and by sub path, on both snapshotter
//! backends; the image cannot be removed while the container's volume uses it, across a daemon
//! SIGKILL and restart; ContainerStatus names the image by id; RemoveContainer unmounts the
//! volumes and frees the image. Sub paths that do not exist or lead out of the image, and images
//! that are not on the node, are refused and leave nothing behind. An artifact whose layers are
//! not tar archives is refused at PullImage, naming its media type.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::images::{
    Compression, ImageBuilder, LayerBuilder, PushedImage, RegistryClient, sha256_digest,
};
use minicri_tests::pod_env::{
    PodEnv, eventually, mounts_under, pod_config, skip_reason, with_busybox, with_busybox_args,
};
use minicri_tests::pod_rpc::{
    RuntimeClient, container_config, container_status, create_container, exec_text, in_userns,
    list_containers, pod_userns, remove_container, run_container, run_pod, stop_and_remove_pod,
    user_namespaces_supported,
};
use tonic::Code;

/// The image mounted as a volume: two layers (the second replaces a file and deletes one), a
/// relative symlink that stays inside it, one that climbs above its root and an absolute one.
async fn push_model(env: &PodEnv, tag: &str, weights: &str) -> PushedImage {
    let client = RegistryClient::new(&env.set.registry);
    let base = LayerBuilder::new()
        .dir("models", 0o755)
        .dir("models/v1", 0o755)
        .file("models/v1/params.json", "{\"layers\":2}\n", 0o644)
        .file("models/weights.bin", "old weights\n", 0o644)
        .file("models/stale.txt", "deleted above\n", 0o644)
        .symlink("models/current", "v1")
        .symlink("models/up", "../../..")
        .symlink("models/etc", "/etc")
        .build(Compression::Gzip)
        .unwrap();
    let top = LayerBuilder::new()
        .file("models/weights.bin", format!("{weights}\n"), 0o644)
        .whiteout("models/stale.txt")
        .build(Compression::Gzip)
        .unwrap();
    ImageBuilder::new()
        .layer(base)
        .layer(top)
        .push(&client, &format!("models:{tag}"))
        .await
        .unwrap()
}

/// PullImage of `reference` for the pod, as the kubelet pulls an image volume: its image id.
async fn pull_for(env: &PodEnv, pod: &cri::PodSandboxConfig, reference: &str) -> String {
    env.daemon
        .images()
        .await
        .unwrap()
        .pull_image(cri::PullImageRequest {
            image: Some(image_spec(reference)),
            auth: None,
            sandbox_config: Some(pod.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("PullImage {reference}: {e:?}"))
        .into_inner()
        .image_ref
}

fn image_spec(image: &str) -> cri::ImageSpec {
    cri::ImageSpec {
        image: image.into(),
        ..Default::default()
    }
}

/// A mount of image `id` (pulled as `reference`) at `path`, as the kubelet sends it.
fn image_mount(path: &str, id: &str, reference: &str, sub_path: &str) -> cri::Mount {
    cri::Mount {
        container_path: path.into(),
        readonly: true,
        image: Some(cri::ImageSpec {
            image: id.into(),
            user_specified_image: reference.into(),
            ..Default::default()
        }),
        image_sub_path: sub_path.into(),
        ..Default::default()
    }
}

/// Asserts that RemoveImage of `image` is refused, naming container `id` whose volume uses it.
async fn assert_removal_refused(env: &PodEnv, image: &str, id: &str) {
    let err = remove_image(env, image).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(id), "names the container: {err:?}");
}

async fn remove_image(env: &PodEnv, image: &str) -> Result<(), tonic::Status> {
    env.daemon
        .images()
        .await
        .unwrap()
        .remove_image(cri::RemoveImageRequest {
            image: Some(image_spec(image)),
        })
        .await
        .map(drop)
}

async fn listed_ids(env: &PodEnv) -> Vec<String> {
    env.daemon
        .images()
        .await
        .unwrap()
        .list_images(cri::ListImagesRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .images
        .into_iter()
        .map(|i| i.id)
        .collect()
}

/// Keys of the snapshot records under the daemon's root that belong to image volumes.
fn volume_snapshots(env: &PodEnv) -> Vec<String> {
    let meta = env.daemon.root().join("snapshots/meta");
    std::fs::read_dir(meta)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .filter_map(|v| v["key"].as_str().map(String::from))
        .filter(|k| k.contains(".volume."))
        .collect()
}

/// Polls RemoveImage of `image` every 50 ms for up to 10 s until it succeeds (teardown after
/// RemoveContainer runs in the background).
async fn remove_image_eventually(env: &PodEnv, image: &str) {
    let mut last = None;
    for _ in 0..200 {
        match remove_image(env, image).await {
            Ok(()) => return,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("RemoveImage {image} kept failing: {last:?}");
}

const READ: &str = "cat /vol/models/weights.bin /params/params.json /weights.bin; \
                    ls /vol/models; ls /params";
const READ_OUT: &str =
    "new weights\n{\"layers\":2}\nnew weights\ncurrent\netc\nup\nv1\nweights.bin\nparams.json\n";

async fn read_volumes(c: &mut RuntimeClient, id: &str) {
    let (code, out, err) = exec_text(c, id, &["sh", "-c", READ], 10).await;
    assert_eq!((code, out.as_str()), (0, READ_OUT), "{err}");
}

/// The whole life of a container with image volumes, on snapshotter `backend`.
async fn image_volume_lifecycle(backend: &str) {
    let Some((mut env, busybox, mut c)) = with_busybox_args(&["--snapshotter", backend]).await
    else {
        return;
    };
    let model = push_model(&env, "v1", "new weights").await;
    let pod = pod_config("imagevol", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let model_id = pull_for(&env, &pod, &model.reference).await;
    assert_eq!(model_id, model.config_digest);

    let mut config = container_config("main", &busybox, &["sleep", "1000"]);
    config.mounts = vec![
        image_mount("/vol", &model_id, &model.reference, ""),
        // A directory through a symlink that stays in the image, and a file.
        image_mount("/params", &model_id, &model.reference, "models/current"),
        image_mount(
            "/weights.bin",
            &model_id,
            &model.reference,
            "models/weights.bin",
        ),
    ];
    let id = run_container(&mut c, &sb, &pod, config).await;

    // The image's layers merged (the top one's file, its deletion), the sub paths alone.
    read_volumes(&mut c, &id).await;
    for write in [
        "touch /vol/new",
        "echo x > /vol/models/weights.bin",
        "touch /params/new",
        "echo x > /weights.bin",
    ] {
        let (code, _, err) = exec_text(&mut c, &id, &["sh", "-c", write], 10).await;
        assert!(
            code != 0 && err.contains("Read-only file system"),
            "{write}: {code} {err}"
        );
    }
    let (_, mounts, _) = exec_text(&mut c, &id, &["cat", "/proc/self/mounts"], 10).await;
    let vol = mounts
        .lines()
        .find(|l| l.split(' ').nth(1) == Some("/vol"))
        .expect("/vol mounted");
    let opts: Vec<&str> = vol.split(' ').nth(3).unwrap().split(',').collect();
    for want in ["ro", "nosuid", "nodev"] {
        assert!(opts.contains(&want), "{want} in {vol}");
    }

    // ContainerStatus names the image by id, as the kubelet's image GC matches it.
    let st = container_status(&mut c, &id).await;
    let by_image: Vec<&cri::Mount> = st
        .mounts
        .iter()
        .filter(|m| m.image.as_ref().is_some_and(|i| i.image == model_id))
        .collect();
    assert_eq!(by_image.len(), 3, "{:?}", st.mounts);
    assert_eq!(
        by_image[0].image.as_ref().unwrap().user_specified_image,
        model.reference
    );
    assert_eq!(by_image[1].image_sub_path, "models/current");
    // crictl inspect: where each volume comes from.
    let info = c
        .container_status(cri::ContainerStatusRequest {
            container_id: id.clone(),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner()
        .info;
    let info: serde_json::Value = serde_json::from_str(&info["info"]).unwrap();
    let volumes = info["imageVolumes"].as_array().expect("imageVolumes");
    assert_eq!(volumes.len(), 3, "{info}");
    assert_eq!(volumes[1]["containerPath"], "/params");
    assert_eq!(volumes[1]["image"], model_id.as_str());
    assert_eq!(volumes[1]["imageSubPath"], "models/current");

    // The image cannot be removed from under the container, by any name.
    for name in [&model.reference, &model_id] {
        assert_removal_refused(&env, name, &id).await;
    }
    assert!(listed_ids(&env).await.contains(&model_id));
    let status = env
        .daemon
        .images()
        .await
        .unwrap()
        .image_status(cri::ImageStatusRequest {
            image: Some(image_spec(&model_id)),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner();
    let info: serde_json::Value = serde_json::from_str(&status.info["info"]).unwrap();
    assert_eq!(info["volumeOf"], serde_json::json!([id]));

    // SIGKILL and restart: the volumes are still there and still hold the image.
    drop(c);
    env.daemon.kill();
    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    read_volumes(&mut c, &id).await;
    assert_removal_refused(&env, &model_id, &id).await;

    // RemoveContainer (after the restart) unmounts them, removes their snapshots and lets the
    // image go.
    remove_container(&mut c, &id).await;
    let dir = env.state().join("containers").join(&id);
    eventually("the container's directory to go", || !dir.exists()).await;
    assert!(mounts_under(&dir).is_empty());
    remove_image_eventually(&env, &model_id).await;
    assert!(!listed_ids(&env).await.contains(&model_id));
    eventually("the volumes' snapshots to go", || {
        volume_snapshots(&env).is_empty()
    })
    .await;
    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn image_volumes_on_the_overlay_snapshotter() {
    image_volume_lifecycle("overlay").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn image_volumes_on_the_copy_snapshotter() {
    image_volume_lifecycle("copy").await;
}

/// Sub paths that do not exist or lead out of the image, and an image that is not on the node,
/// are refused with statuses naming them; a refused CreateContainer holds no image and leaves
/// no mount and no snapshot.
#[tokio::test(flavor = "multi_thread")]
async fn image_volumes_that_cannot_be_mounted_are_refused_and_leave_nothing() {
    let Some((env, busybox, mut c)) = with_busybox().await else {
        return;
    };
    let model = push_model(&env, "v1", "new weights").await;
    let pod = pod_config("refused", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let model_id = pull_for(&env, &pod, &model.reference).await;
    let absent = format!("sha256:{}", "0".repeat(64));
    // (image, image_sub_path, status, what its message says)
    let cases = [
        (
            &model_id,
            "models/missing",
            Code::NotFound,
            "\"models/missing\" of image",
        ),
        (
            &model_id,
            "models/up/etc",
            Code::InvalidArgument,
            "leads outside",
        ),
        (
            &model_id,
            "models/etc",
            Code::InvalidArgument,
            "leads outside",
        ),
        (&model_id, "../models", Code::InvalidArgument, "'..'"),
        (&model_id, "/models", Code::InvalidArgument, "not relative"),
        (&absent, "", Code::NotFound, absent.as_str()),
    ];
    for (n, (image, sub, code, needle)) in cases.into_iter().enumerate() {
        let mut config = container_config(&format!("c{n}"), &busybox, &["sleep", "1000"]);
        // A good volume first: its mounts and hold are undone with the refused one's.
        config.mounts = vec![
            image_mount("/ok", &model_id, &model.reference, ""),
            image_mount("/v", image, &model.reference, sub),
        ];
        let err = create_container(&mut c, &sb, &pod, config)
            .await
            .expect_err("CreateContainer");
        assert_eq!(err.code(), code, "case {n}: {err:?}");
        assert!(err.message().contains(needle), "case {n}: {err:?}");
    }
    assert!(list_containers(&mut c).await.is_empty());
    assert!(volume_snapshots(&env).is_empty());
    let containers = env.state().join("containers");
    assert!(mounts_under(&containers).is_empty());
    // No hold was left: the image goes at once.
    remove_image(&env, &model_id)
        .await
        .expect("no volume holds it");
    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

/// A pull that moves the image's tag to a new image (the kubelet's `Always` policy and a moved
/// tag) leaves the old one, under its digest reference, to the container whose volume mounts it:
/// still readable, still refused to RemoveImage until the container goes.
#[tokio::test(flavor = "multi_thread")]
async fn an_image_whose_tag_moves_away_is_kept_for_its_volume() {
    let Some((env, busybox, mut c)) = with_busybox().await else {
        return;
    };
    let pod = pod_config("moved", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let first = push_model(&env, "latest", "first").await;
    let first_id = pull_for(&env, &pod, &first.reference).await;
    let mut config = container_config("main", &busybox, &["sleep", "1000"]);
    config.mounts = vec![image_mount("/vol", &first_id, &first.reference, "")];
    let id = run_container(&mut c, &sb, &pod, config).await;
    let second = push_model(&env, "latest", "second").await;
    let second_id = pull_for(&env, &pod, &second.reference).await;
    assert_ne!(first_id, second_id);

    let listed = env
        .daemon
        .images()
        .await
        .unwrap()
        .list_images(cri::ListImagesRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .images;
    let old = listed
        .iter()
        .find(|i| i.id == first_id)
        .expect("the old image is still listed");
    assert!(old.repo_tags.is_empty(), "the tag moved: {old:?}");
    let (code, out, err) = exec_text(&mut c, &id, &["cat", "/vol/models/weights.bin"], 10).await;
    assert_eq!((code, out.as_str()), (0, "first\n"), "{err}");
    assert_removal_refused(&env, &first_id, &id).await;

    remove_container(&mut c, &id).await;
    remove_image_eventually(&env, &first_id).await;
    let ids = listed_ids(&env).await;
    assert!(
        !ids.contains(&first_id) && ids.contains(&second_id),
        "{ids:?}"
    );
    stop_and_remove_pod(&mut c, &sb).await;
}

/// An OCI artifact whose layer is not a tar archive (a model file pushed as is) is refused at
/// PullImage, before any layer is fetched, with a status naming the media type.
#[tokio::test(flavor = "multi_thread")]
async fn an_artifact_whose_layers_are_not_tar_archives_is_refused_at_pull() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let client = RegistryClient::new(&env.set.registry);
    const MEDIA_TYPE: &str = "application/vnd.example.model.weights.v1";
    let config = bytes::Bytes::from_static(b"{}");
    let config_digest = sha256_digest(&config);
    let blob = bytes::Bytes::from_static(b"raw weights, not a tar archive");
    let blob_digest = sha256_digest(&blob);
    client
        .push_blob_bytes("artifact", &config_digest, config.clone())
        .await
        .unwrap();
    client
        .push_blob_bytes("artifact", &blob_digest, blob.clone())
        .await
        .unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.example.model.v1",
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": config_digest,
            "size": config.len(),
        },
        "layers": [{ "mediaType": MEDIA_TYPE, "digest": blob_digest, "size": blob.len() }],
    });
    client
        .put_manifest(
            "artifact",
            "v1",
            "application/vnd.oci.image.manifest.v1+json",
            serde_json::to_vec(&manifest).unwrap().into(),
        )
        .await
        .unwrap();
    let reference = format!("{}/artifact:v1", env.set.registry);
    let err = env
        .daemon
        .images()
        .await
        .unwrap()
        .pull_image(cri::PullImageRequest {
            image: Some(image_spec(&reference)),
            auth: None,
            sandbox_config: None,
        })
        .await
        .expect_err("PullImage of an artifact");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(MEDIA_TYPE), "{err:?}");
    assert!(listed_ids(&env).await.is_empty());
}

/// In a pod with its own user namespace the image's layers are idmapped for the pod, as its
/// rootfs's are: the image's files belong to the pod's root, not to nobody.
#[tokio::test(flavor = "multi_thread")]
async fn image_volumes_in_a_pod_user_namespace_belong_to_the_pods_root() {
    let Some((env, busybox, mut c)) = with_busybox().await else {
        return;
    };
    if !user_namespaces_supported(&mut c).await {
        eprintln!("skipping: the runtime reports no user namespaces here");
        return;
    }
    let userns = pod_userns(2_000_000);
    let maps = userns.userns_options.clone().unwrap();
    let pod = in_userns(pod_config("userns-vol", env.logs.path()), &userns);
    let sb = run_pod(&mut c, &pod).await;
    let model = push_model(&env, "v1", "new weights").await;
    let model_id = pull_for(&env, &pod, &model.reference).await;
    let mut config = container_config("main", &busybox, &["sleep", "1000"]);
    config.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            namespace_options: Some(userns),
            ..Default::default()
        }),
        resources: None,
    });
    // As the kubelet sends mounts of such a pod: with the pod's mappings.
    let with_maps = |mut m: cri::Mount| {
        m.uid_mappings = maps.uids.clone();
        m.gid_mappings = maps.gids.clone();
        m
    };
    config.mounts = vec![
        with_maps(image_mount("/vol", &model_id, &model.reference, "")),
        with_maps(image_mount(
            "/params",
            &model_id,
            &model.reference,
            "models/current",
        )),
    ];
    let id = run_container(&mut c, &sb, &pod, config).await;
    let (code, out, err) = exec_text(
        &mut c,
        &id,
        &[
            "sh",
            "-c",
            "stat -c %u:%g /vol/models/weights.bin /params/params.json; cat /params/params.json",
        ],
        10,
    )
    .await;
    assert_eq!(
        (code, out.as_str()),
        (0, "0:0\n0:0\n{\"layers\":2}\n"),
        "{err}"
    );
    let (code, _, err) = exec_text(&mut c, &id, &["touch", "/vol/new"], 10).await;
    assert!(code != 0 && err.contains("Read-only file system"), "{err}");
    stop_and_remove_pod(&mut c, &sb).await;
    // Nothing stays mounted: neither the volumes nor their idmapped layers.
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
    assert!(!env.state().join("idmap").join(&id).exists());
    remove_image_eventually(&env, &model_id).await;
}
