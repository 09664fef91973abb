//! What reading the ports the node holds costs the agent, at every sweep: from the kernel's
//! socket diagnostics (what the agent reads) and from `/proc/net` (what it reads where the
//! kernel has none, and read before), in a namespace of its own, while another namespace on
//! the machine holds none or many connections: `/proc/net/tcp` walks every connection of every
//! namespace to list one namespace's. One JSON line per count of connections elsewhere, for
//! `cargo xtask bench`.
//!
//! Usage: node_ports_bench [--rounds N] [--connections 0,8000]

use std::{
    net::{Ipv4Addr, TcpListener, TcpStream},
    time::Instant,
};

use anyhow::bail;
use masq_agent::dataplane::ebpf::node_ports::NodePorts;
use masq_testbed::{netns, topology::Topology};

/// Reads per measurement: one read is tens of microseconds from the socket diagnostics.
const READS: u32 = 50;

fn main() -> anyhow::Result<()> {
    let mut rounds = 5;
    // The process's own limit on open files bounds the connections it can hold (two each).
    let mut counts: Vec<usize> = vec![0, 8_000];
    for (arg, value) in masq_testbed::flag_pairs()? {
        match arg.as_str() {
            "--rounds" => rounds = value.parse()?,
            "--connections" => {
                counts = value.split(',').map(str::parse).collect::<Result<_, _>>()?;
            }
            _ => bail!("unknown argument {arg}"),
        }
    }
    let topo = Topology::new(0)?;
    for &count in &counts {
        // Held open in the outside host's namespace while the node's ports are read.
        let _connections = netns::within(&topo.ext, move || connections(count))?;
        let (mut diagnostics, mut proc) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (by_diagnostics, by_proc) = netns::within(&topo.node, || {
                Ok((
                    mean_ms(|| Ok(NodePorts::from_socket_diagnostics(None)?))?,
                    mean_ms(|| Ok(NodePorts::from_proc(None)))?,
                ))
            })?;
            diagnostics.push(by_diagnostics);
            proc.push(by_proc);
        }
        println!(
            "{}",
            serde_json::json!({
                "connections_elsewhere": count,
                "diagnostics_ms": median(diagnostics.clone()),
                "proc_ms": median(proc.clone()),
                "diagnostics_samples": diagnostics,
                "proc_samples": proc,
            })
        );
    }
    Ok(())
}

/// `count` established loopback connections, both ends.
fn connections(count: usize) -> anyhow::Result<Vec<(TcpStream, TcpStream)>> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let at = listener.local_addr()?;
    (0..count)
        .map(|_| {
            let client = TcpStream::connect(at)?;
            Ok((client, listener.accept()?.0))
        })
        .collect()
}

/// The mean time of `READS` reads, in milliseconds, after checking that one read finds the
/// namespace holding nothing: the connections elsewhere are not its.
fn mean_ms(read: impl Fn() -> anyhow::Result<NodePorts>) -> anyhow::Result<f64> {
    if read()? != NodePorts::default() {
        bail!("the node's namespace holds ports it was never given");
    }
    let started = Instant::now();
    for _ in 0..READS {
        std::hint::black_box(read()?);
    }
    Ok(started.elapsed().as_secs_f64() * 1e3 / f64::from(READS))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
