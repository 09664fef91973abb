//! Loading the embedded object into the kernel: for the agent, with the maps an earlier agent
//! pinned, so that established flows keep their translation across a restart; for the test
//! bed, with fresh ones. Nothing is attached here, and the NAT ports are set before any program
//! can run.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, MapType},
    programs::{ProgramError, SchedClassifier},
};
use aya::{
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported},
};
use masq_ebpf::{
    MAX_PORT_SPANS, PortSpan, Settings, TickClock, global_names, map_names, program_names,
    slot_table::{self, BUCKET_SLOTS},
};

use aya_obj::generated::bpf_map_type;

use super::{
    carry::Carried,
    drop_sample,
    flow_table::{V4_MAPS, V6_MAPS},
    hook::Hook,
    kernel_sweep::{KernelSweep, LeftPressed, Sweeper},
    map_types::SweepMaps,
    maps::Maps,
    options::{EbpfOptions, decision_slots},
    pins::{MapSpec, Pins},
    tick_clock::{self, Tick},
};
use crate::ports::PortRange;

/// The compiled tc programs, embedded so that the agent is one binary: built without the slot
/// table, for any kernel the eBPF data plane runs on.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/masq"));

/// The same programs built with the slot table (masq-ebpf's `slot-table` feature), for kernels
/// with BPF atomics on map values (5.12).
pub static SLOT_TABLE_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/slot-table/masq"));

/// The object's programs, loaded; its maps are in `Maps`.
pub struct Programs {
    ebpf: Ebpf,
    /// Where the sweep program is loaded, what the agent keeps of its sweeps.
    sweeps: Option<LeftPressed>,
    /// What the programs stamp flows by, where the agent measured the tick.
    tick: Option<Tick>,
}

impl Programs {
    /// The program that runs at `hook`.
    pub fn at(&mut self, hook: Hook) -> anyhow::Result<&mut SchedClassifier> {
        self.named(hook.program())
    }

    /// The program called `name` in the object.
    pub fn named(&mut self, name: &str) -> anyhow::Result<&mut SchedClassifier> {
        classifier(&mut self.ebpf, name)
    }

    /// What the programs stamp flows by, where the agent measured the tick.
    pub fn tick_clock(&self) -> Option<TickClock> {
        self.tick.as_ref().map(Tick::clock)
    }

    /// Keeps the programs' stamps on CLOCK_MONOTONIC (`Tick::keep`), where they stamp by the
    /// tick.
    pub fn keep_the_tick(&mut self) -> anyhow::Result<()> {
        let Some(tick) = &mut self.tick else {
            return Ok(());
        };
        tick.keep(classifier(&mut self.ebpf, program_names::CLOCK_PROBE)?)
    }

    /// The sweep program with its maps, where it is loaded.
    pub fn kernel_sweep<'a>(&'a mut self, maps: &'a mut SweepMaps) -> Option<KernelSweep<'a>> {
        let pressed = self.sweeps.as_mut()?;
        let program = classifier(&mut self.ebpf, program_names::SWEEP).ok()?;
        Some(KernelSweep {
            program,
            maps,
            pressed,
        })
    }
}

/// Loads the sweep program; false, with a warning, where the kernel refuses it, which leaves
/// the sweep to userspace. The verifier's log goes to the debug log.
fn load_sweep(ebpf: &mut Ebpf, sweeper: Sweeper) -> anyhow::Result<bool> {
    let err = match classifier(ebpf, program_names::SWEEP)?.load() {
        Ok(()) => {
            tracing::debug!("the NAT table is swept in the kernel");
            return Ok(true);
        }
        Err(err) => err,
    };
    if sweeper == Sweeper::KernelOnly {
        return Err(err).context("loading the sweep program, which the environment insists on");
    }
    if let ProgramError::LoadError { verifier_log, .. } = &err {
        tracing::debug!(%verifier_log, "the sweep program's verifier log");
    }
    tracing::warn!(
        "the NAT table is swept in userspace: the kernel refused the sweep program: {err}"
    );
    Ok(false)
}

fn classifier<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut SchedClassifier> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a classifier"))
}

/// The size of each family's NAT table, and of its drop sample, and its slot table's seed,
/// which the programs read from globals; the loader borrows the globals' values from here.
/// Where the halves are kept in the slot table (`slot_table`), the hash tables take one entry
/// each, and the other way round.
pub struct NatSizes {
    v4_entries: u32,
    v6_entries: u32,
    v4_sample_slots: u32,
    v6_sample_slots: u32,
    /// Whether the halves are in the slot tables (and the object is the one built with them).
    slot_table: bool,
    v4_buckets: u32,
    v6_buckets: u32,
    seeds: SlotSeeds,
}

/// Each family's slot table's seed (`slot_seed`).
#[derive(Clone, Copy, Debug)]
pub struct SlotSeeds {
    pub v4: u64,
    pub v6: u64,
}

impl SlotSeeds {
    /// New seeds, at random: tables no earlier agent pinned.
    #[cfg(feature = "testbed")]
    pub fn random() -> anyhow::Result<SlotSeeds> {
        Ok(SlotSeeds {
            v4: slot_seed(None)?,
            v6: slot_seed(None)?,
        })
    }
}

/// The seed of a family's slot table: the one a pinned table has, which its halves were placed
/// by, or a new one at random (`slot_table::seed_at`).
pub fn slot_seed(pinned: Option<u64>) -> anyhow::Result<u64> {
    Ok(match pinned {
        Some(seed) if seed != 0 => seed,
        // 0 is the unseeded hash's.
        _ => getrandom::u64().context("a random seed for the NAT slot table")? | 1,
    })
}

/// A family's drop sample's slots. A full slot table looks at the new half's buckets: the
/// sample then goes unused, and takes the one slot the kernel asks of an array.
fn sample_slots(entries: u32, slot_table: bool) -> u32 {
    if slot_table {
        1
    } else {
        masq_ebpf::drop_sample_slots(entries)
    }
}

impl NatSizes {
    pub fn new(v4_entries: u32, v6_entries: u32, slot_table: bool, seeds: SlotSeeds) -> NatSizes {
        // A slot table is made larger than its entries, so that it has room for them all
        // (`slot_table::buckets_for`).
        let buckets = slot_table::buckets_for;
        NatSizes {
            v4_entries,
            v6_entries,
            v4_sample_slots: sample_slots(v4_entries, slot_table),
            v6_sample_slots: sample_slots(v6_entries, slot_table),
            slot_table,
            v4_buckets: buckets(v4_entries),
            v6_buckets: buckets(v6_entries),
            seeds,
        }
    }

    /// As made, but with slot tables of the fewest whole buckets that hold their entries, a
    /// power of two of them, as every table was before the agent's took room to spare: the
    /// tests' tables, full at the size they ask once `NatTable::limit_to` blocks the slots
    /// past it, in the buckets their cases were written for.
    #[cfg(feature = "testbed")]
    pub fn with_slots_for_entries_alone(self) -> NatSizes {
        let buckets = |entries: u32| entries.div_ceil(BUCKET_SLOTS).next_power_of_two().max(2);
        NatSizes {
            v4_buckets: buckets(self.v4_entries),
            v6_buckets: buckets(self.v6_entries),
            ..self
        }
    }

    /// The maps sized here, and their sizes.
    fn max_entries(&self) -> [(&'static str, u32); 8] {
        let (in_slots, in_hash) = match self.slot_table {
            true => (1, 0),
            false => (0, 1),
        };
        // The table not in use takes one entry: the kernel allows no array or hash of none.
        let used = |entries: u32, used: u32| if used == 1 { entries } else { 1 };
        // A family's slot table's slots and words. A family that translates nothing takes one
        // entry (`EbpfOptions::for_ipv6`), and uses no slot table either.
        let slot_maps = |entries: u32, buckets: u32| {
            let in_use = if entries > 1 { in_slots } else { 0 };
            (
                used(buckets * BUCKET_SLOTS, in_use),
                used(slot_table::words_for(buckets), in_use),
            )
        };
        let (v4_slots, v4_words) = slot_maps(self.v4_entries, self.v4_buckets);
        let (v6_slots, v6_words) = slot_maps(self.v6_entries, self.v6_buckets);
        [
            (map_names::NAT_V4, used(self.v4_entries, in_hash)),
            (map_names::NAT_V6, used(self.v6_entries, in_hash)),
            (map_names::NAT_SLOTS_V4, v4_slots),
            (map_names::NAT_SLOT_WORDS_V4, v4_words),
            (map_names::NAT_SLOTS_V6, v6_slots),
            (map_names::NAT_SLOT_WORDS_V6, v6_words),
            (map_names::DROP_SAMPLE_V4, self.v4_sample_slots),
            (map_names::DROP_SAMPLE_V6, self.v6_sample_slots),
        ]
    }

    /// The entries the map named `name` takes, of those sized here; 0 for any other.
    pub fn entries_of(&self, name: &str) -> u32 {
        self.max_entries()
            .into_iter()
            .find_map(|(sized, entries)| (sized == name).then_some(entries))
            .unwrap_or(0)
    }

    /// The object these sizes are for: the one with the slot tables where the halves go there.
    pub fn object(&self) -> &'static [u8] {
        match self.slot_table {
            true => SLOT_TABLE_OBJECT,
            false => OBJECT,
        }
    }

    pub fn set<'a>(&'a self, loader: &mut EbpfLoader<'a>) {
        for (name, entries) in self.max_entries() {
            loader.map_max_entries(name, entries);
        }
        loader
            .override_global(
                global_names::DROP_SAMPLE_SLOTS_V4,
                &self.v4_sample_slots,
                true,
            )
            .override_global(
                global_names::DROP_SAMPLE_SLOTS_V6,
                &self.v6_sample_slots,
                true,
            )
            .override_global(global_names::SLOT_BUCKETS_V4, &self.v4_buckets, true)
            .override_global(global_names::SLOT_BUCKETS_V6, &self.v6_buckets, true)
            .override_global(global_names::SLOT_SEED_V4, &self.seeds.v4, true)
            .override_global(global_names::SLOT_SEED_V6, &self.seeds.v6, true);
    }
}

/// Set to `0` to keep the halves in the kernel's hash tables where the slot tables could hold
/// them, or to `1` to ask for the slot tables (the default where the kernel has them).
pub const SLOT_TABLE_ENV: &str = "MASQ_AGENT_SLOT_TABLE";

/// Whether the NAT halves go in the slot tables here: where the kernel has BPF atomics on map
/// values (compare-and-exchange, xor: Linux 5.12), unless `SLOT_TABLE_ENV` is `0`. Asked for
/// on an older kernel, the request is said to be ignored: its verifier would refuse the
/// programs.
pub fn slot_table() -> bool {
    let asked = std::env::var(SLOT_TABLE_ENV);
    if asked.as_deref() == Ok("0") {
        return false;
    }
    let atomics = aya::util::KernelVersion::current()
        .is_ok_and(|v| v >= aya::util::KernelVersion::new(5, 12, 0));
    if !atomics && asked.as_deref() == Ok("1") {
        tracing::warn!(
            "{SLOT_TABLE_ENV}=1 ignored: Linux {} lacks BPF atomics on map values (5.12); the \
             NAT halves stay in the hash table",
            kernel_release()
        );
    }
    atomics
}

/// Set to `1` or `0` to say whether the kernel has the coarse clock instead of asking it: `1`
/// on a kernel without it makes the verifier refuse the programs, as an older kernel would.
pub const COARSE_CLOCK_ENV: &str = "MASQ_AGENT_COARSE_CLOCK";

/// Whether the programs may call `bpf_ktime_get_coarse_ns` (Linux 5.11) here.
fn coarse_clock() -> bool {
    match std::env::var(COARSE_CLOCK_ENV).as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => is_helper_supported(
            ProgramType::SchedClassifier,
            BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
        )
        .unwrap_or(false),
    }
}

/// Loads the object as `loader` sets it up, with the kernel's features set in its globals, and
/// both programs into the kernel.
/// `reused_decisions`: the loader reuses an earlier agent's decision counters.
pub fn load(
    loader: &mut EbpfLoader,
    sizes: &NatSizes,
    reused_decisions: bool,
) -> anyhow::Result<(Programs, Maps)> {
    static YES: u8 = 1;
    static NO: u8 = 0;
    let coarse = if coarse_clock() { &YES } else { &NO };
    loader.override_global(global_names::COARSE_CLOCK, coarse, true);
    let in_order = if super::interfaces::MEMORY_IN_ORDER {
        &YES
    } else {
        &NO
    };
    loader.override_global(global_names::STORES_IN_ORDER, in_order, true);
    let mut ebpf = loader
        .load(sizes.object())
        .context("loading the eBPF object")?;
    for name in [program_names::EGRESS, program_names::INGRESS] {
        classifier(&mut ebpf, name)?
            .load()
            .map_err(|err| match err {
                ProgramError::LoadError {
                    io_error,
                    verifier_log,
                } => anyhow::Error::new(Refused {
                    program: name,
                    errno: io_error,
                    log: verifier_log.to_string(),
                }),
                err => anyhow::Error::new(err).context(format!("loading program {name}")),
            })?;
    }
    let sweeps = match Sweeper::chosen() {
        Sweeper::Userspace => None,
        sweeper => load_sweep(&mut ebpf, sweeper)?.then(LeftPressed::default),
    };
    let tick = tick_clock::give_the_programs_the_tick(&mut ebpf).unwrap_or_else(|err| {
        tracing::warn!("the programs read the kernel's clock, a helper call a packet: {err:#}");
        None
    });
    let maps = Maps::take_from(&mut ebpf, reused_decisions)?;
    // Before the programs can reach the table: they are attached after this.
    maps.nat
        .v4
        .keep_seed(sizes.seeds.v4)
        .context("the IPv4 NAT slot table's seed")?;
    maps.nat
        .v6
        .keep_seed(sizes.seeds.v6)
        .context("the IPv6 NAT slot table's seed")?;
    Ok((Programs { ebpf, sweeps, tick }, maps))
}

/// The kernel refused a program: which one, its error, and the verifier's log, which runs to
/// hundreds of lines. Its `Display` is the one line an operator reads first.
#[derive(Debug, thiserror::Error)]
#[error(
    "Linux {} refused program {program}: {} ({})",
    kernel_release(),
    self.reason(),
    self.hint()
)]
pub struct Refused {
    pub program: &'static str,
    pub errno: std::io::Error,
    pub log: String,
}

impl Refused {
    /// The verifier's last words, which say why; the error itself when it wrote none.
    pub fn reason(&self) -> String {
        self.log
            .lines()
            .rev()
            .map(str::trim)
            .find(|line| {
                !line.is_empty()
                    && !line.starts_with("processed ")
                    && !line.starts_with("verification time")
                    && !line.starts_with("stack depth")
            })
            .map_or_else(|| self.errno.to_string(), String::from)
    }

    /// What the reason means, and where to read on.
    pub fn hint(&self) -> &'static str {
        let reason = self.reason();
        if reason.contains("unknown func") || reason.contains("invalid func") {
            "this kernel lacks a helper the program calls; docs/install.md lists the kernels the \
             eBPF data plane runs on"
        } else if reason.contains("stack") {
            "the program needs more stack than this kernel's verifier allows; docs/install.md \
             lists the kernels the eBPF data plane runs on"
        } else if reason.contains("too large") || reason.contains("complexity") {
            "the program is more than this kernel's verifier can follow; docs/install.md lists \
             the kernels the eBPF data plane runs on"
        } else {
            "docs/install.md lists the kernels the eBPF data plane runs on"
        }
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "?".to_string(), |r| r.trim().to_string())
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
    let before = pins.snapshot();
    pins.prepare()?;
    // A table reused keeps its seed; one replaced may take it too. One that cannot be read
    // is replaced (`discard_incompatible`), and the new table takes a new seed.
    let pinned_seed = |family: &str, pinned: anyhow::Result<Option<u64>>| {
        slot_seed(pinned.unwrap_or_else(|err| {
            tracing::warn!("the pinned {family} NAT table's seed: {err:#}");
            None
        }))
    };
    let seeds = SlotSeeds {
        v4: pinned_seed("IPv4", pins.slot_seed::<[u8; 4]>(&V4_MAPS))?,
        v6: pinned_seed("IPv6", pins.slot_seed::<[u8; 16]>(&V6_MAPS))?,
    };
    let sizes = NatSizes::new(
        opts.nat_capacity,
        opts.nat_v6_capacity(),
        slot_table(),
        seeds,
    );
    let mut carried = Carried::open(pins, |name| sizes.entries_of(name));
    match load_into(opts, pins, &sizes) {
        Ok((programs, mut maps)) => {
            if let Some(clock) = programs.tick_clock() {
                tracing::debug!(
                    tick_ns = clock.tick_ns,
                    "the programs stamp flows by the kernel's tick"
                );
            }
            carried.copy_into(&mut maps);
            if let Err(err) = drop_sample::fill(&maps) {
                tracing::warn!(
                    "the NAT tables' flows cannot be dropped early until they are new: {err:#}"
                );
            }
            Ok(Loaded {
                programs,
                maps,
                carried,
            })
        }
        Err(err) => {
            // What this attempt pinned holds nothing yet: left, it would read as an eBPF data
            // plane to drain. What an earlier agent pinned stays, and the NAT tables it was
            // to replace are pinned again, their flows kept for the next attempt.
            pins.remove_pinned_since(&before);
            carried.pin_again(pins);
            Err(match err.downcast::<Refused>() {
                Ok(refused) => refused_with_log(&pins.dir, refused),
                Err(err) => with_memlock_hint(err),
            })
        }
    }
}

/// Before 5.11 the kernel charges maps to RLIMIT_MEMLOCK, and a container's limit is often too
/// low for the NAT tables: a refusal to create one says what to change.
fn with_memlock_hint(err: anyhow::Error) -> anyhow::Error {
    let denied = err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EPERM))
    });
    let charged_to_memlock = aya::util::KernelVersion::current()
        .is_ok_and(|v| v < aya::util::KernelVersion::new(5, 11, 0));
    if denied && charged_to_memlock {
        err.context(
            "before 5.11 the kernel charges BPF maps to RLIMIT_MEMLOCK: give the container an \
             unlimited memlock limit, or CAP_SYS_RESOURCE so that the agent raises it \
             (docs/install.md, Kernels)",
        )
    } else {
        err
    }
}

/// The one line that says the kernel refused a program, naming the file that holds the
/// verifier's full log; the log goes to the debug log if the file cannot be written.
fn refused_with_log(bpffs: &std::path::Path, refused: Refused) -> anyhow::Error {
    let path = crate::dataplane::state::verifier_log(bpffs, refused.program);
    let log = match crate::dataplane::state::write(&path, &refused.log) {
        Ok(()) => format!("the verifier's full log is in {}", path.display()),
        Err(err) => {
            tracing::debug!(
                program = refused.program,
                "the verifier's log:\n{}",
                refused.log
            );
            format!(
                "the verifier's full log is in the debug log (-v=4): {} not written: {err}",
                path.display()
            )
        }
    };
    anyhow::anyhow!("{refused}; {log}")
}

/// Loads the object with the maps pinned under `pins`, after replacing those this build cannot
/// reuse, and sets the programs' NAT ports.
fn load_into(
    opts: &EbpfOptions,
    pins: &Pins,
    sizes: &NatSizes,
) -> anyhow::Result<(Programs, Maps)> {
    pins.discard_incompatible(&expected_maps(sizes, decision_slots(opts.policy_entries))?);
    let mut loader = EbpfLoader::new();
    sizes.set(&mut loader);
    size_the_policy_maps(&mut loader, opts.policy_entries);
    // 64 KiB a CPU where IPv6 is translated.
    let ipv6_cache = opts.for_ipv6(masq_ebpf::NON_MASQ_CACHE_SLOTS_V6);
    loader.map_max_entries(map_names::NON_MASQ_CACHE_V6, ipv6_cache);
    let paths: Vec<(&str, PathBuf)> = map_names::PINNED
        .iter()
        .map(|name| (*name, pins.map(name)))
        .collect();
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    let reused_decisions = pins.map(map_names::DECISIONS).exists();
    let (programs, mut maps) = load(&mut loader, sizes, reused_decisions)?;
    write_settings(&mut maps.settings, &opts.port_spans, opts.random_fully)?;
    Ok((programs, maps))
}

/// Sizes the maps that grow with the policy for one of `entries` prefixes: the decision
/// counters, and the programs' index of the IPv4 policy trie.
pub fn size_the_policy_maps(loader: &mut EbpfLoader, entries: usize) {
    loader.map_max_entries(map_names::DECISIONS, decision_slots(entries));
    let chunks = super::policy_index::chunks_for(entries);
    loader.map_max_entries(map_names::NON_MASQ_INDEX_V4, chunks);
}

/// The pinned maps this build creates, as the kernel will report them: their shapes as the
/// object declares them, at the sizes the loader gives them (`sizes`, and `decision_slots`).
fn expected_maps(sizes: &NatSizes, decision_slots: u32) -> anyhow::Result<Vec<MapSpec>> {
    let object =
        aya_obj::Object::parse(sizes.object()).context("parsing the embedded eBPF object")?;
    let mut sized = sizes.max_entries().to_vec();
    sized.push((map_names::DECISIONS, decision_slots));
    map_names::PINNED
        .iter()
        .map(|&name| {
            let map = object
                .maps
                .get(name)
                .with_context(|| format!("map {name} missing from the object"))?;
            let kind = bpf_map_type::try_from(map.map_type())
                .ok()
                .and_then(|kind| MapType::try_from(kind).ok())
                .with_context(|| format!("map {name}: unknown type {}", map.map_type()))?;
            let max_entries = sized
                .iter()
                .find(|(sized, _)| *sized == name)
                .map_or(map.max_entries(), |(_, entries)| *entries);
            Ok(MapSpec {
                name,
                kind,
                key_size: map.key_size(),
                value_size: map.value_size(),
                max_entries,
            })
        })
        .collect()
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
    // Which families' sources the tries decide is the policy's, not the flags': the pinned
    // tries an earlier agent filled go on deciding until this one's first sync.
    let sources_decided = settings.get(&0, 0).map_or(0, |s| s.sources_decided);
    let mut written = Settings {
        span_count: spans.len() as u32,
        random_fully: u32::from(random_fully),
        sources_decided,
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
    use aya::maps::MapType;
    use masq_ebpf::{NatEntryV4, NatKeyV6, PolicyEntry, map_names};

    use super::{NatSizes, SlotSeeds, expected_maps};

    /// Both embedded objects went through `bpf_straighten` (build.rs): they hold the jumps to
    /// the next instruction it leaves, and it finds no branch left to straighten in either.
    #[test]
    fn both_embedded_objects_are_straightened() {
        for object in [super::OBJECT, super::SLOT_TABLE_OBJECT] {
            assert!(bpf_straighten::jumps_to_next(object).unwrap() > 100);
            let mut copy = object.to_vec();
            assert_eq!(bpf_straighten::straighten_elf(&mut copy).unwrap(), 0);
            assert_eq!(copy, object);
        }
    }

    /// Each family's halves go in its slot table where the agent uses them, and a family that
    /// translates nothing (IPv6 without `--enable-ipv6`: one entry) takes one entry in each of
    /// its maps, so that `status` reads no table for it.
    #[test]
    fn a_family_that_is_off_takes_no_room_in_either_table() {
        let seeds = SlotSeeds { v4: 1, v6: 1 };
        let entries = |sizes: &NatSizes, names: [&str; 3]| names.map(|n| sizes.entries_of(n));
        let v4 = [
            map_names::NAT_V4,
            map_names::NAT_SLOTS_V4,
            map_names::NAT_SLOT_WORDS_V4,
        ];
        let v6 = [
            map_names::NAT_V6,
            map_names::NAT_SLOTS_V6,
            map_names::NAT_SLOT_WORDS_V6,
        ];
        let both_on = NatSizes::new(4096, 4096, true, seeds);
        for family in [v4, v6] {
            let [hash, slots, words] = entries(&both_on, family);
            assert_eq!(hash, 1, "{family:?}");
            assert!(
                slots >= 4096 && words > 1,
                "{family:?}: {slots} slots, {words} words"
            );
        }
        let v6_off = NatSizes::new(4096, 1, true, seeds);
        assert_eq!(entries(&v6_off, v6), [1, 1, 1]);
        assert_eq!(entries(&v6_off, v4), entries(&both_on, v4));
        let in_hash = NatSizes::new(4096, 4096, false, seeds);
        for family in [v4, v6] {
            assert_eq!(entries(&in_hash, family), [4096, 1, 1], "{family:?}");
        }
    }

    /// What a pinned map is checked against comes from the object: spot checks of its shapes
    /// against the types the agent reads the maps with, and the sizes the loader gives.
    #[test]
    fn pinned_maps_are_checked_against_the_object_s_shapes_at_the_loader_s_sizes() {
        let seeds = SlotSeeds { v4: 0, v6: 0 };
        let specs = expected_maps(&NatSizes::new(4096, 1, false, seeds), 100).unwrap();
        let spec = |name| specs.iter().find(|s| s.name == name).unwrap();
        let trie = spec(map_names::NON_MASQ_V4);
        assert_eq!(trie.kind, MapType::LpmTrie);
        assert_eq!(trie.key_size, 4 + 4, "prefix length, then the address");
        assert_eq!(trie.value_size as usize, size_of::<PolicyEntry>());
        let nat = spec(map_names::NAT_V4);
        assert_eq!((nat.kind, nat.max_entries), (MapType::Hash, 4096));
        assert_eq!(nat.value_size as usize, size_of::<NatEntryV4>());
        assert_eq!(
            spec(map_names::NAT_V6).key_size as usize,
            size_of::<NatKeyV6>()
        );
        assert_eq!(spec(map_names::NAT_V6).max_entries, 1);
        assert_eq!(spec(map_names::DECISIONS).max_entries, 100);
        assert_eq!(specs.len(), map_names::PINNED.len());
    }

    /// The programs name their maps in `#[btf_map(name = ...)]`, which takes no constant; this
    /// holds those literals to `map_names`, without a kernel.
    #[test]
    fn the_object_defines_every_map_the_agent_names() {
        let object = aya_obj::Object::parse(super::OBJECT).expect("the embedded object parses");
        let unpinned = [
            map_names::NON_MASQ_CACHE_V4,
            map_names::NON_MASQ_CACHE_V6,
            map_names::FRAGMENTS_V4,
            map_names::FRAGMENTS_V6,
            map_names::NODE_PORTS,
            map_names::ENTRYLESS_PORTS,
            map_names::DROP_SAMPLE_V4,
            map_names::DROP_SAMPLE_V6,
            map_names::DROP_VACANCY,
            map_names::PORT_REQUEST_V4,
            map_names::PORT_REQUEST_V6,
            map_names::IPV6_WALK,
        ];
        for name in map_names::PINNED.iter().chain(&unpinned) {
            assert!(
                object.maps.contains_key(*name),
                "no map {name} in the object"
            );
        }
        // The maps that are not pinned and are looked for by the name the kernel keeps
        // (`status`, the tests): no other map is kept under it. (Both families' fragment
        // tables, say, are: they are only reached through the programs.)
        for name in [
            map_names::NON_MASQ_INDEX_V4,
            map_names::NON_MASQ_CACHE_V4,
            map_names::NON_MASQ_CACHE_V6,
        ] {
            let kept = map_names::as_the_kernel_keeps(name);
            let alike: Vec<&String> = (object.maps.keys())
                .filter(|other| map_names::as_the_kernel_keeps(other) == kept)
                .collect();
            assert_eq!(alike, [name], "maps the kernel names {kept}");
        }
    }
}
