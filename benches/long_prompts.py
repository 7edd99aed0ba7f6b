"""Writes a mooncake trace of REQUESTS prompts of TOKENS tokens, GAP_MS apart, each with blocks of
its own (no prefix is shared, every prompt is prefilled whole) and 8 output tokens — the
busy-producer workload of benches/busy-producer.sh and benches/streaming.sh. The first WARMUP
of them (default 0) are followed by a pause of PAUSE_MS (default 5000) before the next, so the
measured requests do not queue behind what the warmup ones paid for first launches.
    python3 benches/long_prompts.py PATH TOKENS REQUESTS GAP_MS [WARMUP] [PAUSE_MS]
"""
import json
import sys

path, tokens, requests, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 0
pause = int(sys.argv[6]) if len(sys.argv) > 6 else 5000
blocks = (tokens + 511) // 512  # a mooncake trace names one id per 512-token block
with open(path, "w") as f:
    for i in range(requests):
        ids = [100000 * (i + 1) + j for j in range(blocks)]
        f.write(json.dumps({"timestamp": i * gap + (pause if warmup and i >= warmup else 0), "input_length": tokens, "output_length": 8, "hash_ids": ids}) + "\n")
