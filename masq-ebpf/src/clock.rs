//! The time entries are stamped with: CLOCK_MONOTONIC, at tick precision, which is all that
//! expiry in seconds needs. Read from the kernel's tick count where the agent measured the tick
//! (`TickClock`): a load, where the kernel's clocks are a helper call each packet.

use aya_ebpf::{
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    macros::classifier,
    programs::TcContext,
};
use masq_ebpf::TickClock;

/// `global_names::COARSE_CLOCK`: 0 (the precise clock, which every kernel has) unless the
/// agent says the kernel has the coarse one.
#[unsafe(no_mangle)]
static MASQ_COARSE_CLOCK: u8 = 0;

/// `TICK_CLOCK_SECTION`: the tick and its offset written by the agent before the programs
/// are attached, and the offset again where their stamps leave CLOCK_MONOTONIC (its
/// `Tick::keep`, at a sweep); the probe's reading written by the probe, whenever the agent runs
/// it, and read by no other program.
#[unsafe(link_section = ".data.masq_tick_clock")]
#[unsafe(no_mangle)]
static mut MASQ_TICK_CLOCK: TickClock = TickClock {
    tick_ns: 0,
    base_ns: 0,
    probe_ticks: 0,
    probe_monotonic_ns: 0,
};

/// CLOCK_MONOTONIC, now.
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: reads of globals, volatile so that the compiler keeps them: the tick clock, which
    // the agent writes before the programs run; the coarse clock's flag, for the verifier to
    // read as the constant the agent set. The helpers have no preconditions.
    unsafe {
        let tick_ns = core::ptr::read_volatile(&raw const MASQ_TICK_CLOCK.tick_ns);
        if tick_ns != 0 {
            let clock = TickClock {
                tick_ns,
                base_ns: core::ptr::read_volatile(&raw const MASQ_TICK_CLOCK.base_ns),
                ..TickClock::default()
            };
            clock.at(bpf_jiffies64())
        } else if core::ptr::read_volatile(&MASQ_COARSE_CLOCK) != 0 {
            bpf_ktime_get_coarse_ns()
        } else {
            bpf_ktime_get_ns()
        }
    }
}

/// `program_names::CLOCK_PROBE`: one reading of both clocks.
#[classifier]
pub fn masq_clock_probe(_ctx: TcContext) -> i32 {
    // SAFETY: writes to a global that only this program writes while the agent measures, and
    // no other program reads then (none is attached). The helpers have no preconditions.
    unsafe {
        let ticks = bpf_jiffies64();
        let monotonic_ns = bpf_ktime_get_ns();
        core::ptr::write_volatile(&raw mut MASQ_TICK_CLOCK.probe_ticks, ticks);
        core::ptr::write_volatile(&raw mut MASQ_TICK_CLOCK.probe_monotonic_ns, monotonic_ns);
    }
    0
}
