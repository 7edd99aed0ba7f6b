"""Compares a real run with its simulation (benches/device/sim_fidelity.sh): the report's
figures side by side with their ratio (and the requests whose second token was handed on with
their first, within 0.1 ms: tokens a rank held back until a later step ended), then the steps of both step logs (`[report] steps`,
matched by pool, rank and launch order: step numbers count the pool's empty steps too, which
differ between the two clocks) by kind — each step's service time (its completion less the
later of its launch and the completion before it) and the host's gaps (a launch after the
completion before it) — so a mispriced kind of step shows.

    python3 sim_fidelity_compare.py REAL_REPORT_DIR SIM_REPORT_DIR
"""
import json
import statistics
import sys


def figures(real, sim):
    rows = [("TTFT p50 ms", "ttft_ms", "p50"), ("TTFT p99 ms", "ttft_ms", "p99"), ("TPOT p50 ms", "tpot_ms", "p50"),
            ("TPOT p99 ms", "tpot_ms", "p99"), ("e2e p50 ms", "e2e_ms", "p50"), ("queue p50 ms", "queue_ms", "p50"),
            ("queue p99 ms", "queue_ms", "p99"), ("output tokens/s", "output_tokens_per_s", None),
            ("completed", "completed", None)]
    print(f"{'figure':<18} {'real (cuda)':>12} {'simulated':>12} {'sim/real':>9}")
    for label, key, q in rows:
        r, s = real.get(key), sim.get(key)
        if q is not None:
            r, s = (r or {}).get(q), (s or {}).get(q)
        ratio = f"{s / r:.3f}" if isinstance(r, (int, float)) and isinstance(s, (int, float)) and r else "-"
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v if v is not None else "-")
        print(f"{label:<18} {fmt(r):>12} {fmt(s):>12} {ratio:>9}")
    # The offload tier's counts, when the graph has one.
    for label, key in [("saved chunks", "saved_chunks"), ("loads", "loads"), ("loaded chunks", "loaded_chunks"),
                       ("offload hit tokens", "offload_hit_tokens"), ("unsaved (limit)", "pending_limit_saves")]:
        r, s = (real.get("offload") or {}).get(key), (sim.get("offload") or {}).get(key)
        if r is None and s is None:
            continue
        ratio = f"{s / r:.3f}" if isinstance(r, (int, float)) and isinstance(s, (int, float)) and r else "-"
        print(f"{label:<18} {str(r):>12} {str(s):>12} {ratio:>9}")


def tokens_together(run_dir):
    """The measured requests whose second token was handed on within 0.1 ms of their first."""
    try:
        lines = open(f"{run_dir}/requests.jsonl").read().splitlines()
    except OSError:
        return None
    records = [json.loads(line) for line in lines]
    return sum(1 for r in records if not r.get("warmup") and r.get("second_token_ms") is not None
               and r["second_token_ms"] - r["ttft_ms"] < 0.1)


def steps(path):
    by_rank = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {}
    for line in lines:
        e = json.loads(line)
        by_rank.setdefault((e["pool"], e["rank"]), []).append(e)
    timed = {}
    for (pool, rank), entries in by_rank.items():
        entries.sort(key=lambda e: e["step"])
        before = None
        for n, e in enumerate(entries):
            if e["done_ms"] is None:
                continue
            start = e["launched_ms"] if before is None else max(e["launched_ms"], before)
            gap = 0.0 if before is None else max(0.0, e["launched_ms"] - before)
            timed[(pool, rank, n)] = (e, e["done_ms"] - start, gap)
            before = e["done_ms"]
    return timed


def kind(e):
    p, r = e["prefill_tokens"], e["decode_rows"]
    if p == 0:
        return f"decode rows {'1-4' if r <= 4 else '5-16' if r <= 16 else '17+'}"
    size = "<=256" if p <= 256 else "<=1024" if p <= 1024 else ">1024"
    prefix = e.get("prefill_prefix_positions", 0) / p
    return f"{'mixed' if r else 'prefill'} {size} tok, prefix {'<4k' if prefix < 4096 else '>=4k'}"


def compare_steps(real, sim):
    if not real or not sim:
        print("(no step logs to compare)")
        return
    kinds = {}
    shapes_differ = 0
    for key, (e, service, gap) in real.items():
        if key not in sim:
            continue
        s, s_service, s_gap = sim[key]
        if (s["prefill_tokens"], s["decode_rows"]) != (e["prefill_tokens"], e["decode_rows"]):
            shapes_differ += 1
        k = kinds.setdefault(kind(e), ([], [], [], []))
        k[0].append(service)
        k[1].append(s_service)
        k[2].append(gap)
        k[3].append(s_gap)
    print(f"steps matched: {sum(len(k[0]) for k in kinds.values())} (real {len(real)}, simulated {len(sim)}); "
          f"shapes differing: {shapes_differ}")
    print(f"{'kind':<34} {'steps':>6} {'real ms':>9} {'sim ms':>9} {'sim/real':>9} {'real gap':>9} {'sim gap':>9}")
    total = [0.0, 0.0]
    for name in sorted(kinds):
        r, s, rg, sg = kinds[name]
        total[0] += sum(r)
        total[1] += sum(s)
        mr, ms = statistics.mean(r), statistics.mean(s)
        print(f"{name:<34} {len(r):>6} {mr:>9.3f} {ms:>9.3f} {ms / mr if mr else 0:>9.3f} "
              f"{statistics.mean(rg):>9.3f} {statistics.mean(sg):>9.3f}")
    print(f"service time, all steps: real {total[0]:.0f} ms, simulated {total[1]:.0f} ms "
          f"({total[1] / total[0] if total[0] else 0:.3f})")


def main():
    real_dir, sim_dir = sys.argv[1:3]
    real, sim = (json.load(open(f"{d}/report.json")) for d in (real_dir, sim_dir))
    figures(real, sim)
    print(f"{'2nd token with 1st':<18} {str(tokens_together(real_dir)):>12} {str(tokens_together(sim_dir)):>12}")
    compare_steps(steps(f"{real_dir}/steps.jsonl"), steps(f"{sim_dir}/steps.jsonl"))


main()
