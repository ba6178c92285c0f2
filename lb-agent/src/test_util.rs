//! Helpers the unit tests of several modules share.

use std::net::SocketAddr;

/// A plain HTTP/1.1 GET of `path` on a real listener (no client library, so the test sees exactly
/// what the server writes); the whole response, head and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}
