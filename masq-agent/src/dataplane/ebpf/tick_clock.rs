//! The tick the programs stamp entries by (`masq_ebpf::TickClock`): measured when the agent
//! loads them, by running the probe program, and given to them before they are attached. The
//! kernel advances its tick count from CLOCK_MONOTONIC, a tick of `TICK_NSEC` at a time, so
//! that the count times the tick stays on CLOCK_MONOTONIC, at the start of the current tick.
//! A tick driven by a periodic timer of its own could drift from it, so the agent reads the
//! probe again at every sweep, and moves the offset where the stamps have left their tick
//! (`Tick::keep`).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use aya::{
    Ebpf,
    maps::{Array, MapData},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use masq_ebpf::{TICK_CLOCK_SECTION, TickClock, program_names};

use super::kernel_sweep;

/// Set to `0` to keep the programs on the kernel's clock, as where the agent could not measure
/// the tick.
pub const TICK_CLOCK_ENV: &str = "MASQ_AGENT_TICK_CLOCK";

/// The ticks a second a kernel may be built with (`CONFIG_HZ`).
const KERNEL_HZ: [u64; 4] = [100, 250, 300, 1000];

/// Tick edges the probe's readings must span: two ticks, the first edge's time to the last's.
const EDGES: usize = 3;

/// How long the agent reads the probe at most: three ticks at 100 Hz, and some.
const READ_FOR: Duration = Duration::from_millis(100);

/// The tick the programs stamp by, and the map they read it from.
pub struct Tick {
    clock: TickClock,
    map: Array<MapData, TickClock>,
}

impl Tick {
    /// What the programs stamp by.
    pub fn clock(&self) -> TickClock {
        self.clock
    }

    /// Reads the probe once, and moves the programs' offset where their stamps have left the
    /// tick behind CLOCK_MONOTONIC (`anchored_again`), with a warning.
    pub fn keep(&mut self, probe: &mut SchedClassifier) -> anyhow::Result<()> {
        let reading = read_once(probe, &self.map)?;
        if let Some(anchored) = anchored_again(&self.clock, reading) {
            tracing::warn!(
                moved_ns = anchored.base_ns.wrapping_sub(self.clock.base_ns) as i64,
                "the kernel's tick left CLOCK_MONOTONIC: the programs' stamps moved back onto it"
            );
            self.map
                .set(0, anchored, 0)
                .context("moving the programs' tick")?;
            self.clock = anchored;
        }
        Ok(())
    }
}

/// `clock` anchored again at `reading` (tick count, CLOCK_MONOTONIC), where its stamp of the
/// reading's tick is later than the reading, or earlier by more than a tick, by more than a
/// quarter of a tick either way (what one tick's interrupt may come later than another's): a
/// stamp of that tick is then the reading's time.
pub fn anchored_again(clock: &TickClock, (ticks, monotonic_ns): (u64, u64)) -> Option<TickClock> {
    let behind = monotonic_ns.wrapping_sub(clock.at(ticks)) as i64;
    let leeway = (clock.tick_ns / 4) as i64;
    (behind < -leeway || behind > clock.tick_ns as i64 + leeway).then(|| TickClock {
        base_ns: clock.base_ns.wrapping_add(behind as u64),
        ..*clock
    })
}

/// Measures the tick and gives it to the programs, before they are attached; `None` (after a
/// warning) where the kernel's tick is none of `KERNEL_HZ`, or the environment says so: the
/// programs then read the kernel's clock, as before. The probe stays loaded, for `Tick::keep`.
pub fn give_the_programs_the_tick(ebpf: &mut Ebpf) -> anyhow::Result<Option<Tick>> {
    if std::env::var(TICK_CLOCK_ENV).as_deref() == Ok("0") {
        return Ok(None);
    }
    // Held until the probe is loaded: the loader resolved the probe's reference to it through
    // this descriptor. The other programs hold the map once loaded.
    let mut clock: Array<MapData, TickClock> = ebpf
        .take_map(TICK_CLOCK_SECTION)
        .with_context(|| format!("map {TICK_CLOCK_SECTION} missing from the object"))?
        .try_into()?;
    let probe: &mut SchedClassifier = ebpf
        .program_mut(program_names::CLOCK_PROBE)
        .with_context(|| format!("program {} missing", program_names::CLOCK_PROBE))?
        .try_into()?;
    probe.load().context("loading the clock probe")?;
    let Some(measured) = measure(&read_probe(probe, &clock)?) else {
        tracing::warn!(
            "the kernel's tick is none of {KERNEL_HZ:?} Hz: the programs read its clock, a helper call a packet"
        );
        return Ok(None);
    };
    clock
        .set(0, measured, 0)
        .context("giving the programs the tick")?;
    Ok(Some(Tick {
        clock: measured,
        map: clock,
    }))
}

/// The probe's readings, tick count and CLOCK_MONOTONIC, until they span `EDGES` tick edges, or
/// for `READ_FOR`.
fn read_probe(
    probe: &mut SchedClassifier,
    clock: &Array<MapData, TickClock>,
) -> anyhow::Result<Vec<(u64, u64)>> {
    let until = Instant::now() + READ_FOR;
    let mut readings: Vec<(u64, u64)> = Vec::new();
    let mut edges = 0;
    while Instant::now() < until && edges < EDGES {
        let reading = read_once(probe, clock)?;
        if readings.last().is_some_and(|last| last.0 != reading.0) {
            edges += 1;
        }
        readings.push(reading);
    }
    Ok(readings)
}

/// One run of the probe: its reading of the tick count and CLOCK_MONOTONIC.
fn read_once(
    probe: &mut SchedClassifier,
    clock: &Array<MapData, TickClock>,
) -> anyhow::Result<(u64, u64)> {
    probe
        .test_run(TestRunOptions {
            data_in: Some(&kernel_sweep::frame(0)),
            repeat: 1,
            ..TestRunOptions::new()
        })
        .context("running the clock probe")?;
    let read = clock.get(&0, 0).context("reading the clock probe")?;
    Ok((read.probe_ticks, read.probe_monotonic_ns))
}

/// The readings that are the first of their tick, after one of the tick before.
fn edges(readings: &[(u64, u64)]) -> impl Iterator<Item = (u64, u64)> + '_ {
    readings
        .windows(2)
        .filter(|pair| pair[1].0 != pair[0].0)
        .map(|pair| pair[1])
}

/// The tick clock that `readings` (tick count, CLOCK_MONOTONIC, in order) show: the tick of
/// the `KERNEL_HZ` within a tenth of the time between their first and last edges a tick, and
/// the earliest CLOCK_MONOTONIC at tick 0 any reading allows, so that a stamp is never later
/// than CLOCK_MONOTONIC by more than the readings' error, and lags it by a tick at most, as
/// the kernel's coarse clock does. `None` without two edges, or where a reading is more than
/// two ticks off that clock.
pub fn measure(readings: &[(u64, u64)]) -> Option<TickClock> {
    let (first, last) = (edges(readings).next()?, edges(readings).last()?);
    let ticks = last.0.checked_sub(first.0).filter(|&ticks| ticks > 0)?;
    let per_tick = last.1.checked_sub(first.1)? / ticks;
    let tick_ns = KERNEL_HZ
        .iter()
        .map(|hz| (1_000_000_000 + hz / 2) / hz)
        .find(|&tick_ns| per_tick.abs_diff(tick_ns) * 10 < tick_ns)?;
    let offset = |&(ticks, monotonic_ns): &(u64, u64)| {
        i128::from(monotonic_ns) - i128::from(ticks) * i128::from(tick_ns)
    };
    let base = readings.iter().map(offset).min()?;
    if readings
        .iter()
        .any(|reading| offset(reading) - base > 2 * i128::from(tick_ns))
    {
        return None;
    }
    Some(TickClock {
        tick_ns,
        // Wrapping, as the programs add it: the count starts some minutes short of 2^32.
        base_ns: base as u64,
        ..TickClock::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Readings every `every_ns` from CLOCK_MONOTONIC `from_ns`, of a kernel whose tick count
    /// moves every `tick_ns` and read `tick_0_ns` at 0 (its ticks start some minutes short of
    /// 2^32, before the node booted).
    fn readings(
        tick_ns: u64,
        tick_0_ns: i128,
        from_ns: u64,
        every_ns: u64,
        n: u64,
    ) -> Vec<(u64, u64)> {
        (0..n)
            .map(|i| {
                let now = from_ns + i * every_ns;
                let ticks = ((i128::from(now) - tick_0_ns) / i128::from(tick_ns)) as u64;
                (ticks, now)
            })
            .collect()
    }

    const BOOT: i128 = -(((1u64 << 32) - 300 * 250) as i128) * 4_000_000;

    #[test]
    fn each_kernels_tick_is_found_and_its_stamps_lag_the_clock_by_a_tick_at_most() {
        for hz in KERNEL_HZ {
            let tick_ns = (1_000_000_000 + hz / 2) / hz;
            let tick_0 = -(((1u64 << 32) - 300 * hz) as i128) * i128::from(tick_ns);
            let read = readings(tick_ns, tick_0, 5_000_000_000_000, 7_919, 40_000);
            let clock = measure(&read).unwrap_or_else(|| panic!("{hz} Hz"));
            assert_eq!(clock.tick_ns, tick_ns, "{hz} Hz");
            for (ticks, now) in read {
                let stamp = clock.at(ticks);
                assert!(
                    stamp <= now && now - stamp <= tick_ns,
                    "{hz} Hz: {stamp} at {now}"
                );
            }
        }
    }

    #[test]
    fn a_tick_of_no_kernel_or_a_count_that_never_moves_is_no_clock() {
        // 200 Hz: between 250 and 100, within a tenth of neither.
        assert_eq!(
            measure(&readings(5_000_000, BOOT, 1 << 40, 1000, 20_000)),
            None
        );
        assert_eq!(measure(&[(7, 1), (7, 2), (7, 3)]), None);
        assert_eq!(measure(&[]), None);
    }

    #[test]
    fn a_clock_is_anchored_again_only_where_its_stamps_left_the_tick_behind_the_clock() {
        let clock = measure(&readings(4_000_000, BOOT, 1 << 40, 10_000, 3_000)).unwrap();
        let ticks = 1_000_000u64;
        let at_tick = clock.at(ticks);
        for reading in [
            at_tick - 1_000_000,
            at_tick,
            at_tick + 4_000_000,
            at_tick + 5_000_000,
        ] {
            assert_eq!(anchored_again(&clock, (ticks, reading)), None);
        }
        for (off, reading) in [
            ("behind", (ticks, at_tick + 5_000_001)),
            ("ahead", (ticks, at_tick - 1_000_001)),
            ("far ahead", (ticks + 1000, at_tick)),
        ] {
            let anchored = anchored_again(&clock, reading).expect(off);
            assert_eq!(anchored.at(reading.0), reading.1, "{off}");
            assert_eq!(anchored.tick_ns, clock.tick_ns);
        }
    }

    #[test]
    fn a_reading_two_ticks_off_the_others_is_no_clock() {
        let mut read = readings(4_000_000, BOOT, 1 << 40, 10_000, 3_000);
        read.push((read.last().unwrap().0, read.last().unwrap().1 + 9_000_000));
        assert_eq!(measure(&read), None);
    }
}
