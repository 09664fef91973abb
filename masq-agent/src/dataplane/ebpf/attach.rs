//! Attaching the classifiers to devices. On kernels with TCX (>= 6.6) every attachment is a
//! link pinned under bpffs: it outlives the agent, and a restarted agent swaps its new program
//! into the same link atomically, so no packet ever misses translation. Older kernels get a
//! clsact filter through netlink, at a priority and handle of the agent's own: it too outlives
//! the agent, and a restarted agent replaces the program in that filter in one step
//! (`cls_bpf` swaps it under RCU), so that there too no packet misses translation.

use std::path::Path;

use super::{hook::Hook, tc_filters};
use anyhow::Context as _;
use aya::{
    programs::{
        SchedClassifier,
        links::{FdLink, Link as _, LinkOrder, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
    util::KernelVersion,
};

/// Set to force netlink (clsact) attachment, to exercise the path older kernels take.
pub const FORCE_NETLINK_ENV: &str = "MASQ_AGENT_TC_NETLINK";

/// How a program is attached to one device and hook. Dropping it leaves the program attached.
pub enum Attachment {
    /// A TCX link, pinned: it stays when the agent exits.
    Tcx(FdLink),
    /// A clsact filter; forgotten on drop so that it, too, stays when the agent exits.
    Netlink(Option<SchedClassifierLink>),
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if let Attachment::Netlink(link) = self {
            std::mem::forget(link.take());
        }
    }
}

/// Where the programs' clsact filters sit, on kernels without TCX: a priority of their own (an
/// arbitrary mark, "MA"), and handle 1, at both hooks. tc lists them as `pref 19777 bpf ...
/// handle 0x1 masq_egress direct-action`.
pub const NETLINK_PRIORITY: u16 = 0x4d41;
pub const NETLINK_HANDLE: u32 = 1;

fn netlink_handle() -> TcHandle {
    TcHandle::new((NETLINK_HANDLE >> 16) as u16, NETLINK_HANDLE as u16)
}

pub fn uses_tcx() -> bool {
    std::env::var_os(FORCE_NETLINK_ENV).is_none()
        && KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

/// Attaches `prog` to `device` at `hook`, taking over the pinned link at `pin` if an earlier
/// agent left one there.
pub fn attach(
    prog: &mut SchedClassifier,
    device: &str,
    hook: Hook,
    pin: &Path,
) -> anyhow::Result<Attachment> {
    if !uses_tcx() {
        return attach_netlink(prog, device, hook);
    }
    if pin.exists() {
        match replace_pinned(prog, device, hook, pin) {
            Ok(link) => return Ok(Attachment::Tcx(link)),
            Err(err) => {
                tracing::warn!(
                    device,
                    hook = hook.name(),
                    "pinned link unusable, attaching anew: {err:#}"
                );
                std::fs::remove_file(pin)
                    .with_context(|| format!("removing the unusable pin {}", pin.display()))?;
            }
        }
    }
    let id = prog
        .attach_with_options(
            device,
            hook.attach_type(),
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .with_context(|| format!("attaching to {device} {}", hook.name()))?;
    let link: FdLink = prog.take_link(id)?.try_into()?;
    let pinned = link
        .pin(pin)
        .with_context(|| format!("pinning {}", pin.display()))?;
    Ok(Attachment::Tcx(pinned.into()))
}

/// Swaps `prog` into the link an earlier agent pinned, in one step (`BPF_LINK_UPDATE`).
fn replace_pinned(
    prog: &mut SchedClassifier,
    device: &str,
    hook: Hook,
    pin: &Path,
) -> anyhow::Result<FdLink> {
    let link: FdLink = PinnedLink::from_pin(pin)?.into();
    let link = SchedClassifierLink::try_from(link)?;
    let id = prog.attach_to_link(link)?;
    let link: FdLink = prog.take_link(id)?.try_into()?;
    // A link whose device was deleted and recreated no longer points at the device.
    if !is_attached(prog, device, hook)? {
        anyhow::bail!("the pinned link is no longer attached to {device}");
    }
    Ok(link)
}

/// Attaches `prog` as the clsact filter at the agent's priority and handle: replacing the
/// program of the filter an earlier agent left there, in one step, or creating the filter.
fn attach_netlink(
    prog: &mut SchedClassifier,
    device: &str,
    hook: Hook,
) -> anyhow::Result<Attachment> {
    // An existing clsact qdisc is fine.
    let _ = tc::qdisc_add_clsact(device);
    let ours = SchedClassifierLink::attached(
        device,
        hook.attach_type(),
        NETLINK_PRIORITY,
        netlink_handle(),
        None,
    )
    .with_context(|| format!("no device {device}"))?;
    let id = match prog.attach_to_link(ours) {
        Ok(id) => id,
        // No filter there yet: create it.
        Err(_) => {
            if let Some(name) = prog_name(prog) {
                // An agent from before the fixed priority attached wherever the kernel chose.
                remove_stray_filters(device, hook, &name);
            }
            prog.attach_with_options(
                device,
                hook.attach_type(),
                TcAttachOptions::Netlink(NlOptions {
                    priority: NETLINK_PRIORITY,
                    handle: netlink_handle(),
                    ..NlOptions::default()
                }),
            )
            .with_context(|| format!("attaching to {device} {} via netlink", hook.name()))?
        }
    };
    Ok(Attachment::Netlink(Some(prog.take_link(id)?)))
}

/// Removes filters named `name` at `device`'s `hook` other than the agent's own.
fn remove_stray_filters(device: &str, hook: Hook, name: &str) {
    let Ok(filters) = tc_filters::list(device, hook) else {
        return;
    };
    for filter in filters {
        let ours = filter.priority == NETLINK_PRIORITY && filter.handle == NETLINK_HANDLE;
        if filter.name != name || ours {
            continue;
        }
        let handle = TcHandle::new((filter.handle >> 16) as u16, filter.handle as u16);
        if let Ok(link) =
            SchedClassifierLink::attached(device, hook.attach_type(), filter.priority, handle, None)
        {
            let _ = link.detach();
        }
    }
}

fn prog_name(prog: &SchedClassifier) -> Option<String> {
    prog.info().ok()?.name_as_str().map(String::from)
}

/// Whether `prog` currently runs at `device`'s `hook`.
pub fn is_attached(prog: &SchedClassifier, device: &str, hook: Hook) -> anyhow::Result<bool> {
    runs(prog.info()?.id(), device, hook)
}

/// Whether the program `id` runs at `device`'s `hook`: through TCX, or as a clsact filter.
pub fn runs(id: u32, device: &str, hook: Hook) -> anyhow::Result<bool> {
    if uses_tcx() {
        Ok(tcx_program_ids(device, hook)?.contains(&id))
    } else {
        Ok(tc_filters::list(device, hook)?
            .iter()
            .any(|f| f.program_id == id))
    }
}

/// The ids of the programs TCX runs at `device`'s `hook`. The query needs CAP_NET_ADMIN only;
/// aya's `query_tcx` also opens each program by id, which needs CAP_SYS_ADMIN.
fn tcx_program_ids(device: &str, hook: Hook) -> anyhow::Result<Vec<u32>> {
    /// The `query` member of `union bpf_attr`, as of kernel 6.6.
    #[repr(C)]
    #[derive(Default)]
    struct QueryAttr {
        target_ifindex: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        count: u32,
        _pad: u32,
        prog_attach_flags: u64,
        link_ids: u64,
        link_attach_flags: u64,
        revision: u64,
    }
    /// `enum bpf_attach_type`.
    const BPF_TCX_INGRESS: u32 = 46;
    const BPF_TCX_EGRESS: u32 = 47;
    /// More programs than any device carries; the kernel says ENOSPC if not.
    const ROOM: usize = 64;

    let ifindex =
        nix::net::if_::if_nametoindex(device).with_context(|| format!("no device {device}"))?;
    let mut ids = vec![0u32; ROOM];
    let mut attr = QueryAttr {
        target_ifindex: ifindex,
        attach_type: match hook {
            Hook::Egress => BPF_TCX_EGRESS,
            Hook::Ingress => BPF_TCX_INGRESS,
        },
        prog_ids: ids.as_mut_ptr() as u64,
        count: ROOM as u32,
        ..QueryAttr::default()
    };
    // SAFETY: `attr` is the `query` member, and `prog_ids` has room for `count` ids.
    unsafe { super::syscall::bpf(super::syscall::cmd::BPF_PROG_QUERY, &mut attr) }
        .with_context(|| format!("querying the programs at {device} {}", hook.name()))?;
    ids.truncate(attr.count as usize);
    Ok(ids)
}

/// Takes `program` off `device`'s `hook`: unpins its link (the agent holds no other reference
/// to it by now) and removes clsact filters of that name. A device already gone took its
/// attachments with it; only the pin was left.
pub fn detach(device: &str, hook: Hook, pin: &Path, program: &str) {
    if let Err(err) = std::fs::remove_file(pin)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(pin = %pin.display(), "could not unpin a link: {err}");
    }
    let _ = tc::qdisc_detach_program(device, hook.attach_type(), program);
}

/// Removes every pinned link under `links_dir`, which detaches their programs, and any clsact
/// filters named after our programs on `devices`.
pub fn detach_all(
    links_dir: &Path,
    devices: &[String],
    program_names: &[&str],
) -> anyhow::Result<()> {
    if let Ok(entries) = std::fs::read_dir(links_dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            match PinnedLink::from_pin(&path) {
                Ok(link) => drop(link.unpin()?),
                Err(_) => std::fs::remove_file(&path)?,
            }
        }
    }
    for device in devices {
        for hook in Hook::BOTH {
            for name in program_names {
                let _ = tc::qdisc_detach_program(device, hook.attach_type(), name);
            }
        }
    }
    Ok(())
}
