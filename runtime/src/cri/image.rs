//! CRI ImageService: pull, list, inspect, remove images and report the image filesystem.

use std::collections::HashMap;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::image_service_server::ImageService;
use minicri_store::{Credentials, ImageRecord};
use tonic::{Request, Response, Status};

use super::Streamed;
use crate::daemon::Daemon;
use crate::error::Error;
use crate::rpc::{Verbosity, call, call_batched, deadline};

pub struct ImageHandler {
    pub daemon: Arc<Daemon>,
}

/// The CRI view of an image record.
pub fn to_cri_image(r: &ImageRecord) -> cri::Image {
    cri::Image {
        id: r.id.to_string(),
        repo_tags: r.repo_tags.clone(),
        repo_digests: r.repo_digests.clone(),
        size: r.size,
        uid: r.uid.map(|value| cri::Int64Value { value }),
        username: r.username.clone(),
        spec: Some(cri::ImageSpec {
            image: r.id.to_string(),
            ..Default::default()
        }),
        pinned: r.pinned,
    }
}

fn image_name(spec: Option<&cri::ImageSpec>) -> &str {
    spec.map(|s| s.image.as_str()).unwrap_or("")
}

fn require_name(spec: Option<&cri::ImageSpec>) -> Result<String, Error> {
    let name = image_name(spec);
    if name.is_empty() {
        return Err(Error::InvalidArgument(
            "image reference is empty (ImageSpec.image must be set)".into(),
        ));
    }
    Ok(name.to_string())
}

fn credentials(auth: Option<cri::AuthConfig>) -> Credentials {
    auth.map(|a| Credentials {
        username: a.username,
        password: a.password,
        auth: a.auth,
        server_address: a.server_address,
        identity_token: a.identity_token,
        registry_token: a.registry_token,
    })
    .unwrap_or_default()
}

/// The image a list filter names (`""`: every image).
fn image_filter(filter: Option<cri::ImageFilter>) -> String {
    filter
        .and_then(|f| f.image)
        .map(|s| s.image)
        .unwrap_or_default()
}

/// ListImages and StreamImages: every image, or the one `filter` names (none when unknown).
fn list_images(daemon: &Daemon, filter: &str) -> Result<Vec<cri::Image>, Error> {
    let images = if filter.is_empty() {
        daemon.images.list()
    } else {
        daemon.images.get(filter)?.into_iter().collect()
    };
    Ok(images.iter().map(to_cri_image).collect())
}

#[tonic::async_trait]
impl ImageService for ImageHandler {
    async fn list_images(
        &self,
        req: Request<cri::ListImagesRequest>,
    ) -> Result<Response<cri::ListImagesResponse>, Status> {
        let dl = deadline(&req);
        let filter = image_filter(req.into_inner().filter);
        call("ListImages", filter.clone(), dl, Verbosity::Poll, async {
            Ok(cri::ListImagesResponse {
                images: list_images(&self.daemon, &filter)?,
            })
        })
        .await
    }

    async fn stream_images(
        &self,
        req: Request<cri::StreamImagesRequest>,
    ) -> Streamed<cri::StreamImagesResponse> {
        let dl = deadline(&req);
        let filter = image_filter(req.into_inner().filter);
        let daemon = &self.daemon;
        let list = async { list_images(daemon, &filter) };
        call_batched("StreamImages", dl, Verbosity::Poll, list, |images| {
            cri::StreamImagesResponse { images }
        })
        .await
    }

    async fn image_status(
        &self,
        req: Request<cri::ImageStatusRequest>,
    ) -> Result<Response<cri::ImageStatusResponse>, Status> {
        let dl = deadline(&req);
        let req = req.into_inner();
        let name = image_name(req.image.as_ref()).to_string();
        call("ImageStatus", name.clone(), dl, Verbosity::Poll, async {
            let name = require_name(req.image.as_ref())?;
            // An unknown image is an empty response, not an error (CRI).
            let Some(rec) = self.daemon.images.get(&name)? else {
                return Ok(cri::ImageStatusResponse::default());
            };
            let mut info = HashMap::new();
            if req.verbose {
                info.insert("info".to_string(), self.daemon.image_info(&rec)?);
            }
            Ok(cri::ImageStatusResponse {
                image: Some(to_cri_image(&rec)),
                info,
            })
        })
        .await
    }

    async fn pull_image(
        &self,
        req: Request<cri::PullImageRequest>,
    ) -> Result<Response<cri::PullImageResponse>, Status> {
        let dl = deadline(&req);
        let req = req.into_inner();
        let name = image_name(req.image.as_ref()).to_string();
        call("PullImage", name.clone(), dl, Verbosity::Normal, async {
            let name = require_name(req.image.as_ref())?;
            let creds = credentials(req.auth);
            let requester = crate::images::requester(
                req.sandbox_config,
                |uid, attempt| self.daemon.pods.sandbox_of_pod(uid, attempt),
                &self.daemon.config.pull.priority_namespaces,
            );
            let rec = self.daemon.pulls.pull(&name, &creds, requester).await?;
            Ok(cri::PullImageResponse {
                image_ref: rec.id.to_string(),
            })
        })
        .await
    }

    async fn remove_image(
        &self,
        req: Request<cri::RemoveImageRequest>,
    ) -> Result<Response<cri::RemoveImageResponse>, Status> {
        let dl = deadline(&req);
        let req = req.into_inner();
        let name = image_name(req.image.as_ref()).to_string();
        call("RemoveImage", name.clone(), dl, Verbosity::Normal, async {
            let name = require_name(req.image.as_ref())?;
            // Removing an image that is not there succeeds (CRI: idempotent). The call returns
            // once the record is gone; blobs and snapshots go in the background.
            let pulls = self.daemon.pulls.clone();
            let removed = tokio::task::spawn_blocking(move || pulls.remove_image(&name))
                .await
                .map_err(|e| Error::Internal(format!("RemoveImage task: {e}")))??;
            for img in &removed {
                tracing::info!(image = %img.id, tags = ?img.repo_tags, "image removed");
            }
            Ok(cri::RemoveImageResponse {})
        })
        .await
    }

    async fn image_fs_info(
        &self,
        req: Request<cri::ImageFsInfoRequest>,
    ) -> Result<Response<cri::ImageFsInfoResponse>, Status> {
        let dl = deadline(&req);
        call("ImageFsInfo", "", dl, Verbosity::Poll, async {
            let usage = self.daemon.image_fs_usage().await?;
            Ok(cri::ImageFsInfoResponse {
                image_filesystems: vec![usage],
                container_filesystems: vec![],
            })
        })
        .await
    }
}
