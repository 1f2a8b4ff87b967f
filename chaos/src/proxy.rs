//! A fault-injecting TCP proxy in front of each replica.
//!
//! Peers reach replica `j` through its proxy; the proxy forwards to the
//! replica's real address. A connection's source address names the replica
//! it comes from (`127.0.0.{10+i}` for replica `i`, [`source_ip`]); others
//! are clients, never faulted. Each direction of each connection is
//! governed by a directed link: data from `i` to `j` flows while link
//! `(i, j)` is up. While a link is down its bytes are read and dropped, as
//! a network drops packets; a connection that lost bytes is closed once
//! the link is back (its stream is broken), and the peer reconnects.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The address replica `id`'s connections to its peers leave from.
pub fn source_ip(id: u64) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 10 + (id as u8)))
}

fn replica_of(ip: IpAddr) -> Option<u64> {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, d] = v4.octets();
            (a == 127 && b == 0 && c == 0 && d > 10 && d < 100).then(|| u64::from(d - 10))
        }
        IpAddr::V6(_) => None,
    }
}

/// Which directed links are down.
#[derive(Debug, Default)]
pub struct Links {
    down: Mutex<BTreeSet<(u64, u64)>>,
}

impl Links {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<(u64, u64)>> {
        match self.down.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Whether data from `from` to `to` is dropped.
    pub fn is_down(&self, from: u64, to: u64) -> bool {
        self.lock().contains(&(from, to))
    }

    /// Drops data from `from` to `to` (one way).
    pub fn cut(&self, from: u64, to: u64) {
        self.lock().insert((from, to));
    }

    /// Cuts every link between the two groups, both ways.
    pub fn partition(&self, a: &[u64], b: &[u64]) {
        let mut down = self.lock();
        for x in a {
            for y in b {
                down.insert((*x, *y));
                down.insert((*y, *x));
            }
        }
    }

    /// Every link up again.
    pub fn heal(&self) {
        self.lock().clear();
    }

    /// The links down now.
    pub fn down(&self) -> Vec<(u64, u64)> {
        self.lock().iter().copied().collect()
    }
}

/// Starts the proxy for replica `to` at `target`; returns the address peers
/// dial. It runs until the runtime stops.
pub async fn spawn(links: Arc<Links>, to: u64, target: SocketAddr) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((inbound, peer)) = listener.accept().await else {
                continue;
            };
            let links = links.clone();
            tokio::spawn(async move {
                let from = replica_of(peer.ip());
                let Ok(outbound) = TcpStream::connect(target).await else {
                    return;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                let up = pump(ri, wo, links.clone(), from.map(|f| (f, to)));
                let down = pump(ro, wi, links, from.map(|f| (to, f)));
                // Either side closing (or a broken stream) ends both.
                tokio::select! {
                    _ = up => {}
                    _ = down => {}
                }
            });
        }
    });
    Ok(addr)
}

/// Copies `r` to `w` while `link` is up; drops the bytes while it is down;
/// returns (closing the connection) at the end of the stream, on an error,
/// or when the link comes back after bytes were dropped.
async fn pump(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    links: Arc<Links>,
    link: Option<(u64, u64)>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut lost = false;
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let down = link.is_some_and(|(f, t)| links.is_down(f, t));
        if down {
            lost = true;
            continue;
        }
        if lost || w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_name_replicas_and_clients_are_none() {
        assert_eq!(replica_of(source_ip(3)), Some(3));
        assert_eq!(replica_of("127.0.0.1".parse().expect("ip")), None);
        let links = Links::default();
        links.partition(&[1], &[2, 3]);
        assert!(links.is_down(1, 2) && links.is_down(3, 1) && !links.is_down(2, 3));
        links.heal();
        assert!(links.down().is_empty());
    }

    #[tokio::test]
    async fn a_cut_link_drops_its_bytes_and_the_connection_closes_after_the_heal() {
        let echo = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let target = echo.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let links = Arc::new(Links::default());
        let proxy = spawn(links.clone(), 2, target).await.expect("proxy");
        // From replica 1's address.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new(source_ip(1), 0))
            .expect("bind source");
        let mut s = socket.connect(proxy).await.expect("connect");
        s.write_all(b"hello").await.expect("write");
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.expect("echo");
        assert_eq!(&buf, b"hello");
        links.cut(1, 2);
        s.write_all(b"lost").await.expect("write");
        let got =
            tokio::time::timeout(std::time::Duration::from_millis(300), s.read(&mut buf)).await;
        assert!(got.is_err(), "nothing comes back while the link is cut");
        links.heal();
        s.write_all(b"again").await.expect("write");
        let n = tokio::time::timeout(std::time::Duration::from_secs(2), s.read(&mut buf))
            .await
            .expect("closed, not silent");
        assert!(
            matches!(n, Ok(0) | Err(_)),
            "the broken stream is closed: {n:?}"
        );
    }
}
