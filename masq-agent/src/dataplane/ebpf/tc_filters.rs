//! The BPF filters at a device's clsact hooks, as the kernel lists them over rtnetlink
//! (`RTM_GETTFILTER`): where the programs run on kernels without TCX (before 6.6), which keep
//! no link to read back. aya attaches filters but cannot list them.

use std::{io, os::fd::AsRawFd as _};

use anyhow::Context as _;
use nix::sys::socket::{
    AddressFamily, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send, socket,
};

use super::hook::Hook;

/// One BPF filter at a clsact hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    /// The program it runs, and the name it was attached under.
    pub program_id: u32,
    pub name: String,
}

// From include/uapi/linux/rtnetlink.h, netlink.h and pkt_sched.h / pkt_cls.h.
const RTM_NEWTFILTER: u16 = 44;
const RTM_GETTFILTER: u16 = 46;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_ID: u16 = 11;
/// `TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)` and `..._EGRESS`.
const CLSACT_INGRESS: u32 = 0xffff_fff2;
const CLSACT_EGRESS: u32 = 0xffff_fff3;
const NLMSG_HDRLEN: usize = 16;
const TCMSG_LEN: usize = 20;

fn parent(hook: Hook) -> u32 {
    match hook {
        Hook::Ingress => CLSACT_INGRESS,
        Hook::Egress => CLSACT_EGRESS,
    }
}

/// The BPF filters at `device`'s `hook`. A device without a clsact qdisc has none.
pub fn list(device: &str, hook: Hook) -> anyhow::Result<Vec<Filter>> {
    let ifindex =
        nix::net::if_::if_nametoindex(device).with_context(|| format!("no device {device}"))?;
    let sock = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )
    .context("opening a netlink socket")?;
    bind(sock.as_raw_fd(), &NetlinkAddr::new(0, 0)).context("binding a netlink socket")?;

    let mut request = Vec::with_capacity(NLMSG_HDRLEN + TCMSG_LEN);
    request.extend(((NLMSG_HDRLEN + TCMSG_LEN) as u32).to_ne_bytes());
    request.extend(RTM_GETTFILTER.to_ne_bytes());
    request.extend((NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    request.extend(1u32.to_ne_bytes()); // sequence
    request.extend(0u32.to_ne_bytes()); // port id: the kernel's
    // struct tcmsg: family, padding, ifindex, handle, parent, info.
    request.extend([libc::AF_UNSPEC as u8, 0, 0, 0]);
    request.extend((ifindex as i32).to_ne_bytes());
    request.extend(0u32.to_ne_bytes());
    request.extend(parent(hook).to_ne_bytes());
    request.extend(0u32.to_ne_bytes());
    send(
        sock.as_raw_fd(),
        &request,
        nix::sys::socket::MsgFlags::empty(),
    )
    .context("asking for the device's filters")?;

    let mut filters = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = recv(
            sock.as_raw_fd(),
            &mut buffer,
            nix::sys::socket::MsgFlags::empty(),
        )
        .context("reading the device's filters")?;
        let mut rest = &buffer[..n];
        while rest.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes(rest[4..6].try_into().expect("2 bytes"));
            if len < NLMSG_HDRLEN || len > rest.len() {
                anyhow::bail!("a malformed netlink message");
            }
            let body = &rest[NLMSG_HDRLEN..len];
            match kind {
                NLMSG_DONE => return Ok(filters),
                NLMSG_ERROR => {
                    let errno = i32::from_ne_bytes(body[0..4].try_into().expect("4 bytes"));
                    // No clsact qdisc on the device: no filters.
                    if errno == -libc::EINVAL || errno == -libc::ENOENT {
                        return Ok(filters);
                    }
                    return Err(io::Error::from_raw_os_error(-errno))
                        .context("listing the device's filters");
                }
                RTM_NEWTFILTER => filters.extend(filter(body)),
                _ => {}
            }
            rest = &rest[align(len).min(rest.len())..];
        }
    }
}

fn align(len: usize) -> usize {
    len.div_ceil(4) * 4
}

/// A BPF filter from an `RTM_NEWTFILTER` message's body; `None` for other kinds, or one
/// without a program (the hook's chain head).
fn filter(body: &[u8]) -> Option<Filter> {
    let tcmsg = body.get(..TCMSG_LEN)?;
    let handle = u32::from_ne_bytes(tcmsg[8..12].try_into().ok()?);
    let info = u32::from_ne_bytes(tcmsg[16..20].try_into().ok()?);
    let mut kind = None;
    let (mut program_id, mut name) = (None, String::new());
    for (attr, value) in attributes(&body[TCMSG_LEN..]) {
        match attr {
            TCA_KIND => kind = Some(c_string(value)),
            TCA_OPTIONS => {
                for (option, value) in attributes(value) {
                    match option {
                        TCA_BPF_ID => {
                            program_id = Some(u32::from_ne_bytes(value.get(..4)?.try_into().ok()?))
                        }
                        TCA_BPF_NAME => name = c_string(value),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (kind.as_deref() == Some("bpf")).then_some(())?;
    Some(Filter {
        priority: (info >> 16) as u16,
        handle,
        program_id: program_id?,
        name,
    })
}

/// The attributes (`struct rtattr`: length, type, value) packed in `bytes`.
fn attributes(mut bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = usize::from(u16::from_ne_bytes(bytes.get(..2)?.try_into().ok()?));
        let kind = u16::from_ne_bytes(bytes.get(2..4)?.try_into().ok()?);
        // NLA_F_NESTED and NLA_F_NET_BYTEORDER ride in the type's top bits.
        let kind = kind & 0x3fff;
        let value = bytes.get(4..len)?;
        bytes = bytes.get(align(len)..).unwrap_or(&[]);
        Some((kind, value))
    })
}

fn c_string(value: &[u8]) -> String {
    let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(((4 + value.len()) as u16).to_ne_bytes());
        out.extend(kind.to_ne_bytes());
        out.extend(value);
        out.resize(align(out.len()), 0);
        out
    }

    #[test]
    fn reads_a_bpf_filters_priority_handle_program_and_name() {
        let mut body = vec![0u8; TCMSG_LEN];
        body[8..12].copy_from_slice(&7u32.to_ne_bytes());
        body[16..20].copy_from_slice(&((0x4d41u32 << 16) | 0x0300).to_ne_bytes());
        body.extend(attr(TCA_KIND, b"bpf\0"));
        let options = [
            attr(TCA_BPF_NAME, b"masq_egress\0"),
            attr(TCA_BPF_ID, &42u32.to_ne_bytes()),
        ]
        .concat();
        body.extend(attr(TCA_OPTIONS | 0x8000, &options));
        assert_eq!(
            filter(&body),
            Some(Filter {
                priority: 0x4d41,
                handle: 7,
                program_id: 42,
                name: "masq_egress".into(),
            })
        );
    }

    #[test]
    fn other_kinds_and_the_chain_head_are_not_filters_of_ours() {
        let mut body = vec![0u8; TCMSG_LEN];
        body.extend(attr(TCA_KIND, b"u32\0"));
        assert_eq!(filter(&body), None);
        let mut head = vec![0u8; TCMSG_LEN];
        head.extend(attr(TCA_KIND, b"bpf\0"));
        assert_eq!(filter(&head), None, "no program, no filter");
    }
}
