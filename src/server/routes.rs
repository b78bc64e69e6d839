//! HTTP routes: the OpenAI endpoints, `/health`, `/metrics`, the chat page, the API-key check, and the
//! admission path (parse → tokenize → queue) shared by both completion endpoints.

use super::anthropic;
use super::error::ApiError;
use super::limit::{self, Concurrency};
use super::metrics::{Metrics, Rejection};
use super::queue::JobQueue;
use super::request::{self, Endpoint, Limits};
use super::respond::{self, Shape};
use super::types::{ModelCard, ModelList};
use super::worker::{Event, Job};
use crate::engine::tokenizer::Tokenizer;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What every handler shares.
pub struct AppState {
    /// The served model's id (what `/v1/models` lists).
    pub model_id: String,
    /// A tokenizer for prompts and logprob token texts (the engine has its own).
    pub tokenizer: Tokenizer,
    /// The way to the engine thread.
    pub queue: JobQueue,
    /// Server metrics.
    pub metrics: Arc<Metrics>,
    /// Request bounds and defaults.
    pub limits: Limits,
    /// Bearer key every route but `/health` requires, if set.
    pub api_key: Option<String>,
    /// Unix seconds at start.
    pub created: u64,
}

/// The application: every route, the API-key check, the concurrency limit (the two
/// completion routes) and the body size limit.
pub fn router(state: Arc<AppState>, max_body_bytes: usize, concurrency: Concurrency) -> Router {
    let generating = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route_layer(middleware::from_fn_with_state(concurrency, limit::limit));
    let guarded = generating
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .merge(super::web::routes())
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

/// Compares without stopping at the first differing byte.
fn same_key(given: &str, key: &str) -> bool {
    given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

async fn require_key(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        // OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`.
        let headers = req.headers();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
        if !given.is_some_and(|g| same_key(g.trim(), key)) {
            s.metrics.rejected(Rejection::Invalid);
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health() -> Response {
    match crate::engine::distributed::broken() {
        // Across ranks: a lost rank leaves rank 0 unable to generate.
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "error", "error": why})),
        )
            .into_response(),
        None => Json(serde_json::json!({"status": "ok"})).into_response(),
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: s.model_id.clone(),
            object: "model",
            created: s.created,
            owned_by: "mlxb",
        }],
    })
    .into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let mut response = s.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

async fn not_found(uri: Uri) -> Response {
    ApiError::not_found(uri.path()).into_response()
}

async fn chat(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(s, Endpoint::Chat, body).await
}

async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(s, Endpoint::Completions, body).await
}

/// `POST /v1/messages`: Anthropic's Messages API, translated into a chat request.
async fn messages(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    let translated = body_bytes(body)
        .and_then(|b| anthropic::request::to_chat_body(&b).map_err(|e| (Rejection::Invalid, e)));
    let admitted = translated.and_then(|b| admit_body(&s, Endpoint::Chat, &b, arrived));
    let (shape, stream, prompt_tokens, mut rx) = match admitted {
        Ok(a) => a,
        Err((why, err)) => {
            s.metrics.rejected(why);
            return err.into_response();
        }
    };
    let m = anthropic::respond::MessageShape::new(shape, prompt_tokens);
    if !stream {
        return anthropic::respond::collect(m, rx).await;
    }
    match rx.recv().await {
        Some(Event::Error(e)) => e.into_response(),
        Some(first) => anthropic::respond::stream(m, rx, first),
        None => {
            ApiError::internal("the engine stopped before starting this request").into_response()
        }
    }
}

/// Admits a completion request and answers it, whole or streamed.
async fn complete(
    s: Arc<AppState>,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let admitted = body_bytes(body).and_then(|b| admit_body(&s, endpoint, &b, arrived));
    let (shape, stream, _, mut rx) = match admitted {
        Ok(admitted) => admitted,
        Err((why, err)) => {
            s.metrics.rejected(why);
            return err.into_response();
        }
    };
    if !stream {
        return respond::collect(shape, &s, rx).await;
    }
    // Wait for the first event so that a failure before any output gets its own status.
    match rx.recv().await {
        Some(Event::Error(e)) => e.into_response(),
        Some(first) => respond::stream(shape, s, rx, first),
        None => {
            ApiError::internal("the engine stopped before starting this request").into_response()
        }
    }
}

/// The response shape, whether to stream, the prompt's length in tokens, and the events.
type Admitted = (Shape, bool, usize, UnboundedReceiver<Event>);

/// The request body, or the 4xx that its rejection (too large, unreadable) deserves.
fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, (Rejection, ApiError)> {
    let invalid = |e| (Rejection::Invalid, e);
    body.map_err(|r| {
        let mut e =
            ApiError::bad_request(format!("the request body was rejected: {}", r.body_text()));
        e.status = r.status();
        if e.status == StatusCode::PAYLOAD_TOO_LARGE {
            e.code = Some("request_too_large");
        }
        invalid(e)
    })
}

/// Parses, validates and tokenizes a request body and queues it for the engine.
fn admit_body(
    s: &AppState,
    endpoint: Endpoint,
    bytes: &[u8],
    arrived: Instant,
) -> Result<Admitted, (Rejection, ApiError)> {
    let invalid = |e| (Rejection::Invalid, e);
    let request = request::parse(endpoint, bytes, &s.limits).map_err(invalid)?;
    let prompt_ids = request::prompt_ids(
        &s.tokenizer,
        &request.prompt,
        request.tool_use.template_tools(),
    )
    .map_err(invalid)?;
    request::check_prompt_length(&request, prompt_ids.len(), &s.limits).map_err(invalid)?;
    let shape = Shape::new(&request, &s.model_id, s.tokenizer.tool_parser());
    let stream = request.stream;
    let prompt_tokens = prompt_ids.len();
    let (tx, rx) = unbounded_channel();
    let job = Job {
        request,
        prompt_ids,
        events: tx,
        arrived,
    };
    s.queue
        .submit(job, &s.metrics)
        .map_err(|e| (Rejection::Unavailable, e))?;
    Ok((shape, stream, prompt_tokens, rx))
}
