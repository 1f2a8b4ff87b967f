//! How a process reaches Keel replicas and is reached by them: plaintext
//! TCP, or TLS with the cluster's certificates ([`crate::tls`]).
//!
//! Every channel a replica or the CLI opens goes through [`Transport`], and
//! the server's listener through [`Transport::incoming`], so there is one
//! place where a connection becomes TLS. With TLS, each new connection,
//! in or out, takes the configuration current when it starts: a reload
//! (SIGHUP) reaches reconnections without a restart.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

use crate::tls::{TlsError, TlsState};

/// How long an incoming connection has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Plaintext, or TLS with these certificates.
#[derive(Clone, Debug, Default)]
pub enum Transport {
    #[default]
    Plain,
    Tls(Arc<TlsState>),
}

/// Whom a channel is for: what the server's certificate must name.
#[derive(Debug, Clone, Copy)]
pub enum Peer<'a> {
    /// A member of the cluster, by id ([`crate::tls::member_name`]).
    Member(u64),
    /// Whatever serves at this address (its host).
    Address(&'a str),
}

impl Transport {
    pub fn is_tls(&self) -> bool {
        matches!(self, Transport::Tls(_))
    }

    /// An endpoint for `addr` (`host:port`, or a URL whose scheme is
    /// replaced by this transport's).
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, tonic::transport::Error> {
        let authority = addr.split_once("://").map_or(addr, |(_, rest)| rest);
        let scheme = if self.is_tls() { "https" } else { "http" };
        Endpoint::from_shared(format!("{scheme}://{authority}"))
    }

    /// A channel that connects on first use (and again after failures),
    /// from `source_ip` when given.
    pub fn lazy(
        &self,
        endpoint: Endpoint,
        peer: Peer<'_>,
        source_ip: Option<IpAddr>,
    ) -> Result<Channel, TlsError> {
        match self {
            Transport::Plain => Ok(endpoint.local_address(source_ip).connect_lazy()),
            Transport::Tls(tls) => {
                let connector = connector(tls.clone(), server_name(peer)?, source_ip);
                Ok(endpoint.connect_with_connector_lazy(connector))
            }
        }
    }

    /// A channel connected now.
    pub async fn connect(
        &self,
        endpoint: Endpoint,
        peer: Peer<'_>,
    ) -> Result<Channel, ConnectError> {
        match self {
            Transport::Plain => Ok(endpoint.connect().await?),
            Transport::Tls(tls) => {
                let connector = connector(tls.clone(), server_name(peer)?, None);
                Ok(endpoint.connect_with_connector(connector).await?)
            }
        }
    }

    /// The server's connections: accepted, Nagle off, and with TLS
    /// handshaken (each in its own task, so a slow or silent client delays
    /// no other). Ends when the stream is dropped.
    pub fn incoming(
        &self,
        listener: TcpListener,
    ) -> Pin<Box<dyn Stream<Item = std::io::Result<Conn>> + Send>> {
        match self {
            Transport::Plain => Box::pin(futures::StreamExt::map(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                |conn| {
                    let stream = conn?;
                    stream.set_nodelay(true)?;
                    Ok(Conn::Plain(stream))
                },
            )),
            Transport::Tls(tls) => {
                let (tx, rx) = tokio::sync::mpsc::channel(64);
                let tls = tls.clone();
                tokio::spawn(accept_tls(
                    listener,
                    move || tls.server_config(),
                    tx,
                    |tls_stream, _| Ok(Conn::Tls(Box::new(tls_stream))),
                    "a client without TLS, or without a certificate from the cluster's CA?",
                ));
                Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
            }
        }
    }
}

/// A channel that could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
}

fn server_name(peer: Peer<'_>) -> Result<ServerName<'static>, TlsError> {
    match peer {
        Peer::Member(id) => ServerName::try_from(crate::tls::member_name(id))
            .map_err(|e| TlsError::Config(e.to_string())),
        Peer::Address(addr) => crate::tls::server_name_of(addr),
    }
}

type Connecting = Pin<
    Box<
        dyn std::future::Future<
                Output = std::io::Result<
                    hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
                >,
            > + Send,
    >,
>;

/// Connects by TCP (from `source_ip`), then TLS with the configuration
/// current at that moment, verifying that the server is `name`.
fn connector(
    tls: Arc<TlsState>,
    name: ServerName<'static>,
    source_ip: Option<IpAddr>,
) -> impl tower::Service<
    Uri,
    Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
    Error = std::io::Error,
    Future = Connecting,
> + Clone
       + Send
       + 'static {
    tower::service_fn(move |uri: Uri| {
        let tls = tls.clone();
        let name = name.clone();
        let connecting: Connecting = Box::pin(async move {
            let host = uri.host().unwrap_or_default().trim_matches(['[', ']']);
            let port = uri.port_u16().unwrap_or(443);
            let target = tokio::net::lookup_host((host, port))
                .await?
                .next()
                .ok_or_else(|| std::io::Error::other(format!("{host}: no address")))?;
            let socket = if target.is_ipv4() {
                TcpSocket::new_v4()?
            } else {
                TcpSocket::new_v6()?
            };
            if let Some(ip) = source_ip {
                socket.bind(SocketAddr::new(ip, 0))?;
            }
            let stream = socket.connect(target).await?;
            stream.set_nodelay(true)?;
            let tls_stream = tokio_rustls::TlsConnector::from(tls.client_config())
                .connect(name, stream)
                .await?;
            Ok(hyper_util::rt::TokioIo::new(tls_stream))
        });
        connecting
    })
}

/// Accepts connections on `listener` and handshakes each apart from the
/// loop (within [`HANDSHAKE_TIMEOUT`]) with the configuration `config`
/// gives at that moment (a reload applies to the connections after it),
/// sending each handshaken one, as `wrap` makes it, to `tx`; stops when
/// `tx`'s receiver is gone. A failed handshake is logged with `hint`.
/// The API's listener and the HTTP endpoint's both use it.
pub(crate) async fn accept_tls<T: Send + 'static>(
    listener: TcpListener,
    config: impl Fn() -> Option<Arc<rustls::ServerConfig>> + Send + 'static,
    tx: tokio::sync::mpsc::Sender<T>,
    wrap: fn(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr) -> T,
    hint: &'static str,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // The server stopped serving: the listener closes here.
            _ = tx.closed() => return,
        };
        let (stream, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: tonic's own listener
                // logs and goes on too.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(config) = config() else {
            return;
        };
        let tx = tx.clone();
        tokio::spawn(async move {
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY");
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(config);
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls_stream)) => {
                    let _ = tx.send(wrap(tls_stream, remote)).await;
                }
                Ok(Err(e)) => tracing::warn!(
                    %remote,
                    error = %e,
                    "refused a connection: its TLS handshake failed ({hint})"
                ),
                Err(_) => tracing::warn!(
                    %remote,
                    "refused a connection: no TLS handshake within {HANDSHAKE_TIMEOUT:?}"
                ),
            }
        });
    }
}

/// An accepted connection.
#[derive(Debug)]
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// What a request's connection says of its caller (in the request's
/// extensions).
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// The caller's certificate chain, on a TLS connection (verified
    /// against the cluster CA by the handshake).
    pub certs: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// What the caller's certificate says of it (read once per
    /// connection; [`crate::caller`]).
    pub identity: Option<crate::caller::CertIdentity>,
}

impl PeerInfo {
    /// Whether the caller's certificate names member `id`.
    pub fn names_member(&self, id: u64) -> bool {
        self.certs
            .as_ref()
            .and_then(|c| c.first())
            .is_some_and(|cert| crate::tls::names_member(cert, id))
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        match self {
            Conn::Plain(s) => PeerInfo {
                remote: s.peer_addr().ok(),
                certs: None,
                identity: None,
            },
            Conn::Tls(s) => {
                let (tcp, session) = s.get_ref();
                let certs: Option<Arc<Vec<CertificateDer<'static>>>> = session
                    .peer_certificates()
                    .map(|c| Arc::new(c.iter().map(|c| c.clone().into_owned()).collect()));
                let identity = certs
                    .as_ref()
                    .and_then(|c| c.first())
                    .and_then(|c| crate::caller::CertIdentity::of(c));
                PeerInfo {
                    remote: tcp.peer_addr().ok(),
                    certs,
                    identity,
                }
            }
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    /// The absence ARCHITECTURE.md states: no channel or listener of the
    /// control plane is made outside this module, so none skips TLS.
    #[test]
    fn no_channel_or_listener_is_made_outside_the_transport() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let forbidden = [
            "Endpoint::from_shared",
            "Channel::from_shared",
            ".connect_lazy()",
            "TcpListenerStream",
            "serve_with_shutdown(",
        ];
        let mut found = Vec::new();
        let mut files = vec![src];
        while let Some(path) = files.pop() {
            if path.is_dir() {
                files.extend(
                    std::fs::read_dir(&path)
                        .expect("read_dir")
                        .map(|e| e.expect("entry").path()),
                );
            } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("transport.rs")
            {
                let text = std::fs::read_to_string(&path).expect("read");
                for f in forbidden {
                    if text.contains(f) {
                        found.push(format!("{}: {f}", path.display()));
                    }
                }
            }
        }
        assert!(found.is_empty(), "made outside `transport`: {found:?}");
    }
}
