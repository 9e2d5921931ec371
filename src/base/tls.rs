//! TLS to RabbitMQ, Redis and Postgres, through rustls with one crypto provider.
//!
//! Each service's settings name a CA file (without one, the system's roots are trusted) and an
//! optional client certificate and key for mutual TLS. This module turns those files into what
//! each client crate takes: lapin's `OwnedTLSConfig`, redis-rs's `TlsCertificates`, sqlx's
//! connect options. Whether TLS is used at all is the URL's business (`amqps://`, `rediss://`,
//! `sslmode=`), as each crate already decides.
//!
//! rustls needs one crypto provider per process. The three crates are built with ring (see
//! Cargo.toml); [`install_crypto_provider`] makes it the process default before any connection
//! is opened, so a crate that asks for the default never finds two candidates and panics.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Makes ring the process-wide rustls crypto provider. Idempotent: a second call (tests run
/// many workers in one process) keeps the provider already installed.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The certificate files of one service's TLS connections. Paths only: file contents (and so
/// key material) are read when connecting and never printed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsFiles {
    /// PEM file of the CA certificates that sign the server's certificate; empty = trust the
    /// system's roots.
    pub ca_file: String,
    /// PEM file of the client certificate (chain) for mutual TLS; empty = none.
    pub client_cert_file: String,
    /// PEM file of the client certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub client_key_file: String,
}

/// A client certificate with its key, as PEM read from their files.
pub struct ClientIdentity {
    /// The certificate chain.
    pub cert: Vec<u8>,
    /// The private key.
    pub key: Vec<u8>,
}

/// A certificate file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read {what} {path}: {source}")]
    Read {
        /// Which setting named the file.
        what: &'static str,
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file holds nothing of the kind expected. The message never quotes the contents.
    #[error("{what} {path} holds no PEM {expected}")]
    NotPem {
        /// Which setting named the file.
        what: &'static str,
        /// The path.
        path: String,
        /// What it should hold.
        expected: &'static str,
    },
    /// Only one of the client certificate and key is set.
    #[error("client_cert_file and client_key_file must be set together")]
    HalfIdentity,
}

impl TlsFiles {
    /// Checks, before any connection, that the files exist and hold PEM of the right kind, so a
    /// typo stops the process with a configuration error naming the setting.
    pub fn check(&self) -> Result<(), TlsError> {
        if self.client_cert_file.is_empty() != self.client_key_file.is_empty() {
            return Err(TlsError::HalfIdentity);
        }
        self.ca_pem()?;
        self.identity_pem()?;
        Ok(())
    }

    /// The CA file's PEM bytes, if one is set.
    pub fn ca_pem(&self) -> Result<Option<Vec<u8>>, TlsError> {
        if self.ca_file.is_empty() {
            return Ok(None);
        }
        let pem = read(&self.ca_file, "ca_file")?;
        expect_pem(
            &pem,
            &self.ca_file,
            "ca_file",
            &["CERTIFICATE"],
            "certificate",
        )?;
        Ok(Some(pem))
    }

    /// The client certificate and key PEM bytes, if both are set.
    pub fn identity_pem(&self) -> Result<Option<ClientIdentity>, TlsError> {
        if self.client_cert_file.is_empty() || self.client_key_file.is_empty() {
            return Ok(None);
        }
        let cert = read(&self.client_cert_file, "client_cert_file")?;
        expect_pem(
            &cert,
            &self.client_cert_file,
            "client_cert_file",
            &["CERTIFICATE"],
            "certificate",
        )?;
        let key = read(&self.client_key_file, "client_key_file")?;
        expect_pem(
            &key,
            &self.client_key_file,
            "client_key_file",
            &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"],
            "private key",
        )?;
        Ok(Some(ClientIdentity { cert, key }))
    }

    /// lapin's TLS configuration: the CA file is added to the system's roots, the client
    /// identity is a PEM certificate with its key.
    pub fn amqp(&self) -> Result<lapin::tcp::OwnedTLSConfig, TlsError> {
        let cert_chain = self
            .ca_pem()?
            .map(|pem| String::from_utf8_lossy(&pem).into_owned());
        let identity = self
            .identity_pem()?
            .map(|id| lapin::tcp::OwnedIdentity::PKCS8 {
                pem: id.cert,
                key: id.key,
            });
        Ok(lapin::tcp::OwnedTLSConfig {
            identity,
            cert_chain,
        })
    }

    /// redis-rs's certificates: the CA file replaces the system's roots when set.
    pub fn redis(&self) -> Result<redis::TlsCertificates, TlsError> {
        Ok(redis::TlsCertificates {
            client_tls: self.identity_pem()?.map(|id| redis::ClientTlsConfig {
                client_cert: id.cert,
                client_key: id.key,
            }),
            root_cert: self.ca_pem()?,
        })
    }

    /// sqlx's connect options with these files applied; `sslmode` stays the URL's.
    pub fn postgres(
        &self,
        mut options: sqlx::postgres::PgConnectOptions,
    ) -> sqlx::postgres::PgConnectOptions {
        if !self.ca_file.is_empty() {
            options = options.ssl_root_cert(Path::new(&self.ca_file));
        }
        if !self.client_cert_file.is_empty() && !self.client_key_file.is_empty() {
            options = options
                .ssl_client_cert(Path::new(&self.client_cert_file))
                .ssl_client_key(Path::new(&self.client_key_file));
        }
        options
    }
}

/// Postgres options for `url` with TLS only when asked for: by an `sslmode` in the URL or the
/// `PGSSLMODE` variable. sqlx's own default is `prefer` (TLS, unverified, whenever the server
/// offers it, as Debian's Postgres does): an encryption that verifies nobody, and that made
/// every denial write wait longer (docs/performance.md). Asked for, `require`, `verify-ca`
/// and `verify-full` are as the URL says.
pub fn postgres_options(url: &str) -> Result<sqlx::postgres::PgConnectOptions, sqlx::Error> {
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    let asked = url.contains("sslmode=") || std::env::var_os("PGSSLMODE").is_some();
    Ok(if asked {
        options
    } else {
        options.ssl_mode(sqlx::postgres::PgSslMode::Disable)
    })
}

fn read(path: &str, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Whether `pem` holds at least one block whose label is one of `labels`. Only the
/// `-----BEGIN ...-----` lines are looked at; a key's contents never reach an error message.
fn expect_pem(
    pem: &[u8],
    path: &str,
    what: &'static str,
    labels: &[&str],
    expected: &'static str,
) -> Result<(), TlsError> {
    let text = String::from_utf8_lossy(pem);
    let found = text.lines().any(|line| {
        let line = line.trim();
        labels
            .iter()
            .any(|label| line == format!("-----BEGIN {label}-----"))
    });
    if found {
        Ok(())
    } else {
        Err(TlsError::NotPem {
            what,
            path: path.to_owned(),
            expected,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> String {
        let path = std::env::temp_dir().join(format!("sqtls_{}_{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn no_files_means_system_roots_and_no_client_identity() {
        let files = TlsFiles::default();
        assert!(files.check().is_ok());
        assert!(files.ca_pem().unwrap().is_none());
        assert!(files.identity_pem().unwrap().is_none());
    }

    #[test]
    fn a_certificate_without_its_key_is_refused() {
        let files = TlsFiles {
            client_cert_file: "/nonexistent.pem".into(),
            ..TlsFiles::default()
        };
        assert_eq!(
            files.check().unwrap_err().to_string(),
            "client_cert_file and client_key_file must be set together"
        );
    }

    #[test]
    fn a_key_file_that_is_not_pem_is_refused_without_quoting_it() {
        let cert = file(
            "cert.pem",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        );
        let key = file("key.pem", "s3cret-key-material");
        let files = TlsFiles {
            client_cert_file: cert,
            client_key_file: key.clone(),
            ..TlsFiles::default()
        };
        let message = files.check().unwrap_err().to_string();
        assert_eq!(
            message,
            format!("client_key_file {key} holds no PEM private key")
        );
        assert!(!message.contains("s3cret"));
    }

    #[test]
    fn postgres_speaks_tls_only_when_the_url_asks() {
        use sqlx::postgres::PgSslMode;
        if std::env::var_os("PGSSLMODE").is_some() {
            return; // the variable asks for a mode: nothing to default
        }
        let mode = |url: &str| postgres_options(url).unwrap().get_ssl_mode();
        assert!(matches!(mode("postgres://u@h/db"), PgSslMode::Disable));
        assert!(matches!(
            mode("postgres://u@h/db?sslmode=require"),
            PgSslMode::Require
        ));
        assert!(matches!(
            mode("postgres://u@h/db?sslmode=verify-full"),
            PgSslMode::VerifyFull
        ));
    }

    #[test]
    fn a_missing_ca_file_is_named() {
        let files = TlsFiles {
            ca_file: "/nonexistent/ca.pem".into(),
            ..TlsFiles::default()
        };
        assert!(files
            .check()
            .unwrap_err()
            .to_string()
            .starts_with("cannot read ca_file /nonexistent/ca.pem: "));
    }
}
