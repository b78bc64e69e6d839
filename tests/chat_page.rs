//! The chat page at `/` of `mlxb serve`, in a real browser: headless Chromium (Debian's
//! `chromium` and `chromium-driver`, installed by `scripts/setup.sh --dev`) driven by Selenium from
//! `.venv` through `tests/browser/chat_page.py`. The page asks for the API key once, streams a
//! greedy answer equal to the API's, stops a generation mid-stream, keeps conversations across
//! a reload, shows markup as text and renders markdown without raw HTML.

mod common;
mod serve_harness;

use serde_json::json;
use serve_harness::Server;

/// Whether `html` has an inline event handler attribute (` onclick=`, ` onload=`, ...).
fn has_event_attribute(html: &str) -> bool {
    html.match_indices(" on").any(|(i, _)| {
        let rest = &html[i + 3..];
        let name_len = rest.chars().take_while(|c| c.is_ascii_alphabetic()).count();
        name_len > 0 && rest[name_len..].starts_with('=')
    })
}

#[test]
fn page_is_served_with_a_strict_content_security_policy() {
    let s = Server::start(&["--api-key", "page-key"]);
    for (path, kind) in [
        ("/", "text/html"),
        ("/chat.js", "text/javascript"),
        ("/chat.css", "text/css"),
    ] {
        // No key needed for the page itself: it asks for the key.
        let r = s.agent.get(&s.url(path)).call().unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert!(
            r.content_type().starts_with(kind),
            "{path}: {}",
            r.content_type()
        );
        let csp = r.header("content-security-policy").unwrap_or("").to_owned();
        assert!(
            csp.contains("script-src 'self'") && csp.contains("default-src 'none'"),
            "{path}: {csp}"
        );
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        let body = r.into_string().unwrap();
        assert!(!body.is_empty());
        if path == "/" {
            // Only the page's own files, no inline script or style.
            assert!(body.contains(r#"<script src="/chat.js" defer></script>"#));
            assert_eq!(body.matches("<script").count(), 1, "{body}");
            assert!(
                !body.contains("<style") && !has_event_attribute(&body),
                "{body}"
            );
            assert!(!body.contains("http://") && !body.contains("https://"));
        }
    }
    // The API still needs the key.
    let denied = s.agent.get(&s.url("/v1/models")).call();
    assert!(matches!(denied, Err(ureq::Error::Status(401, _))));
}

#[test]
fn chat_page_works_in_headless_chromium() {
    let s = Server::start(&["--api-key", "page-key"]);
    let prompt = "Write one sentence about the sea.";
    let max_tokens = 24;
    let (status, api) = s.post(
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": max_tokens,
        }),
    );
    assert_eq!(status, 200, "{api}");
    let answer = api["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!answer.trim().is_empty(), "{api}");
    let dir = tempfile::tempdir().unwrap();
    let expected = dir.path().join("expected.json");
    std::fs::write(
        &expected,
        json!({"prompt": prompt, "max_tokens": max_tokens, "answer": answer}).to_string(),
    )
    .unwrap();
    let shot = std::env::var("MLXB_CHAT_SCREENSHOT").unwrap_or_default();
    let mut args = vec![
        s.url("/"),
        "page-key".into(),
        expected.display().to_string(),
    ];
    if !shot.is_empty() {
        args.push(shot);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = common::run_python(&common::root().join("tests/browser/chat_page.py"), &args);
    let seen: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(seen["conversations"], 3, "{seen}");
    assert!(seen["stopped_chars"].as_u64().unwrap() > 0, "{seen}");
}
