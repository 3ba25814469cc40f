//! The TCP rendezvous store: [`Store`], [`StoreServer`], [`RendezvousEnv`].

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_core::{Error, Result};

/// How long store operations wait by default (connecting, blocking gets, joining).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// Extra time a client waits for the server's answer to a blocking request beyond
/// the request's own timeout (which the server enforces).
const ANSWER_GRACE: Duration = Duration::from_secs(5);

/// Frames larger than this are refused (a stray client speaking another protocol).
const MAX_FRAME: usize = 64 << 20;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_CHECK: u8 = 5;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;

/// Key prefix of the arrival marks written by [`Store::wait_for_all_ranks`].
const JOINED: &str = "tessera/store/joined";

// ---------------------------------------------------------------------------------
// Environment
// ---------------------------------------------------------------------------------

/// The torchrun environment of one rank: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `MASTER_ADDR`, `MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// This process's rank, `0..world_size` (`RANK`).
    pub rank: usize,
    /// The number of processes (`WORLD_SIZE`).
    pub world_size: usize,
    /// This process's index on its node (`LOCAL_RANK`): its CUDA device.
    pub local_rank: usize,
    /// The host of rank 0's store (`MASTER_ADDR`).
    pub master_addr: String,
    /// The port of rank 0's store (`MASTER_PORT`).
    pub master_port: u16,
}

impl RendezvousEnv {
    /// Reads the variables from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `lookup` (for tests and launchers that hold the
    /// environment in a map). Errors name the missing or invalid variable.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        const OP: &str = "RendezvousEnv";
        const ALL: &str = "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT";
        let get = |name: &str| -> Result<String> {
            match lookup(name) {
                Some(v) if !v.trim().is_empty() => Ok(v.trim().to_owned()),
                Some(_) => Err(Error::invalid(
                    OP,
                    format!(
                        "the environment variable {name} is empty (a launcher such as torchrun or `cargo xtask test-gpu` sets {ALL})"
                    ),
                )),
                None => Err(Error::invalid(
                    OP,
                    format!(
                        "the environment variable {name} is not set (a launcher such as torchrun or `cargo xtask test-gpu` sets {ALL})"
                    ),
                )),
            }
        };
        let number = |name: &str| -> Result<usize> {
            let v = get(name)?;
            v.parse::<usize>().map_err(|_| {
                Error::invalid(
                    OP,
                    format!("the environment variable {name}={v:?} is not a non-negative integer"),
                )
            })
        };
        let rank = number("RANK")?;
        let world_size = number("WORLD_SIZE")?;
        let local_rank = number("LOCAL_RANK")?;
        let master_addr = get("MASTER_ADDR")?;
        let port = get("MASTER_PORT")?;
        let master_port = port.parse::<u16>().map_err(|_| {
            Error::invalid(
                OP,
                format!(
                    "the environment variable MASTER_PORT={port:?} is not a port number (0..=65535)"
                ),
            )
        })?;
        if world_size == 0 {
            return Err(Error::invalid(
                OP,
                "the environment variable WORLD_SIZE=0: a job needs at least one rank",
            ));
        }
        if rank >= world_size {
            return Err(Error::invalid(
                OP,
                format!(
                    "the environment variable RANK={rank} is not below WORLD_SIZE={world_size}"
                ),
            ));
        }
        Ok(RendezvousEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT`, with IPv6 literals in brackets.
    pub fn master(&self) -> String {
        host_port(&self.master_addr, self.master_port)
    }
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

// ---------------------------------------------------------------------------------
// Wire format
// ---------------------------------------------------------------------------------

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn write_frame(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "store message too large"))?;
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(payload);
    w.write_all(&frame)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("store frame of {len} bytes exceeds the limit of {MAX_FRAME}"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Reads the fields of a frame, failing (not panicking) on truncated input.
struct Fields<'a> {
    buf: &'a [u8],
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "truncated store message",
            ));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }

    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    fn key(&mut self) -> io::Result<String> {
        String::from_utf8(self.bytes()?.to_vec())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "store key is not UTF-8"))
    }

    fn keys(&mut self) -> io::Result<Vec<String>> {
        let n = self.u32()? as usize;
        (0..n).map(|_| self.key()).collect()
    }
}

// ---------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------

type Data = HashMap<String, Vec<u8>>;

struct ServerShared {
    data: Mutex<Data>,
    changed: Condvar,
    shutdown: AtomicBool,
    /// Requests read but not yet answered.
    in_flight: AtomicUsize,
    connections: Mutex<Vec<TcpStream>>,
}

/// How a blocking request's wait ended.
enum Waited<'a> {
    Ready(MutexGuard<'a, Data>),
    TimedOut(MutexGuard<'a, Data>),
    ShuttingDown,
}

impl ServerShared {
    fn lock(&self) -> MutexGuard<'_, Data> {
        self.data.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `ready(data)`, the deadline, or shutdown.
    fn wait_until<'a>(
        &'a self,
        mut data: MutexGuard<'a, Data>,
        timeout: Duration,
        ready: impl Fn(&Data) -> bool,
    ) -> Waited<'a> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if ready(&data) {
                return Waited::Ready(data);
            }
            if self.shutdown.load(Ordering::SeqCst) {
                return Waited::ShuttingDown;
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => return Waited::TimedOut(data),
                Some(d) => (d - now).min(Duration::from_millis(200)),
                None => Duration::from_millis(200),
            };
            data = self
                .changed
                .wait_timeout(data, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Handles one request and returns the reply payload; `None` for a blocking
    /// request interrupted by shutdown (it gets no answer).
    fn handle(&self, req: &[u8]) -> io::Result<Option<Vec<u8>>> {
        let mut f = Fields { buf: req };
        let op = f.u8()?;
        let mut reply = Vec::new();
        match op {
            OP_SET => {
                let key = f.key()?;
                let value = f.bytes()?.to_vec();
                self.lock().insert(key, value);
                self.changed.notify_all();
                reply.push(ST_OK);
            }
            OP_GET => {
                let key = f.key()?;
                let timeout = Duration::from_millis(f.u64()?);
                match self.wait_until(self.lock(), timeout, |d| d.contains_key(&key)) {
                    Waited::Ready(data) => {
                        reply.push(ST_OK);
                        put_bytes(&mut reply, &data[&key]);
                    }
                    Waited::TimedOut(_) => reply.push(ST_TIMEOUT),
                    Waited::ShuttingDown => return Ok(None),
                }
            }
            OP_ADD => {
                let key = f.key()?;
                let delta = f.u64()? as i64;
                let mut data = self.lock();
                let old = match data.get(&key) {
                    None => Some(0i64),
                    Some(v) => std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.parse::<i64>().ok()),
                };
                match old {
                    Some(old) => {
                        let new = old.wrapping_add(delta);
                        data.insert(key, new.to_string().into_bytes());
                        drop(data);
                        self.changed.notify_all();
                        reply.push(ST_OK);
                        put_u64(&mut reply, new as u64);
                    }
                    None => {
                        reply.push(ST_ERROR);
                        put_bytes(
                            &mut reply,
                            format!("the value of key `{key}` is not an integer counter")
                                .as_bytes(),
                        );
                    }
                }
            }
            OP_WAIT => {
                let keys = f.keys()?;
                let timeout = Duration::from_millis(f.u64()?);
                match self.wait_until(self.lock(), timeout, |d| {
                    keys.iter().all(|k| d.contains_key(k))
                }) {
                    Waited::Ready(_) => reply.push(ST_OK),
                    Waited::ShuttingDown => return Ok(None),
                    Waited::TimedOut(data) => {
                        reply.push(ST_TIMEOUT);
                        let missing: Vec<&String> =
                            keys.iter().filter(|k| !data.contains_key(*k)).collect();
                        reply.extend_from_slice(&(missing.len() as u32).to_le_bytes());
                        for k in missing {
                            put_bytes(&mut reply, k.as_bytes());
                        }
                    }
                }
            }
            OP_CHECK => {
                let keys = f.keys()?;
                let data = self.lock();
                reply.push(ST_OK);
                reply.extend(keys.iter().map(|k| u8::from(data.contains_key(k))));
            }
            other => {
                reply.push(ST_ERROR);
                put_bytes(
                    &mut reply,
                    format!("unknown store opcode {other}").as_bytes(),
                );
            }
        }
        Ok(Some(reply))
    }
}

/// The server side of the store: a listening socket and one thread per connection.
///
/// Dropping it (or [`shutdown`](StoreServer::shutdown)) closes every connection, so
/// clients still using the store get an error saying it went away rather than hang.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<ServerShared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port; see
    /// [`local_addr`](StoreServer::local_addr)) and serves in background threads.
    pub fn bind(addr: impl ToSocketAddrs + fmt::Debug) -> Result<StoreServer> {
        let listener = TcpListener::bind(&addr).map_err(|e| {
            Error::state(
                "StoreServer::bind",
                format!("could not listen on {addr:?}: {e} (is another job using this port?)"),
            )
        })?;
        let io_err = |e: io::Error| Error::state("StoreServer::bind", e.to_string());
        let local = listener.local_addr().map_err(io_err)?;
        // Polled, so that shutting down never depends on waking a blocked accept.
        listener.set_nonblocking(true).map_err(io_err)?;
        let shared = Arc::new(ServerShared {
            data: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            connections: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("tessera-store".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(io_err)?;
        Ok(StoreServer {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and closes every connection.
    pub fn shutdown(self) {}
}

fn accept_loop(listener: TcpListener, shared: Arc<ServerShared>) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_nodelay(true);
                if let Ok(clone) = stream.try_clone() {
                    shared
                        .connections
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(clone);
                }
                let s = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("tessera-store-conn".into())
                    .spawn(move || serve_connection(stream, s));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "store: could not start a connection thread");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!(error = %e, "store: accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn serve_connection(mut stream: TcpStream, shared: Arc<ServerShared>) {
    loop {
        let req = match read_frame(&mut stream) {
            Ok(r) => r,
            Err(_) => return, // closed by the client, or shut down
        };
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        // A server shutting down takes no new requests, and a blocked request it
        // interrupts gets no answer: those clients see the connection close ("the
        // server went away"). Requests already answered are still sent.
        let reply = if shared.shutdown.load(Ordering::SeqCst) {
            None
        } else {
            match shared.handle(&req) {
                Ok(r) => r,
                Err(e) => {
                    let mut r = vec![ST_ERROR];
                    put_bytes(&mut r, format!("malformed request: {e}").as_bytes());
                    Some(r)
                }
            }
        };
        let sent = reply.is_some_and(|r| write_frame(&mut stream, &r).is_ok());
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !sent {
            return;
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // Let answers already computed (e.g. the last barrier's) reach their clients.
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.shared.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        for c in self
            .shared
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

// ---------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------

/// A TCP rendezvous store, torchrun-style, on `std::net` (no async runtime).
///
/// One process (rank 0, in [`Store::from_env`]) runs a [`StoreServer`] on
/// `MASTER_ADDR:MASTER_PORT`; every rank connects a [`Store`] client to it and they
/// exchange small values under string keys: NCCL unique ids (128 bytes), barrier
/// counters, IPC handles. Operations:
///
/// - [`set`](Store::set) a key to a value (overwriting);
/// - [`get`](Store::get) a key's value, blocking until some rank sets it, up to a
///   timeout;
/// - [`add`](Store::add) to a key's integer counter atomically and read the new value
///   (for barriers; counters are stored as decimal text, as torch's `TCPStore` does);
/// - [`wait`](Store::wait) until every key of a list is present;
/// - [`check`](Store::check) whether keys are present, without blocking.
///
/// Every request is one length-prefixed frame (`u32` little-endian length, then the
/// opcode and its fields) answered by one frame; blocking requests carry their
/// timeout, which the server enforces, so a client never waits on a silent server for
/// longer than the timeout plus a grace period. Clients connect with retry and
/// exponential backoff until a deadline, so ranks may start in any order. Failures
/// are typed [`Error`]s that say who was missing and where:
/// `rank 3 of 4 did not reach the store at 127.0.0.1:29500 within 30s`.
///
/// ```
/// use std::time::Duration;
/// use tessera_collectives::Store;
///
/// # fn main() -> tessera_core::Result<()> {
/// // Rank 0 hosts the store (port 0: any free port); rank 1 connects to it.
/// let timeout = Duration::from_secs(5);
/// let store0 = Store::serve("127.0.0.1:0", 2, timeout)?;
/// let addr = store0.addr().to_string();
/// let rank1 = std::thread::spawn(move || -> tessera_core::Result<Vec<u8>> {
///     let store1 = Store::connect(&addr, 1, 2, timeout)?;
///     store1.wait_for_all_ranks()?;
///     store1.get("greeting")
/// });
/// store0.wait_for_all_ranks()?;
/// store0.set("greeting", b"hello")?;
/// assert_eq!(rank1.join().unwrap()?, b"hello");
/// # Ok(())
/// # }
/// ```
///
/// A `Store` is one rank's connection (and, on the rank that hosts it, owns the
/// [`StoreServer`]). It is `Send + Sync`: requests from several threads are serialized
/// on the one connection, so a thread blocked in [`get`](Store::get) or
/// [`wait`](Store::wait) holds up the others' requests until it returns; give a thread
/// that must make progress meanwhile its own [`connect`](Store::connect)ion.
pub struct Store {
    conn: Mutex<TcpStream>,
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    namespaces: AtomicU64,
    server: Option<StoreServer>,
}

/// What the server answered.
enum Reply<'a> {
    Ok(Fields<'a>),
    Timeout(Fields<'a>),
}

impl Store {
    /// Connects rank `rank` of `world_size` to the store at `addr` (`host:port`),
    /// retrying with backoff until `timeout` has passed; `timeout` is also the default
    /// for blocking operations.
    pub fn connect(addr: &str, rank: usize, world_size: usize, timeout: Duration) -> Result<Store> {
        check_rank("Store::connect", rank, world_size)?;
        let deadline = Instant::now().checked_add(timeout);
        let mut backoff = Duration::from_millis(5);
        let last_error = loop {
            let err = match addr.to_socket_addrs() {
                Ok(addrs) => {
                    let addrs: Vec<SocketAddr> = addrs.collect();
                    let mut last = io::Error::new(
                        io::ErrorKind::NotFound,
                        "the host name resolved to no address",
                    );
                    let mut connected = None;
                    for a in &addrs {
                        let left = deadline
                            .map(|d| d.saturating_duration_since(Instant::now()))
                            .unwrap_or(Duration::from_secs(5))
                            .clamp(Duration::from_millis(1), Duration::from_secs(5));
                        match TcpStream::connect_timeout(a, left) {
                            Ok(s) => {
                                connected = Some(s);
                                break;
                            }
                            Err(e) => last = e,
                        }
                    }
                    match connected {
                        Some(stream) => {
                            let _ = stream.set_nodelay(true);
                            return Ok(Store {
                                conn: Mutex::new(stream),
                                addr: addr.to_owned(),
                                rank,
                                world_size,
                                timeout,
                                namespaces: AtomicU64::new(0),
                                server: None,
                            });
                        }
                        None => last,
                    }
                }
                Err(e) => e,
            };
            let now = Instant::now();
            match deadline {
                Some(d) if now >= d => break err,
                Some(d) => std::thread::sleep(backoff.min(d - now)),
                None => std::thread::sleep(backoff),
            }
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        Err(Error::state(
            "Store::connect",
            format!(
                "rank {rank} of {world_size} did not reach the store at {addr} within {timeout:?}: {last_error}"
            ),
        ))
    }

    /// Starts a [`StoreServer`] on `addr` and connects to it as rank 0 of
    /// `world_size`; the returned store owns the server, which stops when the store
    /// is dropped. `addr` may have port 0 (see [`addr`](Store::addr)).
    pub fn serve(addr: &str, world_size: usize, timeout: Duration) -> Result<Store> {
        check_rank("Store::serve", 0, world_size)?;
        let server = StoreServer::bind(addr)?;
        let local = server.local_addr();
        let connect_to = SocketAddr::new(loopback_if_unspecified(local.ip()), local.port());
        let mut store = Store::connect(&connect_to.to_string(), 0, world_size, timeout)?;
        store.server = Some(server);
        Ok(store)
    }

    /// The store of a torchrun-style job: rank 0 listens on `MASTER_PORT` (on every
    /// interface of `MASTER_ADDR`'s address family) and every rank connects to
    /// `MASTER_ADDR:MASTER_PORT`; then all ranks wait for each other
    /// ([`wait_for_all_ranks`](Store::wait_for_all_ranks)), so a missing rank is
    /// reported by number. Uses [`DEFAULT_STORE_TIMEOUT`].
    pub fn from_env() -> Result<Store> {
        Store::from_rendezvous(&RendezvousEnv::from_env()?, DEFAULT_STORE_TIMEOUT)
    }

    /// [`from_env`](Store::from_env) for an already-read environment and a timeout.
    pub fn from_rendezvous(env: &RendezvousEnv, timeout: Duration) -> Result<Store> {
        let master = env.master();
        let store = if env.rank == 0 {
            let family = master
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .map(|a| a.ip())
                .ok_or_else(|| {
                    Error::invalid(
                        "Store::from_env",
                        format!(
                            "MASTER_ADDR={:?} does not resolve to an address",
                            env.master_addr
                        ),
                    )
                })?;
            let any: IpAddr = match family {
                IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
                IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
            };
            let server = StoreServer::bind(SocketAddr::new(any, env.master_port))?;
            let mut store = Store::connect(&master, 0, env.world_size, timeout)?;
            store.server = Some(server);
            store
        } else {
            Store::connect(&master, env.rank, env.world_size, timeout)?
        };
        store.wait_for_all_ranks()?;
        Ok(store)
    }

    /// The address this store connects to (`host:port`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This client's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks sharing the store.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The default timeout of blocking operations.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether this process hosts the server.
    pub fn is_server(&self) -> bool {
        self.server.is_some()
    }

    /// A fresh key prefix `"{what}/{n}"`, `n` counting this store's calls. Every rank
    /// that makes the same calls in the same order gets the same prefixes, so groups
    /// created one after another do not mix their keys.
    pub fn next_namespace(&self, what: &str) -> String {
        format!("{what}/{}", self.namespaces.fetch_add(1, Ordering::SeqCst))
    }

    /// Sets `key` to `value`, waking ranks blocked on it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![OP_SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.request("Store::set", &req, self.timeout, |reply| match reply {
            Reply::Ok(_) => Ok(()),
            Reply::Timeout(_) => Err(self.protocol_error("Store::set")),
        })
    }

    /// The value of `key`, waiting up to the store's timeout for some rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut req = vec![OP_GET];
        put_bytes(&mut req, key.as_bytes());
        put_u64(&mut req, millis(timeout));
        self.request("Store::get", &req, timeout, |reply| match reply {
            Reply::Ok(mut f) => Ok(f
                .bytes()
                .map_err(|e| self.io_error("Store::get", e))?
                .to_vec()),
            Reply::Timeout(_) => Err(Error::state(
                "Store::get",
                format!(
                    "rank {} of {}: key `{key}` was not set within {timeout:?} (store at {})",
                    self.rank, self.world_size, self.addr
                ),
            )),
        })
    }

    /// Adds `delta` to the integer counter `key` (absent = 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![OP_ADD];
        put_bytes(&mut req, key.as_bytes());
        put_u64(&mut req, delta as u64);
        self.request("Store::add", &req, self.timeout, |reply| match reply {
            Reply::Ok(mut f) => Ok(f.u64().map_err(|e| self.io_error("Store::add", e))? as i64),
            Reply::Timeout(_) => Err(self.protocol_error("Store::add")),
        })
    }

    /// Waits until every key of `keys` is set, up to `timeout`; the error lists the
    /// keys still missing.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        match self.wait_missing(keys, timeout)? {
            None => Ok(()),
            Some(missing) => Err(Error::state(
                "Store::wait",
                format!(
                    "rank {} of {}: keys {missing:?} were not set within {timeout:?} (store at {})",
                    self.rank, self.world_size, self.addr
                ),
            )),
        }
    }

    /// Which of `keys` are set now (no waiting).
    pub fn check(&self, keys: &[&str]) -> Result<Vec<bool>> {
        let mut req = vec![OP_CHECK];
        put_keys(&mut req, keys);
        self.request("Store::check", &req, self.timeout, |reply| match reply {
            Reply::Ok(mut f) => {
                let flags = f
                    .take(keys.len())
                    .map_err(|e| self.io_error("Store::check", e))?;
                Ok(flags.iter().map(|&b| b != 0).collect())
            }
            Reply::Timeout(_) => Err(self.protocol_error("Store::check")),
        })
    }

    /// Marks this rank as arrived and waits (up to the store's timeout) for every rank
    /// of the job; the error names the ranks that never arrived:
    /// `rank 3 of 4 did not reach the store at 127.0.0.1:29500 within 30s`.
    pub fn wait_for_all_ranks(&self) -> Result<()> {
        self.set(&format!("{JOINED}/{}", self.rank), b"1")?;
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("{JOINED}/{r}"))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let Some(missing) = self.wait_missing(&refs, self.timeout)? else {
            return Ok(());
        };
        let ranks: Vec<String> = missing
            .iter()
            .filter_map(|k| k.rsplit('/').next())
            .map(str::to_owned)
            .collect();
        let who = match ranks.as_slice() {
            [one] => format!("rank {one}"),
            many => format!("ranks {}", many.join(", ")),
        };
        Err(Error::state(
            "Store::wait_for_all_ranks",
            format!(
                "{who} of {} did not reach the store at {} within {:?}",
                self.world_size, self.addr, self.timeout
            ),
        ))
    }

    /// A barrier of all ranks under `name` (use each name once): an atomic counter,
    /// and the last rank to arrive releases the others. Waits up to the store's
    /// timeout; the error says how many ranks arrived.
    pub fn barrier(&self, name: &str) -> Result<()> {
        let count = format!("tessera/barrier/{name}/count");
        let done = format!("tessera/barrier/{name}/done");
        let n = self.add(&count, 1)?;
        if n == self.world_size as i64 {
            self.set(&done, b"1")?;
        }
        match self.wait_missing(&[done.as_str()], self.timeout)? {
            None => Ok(()),
            Some(_) => {
                let arrived = self.add(&count, 0)?;
                Err(Error::state(
                    "Store::barrier",
                    format!(
                        "rank {} of {}: only {arrived} of {} ranks reached barrier `{name}` within {:?} (store at {})",
                        self.rank, self.world_size, self.world_size, self.timeout, self.addr
                    ),
                ))
            }
        }
    }

    fn wait_missing(&self, keys: &[&str], timeout: Duration) -> Result<Option<Vec<String>>> {
        let mut req = vec![OP_WAIT];
        put_keys(&mut req, keys);
        put_u64(&mut req, millis(timeout));
        self.request("Store::wait", &req, timeout, |reply| match reply {
            Reply::Ok(_) => Ok(None),
            Reply::Timeout(mut f) => {
                Ok(Some(f.keys().map_err(|e| self.io_error("Store::wait", e))?))
            }
        })
    }

    /// Sends one request and decodes the reply with `decode`.
    fn request<T>(
        &self,
        op: &'static str,
        req: &[u8],
        wait: Duration,
        decode: impl FnOnce(Reply<'_>) -> Result<T>,
    ) -> Result<T> {
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let answer_within = wait.checked_add(ANSWER_GRACE);
        conn.set_read_timeout(answer_within.filter(|d| !d.is_zero()))
            .map_err(|e| self.io_error(op, e))?;
        write_frame(&mut *conn, req).map_err(|e| self.io_error(op, e))?;
        let reply = read_frame(&mut *conn).map_err(|e| self.io_error(op, e))?;
        drop(conn);
        let mut f = Fields { buf: &reply };
        match f.u8().map_err(|e| self.io_error(op, e))? {
            ST_OK => decode(Reply::Ok(f)),
            ST_TIMEOUT => decode(Reply::Timeout(f)),
            _ => {
                let msg = f
                    .bytes()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_else(|_| "malformed error reply".into());
                Err(Error::state(
                    op,
                    format!("the store at {} refused the request: {msg}", self.addr),
                ))
            }
        }
    }

    fn io_error(&self, op: &'static str, e: io::Error) -> Error {
        let what = match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => {
                "the store server went away (did rank 0's process exit?)"
            }
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                "the store server did not answer in time"
            }
            _ => "the connection to the store failed",
        };
        Error::state(
            op,
            format!(
                "rank {} of {}: {what}: {e} (store at {})",
                self.rank, self.world_size, self.addr
            ),
        )
    }

    fn protocol_error(&self, op: &'static str) -> Error {
        Error::state(
            op,
            format!("unexpected reply from the store at {}", self.addr),
        )
    }
}

fn put_keys(req: &mut Vec<u8>, keys: &[&str]) {
    req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        put_bytes(req, k.as_bytes());
    }
}

fn check_rank(op: &'static str, rank: usize, world_size: usize) -> Result<()> {
    if world_size == 0 || rank >= world_size {
        return Err(Error::invalid(
            op,
            format!("rank {rank} is not a rank of a job of {world_size}"),
        ));
    }
    Ok(())
}

fn loopback_if_unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v) if v.is_unspecified() => Ipv4Addr::LOCALHOST.into(),
        IpAddr::V6(v) if v.is_unspecified() => Ipv6Addr::LOCALHOST.into(),
        other => other,
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("addr", &self.addr)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("server", &self.server.is_some())
            .finish()
    }
}
