//! A loopback TCP proxy that the tests can cut or stall. While blocked it closes every
//! forwarded connection and holds new ones open without forwarding a byte (a black hole, so
//! clients see timeouts as in a real partition, not quick refusals); healing drops the held
//! ones. While stalled it keeps every connection and holds the bytes it reads, then delivers
//! them in order on resuming: put in front of etcd, requests the API server received queue
//! inside it and commit late, after their clients may have given up.

use std::net::SocketAddr;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting.
pub struct Proxy {
    pub addr: SocketAddr,
    blocked: watch::Sender<bool>,
    stalled: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (blocked, _) = watch::channel(false);
        let (stalled, _) = watch::channel(false);
        let (rx, stall_rx) = (blocked.subscribe(), stalled.subscribe());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, target, rx.clone(), stall_rx.clone()));
            }
        });
        Ok(Proxy {
            addr,
            blocked,
            stalled,
            accept,
        })
    }

    /// Cuts every connection and black-holes new ones.
    pub fn block(&self) {
        self.blocked.send_replace(true);
    }

    /// Forwards again.
    pub fn heal(&self) {
        self.blocked.send_replace(false);
    }

    /// Holds every byte read, keeping the connections open.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    /// Delivers what was held, in order, and forwards again.
    pub fn resume(&self) {
        self.stalled.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn forward(
    client: TcpStream,
    target: SocketAddr,
    mut blocked: watch::Receiver<bool>,
    stalled: watch::Receiver<bool>,
) {
    if *blocked.borrow() {
        // Hold the connection silently until healed, then drop it.
        let _ = blocked.wait_for(|b| !*b).await;
        return;
    }
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = async {
            tokio::join!(
                pipe(client_read, server_write, stalled.clone()),
                pipe(server_read, client_write, stalled),
            )
        } => {}
        _ = blocked.wait_for(|b| *b) => {}
    }
}

/// Copies `from` to `to` until either ends, holding what it read while stalled.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if stalled.wait_for(|s| !*s).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
