//! Where the halves of the NAT table's flows are kept: the one place the programs find, make,
//! remove and walk them, so that what holds them can change behind it (a table of the
//! programs' own, docs/bench/profiles.md, "The first packet"). Each family's halves are
//! elements of a kernel hash table keyed by `NatKey` (`nat_v4`, `nat_v6`).

use core::ffi::c_void;

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::generated::bpf_for_each_map_elem};
use masq_ebpf::{NatEntry, NatKey};

use crate::family::Family;

/// Why a half could not be made: the table holds a half of that key (`exists`), another
/// flow's or the same flow's made first; or there is no room for it.
pub struct InsertError(i32);

impl InsertError {
    #[inline(always)]
    pub fn exists(&self) -> bool {
        self.0 == EEXIST
    }
}

const EEXIST: i32 = -17;

/// The half of `key`, written in place by whoever holds it: the data path's updates of a half
/// race benignly, each writing what a recent packet saw.
#[inline(always)]
pub fn find<F: Family>(key: &NatKey<F::Addr>) -> Option<*mut NatEntry<F::Addr>> {
    F::nat().get_ptr_mut(key)
}

/// The half of `key`, to read only.
///
/// # Safety
/// Another CPU may update or remove the half meanwhile: what is read must be copied before
/// anything is removed, or only compared.
#[inline(always)]
pub unsafe fn read<F: Family>(key: &NatKey<F::Addr>) -> Option<&'static NatEntry<F::Addr>> {
    // SAFETY: as the caller promises.
    unsafe { F::nat().get(key) }
}

/// Makes the half of `key` if the table holds none: of two CPUs that make the same key at
/// once, one does, and the other is told it `exists`; that is how two flows never get one port.
#[inline(always)]
pub fn insert_new<F: Family>(
    key: &NatKey<F::Addr>,
    entry: &NatEntry<F::Addr>,
) -> Result<(), InsertError> {
    // By reference: copies for the helper would take the callers' frames past the verifier's
    // limit.
    F::nat()
        .insert(key, entry, BPF_NOEXIST as u64)
        .map_err(InsertError)
}

/// Removes the half of `key`; an error (the helper's) if the table no longer held it: another
/// CPU, or the sweep, removed it first. (The helper's result as it is: made into a `bool`, or
/// an error of another type, where most callers ignore it, it costs `masq_reserve_port_v6` 16
/// bytes of stack.)
#[inline(always)]
pub fn remove<F: Family>(key: &NatKey<F::Addr>) -> Result<(), i32> {
    F::nat().remove(key)
}

/// What `walk` calls for each half: the table, the half's key and entry (valid for the call),
/// and the context. Returns 0 to go on, 1 to stop.
pub type Visit<F, C> = extern "C" fn(
    *mut c_void,
    *const NatKey<<F as Family>::Addr>,
    *const NatEntry<<F as Family>::Addr>,
    *mut C,
) -> i64;

/// Calls `visit` for each half the table holds (`bpf_for_each_map_elem`, Linux 5.13), with
/// `context`. Halves removed or made during the walk may be skipped or visited twice: a
/// removed element goes back to the free list and may come back at once, in another bucket.
#[inline(always)]
pub fn walk<F: Family, C>(visit: Visit<F, C>, context: &mut C) {
    // SAFETY: the table is a hash map the object declares, and `visit` a static function of
    // the signature the helper calls, which the verifier checks against the map's key and
    // value.
    unsafe {
        bpf_for_each_map_elem(
            core::ptr::from_ref(F::nat()).cast_mut().cast(),
            visit as *mut c_void,
            core::ptr::from_mut(context).cast(),
            0,
        );
    }
}
