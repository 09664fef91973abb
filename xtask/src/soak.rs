//! `cargo xtask soak`: many concurrent flows from many pods through the eBPF data plane for
//! minutes, UDP ones moving to new ports as they go, so that expiry runs under load. Every flow echoes a payload that names it, so a reply that reaches the wrong socket
//! (a translation handed to two live flows, say) shows as a mismatch. The agent's memory and
//! the NAT table are sampled as it goes. Not a CI test: it takes minutes and a lot of sockets.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use masq_testbed::{load, netns, prefixes, topology, write_config};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpStream, UdpSocket},
    time::{sleep, timeout},
};

use crate::{
    bench::{Bed, proc_status_kib},
    bench_plan::Mode,
    node_tables::Family,
    step,
};

#[derive(clap::Args)]
pub struct Options {
    /// How long the flows run.
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// Concurrent flows in all, one in ten of them TCP.
    #[arg(long, default_value_t = 100_000)]
    flows: usize,
}

/// Pods the flows come from, one process each: every pod has its own port space, and every
/// process its own open-file limit, which a container may not let even root raise.
const PODS: usize = 8;
/// Each flow sends its payload this often: far inside the NAT timeouts, so that no flow expires
/// while it lives.
const PERIOD: Duration = Duration::from_secs(20);
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// A UDP flow moves to a new source port after this many rounds, so that the NAT table keeps
/// gaining flows and expiring idle ones (after 120 s) all through the run, while staying under
/// its capacity: 90 000 live flows plus those of the last 120 s.
const UDP_ROUNDS_PER_PORT: u64 = 10;
const SAMPLE_EVERY: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Tally {
    echoed: AtomicU64,
    lost: AtomicU64,
    /// Replies that came back to a flow with another flow's payload.
    crossed: AtomicU64,
}

/// One pod's share of the soak, run as a process of its own by `run`.
#[derive(clap::Args)]
pub struct PodOptions {
    #[arg(long)]
    pod: String,
    #[arg(long)]
    index: usize,
    #[arg(long)]
    flows: usize,
    #[arg(long)]
    seconds: u64,
}

/// Runs one pod's flows and prints their tally as JSON.
pub fn run_pod(options: &PodOptions) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(options.seconds);
    let tally = Arc::new(Tally::default());
    pod_flows(&options.pod, options.index, options.flows, deadline, &tally)?;
    println!(
        "{}",
        serde_json::json!({
            "echoed": tally.echoed.load(Ordering::Relaxed),
            "lost": tally.lost.load(Ordering::Relaxed),
            "crossed": tally.crossed.load(Ordering::Relaxed),
        })
    );
    Ok(())
}

pub fn run(options: &Options) -> anyhow::Result<()> {
    step(
        "cargo",
        &["build", "--release", "--package", "masq-agent", "--bins"],
    )?;
    let agent_bin = masq_testbed::workspace_root().join("target/release/masq-agent");
    let bed = Bed::new(&agent_bin, PODS, Family::IPV4)?;
    write_config(&bed.config, &prefixes::config(4))?;
    let agent = bed
        .activate(Mode::Ebpf, 4)?
        .context("the eBPF data plane runs an agent")?;
    let pid = agent.child.id();
    let seconds = options.minutes * 60;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let per_pod = options.flows / PODS;
    let me = std::env::current_exe()?;
    let children = bed
        .topo
        .pods
        .iter()
        .enumerate()
        .map(|(index, pod)| {
            std::process::Command::new(&me)
                .args(["soak-pod", "--pod", pod])
                .args(["--index", &index.to_string()])
                .args(["--flows", &per_pod.to_string()])
                .args(["--seconds", &seconds.to_string()])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .context("starting a pod's flows")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    eprintln!(
        "xtask: soak: {} flows from {PODS} pods for {} min",
        per_pod * PODS,
        options.minutes
    );
    println!("| minute | agent RSS MiB | NAT flows | NAT entries | drops |");
    println!("|---:|---:|---:|---:|---:|");
    let started = Instant::now();
    let mut rss = Vec::new();
    while Instant::now() < deadline {
        std::thread::sleep(SAMPLE_EVERY.min(deadline.saturating_duration_since(Instant::now())));
        let status = status(&bed, &agent_bin)?;
        let ebpf = &status["ebpf"];
        let drops: u64 = ebpf["counters"]
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(name, _)| name.starts_with("dropped"))
            .filter_map(|(_, v)| v.as_u64())
            .sum();
        let mib = proc_status_kib(pid, "VmRSS")? / 1024.0;
        rss.push(mib);
        println!(
            "| {:.1} | {mib:.1} | {} | {} | {drops} |",
            started.elapsed().as_secs_f64() / 60.0,
            ebpf["nat"]["ipv4"]["pod_flows"],
            ebpf["nat"]["ipv4"]["entries"],
        );
    }
    let tally = Tally::default();
    for child in children {
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("a pod's flows failed: {}", out.status);
        }
        let counts: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        for (name, counter) in [
            ("echoed", &tally.echoed),
            ("lost", &tally.lost),
            ("crossed", &tally.crossed),
        ] {
            counter.fetch_add(counts[name].as_u64().unwrap_or(0), Ordering::Relaxed);
        }
    }
    verdict(&tally, &rss)
}

/// Fails the soak on any crossed reply, on more than one reply in a thousand lost, or on an
/// agent that kept growing in the second half of the run.
fn verdict(tally: &Tally, rss: &[f64]) -> anyhow::Result<()> {
    let (echoed, lost, crossed) = (
        tally.echoed.load(Ordering::Relaxed),
        tally.lost.load(Ordering::Relaxed),
        tally.crossed.load(Ordering::Relaxed),
    );
    println!("echoed {echoed}, lost {lost}, crossed {crossed}");
    if crossed > 0 {
        bail!("{crossed} replies reached a flow other than their own");
    }
    if lost * 1000 > echoed {
        bail!("{lost} of {} replies lost", echoed + lost);
    }
    // The agent's memory follows the NAT table's size (a sweep reads the table whole), which
    // doubles in the first minutes as UDP flows move ports: from the middle of the run on, with
    // the table through a whole cycle, it must stay put.
    if let (Some(middle), Some(end)) = (rss.get(rss.len() / 2), rss.last())
        && *end > middle * 1.1 + 1.0
    {
        bail!("the agent grew from {middle:.1} to {end:.1} MiB in the second half");
    }
    Ok(())
}

fn status(bed: &Bed, agent: &Path) -> anyhow::Result<serde_json::Value> {
    let bpffs = format!("--bpffs={}", bed.topo.bpffs.display());
    let out = bed
        .topo
        .node_command(agent.to_str().context("path")?)
        .args(["status", "--json", &bpffs])
        .env("PATH", bed.path_env("nft"))
        .output()?;
    if !out.status.success() {
        bail!("status: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// One pod's flows, nine in ten UDP and the rest TCP, on an event loop in the pod's namespace.
fn pod_flows(
    pod: &str,
    index: usize,
    flows: usize,
    deadline: Instant,
    tally: &Arc<Tally>,
) -> anyhow::Result<()> {
    netns::enter(pod)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async {
        let server = topology::EXT_ADDR;
        let mut tasks = Vec::new();
        for flow in 0..flows {
            let name = format!("pod{index}-flow{flow}");
            // Spread the first sends over a period, so that the flows do not move in step.
            let offset = PERIOD.mul_f64(flow as f64 / flows as f64);
            let tally = tally.clone();
            tasks.push(tokio::task::spawn_local(async move {
                sleep(offset).await;
                if flow % 10 == 0 {
                    let port = load::rr_port(0);
                    tcp_flow(&name, (server, port).into(), deadline, &tally).await
                } else {
                    let port = load::udp_port(0, flow as u64);
                    udp_flow(&name, (server, port).into(), deadline, &tally).await
                }
            }));
        }
        for task in tasks {
            task.await??;
        }
        anyhow::Ok(())
    })
}

fn record(tally: &Tally, sent: &[u8], got: Option<&[u8]>) {
    let counter = match got {
        None => &tally.lost,
        Some(reply) if reply == sent => &tally.echoed,
        Some(_) => &tally.crossed,
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

async fn udp_flow(
    name: &str,
    server: SocketAddr,
    deadline: Instant,
    tally: &Tally,
) -> anyhow::Result<()> {
    let mut socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
    let mut seq = 0u64;
    let mut buf = [0u8; 128];
    while Instant::now() < deadline {
        if seq > 0 && seq.is_multiple_of(UDP_ROUNDS_PER_PORT) {
            // A new source port, a new flow: the old one is left for the sweep to expire.
            socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
        }
        let payload = format!("{name}-{seq}");
        socket.send_to(payload.as_bytes(), server).await?;
        let reply = timeout(REPLY_TIMEOUT, socket.recv_from(&mut buf)).await;
        let got = match &reply {
            Ok(Ok((n, _))) => Some(&buf[..*n]),
            _ => None,
        };
        record(tally, payload.as_bytes(), got);
        seq += 1;
        sleep(PERIOD).await;
    }
    Ok(())
}

async fn tcp_flow(
    name: &str,
    server: SocketAddr,
    deadline: Instant,
    tally: &Tally,
) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(server)
        .await
        .with_context(|| format!("{name}: connecting"))?;
    let mut seq = 0u64;
    while Instant::now() < deadline {
        // The server echoes byte by byte; one byte that names the round is enough to tell.
        let payload = [(seq % 251) as u8];
        stream.write_all(&payload).await?;
        let mut reply = [0u8; 1];
        let got = timeout(REPLY_TIMEOUT, stream.read_exact(&mut reply)).await;
        record(
            tally,
            &payload,
            matches!(got, Ok(Ok(_))).then_some(&reply[..]),
        );
        seq += 1;
        sleep(PERIOD).await;
    }
    Ok(())
}
