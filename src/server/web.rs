//! The chat page at `/`: three static files compiled into the binary (`assets/web/`), served
//! without the API key (the page asks for it) under a Content-Security-Policy that allows only
//! this origin's script and style, so no text a model or user writes can run as script.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX_HTML: &str = include_str!("../../assets/web/index.html");
const CHAT_JS: &str = include_str!("../../assets/web/chat.js");
const CHAT_CSS: &str = include_str!("../../assets/web/chat.css");

/// No inline script or style, no other origin, no framing, no plugins.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// One static file with its type and the page's security headers.
fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The page's routes (`/`, `/chat.js`, `/chat.css`).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/chat.js",
            get(|| async { asset(CHAT_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/chat.css",
            get(|| async { asset(CHAT_CSS, "text/css; charset=utf-8") }),
        )
}
