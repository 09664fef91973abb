//! The real object with fresh, unpinned maps, driven through BPF_PROG_TEST_RUN: what the packet
//! tests and the data-path benchmark run against. The kernel's test runner runs tc programs on
//! the loopback device, so the node address is configured for ifindex 1.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use aya::{
    EbpfLoader, Pod,
    maps::IterableMap as _,
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use masq_ebpf::{Address, Counter, NatEntry, NatKey, SweepReport, program_names};

use super::{
    batch, decisions,
    expiry::Timeouts,
    flow_table::Table,
    interfaces::write_interfaces,
    kernel_sweep,
    load::{self, Programs, write_settings},
    map_types::{NatFamily, counter_total},
    maps::Maps,
    node_ports::NodeSidePorts,
    prefixes,
};
use crate::{
    dataplane::{chosen_address::ChosenAddresses, nat_usage::NatUsage},
    netdev::Device,
    policy::{IpFamilies, IpFamily},
    ports::PortRange,
};

/// The compiled object the agent embeds, for tests that load it by other means (bpftool).
pub fn object() -> &'static [u8] {
    load::OBJECT
}

/// The object built with the slot table, likewise.
pub fn slot_table_object() -> &'static [u8] {
    load::SLOT_TABLE_OBJECT
}

/// The ifindex BPF_PROG_TEST_RUN gives tc programs: loopback.
pub const TEST_RUN_IFINDEX: u32 = 1;

pub struct TestBed {
    programs: Programs,
    /// The object's maps, as the agent holds them.
    pub maps: Maps,
}

/// The programs' verdicts, as the test runner reports them (include/uapi/linux/pkt_cls.h):
/// the packet goes on, or is dropped.
pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;

/// A reply to a pod's flow: as it arrived, and as the pod got it.
pub struct Answered {
    pub arrived: Vec<u8>,
    pub restored: Vec<u8>,
}

/// One run of a program over a frame.
pub struct Run {
    pub verdict: u32,
    pub frame: Vec<u8>,
    /// Mean time per repetition, as the kernel measured it.
    pub duration: Duration,
}

thread_local! {
    /// Where this thread's beds keep the halves, if a test chose (`TestBed::in_table`): whether
    /// in the slot tables.
    static SLOT_TABLE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

impl TestBed {
    /// The object with both programs loaded and nothing configured: the halves where the agent
    /// would keep them here (`load::slot_table`), or where this thread chose (`in_table`).
    pub fn unconfigured(nat_entries: u32) -> anyhow::Result<TestBed> {
        TestBed::unconfigured_in(nat_entries, TestBed::chosen_table())
    }

    /// As `unconfigured`, but with a slot table as the agent makes it, with room to spare for
    /// `nat_entries` halves (`slot_table::buckets_for`), and the policy's maps sized as the
    /// agent sizes them for a policy of `policy_entries` prefixes: the benchmarks'.
    pub fn like_the_agents(nat_entries: u32, policy_entries: usize) -> anyhow::Result<TestBed> {
        let seeds = load::SlotSeeds::random()?;
        let sizes = load::NatSizes::new(nat_entries, nat_entries, TestBed::chosen_table(), seeds);
        let mut loader = EbpfLoader::new();
        load::size_the_policy_maps(&mut loader, policy_entries);
        TestBed::unconfigured_sized(loader, &sizes)
    }

    /// Whether this thread's beds keep the halves in the slot tables.
    fn chosen_table() -> bool {
        SLOT_TABLE.get().unwrap_or_else(load::slot_table)
    }

    /// What the programs stamp flows by, where the loader measured the kernel's tick.
    pub fn tick_clock(&self) -> Option<masq_ebpf::TickClock> {
        self.programs.tick_clock()
    }

    /// What the agent does to the tick at every sweep (`Programs::keep_the_tick`).
    pub fn keep_the_tick(&mut self) -> anyhow::Result<()> {
        self.programs.keep_the_tick()
    }

    /// Runs `f` with the beds this thread makes (`unconfigured`) keeping the halves in the slot
    /// tables, or in the hash tables: a test written for either table, run on one.
    pub fn in_table<T>(slot_table: bool, f: impl FnOnce() -> T) -> T {
        SLOT_TABLE.set(Some(slot_table));
        let result = f();
        SLOT_TABLE.set(None);
        result
    }

    /// As `unconfigured`, the halves in the slot tables or not, whatever the environment
    /// asks: for what only one of the tables has (the hash table's drop sample). A slot table
    /// holds `nat_entries` halves and no more (`NatSizes::with_slots_for_entries_alone`).
    pub fn unconfigured_in(nat_entries: u32, slot_table: bool) -> anyhow::Result<TestBed> {
        let sizes = load::NatSizes::new(
            nat_entries,
            nat_entries,
            slot_table,
            load::SlotSeeds::random()?,
        )
        .with_slots_for_entries_alone();
        let bed = TestBed::unconfigured_sized(EbpfLoader::new(), &sizes)?;
        bed.maps.nat.v4.limit_to(nat_entries)?;
        bed.maps.nat.v6.limit_to(nat_entries)?;
        Ok(bed)
    }

    /// The object loaded with its NAT tables of `sizes`, nothing configured.
    fn unconfigured_sized<'a>(
        mut loader: EbpfLoader<'a>,
        sizes: &'a load::NatSizes,
    ) -> anyhow::Result<TestBed> {
        sizes.set(&mut loader);
        let (programs, mut maps) = load::load(&mut loader, sizes, false)?;
        kernel_sweep::give_limits(&mut maps.sweep, &Timeouts::default())?;
        Ok(TestBed { programs, maps })
    }

    /// Configured as the agent would: ports, the node's address, and a policy.
    /// `spans` are the NAT ports, each `(first, last)`.
    pub fn new(
        nat_entries: u32,
        spans: &[(u16, u16)],
        random_fully: bool,
        node: Ipv4Addr,
        non_masq: &[Ipv4Net],
    ) -> anyhow::Result<TestBed> {
        TestBed::configured(
            TestBed::unconfigured(nat_entries)?,
            spans,
            random_fully,
            node,
            non_masq,
        )
    }

    /// `bed` (`unconfigured_in`'s) configured as `new` configures its own.
    pub fn configured(
        mut bed: TestBed,
        spans: &[(u16, u16)],
        random_fully: bool,
        node: Ipv4Addr,
        non_masq: &[Ipv4Net],
    ) -> anyhow::Result<TestBed> {
        let spans: Vec<PortRange> = spans
            .iter()
            .map(|&(first, last)| PortRange { first, last })
            .collect();
        write_settings(&mut bed.maps.settings, &spans, random_fully)?;
        let lo = Device {
            name: "lo".into(),
            index: TEST_RUN_IFINDEX,
            ipv4: node,
            ipv6: None,
        };
        write_interfaces(
            &mut bed.maps.interfaces,
            &[lo],
            IpFamilies::IPV4,
            ChosenAddresses::default(),
        )?;
        bed.maps.policy.set_non_masq(IpFamily::Ipv4, non_masq)?;
        Ok(bed)
    }

    /// Masquerades IPv6 too, to `node`, leaving alone destinations in `non_masq`.
    pub fn enable_ipv6(&mut self, node: Ipv6Addr, non_masq: &[Ipv6Net]) -> anyhow::Result<()> {
        let mut lo = Device {
            name: "lo".into(),
            index: TEST_RUN_IFINDEX,
            ipv4: Ipv4Addr::UNSPECIFIED,
            ipv6: Some(node),
        };
        if let Ok(current) = self.maps.interfaces.table.get(&TEST_RUN_IFINDEX, 0) {
            lo.ipv4 = Ipv4Addr::from(current.ipv4);
        }
        write_interfaces(
            &mut self.maps.interfaces,
            &[lo],
            IpFamilies::DUAL_STACK,
            ChosenAddresses::default(),
        )?;
        self.maps.policy.set_non_masq(IpFamily::Ipv6, non_masq)?;
        Ok(())
    }

    /// Runs `program` over `frame`, `repeat` times.
    pub fn run(&mut self, program: &str, frame: &[u8], repeat: u32) -> anyhow::Result<Run> {
        run_once(self.programs.named(program)?, frame, repeat)
    }

    /// The egress program's verdict and output frame, for one run.
    pub fn egress(&mut self, frame: &[u8]) -> (u32, Vec<u8>) {
        let run = self.run(program_names::EGRESS, frame, 1).expect("test run");
        (run.verdict, run.frame)
    }

    /// Sends `out` out (a pod's packet, which must be translated), then in the reply that
    /// `reply` builds to what left (which must be restored): the reply as it arrived, and as
    /// the pod got it.
    pub fn answered(&mut self, out: &[u8], reply: impl Fn(&[u8]) -> Vec<u8>) -> Answered {
        let (verdict, left) = self.egress(out);
        assert_eq!(verdict, TC_ACT_OK);
        assert_ne!(left, out, "the packet out was translated");
        let arrived = reply(&left);
        let (verdict, restored) = self.ingress(&arrived);
        assert_eq!(verdict, TC_ACT_OK);
        assert_ne!(restored, arrived, "the reply was restored");
        Answered { arrived, restored }
    }

    /// The egress program's verdict and output frame for each of `frames`, run on every one of
    /// `cpus` CPUs at once: each from a thread pinned to its CPU, over the frames in their order,
    /// so that the CPUs run the same frame at about the same moment. By CPU, then by frame.
    pub fn egress_on_cpus(&mut self, frames: &[Vec<u8>], cpus: usize) -> Vec<Vec<(u32, Vec<u8>)>> {
        let program = &*self
            .programs
            .named(program_names::EGRESS)
            .expect("the egress program");
        let start = std::sync::Barrier::new(cpus);
        std::thread::scope(|scope| {
            let runs: Vec<_> = (0..cpus)
                .map(|cpu| {
                    let start = &start;
                    scope.spawn(move || {
                        pin_to_cpu(cpu);
                        run_unpreempted();
                        start.wait();
                        frames
                            .iter()
                            .map(|frame| {
                                let run = run_once(program, frame, 1).expect("test run");
                                (run.verdict, run.frame)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            runs.into_iter()
                .map(|run| run.join().expect("a CPU's runs"))
                .collect()
        })
    }

    /// The ingress program's verdict and output frame, for one run.
    pub fn ingress(&mut self, frame: &[u8]) -> (u32, Vec<u8>) {
        let run = self
            .run(program_names::INGRESS, frame, 1)
            .expect("test run");
        (run.verdict, run.frame)
    }

    pub fn counter(&self, counter: Counter) -> u64 {
        counter_total(&self.maps.counters, counter)
    }

    /// What the policy entry for exactly `net` decided, as its counter says: `Some(None)` for
    /// an entry without a slot, `None` for no such entry.
    pub fn decisions_of(&self, net: IpNet) -> Option<Option<u64>> {
        let policy = &self.maps.policy;
        let entry = match net {
            IpNet::V4(net) => {
                let key = (u32::from(net.prefix_len()), net.network().octets());
                [&policy.v4.non_masq, &policy.src_v4.non_masq]
                    .into_iter()
                    .find_map(|trie| prefixes::entries(trie).get(&key).copied())
            }
            IpNet::V6(net) => {
                let key = (u32::from(net.prefix_len()), net.network().octets());
                [&policy.v6.non_masq, &policy.src_v6.non_masq]
                    .into_iter()
                    .find_map(|trie| prefixes::entries(trie).get(&key).copied())
            }
        }?;
        Some(decisions::count(&self.maps.policy.decisions, entry.counted_in).unwrap())
    }

    /// Every slot's decisions, read as kernels from 5.13 read them (in batches) and as older
    /// ones do (slot by slot).
    pub fn decisions_both_ways(&self) -> (Vec<u64>, Vec<u64>) {
        let map = self.maps.policy.decisions.map();
        let cpus = aya::util::nr_cpus().unwrap();
        (
            batch::per_cpu_totals_batched(map, cpus).unwrap(),
            batch::per_cpu_totals_by_slot(map, cpus).unwrap(),
        )
    }

    /// Makes the programs leave `ports` to the node, as the agent does for its listening
    /// sockets and NodePorts.
    pub fn hold_node_ports(&mut self, ports: &super::node_ports::NodePorts) {
        super::node_ports::write(&mut self.maps.node_ports, ports, &mut Vec::new()).unwrap();
    }

    /// The maps of the node's ports, for `node_ports::HeldPorts` to write as the agent does.
    pub fn port_maps(&mut self) -> super::node_ports::PortMaps<'_> {
        super::node_ports::PortMaps {
            held: &mut self.maps.node_ports,
            entryless: &mut self.maps.entryless_ports,
        }
    }

    /// The ports both NAT tables' entries hold on the node's side, as a sweep's read finds them.
    /// Where the kernel runs the sweep program, it must find the same ports, and whether all are
    /// in `spans`, which must be the spans the bed was set up with.
    pub fn node_side_ports(&mut self, spans: &[PortRange]) -> Vec<u64> {
        let mut read = NodeSidePorts::new(spans);
        self.nat().iter().for_each(|(k, e)| read.look(k, e));
        self.nat_v6().iter().for_each(|(k, e)| read.look(k, e));
        if let Some(mut kernel) = self.programs.kernel_sweep(&mut self.maps.sweep) {
            let mut swept = NodeSidePorts::new(spans);
            // At time zero nothing is over: the program only counts.
            let timeouts = Timeouts::default();
            for report in [
                kernel
                    .run::<[u8; 4]>(&timeouts, 0, false)
                    .expect("sweep program"),
                kernel
                    .run::<[u8; 16]>(&timeouts, 0, false)
                    .expect("sweep program"),
            ] {
                swept.take_swept(&report.node_side_ports, report.ports_outside_spans);
            }
            assert!(
                swept.seen == read.seen && swept.all_in_spans == read.all_in_spans,
                "the sweep program finds the node-side ports a read of the tables finds"
            );
        }
        read.seen
    }

    /// The decisions no entry took.
    pub fn decided_by_default(&self) -> u64 {
        let slot = masq_ebpf::decision_slot::BY_DEFAULT;
        decisions::count(&self.maps.policy.decisions, slot)
            .unwrap()
            .unwrap_or(0)
    }

    /// The IPv4 NAT table's entries.
    pub fn nat(&self) -> Table<[u8; 4]> {
        self.nat_table()
    }

    /// The IPv6 NAT table's entries.
    pub fn nat_v6(&self) -> Table<[u8; 16]> {
        self.nat_table()
    }

    /// A family's NAT table's entries, for tests written once over both families.
    pub fn nat_table<A: NatFamily>(&self) -> Table<A>
    where
        NatKey<A>: Pod,
        NatEntry<A>: Pod,
    {
        A::table(&self.maps.nat)
            .read_all()
            .expect("the NAT table reads")
    }

    /// Whether family `A`'s halves are in its hash table, whose full table looks at the drop
    /// sample (the slot table looks at the new flow's buckets instead).
    pub fn has_drop_sample<A: NatFamily>(&self) -> bool
    where
        NatKey<A>: Pod,
        NatEntry<A>: Pod,
    {
        A::table(&self.maps.nat).has_drop_sample()
    }

    /// Sweeps family `A`'s table as the agent does where the kernel runs the sweep program
    /// (`kernel_sweep`), the drop sample included: what it found and removed, and the ports the
    /// halves it found hold on the node's side (`node_side_ports_in`). `None` where this
    /// kernel does not run the program.
    pub fn expire_in_kernel<A>(
        &mut self,
        timeouts: &Timeouts,
        now_ns: u64,
    ) -> anyhow::Result<Option<(NatUsage, Vec<u64>)>>
    where
        A: NatFamily,
        NatKey<A>: Pod,
        NatEntry<A>: Pod,
    {
        let Some(mut kernel) = self.programs.kernel_sweep(&mut self.maps.sweep) else {
            return Ok(None);
        };
        let mut node_side = NodeSidePorts::new(&[]);
        let table = A::table(&self.maps.nat);
        let sample = A::drop_sample(&self.maps.drop_samples);
        let usage = kernel_sweep::sweep(
            Some(&mut kernel),
            table,
            Some(sample),
            timeouts,
            now_ns,
            &mut node_side,
        )?;
        Ok(Some((usage, node_side.seen)))
    }

    /// What the sweep program last reported of family `A`'s table: all zeros until it first
    /// walks it.
    pub fn sweep_report<A: NatFamily>(&self) -> SweepReport {
        self.maps
            .sweep
            .reports
            .get(&A::SWEEP_REPORT, 0)
            .unwrap_or_default()
    }

    /// The ports `entries` hold on the node's side, as a sweep that reads them finds them.
    pub fn node_side_ports_in<A: Address>(entries: &[(NatKey<A>, NatEntry<A>)]) -> Vec<u64> {
        let mut read = NodeSidePorts::new(&[]);
        entries
            .iter()
            .for_each(|(key, entry)| read.look(key, entry));
        read.seen
    }

    /// Checks the NAT tables for flows that outlived the policy, as the agent's sweep does (with
    /// no grace: nothing runs the programs meanwhile); returns whether none did, and the
    /// programs now skip the table toward destinations the policy leaves alone.
    pub fn clear_strays(&mut self) -> anyhow::Result<bool> {
        self.maps
            .policy
            .check_strays(&self.maps.nat, Duration::ZERO)
    }

    /// Removes the NAT entries whose keys `expired` picks, as if their flows had expired.
    pub fn expire_nat<A: NatFamily>(
        &mut self,
        expired: impl Fn(&NatKey<A>) -> bool,
    ) -> anyhow::Result<()>
    where
        NatKey<A>: Pod,
        NatEntry<A>: Pod,
    {
        let table = A::table(&self.maps.nat);
        let doomed: Vec<NatKey<A>> = table
            .read_all()?
            .into_iter()
            .map(|(key, _)| key)
            .filter(|key| expired(key))
            .collect();
        table.remove_all(&doomed)?;
        Ok(())
    }

    /// The entry under `key`, if there is one.
    pub fn nat_entry<A: NatFamily>(&self, key: &NatKey<A>) -> Option<NatEntry<A>>
    where
        NatKey<A>: Pod,
        NatEntry<A>: Pod,
    {
        A::table(&self.maps.nat).get(key)
    }
}

/// One run of `program` over `frame`, `repeat` times.
fn run_once(program: &SchedClassifier, frame: &[u8], repeat: u32) -> anyhow::Result<Run> {
    let mut out = vec![0u8; frame.len() + 256];
    let result = program.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        repeat,
        ..TestRunOptions::new()
    })?;
    out.truncate(result.data_size_out as usize);
    Ok(Run {
        verdict: result.return_value,
        frame: out,
        duration: result.duration,
    })
}

/// Has the calling thread's programs run as tc runs them, where no task takes the CPU from a
/// program before it ends (softirq, on kernels without PREEMPT_RT): BPF_PROG_TEST_RUN keeps
/// a program on its CPU, but lets another task preempt it for a scheduler slice, in which a
/// flow another CPU is making stays half made for milliseconds. A real-time thread is
/// preempted by no ordinary task; an interrupt still takes its CPU for a while, as in softirq.
/// (What a stall past the table's wait does is masq-ebpf's `slot_table` unit tests'.)
fn run_unpreempted() {
    let lowest = libc::sched_param { sched_priority: 1 };
    // SAFETY: sets the calling thread's (0) policy from a parameter that lives through the call.
    let set = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &lowest) };
    assert_eq!(
        set,
        0,
        "running as a real-time thread: {}",
        std::io::Error::last_os_error()
    );
}

/// Keeps the calling thread on CPU `cpu`.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set, which CPU_SET fills in; sched_setaffinity
    // reads it for the calling thread (0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set),
            0,
            "pinning to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
}
