//! Netlink dumps: a request sent to the kernel, and its answers received to their end.

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkDeserializable, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::{Socket, SocketAddr};

/// A socket of netlink `protocol` that talks to the kernel.
pub fn socket(protocol: isize) -> std::io::Result<Socket> {
    let mut socket = Socket::new(protocol)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// Sends `request` as a dump on `socket` and hands `each` every message of the answer, to its
/// end.
pub fn dump<M>(socket: &Socket, request: M, mut each: impl FnMut(M)) -> std::io::Result<()>
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
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let size = socket.recv(&mut &mut buffer[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let message = NetlinkMessage::<M>::deserialize(&buffer[offset..size])
                .map_err(|err| invalid(format!("an answer that does not parse: {err}")))?;
            let length = message.header.length as usize;
            match message.payload {
                NetlinkPayload::InnerMessage(inner) => each(inner),
                NetlinkPayload::Done(_) => return Ok(()),
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
