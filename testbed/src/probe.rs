//! Real traffic through the test bed: an outside server that records the source address of
//! every TCP connection and UDP datagram it sees and answers with it, and clients that run
//! inside a pod's namespace. Everything works over IPv4 and IPv6 alike: servers listen on both
//! families, clients take the family of the address they are given, and addresses are reported
//! as they are (an IPv4 peer is an `IpAddr::V4`, never an IPv4-mapped IPv6 address).
//! One job, real traffic and what it saw: each probe is small, and they share their sockets'
//! setup.

use std::{
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context as _;
use socket2::{Domain, Socket, Type};

use crate::{netns, workers::Workers};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

/// One packet or connection as the server saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub proto: Proto,
    pub peer: SocketAddr,
}

/// A TCP and UDP server on one port in one namespace, running until dropped.
pub struct Observer {
    pub port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    _workers: Workers,
}

const POLL: Duration = Duration::from_millis(10);

impl Observer {
    /// Listens on `port`: TCP on every address of both families, UDP on each address in `addrs`
    /// (IPv4, IPv6 or a mix) on its own, so that replies leave from the address that was asked,
    /// which source-based routes rely on.
    pub fn start<A: Copy + Into<IpAddr>>(
        ns: &str,
        addrs: &[A],
        port: u16,
    ) -> anyhow::Result<Observer> {
        let addrs: Vec<IpAddr> = addrs.iter().map(|&a| a.into()).collect();
        let (tcp, udp) = netns::within(ns, move || {
            let tcp = tcp_listeners(port, addrs.iter().any(IpAddr::is_ipv6))?;
            let udp = addrs
                .iter()
                .map(|&a| {
                    udp_socket((a, port).into()).with_context(|| format!("bind udp {a}:{port}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok((tcp, udp))
        })?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut workers = Workers::default();
        for listener in tcp {
            listener.set_nonblocking(true)?;
            let tcp_seen = seen.clone();
            workers.spawn(move || serve_tcp(&listener, &tcp_seen));
        }
        for socket in udp {
            socket.set_read_timeout(Some(POLL))?;
            let udp_seen = seen.clone();
            workers.spawn(move || serve_udp(&socket, &udp_seen));
        }
        Ok(Observer {
            port,
            seen,
            _workers: workers,
        })
    }

    /// Everything seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Source addresses seen for `proto`.
    pub fn sources(&self, proto: Proto) -> Vec<IpAddr> {
        self.seen()
            .iter()
            .filter(|s| s.proto == proto)
            .map(|s| s.peer.ip())
            .collect()
    }

    pub fn clear(&self) {
        self.seen.lock().unwrap().clear();
    }

    /// Forgets what was seen, then sends UDP from `ns` to `dst` until a datagram arrives with
    /// source `expect` (as after a policy change, which takes effect within moments).
    pub fn wait_for_udp_from(
        &self,
        ns: &str,
        dst: SocketAddr,
        expect: IpAddr,
    ) -> anyhow::Result<()> {
        self.clear();
        crate::wait_for(|| {
            udp_send(ns, dst)?;
            std::thread::sleep(Duration::from_millis(50));
            Ok(self.sources(Proto::Udp).contains(&expect))
        })
        .with_context(|| {
            format!(
                "UDP to {dst} never arrived from {expect}; saw {:?}",
                self.seen()
            )
        })
    }
}

/// TCP listeners on `port` of every IPv4 and every IPv6 address, one socket per family. The
/// IPv6 one is required only when `need_v6`; otherwise a namespace without IPv6 still serves
/// IPv4.
fn tcp_listeners(port: u16, need_v6: bool) -> anyhow::Result<Vec<TcpListener>> {
    let mut listeners =
        vec![tcp_listener((Ipv4Addr::UNSPECIFIED, port).into()).context("bind tcp 0.0.0.0")?];
    match tcp_listener((Ipv6Addr::UNSPECIFIED, port).into()) {
        Ok(listener) => listeners.push(listener),
        Err(e) if need_v6 => return Err(e).context("bind tcp [::]"),
        Err(_) => {}
    }
    Ok(listeners)
}

/// A listening TCP socket on `addr`; an IPv6 one takes IPv6 only, so that IPv4 has its own.
fn tcp_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    // As `TcpListener::bind` does, which the listener replaces.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(libc::SOMAXCONN)?;
    Ok(socket.into())
}

/// A UDP socket bound to `addr`; an IPv6 one takes IPv6 only.
fn udp_socket(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    // A socket of the same port closed a moment ago can still be bound: a process the tests
    // spawn meanwhile holds a copy of every descriptor from its fork until its exec closes
    // them, which takes a while on a loaded machine.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    loop {
        match socket.bind(&addr.into()) {
            Err(err)
                if err.kind() == std::io::ErrorKind::AddrInUse
                    && addr.port() != 0
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            result => break result?,
        }
    }
    Ok(socket.into())
}

/// The unspecified address of `server`'s family, with `port`: where a client binds.
fn any_addr_for(server: SocketAddr, port: u16) -> SocketAddr {
    match server {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, port).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, port).into(),
    }
}

/// `addr` with an IPv4-mapped IPv6 address turned back into IPv4.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn serve_tcp(listener: &TcpListener, seen: &Mutex<Vec<Seen>>) {
    match listener.accept() {
        Ok((mut stream, peer)) => {
            let peer = canonical(peer);
            seen.lock().unwrap().push(Seen {
                proto: Proto::Tcp,
                peer,
            });
            let _ = stream.set_nonblocking(false);
            let _ = writeln!(stream, "{peer}");
        }
        Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(POLL),
        Err(_) => std::thread::sleep(POLL),
    }
}

fn serve_udp(socket: &UdpSocket, seen: &Mutex<Vec<Seen>>) {
    let mut buf = [0u8; 2048];
    if let Ok((_, peer)) = socket.recv_from(&mut buf) {
        let seen_peer = canonical(peer);
        seen.lock().unwrap().push(Seen {
            proto: Proto::Udp,
            peer: seen_peer,
        });
        // Without masquerading there may be no route back; the record above is what counts.
        let _ = socket.send_to(format!("{seen_peer}\n").as_bytes(), peer);
    }
}

/// Connects from namespace `ns` to `server` and returns the source address the server reports
/// having seen. `source_port` pins the client's port (0 = any).
pub fn tcp_probe(ns: &str, server: SocketAddr, source_port: u16) -> anyhow::Result<SocketAddr> {
    tcp_probe_from(ns, any_addr_for(server, source_port), server)
}

/// Like `tcp_probe`, from a chosen local address and port. An unspecified source address (of
/// either family) stands for the unspecified address of `server`'s family.
pub fn tcp_probe_from(
    ns: &str,
    source: SocketAddr,
    server: SocketAddr,
) -> anyhow::Result<SocketAddr> {
    let source = if source.ip().is_unspecified() {
        any_addr_for(server, source.port())
    } else {
        source
    };
    netns::within(ns, move || {
        let socket = Socket::new(Domain::for_address(server), Type::STREAM, None)?;
        // Tests reuse a source port across pods and runs; TIME_WAIT must not block that.
        socket.set_reuse_address(true)?;
        if source != any_addr_for(server, 0) {
            socket
                .bind(&source.into())
                .with_context(|| format!("bind {source}"))?;
        }
        socket
            .connect_timeout(&server.into(), Duration::from_secs(3))
            .with_context(|| format!("connect to {server}"))?;
        let stream = TcpStream::from(socket);
        stream.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line)?;
        line.trim()
            .parse()
            .with_context(|| format!("server reply {line:?}"))
    })
}

/// Sends one UDP datagram from namespace `ns` and returns the source address the server
/// reports, or an error if no reply comes back (as when the server has no route back).
pub fn udp_probe(ns: &str, server: SocketAddr, source_port: u16) -> anyhow::Result<SocketAddr> {
    netns::within(ns, move || {
        let socket = udp_socket(any_addr_for(server, source_port))?;
        socket.set_read_timeout(Some(Duration::from_secs(2)))?;
        socket.send_to(b"probe\n", server)?;
        let mut buf = [0u8; 128];
        let (n, _) = socket.recv_from(&mut buf).context("no UDP reply")?;
        let reply = String::from_utf8_lossy(&buf[..n]).trim().to_string();
        reply
            .parse()
            .with_context(|| format!("server reply {reply:?}"))
    })
}

/// Sends one UDP datagram from namespace `ns` without waiting for a reply.
pub fn udp_send(ns: &str, server: SocketAddr) -> anyhow::Result<()> {
    udp_send_from(ns, server, 0)
}

/// Sends one UDP datagram from namespace `ns`, from `source_port` (0: any), without waiting
/// for a reply.
pub fn udp_send_from(ns: &str, server: SocketAddr, source_port: u16) -> anyhow::Result<()> {
    udp_send_payload_from(ns, server, source_port, b"probe\n")
}

/// Sends `payload` in one UDP datagram from namespace `ns`, from `source_port` (0: any); one
/// larger than the path's MTU leaves in fragments.
pub fn udp_send_payload_from(
    ns: &str,
    server: SocketAddr,
    source_port: u16,
    payload: &[u8],
) -> anyhow::Result<()> {
    let payload = payload.to_vec();
    netns::within(ns, move || {
        let socket = udp_socket(any_addr_for(server, source_port))?;
        socket.send_to(&payload, server)?;
        Ok(())
    })
}

/// Records every packet of one IP protocol that reaches a namespace (ICMP or ICMPv6, TCP, GRE,
/// ...), through a raw socket: where it came from and its bytes past the IP header.
pub struct RawObserver {
    seen: Arc<Mutex<Vec<Captured>>>,
    protocol: i32,
    _workers: Workers,
}

/// One packet a `RawObserver` saw.
#[derive(Debug, Clone)]
pub struct Captured {
    pub src: IpAddr,
    /// The upper layer: the TCP, UDP or ICMP header and what follows.
    pub l4: Vec<u8>,
}

const ICMP_ECHO_REQUEST: u8 = 8;
const ICMPV6_ECHO_REQUEST: u8 = 128;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_GRE: u8 = 47;
pub const IPPROTO_ICMPV6: u8 = 58;

impl RawObserver {
    /// Observes IPv4 packets of `protocol`.
    pub fn start(ns: &str, protocol: i32) -> anyhow::Result<RawObserver> {
        Self::start_in(ns, Domain::IPV4, protocol)
    }

    /// Observes IPv6 packets of `protocol`.
    pub fn start_v6(ns: &str, protocol: i32) -> anyhow::Result<RawObserver> {
        Self::start_in(ns, Domain::IPV6, protocol)
    }

    fn start_in(ns: &str, domain: Domain, protocol: i32) -> anyhow::Result<RawObserver> {
        let socket = netns::within(ns, move || {
            Ok(Socket::new(
                domain,
                Type::RAW,
                Some(socket2::Protocol::from(protocol)),
            )?)
        })?;
        socket.set_read_timeout(Some(POLL))?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut workers = Workers::default();
        let recorded = seen.clone();
        workers.spawn(move || {
            let captured = if domain == Domain::IPV6 {
                receive_v6(&socket)
            } else {
                receive_v4(&socket)
            };
            if let Some(captured) = captured {
                recorded.lock().unwrap().push(captured);
            }
        });
        Ok(RawObserver {
            seen,
            protocol,
            _workers: workers,
        })
    }

    /// Every packet seen so far.
    pub fn packets(&self) -> Vec<Captured> {
        self.seen.lock().unwrap().clone()
    }

    /// The sources of the packets seen so far; for ICMP and ICMPv6, of echo requests only (not
    /// the replies, errors or neighbour discovery that share the protocol).
    pub fn sources(&self) -> Vec<IpAddr> {
        let echo = [
            (i32::from(IPPROTO_ICMP), ICMP_ECHO_REQUEST),
            (i32::from(IPPROTO_ICMPV6), ICMPV6_ECHO_REQUEST),
        ]
        .into_iter()
        .find(|(protocol, _)| *protocol == self.protocol)
        .map(|(_, request)| request);
        self.packets()
            .into_iter()
            .filter(|p| echo.is_none_or(|request| p.l4.first() == Some(&request)))
            .map(|p| p.src)
            .collect()
    }
}

/// Receives one packet from a raw socket: its bytes and where it came from.
fn receive(socket: &Socket) -> Option<(Vec<u8>, Option<SocketAddr>)> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 2048];
    let (n, from) = socket.recv_from(&mut buf).ok()?;
    // SAFETY: recv_from initialised the first n bytes.
    let packet = buf[..n]
        .iter()
        .map(|b| unsafe { b.assume_init() })
        .collect();
    Some((packet, from.as_socket()))
}

/// The next packet on an IPv4 raw socket, which returns it with its IP header.
fn receive_v4(socket: &Socket) -> Option<Captured> {
    let (packet, _) = receive(socket)?;
    let ihl = usize::from(packet.first()? & 0x0f) * 4;
    if packet.len() <= ihl.max(20) {
        return None;
    }
    Some(Captured {
        src: IpAddr::from([packet[12], packet[13], packet[14], packet[15]]),
        l4: packet[ihl..].to_vec(),
    })
}

/// The next packet on an IPv6 raw socket, which returns the payload without the IPv6 header,
/// so the source is the address the packet was received from.
fn receive_v6(socket: &Socket) -> Option<Captured> {
    let (payload, from) = receive(socket)?;
    Some(Captured {
        src: from?.ip().to_canonical(),
        l4: payload,
    })
}

/// Sends one raw IP packet of `protocol` from namespace `ns` to `dst`.
pub fn raw_send(ns: &str, protocol: i32, dst: Ipv4Addr, payload: &[u8]) -> anyhow::Result<()> {
    raw_send_to(ns, protocol, None, dst.into(), payload)
}

/// Sends the upper layer `payload` of `protocol` from `src`, an address of namespace `ns`, to
/// `dst`, in an IP header the kernel builds: a crafted segment (a TCP RST, say), whose checksum
/// the caller computed over the pseudo-header of `src` and `dst`.
pub fn raw_send_from(
    ns: &str,
    protocol: i32,
    src: IpAddr,
    dst: IpAddr,
    payload: &[u8],
) -> anyhow::Result<()> {
    raw_send_to(ns, protocol, Some(src), dst, payload)
}

/// Sends whole IP packets (`frames`: Ethernet frames as `packet` builds them, their IP
/// headers included) from namespace `ns` as they are, source addresses and all: a flood from
/// addresses that are no one's.
pub fn send_frames(ns: &str, frames: Vec<Vec<u8>>) -> anyhow::Result<()> {
    const ETH_HLEN: usize = 14;
    netns::within(ns, move || {
        for frame in &frames {
            let packet = &frame[ETH_HLEN..];
            let (domain, dst): (Domain, IpAddr) = match packet[0] >> 4 {
                4 => (
                    Domain::IPV4,
                    Ipv4Addr::from(<[u8; 4]>::try_from(&packet[16..20])?).into(),
                ),
                _ => (
                    Domain::IPV6,
                    Ipv6Addr::from(<[u8; 16]>::try_from(&packet[24..40])?).into(),
                ),
            };
            // IPPROTO_RAW: the header is the caller's, sent as it is.
            let socket = Socket::new(domain, Type::RAW, Some(socket2::Protocol::from(255)))?;
            if domain == Domain::IPV6 {
                socket.set_header_included_v6(true)?;
            }
            socket.send_to(packet, &SocketAddr::from((dst, 0)).into())?;
        }
        Ok(())
    })
}

/// Sends one raw IPv6 packet of `protocol` (`payload` follows the IPv6 header the kernel
/// builds) from namespace `ns` to `dst`. For ICMPv6 the kernel fills in the checksum.
pub fn raw_send_v6(ns: &str, protocol: i32, dst: Ipv6Addr, payload: &[u8]) -> anyhow::Result<()> {
    raw_send_to(ns, protocol, None, dst.into(), payload)
}

/// Sends `payload` through a raw socket of `protocol`, from `src` if given (else the kernel
/// picks the source as for any packet to `dst`).
fn raw_send_to(
    ns: &str,
    protocol: i32,
    src: Option<IpAddr>,
    dst: IpAddr,
    payload: &[u8],
) -> anyhow::Result<()> {
    let payload = payload.to_vec();
    netns::within(ns, move || {
        let dst = SocketAddr::from((dst, 0));
        let socket = Socket::new(
            Domain::for_address(dst),
            Type::RAW,
            Some(socket2::Protocol::from(protocol)),
        )?;
        if let Some(src) = src {
            socket.bind(&SocketAddr::from((src, 0)).into())?;
        }
        socket.send_to(&payload, &dst.into())?;
        Ok(())
    })
}

/// A TCP server, on every IPv4 and IPv6 address, that reads each connection to its end and
/// answers with the byte count.
pub struct BulkSink {
    _workers: Workers,
}

impl BulkSink {
    pub fn start(ns: &str, port: u16) -> anyhow::Result<BulkSink> {
        Ok(BulkSink {
            _workers: serve_connections(ns, port, drain_and_answer)?,
        })
    }
}

/// TCP listeners on `port` of every address of `ns`, handing each connection to `handle` on a
/// thread of its own, until the workers are dropped.
fn serve_connections(
    ns: &str,
    port: u16,
    handle: impl Fn(TcpStream) + Copy + Send + 'static,
) -> anyhow::Result<Workers> {
    let listeners = netns::within(ns, move || tcp_listeners(port, false))?;
    let mut workers = Workers::default();
    for listener in listeners {
        listener.set_nonblocking(true)?;
        workers.spawn(move || match listener.accept() {
            Ok((stream, _)) => {
                std::thread::spawn(move || handle(stream));
            }
            Err(_) => std::thread::sleep(POLL),
        });
    }
    Ok(workers)
}

fn drain_and_answer(mut stream: TcpStream) {
    use std::io::Read as _;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut total: u64 = 0;
    let mut buf = [0u8; 65536];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let _ = writeln!(stream, "{total}");
}

/// A TCP server, on every IPv4 and IPv6 address, that sends each connection `bytes` bytes and
/// closes it: the far end of a download.
pub struct BulkSource {
    _workers: Workers,
}

impl BulkSource {
    pub fn start(ns: &str, port: u16, bytes: usize) -> anyhow::Result<BulkSource> {
        Ok(BulkSource {
            _workers: serve_connections(ns, port, move |stream| send_and_close(stream, bytes))?,
        })
    }
}

fn send_and_close(mut stream: TcpStream, bytes: usize) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
    let chunk = vec![0xa5; 64 * 1024];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        if stream.write_all(&chunk[..n]).is_err() {
            return;
        }
        left -= n;
    }
}

/// Downloads from a `BulkSource` into namespace `ns` until it closes, or until nothing has
/// arrived for `stall`: the bytes received.
pub fn tcp_download(ns: &str, server: SocketAddr, stall: Duration) -> anyhow::Result<u64> {
    use std::io::Read as _;

    netns::within(ns, move || {
        let mut stream = TcpStream::connect_timeout(&server, Duration::from_secs(3))
            .with_context(|| format!("connect to {server}"))?;
        stream.set_read_timeout(Some(stall))?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut received = 0u64;
        loop {
            match stream.read(&mut buf) {
                Ok(0) => return Ok(received),
                Ok(n) => received += n as u64,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Ok(received);
                }
                Err(e) => return Err(e).context("downloading"),
            }
        }
    })
}

/// Sends `chunks` chunks of `chunk_size` bytes from namespace `ns` to a `BulkSink`, sleeping
/// `pause` between chunks, and returns the byte count the sink reports.
pub fn tcp_bulk(
    ns: &str,
    server: SocketAddr,
    chunk_size: usize,
    chunks: usize,
    pause: Duration,
) -> anyhow::Result<u64> {
    netns::within(ns, move || {
        let socket = Socket::new(Domain::for_address(server), Type::STREAM, None)?;
        socket
            .connect_timeout(&server.into(), Duration::from_secs(3))
            .with_context(|| format!("connect to {server}"))?;
        let mut stream = TcpStream::from(socket);
        stream.set_write_timeout(Some(Duration::from_secs(20)))?;
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        let chunk = vec![0x5a; chunk_size];
        for _ in 0..chunks {
            stream.write_all(&chunk).context("sending")?;
            std::thread::sleep(pause);
        }
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut line = String::new();
        BufReader::new(stream)
            .read_line(&mut line)
            .context("reading the count")?;
        line.trim()
            .parse()
            .with_context(|| format!("sink reply {line:?}"))
    })
}

/// The value of the series whose line of the Prometheus text `metrics` starts with `series`
/// (its name, and its labels if it has any).
pub fn metric(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let rest = line.strip_prefix(series)?.strip_prefix(' ')?;
        rest.parse().ok()
    })
}

/// `GET path` over HTTP/1.1 from inside `ns`: the status code and the body.
pub fn http_get(ns: &str, server: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::Read as _;

    let path = path.to_string();
    netns::within(ns, move || {
        let mut stream = TcpStream::connect_timeout(&server, Duration::from_secs(2))
            .with_context(|| format!("connecting to {server}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {server}\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("no end of headers")?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .with_context(|| format!("no status in {head:?}"))?;
        Ok((status, body.to_string()))
    })
}

/// A UDP server on `addr` in `ns` that sends every datagram back to where it came from, until
/// dropped.
pub struct UdpEcho {
    _workers: Workers,
}

impl UdpEcho {
    pub fn start(ns: &str, addr: SocketAddr) -> anyhow::Result<UdpEcho> {
        let socket = netns::within(ns, move || {
            let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, None)?;
            // Thousands of flows answer at once: room for their datagrams.
            socket.set_recv_buffer_size(8 << 20)?;
            socket.bind(&addr.into())?;
            Ok(UdpSocket::from(socket))
        })?;
        socket.set_read_timeout(Some(POLL))?;
        let mut workers = Workers::default();
        workers.spawn(move || {
            let mut buf = [0u8; 2048];
            if let Ok((n, from)) = socket.recv_from(&mut buf) {
                let _ = socket.send_to(&buf[..n], from);
            }
        });
        Ok(UdpEcho { _workers: workers })
    }
}

/// Many UDP flows from one namespace to one server, each its own socket (and so its own
/// source port), kept open so that they are all live at once. Each sends a payload that names
/// it, and must get that payload back: a reply that reaches another flow shows.
pub struct UdpFlows {
    flows: Vec<(UdpSocket, Vec<u8>)>,
    server: SocketAddr,
}

/// What one exchange over `UdpFlows` came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowTally {
    pub answered: usize,
    /// Flows that never got their own payload back.
    pub lost: usize,
    /// Replies that carried another flow's payload.
    pub crossed: usize,
}

impl UdpFlows {
    pub fn open(ns: &str, server: SocketAddr, count: usize, tag: &str) -> anyhow::Result<UdpFlows> {
        let any: IpAddr = match server {
            SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        let sockets = netns::within(ns, move || {
            (0..count)
                .map(|_| UdpSocket::bind((any, 0)))
                .collect::<std::io::Result<Vec<_>>>()
                .context("binding the flows' sockets")
        })?;
        let flows = sockets
            .into_iter()
            .enumerate()
            .map(|(i, socket)| {
                socket.set_nonblocking(true)?;
                Ok((socket, format!("{tag}-{i}").into_bytes()))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(UdpFlows { flows, server })
    }

    /// Every flow sends its payload, up to `tries` times while its own has not come back (a
    /// datagram may be dropped on the way; a flow whose replies go elsewhere never gets it).
    pub fn exchange(&self, tries: usize) -> anyhow::Result<FlowTally> {
        let mut tally = FlowTally::default();
        let mut waiting: Vec<usize> = (0..self.flows.len()).collect();
        let mut buf = [0u8; 2048];
        for _ in 0..tries {
            for &i in &waiting {
                let (socket, payload) = &self.flows[i];
                socket.send_to(payload, self.server)?;
                // Paced, so that the server's queue holds them.
                if i % 64 == 63 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while !waiting.is_empty() && std::time::Instant::now() < deadline {
                let before = waiting.len();
                waiting.retain(|&i| {
                    let (socket, payload) = &self.flows[i];
                    let mut answered = false;
                    while let Ok(n) = socket.recv(&mut buf) {
                        if &buf[..n] == payload.as_slice() {
                            answered = true;
                        } else {
                            tally.crossed += 1;
                        }
                    }
                    !answered
                });
                if waiting.len() == before {
                    std::thread::sleep(POLL);
                }
            }
        }
        tally.lost = waiting.len();
        tally.answered = self.flows.len() - tally.lost;
        Ok(tally)
    }
}

/// A TCP connection from `ns` to `server` from the chosen local address and port (bound even
/// where another socket's flow uses them), as a daemon with a fixed source port opens one.
pub fn tcp_connect_from(
    ns: &str,
    local: SocketAddr,
    server: SocketAddr,
) -> anyhow::Result<TcpStream> {
    netns::within(ns, move || {
        let socket = Socket::new(Domain::for_address(local), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&local.into())?;
        socket
            .connect_timeout(&server.into(), Duration::from_secs(3))
            .with_context(|| format!("connect from {local} to {server}"))?;
        Ok(TcpStream::from(socket))
    })
}
