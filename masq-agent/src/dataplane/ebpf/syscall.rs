//! The `bpf(2)` commands aya has no binding for, or binds only with more privilege than the
//! agent holds: the batch reads, writes and deletes of whole tables (`batch`), and the query of a
//! device's TCX programs by id (`attach`), which aya follows with a lookup of each program by
//! id that needs CAP_SYS_ADMIN; and the lookup of one slot of a per-CPU array, the batch's
//! fallback on kernels before 5.13.

use std::io;

/// Numbers from the kernel's `enum bpf_cmd` (include/uapi/linux/bpf.h).
pub mod cmd {
    pub const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
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
    // SAFETY: as the caller promises; the size passed is the member's own.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut A, size_of::<A>()) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}
