//! The `bpf(2)` commands aya has no binding for, or binds only with more privilege than the
//! agent holds: the batch reads, writes and deletes of whole tables (`batch`), and the query of a
//! device's TCX programs by id (`attach`), which aya follows with a lookup of each program by
//! id that needs CAP_SYS_ADMIN; and the lookup of one slot of a per-CPU array, the batch's
//! fallback on kernels before 5.13; and the map of maps whose update waits for the program runs
//! in flight (`interfaces`).

use std::{
    io,
    os::fd::{FromRawFd as _, OwnedFd},
};

/// Numbers from the kernel's `enum bpf_cmd` (include/uapi/linux/bpf.h).
pub mod cmd {
    pub const BPF_MAP_CREATE: libc::c_long = 0;
    pub const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    pub const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    pub const BPF_PROG_QUERY: libc::c_long = 16;
    pub const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    pub const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    pub const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
}

/// Runs `cmd` with `attr`, one member of `union bpf_attr` laid out as the kernel declares it.
///
/// # Safety
/// `attr` must be that member for `cmd`, and every pointer in it valid for what the kernel
/// reads or writes through it.
pub unsafe fn bpf<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<()> {
    // SAFETY: as the caller promises.
    unsafe { bpf_returning(cmd, attr) }.map(|_| ())
}

/// `bpf` for a command that makes a descriptor, which it returns.
///
/// # Safety
/// As for `bpf`.
pub unsafe fn bpf_fd<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<OwnedFd> {
    // SAFETY: as the caller promises.
    let fd = unsafe { bpf_returning(cmd, attr) }?;
    let fd = i32::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: a descriptor the kernel just made for this process, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// # Safety
/// As for `bpf`.
unsafe fn bpf_returning<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<libc::c_long> {
    // SAFETY: as the caller promises; the size passed is the member's own.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut A, size_of::<A>()) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// The `elem` member of `union bpf_attr`: a map's key and value, by address.
#[repr(C)]
#[derive(Default)]
pub struct ElemAttr {
    pub map_fd: u32,
    pub _pad: u32,
    pub key: u64,
    pub value: u64,
    pub flags: u64,
}

/// The first fields of the `map_create` member of `union bpf_attr`, all a map without a name or
/// BTF needs: the kernel takes the fields past them as zero.
#[repr(C)]
#[derive(Default)]
pub struct MapCreateAttr {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
    pub inner_map_fd: u32,
}
