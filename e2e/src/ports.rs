//! Free loopback ports for the components and replicas a test starts.

use std::net::{Ipv4Addr, TcpListener};

use anyhow::{Result, bail};

/// A free loopback port (the kernel's choice; a race with other binders is possible but
/// shows up as a component failing to start, with its log).
pub fn free_port() -> Result<u16> {
    // The port is free when asked for, but is released before its user binds it, so the
    // kernel may hand it out again: never give the same port twice in this process (a
    // replica once got one port for both its metrics and its health endpoint).
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    for _ in 0..100 {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
            .local_addr()?
            .port();
        let mut given = GIVEN.lock().expect("given ports lock");
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
    bail!("no port not handed out before in 100 tries")
}
