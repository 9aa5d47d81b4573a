//! The gateway's connections to workers: TCP for `http://` workers, TLS
//! (rustls: the system's roots, or the CA file `gateway.tls_ca_file` names) for
//! `https://` ones; each connection keeps count of what it carried, so a failure
//! can be told apart: a pooled keep-alive connection the worker closed while it
//! sat idle (a worker's HTTP server closes idle connections after a few seconds:
//! cpp-httplib's, which llama.cpp serves with, and uvicorn's, which vLLM and
//! SGLang serve with, after 5 s) fails the next request written on it with no
//! byte of an answer. That request is re-sent once on a fresh connection to the
//! same worker, and is not the worker's failure.

use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// What one connection carried, request by request (HTTP/1.1 without
/// pipelining: a request's bytes go out, then its answer's come in).
#[derive(Debug)]
pub struct Wire {
    /// Requests begun on it (a write tried after a read, or the first one).
    exchanges: AtomicU64,
    /// Bytes of an answer read since the current request began.
    answer_bytes: AtomicU64,
    /// The last thing done was a read (so the next write begins a request).
    reading: AtomicBool,
}

impl Default for Wire {
    fn default() -> Self {
        Self {
            exchanges: AtomicU64::new(0),
            answer_bytes: AtomicU64::new(0),
            reading: AtomicBool::new(true),
        }
    }
}

impl Wire {
    /// A write is tried: after a read (or on a new connection), a request
    /// begins, whether or not its bytes get out.
    fn writing(&self) {
        if self.reading.swap(false, Ordering::Relaxed) {
            self.exchanges.fetch_add(1, Ordering::Relaxed);
            self.answer_bytes.store(0, Ordering::Relaxed);
        }
    }

    /// The connection had carried a whole exchange before the current one (it
    /// came from the pool), and no byte of the current one's answer came.
    pub fn reused_and_unanswered(&self) -> bool {
        self.exchanges.load(Ordering::Relaxed) > 1 && self.answer_bytes.load(Ordering::Relaxed) == 0
    }
}

/// A stream that counts what it carries into its [`Wire`].
pub struct Counted<S> {
    inner: S,
    wire: Arc<Wire>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        if read > 0 {
            self.wire.reading.store(true, Ordering::Relaxed);
            self.wire
                .answer_bytes
                .fetch_add(read as u64, Ordering::Relaxed);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.wire.writing();
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.wire.writing();
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A connection to a worker, plain or TLS.
pub enum Stream {
    Plain(Counted<TcpStream>),
    Tls(Box<Counted<tokio_rustls::client::TlsStream<TcpStream>>>),
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Stream::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            Stream::Tls($s) => {
                let $s = Pin::new(&mut **$s);
                $e
            }
        }
    };
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, data))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        let wire = match self {
            Stream::Plain(s) => &s.wire,
            Stream::Tls(s) => &s.wire,
        };
        Connected::new().extra(Arc::clone(wire))
    }
}

/// The [`Wire`] of the connection a client error happened on, if it happened on
/// one.
pub fn wire_of(error: &hyper_util::client::legacy::Error) -> Option<Arc<Wire>> {
    let connected = error.connect_info()?;
    let mut extensions = axum::http::Extensions::new();
    connected.get_extras(&mut extensions);
    extensions.get::<Arc<Wire>>().cloned()
}

/// Connects to workers: TCP (no Nagle), then TLS for `https://`.
#[derive(Clone)]
pub struct Connector {
    tcp: HttpConnector,
    tls: tokio_rustls::TlsConnector,
    handshake_timeout: Duration,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("a certificate in {file} was refused: {error}")]
    BadCertificate { file: String, error: String },
    #[error("TLS to workers cannot be set up: {0}")]
    Rustls(String),
}

/// The roots `https://` workers' certificates are checked against: the CA
/// file's certificates if the config names one, else the system's.
pub fn tls_roots(
    ca: Option<&crate::config::TlsCa>,
) -> Result<rustls::RootCertStore, TlsSetupError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(ca) => {
            for certificate in &ca.certificates {
                roots
                    .add(certificate.clone())
                    .map_err(|e| TlsSetupError::BadCertificate {
                        file: ca.file.display().to_string(),
                        error: e.to_string(),
                    })?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for error in &found.errors {
                tracing::warn!(%error, "a system CA certificate could not be read; https:// workers are checked against the others");
            }
            let (added, ignored) = roots.add_parsable_certificates(found.certs);
            if ignored > 0 {
                tracing::warn!(
                    added,
                    ignored,
                    "system CA certificates rustls could not parse were left out"
                );
            }
        }
    }
    Ok(roots)
}

impl Connector {
    pub fn new(
        connect_timeout: Duration,
        roots: rustls::RootCertStore,
    ) -> Result<Self, TlsSetupError> {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(connect_timeout));
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsSetupError::Rustls(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            tcp,
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            handshake_timeout: connect_timeout,
        })
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<axum::http::Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: axum::http::Uri) -> Self::Future {
        let https = uri.scheme_str() == Some("https");
        let mut tcp = self.tcp.clone();
        let tls = self.tls.clone();
        let handshake_timeout = self.handshake_timeout;
        Box::pin(async move {
            let host = uri
                .host()
                .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string());
            let stream = tcp.call(uri).await?.into_inner();
            let wire = Arc::default();
            if !https {
                return Ok(TokioIo::new(Stream::Plain(Counted {
                    inner: stream,
                    wire,
                })));
            }
            let name = rustls_pki_types::ServerName::try_from(host.unwrap_or_default())
                .map_err(|e| format!("the worker's host is not a name TLS can check: {e}"))?;
            let connecting = tls.connect(name, stream);
            let tls_stream = tokio::time::timeout(handshake_timeout, connecting)
                .await
                .map_err(|_| {
                    format!(
                        "the TLS handshake took over {} ms (gateway.connect_timeout_ms)",
                        handshake_timeout.as_millis()
                    )
                })?
                .map_err(|e| format!("the TLS handshake failed: {e}"))?;
            Ok(TokioIo::new(Stream::Tls(Box::new(Counted {
                inner: tls_stream,
                wire,
            }))))
        })
    }
}
