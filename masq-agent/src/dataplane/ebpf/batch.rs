//! Whole-table reads, writes and deletes with the kernel's batch commands
//! (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`): a few system calls per table, where key-by-key iteration takes two
//! per entry. A full NAT table holds half a million entries, and the sweep reads it every ten
//! seconds; the decision counters hold a slot per policy entry, and every metrics scrape reads
//! them. aya has no binding for these commands (see `syscall`).

use std::{
    io,
    mem::MaybeUninit,
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::{Pod, maps::MapData};

use super::syscall::{
    ElemAttr,
    cmd::{BPF_MAP_DELETE_BATCH, BPF_MAP_LOOKUP_BATCH, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_BATCH},
};
/// Entries per call. A hash bucket must fit in one call; the kernel says ENOSPC if not, and
/// the call is retried with more room.
const CHUNK: usize = 4096;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid `batch` attribute whose pointers the caller keeps alive and
    // sized for `count` entries.
    unsafe { super::syscall::bpf(cmd, attr) }
}

fn fd(map: &MapData) -> u32 {
    map.fd().as_fd().as_raw_fd() as u32
}

/// Every entry of the hash map `map`, whose key and value types are `K` and `V`.
pub fn lookup_all<K: Pod, V: Pod>(map: &MapData) -> io::Result<Vec<(K, V)>> {
    let mut entries = Vec::new();
    lookup_each::<K>(map, size_of::<V>(), |key, value| {
        // SAFETY: the kernel wrote `size_of::<V>()` bytes of a `V` there, possibly unaligned.
        entries.push((key, unsafe { value.as_ptr().cast::<V>().read_unaligned() }));
    })?;
    Ok(entries)
}

/// Every slot of the per-CPU array `map` of `u64`s, summed over the CPUs. Kernels before 5.13
/// have no batch command for per-CPU arrays: there, slot by slot.
pub fn per_cpu_totals(map: &MapData) -> io::Result<Vec<u64>> {
    let cpus = aya::util::nr_cpus().map_err(|(_, err)| err)?;
    match per_cpu_totals_batched(map, cpus) {
        // ENOTSUPP, which libc does not name.
        Err(err) if matches!(err.raw_os_error(), Some(524 | libc::EINVAL)) => {
            per_cpu_totals_by_slot(map, cpus)
        }
        totals => totals,
    }
}

/// The sum over the CPUs of one per-CPU value laid out as the kernel lays it: one
/// eight-byte-aligned copy per possible CPU.
fn sum_over_cpus(values: &[u8]) -> u64 {
    values
        .chunks_exact(size_of::<u64>())
        .map(|bytes| u64::from_ne_bytes(bytes.try_into().expect("eight bytes")))
        .fold(0u64, u64::wrapping_add)
}

/// `per_cpu_totals` slot by slot, as on kernels before 5.13.
pub fn per_cpu_totals_by_slot(map: &MapData, cpus: usize) -> io::Result<Vec<u64>> {
    let slots = map.info().map_err(io::Error::other)?.max_entries();
    let mut values = vec![0u8; cpus * size_of::<u64>()];
    (0..slots)
        .map(|slot| {
            let mut attr = ElemAttr {
                map_fd: fd(map),
                key: &slot as *const u32 as u64,
                value: values.as_mut_ptr() as u64,
                ..ElemAttr::default()
            };
            // SAFETY: `elem` points at a four-byte key and room for a value per CPU.
            unsafe { super::syscall::bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) }?;
            Ok(sum_over_cpus(&values))
        })
        .collect()
}

/// `per_cpu_totals` with the batch command.
pub fn per_cpu_totals_batched(map: &MapData, cpus: usize) -> io::Result<Vec<u64>> {
    let mut totals = Vec::new();
    // The kernel lays a per-CPU value out as one eight-byte-aligned copy per possible CPU.
    lookup_each::<u32>(map, cpus * size_of::<u64>(), |slot, values| {
        let total = sum_over_cpus(values);
        let slot = slot as usize;
        if totals.len() <= slot {
            totals.resize(slot + 1, 0);
        }
        totals[slot] = total;
    })?;
    Ok(totals)
}

/// The values of the array `map`'s first `count` slots, or of all its slots where it has
/// fewer, read with the batch command (Linux 5.6), which reads them in slot order.
pub fn array_head<V: Pod>(map: &MapData, count: usize) -> io::Result<Vec<V>> {
    let mut values = Vec::with_capacity(count);
    lookup_first::<u32>(map, size_of::<V>(), count, |_, value| {
        // SAFETY: the kernel wrote `size_of::<V>()` bytes of a `V` there, possibly unaligned.
        values.push(unsafe { value.as_ptr().cast::<V>().read_unaligned() });
    })?;
    Ok(values)
}

/// Hands each entry of `map` to `each`: its key, of type `K`, and its value's `value_size`
/// bytes.
fn lookup_each<K: Pod>(
    map: &MapData,
    value_size: usize,
    each: impl FnMut(K, &[u8]),
) -> io::Result<()> {
    lookup_first(map, value_size, usize::MAX, each)
}

/// `lookup_each`, for the map's first `count` entries at most (in a hash map, the first the
/// kernel's walk finds).
fn lookup_first<K: Pod>(
    map: &MapData,
    value_size: usize,
    count: usize,
    mut each: impl FnMut(K, &[u8]),
) -> io::Result<()> {
    let (mut left, mut chunk) = (count, CHUNK);
    let mut keys: Vec<MaybeUninit<K>> = Vec::new();
    let mut values: Vec<u8> = Vec::new();
    // The kernel's cursor: where the last call stopped. Hash maps and arrays use four bytes
    // of it.
    let (mut cursor, mut started) = (0u64, false);
    while left > 0 {
        let asked = chunk.min(left);
        keys.resize(asked, MaybeUninit::uninit());
        values.resize(asked * value_size, 0);
        let mut next = 0u64;
        let mut attr = BatchAttr {
            in_batch: if started {
                &cursor as *const u64 as u64
            } else {
                0
            },
            out_batch: &mut next as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: asked as u32,
            map_fd: fd(map),
            ..BatchAttr::default()
        };
        let result = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        // A call that failed otherwise than at the table's end may leave `count` as it was:
        // none of the entries is the kernel's.
        let filled = match &result {
            Err(err) if err.raw_os_error() != Some(libc::ENOENT) => 0,
            _ => (attr.count as usize).min(asked),
        };
        for (i, value) in values.chunks_exact(value_size).take(filled).enumerate() {
            // SAFETY: the kernel filled the first `count` keys.
            each(unsafe { keys[i].assume_init() }, value);
        }
        left -= filled;
        match result {
            Ok(()) => {
                cursor = next;
                started = true;
            }
            // The end of the table; the last call may still have returned entries.
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            // A bucket larger than the call's room; no more room than `left` is asked for.
            Err(err) if err.raw_os_error() == Some(libc::ENOSPC) && filled == 0 && chunk < left => {
                chunk *= 2;
            }
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Writes `values` into the slots `0..values.len()` of the array `map` (Linux 5.6).
pub fn fill_array<V: Pod>(map: &MapData, values: &[V]) -> io::Result<()> {
    let slots: Vec<u32> = (0..values.len() as u32).collect();
    update_array(map, &slots, values)
}

/// Writes `values` into the array map `map`, each into the slot of `slots` at its place.
pub fn update_array<V: Pod>(map: &MapData, slots: &[u32], values: &[V]) -> io::Result<()> {
    assert_eq!(slots.len(), values.len(), "a slot for each value");
    let mut start = 0;
    while start < values.len() {
        let take = (values.len() - start).min(CHUNK);
        let mut attr = BatchAttr {
            keys: slots[start..].as_ptr() as u64,
            values: values[start..].as_ptr() as u64,
            count: take as u32,
            map_fd: fd(map),
            ..BatchAttr::default()
        };
        bpf(BPF_MAP_UPDATE_BATCH, &mut attr)?;
        start += take;
    }
    Ok(())
}

/// Deletes `keys` from the hash map `map`. Keys already gone (the data path or another sweep
/// got there first) are skipped. Returns how many were deleted.
pub fn delete_all<K: Pod>(map: &MapData, keys: &[K]) -> io::Result<usize> {
    let mut deleted = 0;
    let mut rest = keys;
    while !rest.is_empty() {
        let take = rest.len().min(CHUNK);
        let mut attr = BatchAttr {
            keys: rest.as_ptr() as u64,
            count: take as u32,
            map_fd: fd(map),
            ..BatchAttr::default()
        };
        let result = bpf(BPF_MAP_DELETE_BATCH, &mut attr);
        // The kernel stops at the first key it cannot delete and says how many it did.
        let done = (attr.count as usize).min(take);
        deleted += done;
        match result {
            Ok(()) => rest = &rest[take..],
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => rest = &rest[done + 1..],
            Err(err) => return Err(err),
        }
    }
    Ok(deleted)
}
