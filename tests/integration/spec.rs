//! Speculative decoding (DESIGN §10) with the n-gram drafter: greedy verification keeps exactly
//! the tokens plain decoding gives — `--verify` compares every output, token by token and by the
//! bits of every sampled logits row, with the plain executor without drafting — on every family,
//! with drafts really fed and kept; a rejected draft leaves the recurrent state as after the last
//! accepted token.

use crate::common::{assert_clean_failure, fixture, kvflow, FIXTURES};
use crate::handoff::{runner, step, BLOCK};
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_kernels::models;
use kvflow_operators::executor::CpuStepRunner;
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
fn long_outputs() -> Overrides {
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
    // Guarantee-style check for DESIGN §10's rollback (tests/GUARANTEES.md).
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
        ("drafter = \"ngram\"", "drafter = \"mtp\"", vec!["speculative.drafter", "not built yet"]),
        ("drafter = \"ngram\"", "drafter = \"eagle\"", vec!["speculative.drafter", "`eagle`"]),
        ("draft_tokens = 4", "draft_tokens = 4\nngram_min = 3\nngram_max = 2", vec!["speculative.ngram_max"]),
    ];
    for (from, to, needles) in cases {
        let graph = spec_graph(dir.path(), "hf/llama", pool);
        let text = std::fs::read_to_string(&graph).unwrap().replace(from, to);
        std::fs::write(&graph, text).unwrap();
        assert_clean_failure(&kvflow(&["check", &graph.to_string_lossy()]), &needles);
    }
    let cuda = "[[pool]]\nname = \"main\"\nranks = 1\nexecutor = \"cuda\"\n";
    let graph = spec_graph(dir.path(), "hf/llama", cuda);
    assert_clean_failure(&kvflow(&["check", &graph.to_string_lossy()]), &["speculative", "cuda"]);
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
    // On one executor: a prompt, then plain decodes (the oracle: T0 = t0, t1, t2, ...). On
    // another: the prompt, then one verification feeding t0 with drafts [t1, t2, wrong, t4] — it
    // must sample t1, t2, t3 with the oracle's logits rows, keeping 2 drafts — then plain decodes
    // from t3, which must give the oracle's t4 and t5 rows bit for bit (the KV and the state as
    // after t3). Without the rollback (test switch) the recurrent families' next rows differ.
    for name in FIXTURES {
        let model = Arc::new(models::load(&fixture(name)).unwrap());
        let vocab = model.vocab_size as u32;
        let prompt: Vec<u32> = (0..37u32).map(|i| (i * 7 + 3) % vocab).collect();
        let p = prompt.len();
        let key = SeqKey { index: 0, generation: 1 };
        let blocks: Vec<u32> =
            if model.needs_blocks() { (0..(p + 16).div_ceil(BLOCK) as u32).collect() } else { vec![] };
        let slot = model.needs_slots().then_some(0);
        let zero: Vec<StateOp> = slot.map(|slot| StateOp::Zero { slot }).into_iter().collect();
        let run = |r: &mut CpuStepRunner, t: u64, known: &[u32], start_pos: usize, drafts: &[u32], keep: bool| {
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
            };
            let before: &[StateOp] = if t == 0 { &zero } else { &[] };
            step(r, t, s, before, &[], &[], keep).result.unwrap().remove(0)
        };
        let mut plain = runner(&model);
        let mut oracle = vec![run(&mut plain, 0, &prompt, 0, &[], false)];
        for i in 0..6 {
            let last = [oracle[i].token.unwrap()];
            oracle.push(run(&mut plain, 1 + i as u64, &last, p + i, &[], false));
        }
        let token = |i: usize| oracle[i].token.unwrap();
        for keep in [false, true] {
            let mut spec = runner(&model);
            assert_eq!(run(&mut spec, 0, &prompt, 0, &[], keep), oracle[0], "{name}: the prompt's row");
            let drafts = [token(1), token(2), (token(3) + 1) % vocab, token(4)];
            let verified = run(&mut spec, 1, &[token(0)], p, &drafts, keep);
            assert_eq!((verified.token, verified.logits_hash), (oracle[1].token, oracle[1].logits_hash), "{name}");
            assert_eq!(
                verified.accepted,
                vec![(oracle[2].token, oracle[2].logits_hash), (oracle[3].token, oracle[3].logits_hash)],
                "{name}: two drafts kept, then the oracle's token where the wrong draft stood"
            );
            let next = run(&mut spec, 2, &[token(3)], p + 3, &[], keep);
            let after = run(&mut spec, 3, &[token(4)], p + 4, &[], keep);
            let exact = next == oracle[4] && after == oracle[5];
            if !keep || slot.is_none() {
                assert!(exact, "{name} (rollback {}): the decodes after it are the oracle's", !keep);
            } else {
                assert!(!exact, "{name}: without the rollback the state after the rejected drafts shows");
            }
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
