"""Writes a mooncake trace of REQUESTS prompts of TOKENS tokens, GAP_MS apart, each with blocks of
its own (no prefix is shared, every prompt is prefilled whole) and 8 output tokens — the
busy-producer workload of benches/busy-producer.sh and benches/streaming.sh.
    python3 benches/long_prompts.py PATH TOKENS REQUESTS GAP_MS
"""
import json
import sys

path, tokens, requests, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
blocks = (tokens + 511) // 512  # a mooncake trace names one id per 512-token block
with open(path, "w") as f:
    for i in range(requests):
        ids = [100000 * (i + 1) + j for j in range(blocks)]
        f.write(json.dumps({"timestamp": i * gap, "input_length": tokens, "output_length": 8, "hash_ids": ids}) + "\n")
