//! Expert-parallel MoE, one MoE layer of the model at a time (DESIGN §4): `dispatch[ℓ]` sends the
//! rows this rank's step routed at layer ℓ to the ranks owning their experts, `experts[ℓ]` runs
//! this rank's experts over every rank's rows, and `combine[ℓ]` sums the results back into the
//! step and runs it on to the next MoE layer (or to its end). A pool's `forward` is `forward(t)`
//! followed by these three per MoE layer, built from the model config, and — with the MTP drafter,
//! whose layer is a MoE block — by the same three per draft pass (`dispatch[mtp.c]`: the step
//! samples at the end of the model's layers, and each pass drafts one more token), which every
//! rank joins whether or not it has rows in them.
//!
//! Time: each acts at step `t`. `dispatch` passes the rank's [`StageToken`] along and holds
//! nothing. `experts` holds a capability for `t` from the first rows of `t` until its input
//! frontier has passed `t` — every rank's `dispatch[ℓ]` is done with `t` — then computes once.
//! `combine` holds the token's capability until both its inputs have passed `t`.
//!
//! Guarantee carried: collective alignment (DESIGN §5). An exchange completes when the frontier
//! passes `t`, not when a count of peers has arrived: a rank with no tokens sends nothing and lets
//! time pass, so no rank can be one short, and nothing outside the dataflow synchronises ranks.
//! `combine` checks that every (row, expert) pair it dispatched got its result; a missing one
//! fails that request with the layer, expert and rank named — never a silent zero (in a draft
//! pass it drops the step's drafts instead, logged: drafts only propose).

use crate::messages::{ExpertPair, ExpertRows, StageToken};
pub use crate::rank::ExchangeSwitches;
use crate::rank::Rank;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;
use timely::container::CapacityContainerBuilder;
use timely::dataflow::channels::pact::{Exchange, Pipeline};
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::operator::Operator;
use timely::dataflow::operators::generic::OutputBuilder;
use timely::dataflow::operators::Capability;
use timely::dataflow::StreamVec;

/// One MoE layer: its index among the model's MoE layers and its layer in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeLayer {
    pub moe: usize,
    pub layer: usize,
    /// A draft pass of the MTP drafter (its MoE block's experts): which one.
    pub draft_pass: Option<usize>,
}

impl MoeLayer {
    /// How its operators are named: `dispatch[ℓ]`, or `dispatch[mtp.c]` for draft pass `c`.
    pub fn label(&self) -> String {
        match self.draft_pass {
            Some(c) => format!("mtp.{c}"),
            None => self.layer.to_string(),
        }
    }
}

/// Builds `dispatch[ℓ] → experts[ℓ] → combine[ℓ]` on this rank; returns the tokens `combine`
/// passes on.
pub fn moe_layer<'scope>(
    stages: StreamVec<'scope, u64, StageToken>,
    rank: Rc<RefCell<Rank>>,
    at: MoeLayer,
    switches: ExchangeSwitches,
) -> StreamVec<'scope, u64, StageToken> {
    let (rows, tokens) = dispatch(stages, rank.clone(), at, switches);
    let results = experts(rows, rank.clone(), at, switches.send_no_results_at);
    combine(results, tokens, rank, at)
}

fn dispatch<'scope>(
    stages: StreamVec<'scope, u64, StageToken>,
    rank: Rc<RefCell<Rank>>,
    at: MoeLayer,
    switches: ExchangeSwitches,
) -> (StreamVec<'scope, u64, ExpertRows>, StreamVec<'scope, u64, StageToken>) {
    let mut builder = OperatorBuilder::new(format!("dispatch[{}]", at.label()), stages.scope());
    let mut input = builder.new_input(stages, Pipeline);
    let (rows_out, rows) = builder.new_output();
    let (token_out, tokens) = builder.new_output();
    let mut rows_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<ExpertRows>>>::from(rows_out);
    let mut token_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<StageToken>>>::from(token_out);
    builder.build(move |_caps| {
        let mut withheld = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            let mut rows_session = rows_out.activate();
            let mut token_session = token_out.activate();
            input.for_each_stamp(|stamp, data| {
                let Some(rows_cap) = stamp.retain_least(0) else { return };
                let Some(token_cap) = stamp.retain_least(1) else { return };
                let t = *rows_cap.time();
                for tokens in data {
                    for mut token in tokens.drain(..) {
                        let mut rank = rank.borrow_mut();
                        let sent = if token.exchange && rank.is_in_flight(t) {
                            rank.expert_dispatch(at.moe)
                        } else {
                            Vec::new()
                        };
                        token.dispatched = sent
                            .iter()
                            .flat_map(|m| m.pairs.iter().map(|&(row, expert)| ExpertPair { row, expert, owner: m.to }))
                            .collect();
                        let without_samples = at.draft_pass.is_some() && rank.is_in_flight(t) && !rank.samples_at(t);
                        if without_samples && at.draft_pass == Some(0) && token.exchange {
                            rank.stats.spec.draft_passes_without_samples += 1;
                        }
                        let skips_draft = switches.skip_draft_without_samples && without_samples;
                        if switches.withhold_dispatch_at == Some(t) || skips_draft {
                            tracing::warn!(
                                rank = rank.index,
                                step = t,
                                "test switch: dispatch[{}] withholds its rows",
                                at.label()
                            );
                            withheld.push(rows_cap.clone());
                        } else {
                            rank.count_exchange(&sent);
                            rows_session.session(&rows_cap).give_iterator(sent.into_iter());
                        }
                        token_session.session(&token_cap).give(token);
                    }
                }
            });
        }
    });
    (rows, tokens)
}

fn experts<'scope>(
    rows: StreamVec<'scope, u64, ExpertRows>,
    rank: Rc<RefCell<Rank>>,
    at: MoeLayer,
    send_nothing_at: Option<u64>,
) -> StreamVec<'scope, u64, ExpertRows> {
    let name = format!("experts[{}]", at.label());
    rows.unary_frontier::<CapacityContainerBuilder<Vec<ExpertRows>>, _, _, _>(
        Exchange::new(|m: &ExpertRows| m.to as u64),
        &name,
        move |_cap, _info| {
            let mut stash: BTreeMap<u64, (Capability<u64>, Vec<ExpertRows>)> = BTreeMap::new();
            move |(input, frontier), output| {
                input.for_each_stamp(|stamp, data| {
                    let Some(cap) = stamp.retain_least(output.output_index()) else { return };
                    let entry = stash.entry(*cap.time()).or_insert_with(|| (cap, Vec::new()));
                    entry.1.extend(data.flat_map(|d| d.drain(..)));
                });
                while let Some((&t, _)) = stash.first_key_value() {
                    if frontier.frontier().less_equal(&t) {
                        break;
                    }
                    let Some((cap, mut got)) = stash.remove(&t) else { break };
                    if send_nothing_at == Some(t) {
                        tracing::warn!(step = t, "test switch: experts[{}] sends no results", at.label());
                        continue;
                    }
                    got.sort_by_key(|m| m.from);
                    let mut rank = rank.borrow_mut();
                    let results = rank.run_experts(at.moe, &got);
                    rank.count_exchange(&results);
                    output.session(&cap).give_iterator(results.into_iter());
                }
            }
        },
    )
}

fn combine<'scope>(
    results: StreamVec<'scope, u64, ExpertRows>,
    tokens: StreamVec<'scope, u64, StageToken>,
    rank: Rc<RefCell<Rank>>,
    at: MoeLayer,
) -> StreamVec<'scope, u64, StageToken> {
    let name = format!("combine[{}]", at.label());
    results.binary_frontier::<_, CapacityContainerBuilder<Vec<StageToken>>, _, _, _, _>(
        tokens,
        Exchange::new(|m: &ExpertRows| m.to as u64),
        Pipeline,
        &name,
        move |_cap, _info| {
            let mut arrived: BTreeMap<u64, Vec<ExpertRows>> = BTreeMap::new();
            let mut waiting: BTreeMap<u64, (Capability<u64>, StageToken)> = BTreeMap::new();
            move |(results, results_frontier), (tokens, tokens_frontier), output| {
                results.for_each_stamp(|stamp, data| {
                    let t = stamp.least().copied().unwrap_or_default();
                    arrived.entry(t).or_default().extend(data.flat_map(|d| d.drain(..)));
                });
                tokens.for_each_stamp(|stamp, data| {
                    let Some(cap) = stamp.retain_least(output.output_index()) else { return };
                    for token in data.flat_map(|d| d.drain(..)) {
                        waiting.insert(*cap.time(), (cap.clone(), token));
                    }
                });
                while let Some((&t, _)) = waiting.first_key_value() {
                    if results_frontier.frontier().less_equal(&t) || tokens_frontier.frontier().less_equal(&t) {
                        break;
                    }
                    let Some((cap, mut token)) = waiting.remove(&t) else { break };
                    let got = arrived.remove(&t).unwrap_or_default();
                    let mut rank = rank.borrow_mut();
                    if rank.is_in_flight(t) && token.exchange {
                        let back: HashSet<(u32, u32)> = got.iter().flat_map(|m| m.pairs.iter().copied()).collect();
                        let missing: Vec<ExpertPair> =
                            token.dispatched.drain(..).filter(|p| !back.contains(&(p.row, p.expert))).collect();
                        if !missing.is_empty() {
                            tracing::error!(
                                rank = rank.index,
                                step = t,
                                "combine[{}]: {} expert results missing",
                                at.label(),
                                missing.len()
                            );
                        }
                        rank.combine_experts(at.moe, got, &missing);
                    }
                    token.dispatched.clear();
                    output.session(&cap).give(token);
                }
            }
        },
    )
}
