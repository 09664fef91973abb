//! Real traffic through the test bed: an outside server that records the source address of
//! every TCP connection and UDP datagram it sees and answers with it, and clients that run
//! inside a pod's namespace.

use std::{
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
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
    /// Listens on `port` of every address in `addrs`. UDP binds each address on its own so
    /// that replies leave from the address that was asked, which source-based routes rely on.
    pub fn start(ns: &str, addrs: &[Ipv4Addr], port: u16) -> anyhow::Result<Observer> {
        let addrs = addrs.to_vec();
        let (tcp, udp) = netns::within(ns, move || {
            let tcp = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).context("bind tcp")?;
            let udp = addrs
                .iter()
                .map(|a| UdpSocket::bind((*a, port)).context("bind udp"))
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok((tcp, udp))
        })?;
        tcp.set_nonblocking(true)?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut workers = Workers::default();
        let tcp_seen = seen.clone();
        workers.spawn(move || serve_tcp(&tcp, &tcp_seen));
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

fn serve_tcp(listener: &TcpListener, seen: &Mutex<Vec<Seen>>) {
    match listener.accept() {
        Ok((mut stream, peer)) => {
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
        seen.lock().unwrap().push(Seen {
            proto: Proto::Udp,
            peer,
        });
        // Without masquerading there may be no route back; the record above is what counts.
        let _ = socket.send_to(format!("{peer}\n").as_bytes(), peer);
    }
}

/// Connects from namespace `ns` to `server` and returns the source address the server reports
/// having seen. `source_port` pins the client's port (0 = any).
pub fn tcp_probe(ns: &str, server: SocketAddr, source_port: u16) -> anyhow::Result<SocketAddr> {
    tcp_probe_from(ns, (Ipv4Addr::UNSPECIFIED, source_port).into(), server)
}

/// Like `tcp_probe`, from a chosen local address and port.
pub fn tcp_probe_from(
    ns: &str,
    source: SocketAddr,
    server: SocketAddr,
) -> anyhow::Result<SocketAddr> {
    netns::within(ns, move || {
        let socket = Socket::new(Domain::for_address(server), Type::STREAM, None)?;
        // Tests reuse a source port across pods and runs; TIME_WAIT must not block that.
        socket.set_reuse_address(true)?;
        if source != SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)) {
            socket.bind(&source.into())?;
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
        let socket = UdpSocket::bind(("0.0.0.0", source_port))?;
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
    netns::within(ns, move || {
        let socket = UdpSocket::bind(("0.0.0.0", 0))?;
        socket.send_to(b"probe\n", server)?;
        Ok(())
    })
}

/// Records the source address of every packet of one IP protocol that reaches a namespace
/// (ICMP echo requests, GRE, ...), through a raw socket.
pub struct RawObserver {
    seen: Arc<Mutex<Vec<IpAddr>>>,
    _workers: Workers,
}

const ICMP_ECHO_REQUEST: u8 = 8;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_GRE: u8 = 47;

impl RawObserver {
    pub fn start(ns: &str, protocol: i32) -> anyhow::Result<RawObserver> {
        let socket = netns::within(ns, move || {
            Ok(Socket::new(
                Domain::IPV4,
                Type::RAW,
                Some(socket2::Protocol::from(protocol)),
            )?)
        })?;
        socket.set_read_timeout(Some(POLL))?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut workers = Workers::default();
        let recorded = seen.clone();
        workers.spawn(move || {
            if let Some(src) = receive_source(&socket, protocol) {
                recorded.lock().unwrap().push(src);
            }
        });
        Ok(RawObserver {
            seen,
            _workers: workers,
        })
    }

    pub fn sources(&self) -> Vec<IpAddr> {
        self.seen.lock().unwrap().clone()
    }
}

/// The source of the next packet on a raw socket, if it is one to record: for ICMP, only echo
/// requests count.
fn receive_source(socket: &Socket, protocol: i32) -> Option<IpAddr> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 2048];
    let n = socket.recv(&mut buf).ok()?;
    // SAFETY: recv initialised the first n bytes.
    let packet: Vec<u8> = buf[..n]
        .iter()
        .map(|b| unsafe { b.assume_init() })
        .collect();
    if packet.len() < 21 {
        return None;
    }
    let ihl = usize::from(packet[0] & 0x0f) * 4;
    let is_icmp = protocol == i32::from(IPPROTO_ICMP);
    if is_icmp && packet.get(ihl) != Some(&ICMP_ECHO_REQUEST) {
        return None;
    }
    Some(IpAddr::from([
        packet[12], packet[13], packet[14], packet[15],
    ]))
}

/// Sends one raw IP packet of `protocol` from namespace `ns` to `dst`.
pub fn raw_send(ns: &str, protocol: i32, dst: Ipv4Addr, payload: &[u8]) -> anyhow::Result<()> {
    let payload = payload.to_vec();
    netns::within(ns, move || {
        let socket = Socket::new(
            Domain::IPV4,
            Type::RAW,
            Some(socket2::Protocol::from(protocol)),
        )?;
        socket.send_to(&payload, &SocketAddr::from((dst, 0)).into())?;
        Ok(())
    })
}

/// A TCP server that reads each connection to its end and answers with the byte count.
pub struct BulkSink {
    _workers: Workers,
}

impl BulkSink {
    pub fn start(ns: &str, port: u16) -> anyhow::Result<BulkSink> {
        let listener = netns::within(ns, move || {
            Ok(TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))?)
        })?;
        listener.set_nonblocking(true)?;
        let mut workers = Workers::default();
        workers.spawn(move || match listener.accept() {
            Ok((stream, _)) => {
                std::thread::spawn(move || drain_and_answer(stream));
            }
            Err(_) => std::thread::sleep(POLL),
        });
        Ok(BulkSink { _workers: workers })
    }
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
