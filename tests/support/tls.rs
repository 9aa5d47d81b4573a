//! Certificates for the TLS tests, made with the `openssl` command-line tool at
//! test time: a CA of its own, and a server certificate it signed for
//! `127.0.0.1` and `localhost` (subject alternative names), each in PEM.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;
use tempfile::TempDir;

pub struct TestCa {
    _dir: TempDir,
    /// The CA's certificate: what a client checks the server's against.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new() -> TestCa {
        let dir = crate::private_dir();
        let at = |name: &str| dir.path().join(name);
        let run = |args: &[&str]| {
            let output = crate::run_bounded(
                Command::new("openssl").args(args).current_dir(dir.path()),
                Duration::from_secs(60),
            );
            assert!(
                output.status.success(),
                "openssl {} failed (the TLS tests need the openssl command; Debian: apt-get install openssl): {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=kvhint test CA",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        std::fs::write(
            at("san.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
        )
        .unwrap();
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
        ]);
        TestCa {
            ca: at("ca.pem"),
            cert: at("server.pem"),
            key: at("server.key"),
            _dir: dir,
        }
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}
