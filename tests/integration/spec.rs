//! Speculative decoding (DESIGN §10) with the n-gram drafter: greedy verification keeps exactly
//! the tokens plain decoding gives — `--verify` compares every output, token by token and by the
//! bits of every sampled logits row, with the plain executor without drafting — on every family,
//! with drafts really fed and kept; a rejected draft leaves the recurrent state as after the last
//! accepted token.

use crate::common::{assert_clean_failure, fixture, kvflow, FIXTURES};
use crate::handoff::{runner, runner_drafting, step, BLOCK};
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_kernels::cpu::sampling::{RequestSampling, Sampler, SamplingParams};
use kvflow_kernels::models::{self, LogitsWanted, SeqInput};
use kvflow_operators::rank::TestSwitches;
use kvflow_operators::step::{SeqKey, SeqStep, StateOp};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

const SPEC: &str = "[speculative]\ndrafter = \"ngram\"\ndraft_tokens = 4\n";

fn spec_graph(dir: &Path, model: &str, pools: &str) -> std::path::PathBuf {
    let workload = "mode = \"concurrency\"\nconcurrency = 6\nlimit = 8";
    let pools = format!("{pools}\n{SPEC}");
    write_graph_with(dir, model, "mooncake_conversation_head.jsonl", workload, "16 MiB", &pools)
}

/// Decodes long enough to draft: 40 outputs a request.
pub(crate) fn long_outputs() -> Overrides {
    Overrides { max_output_tokens: Some(40), ..Default::default() }
}

fn spec_of(report: &Value) -> (u64, u64) {
    (report["spec"]["drafted_tokens"].as_u64().unwrap(), report["spec"]["accepted_tokens"].as_u64().unwrap())
}

#[test]
fn greedy_drafting_gives_the_plain_outputs_on_every_family() {
    let pool = "[[pool]]\nname = \"main\"\nranks = 2\n";
    let mut accepted_somewhere = 0;
    for model in FIXTURES {
        let dir = tempfile::tempdir().unwrap();
        let report = run_graph(&spec_graph(dir.path(), model, pool), long_outputs(), TestSwitches::default());
        assert_exact(&report, model);
        let (drafted, accepted) = spec_of(&report);
        assert!(drafted > 0, "{model}: drafts were fed: {}", report["spec"]);
        accepted_somewhere += accepted;
        eprintln!("{model}: {}", report["spec"]);
    }
    assert!(accepted_somewhere > 0, "some drafts were kept");
}

#[test]
fn a_decode_pool_drafts_exactly_and_a_deferred_executor_stays_exact() {
    // A deferred executor decodes the token still in flight at the next step: a sequence drafts
    // only when it has none in flight, so there it drafts rarely or never — and stays exact.
    let deferred = "[[pool]]\nname = \"main\"\nranks = 2\nexecutor = \"cpu-deferred\"\n";
    let pd = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n[[pool]]\nname = \"decode\"\n\
              role = \"decode\"\nranks = 1\n\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"inproc\"\n";
    for (what, pools) in [("1P1D", pd), ("cpu-deferred", deferred)] {
        for model in ["hf/llama", "hf/kimi_linear"] {
            let dir = tempfile::tempdir().unwrap();
            let report = run_graph(&spec_graph(dir.path(), model, pools), long_outputs(), TestSwitches::default());
            assert_exact(&report, &format!("{what} {model}"));
            if what == "1P1D" {
                assert!(spec_of(&report).0 > 0, "{what} {model}: the decode pool drafts: {}", report["spec"]);
            }
        }
    }
}

#[test]
fn without_the_rollback_a_rejected_draft_breaks_exactly_the_recurrent_families() {
    // Guarantee-style check for DESIGN §10's rollback (docs/design.md §5).
    let pool = "[[pool]]\nname = \"main\"\nranks = 1\n";
    for model in ["hf/llama", "hf/qwen3_next", "hf/qwen3_next_gdn", "hf/kimi_linear"] {
        let dir = tempfile::tempdir().unwrap();
        let graph = spec_graph(dir.path(), model, pool);
        let switches = TestSwitches { keep_rejected_state: true, ..Default::default() };
        let report = run_graph(&graph, long_outputs(), switches);
        let (drafted, accepted) = spec_of(&report);
        assert!(drafted > accepted, "{model}: some drafts were rejected: {}", report["spec"]);
        let mismatched = report["verify"]["mismatched"].as_u64().unwrap();
        if model == "hf/llama" {
            assert_eq!(mismatched, 0, "no state to roll back: exact");
        } else {
            assert!(mismatched > 0, "{model}: the state after rejected drafts changes the outputs");
        }
    }
}

#[test]
fn bad_speculative_settings_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let pool = "[[pool]]\nname = \"main\"\nranks = 1\n";
    let cases = [
        ("draft_tokens = 4", "draft_tokens = 0", vec!["speculative.draft_tokens", "1 to 16"]),
        ("drafter = \"ngram\"", "drafter = \"eagle\"", vec!["speculative.drafter", "`eagle`", "`mtp`"]),
        ("draft_tokens = 4", "draft_tokens = 4\nngram_min = 3\nngram_max = 2", vec!["speculative.ngram_max"]),
    ];
    for (from, to, needles) in cases {
        let graph = spec_graph(dir.path(), "hf/llama", pool);
        let text = std::fs::read_to_string(&graph).unwrap().replace(from, to);
        std::fs::write(&graph, text).unwrap();
        assert_clean_failure(&kvflow(&["check", &graph.to_string_lossy()]), &needles);
    }
}

#[test]
fn expert_parallel_pools_draft_exactly_on_every_moe_family() {
    // The recurrent ones too: a rejected draft rolls back by a copy, with no second forward
    // through the experts of one rank.
    let ep = "[[pool]]\nname = \"main\"\nranks = 2\nexpert_parallel = true\n";
    for model in ["hf/deepseek_v3", "hf/deepseek_v32", "hf/qwen3_next", "hf/kimi_linear"] {
        let dir = tempfile::tempdir().unwrap();
        let report = run_graph(&spec_graph(dir.path(), model, ep), long_outputs(), TestSwitches::default());
        assert_exact(&report, model);
        assert!(spec_of(&report).0 > 0, "{model}: {}", report["spec"]);
        let ranks = report["rank_stats"].as_array().unwrap();
        assert!(ranks.iter().all(|r| r["exchange_bytes"].as_u64().unwrap() > 0), "experts really exchanged: {ranks:?}");
    }
}

#[test]
fn a_verification_keeps_the_drafts_greedy_decoding_agrees_with_and_rolls_back_the_rest() {
    for name in FIXTURES {
        let model = Arc::new(models::load(&fixture(name)).unwrap());
        verification_keeps_and_rolls_back(
            name,
            &model,
            || runner(&model),
            |r, t, s, before| step(r, t, s, before, &[], &[]),
        );
    }
}

/// On one executor: a prompt, then plain decodes (the oracle: T0 = t0, t1, t2, ...). On another:
/// the prompt, then one verification feeding t0 with drafts [t1, t2, wrong, t4] — it must sample
/// t1, t2, t3 with the oracle's logits rows, keeping 2 drafts — then plain decodes from t3, which
/// must give the oracle's t4 and t5 rows bit for bit (the KV and the state as after t3). Without
/// the rollback (no `StateOp::Rewind`) the recurrent families' next rows differ. `new` makes an
/// executor with room for one sequence of 53 tokens in slot 0 and a verification of 5 rows;
/// `step` runs one step on it.
pub(crate) fn verification_keeps_and_rolls_back<R>(
    name: &str,
    model: &Arc<kvflow_kernels::models::Model>,
    new: impl Fn() -> R,
    step: impl Fn(&mut R, u64, SeqStep<'_>, &[StateOp]) -> kvflow_operators::step::StepCompletion,
) {
    let vocab = model.vocab_size as u32;
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 7 + 3) % vocab).collect();
    let p = prompt.len();
    let key = SeqKey { index: 0, generation: 1 };
    let blocks: Vec<u32> = if model.needs_blocks() { (0..(p + 16).div_ceil(BLOCK) as u32).collect() } else { vec![] };
    let slot = model.needs_slots().then_some(0);
    let zero: Vec<StateOp> = slot.map(|slot| StateOp::Zero { slot }).into_iter().collect();
    // What `verify` asks of the sequence's next launch after a rejection (the rollback):
    // its slot back to the state after the last token that held, fed at p + 2.
    let rewind: Vec<StateOp> = slot.map(|slot| StateOp::Rewind { slot, position: p + 2 }).into_iter().collect();
    let run = |r: &mut R, t: u64, known: &[u32], start_pos: usize, drafts: &[u32], rewinds: bool| {
        let s = SeqStep {
            key,
            known,
            drafts,
            deferred: None,
            start_pos,
            block_table: &blocks,
            slot,
            prompt_len: p,
            sample: true,
            sampler: Sampler::default(),
            next_prompt_token: None,
        };
        let before: &[StateOp] = match t {
            0 => &zero,
            _ if rewinds => &rewind,
            _ => &[],
        };
        step(r, t, s, before).result.unwrap().remove(0)
    };
    let mut plain = new();
    let mut oracle = vec![run(&mut plain, 0, &prompt, 0, &[], false)];
    for i in 0..6 {
        let last = [oracle[i].token.unwrap()];
        oracle.push(run(&mut plain, 1 + i as u64, &last, p + i, &[], false));
    }
    let token = |i: usize| oracle[i].token.unwrap();
    for keep in [false, true] {
        let mut spec = new();
        assert_eq!(run(&mut spec, 0, &prompt, 0, &[], false), oracle[0], "{name}: the prompt's row");
        let drafts = [token(1), token(2), (token(3) + 1) % vocab, token(4)];
        let verified = run(&mut spec, 1, &[token(0)], p, &drafts, false);
        assert_eq!((verified.token, verified.logits_hash), (oracle[1].token, oracle[1].logits_hash), "{name}");
        assert_eq!(verified.kept_drafts(), 2, "{name}: the first two drafts hold");
        assert_eq!(
            verified.verified().skip(1).collect::<Vec<_>>(),
            vec![(oracle[2].token, oracle[2].logits_hash), (oracle[3].token, oracle[3].logits_hash)],
            "{name}: two drafts kept, then the oracle's token where the wrong draft stood"
        );
        let next = run(&mut spec, 2, &[token(3)], p + 3, &[], !keep);
        let after = run(&mut spec, 3, &[token(4)], p + 4, &[], false);
        let exact = next == oracle[4] && after == oracle[5];
        if !keep || slot.is_none() {
            assert!(exact, "{name} (rollback {}): the decodes after it are the oracle's", !keep);
        } else {
            assert!(!exact, "{name}: without the rollback the state after the rejected drafts shows");
        }
    }
}

#[test]
fn the_regression_configuration_with_drafting_is_exact_with_drafts_on_every_decode_rank() {
    // graphs/regress-1p1d-dpa8-spec.toml at reduced size: 8 + 8 expert-parallel Kimi Linear ranks
    // (KDA and conv state rolled back by a copy), drafts verified on decode ranks while other
    // ranks run middle chunks or idle, every rank joining every exchange.
    let dir = tempfile::tempdir().unwrap();
    let overrides = Overrides { limit: Some(40), out: Some(dir.path().join("out")), ..Default::default() };
    let graph = Path::new(env!("CARGO_MANIFEST_DIR")).join("graphs/regress-1p1d-dpa8-spec.toml");
    let report = run_graph(&graph, overrides, TestSwitches::default());
    assert_exact(&report, "regression configuration with drafting");
    assert_ne!(report["stalled"], true, "the watchdog never fired");
    assert_eq!(report["verify"]["checked"], 182, "warmup requests are verified too");
    for r in report["rank_stats"].as_array().unwrap() {
        let drafted = r["drafted_tokens"].as_u64().unwrap();
        if r["pool"] == "decode" {
            assert!(drafted > 0 && r["exchange_bytes"].as_u64().unwrap() > 0, "every decode rank drafts: {r}");
        } else {
            assert_eq!(drafted, 0, "a prefill rank never verifies: {r}");
        }
    }
}

/// The target distribution at the position after `tokens` (temperature `t`), from a plain
/// forward of `tokens` on a fresh cache.
fn target_after(model: &models::Model, tokens: &[u32], t: f64) -> Vec<f64> {
    let blocks: Vec<u32> = (0..tokens.len().div_ceil(BLOCK) as u32).collect();
    let mut cache = model.new_cache(BLOCK, blocks.len(), usize::from(model.needs_slots()), 0);
    let seq = SeqInput {
        tokens,
        start_pos: 0,
        block_table: if model.needs_blocks() { &blocks } else { &[] },
        slot: model.needs_slots().then_some(0),
        prompt_len: tokens.len(),
        logits: LogitsWanted::Last,
    };
    let out = model.forward(&[seq], &mut cache);
    let logits = out.last(0).unwrap();
    let max = logits.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
    let weights: Vec<f64> = logits.iter().map(|&v| ((v as f64 - max) / t).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Pearson's chi-square of `counts` against `probs` over bins of at least 20 expected draws (the
/// likeliest tokens alone, the rest pooled in probability order); returns (statistic, the 0.1%
/// critical value for its degrees of freedom by the Wilson–Hilferty approximation).
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, f64) {
    let n: usize = counts.iter().sum();
    assert!(n as f64 >= 40.0, "too few draws for a chi-square");
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let (mut bins, mut expected, mut seen) = (Vec::new(), 0.0, 0usize);
    for t in order {
        expected += probs[t] * n as f64;
        seen += counts[t];
        if expected >= 20.0 {
            bins.push((seen as f64, expected));
            (expected, seen) = (0.0, 0);
        }
    }
    if let Some(last) = bins.last_mut() {
        (last.0, last.1) = (last.0 + seen as f64, last.1 + expected);
    }
    let statistic = bins.iter().map(|(o, e)| (o - e).powi(2) / e).sum();
    let k = (bins.len() - 1) as f64;
    let critical = k * (1.0 - 2.0 / (9.0 * k) + 3.09 * (2.0 / (9.0 * k)).sqrt()).powi(3);
    (statistic, critical)
}

#[test]
fn sampled_drafting_keeps_the_target_distribution() {
    // Speculative sampling through the CPU executor (the llama fixture, temperature 0.05: its random weights give flat logits): after a
    // prompt, one verification per trial feeds T0 and drafts [d1, d2] at the same positions with
    // a different request id (so different seeded draws). The token chosen at p + 1 must follow
    // the target distribution there, whichever draft stood; among trials that kept d1, the
    // token at p + 2 must follow the target given d1 — and d1 is kept at the rate p(d1).
    let model = Arc::new(models::load(&fixture("hf/llama")).unwrap());
    let vocab = model.vocab_size as u32;
    let prompt: Vec<u32> = (0..29u32).map(|i| (i * 11 + 5) % vocab).collect();
    let p = prompt.len();
    let temperature = 0.05;
    let t0 = 17u32;
    let with_t0: Vec<u32> = prompt.iter().copied().chain([t0]).collect();
    let first = target_after(&model, &with_t0, temperature);
    let mut by_probability: Vec<u32> = (0..vocab).collect();
    by_probability.sort_by(|&a, &b| first[b as usize].total_cmp(&first[a as usize]));
    let blocks: Vec<u32> = (0..(p + 8).div_ceil(BLOCK) as u32).collect();
    let key = SeqKey { index: 0, generation: 1 };
    let sampling =
        RequestSampling { params: SamplingParams { temperature: temperature as f32, top_k: 0, top_p: 1.0 }, seed: 9 };
    let trials = 6000u64;
    // The likeliest token, the runner-up, and one the target never picks.
    for d1 in [by_probability[0], by_probability[1], by_probability[vocab as usize - 1]] {
        let d2 = (d1 * 3 + 1) % vocab;
        let with_d1: Vec<u32> = with_t0.iter().copied().chain([d1]).collect();
        let second = target_after(&model, &with_d1, temperature);
        let mut r = runner(&model);
        let prefill = SeqStep {
            key,
            known: &prompt,
            drafts: &[],
            deferred: None,
            start_pos: 0,
            block_table: &blocks,
            slot: None,
            prompt_len: p,
            sample: true,
            sampler: Sampler::default(),
            next_prompt_token: None,
        };
        step(&mut r, 0, prefill, &[], &[], &[]).result.unwrap();
        let (mut at_first, mut at_second) = (vec![0usize; vocab as usize], vec![0usize; vocab as usize]);
        let mut kept = 0;
        for trial in 0..trials {
            let s = SeqStep {
                known: &[t0],
                drafts: &[d1, d2],
                start_pos: p,
                sampler: Sampler::new(sampling, trial),
                ..prefill
            };
            let verified = step(&mut r, 1 + trial, s, &[], &[], &[]).result.unwrap().remove(0);
            let token = verified.token.unwrap();
            at_first[token as usize] += 1;
            let holds: Vec<_> = verified.verified().collect();
            if let Some(&(Some(next), _)) = holds.get(1) {
                assert_eq!(token, d1, "a token follows only a kept draft");
                at_second[next as usize] += 1;
                kept += 1;
            } else {
                assert_eq!(verified.kept_drafts(), 0);
            }
        }
        let (statistic, critical) = chi_square(&at_first, &first);
        assert!(statistic < critical, "d1 {d1}: position p+1: chi-square {statistic} over critical {critical}");
        if kept >= 500 {
            let (statistic, critical) = chi_square(&at_second, &second);
            assert!(
                statistic < critical,
                "d1 {d1}: position p+2 given d1: chi-square {statistic} over critical {critical}"
            );
        }
        let rate = kept as f64 / trials as f64;
        let expected = first[d1 as usize];
        let sd = (expected * (1.0 - expected) / trials as f64).sqrt();
        assert!((rate - expected).abs() < 4.0 * sd + 1e-3, "d1 {d1}: kept at {rate}, p(d1) {expected}");
        eprintln!("d1 {d1}: kept at {rate:.4} (p(d1) {expected:.4}), {kept} trials reached p+2");
    }
}

#[test]
fn a_producer_drafts_from_t0_and_the_consumers_first_decode_verifies_those_drafts() {
    // Guarantee-style check for "drafter inputs explicit" (docs/design.md §5): the producer
    // never verifies, yet its T0 chunk tells the drafter to propose from T0; the handoff carries
    // the drafts (inproc, and over tcp on the wire) and the consumer's first decode feeds T0 and
    // exactly those. With the test switch the drafter hears of a sampled token only when the
    // chunk verifies drafts: the producer makes none and first decodes feed T0 alone.
    let pd = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n[[pool]]\nname = \"decode\"\n\
              role = \"decode\"\nranks = 2\n\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\n";
    let tcp = format!("{pd}backend = \"tcp\"\nendpoint = \"127.0.0.1:0\"\n");
    let inproc = format!("{pd}backend = \"inproc\"\n");
    // Every family, over tcp for some (the drafts ride on the wire) and inproc for the rest.
    for (i, model) in FIXTURES.iter().copied().enumerate() {
        let pools = if i % 2 == 0 { &tcp } else { &inproc };
        first_decodes_verify_the_producers_drafts(model, pools, long_outputs());
    }
}

/// A 1P1D graph of `pools` drafting on `model`: exact, every draft the producer handed off fed by
/// a first decode; with `drafter_successors_only_when_verifying` none made and none fed. Returns
/// the report of the run with drafts.
pub(crate) fn first_decodes_verify_the_producers_drafts(model: &str, pools: &str, outputs: Overrides) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let graph = spec_graph(dir.path(), model, pools);
    let report = run_graph(&graph, outputs.clone(), TestSwitches::default());
    assert_exact(&report, model);
    let spec = &report["spec"];
    let (sent, fed) = (spec["handed_off_drafts"].as_u64().unwrap(), spec["first_decode_drafts"].as_u64().unwrap());
    assert!(sent > 0 && fed == sent, "{model}: the first decodes verify the producer's drafts: {spec}");
    assert!(spec["first_decodes"].as_u64().unwrap() > 0);
    let switches = TestSwitches { drafter_successors_only_when_verifying: true, ..Default::default() };
    let without = run_graph(&graph, outputs, switches);
    assert_exact(&without, model);
    let spec = &without["spec"];
    assert_eq!(spec["handed_off_drafts"], 0, "{model}: without the field the producer drafts nothing: {spec}");
    assert_eq!(spec["first_decode_drafts"], 0, "{model}: {spec}");
    report
}

/// The seeded DeepSeek-V3 of `benches/specs/deepseek_mtp.toml`, with its MTP layer, written as a
/// checkpoint under DeepSeek's tensor names
/// (`model.layers.3.enorm`, `.hnorm`, `.eh_proj`, `.shared_head.*` and the layer's decoder
/// tensors) into `dir/ckpt`.
pub(crate) fn mtp_checkpoint(dir: &Path) -> std::path::PathBuf {
    let ckpt = dir.join("ckpt");
    let spec = crate::common::repo().join("benches/specs/deepseek_mtp.toml");
    let names = models::write_seeded_checkpoint(&spec, &ckpt).unwrap();
    assert!(names.iter().any(|n| n == "model.layers.3.eh_proj.weight"), "{names:?}");
    ckpt
}

/// [`spec_graph`] with `drafter = "mtp"` and `edits` (from, to) applied to its text.
pub(crate) fn mtp_graph(dir: &Path, model: &str, pools: &str, edits: &[(&str, &str)]) -> std::path::PathBuf {
    let graph = spec_graph(dir, model, pools);
    let mut text = std::fs::read_to_string(&graph).unwrap().replace("drafter = \"ngram\"", "drafter = \"mtp\"");
    for (from, to) in edits {
        text = text.replace(from, to);
    }
    std::fs::write(&graph, text).unwrap();
    graph
}

#[test]
fn the_mtp_drafter_is_exact_and_a_producer_hands_its_mtp_drafts_off() {
    // MTP drafts from the seeded checkpoint's MTP layer, run in the executor after each step:
    // greedy verification keeps outputs exactly the plain ones (aggregated, deferred, and P/D
    // over inproc and tcp, where the MTP layer's KV travels with the rest and the producer's
    // drafts made from T0 are the consumer's first draft).
    let dir = tempfile::tempdir().unwrap();
    let ckpt = mtp_checkpoint(dir.path());
    let link = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n[[pool]]\nname = \"decode\"\n\
                role = \"decode\"\nranks = 2\n\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\n";
    let cases = [
        ("aggregated", "[[pool]]\nname = \"main\"\nranks = 2\n".to_string()),
        ("cpu-deferred", "[[pool]]\nname = \"main\"\nranks = 1\nexecutor = \"cpu-deferred\"\n".to_string()),
        ("expert parallel", "[[pool]]\nname = \"main\"\nranks = 2\nexpert_parallel = true\n".to_string()),
        ("1P2D inproc", format!("{link}backend = \"inproc\"\n")),
        ("1P2D tcp", format!("{link}backend = \"tcp\"\nendpoint = \"127.0.0.1:0\"\n")),
    ];
    for (what, pools) in cases {
        let run_dir = dir.path().join(what.replace(' ', "-"));
        std::fs::create_dir_all(&run_dir).unwrap();
        let graph = mtp_graph(&run_dir, &ckpt.to_string_lossy(), &pools, &[]);
        let report = run_graph(&graph, long_outputs(), TestSwitches::default());
        assert_exact(&report, what);
        let spec = &report["spec"];
        if what != "cpu-deferred" {
            assert!(spec["drafted_tokens"].as_u64().unwrap() > 0, "{what}: MTP drafts were fed: {spec}");
        }
        if what.starts_with("1P2D") {
            let sent = spec["handed_off_drafts"].as_u64().unwrap();
            assert!(sent > 0 && spec["first_decode_drafts"] == sent, "{what}: {spec}");
        }
    }
    // Refused where it cannot run: a checkpoint without an MTP layer.
    let graph = mtp_graph(dir.path(), "hf/llama", "[[pool]]\nname = \"main\"\nranks = 1\n", &[]);
    assert_clean_failure(&kvflow(&["run", &graph.to_string_lossy()]), &["speculative.drafter", "holds no MTP layer"]);
}

#[test]
fn mtp_kv_a_producer_hands_off_equals_the_mtp_kv_recomputed_in_one_pass() {
    // Drafter KV self-consistency: a producer runs the prompt in chunks of 16 (each middle chunk's
    // last MTP row pairs with the next prompt token, `SeqStep::next_prompt_token`) and samples T0;
    // another executor runs the whole prompt as one chunk. The MTP layer's KV in the blocks the
    // producer exports (what its handoff carries) equals the one-pass KV bit for bit, and both
    // propose the same drafts from T0.
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(models::load(&mtp_checkpoint(dir.path())).unwrap());
    let prompt: Vec<u32> = (0..45u32).map(|i| (i * 29 + 7) % 512).collect();
    let p = prompt.len();
    let blocks: Vec<u32> = (0..(p + 8).div_ceil(BLOCK) as u32).collect();
    let key = SeqKey { index: 0, generation: 1 };
    let seq = |known: &'static [u32], start_pos: usize, sample: bool| SeqStep {
        key,
        known,
        drafts: &[],
        deferred: None,
        start_pos,
        block_table: Box::leak(blocks.clone().into_boxed_slice()),
        slot: None,
        prompt_len: p,
        sample,
        sampler: Sampler::default(),
        next_prompt_token: prompt.get(start_pos + known.len()).copied().filter(|_| !sample),
    };
    let leak = |v: &[u32]| -> &'static [u32] { Box::leak(v.to_vec().into_boxed_slice()) };
    // Named in place, so the rows are read straight from the producer's cache.
    let export = [kvflow_operators::step::KvExport {
        key,
        blocks: blocks.clone(),
        slot: None,
        copy_out: false,
        at_launch: false,
    }];
    let mut whole = runner_drafting(&model, 4);
    let one = step(&mut whole, 0, seq(leak(&prompt), 0, true), &[], &[], &export);
    let mut producer = runner_drafting(&model, 4);
    let mut last = None;
    for (t, start) in (0..p).step_by(16).enumerate() {
        let end = (start + 16).min(p);
        let exports: &[_] = if end == p { &export } else { &[] };
        last = Some(step(&mut producer, t as u64, seq(leak(&prompt[start..end]), start, end == p), &[], &[], exports));
    }
    let chunked = last.unwrap();
    let (a, b) = (one.result.as_ref().unwrap(), chunked.result.as_ref().unwrap());
    assert_eq!((a[0].token, a[0].logits_hash), (b[0].token, b[0].logits_hash), "the same T0");
    assert_eq!(a[0].drafts, b[0].drafts, "the same drafts from T0");
    assert_eq!(a[0].drafts.len(), 4, "drafts at full width: {:?}", a[0].drafts);
    let mtp_layer = model.kv_row_widths().len() - 1;
    let rows = |c: &kvflow_operators::step::StepCompletion| -> Vec<f32> {
        let Some(kvflow_operators::step::KvSource { store: kvflow_operators::step::BlockStore::Host(cache), .. }) =
            &c.exports[0].source
        else {
            panic!("a CPU export reads in place")
        };
        let cache = cache.read();
        let layer = cache.kv.layer(mtp_layer);
        blocks
            .iter()
            .flat_map(|&b| layer.rows(b as usize * BLOCK, BLOCK).to_vec())
            .take(p * layer.row_width())
            .collect()
    };
    let (handed, recomputed) = (rows(&chunked), rows(&one));
    assert!(handed.iter().any(|&v| v != 0.0), "the MTP layer wrote its KV");
    assert_eq!(handed, recomputed, "the MTP KV handed off is the MTP KV recomputed");
}

#[test]
fn every_rank_joins_the_draft_passes_and_a_rank_that_skips_them_is_named_by_the_watchdog() {
    // The seed's hang, reproduced: P/D pools of 2 expert-parallel ranks with the MTP drafter,
    // whose MoE block makes each draft pass an expert exchange; prompt chunks of 16 tokens, so a
    // producer rank often runs only a middle chunk (nothing sampled, nothing to draft) while its
    // peer samples T0 and drafts. It still joins every draft pass: the run ends exact. With the
    // test switch a rank that samples nothing skips them — its `dispatch[mtp.0]` never lets the
    // step pass — and the watchdog names that operator in the producer pool.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = mtp_checkpoint(dir.path());
    let pools = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 2\nexpert_parallel = true\n\n\
                 [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 2\nexpert_parallel = true\n\n\
                 [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"inproc\"\n";
    let edits = [("draft_tokens = 4", "draft_tokens = 3"), ("chunk_tokens = 64", "chunk_tokens = 16")];
    let graph = mtp_graph(dir.path(), &ckpt.to_string_lossy(), pools, &edits);
    let report = run_graph(&graph, long_outputs(), TestSwitches::default());
    assert_exact(&report, "P/D expert parallel with MTP draft passes");
    let ranks = report["rank_stats"].as_array().unwrap();
    let prefill: Vec<&Value> = ranks.iter().filter(|r| r["pool"] == "prefill").collect();
    let joined_idle: u64 = prefill.iter().map(|r| r["draft_passes_without_samples"].as_u64().unwrap()).sum();
    let drafted: u64 = prefill.iter().map(|r| r["handed_off_drafts"].as_u64().unwrap()).sum();
    assert!(joined_idle > 0 && drafted > 0, "producer ranks joined draft passes with nothing sampled: {prefill:?}");
    assert!(ranks.iter().all(|r| r["exchange_bytes"].as_u64().unwrap() > 0), "experts really exchanged: {ranks:?}");
    let dot = kvflow(&["check", &graph.to_string_lossy(), "--dot"]);
    let dot = String::from_utf8_lossy(&dot.stdout);
    for op in ["dispatch[mtp.0]", "experts[mtp.1]", "combine[mtp.2]"] {
        assert_eq!(dot.matches(op).count(), 2, "{op} once per pool in:\n{dot}");
    }

    let (culprit, stderr) = stall_culprit(&graph, "skip-draft-passes-without-samples", "2", "prefill");
    assert!(culprit.contains("holding the pool back: operator `dispatch[mtp.0]`"), "in:\n{stderr}");
}

/// Runs `graph` with `--test-switch switch` and `--stall-timeout timeout` (one heavy run at a
/// time), expects the stall's exit status 3, and returns the line naming what holds `pool` back,
/// with the whole stderr.
pub(crate) fn stall_culprit(graph: &Path, switch: &str, timeout: &str, pool: &str) -> (String, String) {
    let _one_at_a_time = crate::runtime::HEAVY.lock();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--stall-timeout", timeout, "--test-switch", switch])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(3), "a stall exits with status 3: {stderr}");
    let header = format!("pool {pool}: stall");
    let culprit = stderr.lines().skip_while(|l| !l.starts_with(&header)).nth(1).unwrap_or_default().to_string();
    (culprit, stderr)
}

#[test]
fn propose_and_verify_are_operators_of_the_step_loop() {
    // DESIGN §4: forward(t) → verify(t) → propose(t) → feedback (t + 1) → schedule(t + 1), as the
    // runtime builds it (the picture is drawn from the built dataflow).
    let dir = tempfile::tempdir().unwrap();
    let graph = spec_graph(dir.path(), "hf/llama", "[[pool]]\nname = \"main\"\nranks = 2\n");
    let out = kvflow(&["check", &graph.to_string_lossy(), "--dot"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dot = String::from_utf8_lossy(&out.stdout).to_string();
    let node = |label: &str| {
        dot.lines()
            .find(|l| l.contains(&format!("label=\"{label}")) && l.contains('[') && !l.contains("->"))
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .unwrap_or_else(|| panic!("no {label} node in:\n{dot}"))
    };
    let (forward, verify, propose) =
        (node("forward(t)"), node("verify(t)"), node("propose(t)\\ndrafter: ngram, k = 4"));
    for (from, to) in [(&forward, &verify), (&verify, &propose)] {
        let edge = format!("{from} -> {to} [label=\"launched: LoopSignal\"]");
        assert!(dot.contains(&edge), "{edge} in:\n{dot}");
    }
    assert!(dot.contains(&format!("{propose} -> ")), "propose feeds the feedback edge:\n{dot}");
    assert!(dot.contains(&format!("{verify} -> ")) && dot.contains("sampled: Event"), "{dot}");

    // Every draft the scheduler booked was proposed by `propose` first.
    let report = run_graph(&graph, long_outputs(), TestSwitches::default());
    assert_exact(&report, "aggregated, drafting");
    let proposed = report["spec"]["proposed_tokens"].as_u64().unwrap();
    let (drafted, _) = spec_of(&report);
    assert!(drafted > 0 && proposed >= drafted, "proposed {proposed}, drafted {drafted}: {}", report["spec"]);

    // The step loop runs through it: `propose` holding step 6 on rank 1 holds the pool back, and
    // the watchdog names it.
    let _one_at_a_time = crate::runtime::HEAVY.lock();
    let g = graph.to_string_lossy();
    let out = kvflow(&["run", &g, "--stall-timeout", "2", "--test-switch", "hold-capability=propose:1:6"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "a stall exits with status 3: {stderr}");
    let expected = "holding the pool back: operator `propose` on rank 1 holds step 6 ";
    assert!(stderr.contains(expected), "expected {expected:?} in:\n{stderr}");
}
