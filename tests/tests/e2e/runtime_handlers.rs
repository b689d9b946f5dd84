//! Runtime handlers (Kubernetes RuntimeClass): pods choose their OCI runtime by name, the Status
//! RPC lists the handlers that work here, unknown and broken ones are refused by name.
//!
//! The real daemon, runc and CNI plugins. A second handler, `traced`, is runc behind a script
//! that logs each invocation's arguments, so the test sees which runtime ran what, under which
//! `--root`. Root only.

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, pod_config, runc_list, skip_reason, write_executable};
use minicri_tests::pod_rpc::{
    container_config, exec_text, remove_pod_sandbox, run_container, stop_pod_sandbox,
};
use serde_json::Value;
use tonic::Code;

/// `traced`: a runc wrapper logging its arguments to `calls`, one invocation per line.
struct Traced {
    dir: tempfile::TempDir,
}

impl Traced {
    fn new() -> Traced {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "#!/bin/sh\necho \"$*\" >>{}/calls\nexec runc \"$@\"\n",
            dir.path().display()
        );
        let bin = dir.path().join("traced-runc");
        write_executable(&bin, &script);
        Traced { dir }
    }

    fn flag(&self) -> String {
        format!("traced={}", self.dir.path().join("traced-runc").display())
    }

    /// The logged invocations whose arguments contain `needle`.
    fn calls_with(&self, needle: &str) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("calls"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .map(String::from)
            .collect()
    }
}

async fn run_pod_with(
    c: &mut minicri_tests::pod_rpc::RuntimeClient,
    config: &cri::PodSandboxConfig,
    handler: &str,
) -> Result<String, tonic::Status> {
    Ok(c.run_pod_sandbox(cri::RunPodSandboxRequest {
        config: Some(config.clone()),
        runtime_handler: handler.into(),
    })
    .await?
    .into_inner()
    .pod_sandbox_id)
}

async fn verbose_status(c: &mut minicri_tests::pod_rpc::RuntimeClient) -> cri::StatusResponse {
    c.status(cri::StatusRequest { verbose: true })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread")]
async fn pods_run_under_the_handler_they_name_and_unusable_handlers_are_refused() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let traced = Traced::new();
    let env = PodEnv::with_args(&[
        "--runtime",
        &traced.flag(),
        "--runtime",
        "gone=/nonexistent/bin/runc",
    ])
    .await;
    let image = env.set.busybox_oci.reference.clone();
    env.pull_busybox().await;
    let mut c = env.runtime().await;

    // Status: the default as "", then every handler that works, by name; the rest with their
    // reasons in the verbose info.
    let status = verbose_status(&mut c).await;
    let names: Vec<&str> = status
        .runtime_handlers
        .iter()
        .map(|h| h.name.as_str())
        .collect();
    assert_eq!(names.first(), Some(&""), "{names:?}");
    assert!(
        names.contains(&"runc") && names.contains(&"traced"),
        "{names:?}"
    );
    assert!(!names.contains(&"gone"), "{names:?}");
    let ready = &status.status.as_ref().unwrap().conditions[0];
    assert!(ready.r#type == "RuntimeReady" && ready.status, "{ready:?}");
    let info: Vec<Value> = serde_json::from_str(&status.info["runtimeHandlers"]).unwrap();
    let entry = |name: &str| info.iter().find(|h| h["name"] == name).unwrap().clone();
    assert_eq!(entry("runc")["default"], true);
    let gone = entry("gone");
    assert_eq!(gone["available"], false);
    assert!(
        gone["reason"].as_str().unwrap().contains("not found"),
        "{gone}"
    );
    // crun is built in: listed by name exactly when its probe found it working (on a host
    // whose cgroup v2 hierarchy is mounted beside v1 controllers, crun refuses to run).
    let crun = entry("crun");
    assert_eq!(
        crun["available"].as_bool().unwrap(),
        names.contains(&"crun"),
        "{crun}"
    );
    if crun["available"] == false {
        assert!(!crun["reason"].as_str().unwrap().is_empty(), "{crun}");
    }

    // The probes (two of them runc) ran in containers of their own: nothing was written into
    // the infra rootfs every sandbox shares (its /dev stays an empty mount point).
    let infra_dev: Vec<_> = std::fs::read_dir(env.state().join("infra/dev"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(infra_dev.is_empty(), "{infra_dev:?}");

    // Refused by name: a handler nobody configured, one that does not work here.
    let config = pod_config("traced", env.logs.path());
    let e = run_pod_with(&mut c, &config, "gvisor").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("\"gvisor\"") && e.message().contains("traced"),
        "{e:?}"
    );
    let e = run_pod_with(&mut c, &config, "gone").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("\"gone\"") && e.message().contains("not found"),
        "{e:?}"
    );
    if crun["available"] == false {
        let e = run_pod_with(&mut c, &config, "crun").await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        let reason = crun["reason"].as_str().unwrap();
        assert!(e.message().contains(reason), "{e:?}");
    }

    // A pod under `traced`: its infra and its containers run through that binary, under that
    // handler's own root, and through nothing else.
    let sb = run_pod_with(&mut c, &config, "traced").await.unwrap();
    let ctr = run_container(
        &mut c,
        &sb,
        &config,
        container_config("main", &image, &["sleep", "3600"]),
    )
    .await;
    let (code, out, _) = exec_text(&mut c, &ctr, &["echo", "hi"], 10).await;
    assert_eq!((code, out.as_str()), (0, "hi\n"));
    let root = env.state().join("runtimes/traced");
    let root_arg = format!("--root {}", root.display());
    for (id, what) in [(&sb, "infra"), (&ctr, "container")] {
        for op in ["create", "start"] {
            assert!(
                traced
                    .calls_with(id)
                    .iter()
                    .any(|l| l.contains(op) && l.contains(&root_arg)),
                "no {op} of the {what} through traced under {root_arg}: {:?}",
                traced.calls_with("")
            );
        }
    }
    // ExecSync is `exec` of the container's runtime.
    assert!(
        traced
            .calls_with(&ctr)
            .iter()
            .any(|l| l.contains(" exec ") && l.contains(&root_arg)),
        "{:?}",
        traced.calls_with(&ctr)
    );
    let status = c
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: sb.clone(),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner();
    let sinfo: Value = serde_json::from_str(&status.info["info"]).unwrap();
    assert_eq!(sinfo["runtimeHandler"], "traced", "{sinfo}");
    assert_eq!(status.status.unwrap().runtime_handler, "traced");
    let cinfo: Value = serde_json::from_str(
        &c.container_status(cri::ContainerStatusRequest {
            container_id: ctr.clone(),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner()
        .info["info"],
    )
    .unwrap();
    assert_eq!(cinfo["runtimeHandler"], "traced", "{cinfo}");
    assert!(
        cinfo["runtimeType"]
            .as_str()
            .unwrap()
            .ends_with("traced-runc"),
        "{cinfo}"
    );

    // A pod with no handler runs under runc's own root, not traced's.
    let plain = pod_config("plain", env.logs.path());
    let sb2 = run_pod_with(&mut c, &plain, "").await.unwrap();
    assert!(
        traced.calls_with(&sb2).is_empty(),
        "{:?}",
        traced.calls_with(&sb2)
    );
    let listed = runc_list(&env.state().join("runc"));
    assert!(listed.contains(&sb2) && !listed.contains(&sb), "{listed}");

    // Across a restart the records keep their handler: the pod is stopped and removed through
    // it.
    let mut env = env;
    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    stop_pod_sandbox(&mut c, &sb).await;
    for op in ["kill", "delete"] {
        assert!(
            traced
                .calls_with(&sb)
                .iter()
                .any(|l| l.contains(op) && l.contains(&root_arg)),
            "no {op} of the infra through traced: {:?}",
            traced.calls_with(&sb)
        );
    }
    remove_pod_sandbox(&mut c, &sb).await;
    remove_pod_sandbox(&mut c, &sb2).await;
    let left = runc_list(&root);
    assert!(left.is_empty(), "{left}");
    assert!(env.stray_state().is_empty(), "{:?}", env.stray_state());
}
