//! CreateContainer: the request checked, the writable snapshot prepared and mounted at
//! `<state>/containers/<id>/rootfs` (on idmapped layers in a pod user namespace), a checkpoint
//! archive's files applied when the image names one ([`super::super::checkpoint`]), the image
//! volumes mounted ([`super::super::imagevol`]), the OCI spec built and written as the bundle,
//! and the record stored. Every step is journaled first ([`super::super::undo`]), so a failure
//! or a crash half-way leaves nothing of the container.

use std::path::PathBuf;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use prost::Message;

use crate::error::{Error, Result};
use crate::oci::HostInfo;
use crate::pods::store::{ContainerRecord, ContainerState};
use crate::pods::{Journal, Operation, PodService, Undo, blocking, now_ns};
use crate::spec::userns::PodUserns;
use crate::spec::{ContainerSpecParams, ImageConfig, SandboxFiles, SandboxNamespaces};

/// The bind mounts of a container's spec, to be prepared on the host: in a pod user namespace
/// (its path and mappings), idmapped into `volumes`.
struct Binds {
    mounts: Vec<cri::Mount>,
    userns: Option<(PathBuf, PodUserns)>,
    volumes: PathBuf,
}

/// A pod user namespace as the rootfs and volume mounts take it: the namespace's path and the
/// host ids of its root.
type Userns = (PathBuf, (u32, u32));

/// The container's metadata and image name, refused unless they are what a container can be
/// made of and listed with.
fn check_request(config: &cri::ContainerConfig) -> Result<(cri::ContainerMetadata, String)> {
    let meta = config
        .metadata
        .clone()
        .ok_or_else(|| Error::InvalidArgument("container config metadata is required".into()))?;
    if meta.name.is_empty() {
        return Err(Error::InvalidArgument(
            "container config metadata.name is required".into(),
        ));
    }
    // The name is in every ListContainers, stats and event answer, and in logs: a long one
    // (Kubernetes' are DNS labels, at most 63) would push relists past the kubelet's 16 MiB.
    if meta.name.len() > 253
        || meta
            .name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '/')
    {
        return Err(Error::InvalidArgument(format!(
            "container config metadata.name {:?} is not a Kubernetes name (at most 253 characters, none of whitespace, control characters, '/')",
            meta.name
        )));
    }
    super::super::validate_labels_and_annotations(
        "container config",
        &config.labels,
        &config.annotations,
    )?;
    let image_name = config
        .image
        .as_ref()
        .map(|i| i.image.clone())
        .unwrap_or_default();
    if image_name.is_empty() {
        return Err(Error::InvalidArgument(
            "container config image is required".into(),
        ));
    }
    Ok((meta, image_name))
}

impl PodService {
    /// CreateContainer: returns the new container's id.
    pub async fn create_container(
        self: &Arc<Self>,
        sandbox_id: String,
        config: cri::ContainerConfig,
        sandbox_config: Option<cri::PodSandboxConfig>,
    ) -> Result<String> {
        self.undoable(Operation::CreateContainer, move |svc, undo| {
            Box::pin(async move {
                svc.create_steps(&sandbox_id, config, sandbox_config, undo)
                    .await
            })
        })
        .await
    }

    async fn create_steps(
        self: &Arc<Self>,
        sandbox_id: &str,
        mut config: cri::ContainerConfig,
        _sandbox_config: Option<cri::PodSandboxConfig>,
        undo: &mut Journal,
    ) -> Result<String> {
        let sb = self.ready_sandbox(sandbox_id)?;
        let sb_config = sb.config();
        // Containers run under their pod's runtime handler.
        let host = self.host_for(self.handlers.get(&sb.runtime_handler)?);
        let (meta, image_name) = check_request(&config)?;
        let _claim = self.check_node_metadata(
            super::super::Listed::Containers,
            &config.labels,
            &config.annotations,
        )?;
        // An image naming a checkpoint archive: the container is made from the archive's image
        // and process, then its files (super::checkpoint).
        let restore = self.restore_source(&mut config).await?;
        let rootfs_image = restore.as_ref().map_or(&image_name, |(_, i)| i);
        let (image, chain_id, image_config) = self.unpacked_image(rootfs_image, &image_name)?;
        // Mounts are checked before anything is done on the host for them (their sources may
        // be made shared below, which is not undone).
        let pod_userns = crate::spec::userns::pod_userns(&sb_config)?;
        self.check_mounts(&config, &host, pod_userns.as_ref())?;
        // CRI: the log is <sandbox log_directory>/<container log_path>.
        let log_path = crate::logs::container_log_path(&sb_config.log_directory, &config.log_path)
            .map_err(Error::InvalidArgument)?;
        let target_pid_ns = self.target_pid_namespace(sandbox_id, &config)?;

        let (id, name) = self.reserve_name(&meta, &sb_config, undo)?;

        let userns_path =
            pod_userns.map(|_| PathBuf::from(format!("/proc/{}/ns/user", sb.infra_pid)));
        let userns: Option<Userns> = pod_userns
            .zip(userns_path.clone())
            .map(|(u, path)| (path, (u.uid.host_id(), u.gid.host_id())));
        let rootfs = self
            .mount_rootfs(&id, chain_id, userns.clone(), undo)
            .await?;
        let dir = self.container_dir(&id);
        // A restore's files: the archive unpacked beside the rootfs, its changes applied.
        let restore_from = match restore {
            Some((archive, _)) => Some(
                self.unpack_restore(archive, dir.clone(), rootfs.clone())
                    .await?,
            ),
            None => None,
        };
        // Image volumes, mounted in the container's directory (private by now).
        let image_volumes = self
            .mount_image_volumes(&id, &config.mounts, userns.as_ref(), undo)
            .await?;
        // The mounts as the spec binds them: image volumes from where they were mounted.
        let bound = super::super::imagevol::spec_mounts(&config.mounts, &image_volumes);

        // The spec, then its bind sources and the bundle (write_spec). In a pod user namespace,
        // the spec binds the idmapped mounts made there.
        let namespaces = SandboxNamespaces::of_infra(sb.infra_pid, &sb_config);
        let files = self.sandbox_files_of(sandbox_id).await?;
        let volumes = self.idmap_dir(&id).join("volumes");
        let spec_config = cri::ContainerConfig {
            mounts: match &userns_path {
                Some(_) => crate::spec::userns::idmapped_mounts(&bound, &volumes),
                None => bound.clone(),
            },
            ..config.clone()
        };
        let params = ContainerSpecParams {
            id: &id,
            sandbox_id,
            config: &spec_config,
            sandbox_config: &sb_config,
            image: &image_config,
            rootfs: &rootfs,
            namespaces: &namespaces,
            files: &files,
            target_pid_ns: target_pid_ns.as_deref(),
            cgroup_driver: self.cgroup_driver,
            host: &host,
            annotations: &self.annotations,
        };
        let binds = Binds {
            mounts: bound,
            userns: userns_path.zip(pod_userns),
            volumes,
        };
        let (spec, bundle) = self.write_spec(&params, binds, undo).await?;

        let rec = ContainerRecord {
            id: id.clone(),
            sandbox_id: sandbox_id.to_string(),
            name,
            config: config.encode_to_vec().into(),
            image: image_name,
            image_id: image.id.to_string(),
            created_at: now_ns(),
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            state: ContainerState::Created,
            log_path,
            rootfs,
            bundle,
            stop_signal: image_config.stop_signal_number().unwrap_or(libc::SIGTERM),
            shim: None,
            pid: 0,
            user: spec.process().as_ref().map(|p| p.user().clone()),
            runtime_handler: sb.runtime_handler.clone(),
            runtime_deleted: false,
            image_volumes,
            restore_from,
        };
        self.store.put_container(rec)?;
        tracing::info!(container = %id, sandbox = %sandbox_id, name = %meta.name, "container created");
        Ok(id)
    }

    /// A new container id, named in the journal, and the container's name (unique on the node:
    /// the kubelet's name, its pod's and the attempt), reserved for it.
    fn reserve_name(
        &self,
        meta: &cri::ContainerMetadata,
        sb_config: &cri::PodSandboxConfig,
        undo: &mut Journal,
    ) -> Result<(String, String)> {
        let id = self.new_id()?;
        undo.subject(&id)?;
        let sm = sb_config.metadata.clone().unwrap_or_default();
        let name = format!(
            "{}_{}_{}_{}_{}",
            meta.name, sm.name, sm.namespace, sm.uid, meta.attempt
        );
        self.store.reserve(&name, &id)?;
        undo.push(Undo::ReleaseName {
            name: name.clone(),
            id: id.clone(),
        })?;
        Ok((id, name))
    }

    /// The image `name` (`shown` in messages: the one the request named) with its top layer's
    /// chain id and its config; NOT_FOUND or FAILED_PRECONDITION (not unpacked) naming it.
    fn unpacked_image(
        &self,
        name: &str,
        shown: &str,
    ) -> Result<(minicri_store::ImageRecord, String, ImageConfig)> {
        let image = self
            .images
            .image(name)?
            .ok_or_else(|| Error::NotFound(format!("image {shown:?} not found")))?;
        let chain_id = image
            .chain_id
            .clone()
            .ok_or_else(|| Error::FailedPrecondition(format!("image {shown:?} is not unpacked")))?;
        let config = minicri_store::fsutil::off_async(|| self.images.config(&image))?;
        let config = ImageConfig::from_document(&config)?;
        Ok((image, chain_id, config))
    }

    /// The container's mounts and devices refused unless the host can make them, they keep
    /// away from minicri's own files (a lookup per path component) and their user namespace
    /// mappings are the pod's.
    fn check_mounts(
        &self,
        config: &cri::ContainerConfig,
        host: &HostInfo,
        pod_userns: Option<&PodUserns>,
    ) -> Result<()> {
        crate::spec::container::validate_mounts(&config.mounts, host)?;
        minicri_store::fsutil::off_async(|| self.own_paths.check(&config.mounts, &config.devices))?;
        crate::spec::userns::check_volume_mappings(&config.mounts, pod_userns)?;
        Ok(())
    }

    /// Builds the spec `params` describe (which checks all the rest of the request and changes
    /// nothing on the host, so a refused request leaves no bind source made or made shared),
    /// prepares the bind sources `binds` (created when missing, made shared when their
    /// propagation needs it; in a pod user namespace, idmapped when the kubelet asks) and writes
    /// the bundle. Returns the spec and the bundle's directory.
    async fn write_spec(
        &self,
        params: &ContainerSpecParams<'_>,
        binds: Binds,
        undo: &mut Journal,
    ) -> Result<(oci_spec::runtime::Spec, PathBuf)> {
        // It reads the image's /etc/passwd and /etc/group, device nodes and seccomp profiles:
        // file work kept off the async workers.
        let spec = minicri_store::fsutil::off_async(|| crate::spec::container_spec(params))?;
        let Binds {
            mounts,
            userns,
            volumes,
        } = binds;
        blocking(move || {
            crate::spec::propagation::prepare_bind_sources(&mounts)?;
            if let Some((ns, pod)) = &userns {
                crate::spec::userns::idmap_volumes(&mounts, Some(pod), ns, &volumes)?;
            }
            Ok(())
        })
        .await?;
        let bundle = self.bundle_dir(params.id);
        undo.push(Undo::RemoveDir(bundle.clone()))?;
        minicri_store::fsutil::off_async(|| crate::spec::write_bundle(&bundle, &spec))?;
        Ok((spec, bundle))
    }

    /// The writable snapshot of container `id` on the image's top layer `chain_id`, mounted at
    /// `<container dir>/rootfs` (returned); in a pod with its own user namespace, on idmapped
    /// layers (crate::spec::userns), kept out of the container's directory, which undo removes
    /// recursively.
    async fn mount_rootfs(
        &self,
        id: &str,
        chain_id: String,
        userns: Option<Userns>,
        undo: &mut Journal,
    ) -> Result<PathBuf> {
        let dir = self.container_dir(id);
        let rootfs = dir.join("rootfs");
        let idmap = self.idmap_dir(id);
        undo.push(Undo::RemoveDir(dir.clone()))?;
        undo.push(Undo::RemoveSnapshot(id.to_string()))?;
        undo.push(Undo::Unmount(rootfs.clone()))?;
        undo.push(Undo::RemoveIdmapped(idmap.clone()))?;
        let images = self.images.clone();
        let (key, target, layers) = (id.to_string(), rootfs.clone(), idmap.join("layers"));
        blocking(move || {
            let m = images.prepare(&key, Some(&chain_id))?;
            // The mounted rootfs holds the image's setuid files and device nodes: its
            // directory is root's alone, or the pod user namespace root's (who must reach
            // it from inside).
            crate::fsutil::private_dir(&dir, userns.as_ref().map(|(_, root)| *root))
                .and_then(|()| std::fs::create_dir_all(&target))
                .map_err(|e| Error::Internal(format!("creating {}: {e}", target.display())))?;
            match userns {
                Some((ns, root)) => {
                    crate::spec::userns::mount_rootfs(&m, &target, &layers, &ns, root)?;
                }
                None => m.mount_at(&target)?,
            }
            Ok(())
        })
        .await?;
        Ok(rootfs)
    }

    /// The files of sandbox `id` its containers bind (hostname, resolv.conf, hosts, and shm
    /// when it is mounted).
    async fn sandbox_files_of(&self, id: &str) -> Result<SandboxFiles> {
        let files_dir = self.sandbox_dir(id).join("files");
        let shm = files_dir.join("shm");
        // Reads the node's whole mount table: off the async workers.
        let shm =
            blocking(move || Ok(crate::spec::propagation::is_mountpoint(&shm).then_some(shm)))
                .await?;
        Ok(SandboxFiles {
            hostname: Some(files_dir.join("hostname")),
            resolv_conf: Some(files_dir.join("resolv.conf")),
            hosts: Some(files_dir.join("hosts")),
            shm,
        })
    }
}
