//! Expert parallelism changes no bit: a step run with its MoE layers split three ways — routed on
//! the token's rank, each expert run on the rank that holds it over a different grouping of rows,
//! summed back in expert order — gives the logits of the step run whole.

use super::parts::moe::{expert_owner, expert_range};
use super::{load, load_expert_shard, LogitsWanted, Model, SeqInput};
use std::path::{Path, PathBuf};

const MOE_FIXTURES: [&str; 4] = ["deepseek_v3", "deepseek_v32", "qwen3_next", "kimi_linear"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hf").join(name)
}

/// Two prompts of 5 and 9 tokens, each in its own blocks and slot.
fn batch<'a>(model: &Model, tokens: &'a [Vec<u32>; 2]) -> Vec<SeqInput<'a>> {
    let tables: [&'static [u32]; 2] = [&[0], &[1, 2]];
    (0..2)
        .map(|i| SeqInput {
            tokens: &tokens[i],
            start_pos: 0,
            block_table: if model.needs_blocks() { tables[i] } else { &[] },
            slot: model.needs_slots().then_some(i as u32),
            prompt_len: tokens[i].len(),
            logits: LogitsWanted::All,
        })
        .collect()
}

#[test]
fn a_step_with_its_experts_on_three_ranks_gives_the_bits_of_the_step_run_whole() {
    let ranks = 3;
    for name in MOE_FIXTURES {
        let whole = load(&fixture(name)).unwrap();
        let shards: Vec<Model> = (0..ranks).map(|r| load_expert_shard(&fixture(name), r, ranks).unwrap()).collect();
        let tokens = [vec![3, 17, 4, 99, 1], vec![8, 8, 2, 61, 5, 40, 7, 13, 21]];
        let tokens = tokens.map(|t| t.into_iter().map(|x| x % whole.vocab_size as u32).collect::<Vec<u32>>());
        let b = batch(&whole, &tokens);
        let expected = whole.forward(&b, &mut whole.new_cache(8, 3, 2, 0)).logits;

        // Rank 0 runs the step; the experts run on whichever shard holds them, one row at a time
        // for even experts and all rows at once for odd ones.
        let home = &shards[0];
        let mut cache = home.new_cache(8, 3, 2, 0);
        let mut acts = home.begin_step(&b, 8);
        let mut moe_layers = 0;
        while home.run_to_experts(&mut acts, &mut cache) {
            moe_layers += 1;
            let routed = home.routed(&acts).unwrap();
            let (h, layer, n_experts) = (routed.hidden, routed.layer, 8);
            let mut outputs: Vec<Vec<Vec<f32>>> = routed.routes.iter().map(|r| vec![Vec::new(); r.len()]).collect();
            for e in 0..n_experts {
                let owner = &shards[expert_owner(n_experts, e, ranks)];
                assert!(shards.iter().enumerate().all(|(r, s)| (r == expert_owner(n_experts, e, ranks))
                    == s.run_expert(layer, e, &routed.x[..h], 1).is_some()));
                let rows: Vec<(usize, usize)> = routed
                    .routes
                    .iter()
                    .enumerate()
                    .filter_map(|(r, route)| route.iter().position(|p| p.0 == e).map(|k| (r, k)))
                    .collect();
                if e % 2 == 0 {
                    for &(r, k) in &rows {
                        outputs[r][k] = owner.run_expert(layer, e, &routed.x[r * h..(r + 1) * h], 1).unwrap();
                    }
                } else if !rows.is_empty() {
                    let x: Vec<f32> = rows.iter().flat_map(|&(r, _)| routed.x[r * h..(r + 1) * h].to_vec()).collect();
                    let y = owner.run_expert(layer, e, &x, rows.len()).unwrap();
                    for (i, &(r, k)) in rows.iter().enumerate() {
                        outputs[r][k] = y[i * h..(i + 1) * h].to_vec();
                    }
                }
            }
            home.combine_experts(&mut acts, |r, k| &outputs[r][k]);
        }
        assert_eq!(moe_layers, whole.moe_layers().len(), "{name}");
        let got = home.finish_step(&b, acts).logits;
        assert!(got.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: logits differ");

        // Each shard holds its own range, and the shares add up to the whole.
        let bytes: Vec<usize> = shards.iter().map(Model::expert_bytes).collect();
        assert_eq!(bytes.iter().sum::<usize>(), whole.expert_bytes(), "{name}");
        assert_eq!(expert_range(8, 0, 3), 0..2);
        assert!(bytes[0] < bytes[1] && bytes[1] == bytes[2], "{name}: uneven split 2/3/3: {bytes:?}");
        assert!(whole.holds_every_expert() && !home.holds_every_expert());
    }
}
