//! The console's static files, compiled into the binary: the pages' stylesheet and script, and
//! the vendored chart library (uPlot 1.6.32, MIT; its licence is `static/uPlot.LICENSE`, served
//! too). No CDN: the console works where the admin server is reachable and nothing else is.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// Name, content type and bytes of every static file.
const FILES: &[(&str, &str, &[u8])] = &[
    (
        "console.css",
        "text/css; charset=utf-8",
        include_bytes!("static/console.css"),
    ),
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_bytes!("static/console.js"),
    ),
    (
        "uPlot.iife.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("static/uPlot.iife.min.js"),
    ),
    (
        "uPlot.min.css",
        "text/css; charset=utf-8",
        include_bytes!("static/uPlot.min.css"),
    ),
    (
        "uPlot.LICENSE",
        "text/plain; charset=utf-8",
        include_bytes!("static/uPlot.LICENSE"),
    ),
];

/// `GET /ui/static/{file}`: needs no session (nothing in them is secret), cached for an hour.
pub async fn serve(Path(file): Path<String>) -> Response {
    match FILES.iter().find(|(name, _, _)| *name == file) {
        Some((_, content_type, bytes)) => {
            let mut response = (*bytes).into_response();
            let headers = response.headers_mut();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            headers.insert(
                header::CACHE_CONTROL,
                HeaderValue::from_static("max-age=3600"),
            );
            response
        }
        None => (StatusCode::NOT_FOUND, "no such file\n").into_response(),
    }
}
