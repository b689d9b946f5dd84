//! CRI RuntimeService calls the pod tests make again and again: run, inspect, stop and remove a
//! pod sandbox; build, create and start a container (also a web server, [`run_http_server`]);
//! ExecSync; ContainerStatus; whether pods may have user namespaces ([`pod_userns`]).
//!
//! Each helper makes exactly one request per RPC it names and panics, naming the RPC, when that
//! RPC fails; a test that expects an error makes the call itself (or uses [`create_container`],
//! which returns it). Timeouts are the caller's: [`exec_sync`] and [`stop_container`] take theirs
//! in seconds, as the CRI does.

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::Channel;

/// A RuntimeService client, as [`crate::pod_env::PodEnv::runtime`] hands it out.
pub type RuntimeClient = RuntimeServiceClient<Channel>;

/// A container config named `name` (attempt 0) running `args` in `image`, logging to
/// `<name>/0.log` in the pod's log directory.
pub fn container_config(name: &str, image: &str, args: &[&str]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: args.iter().map(|s| s.to_string()).collect(),
        log_path: format!("{name}/0.log"),
        ..Default::default()
    }
}

/// [`container_config`] for `sh -c script`.
pub fn sh_container_config(name: &str, image: &str, script: &str) -> cri::ContainerConfig {
    container_config(name, image, &["sh", "-c", script])
}

/// RunPodSandbox with `config` and the default runtime handler; returns the sandbox id.
pub async fn run_pod(c: &mut RuntimeClient, config: &cri::PodSandboxConfig) -> String {
    c.run_pod_sandbox(cri::RunPodSandboxRequest {
        config: Some(config.clone()),
        runtime_handler: String::new(),
    })
    .await
    .expect("RunPodSandbox")
    .into_inner()
    .pod_sandbox_id
}

/// PodSandboxStatus (not verbose) of sandbox `id`: its status.
pub async fn pod_sandbox_status(c: &mut RuntimeClient, id: &str) -> cri::PodSandboxStatus {
    c.pod_sandbox_status(cri::PodSandboxStatusRequest {
        pod_sandbox_id: id.into(),
        verbose: false,
    })
    .await
    .expect("PodSandboxStatus")
    .into_inner()
    .status
    .expect("a pod sandbox status")
}

/// ListPodSandbox without a filter: every sandbox the daemon knows.
pub async fn list_pod_sandboxes(c: &mut RuntimeClient) -> Vec<cri::PodSandbox> {
    c.list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .expect("ListPodSandbox")
        .into_inner()
        .items
}

/// Every container (ListContainers, no filter).
pub async fn list_containers(c: &mut RuntimeClient) -> Vec<cri::Container> {
    c.list_containers(cri::ListContainersRequest { filter: None })
        .await
        .expect("ListContainers")
        .into_inner()
        .containers
}

/// Asserts that ContainerStatus of `id` is NOT_FOUND.
pub async fn assert_container_not_found(c: &mut RuntimeClient, id: &str) {
    let err = c
        .container_status(cri::ContainerStatusRequest {
            container_id: id.to_string(),
            verbose: false,
        })
        .await
        .expect_err("ContainerStatus of a removed container");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
}

/// StopPodSandbox of sandbox `id`.
pub async fn stop_pod_sandbox(c: &mut RuntimeClient, id: &str) {
    c.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: id.into(),
    })
    .await
    .expect("StopPodSandbox");
}

/// RemovePodSandbox of sandbox `id`.
pub async fn remove_pod_sandbox(c: &mut RuntimeClient, id: &str) {
    c.remove_pod_sandbox(cri::RemovePodSandboxRequest {
        pod_sandbox_id: id.into(),
    })
    .await
    .expect("RemovePodSandbox");
}

/// StopPodSandbox, then RemovePodSandbox, of sandbox `id`.
pub async fn stop_and_remove_pod(c: &mut RuntimeClient, id: &str) {
    stop_pod_sandbox(c, id).await;
    remove_pod_sandbox(c, id).await;
}

/// CreateContainer of `config` in sandbox `sandbox` (created with `pod`): the container id, or
/// the RPC's error.
pub async fn create_container(
    c: &mut RuntimeClient,
    sandbox: &str,
    pod: &cri::PodSandboxConfig,
    config: cri::ContainerConfig,
) -> Result<String, tonic::Status> {
    Ok(c.create_container(cri::CreateContainerRequest {
        pod_sandbox_id: sandbox.into(),
        config: Some(config),
        sandbox_config: Some(pod.clone()),
    })
    .await?
    .into_inner()
    .container_id)
}

/// CreateContainer, then StartContainer: the id of the running container. Panics, naming the
/// container, if either fails.
pub async fn run_container(
    c: &mut RuntimeClient,
    sandbox: &str,
    pod: &cri::PodSandboxConfig,
    config: cri::ContainerConfig,
) -> String {
    let name = config.metadata.as_ref().unwrap().name.clone();
    let id = create_container(c, sandbox, pod, config)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    c.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap_or_else(|e| panic!("start {name}: {e:?}"));
    id
}

/// RemoveContainer of container `id`.
pub async fn remove_container(c: &mut RuntimeClient, id: &str) {
    c.remove_container(cri::RemoveContainerRequest {
        container_id: id.into(),
    })
    .await
    .expect("RemoveContainer");
}

/// StopContainer of container `id`, with `timeout_secs` between SIGTERM and SIGKILL.
pub async fn stop_container(c: &mut RuntimeClient, id: &str, timeout_secs: i64) {
    c.stop_container(cri::StopContainerRequest {
        container_id: id.into(),
        timeout: timeout_secs,
    })
    .await
    .expect("StopContainer");
}

/// ContainerStatus (not verbose) of container `id`: its status.
pub async fn container_status(c: &mut RuntimeClient, id: &str) -> cri::ContainerStatus {
    c.container_status(cri::ContainerStatusRequest {
        container_id: id.into(),
        verbose: false,
    })
    .await
    .expect("ContainerStatus")
    .into_inner()
    .status
    .expect("a container status")
}

/// ExecSync of `cmd` in container `id` with a timeout of `timeout_secs`: the response as it
/// comes (a non-zero exit is no failure; a failed RPC panics).
pub async fn exec_sync(
    c: &mut RuntimeClient,
    id: &str,
    cmd: &[&str],
    timeout_secs: i64,
) -> cri::ExecSyncResponse {
    c.exec_sync(cri::ExecSyncRequest {
        container_id: id.into(),
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        timeout: timeout_secs,
    })
    .await
    .unwrap_or_else(|e| panic!("ExecSync {cmd:?}: {e:?}"))
    .into_inner()
}

/// [`exec_sync`] with the output as text: (exit code, stdout, stderr).
pub async fn exec_text(
    c: &mut RuntimeClient,
    id: &str,
    cmd: &[&str],
    timeout_secs: i64,
) -> (i32, String, String) {
    let out = exec_sync(c, id, cmd, timeout_secs).await;
    (
        out.exit_code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs busybox's httpd in a container named `server` of the pod, listening on 127.0.0.1:8080
/// (and the pod's other addresses) and answering `GET /` with `text` and a newline; returns the
/// container's id once it serves (checked with ExecSync inside the pod).
pub async fn run_http_server(
    c: &mut RuntimeClient,
    sandbox: &str,
    pod: &cri::PodSandboxConfig,
    image: &str,
    text: &str,
) -> String {
    let script =
        format!("mkdir -p /www && echo {text} > /www/index.html && exec httpd -f -p 8080 -h /www");
    let id = run_container(
        c,
        sandbox,
        pod,
        sh_container_config("server", image, &script),
    )
    .await;
    for _ in 0..100 {
        let get = ["wget", "-q", "-O", "-", "http://127.0.0.1:8080/"];
        if exec_sync(c, &id, &get, 10).await.exit_code == 0 {
            return id;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("httpd did not start in the pod");
}

/// Whether a runtime handler of the daemon reports user namespace support (Status): pods with a
/// user namespace of their own run only then.
pub async fn user_namespaces_supported(c: &mut RuntimeClient) -> bool {
    c.status(cri::StatusRequest { verbose: false })
        .await
        .expect("Status")
        .into_inner()
        .runtime_handlers
        .iter()
        .any(|h| h.features.as_ref().is_some_and(|f| f.user_namespaces))
}

/// `pod` in the user namespace of `userns` ([`pod_userns`]).
pub fn in_userns(
    mut pod: cri::PodSandboxConfig,
    userns: &cri::NamespaceOption,
) -> cri::PodSandboxConfig {
    pod.linux = Some(cri::LinuxPodSandboxConfig {
        security_context: Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(userns.clone()),
            ..Default::default()
        }),
        ..Default::default()
    });
    pod
}

/// The namespace options of a pod (and of its containers) in a user namespace of its own, with
/// container ids 0 to 65535 mapped to host ids from `host_id`, as the kubelet allocates them.
pub fn pod_userns(host_id: u32) -> cri::NamespaceOption {
    let map = vec![cri::IdMapping {
        host_id,
        container_id: 0,
        length: 65_536,
    }];
    cri::NamespaceOption {
        userns_options: Some(cri::UserNamespace {
            mode: cri::NamespaceMode::Pod as i32,
            uids: map.clone(),
            gids: map,
        }),
        ..Default::default()
    }
}
