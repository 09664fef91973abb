//! Loading the embedded object into the kernel: for the agent, with the maps an earlier agent
//! pinned, so that established flows keep their translation across a restart; for the test
//! bed, with fresh ones. Nothing is attached here, and the NAT ports are set before any program
//! can run.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData},
    programs::SchedClassifier,
};
use masq_ebpf::{MAX_PORT_SPANS, PortSpan, Settings, map_names, program_names};

use super::{EbpfOptions, attach::Hook, carry::Carried, maps::Maps, pins::Pins};
use crate::ports::PortRange;

/// The compiled tc programs, embedded so that the agent is one binary.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/masq"));

/// The object's programs, loaded; its maps are in `Maps`.
pub struct Programs(Ebpf);

impl Programs {
    /// The program that runs at `hook`.
    pub fn at(&mut self, hook: Hook) -> anyhow::Result<&mut SchedClassifier> {
        self.named(hook.program())
    }

    /// The program called `name` in the object.
    pub fn named(&mut self, name: &str) -> anyhow::Result<&mut SchedClassifier> {
        classifier(&mut self.0, name)
    }
}

fn classifier<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut SchedClassifier> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a classifier"))
}

/// Loads the object as `loader` sets it up, and both programs into the kernel.
/// `reused_decisions`: the loader reuses an earlier agent's decision counters.
pub fn load(loader: &mut EbpfLoader, reused_decisions: bool) -> anyhow::Result<(Programs, Maps)> {
    let mut ebpf = loader.load(OBJECT).context("loading the eBPF object")?;
    for name in [program_names::EGRESS, program_names::INGRESS] {
        classifier(&mut ebpf, name)?
            .load()
            .with_context(|| format!("loading program {name}"))?;
    }
    let maps = Maps::take_from(&mut ebpf, reused_decisions)?;
    Ok((Programs(ebpf), maps))
}

/// What the agent's load leaves: the programs, the maps, and the old NAT tables whose flows
/// are carried into the new ones.
pub struct Loaded {
    pub programs: Programs,
    pub maps: Maps,
    pub carried: Carried,
}

/// Loads the object for the agent: reusing the maps pinned under `pins` when their layout
/// matches, carrying the flows of the NAT tables it replaces, its NAT ports set.
pub fn load_pinned(opts: &EbpfOptions, pins: &Pins) -> anyhow::Result<Loaded> {
    pins.prepare()?;
    let carried = Carried::open(pins, |name| match name {
        map_names::NAT_V6 => opts.nat_v6_capacity(),
        _ => opts.nat_capacity,
    });
    pins.discard_incompatible(opts);
    let mut loader = EbpfLoader::new();
    loader.map_max_entries(map_names::NAT_V4, opts.nat_capacity);
    loader.map_max_entries(map_names::NAT_V6, opts.nat_v6_capacity());
    loader.map_max_entries(map_names::DECISIONS, opts.decision_slots());
    let paths: Vec<(&str, PathBuf)> = map_names::PINNED
        .iter()
        .map(|name| (*name, pins.map(name)))
        .collect();
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    let reused_decisions = pins.map(map_names::DECISIONS).exists();
    let (programs, mut maps) = load(&mut loader, reused_decisions)?;
    write_settings(&mut maps.settings, &opts.port_spans, opts.random_fully)?;
    carried.copy_into(&mut maps);
    Ok(Loaded {
        programs,
        maps,
        carried,
    })
}

/// Gives the programs their NAT ports: `spans`, and whether to pick among them at random.
pub fn write_settings(
    settings: &mut Array<MapData, Settings>,
    spans: &[PortRange],
    random_fully: bool,
) -> anyhow::Result<()> {
    if spans.is_empty() {
        bail!("no ports left for NAT: the ephemeral range covers 1024-65535; set --to-ports");
    }
    if spans.len() > MAX_PORT_SPANS {
        bail!(
            "--to-ports lists {} ranges; the eBPF data plane takes at most {MAX_PORT_SPANS}",
            spans.len()
        );
    }
    let mut written = Settings {
        span_count: spans.len() as u32,
        random_fully: u32::from(random_fully),
        ..Settings::default()
    };
    for (slot, span) in written.spans.iter_mut().zip(spans) {
        *slot = PortSpan {
            first: u32::from(span.first),
            count: span.port_count(),
        };
    }
    written.total_ports = written.spans.iter().map(|s| s.count).sum();
    settings.set(0, written, 0)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use masq_ebpf::map_names;

    /// The programs name their maps in `#[btf_map(name = ...)]`, which takes no constant; this
    /// holds those literals to `map_names`, without a kernel.
    #[test]
    fn the_object_defines_every_map_the_agent_names() {
        let object = aya_obj::Object::parse(super::OBJECT).expect("the embedded object parses");
        let unpinned = [
            map_names::NON_MASQ_CACHE_V4,
            map_names::FRAGMENTS_V4,
            map_names::FRAGMENTS_V6,
        ];
        for name in map_names::PINNED.iter().chain(&unpinned) {
            assert!(
                object.maps.contains_key(*name),
                "no map {name} in the object"
            );
        }
    }
}
