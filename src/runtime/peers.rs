//! The failure boundary of a pool spread over processes. timely has no recovery: when a peer
//! process exits, this process's network threads panic ("timely communication error: …"), its
//! workers then panic on the poisoned queues, and joining the pool panics too. Here those panics
//! are recognised: the first names the lost peer (its thread is `timely:recv-P` or
//! `timely:send-P`, P the peer's process index), the rest are expected and kept quiet, and the
//! pool's join turns into a [`Lost`] that names the process and its address — the runtime then
//! fails every request the pool held with that cause and writes the report. The pool's ranks in
//! this process are dropped whole, and what they held with them.

use super::cluster::ClusterPlace;
use parking_lot::Mutex;
use std::sync::Once;

/// Why a pool spread over processes ended: a peer process is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lost {
    pub process: Option<usize>,
    pub message: String,
}

/// The first communication error seen by this process's timely threads: (peer, what failed).
static FIRST_ERROR: Mutex<Option<(Option<usize>, String)>> = Mutex::new(None);
static HOOK: Once = Once::new();

/// Installs (once) the panic hook that recognises a lost peer; other panics print as before.
pub fn watch_for_lost_peers() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let thread = std::thread::current().name().unwrap_or("").to_string();
            if text.starts_with("timely communication error") {
                let peer = peer_of(&thread);
                let mut first = FIRST_ERROR.lock();
                if first.is_none() {
                    *first = Some((peer, text));
                }
                return;
            }
            // the poisoned queues and the guards' joins that follow the first error
            let follows = text.starts_with("MergeQueue poisoned")
                || text.starts_with("Send thread panic")
                || text.starts_with("Recv thread panic");
            if follows && FIRST_ERROR.lock().is_some() {
                return;
            }
            previous(info);
        }));
    });
}

/// The peer a timely network thread serves: `timely:recv-3` → 3.
fn peer_of(thread: &str) -> Option<usize> {
    thread.strip_prefix("timely:recv-").or_else(|| thread.strip_prefix("timely:send-"))?.parse().ok()
}

/// What to say of pool `pool` after joining it panicked.
pub fn lost(pool: &str, place: Option<&ClusterPlace>) -> Lost {
    let first = FIRST_ERROR.lock().clone();
    let (process, cause) = match first {
        Some((peer, text)) => (peer, text),
        None => (None, "a worker thread panicked".to_string()),
    };
    let who = match (process, place) {
        (Some(p), Some(place)) => {
            format!("process {p} ({})", place.addresses.get(p).map_or("?", String::as_str))
        }
        (Some(p), None) => format!("process {p}"),
        (None, _) => "a process".to_string(),
    };
    Lost {
        process,
        message: format!(
            "pool {pool}: {who} is gone ({cause}); timely has no recovery, so the pool ended with it and its ranks \
             in this process were dropped with what they held"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_network_threads_name_gives_its_peer() {
        assert_eq!(peer_of("timely:recv-3"), Some(3));
        assert_eq!(peer_of("timely:send-0"), Some(0));
        assert_eq!(peer_of("timely:work-0"), None);
        let place = ClusterPlace {
            process: 0,
            processes: 2,
            addresses: vec!["10.0.0.1:7000".into(), "10.0.0.2:7000".into()],
            connect_timeout: std::time::Duration::from_secs(1),
        };
        *FIRST_ERROR.lock() = Some((Some(1), "timely communication error: reading data: socket closed".into()));
        let l = lost("main", Some(&place));
        assert_eq!(l.process, Some(1));
        assert!(l.message.contains("process 1 (10.0.0.2:7000) is gone (timely communication error"), "{}", l.message);
    }
}
