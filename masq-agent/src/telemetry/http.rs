//! The HTTP endpoint: `/metrics`, `/healthz` and `/readyz`.

use std::{
    convert::Infallible,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Bytes, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::Telemetry;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// Binds `addr` now, so that a taken port fails the start with a clear error, and serves the
/// endpoints from a thread of its own until the process exits.
pub fn serve(addr: SocketAddr, telemetry: Arc<Telemetry>) -> anyhow::Result<()> {
    let listener = bind(addr).map_err(|err| anyhow::anyhow!("--metrics-addr {addr}: {err}"))?;
    listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("telemetry".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(err) => {
                    tracing::error!("metrics endpoint: {err}");
                    return;
                }
            };
            runtime.block_on(accept_each(listener, telemetry));
        })?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    Ok(())
}

/// Binds `addr`. On `[::]`, which `:PORT` means, Linux takes IPv4 connections too; a kernel
/// without IPv6 gets every IPv4 address instead, as Go's listeners do.
fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    match std::net::TcpListener::bind(addr) {
        Err(err)
            if addr.ip() == Ipv6Addr::UNSPECIFIED
                && err.raw_os_error() == Some(libc::EAFNOSUPPORT) =>
        {
            std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, addr.port()))
        }
        bound => bound,
    }
}

async fn accept_each(listener: std::net::TcpListener, telemetry: Arc<Telemetry>) {
    let listener = match TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(err) => {
            tracing::error!("metrics endpoint: {err}");
            return;
        }
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let telemetry = telemetry.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let telemetry = telemetry.clone();
                async move { Ok::<_, Infallible>(respond(&telemetry, &request)) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn respond<B>(telemetry: &Telemetry, request: &Request<B>) -> Response<Full<Bytes>> {
    match request.uri().path() {
        "/metrics" => reply(StatusCode::OK, OPENMETRICS, telemetry.encode()),
        "/healthz" => match telemetry.liveness_problem() {
            None => reply(StatusCode::OK, TEXT, "ok\n".into()),
            Some(problem) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, problem + "\n"),
        },
        "/readyz" if telemetry.is_ready() => reply(StatusCode::OK, TEXT, "ok\n".into()),
        "/readyz" => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            TEXT,
            "no successful sync yet\n".into(),
        ),
        _ => reply(StatusCode::NOT_FOUND, TEXT, "not found\n".into()),
    }
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}
