//! Load for the end-to-end benchmark: servers in one namespace (the outside host's, or the
//! node's), and clients in another (a pod's, the node's, or the outside host's) that count
//! completed operations for a fixed time. Every kind of load runs in either `Shape`.
//!
//! Pinned lanes: one lane per CPU. A lane's client, its server and the node's forwarding all
//! stay on that CPU: a veth hands a packet to the next namespace on the CPU that sent it, so
//! the node's conntrack, NAT and tc programs run there too. A figure is then what an operation
//! costs along the whole path, and the data plane's share of it shows. Lanes that woke each
//! other across CPUs would measure wake-up latency instead, which on a VM (an IPI and an exit
//! per wake-up) dwarfs everything the data plane does.
//!
//! Unpinned, more in flight: a few client and server threads that the scheduler places, each
//! with three times a pinned lane's operations in flight, as a busy node's pods run. Wake-ups
//! cross CPUs and each one finds more work, so that what each packet costs the node weighs
//! more in the figures than in lanes that take turns on their CPU.
//!
//! Each lane is one thread per side with an event loop, so that many operations are in flight
//! without a thread each.

use std::{
    future::Future,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::mpsc,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpSocket, TcpStream, UdpSocket},
    sync::oneshot,
    time::timeout,
};

use crate::netns;

/// Server ports per lane for new connections and for UDP: NAT ports are unique per remote
/// endpoint, so spreading keeps a fast run of new flows from exhausting them.
pub const SERVER_PORTS: u16 = 8;
const CRR_BASE: u16 = 7100;
const RR_BASE: u16 = 7200;
const BULK_BASE: u16 = 7300;
const UDP_BASE: u16 = 7400;
/// Server ports per lane for new connections over `Tuples::Fresh`, from `FRESH_CRR_BASE`: the
/// unpinned shape's 512 times the ~5 500 ports a pod's kernel steps through per server port
/// make ~2.8 million tuples, which at `CHURN_RATE`-like rates come round after minutes, longer
/// than any measurement and than a closed flow lasts.
const FRESH_SERVER_PORTS: u16 = 256;
const FRESH_CRR_BASE: u16 = 20_000;
/// At most this many pinned lanes; the unpinned shape's lanes come after them.
const MAX_PINNED_LANES: usize = 8;
/// Client threads, and as many server threads, of the unpinned shape.
const UNPINNED_LANES: usize = 2;
/// How many times the pinned lanes' operations in flight each unpinned lane runs.
const UNPINNED_IN_FLIGHT_FACTOR: usize = 3;
/// Every lane's ports fit below the next range's base.
const LANE_IDS: usize = MAX_PINNED_LANES + UNPINNED_LANES;
const _: () = assert!(CRR_BASE as usize + LANE_IDS * SERVER_PORTS as usize <= RR_BASE as usize);
const _: () = assert!(RR_BASE as usize + LANE_IDS <= BULK_BASE as usize);
const _: () = assert!(BULK_BASE as usize + LANE_IDS <= UDP_BASE as usize);
const _: () =
    assert!(UDP_BASE as usize + LANE_IDS * SERVER_PORTS as usize <= FRESH_CRR_BASE as usize);
const _: () =
    assert!(FRESH_CRR_BASE as usize + LANE_IDS * FRESH_SERVER_PORTS as usize <= u16::MAX as usize);
/// Operations in flight per pinned lane.
const CRR_IN_FLIGHT: usize = 8;
const RR_CONNECTIONS: usize = 4;
const UDP_IN_FLIGHT: usize = 16;
const BULK_CONNECTIONS: usize = 1;
/// An operation that takes longer failed (a lost packet, say) and does not count.
const OP_TIMEOUT: Duration = Duration::from_secs(1);

fn crr_port(lane: usize, i: u64) -> u16 {
    Tuples::Recurring.server_port(lane, i)
}

pub fn udp_port(lane: usize, i: u64) -> u16 {
    UDP_BASE + lane as u16 * SERVER_PORTS + (i % u64::from(SERVER_PORTS)) as u16
}

pub fn rr_port(lane: usize) -> u16 {
    RR_BASE + lane as u16
}

fn bulk_port(lane: usize) -> u16 {
    BULK_BASE + lane as u16
}

/// Whether new connections come back to the tuples (pod address and port, server address and
/// port) they used before, which decides whether they make flows or reopen them: a SYN on a
/// flow a RST closed reopens it, as conntrack replaces its CLOSE entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tuples {
    /// `SERVER_PORTS` per lane, as a pod that talks to a few services: the kernel steps a
    /// client's port by two per connection to one server port, so at thousands a second each
    /// tuple comes round within seconds, mostly onto a flow that is closed but not yet expired.
    #[default]
    Recurring,
    /// `FRESH_SERVER_PORTS` per lane, as a pod that talks to many endpoints: no tuple comes
    /// round within minutes, so every connection makes a flow, which stays in the table until
    /// its timeout after the close.
    Fresh,
}

impl Tuples {
    pub const ALL: [Tuples; 2] = [Tuples::Recurring, Tuples::Fresh];

    pub fn name(self) -> &'static str {
        match self {
            Tuples::Recurring => "tuples that recur within seconds",
            Tuples::Fresh => "tuples that do not recur",
        }
    }

    /// The `i`th server port of `lane` for new connections.
    fn server_port(self, lane: usize, i: u64) -> u16 {
        let (base, ports) = match self {
            Tuples::Recurring => (CRR_BASE, SERVER_PORTS),
            Tuples::Fresh => (FRESH_CRR_BASE, FRESH_SERVER_PORTS),
        };
        base + lane as u16 * ports + (i % u64::from(ports)) as u16
    }
}

/// How the load is laid out over threads and CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Shape {
    PinnedLanes,
    Unpinned,
}

impl Shape {
    pub const ALL: [Shape; 2] = [Shape::PinnedLanes, Shape::Unpinned];

    pub fn name(self) -> &'static str {
        match self {
            Shape::PinnedLanes => "pinned lanes",
            Shape::Unpinned => "unpinned, more in flight",
        }
    }

    /// The name on the command line.
    pub fn key(self) -> &'static str {
        match self {
            Shape::PinnedLanes => "pinned",
            Shape::Unpinned => "unpinned",
        }
    }

    pub fn from_key(key: &str) -> Result<Shape, String> {
        Shape::ALL
            .into_iter()
            .find(|shape| shape.key() == key)
            .ok_or_else(|| {
                let keys: Vec<&str> = Shape::ALL.map(Shape::key).to_vec();
                format!("no load shape {key:?}; there are {}", keys.join(", "))
            })
    }

    /// How the shape lays out its threads and how much it keeps in flight, for the report.
    pub fn describe(self) -> anyhow::Result<String> {
        let lanes = self.lanes()?.len();
        let factor = self.in_flight_factor();
        let in_flight = format!(
            "in flight per client thread: new connections {}, request/response connections {}, UDP exchanges {}, bulk streams {}",
            CRR_IN_FLIGHT * factor,
            RR_CONNECTIONS * factor,
            UDP_IN_FLIGHT * factor,
            BULK_CONNECTIONS * factor
        );
        Ok(match self {
            Shape::PinnedLanes => format!(
                "{lanes} lanes, one per CPU, each a client and a server thread pinned to its CPU; {in_flight}"
            ),
            Shape::Unpinned => format!(
                "{lanes} client and {lanes} server threads that the scheduler places; {in_flight}"
            ),
        })
    }

    fn in_flight_factor(self) -> usize {
        match self {
            Shape::PinnedLanes => 1,
            Shape::Unpinned => UNPINNED_IN_FLIGHT_FACTOR,
        }
    }

    /// The shape's lanes, each a client thread and the server thread it talks to.
    fn lanes(self) -> anyhow::Result<Vec<Lane>> {
        Ok(match self {
            Shape::PinnedLanes => cpus()?
                .into_iter()
                .take(MAX_PINNED_LANES)
                .enumerate()
                .map(|(id, cpu)| Lane { id, cpu: Some(cpu) })
                .collect(),
            Shape::Unpinned => (MAX_PINNED_LANES..LANE_IDS)
                .map(|id| Lane { id, cpu: None })
                .collect(),
        })
    }
}

/// A client thread and the server thread it talks to: `id` picks their ports.
#[derive(Clone, Copy)]
struct Lane {
    id: usize,
    /// The CPU both threads are pinned to, if they are.
    cpu: Option<usize>,
}

/// The CPUs this process may run on.
fn cpus() -> anyhow::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(io::Error::last_os_error()).context("sched_getaffinity");
    }
    let cpus = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect();
    Ok(cpus)
}

/// Moves the calling thread into `ns`, onto `lane`'s CPU if it has one, and gives it an event
/// loop.
fn lane_runtime(ns: &str, lane: Lane) -> anyhow::Result<tokio::runtime::Runtime> {
    netns::enter(ns)?;
    if let Some(cpu) = lane.cpu {
        // SAFETY: as in `cpus`; the set names one CPU, and pid 0 is the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(io::Error::last_os_error()).context("sched_setaffinity");
            }
        }
    }
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// The TCP ports the servers of new connections listen on, every lane's of every shape.
pub fn new_connection_ports() -> anyhow::Result<Vec<u16>> {
    let lanes = Shape::ALL
        .into_iter()
        .map(Shape::lanes)
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(lanes
        .concat()
        .into_iter()
        .flat_map(|lane| (0..u64::from(SERVER_PORTS)).map(move |i| crr_port(lane.id, i)))
        .collect())
}

/// The servers' half, in one namespace, a server thread for every lane of every shape:
/// connect-request-response servers, a request-response server, a bulk sink and UDP echo
/// servers, each on a port of its own. Stops when dropped.
pub struct Servers {
    lanes: Vec<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl Servers {
    pub fn start(ns: &str) -> anyhow::Result<Servers> {
        Servers::serving(ns, Tuples::Recurring)
    }

    /// Only the servers of new connections over `Tuples::Fresh`, every lane's: thousands of
    /// listeners, started where a measurement needs them.
    pub fn start_fresh(ns: &str) -> anyhow::Result<Servers> {
        Servers::serving(ns, Tuples::Fresh)
    }

    /// `Tuples::Recurring`: everything `serve_lane` serves.
    fn serving(ns: &str, tuples: Tuples) -> anyhow::Result<Servers> {
        let mut servers = Servers { lanes: Vec::new() };
        let lanes: Vec<Lane> = Shape::ALL
            .into_iter()
            .map(Shape::lanes)
            .collect::<anyhow::Result<Vec<_>>>()?
            .concat();
        for lane in lanes {
            let (stop, stopped) = oneshot::channel();
            let (ready, is_ready) = mpsc::channel();
            let ns = ns.to_string();
            let thread = std::thread::spawn(move || {
                let serve = || -> anyhow::Result<tokio::runtime::Runtime> {
                    let runtime = lane_runtime(&ns, lane)?;
                    match tuples {
                        Tuples::Recurring => runtime.block_on(serve_lane(lane.id))?,
                        Tuples::Fresh => runtime.block_on(serve_fresh_tuples(lane.id))?,
                    }
                    Ok(runtime)
                };
                match serve() {
                    Ok(runtime) => {
                        let _ = ready.send(Ok(()));
                        // Dropping the runtime afterwards ends every server task.
                        let _ = runtime.block_on(stopped);
                    }
                    Err(err) => {
                        let _ = ready.send(Err(err));
                    }
                }
            });
            servers.lanes.push((stop, thread));
            is_ready
                .recv()
                .context("server lane ended before it was ready")?
                .with_context(|| format!("server lane {}", lane.id))?;
        }
        Ok(servers)
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for (stop, thread) in self.lanes.drain(..) {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }
}

/// The addresses every server binds, one socket each: a socket of each family, so that an IPv4
/// client meets the IPv4 socket it always met, and not a dual-stack one's mapped addresses.
const SERVER_ADDRS: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    IpAddr::V6(Ipv6Addr::UNSPECIFIED),
];

/// Binds every server of `lane` and leaves them running on the current event loop.
async fn serve_lane(lane: usize) -> io::Result<()> {
    for addr in SERVER_ADDRS {
        for i in 0..u64::from(SERVER_PORTS) {
            tokio::spawn(accept_each(listen(addr, crr_port(lane, i))?, answer_once));
            tokio::spawn(echo_datagrams(bind_udp(addr, udp_port(lane, i))?));
        }
        tokio::spawn(accept_each(listen(addr, rr_port(lane))?, answer_each));
        tokio::spawn(accept_each(listen(addr, bulk_port(lane))?, drain));
    }
    Ok(())
}

/// Binds `lane`'s servers of new connections over `Tuples::Fresh`.
async fn serve_fresh_tuples(lane: usize) -> io::Result<()> {
    for addr in SERVER_ADDRS {
        for i in 0..u64::from(FRESH_SERVER_PORTS) {
            let port = Tuples::Fresh.server_port(lane, i);
            tokio::spawn(accept_each(listen(addr, port)?, answer_once));
        }
    }
    Ok(())
}

/// A TCP socket of `addr`'s family; an IPv6 one serves IPv6 alone (`SERVER_ADDRS`).
fn tcp_socket(addr: IpAddr) -> io::Result<TcpSocket> {
    match addr {
        IpAddr::V4(_) => TcpSocket::new_v4(),
        IpAddr::V6(_) => {
            let socket = TcpSocket::new_v6()?;
            socket2::SockRef::from(&socket).set_only_v6(true)?;
            Ok(socket)
        }
    }
}

fn listen(addr: IpAddr, port: u16) -> io::Result<TcpListener> {
    let socket = tcp_socket(addr)?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::new(addr, port))?;
    socket.listen(4096)
}

/// A server's UDP socket bound to `port` of `addr`, of `addr`'s family; an IPv6 one serves
/// IPv6 alone, as `tcp_socket`'s.
fn bind_udp(addr: IpAddr, port: u16) -> io::Result<UdpSocket> {
    let domain = socket2::Domain::for_address(SocketAddr::new(addr, port));
    let socket = socket2::Socket::new(domain, socket2::Type::DGRAM, None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::new(addr, port).into())?;
    UdpSocket::from_std(socket.into())
}

/// The unspecified address of `server`'s family, which a client binds to reach it.
fn any_of(server: IpAddr) -> IpAddr {
    match server {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

async fn accept_each<F: Future<Output = io::Result<()>> + Send + 'static>(
    listener: TcpListener,
    handle: fn(TcpStream) -> F,
) {
    loop {
        if let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(handle(stream));
        }
    }
}

/// One request, one response, then the client closes.
async fn answer_once(mut stream: TcpStream) -> io::Result<()> {
    let mut byte = [0u8; 1];
    stream.read_exact(&mut byte).await?;
    stream.write_all(&byte).await?;
    let _ = stream.read(&mut byte).await;
    Ok(())
}

/// Requests and responses until the client closes.
async fn answer_each(mut stream: TcpStream) -> io::Result<()> {
    let mut byte = [0u8; 1];
    loop {
        stream.read_exact(&mut byte).await?;
        stream.write_all(&byte).await?;
    }
}

async fn drain(mut stream: TcpStream) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 16];
    while stream.read(&mut buf).await? > 0 {}
    Ok(())
}

async fn echo_datagrams(socket: UdpSocket) {
    // Room for any datagram, so that fragmented ones come back whole.
    let mut buf = vec![0u8; 65_536];
    loop {
        if let Ok((n, peer)) = socket.recv_from(&mut buf).await {
            let _ = socket.send_to(&buf[..n], peer).await;
        }
    }
}

/// What one client task of a measurement is given: its lane, its index within the lane, and
/// when to stop.
#[derive(Clone, Copy)]
struct Task {
    lane: usize,
    index: usize,
    deadline: Instant,
    /// When a paced task starts its first operation, and the time between its starts.
    pace: Option<(Instant, Duration)>,
}

impl Task {
    /// Runs `op` until the deadline and returns the units it completed. An operation that
    /// fails or times out does not count.
    async fn repeat<Fut: Future<Output = io::Result<u64>>>(
        self,
        mut op: impl FnMut(u64) -> Fut,
    ) -> u64 {
        let (mut done, mut seq) = (0, 0);
        while Instant::now() < self.deadline {
            if let Some((first, period)) = self.pace {
                // Behind its schedule, a task goes on at once: the rate is at most the pace.
                let due = first + period.mul_f64(seq as f64);
                if due >= self.deadline {
                    break;
                }
                tokio::time::sleep_until(due.into()).await;
            }
            if let Ok(Ok(units)) = timeout(OP_TIMEOUT, op(seq)).await {
                done += units;
            }
            seq += 1;
        }
        done
    }
}

async fn connect(server: IpAddr, port: u16) -> io::Result<TcpStream> {
    let socket = tcp_socket(server)?;
    // Close with a reset: no TIME_WAIT piles up in the client over thousands of connections.
    // (A zero linger never blocks, the reason tokio deprecates setting it.)
    socket2::SockRef::from(&socket).set_linger(Some(Duration::ZERO))?;
    let stream = socket.connect(SocketAddr::new(server, port)).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// One measurement: clients in the namespace `ns` against `server`, laid out as `shape`, for
/// `duration`. Each kind of load is a method.
#[derive(Clone, Copy)]
pub struct Load<'a> {
    pub ns: &'a str,
    pub server: IpAddr,
    pub shape: Shape,
    pub duration: Duration,
    /// At most this many operations a second, over all lanes, spread evenly over the tasks and
    /// the time; `None`: as many as the tasks complete.
    pub pace: Option<f64>,
    /// Which server ports new connections go to (`Tuples::Fresh` needs
    /// `Servers::start_fresh`).
    pub tuples: Tuples,
}

impl Load<'_> {
    /// Runs `in_flight` tasks (as many per pinned lane, scaled by the shape) per lane and
    /// returns the units they completed per second, summed over lanes.
    fn rate<Fut>(
        self,
        in_flight: usize,
        task: impl Fn(Task) -> Fut + Send + Clone + 'static,
    ) -> anyhow::Result<f64>
    where
        Fut: Future<Output = u64> + 'static,
    {
        let started = Instant::now();
        let deadline = started + self.duration;
        let in_flight = in_flight * self.shape.in_flight_factor();
        let lanes = self.shape.lanes()?;
        let tasks = lanes.len() * in_flight;
        // Each task starts an operation every `period`, the tasks staggered across it.
        let period = self
            .pace
            .map(|rate| Duration::from_secs_f64(tasks as f64 / rate));
        let pace_of = move |lane_at: usize, index: usize| {
            period.map(|period| {
                let nth = (lane_at * in_flight + index) as f64 / tasks as f64;
                (started + period.mul_f64(nth), period)
            })
        };
        let threads: Vec<_> = lanes
            .into_iter()
            .enumerate()
            .map(|(lane_at, lane)| {
                let (ns, task) = (self.ns.to_string(), task.clone());
                std::thread::spawn(move || -> anyhow::Result<u64> {
                    let runtime = lane_runtime(&ns, lane)?;
                    let local = tokio::task::LocalSet::new();
                    let total = local.block_on(&runtime, async move {
                        let tasks: Vec<_> = (0..in_flight)
                            .map(|index| {
                                tokio::task::spawn_local(task(Task {
                                    lane: lane.id,
                                    index,
                                    deadline,
                                    pace: pace_of(lane_at, index),
                                }))
                            })
                            .collect();
                        let mut total = 0;
                        for t in tasks {
                            total += t.await.unwrap_or(0);
                        }
                        total
                    });
                    Ok(total)
                })
            })
            .collect();
        let mut total = 0;
        for thread in threads {
            total += thread
                .join()
                .map_err(|_| anyhow::anyhow!("load lane panicked"))??;
        }
        Ok(total as f64 / started.elapsed().as_secs_f64())
    }

    /// New TCP connections per second: connect, one request and response, close.
    pub fn new_connections(self) -> anyhow::Result<f64> {
        let (server, tuples) = (self.server, self.tuples);
        self.rate(CRR_IN_FLIGHT, move |task| {
            task.repeat(move |seq| async move {
                let port = tuples.server_port(task.lane, task.index as u64 + seq);
                let mut stream = connect(server, port).await?;
                let mut byte = [7u8; 1];
                stream.write_all(&byte).await?;
                stream.read_exact(&mut byte).await?;
                Ok(1)
            })
        })
    }

    /// Request/response transactions per second on established connections.
    pub fn transactions(self) -> anyhow::Result<f64> {
        let server = self.server;
        self.rate(RR_CONNECTIONS, move |task| async move {
            let Ok(mut stream) = connect(server, rr_port(task.lane)).await else {
                return 0;
            };
            let mut done = 0;
            let mut byte = [1u8; 1];
            while Instant::now() < task.deadline {
                let transaction = async {
                    stream.write_all(&byte).await?;
                    stream.read_exact(&mut byte).await
                };
                match timeout(OP_TIMEOUT, transaction).await {
                    Ok(Ok(_)) => done += 1,
                    // A broken connection cannot carry on.
                    _ => break,
                }
            }
            done
        })
    }

    /// Bulk TCP throughput in bits per second.
    pub fn throughput(self) -> anyhow::Result<f64> {
        let server = self.server;
        let bytes_per_second = self.rate(BULK_CONNECTIONS, move |task| async move {
            let Ok(mut stream) = connect(server, bulk_port(task.lane)).await else {
                return 0;
            };
            let chunk = vec![0x5au8; 1 << 16];
            let mut sent = 0;
            while Instant::now() < task.deadline {
                match timeout(OP_TIMEOUT, stream.write_all(&chunk)).await {
                    Ok(Ok(())) => sent += chunk.len() as u64,
                    _ => break,
                }
            }
            sent
        })?;
        Ok(bytes_per_second * 8.0)
    }

    /// UDP request/response per second, each from a new source port (so each is a new flow).
    pub fn udp_new_flows(self) -> anyhow::Result<f64> {
        let server = self.server;
        self.rate(UDP_IN_FLIGHT, move |task| {
            task.repeat(move |seq| async move {
                let port = udp_port(task.lane, task.index as u64 + seq);
                let socket = UdpSocket::bind((any_of(server), 0)).await?;
                socket.send_to(b"q", SocketAddr::new(server, port)).await?;
                let mut buf = [0u8; 8];
                socket.recv_from(&mut buf).await?;
                Ok(1)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paced task starts no operation before its turn, nor one whose turn falls past the
    /// deadline: never more than the pace, however fast its operations.
    #[test]
    fn a_paced_task_never_runs_ahead_of_its_schedule() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let first = Instant::now();
        let period = Duration::from_millis(10);
        let task = Task {
            lane: 0,
            index: 0,
            deadline: first + period * 5 + period / 2,
            pace: Some((first, period)),
        };
        let started: std::rc::Rc<std::cell::RefCell<Vec<Instant>>> = Default::default();
        let log = started.clone();
        let done = runtime.block_on(task.repeat(move |_| {
            log.borrow_mut().push(Instant::now());
            async { Ok(1) }
        }));
        let started = started.borrow();
        assert_eq!(done, started.len() as u64);
        assert!(
            started.len() <= 6,
            "{} operations in 5.5 periods",
            started.len()
        );
        for (nth, at) in started.iter().enumerate() {
            assert!(
                *at >= first + period * nth as u32,
                "operation {nth} ran early"
            );
        }
    }

    /// A server port holds a socket of each family, each taking its own family's clients: a
    /// dual-stack IPv6 socket could not share the port with the IPv4 one (its bind would fail),
    /// and would make the IPv4 figures a mapped address's.
    #[test]
    fn a_server_port_takes_a_socket_of_each_family_and_each_its_own_familys_clients() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let v4 = listen(SERVER_ADDRS[0], 0).unwrap();
            let port = v4.local_addr().unwrap().port();
            let v6 = listen(SERVER_ADDRS[1], port).unwrap();
            assert_eq!(v6.local_addr().unwrap().port(), port);
            let udp_v4 = bind_udp(SERVER_ADDRS[0], 0).unwrap();
            let udp_port = udp_v4.local_addr().unwrap().port();
            bind_udp(SERVER_ADDRS[1], udp_port).unwrap();

            let client = connect(Ipv6Addr::LOCALHOST.into(), port).await;
            let (accepted, peer) = v6.accept().await.unwrap();
            assert!(peer.is_ipv6(), "{peer}");
            drop((client, accepted));
            connect(Ipv4Addr::LOCALHOST.into(), port).await.unwrap();
            assert!(v4.accept().await.unwrap().1.is_ipv4());
        });
    }

    #[test]
    fn the_shapes_lanes_never_share_a_server_port() {
        let lanes: Vec<Lane> = Shape::ALL
            .into_iter()
            .flat_map(|shape| shape.lanes().unwrap())
            .collect();
        let mut ports = std::collections::BTreeSet::new();
        for lane in &lanes {
            for i in 0..u64::from(SERVER_PORTS) {
                assert!(ports.insert(crr_port(lane.id, i)));
                assert!(ports.insert(udp_port(lane.id, i)));
            }
            assert!(ports.insert(rr_port(lane.id)));
            assert!(ports.insert(bulk_port(lane.id)));
            for i in 0..u64::from(FRESH_SERVER_PORTS) {
                assert!(ports.insert(Tuples::Fresh.server_port(lane.id, i)));
            }
        }
        let connection_ports = new_connection_ports().unwrap();
        assert_eq!(
            connection_ports.len(),
            lanes.len() * usize::from(SERVER_PORTS)
        );
        assert!(
            connection_ports
                .iter()
                .all(|port| ports.contains(port) && (CRR_BASE..RR_BASE).contains(port))
        );
        let unpinned = Shape::Unpinned.lanes().unwrap();
        assert_eq!(unpinned.len(), UNPINNED_LANES);
        assert!(unpinned.iter().all(|lane| lane.cpu.is_none()));
        assert!(
            Shape::PinnedLanes
                .lanes()
                .unwrap()
                .iter()
                .all(|lane| lane.cpu.is_some())
        );
    }

    #[test]
    fn a_shape_is_named_on_the_command_line_by_its_key() {
        for shape in Shape::ALL {
            assert_eq!(Shape::from_key(shape.key()), Ok(shape));
        }
        let err = Shape::from_key("pinned lanes").unwrap_err();
        assert!(err.contains("pinned, unpinned"), "{err}");
    }
}
