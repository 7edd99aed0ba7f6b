//! `kvflow bench calibrate` on the emulated GPU (the cuda kernels run on the CPU): every part of
//! the step table is measured, every grid point taking its turn on one executor, and a simulated
//! run prices its steps from the table it wrote.

use crate::asynchronous::pool;
use crate::common::{fixture, report_in};
use crate::runtime::{kvflow_heavy, write_graph_with};
use crate::simulation::run_ok;
use serde_json::Value;

/// Every number of a table's part (nested lists flattened).
fn numbers(v: &Value) -> Vec<f64> {
    match v {
        Value::Number(n) => n.as_f64().into_iter().collect(),
        Value::Array(a) => a.iter().flat_map(numbers).collect(),
        Value::Object(o) => o.values().flat_map(numbers).collect(),
        _ => vec![],
    }
}

#[test]
fn calibrate_measures_every_part_of_the_table_and_a_simulated_run_prices_its_steps_by_it() {
    // llama keeps KV blocks; kimi_linear keeps blocks and recurrent state slots, which each grid
    // point's sequences take over from the one before on the same executor.
    for model in ["hf/llama", "hf/kimi_linear"] {
        let dir = tempfile::tempdir().unwrap();
        let table = dir.path().join("table.json");
        let grid = ["--prefill", "8,16", "--prefix", "0,16", "--prompts", "1,2", "--rows", "1,2", "--context", "16,32"];
        let grid = [&grid[..], &["--idle-gaps", "0,3"]].concat();
        let mut args = vec!["bench", "calibrate", "--emulate", "--dtype", "float32", "--steps", "1"];
        let (model_dir, out) = (fixture(model).display().to_string(), table.display().to_string());
        args.extend(["--model", &model_dir, "--out", &out]);
        args.extend(grid);
        let run = kvflow_heavy(&args);
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{model}: {}{stdout}", String::from_utf8_lossy(&run.stderr));
        let t: Value = serde_json::from_str(&std::fs::read_to_string(&table).unwrap()).unwrap();
        for (part, points) in
            [("decode_seconds", 4), ("decode_launch_seconds", 4), ("prefill_seconds", 4), ("prefill_launch_seconds", 4)]
        {
            let got = numbers(&t[part]);
            assert_eq!(got.len(), points, "{model}: {part} in {t}");
            assert!(got.iter().all(|s| s.is_finite() && *s > 0.0), "{model}: {part} measured nothing: {got:?}");
        }
        assert_eq!(numbers(&t["prefill_split"]["seconds"]).len(), 4, "{model}: {t}");
        assert_eq!(numbers(&t["engine"]["seconds"]).len(), 2, "{model}: {t}");
        assert_eq!(numbers(&t["idle"]["gap_us"]), [0.0, 3000.0], "{model}: the gaps asked for: {t}");
        assert_eq!(numbers(&t["idle"]["extra_seconds"]).len(), 2, "{model}: {t}");
        assert!(t["save_reads"]["read_bytes_per_s"].as_f64().unwrap() > 0.0, "{model}: {t}");
        let store = &t["store"];
        assert!(store["save_bytes_per_s"].as_f64().unwrap() > 0.0 && store["load_bytes_per_s"].as_f64().unwrap() > 0.0);
        assert_eq!(store["chunk_tokens"], 256, "{model}: {t}");

        // The sim executor reads the table it wrote.
        let settings = format!("table = {:?}", table.display().to_string());
        let workload = "mode = \"concurrency\"\nconcurrency = 2\nlimit = 6";
        let pools = format!("{}\n", pool(1, "sim", &settings));
        let g = write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", workload, "64 MiB", &pools);
        run_ok(&g, &[]);
        let r = report_in(&dir.path().join("out"));
        assert_eq!(r["completed"], 6, "{model}: {r}");
        let tpot = r["tpot_ms"]["p50"].as_f64().unwrap();
        assert!(tpot.is_finite() && tpot > 0.0, "{model}: the table's steps take time: TPOT {tpot} ms");
    }
}

#[test]
fn calibrate_refuses_a_grid_it_cannot_measure_by_its_flag() {
    let model = fixture("hf/llama").display().to_string();
    for (flag, value) in [("--idle-gaps", "5,10"), ("--prompts", "2,4"), ("--prefill", "64,16")] {
        let out = crate::common::kvflow(&["bench", "calibrate", "--emulate", "--model", &model, flag, value]);
        crate::common::assert_clean_failure(&out, &[flag]);
    }
}
