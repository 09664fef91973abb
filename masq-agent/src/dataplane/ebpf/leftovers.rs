//! What an eBPF data plane leaves behind when another one takes over (a rollback to
//! `--dataplane iptables`, or the fallback): its programs stay attached, so that the flows they
//! translated go on, and keep the tuples of the node's own flows apart from them. Its tables
//! are swept here as the eBPF data plane sweeps them, so that every flow expires on time; once
//! no translated flow is left, the programs and their pins are removed.

use std::path::{Path, PathBuf};

use masq_ebpf::map_names;
use tracing::info;

use super::{
    cleanup::cleanup,
    expiry::{self, SweepClock},
    flow_table,
    flow_table::{TableMaps, V4_MAPS, V6_MAPS},
    pins::Pins,
    status,
};
use crate::dataplane::nat_usage::{NatSweep, NatUsage};

/// An earlier eBPF data plane's programs and tables, draining.
pub struct Leftovers {
    bpffs: PathBuf,
    timeouts: expiry::Timeouts,
    sweeps: SweepClock,
}

/// Where draining stands after an upkeep run.
pub enum Drain {
    /// Translated flows are left; the sweep (when one ran) found this.
    Draining(Option<NatSweep>),
    /// None was left: programs and pins are gone.
    Done,
}

impl Leftovers {
    /// The eBPF data plane's objects under `bpffs`, if any are pinned there.
    pub fn find(bpffs: &Path) -> Option<Leftovers> {
        Pins::new(bpffs)
            .map(map_names::NAT_V4)
            .exists()
            .then(|| Leftovers {
                bpffs: bpffs.to_path_buf(),
                timeouts: expiry::Timeouts::of_conntrack(Path::new(expiry::CONNTRACK_SYSCTLS)),
                sweeps: SweepClock::default(),
            })
    }

    /// Sweeps the tables when a sweep is due, and removes everything once no translated flow
    /// is left.
    pub fn maintain(&mut self) -> anyhow::Result<Drain> {
        if !self.sweeps.due() {
            return Ok(Drain::Draining(None));
        }
        let pins = Pins::new(&self.bpffs);
        let now = flow_table::monotonic_now_ns();
        let (run_v4, left_v4) = self.sweep::<[u8; 4]>(&pins, &V4_MAPS, now)?;
        let (run_v6, left_v6) = self.sweep::<[u8; 16]>(&pins, &V6_MAPS, now)?;
        if left_v4.translated_flows + left_v6.translated_flows > 0 {
            let in_use = status::nat_capacities(&pins)?;
            let run =
                NatSweep::of_tables_in_use(run_v4, run_v6, |family| in_use.contains_key(&family));
            return Ok(Drain::Draining(Some(run)));
        }
        cleanup(&self.bpffs)?;
        info!(
            bpffs = %self.bpffs.display(),
            "the eBPF data plane's last translated flow ended: its programs and pins are removed"
        );
        Ok(Drain::Done)
    }

    /// Expires the idle flows of the family's table pinned in `maps`, if there is one; returns
    /// what the sweep found, and what is left.
    fn sweep<A>(
        &self,
        pins: &Pins,
        maps: &TableMaps,
        now: u64,
    ) -> anyhow::Result<(NatUsage, NatUsage)>
    where
        A: masq_ebpf::Address,
        masq_ebpf::NatKey<A>: aya::Pod,
        masq_ebpf::NatEntry<A>: aya::Pod,
    {
        let Some(table) = pins.nat_table::<A>(maps)? else {
            return Ok(Default::default());
        };
        // Old programs' tables: nothing new is written into them, so nothing to make room for.
        let run = expiry::expire::<A>(&table, None, &self.timeouts, now)?;
        let left = expiry::usage(&table.read_all()?);
        Ok((run, left))
    }
}
