//! `--hostfile`: one `host:port` per process, in process order (blank lines and `#` comments
//! skipped). Every line is checked here, naming the file and line, before any socket is opened.

use super::ClusterPlace;
use anyhow::{bail, Context, Result};
use std::path::Path;

impl ClusterPlace {
    /// This process's place in the cluster the hostfile describes.
    pub fn from_hostfile(path: &Path, process: usize, processes: usize) -> Result<ClusterPlace> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("--hostfile: cannot read {}", path.display()))?;
        let mut addresses = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            check_address(line).map_err(|why| anyhow::anyhow!("{}:{}: {why}", path.display(), i + 1))?;
            addresses.push(line.to_string());
        }
        if addresses.len() != processes {
            bail!(
                "{}: lists {} address(es), but --processes is {processes} (one host:port line per process)",
                path.display(),
                addresses.len()
            );
        }
        if process >= processes {
            bail!("--process {process} is not below --processes {processes} (processes count from 0)");
        }
        Ok(ClusterPlace { process, processes, addresses, connect_timeout: std::time::Duration::from_secs(60) })
    }
}

/// `host:port` with a host and a port number from 1 to 65535.
fn check_address(line: &str) -> Result<(), String> {
    let Some((host, port)) = line.rsplit_once(':') else {
        return Err(format!("expected host:port, got {line:?}"));
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(format!("expected host:port with a host name or address before the colon, got {line:?}"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("expected a port number from 1 to 65535 after the colon, got {port:?} in {line:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bad_line_is_named_by_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hosts");
        std::fs::write(&path, "# cluster\n127.0.0.1:7000\n127.0.0.1:seventy\n").unwrap();
        let e = ClusterPlace::from_hostfile(&path, 0, 2).unwrap_err().to_string();
        assert!(e.contains("hosts:3") && e.contains("port number"), "{e}");
        std::fs::write(&path, "127.0.0.1:7000\n127.0.0.1:7001\n").unwrap();
        assert_eq!(ClusterPlace::from_hostfile(&path, 1, 2).unwrap().addresses.len(), 2);
        assert!(ClusterPlace::from_hostfile(&path, 2, 2).unwrap_err().to_string().contains("--process 2"));
        assert!(ClusterPlace::from_hostfile(&path, 0, 3).unwrap_err().to_string().contains("--processes is 3"));
    }
}
