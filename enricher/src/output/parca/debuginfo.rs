//! Parca debuginfo upload: binaries whose frames firn could not name (stripped) are sent
//! to Parca so that it can symbolize them (with `--debuginfo-upload-all`, every binary
//! with a build id the server lacks). Per build id: `ShouldInitiateUpload`, then
//! `InitiateUpload`, a client stream of `Upload` (its info, then chunks), then
//! `MarkUploadFinished`. A cache by build id asks once; uploads are limited in number at
//! once and in bytes per second.

use std::io::Read;
use std::num::NonZeroUsize;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tonic::transport::Channel;

use super::proto::*;
use super::Token;
use crate::metrics::Metrics;
use crate::output::delivery::SendError;
use crate::output::grpc;
use crate::settings::DebuginfoMode as Mode;

const SHOULD: &str = "/parca.debuginfo.v1alpha1.DebuginfoService/ShouldInitiateUpload";
const INITIATE: &str = "/parca.debuginfo.v1alpha1.DebuginfoService/InitiateUpload";
const UPLOAD: &str = "/parca.debuginfo.v1alpha1.DebuginfoService/Upload";
const FINISHED: &str = "/parca.debuginfo.v1alpha1.DebuginfoService/MarkUploadFinished";
const CHUNK: usize = 256 << 10;
/// A failed attempt (server down, error) is tried again after this.
const RETRY_AFTER: Duration = Duration::from_secs(300);
/// Larger files are not uploaded (counted).
const MAX_SIZE: u64 = 2 << 30;

#[derive(Clone, Copy)]
enum State {
    /// Being handled, or known to the server (done).
    Settled,
    /// Try again after this instant.
    RetryAt(Instant),
}

pub(super) struct Settings {
    pub(crate) mode: Mode,
    pub(crate) concurrency: usize,
    /// Bytes per second over all uploads.
    pub(crate) rate: u64,
}

pub(super) struct Debuginfo {
    channel: Channel,
    token: Rc<Token>,
    settings: Settings,
    cache: std::cell::RefCell<lru::LruCache<String, State>>,
    slots: Semaphore,
    metrics: Arc<Metrics>,
}

impl Debuginfo {
    pub(crate) fn new(
        channel: Channel,
        token: Rc<Token>,
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> Rc<Self> {
        let slots = Semaphore::new(settings.concurrency.max(1));
        Rc::new(Self {
            channel,
            token,
            settings,
            cache: std::cell::RefCell::new(lru::LruCache::new(
                NonZeroUsize::new(8192).unwrap_or(NonZeroUsize::MIN),
            )),
            slots,
            metrics,
        })
    }

    pub(crate) fn mode(&self) -> Mode {
        self.settings.mode
    }

    /// Whether `build_id` (hex) should be offered now: not settled, not waiting to retry.
    pub(crate) fn wants(&self, build_id: &str) -> bool {
        match self.cache.borrow_mut().get(build_id) {
            None => true,
            Some(State::Settled) => false,
            Some(State::RetryAt(t)) => Instant::now() >= *t,
        }
    }

    /// Starts handling one binary in the background.
    pub(crate) fn offer(self: &Rc<Self>, build_id: String, file: std::fs::File) {
        self.cache
            .borrow_mut()
            .put(build_id.clone(), State::Settled);
        let me = self.clone();
        tokio::task::spawn_local(async move {
            let Ok(_slot) = me.slots.acquire().await else {
                return;
            };
            match me.upload(&build_id, file).await {
                Ok(()) => {}
                Err(e) => {
                    Metrics::inc(&me.metrics.debuginfo_upload_errors);
                    let retry = matches!(grpc::classify(&e), SendError::Retry(_));
                    tracing::warn!(build_id = %build_id, error = %e.message(), code = ?e.code(), retry, "debuginfo upload failed");
                    let at = Instant::now() + if retry { RETRY_AFTER } else { RETRY_AFTER * 12 };
                    me.cache.borrow_mut().put(build_id, State::RetryAt(at));
                }
            }
        });
    }

    async fn upload(&self, build_id: &str, file: std::fs::File) -> Result<(), tonic::Status> {
        let should: ShouldInitiateUploadResponse = self
            .call(
                SHOULD,
                ShouldInitiateUploadRequest {
                    build_id: build_id.into(),
                    hash: String::new(),
                    force: false,
                    r#type: DEBUGINFO_TYPE_EXECUTABLE,
                    build_id_type: BUILD_ID_TYPE_GNU,
                },
            )
            .await?;
        if !should.should_initiate_upload {
            Metrics::inc(&self.metrics.debuginfo_already_present);
            tracing::debug!(build_id, reason = %should.reason, "the server has this binary's debuginfo");
            return Ok(());
        }
        let size = file
            .metadata()
            .map_err(|e| tonic::Status::internal(format!("stat: {e}")))?
            .len();
        if size > MAX_SIZE {
            Metrics::inc(&self.metrics.debuginfo_skipped);
            tracing::info!(build_id, size, "binary too large to upload as debuginfo");
            return Ok(());
        }
        let init: InitiateUploadResponse = self
            .call(
                INITIATE,
                InitiateUploadRequest {
                    build_id: build_id.into(),
                    size: size as i64,
                    hash: String::new(),
                    force: false,
                    r#type: DEBUGINFO_TYPE_EXECUTABLE,
                    build_id_type: BUILD_ID_TYPE_GNU,
                },
            )
            .await?;
        let Some(ins) = init.upload_instructions else {
            return Err(tonic::Status::internal(
                "InitiateUpload answered no instructions",
            ));
        };
        if ins.upload_strategy != UPLOAD_STRATEGY_GRPC {
            Metrics::inc(&self.metrics.debuginfo_skipped);
            tracing::warn!(
                build_id,
                strategy = ins.upload_strategy,
                "the server asks for a signed-URL upload, which firn does not do; skipped"
            );
            return Ok(());
        }
        let first = UploadRequest {
            data: Some(upload_request::Data::Info(UploadInfo {
                build_id: build_id.into(),
                upload_id: ins.upload_id.clone(),
                r#type: DEBUGINFO_TYPE_EXECUTABLE,
            })),
        };
        // Chunks are read as the stream is polled; the rate limit paces them.
        let rate = self.settings.rate.max(1);
        let chunks = futures::stream::unfold(Some(file), move |f| async move {
            let mut f = f?;
            let mut buf = vec![0u8; CHUNK];
            let n = match f.read(&mut buf) {
                Ok(0) | Err(_) => return None,
                Ok(n) => n,
            };
            buf.truncate(n);
            tokio::time::sleep(Duration::from_secs_f64(n as f64 / rate as f64)).await;
            Some((
                UploadRequest {
                    data: Some(upload_request::Data::ChunkData(buf)),
                },
                Some(f),
            ))
        });
        let stream = futures::StreamExt::chain(futures::stream::iter([first]), chunks);
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("connecting: {e}")))?;
        let mut req = tonic::Request::new(stream);
        for (k, v) in self.token.headers() {
            req.metadata_mut().insert(k, v);
        }
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(UPLOAD);
        let codec = tonic_prost::ProstCodec::<UploadRequest, UploadResponse>::default();
        let up = grpc.client_streaming(req, path, codec).await?.into_inner();
        let _: MarkUploadFinishedResponse = self
            .call(
                FINISHED,
                MarkUploadFinishedRequest {
                    build_id: build_id.into(),
                    upload_id: ins.upload_id,
                    r#type: DEBUGINFO_TYPE_EXECUTABLE,
                },
            )
            .await?;
        Metrics::inc(&self.metrics.debuginfo_uploaded);
        Metrics::add(&self.metrics.debuginfo_upload_bytes, up.size.max(size));
        tracing::info!(build_id, bytes = size, "debuginfo uploaded to Parca");
        Ok(())
    }

    async fn call<Q, R>(&self, path: &'static str, req: Q) -> Result<R, tonic::Status>
    where
        Q: prost14::Message,
        R: prost14::Message + Default + Send + 'static,
    {
        let body = Arc::new(req.encode_to_vec());
        grpc::unary::<R>(
            self.channel.clone(),
            path,
            body,
            &self.token.headers(),
            false,
        )
        .await
    }
}
