//! What an eBPF data plane leaves behind when another one takes over (a rollback to
//! `--dataplane iptables`, or the fallback): its programs stay attached, so that the flows they
//! translated go on, and keep the tuples of the node's own flows apart from them. Its tables
//! are swept here as the eBPF data plane sweeps them, so that every flow expires on time; once
//! no translated flow is left, the programs and their pins are removed.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::Context as _;
use aya::maps::{Map, MapData};
use masq_ebpf::map_names;
use tracing::info;

use super::{SWEEP_INTERVAL, expiry, pins::Pins};
use crate::dataplane::NatUsage;

/// An earlier eBPF data plane's programs and tables, draining.
pub struct Leftovers {
    bpffs: PathBuf,
    timeouts: expiry::Timeouts,
    last_sweep: Option<Instant>,
}

/// Where draining stands after an upkeep run.
pub enum Drain {
    /// Translated flows are left; the sweep (when one ran) found this.
    Draining(Option<NatUsage>),
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
                timeouts: expiry::Timeouts::default(),
                last_sweep: None,
            })
    }

    /// Sweeps the tables when a sweep is due, and removes everything once no translated flow
    /// is left.
    pub fn maintain(&mut self) -> anyhow::Result<Drain> {
        if self
            .last_sweep
            .is_some_and(|last| last.elapsed() < SWEEP_INTERVAL)
        {
            return Ok(Drain::Draining(None));
        }
        self.last_sweep = Some(Instant::now());
        let pins = Pins::new(&self.bpffs);
        let now = expiry::monotonic_now_ns();
        let mut run = NatUsage::default();
        let mut left = NatUsage::default();
        for name in [map_names::NAT_V4, map_names::NAT_V6] {
            let path = pins.map(name);
            if !path.exists() {
                continue;
            }
            let map = Map::from_map_data(
                MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?,
            )?;
            let (table_run, table_left) = if name == map_names::NAT_V6 {
                sweep::<[u8; 16]>(&map, &self.timeouts, now)?
            } else {
                sweep::<[u8; 4]>(&map, &self.timeouts, now)?
            };
            run = run + table_run;
            left = left + table_left;
        }
        if left.translated_flows > 0 {
            return Ok(Drain::Draining(Some(run)));
        }
        super::cleanup(&self.bpffs)?;
        info!(
            bpffs = %self.bpffs.display(),
            "the eBPF data plane's last translated flow ended: its programs and pins are removed"
        );
        Ok(Drain::Done)
    }
}

/// Expires a table's idle flows; returns what the sweep found, and what is left.
fn sweep<A>(
    map: &Map,
    timeouts: &expiry::Timeouts,
    now: u64,
) -> anyhow::Result<(NatUsage, NatUsage)>
where
    A: masq_ebpf::Address,
    masq_ebpf::NatKey<A>: aya::Pod,
    masq_ebpf::NatEntry<A>: aya::Pod,
{
    let run = expiry::expire::<A>(map, timeouts, now)?;
    let (_, entries) = expiry::read_table::<A>(map)?;
    Ok((run, expiry::usage(&entries)))
}
