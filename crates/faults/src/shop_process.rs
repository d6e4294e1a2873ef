//! A real `shop` process on a fixed port, that can be SIGKILLed and started again.

use anyhow::{bail, Context, Result};
use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};
use tokio::process::{Child, Command};

/// One `shop` server process (restartable on the same port).
pub struct ShopProcess {
    bin: PathBuf,
    args: Vec<String>,
    port: u16,
    child: Option<Child>,
    log: PathBuf,
    /// How many times it was started.
    pub starts: usize,
}

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Starts `bin ARGS…` with its output appended to `log`; SIGKILLed when dropped.
pub fn spawn_logged(bin: &Path, args: &[String], log: &Path) -> Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))
}

impl ShopProcess {
    /// Starts `shop --listen 127.0.0.1:PORT --database-url URL ARGS…` and waits until it answers.
    pub async fn start(bin: &Path, database_url: &str, extra: &[&str]) -> Result<Self> {
        let port = free_port();
        let mut args = vec![
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--database-url".to_owned(),
            database_url.to_owned(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = std::env::temp_dir().join(format!("faults-shop-{port}.log"));
        let mut shop = ShopProcess {
            bin: bin.to_path_buf(),
            args,
            port,
            child: None,
            log,
            starts: 0,
        };
        shop.spawn().await?;
        Ok(shop)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) -> Result<()> {
        let child = spawn_logged(&self.bin, &self.args, &self.log)?;
        self.child = Some(child);
        self.starts += 1;
        self.wait_healthy(Duration::from_secs(30)).await
    }

    /// Waits until `GET /healthz` answers 200.
    pub async fn wait_healthy(&mut self, limit: Duration) -> Result<()> {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + limit;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "shop exited with {status} during start; log: {}",
                        self.log.display()
                    );
                }
            }
            let ok = client
                .get(format!("{}/healthz", self.url()))
                .timeout(Duration::from_millis(500))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("shop did not become healthy; log: {}", self.log.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL (no cleanup of any kind), then wait for the process to be gone.
    pub async fn kill9(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.start_kill()?; // SIGKILL on Unix
            child.wait().await?;
        }
        Ok(())
    }

    /// Starts the process again on the same port.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill9().await?;
        self.spawn().await
    }

    /// Whether the log shows a panic.
    pub fn panicked(&self) -> bool {
        std::fs::read_to_string(&self.log).is_ok_and(|log| log.contains("panicked"))
    }

    /// Where its output goes.
    pub fn log(&self) -> &PathBuf {
        &self.log
    }
}
