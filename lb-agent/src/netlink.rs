//! One netlink request and its answers, for the agent's two netlink families: route (the node's
//! links, `node::interfaces`) and sock_diag (the sockets `datapath::sockets` terminates). A dump's
//! answers run up to NLMSG_DONE; a request with NLM_F_ACK ends at its acknowledgement.

use std::io;

use netlink_packet_core::{
    NLM_F_REQUEST, NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::Socket;

/// A socket of netlink family `protocol` (`netlink_sys::protocols::*`), connected to the kernel,
/// in the calling thread's network namespace.
pub fn socket(protocol: isize) -> io::Result<Socket> {
    let mut socket = Socket::new(protocol)?;
    socket.bind_auto()?;
    socket.connect(&netlink_sys::SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// Sends `payload` with `flags` (besides NLM_F_REQUEST) on `socket` (connected to the kernel) and
/// gives each answer to `on_answer`, until the dump's end or the acknowledgement. A netlink error
/// (a negative errno in NLMSG_ERROR) is returned as that errno.
pub fn request<Q, A>(socket: &Socket, payload: Q, flags: u16, mut on_answer: impl FnMut(A)) -> io::Result<()>
where
    Q: NetlinkSerializable,
    A: NetlinkDeserializable,
    A::Error: std::fmt::Display,
{
    let mut request = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::InnerMessage(payload));
    request.header.flags = flags | NLM_F_REQUEST;
    request.header.sequence_number = 1;
    request.finalize();
    let mut buf = vec![0; request.buffer_len()];
    request.serialize(&mut buf);
    socket.send(&buf, 0)?;

    let invalid = |e: &dyn std::fmt::Display| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
    // A dump's datagrams are at most a page or two each (NLMSG_GOODSIZE).
    let mut datagram = vec![0u8; 64 * 1024];
    loop {
        let size = socket.recv(&mut &mut datagram[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let message: NetlinkMessage<A> =
                NetlinkMessage::deserialize(&datagram[offset..size]).map_err(|e| invalid(&e))?;
            let length = message.header.length as usize;
            match message.payload {
                NetlinkPayload::Done(_) => return Ok(()),
                // An acknowledgement (no code), or the request's error.
                NetlinkPayload::Error(e) => {
                    return e
                        .code
                        .map_or(Ok(()), |code| Err(io::Error::from_raw_os_error(-code.get())));
                }
                NetlinkPayload::InnerMessage(answer) => on_answer(answer),
                _ => {}
            }
            if length == 0 {
                break;
            }
            offset += length;
        }
    }
}
