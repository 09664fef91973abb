//! The real object with fresh, unpinned maps, driven through BPF_PROG_TEST_RUN: what the packet
//! tests and the data-path benchmark run against. The kernel's test runner runs tc programs on
//! the loopback device, so the node address is configured for ifindex 1.

use std::{net::Ipv4Addr, time::Duration};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions},
};
use ipnet::Ipv4Net;
use masq_ebpf::{Counter, NatEntryV4, NatKeyV4, map_names, program_names};

use super::{
    OBJECT, classifier, map_mut, sync_non_masq_v4, v4_keys, write_interfaces, write_settings,
};
use crate::{netdev::Device, ports::PortRange};

/// The ifindex BPF_PROG_TEST_RUN gives tc programs: loopback.
pub const TEST_RUN_IFINDEX: u32 = 1;

pub struct TestBed {
    pub ebpf: Ebpf,
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
            .load(OBJECT)?;
        for name in [program_names::EGRESS, program_names::INGRESS] {
            classifier(&mut ebpf, name)?.load()?;
        }
        Ok(TestBed { ebpf })
    }

    /// Configured as the agent would: ports, the node's address, and a policy.
    pub fn new(
        nat_entries: u32,
        spans: &[PortRange],
        random_fully: bool,
        node: Ipv4Addr,
        non_masq: &[Ipv4Net],
    ) -> anyhow::Result<TestBed> {
        let mut bed = TestBed::unconfigured(nat_entries)?;
        write_settings(&mut bed.ebpf, spans, random_fully)?;
        let lo = Device {
            name: "lo".into(),
            index: TEST_RUN_IFINDEX,
            ipv4: node,
        };
        write_interfaces(&mut bed.ebpf, &[lo])?;
        bed.set_policy(non_masq)?;
        Ok(bed)
    }

    /// Applies a non-masquerade policy the way the data plane does.
    pub fn set_policy(&mut self, non_masq: &[Ipv4Net]) -> anyhow::Result<()> {
        sync_non_masq_v4(&mut self.ebpf, &v4_keys(non_masq))?;
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

    pub fn nat(&self) -> Vec<(NatKeyV4, NatEntryV4)> {
        self.ebpf
            .map(map_names::NAT_V4)
            .and_then(|m| BpfHashMap::<&MapData, NatKeyV4, NatEntryV4>::try_from(m).ok())
            .map(|m| m.iter().filter_map(Result::ok).collect())
            .unwrap_or_default()
    }

    /// The entry under `key`, if there is one.
    pub fn nat_entry(&self, key: &NatKeyV4) -> Option<NatEntryV4> {
        let map = self.ebpf.map(map_names::NAT_V4)?;
        let nat = BpfHashMap::<&MapData, NatKeyV4, NatEntryV4>::try_from(map).ok()?;
        nat.get(key, 0).ok()
    }

    /// The NAT table itself, for the agent's sweep.
    pub fn nat_table(&self) -> anyhow::Result<&Map> {
        self.ebpf
            .map(map_names::NAT_V4)
            .ok_or_else(|| anyhow::anyhow!("no NAT table in the object"))
    }

    pub fn nat_mut(&mut self) -> anyhow::Result<BpfHashMap<&mut MapData, NatKeyV4, NatEntryV4>> {
        Ok(BpfHashMap::try_from(map_mut(
            &mut self.ebpf,
            map_names::NAT_V4,
        )?)?)
    }
}
