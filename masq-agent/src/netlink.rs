//! Netlink dumps: a request sent to the kernel, and its answers received to their end.

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkDeserializable, NetlinkHeader,
    NetlinkMessage, NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::{Socket, SocketAddr};

/// A socket of netlink `protocol` that talks to the kernel.
pub fn socket(protocol: isize) -> std::io::Result<Socket> {
    let mut socket = Socket::new(protocol)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// How often a dump that the kernel marks as interrupted (what it listed changed while it
/// dumped) is asked again before its answer is taken as it is.
const INTERRUPTED_RETRIES: usize = 3;

/// Sends `request` as a dump on `socket` and returns every message of the answer. An answer
/// the kernel marks as inconsistent (`NLM_F_DUMP_INTR`) is asked for again, a few times.
pub fn dump<M>(socket: &Socket, request: M) -> std::io::Result<Vec<M>>
where
    M: NetlinkSerializable + NetlinkDeserializable + Clone + std::fmt::Debug,
{
    let mut attempt = 0;
    loop {
        let (answer, interrupted) = dump_once(socket, request.clone())?;
        attempt += 1;
        if !interrupted || attempt > INTERRUPTED_RETRIES {
            return Ok(answer);
        }
    }
}

/// One dump: its messages, and whether the kernel marked any of them as interrupted.
fn dump_once<M>(socket: &Socket, request: M) -> std::io::Result<(Vec<M>, bool)>
where
    M: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
{
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(request));
    message.finalize();
    let mut bytes = vec![0; message.buffer_len()];
    message.serialize(&mut bytes);
    socket.send(&bytes, 0)?;
    let mut answer = Vec::new();
    let mut interrupted = false;
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let size = socket.recv(&mut &mut buffer[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let message = NetlinkMessage::<M>::deserialize(&buffer[offset..size])
                .map_err(|err| invalid(format!("an answer that does not parse: {err}")))?;
            let length = message.header.length as usize;
            interrupted |= message.header.flags & NLM_F_DUMP_INTR != 0;
            match message.payload {
                NetlinkPayload::InnerMessage(inner) => answer.push(inner),
                // A dump that fails in the kernel says so in its last message.
                NetlinkPayload::Done(done) if done.code < 0 => {
                    return Err(std::io::Error::from_raw_os_error(-done.code));
                }
                NetlinkPayload::Done(_) => return Ok((answer, interrupted)),
                NetlinkPayload::Error(err) => return Err(err.to_io()),
                _ => {}
            }
            if length == 0 {
                return Err(invalid("an empty answer".into()));
            }
            offset += length;
        }
    }
}
