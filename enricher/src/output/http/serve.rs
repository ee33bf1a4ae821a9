//! The HTTP server's connections: at most `--http-max-connections` at once (more are
//! closed at accept, counted), HTTP/1.1 with a header timeout that also ends a
//! connection left idle between requests, a bounded header buffer, and a bounded life.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Time for a request's headers, and for the next request on a kept-alive connection.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest life of one connection (a download of a 60-minute window included).
const CONNECTION_LIFE: Duration = Duration::from_secs(300);
/// Bytes of a request's headers at most.
const MAX_HEADER_BUFFER: usize = 64 << 10;

/// Serves `app` on `listener` until the process ends.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    max_connections: usize,
    metrics: Arc<Metrics>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            Metrics::inc(&metrics.http_connections_refused);
            tracing::warn!(
                limit = max_connections,
                "too many HTTP connections; one closed"
            );
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEADER_BUFFER)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFE, conn).await;
        });
    }
}
