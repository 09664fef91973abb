//! The eBPF data plane: masq-ebpf's tc programs and their maps.

use anyhow::Context as _;
use aya::Ebpf;

use super::DataPlane;
use crate::policy::MasqueradeOptions;

/// The compiled tc programs, embedded so that the agent is one binary.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/masq"));

/// Loads the embedded object into the kernel (maps created, programs not yet loaded).
pub fn load_object() -> anyhow::Result<Ebpf> {
    Ebpf::load(OBJECT).context("loading the eBPF object")
}

/// Builds the eBPF data plane. Until the translating programs land, this reports why it cannot
/// run, and the caller falls back to iptables (or exits, with `--fallback-to-iptables=false`).
pub fn new(_opts: &MasqueradeOptions) -> anyhow::Result<Box<dyn DataPlane>> {
    anyhow::bail!("the eBPF SNAT programs are not part of this build yet")
}

#[cfg(test)]
mod tests {
    use aya::{
        maps::{LpmTrie, PerCpuArray, lpm_trie::Key},
        programs::{SchedClassifier, TestRun, TestRunOptions},
    };
    use masq_ebpf::{Counter, NON_MASQ_PRESENT, map_names, program_names};

    use super::*;

    /// An Ethernet + IPv4 + UDP frame from 10.244.1.2 to `daddr`.
    fn udp_frame(daddr: [u8; 4]) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 8];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[16..18].copy_from_slice(&28u16.to_be_bytes());
        f[22] = 64;
        f[23] = 17;
        f[26..30].copy_from_slice(&[10, 244, 1, 2]);
        f[30..34].copy_from_slice(&daddr);
        f
    }

    fn counter(ebpf: &Ebpf, c: Counter) -> u64 {
        let map: PerCpuArray<_, u64> = ebpf.map(map_names::COUNTERS).unwrap().try_into().unwrap();
        map.get(&(c as u32), 0).unwrap().iter().sum()
    }

    /// Proves the build chain end to end: the embedded object loads, its BTF LPM map takes
    /// prefixes, and the classifier's lookups hit and miss as the trie says.
    #[test]
    fn classifier_looks_destinations_up_in_the_lpm_trie() {
        let mut ebpf = load_object().unwrap();
        let mut trie: LpmTrie<_, [u8; 4], u8> = ebpf
            .map_mut(map_names::NON_MASQ_V4)
            .unwrap()
            .try_into()
            .unwrap();
        trie.insert(&Key::new(8, [10, 0, 0, 0]), NON_MASQ_PRESENT, 0)
            .unwrap();
        let prog: &mut SchedClassifier = ebpf
            .program_mut(program_names::EGRESS)
            .unwrap()
            .try_into()
            .unwrap();
        prog.load().unwrap();
        for daddr in [[10, 1, 2, 3], [203, 0, 113, 7], [203, 0, 113, 8]] {
            let frame = udp_frame(daddr);
            let mut out = vec![0u8; frame.len()];
            let result = prog
                .test_run(TestRunOptions {
                    data_in: Some(&frame),
                    data_out: Some(&mut out),
                    ..TestRunOptions::new()
                })
                .unwrap();
            assert_eq!(result.return_value, 0, "TC_ACT_OK");
            assert_eq!(out, frame, "the classifier must not touch the packet");
        }
        assert_eq!(counter(&ebpf, Counter::NonMasqDestination), 1);
        assert_eq!(counter(&ebpf, Counter::MasqueradeCandidate), 2);
        assert_eq!(counter(&ebpf, Counter::NotInspected), 0);
    }
}
