//! The HTTP endpoints: `/metrics`, `/healthz` and `/readyz`, on one address or two.

use std::{
    convert::Infallible,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Bytes, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// What the endpoints answer from (the agent's `Telemetry`): all this module knows of it.
pub trait Answers: Send + Sync + 'static {
    /// `/metrics`: the metrics in OpenMetrics text.
    fn encode(&self) -> String;
    /// `/healthz`: why the agent is not live, if it is not.
    fn liveness_problem(&self) -> Option<String>;
    /// `/readyz`: whether a sync has succeeded.
    fn is_ready(&self) -> bool;
}
use crate::cli::DaemonFlags;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// Which endpoints one address serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoints {
    pub metrics: bool,
    pub health: bool,
}

impl Endpoints {
    /// Each address the flags name, with what it serves: everything on `--metrics-addr`, unless
    /// `--health-addr` takes the health endpoints elsewhere.
    pub fn listeners(flags: &DaemonFlags) -> Vec<(SocketAddr, Endpoints)> {
        let both = Endpoints {
            metrics: true,
            health: true,
        };
        match (flags.metrics_addr, flags.health_addr) {
            (Some(metrics), Some(health)) if metrics != health => vec![
                (
                    metrics,
                    Endpoints {
                        health: false,
                        ..both
                    },
                ),
                (
                    health,
                    Endpoints {
                        metrics: false,
                        ..both
                    },
                ),
            ],
            (Some(addr), _) => vec![(addr, both)],
            (None, Some(health)) => vec![(
                health,
                Endpoints {
                    metrics: false,
                    ..both
                },
            )],
            (None, None) => Vec::new(),
        }
    }

    fn paths(self) -> &'static str {
        match (self.metrics, self.health) {
            (true, true) => "/metrics, /healthz and /readyz",
            (true, false) => "/metrics",
            _ => "/healthz and /readyz",
        }
    }
}

/// Binds `addr` now, so that a taken port fails the start with a clear error, and serves
/// `endpoints` from a thread of its own until the process exits.
pub fn serve(
    addr: SocketAddr,
    endpoints: Endpoints,
    telemetry: Arc<impl Answers>,
) -> anyhow::Result<()> {
    let flag = if endpoints.metrics {
        "--metrics-addr"
    } else {
        "--health-addr"
    };
    let listener = bind(addr).map_err(|err| anyhow::anyhow!("{flag} {addr}: {err}"))?;
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
            runtime.block_on(accept_each(listener, endpoints, telemetry));
        })?;
    tracing::info!(%addr, "serving {}", endpoints.paths());
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

async fn accept_each(
    listener: std::net::TcpListener,
    endpoints: Endpoints,
    telemetry: Arc<impl Answers>,
) {
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
                async move { Ok::<_, Infallible>(respond(&*telemetry, endpoints, &request)) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn respond<B>(
    telemetry: &(impl Answers + ?Sized),
    endpoints: Endpoints,
    request: &Request<B>,
) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    let served = match path {
        "/metrics" => endpoints.metrics,
        "/healthz" | "/readyz" => endpoints.health,
        _ => false,
    };
    if !served {
        return reply(StatusCode::NOT_FOUND, TEXT, "not found\n".into());
    }
    match path {
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

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::Cli;

    fn listeners(args: &[&str]) -> Vec<(String, &'static str)> {
        let cli =
            Cli::try_parse_from(std::iter::once("masq-agent").chain(args.iter().copied())).unwrap();
        Endpoints::listeners(&cli.flags.daemon)
            .into_iter()
            .map(|(addr, endpoints)| (addr.to_string(), endpoints.paths()))
            .collect()
    }

    #[test]
    fn the_health_endpoints_go_where_health_addr_says() {
        let all = "/metrics, /healthz and /readyz";
        assert!(listeners(&[]).is_empty());
        let metrics = "--metrics-addr=0.0.0.0:9830";
        assert_eq!(listeners(&[metrics]), [("0.0.0.0:9830".into(), all)]);
        assert_eq!(
            listeners(&[metrics, "--health-addr=127.0.0.1:9831"]),
            [
                ("0.0.0.0:9830".into(), "/metrics"),
                ("127.0.0.1:9831".into(), "/healthz and /readyz")
            ]
        );
        assert_eq!(
            listeners(&["--health-addr=127.0.0.1:9831"]),
            [("127.0.0.1:9831".into(), "/healthz and /readyz")]
        );
        let same = listeners(&[metrics, "--health-addr=0.0.0.0:9830"]);
        assert_eq!(same, [("0.0.0.0:9830".into(), all)]);
    }
}
