//! The real object with fresh, unpinned maps, driven through BPF_PROG_TEST_RUN: what the packet
//! tests and the data-path benchmark run against. The kernel's test runner runs tc programs on
//! the loopback device, so the node address is configured for ifindex 1.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use aya::Pod;
use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions},
};
use ipnet::{Ipv4Net, Ipv6Net};
use masq_ebpf::{
    Address, Counter, NatEntry, NatEntryV4, NatKey, NatKeyV4, map_names, program_names,
};

use super::{
    OBJECT, TRIES_V4, TRIES_V6, classifier, expiry::Table, map_mut, sync_non_masq, v4_keys,
    v6_keys, write_interfaces, write_settings,
};
use crate::{netdev::Device, ports::PortRange};

/// The ifindex BPF_PROG_TEST_RUN gives tc programs: loopback.
pub const TEST_RUN_IFINDEX: u32 = 1;

pub struct TestBed {
    pub ebpf: Ebpf,
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

impl TestBed {
    /// The object with both programs loaded and nothing configured.
    pub fn unconfigured(nat_entries: u32) -> anyhow::Result<TestBed> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(map_names::NAT_V4, nat_entries)
            .map_max_entries(map_names::NAT_V6, nat_entries)
            .load(OBJECT)?;
        for name in [program_names::EGRESS, program_names::INGRESS] {
            classifier(&mut ebpf, name)?.load()?;
        }
        Ok(TestBed { ebpf })
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
        let mut bed = TestBed::unconfigured(nat_entries)?;
        let spans: Vec<PortRange> = spans
            .iter()
            .map(|&(first, last)| PortRange { first, last })
            .collect();
        write_settings(&mut bed.ebpf, &spans, random_fully)?;
        let lo = Device {
            name: "lo".into(),
            index: TEST_RUN_IFINDEX,
            ipv4: node,
            ipv6: None,
        };
        write_interfaces(&mut bed.ebpf, &[lo], false)?;
        bed.set_policy(non_masq)?;
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
        if let Some(current) = self.interface_v4()? {
            lo.ipv4 = current;
        }
        write_interfaces(&mut self.ebpf, &[lo], true)?;
        self.set_policy_v6(non_masq)
    }

    fn interface_v4(&mut self) -> anyhow::Result<Option<Ipv4Addr>> {
        let map: BpfHashMap<&MapData, u32, masq_ebpf::Interface> = BpfHashMap::try_from(
            self.ebpf
                .map(map_names::INTERFACES)
                .ok_or_else(|| anyhow::anyhow!("no interfaces map"))?,
        )?;
        Ok(map
            .get(&TEST_RUN_IFINDEX, 0)
            .ok()
            .map(|i| Ipv4Addr::from(i.ipv4)))
    }

    /// Applies a non-masquerade policy the way the data plane does.
    pub fn set_policy(&mut self, non_masq: &[Ipv4Net]) -> anyhow::Result<()> {
        sync_non_masq(&mut self.ebpf, &TRIES_V4, &v4_keys(non_masq))?;
        Ok(())
    }

    /// The same for IPv6.
    pub fn set_policy_v6(&mut self, non_masq: &[Ipv6Net]) -> anyhow::Result<()> {
        sync_non_masq(&mut self.ebpf, &TRIES_V6, &v6_keys(non_masq))?;
        Ok(())
    }

    /// Runs `program` over `frame`, `repeat` times.
    pub fn run(&mut self, program: &str, frame: &[u8], repeat: u32) -> anyhow::Result<Run> {
        let prog = classifier(&mut self.ebpf, program)?;
        let mut out = vec![0u8; frame.len() + 256];
        let result = prog.test_run(TestRunOptions {
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

    /// The ingress program's verdict and output frame, for one run.
    pub fn ingress(&mut self, frame: &[u8]) -> (u32, Vec<u8>) {
        let run = self
            .run(program_names::INGRESS, frame, 1)
            .expect("test run");
        (run.verdict, run.frame)
    }

    pub fn counter(&self, counter: Counter) -> u64 {
        self.ebpf
            .map(map_names::COUNTERS)
            .and_then(|m| PerCpuArray::<&MapData, u64>::try_from(m).ok())
            .and_then(|m| m.get(&(counter as u32), 0).ok())
            .map_or(0, |per_cpu| per_cpu.iter().sum())
    }

    /// The IPv4 NAT table's entries.
    pub fn nat(&self) -> Table<[u8; 4]> {
        self.nat_of(map_names::NAT_V4)
    }

    /// The IPv6 NAT table's entries.
    pub fn nat_v6(&self) -> Table<[u8; 16]> {
        self.nat_of(map_names::NAT_V6)
    }

    fn nat_of<A: Address>(&self, name: &str) -> Table<A>
    where
        NatKey<A>: Pod,
        NatEntry<A>: Pod,
    {
        self.ebpf
            .map(name)
            .and_then(|m| BpfHashMap::<&MapData, NatKey<A>, NatEntry<A>>::try_from(m).ok())
            .map(|m| m.iter().filter_map(Result::ok).collect())
            .unwrap_or_default()
    }

    /// The entry under `key`, if there is one.
    pub fn nat_entry<A: Address>(&self, key: &NatKey<A>) -> Option<NatEntry<A>>
    where
        NatKey<A>: Pod,
        NatEntry<A>: Pod,
    {
        let name = if A::BITS == 32 {
            map_names::NAT_V4
        } else {
            map_names::NAT_V6
        };
        let nat = BpfHashMap::<&MapData, NatKey<A>, NatEntry<A>>::try_from(self.ebpf.map(name)?);
        nat.ok()?.get(key, 0).ok()
    }

    /// The IPv4 NAT table itself, for the agent's sweep.
    pub fn nat_table(&self) -> anyhow::Result<&Map> {
        self.map(map_names::NAT_V4)
    }

    /// The IPv6 one.
    pub fn nat_table_v6(&self) -> anyhow::Result<&Map> {
        self.map(map_names::NAT_V6)
    }

    fn map(&self, name: &str) -> anyhow::Result<&Map> {
        self.ebpf
            .map(name)
            .ok_or_else(|| anyhow::anyhow!("no map {name} in the object"))
    }

    pub fn nat_mut(&mut self) -> anyhow::Result<BpfHashMap<&mut MapData, NatKeyV4, NatEntryV4>> {
        Ok(BpfHashMap::try_from(map_mut(
            &mut self.ebpf,
            map_names::NAT_V4,
        )?)?)
    }
}
