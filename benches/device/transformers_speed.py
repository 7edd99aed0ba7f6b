"""transformers' prefill and decode speed on the GPU, the baseline of `kvflow bench speed`
(benches/device/speed.sh runs both in one device call).

    python3 transformers_speed.py CHECKPOINT OUT.json [--batch 64] [--prompt 256] [--steps 32]

For float32 and bfloat16: the checkpoint loaded with AutoModelForCausalLM in that dtype, a batch
of seeded prompts prefilled in one forward (median of three after a warm-up), then greedy decode
steps with the cache (four warm-up steps, then three timed rounds; the median round per step). Also torch.matmul's rate on two 8192²
matrices in each dtype (float32 without TF32): the matrix rates of the step's lower bound.
"""
import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

# timed rounds; each figure is their median
ROUNDS = 3


def synced():
    torch.cuda.synchronize()
    return time.perf_counter()


def matmul_tflops(dtype, n=8192, reps=20):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    t = synced()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (synced() - t) / 1e12


def forward(model, ids, past=None):
    # only the last position's logits, as kvflow computes them (where the model takes the argument)
    try:
        out = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
    except TypeError:
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
    return out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def speed(path, dtype, batch, prompt, steps):
    # the seeded spec's config names no special tokens, and KimiLinearConfig's defaults lie outside
    # a 32,000-token vocabulary: none are needed to time forwards
    config = AutoConfig.from_pretrained(path)
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).cuda().eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(3)).cuda()
    prefills = []
    for _ in range(ROUNDS + 1):  # the first is a warm-up
        t = synced()
        past, token = forward(model, ids)
        prefills.append(synced() - t)
    prefill_s = statistics.median(prefills[1:])
    for _ in range(4):
        past, token = forward(model, token, past)
    rounds = []
    for _ in range(ROUNDS):
        t = synced()
        for _ in range(steps):
            past, token = forward(model, token, past)
        rounds.append((synced() - t) * 1e3 / steps)
    decode_ms = statistics.median(rounds)
    del model, past
    torch.cuda.empty_cache()
    figures = {
        "prefill_tokens_per_s": batch * prompt / prefill_s,
        "decode_ms_per_step": decode_ms,
        "decode_tokens_per_s": batch * 1e3 / decode_ms,
        "decode_ms_per_step_rounds": rounds,
    }
    print(f"transformers {str(dtype):<15} prefill {figures['prefill_tokens_per_s']:.0f} tokens/s, "
          f"decode {decode_ms:.1f} ms/step = {figures['decode_tokens_per_s']:.0f} tokens/s "
          f"(batch {batch}, prompt {prompt}; median of {ROUNDS} rounds of {steps} steps: "
          f"{', '.join(f'{r:.1f}' for r in rounds)} ms)", flush=True)
    return figures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "matmul_tflops_float32": matmul_tflops(torch.float32),
        "matmul_tflops_bfloat16": matmul_tflops(torch.bfloat16),
    }
    print(f"matmul       float32 {result['matmul_tflops_float32']:.1f} TFLOP/s, "
          f"bfloat16 {result['matmul_tflops_bfloat16']:.1f} TFLOP/s", flush=True)
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        result[name] = speed(a.checkpoint, dtype, a.batch, a.prompt, a.steps)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
