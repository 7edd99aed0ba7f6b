"""transformers' own bfloat16-against-float32 gap on the tiny fixtures: the yardstick for
`kvflow bench device`'s bf16 agreement check (not yet wired in; see benches/results/h200.md).

    python3 transformers_bf16_gap.py FIXTURES_DIR OUT.json

For each fixture folder with an expected.json (or expected_cached.json): the checkpoint loaded with
AutoModelForCausalLM in float32 and in bfloat16 on the GPU; for each case, one forward without
cache over the prompt and its float32 greedy tokens (teacher-forced: both dtypes see the same
tokens), and the relative L2 error ‖bf16 − f32‖ / ‖f32‖ of the logits at every row kvflow compares
(the last prompt position, then after each greedy token). Writes {family: {"max": m, "rows":
[[errors per row] per case]}} and prints each family's largest and median error.
"""
import json
import os
import statistics
import sys

import torch
from transformers import AutoModelForCausalLM


def logits(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda"), use_cache=False)
    return out.logits[0].float()


def main():
    fixtures, out_path = sys.argv[1], sys.argv[2]
    result = {}
    for family in sorted(os.listdir(fixtures)):
        folder = os.path.join(fixtures, family)
        oracle = next(
            (os.path.join(folder, f) for f in ("expected_cached.json", "expected.json") if os.path.exists(os.path.join(folder, f))),
            None,
        )
        if oracle is None:
            continue
        cases = json.load(open(oracle))["cases"]
        models = {
            dtype: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
            for dtype in (torch.float32, torch.bfloat16)
        }
        rows = []
        for case in cases:
            prompt, greedy = case["prompt"], case["greedy"]
            ids = prompt + greedy[:-1]
            full, half = (logits(models[d], ids) for d in (torch.float32, torch.bfloat16))
            first = len(prompt) - 1
            errors = [
                float(torch.linalg.norm(half[r] - full[r]) / torch.linalg.norm(full[r])) for r in range(first, len(ids))
            ]
            rows.append(errors)
        flat = [e for r in rows for e in r]
        result[family] = {"max": max(flat), "rows": rows}
        print(f"bf16-gap     {family:<22} max {max(flat):.2e}, median {statistics.median(flat):.2e} over {len(flat)} rows")
        del models
        torch.cuda.empty_cache()
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main()
