//! Training across machines. Every machine ("node") runs one process with its local
//! replicas; their gradients are averaged in the process first, then over the nodes through
//! Burn's websocket transport (`burn-communication`): rank 0 serves a route that every other
//! node connects to, receives each node's sum of its replicas' values, adds them in rank
//! order and sends the same total back to all, so every replica everywhere applies identical
//! bits (equal, for power-of-two replica groups, to what one machine with all the replicas
//! computes).
//!
//! Why not burn-collective's global all-reduce: in burn-collective 0.21.0 the second global
//! operation of a run never completes. `SyncService::sync` (src/global/node/sync.rs) clears a
//! copy of its list of synced peers instead of the list itself, so from the second call on
//! the list never equals the node set and every node waits forever (reproduced with two
//! loopback nodes: the first all-reduce returns, the second hangs on both). docs/multi-node.md
//! has the details.
//!
//! A node that dies or cannot be reached never leaves the others waiting: a closed connection
//! fails the exchange at once, and every wait is bounded by the cluster timeout.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use burn_communication::websocket::{WsClient, WsClientChannel, WsServer, WsServerChannel};
use burn_communication::{Address, CommunicationChannel, Message, ProtocolClient, ProtocolServer};
use serde::{Deserialize, Serialize};
use tokio::runtime::Runtime;
use tokio::sync::Mutex;

use crate::sync::{NodeExchange, pairwise_sum};
/// How this process takes part in a multi-node run.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    /// Number of nodes (processes, usually one per machine).
    pub nodes: usize,
    /// This node's rank, `0..nodes`; rank 0 serves the coordinator address, writes
    /// checkpoints and evaluates.
    pub rank: usize,
    /// Rank 0's address, `ws://HOST:PORT`.
    pub coordinator: String,
    /// The longest wait for the other nodes (connecting, or one exchange) before giving up.
    pub timeout: Duration,
}

/// `HOST` and `PORT` of a `ws://HOST:PORT` address.
fn host_port(address: &str) -> Result<(&str, u16)> {
    let rest = address
        .strip_prefix("ws://")
        .with_context(|| format!("`{address}` is not of the form ws://HOST:PORT"))?;
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest
        .rsplit_once(':')
        .with_context(|| format!("`{address}` has no port (ws://HOST:PORT)"))?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .with_context(|| format!("`{address}`: `{port}` is not a port number"))?;
    if host.is_empty() {
        bail!("`{address}` has no host (ws://HOST:PORT)");
    }
    Ok((host, port))
}

impl Cluster {
    /// Checks the ranks and the address.
    pub fn new(nodes: usize, rank: usize, coordinator: &str, timeout: Duration) -> Result<Self> {
        if nodes < 2 {
            bail!("--nodes must be at least 2 for a multi-node run (got {nodes})");
        }
        if rank >= nodes {
            bail!("--node-rank {rank} is not below --nodes {nodes}");
        }
        if timeout.is_zero() {
            bail!("--node-timeout must be positive");
        }
        host_port(coordinator).context("--coordinator")?;
        Ok(Self {
            nodes,
            rank,
            coordinator: coordinator.trim_end_matches('/').to_string(),
            timeout,
        })
    }

    /// True on the node that writes checkpoints and evaluates.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// Values per websocket message (4 MiB of f32: below every frame-size limit on the way).
const CHUNK: usize = 1 << 20;

/// The route of rank 0's server.
const ROUTE: &str = "ssd-burn/mean";

/// What a node says when it connects.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    rank: usize,
    nodes: usize,
    replicas: usize,
}

/// This node's connections: rank 0 holds one per other node (in rank order), the others one
/// to rank 0.
enum Links {
    Leader(Vec<WsServerChannel>),
    Follower(Box<WsClientChannel>),
}

/// Averages over nodes through websocket connections to rank 0 (see the module docs).
pub struct WsExchange {
    cluster: Cluster,
    runtime: Runtime,
    links: Arc<Mutex<Links>>,
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn bytes_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

async fn send_values<C: CommunicationChannel>(
    channel: &mut C,
    values: &[f32],
) -> Result<(), String> {
    for chunk in values.chunks(CHUNK) {
        channel
            .send(Message::new(f32_bytes(chunk).into()))
            .await
            .map_err(|e| format!("sending: {e:?}"))?;
    }
    Ok(())
}

/// Receives `len` values (in chunks of [`CHUNK`]).
async fn recv_values<C: CommunicationChannel>(
    channel: &mut C,
    len: usize,
) -> Result<Vec<f32>, String> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let expected = CHUNK.min(len - out.len());
        let message = channel
            .recv()
            .await
            .map_err(|e| format!("connection lost: {e:?}"))?
            .ok_or("connection closed")?;
        if message.data.len() != 4 * expected {
            return Err(format!(
                "received {} values where {expected} were expected (different models or configs?)",
                message.data.len() / 4
            ));
        }
        out.extend(bytes_f32(&message.data));
    }
    Ok(out)
}

impl WsExchange {
    /// Connects the nodes: rank 0 serves the coordinator port and waits for every other
    /// node; the others connect to it (retrying until the timeout, so start order does not
    /// matter). `replicas` is this node's local replica count, which must be the same on every
    /// node.
    pub fn connect(cluster: &Cluster, replicas: usize) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the network runtime")?;
        let timeout = cluster.timeout;
        let links = if cluster.is_leader() {
            let (_, port) = host_port(&cluster.coordinator)?;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let server = WsServer::new(port).route(ROUTE, move |channel| async move {
                let _ = tx.send(channel);
            });
            runtime.spawn(async move {
                if let Err(e) = server.serve(std::future::pending()).await {
                    tracing::error!("the coordinator's server stopped: {e:?}");
                }
            });
            let nodes = cluster.nodes;
            let accepted = runtime.block_on(async {
                tokio::time::timeout(timeout, async {
                    let mut peers: Vec<Option<WsServerChannel>> = (0..nodes).map(|_| None).collect();
                    while peers.iter().skip(1).any(Option::is_none) {
                        let mut channel = rx.recv().await.ok_or("the server stopped")?;
                        let Ok(Some(hello)) = channel.recv().await else { continue };
                        let hello: Hello = match serde_json::from_slice(&hello.data) {
                            Ok(h) => h,
                            Err(_) => continue,
                        };
                        let problem = if hello.nodes != nodes {
                            Some(format!("node {} was started with --nodes {}, rank 0 with {nodes}", hello.rank, hello.nodes))
                        } else if hello.replicas != replicas {
                            Some(format!("node {} has {} replicas, rank 0 has {replicas}: every node needs the same number", hello.rank, hello.replicas))
                        } else if hello.rank == 0 || hello.rank >= nodes || peers[hello.rank].is_some() {
                            Some(format!("a second node claims rank {}", hello.rank))
                        } else {
                            None
                        };
                        let answer = problem.clone().unwrap_or_default();
                        let _ = channel.send(Message::new(answer.into_bytes().into())).await;
                        if let Some(p) = problem {
                            return Err(p);
                        }
                        peers[hello.rank] = Some(channel);
                    }
                    Ok(peers.into_iter().flatten().collect::<Vec<_>>())
                })
                .await
            });
            match accepted {
                Ok(Ok(peers)) => Links::Leader(peers),
                Ok(Err(e)) => bail!("node 0: {e}"),
                Err(_) => bail!(
                    "node 0: not every one of the {nodes} nodes connected to {} within {} s",
                    cluster.coordinator,
                    timeout.as_secs_f64()
                ),
            }
        } else {
            let address: Address = cluster
                .coordinator
                .parse()
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let hello = serde_json::to_vec(&Hello {
                rank: cluster.rank,
                nodes: cluster.nodes,
                replicas,
            })?;
            let rank = cluster.rank;
            let connected = runtime.block_on(async {
                tokio::time::timeout(timeout, async {
                    loop {
                        if let Some(mut channel) = WsClient::connect(address.clone(), ROUTE).await {
                            channel
                                .send(Message::new(hello.clone().into()))
                                .await
                                .map_err(|e| format!("{e:?}"))?;
                            let answer = channel
                                .recv()
                                .await
                                .map_err(|e| format!("{e:?}"))?
                                .ok_or("rank 0 closed the connection")?;
                            if !answer.data.is_empty() {
                                return Err(String::from_utf8_lossy(&answer.data).into_owned());
                            }
                            return Ok(channel);
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                })
                .await
            });
            match connected {
                Ok(Ok(channel)) => Links::Follower(Box::new(channel)),
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

impl NodeExchange for WsExchange {
    fn nodes(&self) -> usize {
        self.cluster.nodes
    }

    fn sum_over_nodes(&self, values: Vec<f32>) -> Result<Vec<f32>, String> {
        let (rank, timeout) = (self.cluster.rank, self.cluster.timeout);
        let len = values.len();
        let links = self.links.clone();
        let exchange = async move {
            let mut links = links.lock().await;
            match &mut *links {
                Links::Leader(peers) => {
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
                Links::Follower(root) => {
                    let root = root.as_mut();
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

    #[test]
    fn ranks_and_addresses_are_checked() {
        let t = Duration::from_secs(5);
        let c = Cluster::new(2, 1, "ws://10.0.0.1:3000/", t).unwrap();
        assert_eq!(c.coordinator, "ws://10.0.0.1:3000");
        assert!(!c.is_leader());
        assert!(
            Cluster::new(3, 0, "ws://localhost:3000", t)
                .unwrap()
                .is_leader()
        );
        for (nodes, rank, coordinator) in [
            (1, 0, "ws://127.0.0.1:3000"),
            (2, 2, "ws://127.0.0.1:3000"),
            (2, 0, "http://127.0.0.1:3000"),
            (2, 0, "ws://127.0.0.1"),
            (2, 0, "ws://127.0.0.1:70000"),
            (2, 0, "ws://:3000"),
        ] {
            assert!(
                Cluster::new(nodes, rank, coordinator, t).is_err(),
                "{nodes} {rank} {coordinator} accepted"
            );
        }
        assert!(Cluster::new(2, 0, "ws://127.0.0.1:3000", Duration::ZERO).is_err());
    }

    #[test]
    fn values_survive_the_wire_format() {
        let v = vec![0.0, -1.5, f32::MAX, 1e-30, 3.25];
        assert_eq!(bytes_f32(&f32_bytes(&v)), v);
    }
}
