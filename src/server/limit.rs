//! The concurrency limit: at most N completion requests in flight (a streamed response
//! counts until its stream ends or its client goes away); one more is turned away at once
//! with a 429 instead of holding a connection and memory while it waits. `/health`,
//! `/metrics` and `/v1/models` are exempt so that a saturated server can still be watched.

use super::error::ApiError;
use super::metrics::{Metrics, Rejection};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// The permits and the counters the middleware reports to.
#[derive(Clone)]
pub struct Concurrency {
    permits: Arc<Semaphore>,
    limit: usize,
    metrics: Arc<Metrics>,
}

impl Concurrency {
    /// At most `limit` requests at once (at least 1).
    pub fn new(limit: usize, metrics: Arc<Metrics>) -> Self {
        let limit = limit.max(1);
        Self {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
            metrics,
        }
    }
}

/// Middleware: takes a permit for the request and keeps it inside the response body, so
/// the permit is released when the body (a stream, possibly) is finished or dropped.
pub async fn limit(State(c): State<Concurrency>, req: Request, next: Next) -> Response {
    let Ok(permit) = c.permits.clone().try_acquire_owned() else {
        c.metrics.rejected(Rejection::Busy);
        return ApiError::too_many(format!(
            "too many requests in flight ({} at most, --max-concurrent); retry shortly",
            c.limit
        ))
        .into_response();
    };
    let (parts, body) = next.run(req).await.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _held = &permit;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}
