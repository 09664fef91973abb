//! Load for the end-to-end benchmark: servers on the outside host, and client threads in a pod
//! that count completed operations for a fixed time.

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use socket2::{Domain, Socket, Type};

use crate::{netns, workers::Workers};

/// Servers spread over several ports: NAT ports are unique per remote endpoint, so spreading
/// keeps a fast run of new flows from exhausting them.
pub const SERVER_PORTS: u16 = 8;
pub const CRR_BASE: u16 = 7100;
pub const RR_PORT: u16 = 7200;
pub const BULK_PORT: u16 = 7300;
pub const UDP_BASE: u16 = 7400;
const ACCEPTORS_PER_PORT: usize = 2;

/// The outside host's half: connect-request-response servers, a request-response server, a
/// bulk sink and UDP echo servers. Stops when dropped.
pub struct Servers {
    _workers: Workers,
}

impl Servers {
    pub fn start(ns: &str) -> anyhow::Result<Servers> {
        let mut workers = Workers::default();
        let listen = |port: u16| -> anyhow::Result<TcpListener> {
            let listener = netns::within(ns, move || {
                let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
                socket.set_reuse_address(true)?;
                socket.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
                socket.listen(4096)?;
                Ok(TcpListener::from(socket))
            })?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        };
        for i in 0..SERVER_PORTS {
            let listener = listen(CRR_BASE + i)?;
            for _ in 0..ACCEPTORS_PER_PORT {
                let listener = listener.try_clone()?;
                workers.spawn(move || accept_once(&listener, answer_once));
            }
            let socket = netns::within(ns, move || {
                Ok(UdpSocket::bind((Ipv4Addr::UNSPECIFIED, UDP_BASE + i))?)
            })?;
            socket.set_read_timeout(Some(Duration::from_millis(20)))?;
            workers.spawn(move || echo_datagram(&socket));
        }
        let rr = listen(RR_PORT)?;
        workers.spawn(move || {
            accept_once(&rr, |stream| {
                std::thread::spawn(move || answer_each(stream));
            })
        });
        let bulk = listen(BULK_PORT)?;
        workers.spawn(move || {
            accept_once(&bulk, |stream| {
                std::thread::spawn(move || drain(stream));
            })
        });
        Ok(Servers { _workers: workers })
    }
}

fn accept_once(listener: &TcpListener, handle: impl FnOnce(TcpStream)) {
    match listener.accept() {
        Ok((stream, _)) => {
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_nodelay(true);
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            handle(stream);
        }
        Err(_) => std::thread::sleep(Duration::from_micros(200)),
    }
}

/// One request, one response, then the client closes.
fn answer_once(mut stream: TcpStream) {
    let mut byte = [0u8; 1];
    if stream.read_exact(&mut byte).is_ok() {
        let _ = stream.write_all(&byte);
        let _ = stream.read(&mut byte);
    }
}

/// Requests and responses until the client closes.
fn answer_each(mut stream: TcpStream) {
    let mut byte = [0u8; 1];
    while stream.read_exact(&mut byte).is_ok() {
        if stream.write_all(&byte).is_err() {
            break;
        }
    }
}

fn drain(mut stream: TcpStream) {
    let mut buf = vec![0u8; 1 << 16];
    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
}

fn echo_datagram(socket: &UdpSocket) {
    let mut buf = [0u8; 64];
    if let Ok((n, peer)) = socket.recv_from(&mut buf) {
        let _ = socket.send_to(&buf[..n], peer);
    }
}

/// Runs `op` on `threads` threads inside `ns` for `duration` and returns completed operations
/// per second. Each thread first makes its own state with `setup` (a connection, say); `op`
/// gets it, the thread's index and the operation's sequence number. Failed operations do not
/// count.
fn rate<S>(
    ns: &str,
    threads: usize,
    duration: Duration,
    setup: impl Fn() -> anyhow::Result<S> + Send + Sync + Clone + 'static,
    op: impl Fn(&mut S, usize, u64) -> anyhow::Result<u64> + Send + Sync + Clone + 'static,
) -> anyhow::Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (ns, done, setup, op) = (ns.to_string(), done.clone(), setup.clone(), op.clone());
            std::thread::spawn(move || -> anyhow::Result<()> {
                netns::enter(&ns)?;
                let mut state = setup()?;
                let mut seq = 0u64;
                while Instant::now() < deadline {
                    if let Ok(n) = op(&mut state, t, seq) {
                        done.fetch_add(n, Ordering::Relaxed);
                    }
                    seq += 1;
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("load thread panicked"))??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

fn connect(server: SocketAddr) -> anyhow::Result<TcpStream> {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    // Close with a reset: no TIME_WAIT piles up in the client over thousands of connections.
    socket.set_linger(Some(Duration::ZERO))?;
    socket.set_tcp_nodelay(true)?;
    socket.connect_timeout(&server.into(), Duration::from_secs(2))?;
    let stream = TcpStream::from(socket);
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    Ok(stream)
}

/// The server port for thread `t`'s operation `seq`, taking the ports from `base` in turn.
fn spread(base: u16, t: usize, seq: u64) -> u16 {
    base + ((t as u64 + seq) % u64::from(SERVER_PORTS)) as u16
}

/// New TCP connections per second: connect, one request and response, close.
pub fn new_connections(
    ns: &str,
    server: Ipv4Addr,
    threads: usize,
    duration: Duration,
) -> anyhow::Result<f64> {
    rate(
        ns,
        threads,
        duration,
        || Ok(()),
        move |_, t, seq| {
            let port = spread(CRR_BASE, t, seq);
            let mut stream = connect((server, port).into())?;
            let mut byte = [7u8; 1];
            stream.write_all(&byte)?;
            stream.read_exact(&mut byte)?;
            Ok(1)
        },
    )
}

/// Request/response transactions per second on established connections.
pub fn transactions(
    ns: &str,
    server: Ipv4Addr,
    threads: usize,
    duration: Duration,
) -> anyhow::Result<f64> {
    let setup = move || connect((server, RR_PORT).into());
    rate(ns, threads, duration, setup, |stream, _, _| {
        let mut byte = [1u8; 1];
        stream.write_all(&byte)?;
        stream.read_exact(&mut byte)?;
        Ok(1)
    })
}

/// Bulk TCP throughput of one connection, in bits per second.
pub fn throughput(ns: &str, server: Ipv4Addr, duration: Duration) -> anyhow::Result<f64> {
    let ns = ns.to_string();
    netns::within(&ns, move || {
        let mut stream = connect((server, BULK_PORT).into()).context("bulk connect")?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        let chunk = vec![0x5au8; 1 << 16];
        let started = Instant::now();
        let mut sent = 0u64;
        while started.elapsed() < duration {
            stream.write_all(&chunk)?;
            sent += chunk.len() as u64;
        }
        Ok(sent as f64 * 8.0 / started.elapsed().as_secs_f64())
    })
}

/// UDP request/response per second, each from a new source port (so each is a new flow).
pub fn udp_new_flows(
    ns: &str,
    server: Ipv4Addr,
    threads: usize,
    duration: Duration,
) -> anyhow::Result<f64> {
    rate(
        ns,
        threads,
        duration,
        || Ok(()),
        move |_, t, seq| {
            let port = spread(UDP_BASE, t, seq);
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            socket.set_read_timeout(Some(Duration::from_millis(500)))?;
            socket.send_to(b"q", (server, port))?;
            let mut buf = [0u8; 8];
            socket.recv_from(&mut buf)?;
            Ok(1)
        },
    )
}
