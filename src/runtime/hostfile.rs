//! Where a pool's processes are: `--hostfile` (one `host:port` per process, in process order;
//! blank lines and `#` comments skipped; every line checked here, naming the file and line,
//! before any socket is opened), or the pool's own `hosts = [...]` in the graph.

use super::checks::{pick_named_pools, pick_pools};
use super::cluster::ClusterPlace;
use crate::graph::Graph;
use anyhow::{bail, Context, Result};
use std::path::Path;

impl ClusterPlace {
    /// Process `process` of the one pool this run picks (`--pools` or `--pool`, else the graph's
    /// pools) that lists its processes in the graph (`hosts`).
    pub fn from_graph(
        graph: &Graph,
        pools: Option<&[String]>,
        pool: Option<&str>,
        process: usize,
    ) -> Result<ClusterPlace> {
        let picked = match pools {
            Some(names) => pick_named_pools(graph, names)?,
            None => pick_pools(graph, pool)?,
        };
        let spread: Vec<_> = picked.iter().filter(|p| !p.hosts.is_empty()).collect();
        let [one] = spread[..] else {
            bail!(
                "--process {process}: {} of the pools this process runs list their processes (hosts = [...]) in {}; \
                 pick the one to run with --pools NAME",
                if spread.is_empty() { "none".to_string() } else { spread.len().to_string() },
                graph.path.display()
            );
        };
        let processes = one.hosts.len();
        if process >= processes {
            bail!(
                "--process {process}: pool `{}` lists {processes} process(es) in {} (hosts); processes count from 0",
                one.name,
                graph.path.display()
            );
        }
        Ok(ClusterPlace {
            process,
            processes,
            addresses: one.hosts.clone(),
            connect_timeout: std::time::Duration::from_secs(60),
        })
    }

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
            crate::graph::host_port(line).map_err(|why| anyhow::anyhow!("{}:{}: {why}", path.display(), i + 1))?;
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
