//! Training across machines. Every machine ("node") runs one process with its local
//! replicas; their gradients are averaged in the process first, then over the nodes through
//! TCP connections to rank 0: rank 0 listens on the coordinator address (or `--listen`),
//! every other node connects to it, rank 0 receives each node's sum of its replicas' values,
//! adds them in rank order and sends the same total back to all, so every replica everywhere
//! applies identical bits (equal, for power-of-two replica groups, to what one machine with
//! all the replicas computes).
//!
//! Joining is authenticated: rank 0 sends each connection a random challenge, and a node
//! proves it knows the run's shared token with an HMAC-SHA256 of the challenge and of what it
//! says about itself (rank, node count, replicas, the fingerprint of its config and data). A
//! connection that fails the proof, says nothing in time, or claims a rank already taken is
//! dropped and the run goes on waiting for the real node; an authenticated node whose config,
//! data or replica count differ from rank 0's is told why and refused.
//!
//! Why not burn-collective's global all-reduce: in burn-collective 0.21.0 the second global
//! operation of a run never completes (docs/multi-node.md). Why not burn-communication's
//! websocket server: it listens on every interface whatever address it is given.
//!
//! A node that dies or cannot be reached never leaves the others waiting: a closed connection
//! fails the exchange at once, and every wait is bounded by the cluster timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::Mutex;

use super::all_reduce::{NodeExchange, pairwise_sum};

/// The environment variable that holds the cluster token when `--cluster-token` is not given.
pub const TOKEN_ENV: &str = "SSD_BURN_CLUSTER_TOKEN";

/// How this process takes part in a multi-node run.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    /// Number of nodes (processes, usually one per machine).
    pub nodes: usize,
    /// This node's rank, `0..nodes`; rank 0 serves the coordinator address, writes
    /// checkpoints and evaluates.
    pub rank: usize,
    /// Rank 0's address, `HOST:PORT`.
    pub coordinator: String,
    /// Where rank 0 listens, `HOST:PORT` (default: the coordinator address).
    pub listen: String,
    /// The shared secret every node proves it knows.
    token: String,
    /// The longest wait for the other nodes (connecting, or one exchange) before giving up.
    pub timeout: Duration,
}

/// `HOST:PORT` of a `tcp://HOST:PORT` (or `ws://`, or bare) address.
fn host_port(address: &str) -> Result<String> {
    let rest = address
        .strip_prefix("tcp://")
        .or_else(|| address.strip_prefix("ws://"))
        .unwrap_or(address);
    if rest.contains("://") {
        bail!("`{address}` is not of the form tcp://HOST:PORT");
    }
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest
        .rsplit_once(':')
        .with_context(|| format!("`{address}` has no port (tcp://HOST:PORT)"))?;
    port.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .with_context(|| format!("`{address}`: `{port}` is not a port number"))?;
    if host.is_empty() {
        bail!("`{address}` has no host (tcp://HOST:PORT)");
    }
    Ok(rest.to_string())
}

impl Cluster {
    /// Checks the ranks, the address and the token (at least 16 characters).
    pub fn new(
        nodes: usize,
        rank: usize,
        coordinator: &str,
        token: &str,
        timeout: Duration,
    ) -> Result<Self> {
        if nodes < 2 {
            bail!("--nodes must be at least 2 for a multi-node run (got {nodes})");
        }
        if rank >= nodes {
            bail!("--node-rank {rank} is not below --nodes {nodes}");
        }
        if timeout.is_zero() {
            bail!("--node-timeout must be positive");
        }
        if token.chars().count() < 16 {
            bail!(
                "the cluster token must have at least 16 characters (--cluster-token or {TOKEN_ENV}; every node needs the same one), got {}",
                token.chars().count()
            );
        }
        let coordinator = host_port(coordinator).context("--coordinator")?;
        Ok(Self {
            nodes,
            rank,
            listen: coordinator.clone(),
            coordinator,
            token: token.to_string(),
            timeout,
        })
    }

    /// Rank 0 listens on `address` (`HOST:PORT`, e.g. `0.0.0.0:29500` for every interface)
    /// instead of the coordinator address.
    pub fn listening_on(mut self, address: &str) -> Result<Self> {
        self.listen = host_port(address).context("--listen")?;
        Ok(self)
    }

    /// True on the node that writes checkpoints and evaluates.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// Values per frame (4 MiB of f32).
const CHUNK: usize = 1 << 20;
/// The largest frame a handshake may send.
const HANDSHAKE_FRAME: usize = 4096;
/// How long a connection may take to answer the challenge.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a node says when it answers rank 0's challenge.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    rank: usize,
    nodes: usize,
    replicas: usize,
    /// Fingerprint of the node's config and training data.
    run: String,
    /// HMAC-SHA256 of the challenge and the fields above, keyed with the token (hex).
    proof: String,
}

impl Hello {
    fn signed(&self) -> String {
        format!(
            "{}|{}|{}|{}",
            self.rank, self.nodes, self.replicas, self.run
        )
    }
}

fn mac(token: &str, challenge: &[u8], signed: &str) -> Hmac<Sha256> {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("HMAC takes keys of any length");
    mac.update(challenge);
    mac.update(signed.as_bytes());
    mac
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

async fn write_frame(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    stream
        .write_all(&(bytes.len() as u32).to_le_bytes())
        .await?;
    stream.write_all(bytes).await
}

/// One frame of at most `max` bytes; a longer one is refused before it is read.
async fn read_frame(stream: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::other(format!(
            "a frame of {len} bytes (at most {max} expected)"
        )));
    }
    let mut bytes = vec![0u8; len];
    stream.read_exact(&mut bytes).await?;
    Ok(bytes)
}

async fn send_values(stream: &mut TcpStream, values: &[f32]) -> Result<(), String> {
    for chunk in values.chunks(CHUNK) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_frame(stream, &bytes)
            .await
            .map_err(|e| format!("sending: {e}"))?;
    }
    Ok(())
}

/// Receives `len` values (in frames of [`CHUNK`]).
async fn recv_values(stream: &mut TcpStream, len: usize) -> Result<Vec<f32>, String> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let expected = CHUNK.min(len - out.len());
        let bytes = read_frame(stream, 4 * CHUNK)
            .await
            .map_err(|e| format!("connection lost: {e}"))?;
        if bytes.len() != 4 * expected {
            return Err(format!(
                "received {} values where {expected} were expected (different models or configs?)",
                bytes.len() / 4
            ));
        }
        out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
    }
    Ok(out)
}

/// What rank 0 expects every other node to say.
#[derive(Clone)]
struct Expected {
    nodes: usize,
    replicas: usize,
    run: String,
    token: String,
}

/// A connection that passed the handshake, or why one was refused.
type Joined = std::result::Result<(usize, TcpStream), String>;

/// Rank 0's side of one connection: the challenge, the proof, the node's account of itself.
/// Strangers (wrong proof, silence, garbage) are dropped without an answer; an authenticated
/// node that differs from rank 0 is told why.
async fn admit(mut stream: TcpStream, from: SocketAddr, expected: Expected) -> Joined {
    let challenge: [u8; 32] = rand::random();
    let hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        write_frame(&mut stream, &challenge).await?;
        read_frame(&mut stream, HANDSHAKE_FRAME).await
    })
    .await
    .map_err(|_| format!("{from}: no answer to the challenge within {HANDSHAKE_TIMEOUT:?}"))?
    .map_err(|e| format!("{from}: {e}"))?;
    let hello: Hello = serde_json::from_slice(&hello)
        .map_err(|_| format!("{from}: not a node of this project"))?;
    let proof = unhex(&hello.proof).unwrap_or_default();
    if mac(&expected.token, &challenge, &hello.signed())
        .verify_slice(&proof)
        .is_err()
    {
        return Err(format!("{from}: wrong cluster token"));
    }
    let problem = if hello.nodes != expected.nodes {
        Some(format!(
            "node {} was started with --nodes {}, rank 0 with {}",
            hello.rank, hello.nodes, expected.nodes
        ))
    } else if hello.replicas != expected.replicas {
        Some(format!(
            "node {} has {} replicas, rank 0 has {}: every node needs the same number",
            hello.rank, hello.replicas, expected.replicas
        ))
    } else if hello.run != expected.run {
        Some(format!(
            "node {}'s config or training data differ from rank 0's (fingerprint {} against {}): every node needs the same config file and the same training records",
            hello.rank,
            short(&hello.run),
            short(&expected.run)
        ))
    } else if hello.rank == 0 || hello.rank >= expected.nodes {
        Some(format!(
            "rank {} is not a follower's rank (1..{})",
            hello.rank, expected.nodes
        ))
    } else {
        None
    };
    if let Some(p) = problem {
        let _ = write_frame(&mut stream, p.as_bytes()).await;
        return Err(format!("{from}: {p}"));
    }
    Ok((hello.rank, stream))
}

fn short(fingerprint: &str) -> &str {
    fingerprint.get(..12).unwrap_or(fingerprint)
}

/// Rank 0 waits until every other rank has joined: each connection is admitted on a task of
/// its own, so a silent or hostile one delays nobody. Refusals are printed as they happen.
async fn accept_nodes(listener: TcpListener, expected: Expected) -> Vec<TcpStream> {
    let nodes = expected.nodes;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Joined>();
    let accepting = tokio::spawn(async move {
        while let Ok((stream, from)) = listener.accept().await {
            let (tx, expected) = (tx.clone(), expected.clone());
            tokio::spawn(async move {
                let _ = tx.send(admit(stream, from, expected).await);
            });
        }
    });
    let mut peers: Vec<Option<TcpStream>> = (0..nodes).map(|_| None).collect();
    while peers.iter().skip(1).any(Option::is_none) {
        let Some(joined) = rx.recv().await else { break };
        match joined {
            Ok((rank, mut stream)) if peers[rank].is_some() => {
                let why = format!("rank {rank} has joined already");
                let _ = write_frame(&mut stream, why.as_bytes()).await;
                eprintln!("node 0: refused a second node claiming rank {rank}");
            }
            Ok((rank, mut stream)) => {
                if write_frame(&mut stream, b"").await.is_ok() {
                    peers[rank] = Some(stream);
                }
            }
            Err(why) => eprintln!("node 0: refused a connection: {why}"),
        }
    }
    // the run is complete: nobody else is listened to
    accepting.abort();
    peers.into_iter().flatten().collect()
}

/// A follower joins rank 0: answers the challenge and reads the verdict. Retries while rank 0
/// is not up yet (start order does not matter).
async fn join(cluster: &Cluster, replicas: usize, run: &str) -> Result<TcpStream, String> {
    loop {
        let Ok(mut stream) = TcpStream::connect(&cluster.coordinator).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let closed = |e: std::io::Error| {
            format!(
                "rank 0 closed the connection during the handshake ({e}): does this node have the same --cluster-token?"
            )
        };
        let challenge = read_frame(&mut stream, HANDSHAKE_FRAME)
            .await
            .map_err(closed)?;
        let mut hello = Hello {
            rank: cluster.rank,
            nodes: cluster.nodes,
            replicas,
            run: run.to_string(),
            proof: String::new(),
        };
        hello.proof = hex(&mac(&cluster.token, &challenge, &hello.signed())
            .finalize()
            .into_bytes());
        let bytes = serde_json::to_vec(&hello).map_err(|e| e.to_string())?;
        write_frame(&mut stream, &bytes).await.map_err(closed)?;
        let verdict = read_frame(&mut stream, HANDSHAKE_FRAME)
            .await
            .map_err(closed)?;
        if !verdict.is_empty() {
            return Err(format!(
                "rank 0 refused this node: {}",
                String::from_utf8_lossy(&verdict)
            ));
        }
        return Ok(stream);
    }
}

/// This node's connections: rank 0 holds one per other node (in rank order), the others one
/// to rank 0.
enum Links {
    Leader(Vec<TcpStream>),
    Follower(TcpStream),
}

/// Averages over nodes through TCP connections to rank 0 (see the module docs).
pub struct TcpExchange {
    cluster: Cluster,
    runtime: Runtime,
    links: Arc<Mutex<Links>>,
}

impl TcpExchange {
    /// Connects the nodes: rank 0 listens and waits for every other node; the others connect
    /// to it. `replicas` is this node's local replica count and `run` the fingerprint of its
    /// config and data; both must be the same on every node.
    pub fn connect(cluster: &Cluster, replicas: usize, run: &str) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the network runtime")?;
        let (rank, timeout) = (cluster.rank, cluster.timeout);
        let links = if cluster.is_leader() {
            let listener = runtime
                .block_on(TcpListener::bind(&cluster.listen))
                .with_context(|| format!("node 0: listening on {}", cluster.listen))?;
            let expected = Expected {
                nodes: cluster.nodes,
                replicas,
                run: run.to_string(),
                token: cluster.token.clone(),
            };
            // the timer is made inside the runtime (it needs its clock)
            let accepted = runtime.block_on(async {
                tokio::time::timeout(timeout, accept_nodes(listener, expected)).await
            });
            match accepted {
                Ok(peers) if peers.len() == cluster.nodes - 1 => Links::Leader(peers),
                _ => bail!(
                    "node 0: not every one of the {} nodes joined at {} within {} s",
                    cluster.nodes,
                    cluster.listen,
                    timeout.as_secs_f64()
                ),
            }
        } else {
            let joined = runtime.block_on(async {
                tokio::time::timeout(timeout, join(cluster, replicas, run)).await
            });
            match joined {
                Ok(Ok(stream)) => Links::Follower(stream),
                Ok(Err(e)) => bail!("node {rank}: {e}"),
                Err(_) => bail!(
                    "node {rank}: cannot reach rank 0 at {} within {} s",
                    cluster.coordinator,
                    timeout.as_secs_f64()
                ),
            }
        };
        Ok(Self {
            cluster: cluster.clone(),
            runtime,
            links: Arc::new(Mutex::new(links)),
        })
    }
}

/// Rank 0's part of an exchange: every node's values in, their sum (in rank order) out.
async fn sum_as_leader(peers: &mut [TcpStream], values: Vec<f32>) -> Result<Vec<f32>, String> {
    let len = values.len();
    let mut all = vec![values];
    for (i, peer) in peers.iter_mut().enumerate() {
        let theirs = recv_values(peer, len)
            .await
            .map_err(|e| format!("node {}: {e}", i + 1))?;
        all.push(theirs);
    }
    let sum = pairwise_sum(all, |mut a, b| {
        a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        a
    });
    for (i, peer) in peers.iter_mut().enumerate() {
        send_values(peer, &sum)
            .await
            .map_err(|e| format!("node {}: {e}", i + 1))?;
    }
    Ok(sum)
}

impl NodeExchange for TcpExchange {
    fn nodes(&self) -> usize {
        self.cluster.nodes
    }

    fn sum_over_nodes(&self, values: Vec<f32>) -> Result<Vec<f32>, String> {
        let (rank, timeout) = (self.cluster.rank, self.cluster.timeout);
        let len = values.len();
        let links = self.links.clone();
        let exchange = async move {
            match &mut *links.lock().await {
                Links::Leader(peers) => sum_as_leader(peers, values).await,
                Links::Follower(root) => {
                    send_values(root, &values)
                        .await
                        .map_err(|e| format!("node 0: {e}"))?;
                    recv_values(root, len)
                        .await
                        .map_err(|e| format!("node 0: {e}"))
                }
            }
        };
        // a task of its own, so that a panic inside the transport is an error here
        let task = self
            .runtime
            .spawn(async move { tokio::time::timeout(timeout, exchange).await });
        match self.runtime.block_on(task) {
            Ok(Ok(result)) => result.map_err(|e| format!("node {rank}: exchange with {e}")),
            Ok(Err(_)) => Err(format!(
                "node {rank}: no answer from the other nodes within {} s (a node stopped or cannot be reached)",
                timeout.as_secs_f64()
            )),
            Err(e) => Err(format!("node {rank}: the connection failed: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "a-token-of-sixteen+";

    #[test]
    fn ranks_addresses_and_tokens_are_checked() {
        let t = Duration::from_secs(5);
        let c = Cluster::new(2, 1, "tcp://10.0.0.1:3000/", TOKEN, t).unwrap();
        assert_eq!(c.coordinator, "10.0.0.1:3000");
        assert_eq!(c.listen, "10.0.0.1:3000");
        assert!(!c.is_leader());
        let c = Cluster::new(3, 0, "ws://localhost:3000", TOKEN, t).unwrap();
        assert!(c.is_leader());
        assert_eq!(
            c.listening_on("0.0.0.0:4000").unwrap().listen,
            "0.0.0.0:4000"
        );
        for (nodes, rank, coordinator) in [
            (1, 0, "tcp://127.0.0.1:3000"),
            (2, 2, "tcp://127.0.0.1:3000"),
            (2, 0, "http://127.0.0.1:3000"),
            (2, 0, "tcp://127.0.0.1"),
            (2, 0, "tcp://127.0.0.1:70000"),
            (2, 0, "tcp://:3000"),
        ] {
            assert!(
                Cluster::new(nodes, rank, coordinator, TOKEN, t).is_err(),
                "{nodes} {rank} {coordinator} accepted"
            );
        }
        assert!(Cluster::new(2, 0, "127.0.0.1:3000", TOKEN, Duration::ZERO).is_err());
        let err = Cluster::new(2, 0, "127.0.0.1:3000", "short", t).unwrap_err();
        assert!(err.to_string().contains(TOKEN_ENV), "{err}");
    }

    #[test]
    fn the_proof_binds_token_challenge_and_claims() {
        let hello = |rank| Hello {
            rank,
            nodes: 2,
            replicas: 1,
            run: "ab".into(),
            proof: String::new(),
        };
        let proof = |token: &str, challenge: &[u8], h: &Hello| {
            mac(token, challenge, &h.signed())
                .finalize()
                .into_bytes()
                .to_vec()
        };
        let p = proof(TOKEN, b"c1", &hello(1));
        assert!(
            mac(TOKEN, b"c1", &hello(1).signed())
                .verify_slice(&p)
                .is_ok()
        );
        assert!(
            mac("another-token-here", b"c1", &hello(1).signed())
                .verify_slice(&p)
                .is_err()
        );
        assert!(
            mac(TOKEN, b"c2", &hello(1).signed())
                .verify_slice(&p)
                .is_err()
        );
        assert!(
            mac(TOKEN, b"c1", &hello(2).signed())
                .verify_slice(&p)
                .is_err()
        );
        assert_eq!(unhex(&hex(&p)), Some(p));
        assert_eq!(unhex("zz"), None);
    }

    /// Two nodes on loopback: strangers (no proof, a wrong token, silence) are dropped while
    /// rank 0 waits, the real node joins, and sums travel both ways.
    #[test]
    fn strangers_are_dropped_and_the_real_node_joins() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("tcp://127.0.0.1:{port}");
        let t = Duration::from_secs(20);
        let leader = Cluster::new(2, 0, &address, TOKEN, t).unwrap();
        let follower = Cluster::new(2, 1, &address, TOKEN, t).unwrap();
        let stranger = Cluster::new(2, 1, &address, "not-the-right-token", t).unwrap();
        let rank0 = std::thread::spawn(move || {
            let exchange = TcpExchange::connect(&leader, 1, "run").unwrap();
            exchange.sum_over_nodes(vec![1.0, 2.0]).unwrap()
        });
        // a silent connection and one with the wrong token first
        let silent = loop {
            if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let err = TcpExchange::connect(&stranger, 1, "run").err().unwrap();
        assert!(err.to_string().contains("--cluster-token"), "{err}");
        // a node with the right token but other data is told why
        let err = TcpExchange::connect(&follower, 1, "other run")
            .err()
            .unwrap();
        assert!(err.to_string().contains("training data differ"), "{err}");
        let exchange = TcpExchange::connect(&follower, 1, "run").unwrap();
        assert_eq!(
            exchange.sum_over_nodes(vec![10.0, 20.0]).unwrap(),
            [11.0, 22.0]
        );
        assert_eq!(rank0.join().unwrap(), [11.0, 22.0]);
        drop(silent);
    }
}
