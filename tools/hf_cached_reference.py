#!/usr/bin/env python3
"""Reference outputs from transformers' *cached* generation path, for a fixture folder.

The fixtures' expected.json were made by a full forward over the whole sequence at every step
(no cache). For DeepSeek-V3.2 that differs from what any cached decoder computes, transformers'
own cached path included: the indexer's top-k breaks ties (ReLU makes many index scores exactly 0)
by torch's CPU nth_element over the row, and a full recompute re-ranks every earlier row in a
longer, differently padded row. A serving engine keeps its KV, so its reference is the cached
path: prefill the prompt in one forward, then feed one token at a time with past_key_values.

usage: hf_cached_reference.py FIXTURE_DIR OUT.json [--new-tokens N]
Writes the expected.json format (greedy, last_logits, decode_logits[8], greedy_gaps) for the
prompts of FIXTURE_DIR/expected.json, with "reference": "transformers cached generation".
Needs torch and transformers 5.17.0 (CPU is enough).
"""
import argparse, json, sys

import torch
import transformers
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fixture")
    ap.add_argument("out")
    ap.add_argument("--new-tokens", type=int, default=None)
    args = ap.parse_args()
    exp = json.load(open(f"{args.fixture}/expected.json"))
    n_new = args.new_tokens or len(exp["cases"][0]["greedy"])
    model = AutoModelForCausalLM.from_pretrained(args.fixture, dtype=torch.float32).eval()
    cases = []
    with torch.no_grad():
        for case in exp["cases"]:
            ids = torch.tensor([case["prompt"]])
            out = model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            last = logits.tolist()
            greedy, gaps, decode = [], [], []
            for step in range(n_new):
                top2 = torch.topk(logits, 2).values
                gaps.append(float(top2[0] - top2[1]))
                tok = int(torch.argmax(logits))
                greedy.append(tok)
                if step + 1 == n_new:
                    break
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                if len(decode) < 8:
                    decode.append(logits.tolist())
            cases.append({"prompt": case["prompt"], "greedy": greedy, "last_logits": last,
                          "decode_logits": decode, "greedy_gaps": gaps})
            print(f"prompt {len(case['prompt'])} tokens: greedy[:8]={greedy[:8]} min gap {min(gaps):.2e}", flush=True)
    json.dump({"model_type": exp["model_type"], "transformers": transformers.__version__, "torch": torch.__version__,
               "dtype": "float32", "reference": "transformers cached generation (prefill, then one token at a time)",
               "min_greedy_gap": min(min(c["greedy_gaps"]) for c in cases), "cases": cases}, open(args.out, "w"))


if __name__ == "__main__":
    sys.exit(main())
