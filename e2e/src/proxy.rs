//! A loopback TCP proxy that the tests can cut: while blocked it closes every forwarded
//! connection and holds new ones open without forwarding a byte (a black hole, so clients
//! see timeouts as in a real partition, not quick refusals); healing drops the held ones.

use std::net::SocketAddr;

use anyhow::Result;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting.
pub struct Proxy {
    pub addr: SocketAddr,
    blocked: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (blocked, _) = watch::channel(false);
        let rx = blocked.subscribe();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, target, rx.clone()));
            }
        });
        Ok(Proxy {
            addr,
            blocked,
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
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn forward(mut client: TcpStream, target: SocketAddr, mut blocked: watch::Receiver<bool>) {
    if *blocked.borrow() {
        // Hold the connection silently until healed, then drop it.
        let _ = blocked.wait_for(|b| !*b).await;
        return;
    }
    let Ok(mut server) = TcpStream::connect(target).await else {
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = blocked.wait_for(|b| *b) => {}
    }
}
