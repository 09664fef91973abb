//! Help for the verifier, which walks every path through a program separately until the
//! states it reaches can be told equal. A value that comes out of a branchy computation (a
//! header chain walked, a port picked from spans) differs on every path, and so does the
//! verification of everything after it: past a few such values, beyond the verifier's limit.

use aya_ebpf::programs::TcContext;

/// Declares a step of the translation that a family with `Family::OWN_FRAMES` runs as a BPF
/// function of its own, and any other inline. The verifier allows 512 bytes of stack along a
/// chain of calls: IPv6's sixteen-byte addresses, and the spills they cause, would overflow
/// one function holding every step at once; for IPv4 each call would be cost without need.
macro_rules! step {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident<F: Family>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        #[inline(always)]
        $vis fn $name<F: Family>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn inline<F: Family>($($arg: $ty),*) $(-> $ret)? $body

            // Named after the step, so that bpftool's dumps and the verifier budget name it.
            #[inline(never)]
            fn $name<F: Family>($($arg: $ty),*) $(-> $ret)? {
                inline::<F>($($arg),*)
            }

            if F::OWN_FRAMES {
                $name::<F>($($arg),*)
            } else {
                inline::<F>($($arg),*)
            }
        }
    };
}

/// A helper's result as a `step!` returns it: a BPF function gives back one register, and an
/// aggregate only through a pointer the verifier refuses. 0 for success, the error otherwise.
#[inline(always)]
pub fn code(result: Result<(), i64>) -> i64 {
    result.err().unwrap_or(0)
}

/// The other way round.
#[inline(always)]
pub fn result(code: i64) -> Result<(), i64> {
    match code {
        0 => Ok(()),
        err => Err(err),
    }
}

/// `value`, as the verifier sees a value it knows nothing of: read back from the skb's control
/// block, whose contents it does not track. Every path that produced `value` meets the others
/// here as one. The control block is left as it was found. The caller bounds the result again.
#[inline(always)]
pub fn forget(ctx: &TcContext, value: u32) -> u32 {
    // SAFETY: `cb` is the skb's scratch area, which tc programs may read and write.
    unsafe {
        let cb = &raw mut (*ctx.skb.skb).cb[0];
        let saved = cb.read_volatile();
        let forgotten = forget_in(&mut *cb, value);
        cb.write_volatile(saved);
        forgotten
    }
}

/// `forget`, through `cell`: memory whose contents the verifier does not track, as a map
/// value's (where a global BPF function, which has no skb, keeps one).
#[inline(always)]
pub fn forget_in(cell: &mut u32, value: u32) -> u32 {
    let cell: *mut u32 = cell;
    // SAFETY: a valid, exclusive reference; volatile, so that the compiler keeps the round trip.
    unsafe {
        cell.write_volatile(value);
        cell.read_volatile()
    }
}
