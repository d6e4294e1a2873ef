//! Running an outside command that controls a server or the machine (`pg_ctlcluster`, the
//! MariaDB control script, `rabbitmqctl`, `mount`): one place that runs it and turns a failure
//! into an error naming the command and its output.

use anyhow::{ensure, Context, Result};

/// Runs `command` (program and arguments) followed by `extra`, and fails unless it exits 0.
pub async fn run(command: &[String], extra: &[&str]) -> Result<()> {
    output(command, extra).await?;
    Ok(())
}

/// [`run`], returning what the command printed on its standard output.
pub async fn output(command: &[String], extra: &[&str]) -> Result<String> {
    let (program, args) = command.split_first().context("an empty command")?;
    let out = tokio::process::Command::new(program)
        .args(args)
        .args(extra)
        .output()
        .await
        .with_context(|| format!("running {program}"))?;
    ensure!(
        out.status.success(),
        "{} {} failed ({}): {}{}",
        command.join(" "),
        extra.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Splits a command given as one string on whitespace (`"pg_ctlcluster 15 main"`).
pub fn words(command: &str) -> Vec<String> {
    command.split_whitespace().map(str::to_owned).collect()
}
