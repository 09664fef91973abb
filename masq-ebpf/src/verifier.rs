//! Help for the verifier, which walks every path through a program separately until the
//! states it reaches can be told equal. A value that comes out of a branchy computation (a
//! header chain walked, a port picked from spans) differs on every path, and so does the
//! verification of everything after it: past a few such values, beyond the verifier's limit.

use aya_ebpf::programs::TcContext;

/// `value`, as the verifier sees a value it knows nothing of: read back from the skb's control
/// block, whose contents it does not track. Every path that produced `value` meets the others
/// here as one. The control block is left as it was found. The caller bounds the result again.
#[inline(always)]
pub fn forget(ctx: &TcContext, value: u32) -> u32 {
    // SAFETY: `cb` is the skb's scratch area, which tc programs may read and write.
    unsafe {
        let cb = &raw mut (*ctx.skb.skb).cb[0];
        let saved = cb.read_volatile();
        cb.write_volatile(value);
        let forgotten = cb.read_volatile();
        cb.write_volatile(saved);
        forgotten
    }
}
