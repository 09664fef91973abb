//! The data path in isolation: the real object through BPF_PROG_TEST_RUN, per packet kind and
//! table size. Run by `cargo xtask bench`, which turns the JSON it prints into the report.
//!
//! Every size's bed is set up first, and each round then runs every case at every size, so
//! that the machine's drift, which can change every figure by half within minutes here, hits
//! the sizes the report compares alike.
//!
//! Every measurement is the mean of many single runs (`repeat` = 1), each timed by the kernel:
//! with a larger `repeat` the kernel runs the program again on the packet it already rewrote,
//! so a translating case would measure something else from its second run on.
//!
//! With `--cold-predictors KIB`, each run follows KIB KiB of code that jumps from each
//! instruction to the next (`PredictorFlush`): the CPU's branch predictors then hold none of
//! the program's branches, as after a packet's trip through the network stack end to end,
//! where BPF_PROG_TEST_RUN's loop keeps them trained (docs/bench/profiles.md, "A run end to
//! end, cold").
//!
//! Usage: datapath_bench [--runs N] [--rounds N] [--sizes 4,10000,100000] [--cold-predictors KIB]

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::Instant,
};

use anyhow::bail;
use ipnet::{Ipv4Net, Ipv6Net};
use masq_agent::{
    dataplane::ebpf::{
        EbpfOptions, map_types,
        node_ports::{self, HeldPorts, NodePorts},
        testbed::{TC_ACT_OK, TestBed},
    },
    policy::{Action, IpFamily, Rules},
    ports::PortRange,
};
use masq_ebpf::program_names;
use masq_testbed::packet::{self, ACK, L4, SYN, word};

const NODE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const REMOTE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const CLUSTER: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const NODE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
const POD_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
const REMOTE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);
const CLUSTER_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 10);
/// A service of the node's on a port inside NAT's spans (the kubelet's).
const SERVICE_PORT: u16 = 10250;
/// The /24 of the new-flow cases' remotes, whose flows expire after each of those cases.
const NEW_FLOW_REMOTES: [u8; 3] = [198, 51, 100];
const NEW_FLOW_REMOTES_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0);
/// The spread case's remotes, 203.0.113.128 and the 99 after it (clear of `NODE` and
/// `REMOTE`), whose flows expire once the cases that run beside them are done.
const SPREAD_REMOTES: (Ipv4Addr, u32) = (Ipv4Addr::new(203, 0, 113, 128), 100);
const SPREAD_CASE: &str = "snat_established_spread";

struct Options {
    runs: u32,
    rounds: usize,
    sizes: Vec<usize>,
    capacity: u32,
    /// Only the cases named, for a profile of one of them; every case when empty.
    cases: Vec<String>,
    /// KiB of jumps run before each run (`PredictorFlush`); none when 0.
    cold_predictors_kib: usize,
}

fn options() -> anyhow::Result<Options> {
    let mut opts = Options {
        runs: 100_000,
        rounds: 5,
        sizes: vec![4, 10_000, 100_000],
        capacity: EbpfOptions::DEFAULT_NAT_CAPACITY,
        cases: Vec::new(),
        cold_predictors_kib: 0,
    };
    for (arg, value) in masq_testbed::flag_pairs()? {
        match arg.as_str() {
            "--runs" => opts.runs = value.parse()?,
            "--rounds" => opts.rounds = value.parse()?,
            "--sizes" => opts.sizes = value.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--capacity" => opts.capacity = value.parse()?,
            "--cases" => opts.cases = value.split(',').map(String::from).collect(),
            "--cold-predictors" => opts.cold_predictors_kib = value.parse()?,
            _ => bail!("unknown argument {arg}"),
        }
    }
    Ok(opts)
}

/// The benchmark's policies (`masq_testbed::prefixes`' `random` and `random_v6`), as the tries
/// hold them.
fn parsed<N: std::str::FromStr<Err: std::fmt::Debug>>(prefixes: Vec<String>) -> Vec<N> {
    prefixes
        .iter()
        .map(|p| p.parse().expect("generated prefixes parse"))
        .collect()
}

/// The mean kernel-measured time of `runs` single runs over `frames` in turn, after checking
/// that the case does what its name says.
fn mean_ns(
    bed: &mut TestBed,
    name: &str,
    program: &str,
    frames: &[Vec<u8>],
    runs: u32,
    flush: Option<&PredictorFlush>,
) -> anyhow::Result<f64> {
    let first = bed.run(program, &frames[0], 1)?;
    let translated = first.frame != frames[0];
    let should_translate = matches!(
        name,
        "snat_established"
            | SPREAD_CASE
            | "snat_new_flow"
            | SOURCES_CASE
            | "rev_snat"
            | "snat_established_v6"
            | "snat_new_flow_v6"
    );
    if first.verdict != TC_ACT_OK || translated != should_translate {
        bail!(
            "case {name}: verdict {}, translated {translated}",
            first.verdict
        );
    }
    let mut total = first.duration;
    for i in 1..runs {
        let frame = &frames[i as usize % frames.len()];
        if let Some(flush) = flush {
            flush.run();
        }
        total += bed.run(program, frame, 1)?.duration;
    }
    Ok(total.as_secs_f64() * 1e9 / f64::from(runs))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The case of a new flow in a family with source entries, and the one entry it has: sources
/// left alone elsewhere than the pods.
const SOURCES_CASE: &str = "snat_new_flow_sources";
const SOURCE_ELSEWHERE: &str = "192.0.2.0/24";

/// Gives IPv4 the source entries `left_alone`, none when empty, as the agent gives them, and
/// checks for flows that outlived the change as the agent does once its grace is over. A trie
/// change clears the programs' word that no flow did (`strays_cleared`): left so, every later
/// packet to a destination the policy leaves alone would be looked up in the NAT table, which a
/// settled node's are not, and the cases after this one would measure that path instead.
fn set_sources(bed: &mut TestBed, left_alone: &[&str]) -> anyhow::Result<()> {
    let rules: Rules = left_alone
        .iter()
        .map(|net| Ok((net.parse()?, Action::NonMasquerade)))
        .collect::<anyhow::Result<_>>()?;
    let maps = &mut bed.maps;
    maps.policy
        .set_source_rules(IpFamily::Ipv4, &rules, &mut maps.settings)?;
    if !bed.clear_strays()? {
        bail!("a flow outlived the source entries' change");
    }
    Ok(())
}

/// Holds `SERVICE_PORT` for the node as the agent does once the port has been held a while and
/// a sweep found no entry on it, nor any outside the spans.
fn hold_node_service(bed: &mut TestBed, spans: &[PortRange]) -> anyhow::Result<()> {
    let service = NodePorts {
        tcp: [SERVICE_PORT].into(),
        ..NodePorts::default()
    };
    let mut held = HeldPorts::default();
    held.outside_spans_entryless(spans);
    held.hold(bed.port_maps(), service.clone())?;
    held.hold(bed.port_maps(), service)?;
    let seen = bed.node_side_ports(spans);
    let (settled, later) = (Instant::now(), Instant::now() + 2 * node_ports::GRACE);
    held.mark_entryless(&mut bed.maps.entryless_ports, &seen, later, Some(settled))
}

/// The cases, each a name, the program it runs and the frames it runs in turn.
type Cases = [(&'static str, &'static str, Vec<Vec<u8>>); CASES];
const CASES: usize = 15;

/// The frames every size's cases share.
struct Frames {
    outbound: Vec<u8>,
    to_cluster: Vec<u8>,
    outbound_v6: Vec<u8>,
    to_cluster_v6: Vec<u8>,
    across_cluster_v6: Vec<Vec<u8>>,
    across_cluster: Vec<Vec<u8>>,
    from_cluster: Vec<Vec<u8>>,
    new_flows: Vec<Vec<u8>>,
    new_flows_v6: Vec<Vec<u8>>,
    /// The spread case's flows: the SYN that opens each, and the ACK the case sends.
    spread_opened: Vec<Vec<u8>>,
    spread: Vec<Vec<u8>>,
    arp: Vec<u8>,
}

impl Frames {
    /// `capacity` is the table's, in entries: the spread case's flows fill half of it, two
    /// entries a flow, less what `runs` new flows take.
    fn new(runs: u32, capacity: u32) -> Frames {
        let outbound = packet::tcp(POD, 40000, REMOTE, 80, ACK);
        // More cluster addresses than the per-CPU verdict cache has slots: most runs ask the
        // policy anew, each run's address another's.
        let cluster_addr = |i: u16| {
            let [a, b] = i.to_be_bytes();
            Ipv4Addr::new(10, 96, a, b)
        };
        let across_cluster = (0..=u16::MAX)
            .map(|i| packet::tcp(POD, 40002, cluster_addr(i), 443, ACK))
            .collect();
        // The pod's flows toward those addresses coming back (the same packets as other nodes'
        // pods connecting send): were they looked up, each run's NAT bucket another's.
        let from_cluster = (0..=u16::MAX)
            .map(|i| packet::tcp(cluster_addr(i), 443, POD, 40002, ACK))
            .collect();
        // A flow of its own per run, to remotes enough that none runs out of ports: every run
        // takes the path of a connection's first packet, into a table as large as the agent's.
        let new_flows = (0..runs)
            .map(|i| {
                let pod = Ipv4Addr::from(u32::from(POD) + i / 50_000);
                let sport = 1024 + (i % 50_000) as u16;
                let remote = Ipv4Addr::new(
                    NEW_FLOW_REMOTES[0],
                    NEW_FLOW_REMOTES[1],
                    NEW_FLOW_REMOTES[2],
                    (i % 200) as u8,
                );
                packet::tcp(pod, sport, remote, 80, SYN)
            })
            .collect();
        // The same in IPv6, each run's remote one of 200 in the documentation's range.
        let new_flows_v6 = (0..runs)
            .map(|i| {
                let pod = Ipv6Addr::from(u128::from(POD_V6) + u128::from(i / 50_000));
                let sport = 1024 + (i % 50_000) as u16;
                let remote = Ipv6Addr::from(u128::from(NEW_FLOW_REMOTES_V6) + u128::from(i % 200));
                packet::tcp(pod, sport, remote, 80, SYN)
            })
            .collect();
        let spread_flow = |i: u32, flags: u8| {
            let pod = Ipv4Addr::from(u32::from(POD) + 8 + i / 50_000);
            let sport = 1024 + (i % 50_000) as u16;
            let (first, count) = SPREAD_REMOTES;
            let remote = Ipv4Addr::from(u32::from(first) + i % count);
            packet::tcp(pod, sport, remote, 443, flags)
        };
        // Half the table, less half of what a new-flow case adds: through such a case's runs,
        // one flow each, the table is half full on average, as issue 27 measures a first
        // packet, where filling it from half full would end it nearer full.
        let spread_flows = masq_testbed::spread_flows(runs, capacity);
        let spread_opened = (0..spread_flows).map(|i| spread_flow(i, SYN)).collect();
        let spread = (0..spread_flows).map(|i| spread_flow(i, ACK)).collect();
        let mut arp = outbound.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        Frames {
            to_cluster: packet::tcp(POD, 40001, CLUSTER, 443, ACK),
            outbound,
            outbound_v6: packet::tcp(POD_V6, 40000, REMOTE_V6, 80, ACK),
            to_cluster_v6: packet::tcp(POD_V6, 40001, CLUSTER_V6, 443, ACK),
            // As `across_cluster`: more destinations than IPv6's verdict cache has slots.
            across_cluster_v6: (0..=u16::MAX)
                .map(|i| {
                    let dst = Ipv6Addr::from(u128::from(CLUSTER_V6) + (u128::from(i) << 16));
                    packet::tcp(POD_V6, 40002, dst, 443, ACK)
                })
                .collect(),
            across_cluster,
            from_cluster,
            new_flows,
            new_flows_v6,
            spread_opened,
            spread,
            arp,
        }
    }
}

/// One size of the policy: its bed, set up as the agent's first sweep finds the tables, and
/// its cases.
struct Size {
    prefixes: usize,
    bed: TestBed,
    fill: std::time::Duration,
    cases: Cases,
}

impl Size {
    fn new(count: usize, opts: &Options, frames: &Frames) -> anyhow::Result<Size> {
        let spans = [(1024, 65535)];
        let span_ranges = spans.map(|(first, last)| PortRange { first, last });
        let started = Instant::now();
        // The decision counters sized for both families' policies, as the agent sizes them.
        let bed = TestBed::like_the_agents(opts.capacity, 2 * count)?;
        let mut bed = TestBed::configured(
            bed,
            &spans,
            true,
            NODE,
            &parsed::<Ipv4Net>(masq_testbed::prefixes::random(count)),
        )?;
        let fill = started.elapsed();
        // Establish the flow, and learn its port for the reply.
        let (verdict, translated) = bed.egress(&frames.outbound);
        if verdict != TC_ACT_OK || packet::src(&translated) != NODE {
            bail!("the benchmark flow was not masqueraded");
        }
        let reply = packet::tcp(REMOTE, 80, NODE, word(&translated, L4), ACK);
        // IPv6 with a policy of as many prefixes, which has no index.
        bed.enable_ipv6(
            NODE_V6,
            &parsed::<Ipv6Net>(masq_testbed::prefixes::random_v6(count)),
        )?;
        let (verdict, translated) = bed.egress(&frames.outbound_v6);
        if verdict != TC_ACT_OK || packet::src6(&translated) != NODE_V6 {
            bail!("the benchmark's IPv6 flow was not masqueraded");
        }
        // As the agent's first sweep finds the tables: no flow outlived the policy.
        if !bed.clear_strays()? {
            bail!("a flow outlived the benchmark's policy");
        }
        // A packet to the node on a port outside the spans, and one to a service of the node's
        // on a port inside them, held a while: neither is looked up, once the agent's first
        // sweep found no entry on them.
        hold_node_service(&mut bed, &span_ranges)?;
        let to_node = packet::tcp(REMOTE, 80, NODE, 22, ACK);
        let to_service = packet::tcp(REMOTE, 40000, NODE, SERVICE_PORT, ACK);
        let one = |frame: &Vec<u8>| vec![frame.clone()];
        let (egress, ingress) = (program_names::EGRESS, program_names::INGRESS);
        let cases = [
            ("non_masq_hit", egress, one(&frames.to_cluster)),
            ("non_masq_uncached", egress, frames.across_cluster.clone()),
            ("snat_established", egress, one(&frames.outbound)),
            // A known flow among many, each run another's: its bucket and entry are cold, as
            // they are for most packets on a busy node.
            (SPREAD_CASE, egress, frames.spread.clone()),
            ("snat_new_flow", egress, frames.new_flows.clone()),
            // The same first packets while the family has source entries, none of which holds
            // the pods: what asking the source trie adds to a new flow.
            (SOURCES_CASE, egress, frames.new_flows.clone()),
            ("rev_snat", ingress, one(&reply)),
            ("ingress_no_flow", ingress, one(&to_node)),
            ("ingress_node_service", ingress, one(&to_service)),
            ("ingress_from_cluster", ingress, frames.from_cluster.clone()),
            ("non_masq_hit_v6", egress, one(&frames.to_cluster_v6)),
            (
                "non_masq_uncached_v6",
                egress,
                frames.across_cluster_v6.clone(),
            ),
            ("snat_established_v6", egress, one(&frames.outbound_v6)),
            // IPv6's first packets, into a table that holds the case's own flows alone: the
            // spread case's are IPv4's.
            ("snat_new_flow_v6", egress, frames.new_flows_v6.clone()),
            ("ignored_floor", egress, one(&frames.arp)),
        ];
        Ok(Size {
            prefixes: count,
            bed,
            fill,
            cases,
        })
    }

    /// One round of the cases `opts` asks for, a sample each into `samples`.
    fn round(
        &mut self,
        opts: &Options,
        shared: &Frames,
        flush: Option<&PredictorFlush>,
        samples: &mut [Vec<f64>],
    ) -> anyhow::Result<()> {
        let bed = &mut self.bed;
        let mut spread_held = false;
        for (i, (name, program, frames)) in self.cases.iter().enumerate() {
            if !opts.cases.is_empty() && !opts.cases.iter().any(|c| c == name) {
                continue;
            }
            let holds = runs_beside_spread_flows(name);
            if holds && !spread_held {
                open_spread_flows(bed, shared)?;
            } else if !holds && spread_held {
                expire_spread_flows(bed)?;
            }
            spread_held = holds;
            let sources = *name == SOURCES_CASE;
            if sources {
                set_sources(bed, &[SOURCE_ELSEWHERE])?;
            }
            let full_before = map_types::full_table_drops(&bed.maps.counters);
            samples[i].push(mean_ns(bed, name, program, frames, opts.runs, flush)?);
            if map_types::full_table_drops(&bed.maps.counters) != full_before {
                bail!(
                    "case {name}: the NAT table filled, and the case measured early drops: \
                     fewer --runs, or a larger --capacity"
                );
            }
            if sources {
                set_sources(bed, &[])?;
            }
            // Their flows expire, so that the other cases find the table as they left it.
            if makes_new_flows(name) {
                expire_flows_with(bed, |a| a.octets()[..3] == NEW_FLOW_REMOTES)?;
                let remotes_v6 =
                    u128::from(NEW_FLOW_REMOTES_V6)..u128::from(NEW_FLOW_REMOTES_V6) + 200;
                bed.expire_nat::<[u8; 16]>(|key| {
                    [key.saddr, key.daddr]
                        .into_iter()
                        .any(|a| remotes_v6.contains(&u128::from_be_bytes(a)))
                })?;
            }
        }
        // So that the other cases, and the next round, find the table with one flow: a lookup
        // that misses walks every entry in its bucket.
        if spread_held {
            expire_spread_flows(bed)?;
        }
        Ok(())
    }
}

/// The cases that run while the spread case's flows fill the table: that case, and a flow's
/// first packet, which issue 27 measures in a table half full, where a new flow's
/// inserts meet other flows in their buckets as on a busy node.
fn runs_beside_spread_flows(name: &str) -> bool {
    name == SPREAD_CASE || makes_new_flows(name)
}

/// The cases whose every run makes a flow of its own: `snat_new_flow`, `SOURCES_CASE` and
/// `snat_new_flow_v6`.
fn makes_new_flows(name: &str) -> bool {
    name.starts_with("snat_new_flow")
}

/// Opens the spread case's flows and sends each pod's ACK once, so that each measured ACK
/// finds its flow as `snat_established`'s does, with nothing left to write in it.
fn open_spread_flows(bed: &mut TestBed, frames: &Frames) -> anyhow::Result<()> {
    for (syn, ack) in frames.spread_opened.iter().zip(&frames.spread) {
        let (verdict, out) = bed.egress(syn);
        if verdict != TC_ACT_OK || packet::src(&out) != NODE {
            bail!("a flow of {SPREAD_CASE} was not masqueraded");
        }
        bed.egress(ack);
    }
    Ok(())
}

fn expire_spread_flows(bed: &mut TestBed) -> anyhow::Result<()> {
    let (first, count) = SPREAD_REMOTES;
    let first = u32::from(first);
    expire_flows_with(bed, |a| (first..first + count).contains(&u32::from(a)))
}

/// Expires the flows one of whose ends `remote` picks.
fn expire_flows_with(bed: &mut TestBed, remote: impl Fn(Ipv4Addr) -> bool) -> anyhow::Result<()> {
    bed.expire_nat::<[u8; 4]>(|key| {
        [key.saddr, key.daddr]
            .into_iter()
            .any(|a| remote(Ipv4Addr::from(a)))
    })
}

fn main() -> anyhow::Result<()> {
    let opts = options()?;
    let frames = Frames::new(opts.runs, opts.capacity);
    let mut sizes = opts
        .sizes
        .iter()
        .map(|&count| Size::new(count, &opts, &frames))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let flush = match opts.cold_predictors_kib {
        0 => None,
        kib => Some(PredictorFlush::new(kib)?),
    };
    let mut samples = vec![vec![Vec::new(); CASES]; sizes.len()];
    // Interleaved, the sizes as the cases, so that a noisy moment hits every one alike: the
    // report compares the sizes with each other.
    for _ in 0..opts.rounds {
        for (size, samples) in sizes.iter_mut().zip(&mut samples) {
            size.round(&opts, &frames, flush.as_ref(), samples)?;
        }
    }
    for (size, samples) in sizes.iter().zip(samples) {
        for ((name, _, _), values) in size.cases.iter().zip(samples) {
            if values.is_empty() {
                continue;
            }
            println!(
                "{}",
                serde_json::json!({
                    "case": name,
                    "prefixes": size.prefixes,
                    "ns_per_packet": median(values.clone()),
                    "samples": values,
                    "runs": opts.runs,
                    "table_fill_ms": size.fill.as_secs_f64() * 1e3,
                })
            );
        }
    }
    Ok(())
}

/// Code that leaves the CPU's branch predictors without the program's branches: `kib` KiB of
/// two-byte jumps, each to the next instruction, then a return, run before each run of a
/// program. Every jump is a branch the predictors must make room for, some 500 a KiB, where the
/// predictors of a core hold some thousands. The same amount of code without branches (two-byte
/// no-ops) leaves the instruction cache as cold, and costs the program a tenth as much.
struct PredictorFlush {
    code: *mut libc::c_void,
    len: usize,
}

/// A short jump to the next instruction (`jmp rel8` with 0), and a near return.
const JUMP_TO_NEXT: [u8; 2] = [0xeb, 0x00];
const RETURN: u8 = 0xc3;

impl PredictorFlush {
    fn new(kib: usize) -> anyhow::Result<PredictorFlush> {
        if !cfg!(target_arch = "x86_64") {
            bail!("--cold-predictors writes x86-64 code");
        }
        let len = kib * 1024 + 1;
        // SAFETY: a fresh private anonymous mapping, checked before use.
        let code = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if code == libc::MAP_FAILED {
            bail!("mmap: {}", std::io::Error::last_os_error());
        }
        let flush = PredictorFlush { code, len };
        // SAFETY: the mapping is `len` bytes, writable, and this process's alone.
        let bytes = unsafe { std::slice::from_raw_parts_mut(code.cast::<u8>(), len) };
        for jump in bytes[..len - 1].chunks_exact_mut(JUMP_TO_NEXT.len()) {
            jump.copy_from_slice(&JUMP_TO_NEXT);
        }
        bytes[len - 1] = RETURN;
        // SAFETY: the mapping above, made executable and no longer writable.
        if unsafe { libc::mprotect(code, len, libc::PROT_READ | libc::PROT_EXEC) } != 0 {
            bail!("mprotect: {}", std::io::Error::last_os_error());
        }
        Ok(flush)
    }

    fn run(&self) {
        // SAFETY: the mapping holds jumps that end at its return, and touches nothing else: a
        // function of the C ABI that takes and gives nothing.
        let code = unsafe { std::mem::transmute::<*mut libc::c_void, extern "C" fn()>(self.code) };
        code();
    }
}

impl Drop for PredictorFlush {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, unused from here on.
        unsafe { libc::munmap(self.code, self.len) };
    }
}
