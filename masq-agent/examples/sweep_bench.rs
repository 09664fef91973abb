//! What one sweep of the NAT table costs the agent, at the table sizes a node reaches: the
//! table filled through the real egress program (a SYN per flow, both halves inserted), then
//! swept as the agent sweeps it, twice with nothing to expire and once with every flow expired;
//! by the sweep program in the kernel, and in userspace (older kernels), in turn. Three
//! quarters full, the table is under pressure, and each sweep points its drop sample too. One
//! JSON line per table size and sweeper, for `cargo xtask bench`.

use std::{net::Ipv4Addr, time::Instant};

use anyhow::{Context as _, bail};
use masq_agent::dataplane::NatUsage;
use masq_agent::dataplane::ebpf::{
    EbpfOptions,
    expiry::{self, Timeouts},
    flow_table,
    testbed::{TC_ACT_OK, TestBed},
};
use masq_ebpf::Counter;
use masq_testbed::packet::{self, SYN};

const NODE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// The first of the pods the flows come from, 50 000 flows each.
const FIRST_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const FLOWS_PER_POD: u32 = 50_000;

fn main() -> anyhow::Result<()> {
    // A quarter and three quarters of the default table (524 288 entries, two a flow).
    let mut flows: Vec<u32> = vec![65_536, 196_608];
    let mut rounds = 3;
    for (arg, value) in masq_testbed::flag_pairs()? {
        match arg.as_str() {
            "--flows" => flows = value.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--rounds" => rounds = value.parse()?,
            _ => bail!("unknown argument {arg}"),
        }
    }
    let timeouts = Timeouts::default();
    for &count in &flows {
        let mut bed = TestBed::configured(
            TestBed::like_the_agents(EbpfOptions::DEFAULT_NAT_CAPACITY, 0)?,
            &[(1024, 65535)],
            true,
            NODE,
            &["10.0.0.0/8".parse()?],
        )?;
        let mut samples: [Samples; 2] = Default::default();
        for _ in 0..rounds {
            for (sweeper, samples) in SWEEPERS.iter().zip(&mut samples) {
                let held = fill(&mut bed, count)?;
                // Every flow a SYN just sent: none has been idle for its timeout. Swept twice:
                // the second sweep finds the table as the first left it.
                let now = flow_table::monotonic_now_ns();
                for sweeps in [&mut samples.none_over, &mut samples.none_over_again] {
                    let started = Instant::now();
                    let run = sweeper.sweep(&mut bed, &timeouts, now)?;
                    sweeps.push(started.elapsed().as_secs_f64() * 1e3);
                    if run.expired_flows != 0 || run.entries != 2 * held {
                        bail!("a {} sweep of fresh flows expired {run:?}", sweeper.name());
                    }
                }
                // Past every flow's timeout: all of them go.
                let later = now + 2 * timeouts.tcp_syn_sent.as_nanos() as u64;
                let started = Instant::now();
                let run = sweeper.sweep(&mut bed, &timeouts, later)?;
                samples.all_over.push(started.elapsed().as_secs_f64() * 1e3);
                if run.expired_flows != held {
                    bail!("a {} sweep of idle flows expired {run:?}", sweeper.name());
                }
            }
        }
        for (sweeper, samples) in SWEEPERS.iter().zip(samples) {
            println!(
                "{}",
                serde_json::json!({
                    "flows": count,
                    "sweeper": sweeper.name(),
                    "none_expired_ms": median(samples.none_over.clone()),
                    "none_expired_again_ms": median(samples.none_over_again.clone()),
                    "all_expired_ms": median(samples.all_over.clone()),
                    "none_expired_samples": samples.none_over,
                    "none_expired_again_samples": samples.none_over_again,
                    "all_expired_samples": samples.all_over,
                })
            );
        }
    }
    Ok(())
}

/// Each round's ms, per sweeper: the sweep of fresh flows, the one after it, and the sweep of
/// the same flows all over.
#[derive(Default)]
struct Samples {
    none_over: Vec<f64>,
    none_over_again: Vec<f64>,
    all_over: Vec<f64>,
}

/// Who sweeps the table.
#[derive(Clone, Copy)]
enum Sweeper {
    Kernel,
    Userspace,
}

const SWEEPERS: [Sweeper; 2] = [Sweeper::Kernel, Sweeper::Userspace];

impl Sweeper {
    fn name(self) -> &'static str {
        match self {
            Sweeper::Kernel => "kernel",
            Sweeper::Userspace => "userspace",
        }
    }

    /// One sweep as the agent makes it: with the drop sample, which a table under pressure
    /// refills.
    fn sweep(
        self,
        bed: &mut TestBed,
        timeouts: &Timeouts,
        now_ns: u64,
    ) -> anyhow::Result<NatUsage> {
        match self {
            Sweeper::Kernel => bed
                .expire_in_kernel::<[u8; 4]>(timeouts, now_ns)?
                .map(|(usage, _)| usage)
                .context("this kernel does not run the sweep program"),
            Sweeper::Userspace => {
                let sample = Some(&bed.maps.drop_samples.v4);
                expiry::expire(&bed.maps.nat.v4, sample, timeouts, now_ns)
            }
        }
    }
}

/// `count` new flows, each a SYN from a pod port of its own, to 200 remotes in turn: few
/// enough flows per remote that none runs short of node ports.
/// Sends the first packet of `count` flows, each of which must be masqueraded; how many the
/// table holds after: all but those a full table's early drop took for later ones (the slot
/// table's, where a half may go in two buckets only, does so a few times in 100 000 at three
/// quarters full).
fn fill(bed: &mut TestBed, count: u32) -> anyhow::Result<usize> {
    let dropped_before = bed.counter(Counter::NatEarlyDropped);
    for i in 0..count {
        let pod = Ipv4Addr::from(u32::from(FIRST_POD) + i / FLOWS_PER_POD);
        let sport = 1024 + (i % FLOWS_PER_POD) as u16;
        let remote = Ipv4Addr::new(198, 51, 100, (i % 200) as u8);
        let syn = packet::tcp(pod, sport, remote, 443, SYN);
        let (verdict, out) = bed.egress(&syn);
        if verdict != TC_ACT_OK || packet::src(&out) != NODE {
            bail!("flow {i} was not masqueraded");
        }
    }
    let dropped = bed.counter(Counter::NatEarlyDropped) - dropped_before;
    Ok(count as usize - dropped as usize)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
