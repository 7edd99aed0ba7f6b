//! `kvflow serve --ssl-certfile CERT --ssl-keyfile KEY`: the server's rustls configuration (the
//! `ring` provider, TLS 1.2 and 1.3, HTTP/1.1 by ALPN) from PEM files, each problem an error
//! naming the flag and the file.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("--{flag} {}: cannot read it: {source}", path.display())]
    Unreadable { flag: &'static str, path: PathBuf, source: std::io::Error },
    #[error("--{flag} {}: {what}", path.display())]
    Invalid { flag: &'static str, path: PathBuf, what: String },
    #[error("--ssl-certfile {} with --ssl-keyfile {}: {what}", cert.display(), key.display())]
    Refused { cert: PathBuf, key: PathBuf, what: String },
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Unreadable { flag, path: path.to_path_buf(), source })
}

/// The certificate chain in `path` (PEM, the server's certificate first).
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let invalid = |what: String| TlsError::Invalid { flag: "ssl-certfile", path: path.to_path_buf(), what };
    let pem = read("ssl-certfile", path)?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("not a PEM certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(invalid("no certificate in it (expected PEM: -----BEGIN CERTIFICATE-----)".into()));
    }
    Ok(chain)
}

/// The private key in `path` (PEM: PKCS#8, PKCS#1 or SEC1).
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read("ssl-keyfile", path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        let what = match e {
            rustls::pki_types::pem::Error::NoItemsFound => {
                "no private key in it (expected PEM: -----BEGIN PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY)"
                    .to_string()
            }
            e => format!("not a PEM private key: {e}"),
        };
        TlsError::Invalid { flag: "ssl-keyfile", path: path.to_path_buf(), what }
    })
}

/// The server configuration of `cert` and `key`; refused when they do not belong together.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = certificates(cert)?;
    let private = private_key(key)?;
    let refused = |what: String| TlsError::Refused { cert: cert.to_path_buf(), key: key.to_path_buf(), what };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| refused(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| refused(format!("rustls refuses them: {e}")))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
