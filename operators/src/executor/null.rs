//! `null`: no math — every sampled token is 0 and every logits row is one zero. Only for
//! measuring what coordination costs (`kvflow bench step`); outputs are meaningless. With
//! `delay_steps` its completions are held like `cpu-deferred`'s, on the rank's thread.

use super::contract::Executor;
use super::gate::{CompletionGate, Delay};
use crate::step::{Sampled, StepCompletion, StepLaunch};
use kvflow_kernels::hash;

pub struct NullExecutor {
    gate: CompletionGate,
    zero_row: u64,
}

impl NullExecutor {
    pub fn new(delay: Delay) -> Self {
        NullExecutor { gate: CompletionGate::new(delay), zero_row: hash::logits_row(&[0.0]) }
    }
}

impl Executor for NullExecutor {
    fn phases(&self) -> usize {
        1
    }

    fn launch(&mut self, step: &StepLaunch<'_>, _phase: usize) {
        let due = self.gate.launched();
        let sampled = step.sampling.iter().map(|&seq| Sampled::one(seq, Some(0), self.zero_row)).collect();
        self.gate.hold(due, StepCompletion::of(step.step, Ok(sampled)));
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        self.gate.release(out);
    }

    fn flush(&mut self) {
        self.gate.flush();
    }
}
