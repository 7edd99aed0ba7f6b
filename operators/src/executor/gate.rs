//! When a computed step may complete: after the rank's next `steps` launches (plus a seeded
//! jitter of up to `jitter_steps`), or at once while the rank is flushing (it has nothing more
//! to launch). Completions keep their launch order whatever the jitter. Each launch is told, when
//! it is made, the launch count at which it completes ([`CompletionGate::launched`]).

use crate::step::StepCompletion;
use kvflow_kernels::hash;
use std::collections::VecDeque;

/// How long completions are held, in launches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Delay {
    pub steps: u64,
    pub jitter_steps: u64,
    pub seed: u64,
}

impl Delay {
    /// The same settings, seeded apart for rank `rank`.
    pub fn for_rank(self, rank: usize) -> Delay {
        Delay { seed: hash::mix(self.seed, rank as u64), ..self }
    }

    /// A step completes at its own launch.
    pub fn is_synchronous(&self) -> bool {
        self.steps == 0 && self.jitter_steps == 0
    }

    /// Launches after its own that the step launched `launch`-th waits.
    fn draw(&self, launch: u64) -> u64 {
        let jitter = match self.jitter_steps {
            0 => 0,
            j => hash::mix(self.seed, launch) % (j + 1),
        };
        self.steps + jitter
    }
}

/// Computed completions waiting for their release.
#[derive(Debug, Default)]
pub struct CompletionGate {
    delay: Delay,
    launches: u64,
    last_release: u64,
    held: VecDeque<(u64, StepCompletion)>,
    flushing: bool,
}

impl CompletionGate {
    pub fn new(delay: Delay) -> Self {
        CompletionGate { delay, ..Default::default() }
    }

    /// A step was launched (which ends a flush); returns the launch count at which it completes.
    pub fn launched(&mut self) -> u64 {
        self.flushing = false;
        self.launches += 1;
        let at = (self.launches + self.delay.draw(self.launches)).max(self.last_release);
        self.last_release = at;
        at
    }

    /// Launches so far.
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Holds a computed completion until launch count `at` (from [`Self::launched`]).
    pub fn hold(&mut self, at: u64, completion: StepCompletion) {
        self.held.push_back((at, completion));
    }

    /// Complete everything held as soon as possible, until nothing is held.
    pub fn flush(&mut self) {
        self.flushing = true;
    }

    pub fn is_flushing(&self) -> bool {
        self.flushing
    }

    /// Moves what may complete now into `out`; returns how many.
    pub fn release(&mut self, out: &mut Vec<StepCompletion>) -> usize {
        let mut n = 0;
        while let Some((at, _)) = self.held.front() {
            if !self.flushing && *at > self.launches {
                break;
            }
            out.push(self.held.pop_front().expect("peeked").1);
            n += 1;
        }
        if self.held.is_empty() {
            self.flushing = false;
        }
        n
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(step: u64) -> StepCompletion {
        StepCompletion::of(step, Ok(Vec::new()))
    }

    fn steps(out: &[StepCompletion]) -> Vec<u64> {
        out.iter().map(|c| c.step).collect()
    }

    #[test]
    fn a_step_completes_after_the_next_delay_launches_or_at_a_flush() {
        let mut gate = CompletionGate::new(Delay { steps: 1, ..Default::default() });
        let mut out = Vec::new();
        let at = gate.launched();
        gate.hold(at, done(10));
        assert_eq!(gate.release(&mut out), 0, "held until the next launch");
        let at = gate.launched();
        gate.hold(at, done(11));
        gate.release(&mut out);
        assert_eq!(steps(&out), vec![10]);
        gate.flush();
        gate.release(&mut out);
        assert_eq!(steps(&out), vec![10, 11]);
        assert!(!gate.is_flushing(), "a flush ends once nothing is held");
    }

    #[test]
    fn jitter_is_seeded_and_never_reorders() {
        let run = |seed| {
            let mut gate = CompletionGate::new(Delay { steps: 1, jitter_steps: 3, seed });
            let mut order = Vec::new();
            for step in 0..40 {
                let at = gate.launched();
                gate.hold(at, done(step));
                let mut out = Vec::new();
                gate.release(&mut out);
                order.extend(out.iter().map(|c| (c.step, step)));
            }
            order
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
        let order = run(3);
        assert!(order.windows(2).all(|w| w[0].0 < w[1].0), "launch order kept");
        assert!(order.iter().all(|&(s, at)| at > s && at <= s + 4), "delay 1 plus at most 3: {order:?}");
    }
}
