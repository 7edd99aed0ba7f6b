"""The anchors of `kvflow bench speed`: transformers and torch on the same GPU, checkpoint and
dtype, measured at each shape in the same device call (benches/device/speed.sh runs both).

    python3 transformers_speed.py CHECKPOINT OUT.json [--shapes 64x256,1x256,16x4096,1x32768]
        [--float32-shapes 64x256] [--steps 16] [--deadline-s 0] [--no-compiled] [--fla] [--dry-run]

Per shape (BATCHxPROMPT: batch × prompt tokens), in bfloat16:
  eager     transformers eager with its dynamic cache: a batch of seeded prompts prefilled in one
            forward (median of three after a warm-up; one round when the warm-up took over 2 s),
            then greedy decode steps (four warm-up steps, then three timed rounds of --steps; the
            median round per step);
  products  the decode step's weight products alone through torch (cuBLAS): every Linear weight
            of the model (and each expert's matrices, at batch × top-k / experts rows) times an
            activation of `batch` rows, all captured in ONE torch.cuda.graph and replayed;
  compiled  transformers with a StaticCache and the decode step under
            torch.compile(mode="reduce-overhead") (CUDA graphs), after enough warm-up steps that
            compiling and recording are not timed; a failure (kimi_linear, say) is recorded as the
            anchor's error;
  sdpa      prefill with attn_implementation="sdpa" (the eager run's own figure when its default
            attention is already sdpa);
and, at --float32-shapes, eager in float32. The compiled decode runs last: a crash while compiling
loses no other figure (a part that does not finish leaves an anchor saying so). Also torch.matmul's rate on two 8192² matrices in
each dtype (float32 without TF32): the matrix rates of the bounds.

--fla: only the KDA model (kimi_linear) through transformers eager with the flash-linear-attention
kernels (fla-core and flash-linear-attention 0.6.0, which must be importable: speed.sh puts them
on PYTHONPATH for this run only), added to the anchors already in OUT.json.

--deadline-s: seconds this run may take; a part that would not fit is recorded as skipped.
--dry-run: no torch: prints the plan and writes OUT.json with every anchor "not measured" (the
format `kvflow bench speed --baseline` reads; its tests use it).

OUT.json: {"transformers", "torch", "gpu", "matmul_tflops_float32", "matmul_tflops_bfloat16",
"shapes": {"64x256": {"bfloat16": [anchor, ...], "float32": [...]}}}, each anchor {"name", and
"prefill_tokens_per_s", "decode_ms_per_step", "note" where measured, or "error"}. It is rewritten
after every anchor, so a run cut short still leaves what it measured.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

# timed rounds; each figure is their median
ROUNDS = 3
# decode steps before the timed rounds: eager, and compiled (compile, record the graph, replay)
WARMUP_STEPS = 4
COMPILED_WARMUP_STEPS = 8
# a prefill whose warm-up took longer is timed in one round
LONG_PREFILL_S = 2.0
# about how long each part takes at most on the H200 (a part is skipped when less is left)
NEEDS_S = {"load": 15, "eager": 20, "products": 5, "compiled": 45, "sdpa": 15, "fla": 30}

torch = None  # imported in main, unless --dry-run
# where it runs: "cuda" on the device machine; "cpu" checks the script's transformers and torch
# calls without a GPU (the products run without a CUDA graph; the figures mean nothing)
DEVICE = "cuda"


def parse_shape(text):
    """BATCHxPROMPT -> (batch, prompt), both >= 1."""
    parts = text.strip().lower().replace("×", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected BATCHxPROMPT (say 64x256), got {text!r}")
    return int(parts[0]), int(parts[1])


def shape_list(text):
    return [parse_shape(s) for s in text.split(",") if s.strip()]


def key(shape):
    return f"{shape[0]}x{shape[1]}"


def anchor(name, prefill=None, decode=None, note=None, error=None):
    a = {"name": name}
    for k, v in [("prefill_tokens_per_s", prefill), ("decode_ms_per_step", decode), ("note", note), ("error", error)]:
        if v is not None:
            a[k] = v
    return a


class Results:
    """OUT.json, rewritten after every anchor (atomically)."""

    def __init__(self, path, header, merge=False):
        self.path = path
        self.data = {"shapes": {}}
        if merge:
            with open(path) as f:
                self.data = json.load(f)
        else:
            self.data.update(header)
        self.write()

    def add(self, shape, dtype, a, replace_last=False, provisional=False):
        """Appends `a` at `shape` in `dtype` (replacing the last anchor there: a provisional one,
        which is written but not printed)."""
        anchors = self.data["shapes"].setdefault(key(shape), {}).setdefault(dtype, [])
        if replace_last:
            anchors.pop()
        anchors.append(a)
        if provisional:
            return self.write()
        figures = ", ".join(
            f"{k} {a[k]:.2f}" for k in ("prefill_tokens_per_s", "decode_ms_per_step") if k in a
        ) or f"not measured: {a.get('error')}"
        print(f"anchor  {dtype:<8} {key(shape):<9} {a['name']}: {figures}"
              + (f" ({a['note']})" if "note" in a else ""), flush=True)
        self.write()

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


class Budget:
    """The run's deadline (0: none)."""

    def __init__(self, seconds):
        self.start = time.monotonic()
        self.seconds = seconds

    def left(self):
        return math.inf if self.seconds <= 0 else self.seconds - (time.monotonic() - self.start)

    def skip(self, part):
        """None when `part` fits in what is left, else why it is skipped."""
        if self.left() >= NEEDS_S[part]:
            return None
        return f"skipped: {max(self.left(), 0):.0f} s of the --deadline-s budget left, {part} needs about {NEEDS_S[part]} s"


def error_text(e):
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:400]


# ---------------------------------------------------------------------------- measuring (torch)

def synced():
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def matmul_tflops(dtype, n=8192, reps=20):
    if DEVICE != "cuda":
        n, reps = 256, 2
    a = torch.randn(n, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, n, device=DEVICE, dtype=dtype)
    for _ in range(3):
        a @ b
    t = synced()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (synced() - t) / 1e12


def load(path, dtype, attn=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    # the seeded spec's config names no special tokens, and KimiLinearConfig's defaults lie outside
    # a 32,000-token vocabulary: none are needed to time forwards
    config = AutoConfig.from_pretrained(path)
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None
    extra = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, **extra).to(DEVICE).eval()


def attention_of(model):
    return getattr(model.config, "_attn_implementation", None) or "default"


def kda_kernels(model):
    """For kimi_linear: whether transformers bound the fla kernels or its torch reference (decided
    when transformers imported the model's module); None for other models."""
    if model.config.model_type != "kimi_linear":
        return None
    fn = getattr(sys.modules.get(type(model).__module__), "chunk_kimi_delta_attention", None)
    try:
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
        impl = cells["implementation"]
        return f"fla ({impl.__module__})" if cells["is_new_implementation"] else "torch reference"
    except Exception:  # another transformers version's wrapper
        return "unknown"


def prompts(vocab, batch, prompt):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (batch, prompt), generator=g).to(DEVICE)


def forward(model, ids, past=None):
    # only the last position's logits, as kvflow computes them (where the model takes the argument)
    try:
        out = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
    except TypeError:
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
    return out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


def timed_prefills(model, ids):
    """Prefill seconds (median of ROUNDS after a warm-up, one round for a long prefill), the last
    prefill's cache and token, and how it was timed."""
    t = synced()
    past, token = forward(model, ids)
    warmup = synced() - t
    rounds = 1 if warmup > LONG_PREFILL_S else ROUNDS
    times = []
    for _ in range(rounds):
        del past
        t = synced()
        past, token = forward(model, ids)
        times.append(synced() - t)
    how = f"median of {rounds} after a warm-up" if rounds > 1 else f"1 round after a {warmup:.1f} s warm-up"
    return statistics.median(times), past, token, how


def eager(model, shape, steps, name=None):
    """Prefill and decode through transformers' forward with its dynamic cache."""
    batch, prompt = shape
    ids = prompts(model.config.vocab_size, batch, prompt)
    prefill_s, past, token, how = timed_prefills(model, ids)
    for _ in range(WARMUP_STEPS):
        past, token = forward(model, token, past)
    rounds = []
    for _ in range(ROUNDS):
        t = synced()
        for _ in range(steps):
            past, token = forward(model, token, past)
        rounds.append((synced() - t) * 1e3 / steps)
    del past
    torch.cuda.empty_cache()
    start = prompt + 1 + WARMUP_STEPS
    note = (f"prefill {how}; decode at context {start}..{start + ROUNDS * steps}, median of {ROUNDS} rounds of "
            f"{steps} steps: {', '.join(f'{r:.2f}' for r in rounds)} ms")
    kernels = kda_kernels(model)
    if kernels:
        note += f"; KDA through {kernels}"
    name = name or f"transformers eager, dynamic cache (attention {attention_of(model)})"
    return anchor(name, prefill=batch * prompt / prefill_s, decode=statistics.median(rounds), note=note)


def sdpa_prefill(model, shape):
    batch, prompt = shape
    prefill_s, past, _, how = timed_prefills(model, prompts(model.config.vocab_size, batch, prompt))
    del past
    torch.cuda.empty_cache()
    return anchor("transformers prefill, attn_implementation=sdpa", prefill=batch * prompt / prefill_s, note=how)


def step_products(model, batch):
    """(weight [out, in], activation rows) of every product a decode step of `batch` rows makes:
    each Linear weight once (a tied LM head is the embedding's storage), and each expert's
    matrices of a 3-D experts parameter at ceil(batch × top-k / experts) rows."""
    seen, products = set(), []
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            products.append((module.weight, batch))
    c = model.config
    top_k = getattr(c, "num_experts_per_token", None) or getattr(c, "num_experts_per_tok", None) or 1
    for name, p in model.named_parameters():
        if p.dim() == 3 and "experts" in name:
            rows = max(1, math.ceil(batch * top_k / p.shape[0]))
            products.extend((p[e], rows) for e in range(p.shape[0]))
    return products


def products(model, shape):
    """The step's weight products alone, captured in one CUDA graph and replayed."""
    batch = shape[0]
    mats = step_products(model, batch)
    acts, work = {}, []
    for w, rows in mats:
        x = acts.get((rows, w.shape[1]))
        if x is None:
            x = acts[(rows, w.shape[1])] = torch.randn(rows, w.shape[1], device=DEVICE, dtype=w.dtype)
        work.append((x, w, torch.empty(rows, w.shape[0], device=DEVICE, dtype=w.dtype)))

    def run():
        for x, w, out in work:
            torch.mm(x, w.t(), out=out)

    replay = run  # on the cpu (a check of the script): the products one by one
    if DEVICE == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graph asks
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        replay = graph.replay
    for _ in range(3):
        replay()
    reps, rounds = 20, []
    for _ in range(ROUNDS):
        t = synced()
        for _ in range(reps):
            replay()
        rounds.append((synced() - t) * 1e3 / reps)
    weight_bytes = sum(w.numel() * w.element_size() for w, _ in mats)
    del replay, work, acts
    torch.cuda.empty_cache()
    return anchor("the step's weight products alone through torch (cuBLAS, one CUDA graph)",
                  decode=statistics.median(rounds),
                  note=f"{len(mats)} products, {weight_bytes / 1e9:.2f} GB of weights, median of {ROUNDS} rounds "
                       f"of {reps} replays")


def decode_one(model, token, position, cache):
    out = model(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True)


COMPILED = None  # torch.compile(decode_one, ...), made once: a new shape recompiles it


def compiled(model, shape, steps):
    """Decode with a StaticCache, the step under torch.compile(mode="reduce-overhead")."""
    global COMPILED
    from transformers import StaticCache

    batch, prompt = shape
    name = NAMES["compiled"]
    try:
        cache = StaticCache(config=model.config, max_cache_len=prompt + COMPILED_WARMUP_STEPS + ROUNDS * steps + 2)
        ids = prompts(model.config.vocab_size, batch, prompt)
        out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt, device=DEVICE),
                    use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        if COMPILED is None:
            COMPILED = torch.compile(decode_one, mode="reduce-overhead", dynamic=False)
        position = torch.tensor([prompt], device=DEVICE)

        def step(token):
            torch.compiler.cudagraph_mark_step_begin()
            token = COMPILED(model, token, position, cache).clone()
            position.add_(1)
            return token

        from torch._dynamo.utils import counters

        skips_before = counters["inductor"]["cudagraph_skips"]
        t = synced()
        for _ in range(COMPILED_WARMUP_STEPS):  # compiles, records the CUDA graph, replays
            token = step(token)
        warmup_s = synced() - t
        rounds = []
        for _ in range(ROUNDS):
            t = synced()
            for _ in range(steps):
                token = step(token)
            rounds.append((synced() - t) * 1e3 / steps)
        start = prompt + 1 + COMPILED_WARMUP_STEPS
        # a step inductor would not put in a CUDA graph is not the anchor meant: said beside it
        skips = counters["inductor"]["cudagraph_skips"] - skips_before
        graphs = "CUDA graphs" if skips == 0 else f"CUDA graphs SKIPPED {skips} times (see the raw output)"
        note = (f"{graphs}; {COMPILED_WARMUP_STEPS} warm-up steps took {warmup_s:.1f} s (compiling); decode at context "
                f"{start}..{start + ROUNDS * steps}, median of {ROUNDS} rounds of {steps} steps: "
                f"{', '.join(f'{r:.2f}' for r in rounds)} ms")
        return anchor(name, decode=statistics.median(rounds), note=note)
    except Exception as e:  # compile or capture failed for this model: recorded, the run goes on
        print(f"compiled decode failed at {key(shape)}: {error_text(e)}", flush=True)
        torch._dynamo.reset()
        COMPILED = None
        return anchor(name, error=f"torch.compile failed: {error_text(e)}")
    finally:
        cache = None
        torch.cuda.empty_cache()


NAMES = {"eager": "transformers eager, dynamic cache", "products": "the step's weight products alone",
         "compiled": "transformers static cache, decode step torch.compile(mode=reduce-overhead)", "sdpa": "transformers prefill, sdpa",
         "fla": "transformers eager with the flash-linear-attention kernels"}


def measured(results, shape, dtype, budget, part, run):
    """Adds `run()`'s anchor (or why it measured nothing) at `shape` in `dtype`. While it runs,
    OUT.json holds a provisional anchor saying it did not finish: what is left when the process
    is cut by speed.sh's budget or dies (a crash while compiling, say)."""
    why = budget.skip(part)
    if why is not None:
        return results.add(shape, dtype, anchor(NAMES[part], error=why))
    results.add(shape, dtype, anchor(NAMES[part], error="did not finish: the process ended while it ran "
                                                         "(cut by the time budget, or crashed: see the raw output)"), provisional=True)
    try:
        a = run()
    except Exception as e:
        a = anchor(NAMES[part], error=error_text(e))
        torch.cuda.empty_cache()
    results.add(shape, dtype, a, replace_last=True)


def run_all(a, shapes, results, budget):
    """Every anchor of every shape: in bfloat16 eager and products at each shape, then SDPA
    prefill; float32 eager; last the compiled decode at each shape (the longest part, and the one
    that can take the process down)."""
    bf16 = load(a.checkpoint, torch.bfloat16)
    print(f"loaded {a.checkpoint} in bfloat16: attention {attention_of(bf16)}"
          + (f", KDA through {kda_kernels(bf16)}" if kda_kernels(bf16) else ""), flush=True)
    for shape in shapes:
        measured(results, shape, "bfloat16", budget, "eager", lambda: eager(bf16, shape, a.steps))
        measured(results, shape, "bfloat16", budget, "products", lambda: products(bf16, shape))
    if attention_of(bf16) == "sdpa":
        for shape in shapes:
            for e in list(results.data["shapes"].get(key(shape), {}).get("bfloat16", [])):
                if e["name"].startswith("transformers eager") and "prefill_tokens_per_s" in e:
                    results.add(shape, "bfloat16", anchor("transformers prefill, attn_implementation=sdpa",
                                                          prefill=e["prefill_tokens_per_s"],
                                                          note="the eager run's: its default attention is sdpa"))
    elif budget.skip("load") is None:
        sdpa = load(a.checkpoint, torch.bfloat16, attn="sdpa")
        for shape in shapes:
            measured(results, shape, "bfloat16", budget, "sdpa", lambda: sdpa_prefill(sdpa, shape))
        del sdpa
        torch.cuda.empty_cache()
    if a.float32_shapes and budget.skip("load") is None:
        f32 = load(a.checkpoint, torch.float32)
        for shape in a.float32_shapes:
            measured(results, shape, "float32", budget, "eager", lambda: eager(f32, shape, a.steps))
        del f32
        torch.cuda.empty_cache()
    for shape in shapes:
        if a.no_compiled:
            results.add(shape, "bfloat16", anchor(NAMES["compiled"], error="skipped (--no-compiled)"))
        else:
            measured(results, shape, "bfloat16", budget, "compiled", lambda: compiled(bf16, shape, a.steps))


def run_fla(a, shapes, results, budget):
    """transformers eager on the KDA model with the flash-linear-attention kernels bound."""
    name = "transformers eager with the flash-linear-attention 0.6.0 kernels"
    try:  # what transformers' kimi_linear binds, imported here first so a failure is named
        import fla
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: F401

        print(f"flash-linear-attention {getattr(fla, '__version__', '?')} from {os.path.dirname(fla.__file__)}",
              flush=True)
    except Exception as e:
        for shape in shapes:
            results.add(shape, "bfloat16", anchor(name, error=f"fla not importable: {error_text(e)}"))
        return
    model = load(a.checkpoint, torch.bfloat16)
    kernels = kda_kernels(model)
    for shape in shapes:
        # "unknown" (a wrapper this script cannot read) is measured: its note says the binding
        if kernels == "torch reference" or kernels is None:
            results.add(shape, "bfloat16", anchor(name, error=f"transformers bound the KDA kernels of {kernels}"))
        else:
            measured(results, shape, "bfloat16", budget, "fla", lambda: eager(model, shape, a.steps, name=name))


def dry_run(a, shapes):
    """The plan, and OUT.json in its format with nothing measured."""
    results = Results(a.out, {"transformers": "dry run", "torch": "dry run", "gpu": "none",
                              "matmul_tflops_float32": None, "matmul_tflops_bfloat16": None}, merge=a.fla)
    parts = ["fla"] if a.fla else ["eager", "products"] + ([] if a.no_compiled else ["compiled"]) + ["sdpa"]
    for part in parts:
        for shape in shapes:
            print(f"plan: {part} at {key(shape)} in bfloat16 (about {NEEDS_S[part]} s at most)")
            results.add(shape, "bfloat16", anchor(f"{part} (dry run)", error="dry run: nothing measured"))
    for shape in [] if a.fla else a.float32_shapes:
        print(f"plan: eager at {key(shape)} in float32")
        results.add(shape, "float32", anchor("eager (dry run)", error="dry run: nothing measured"))


def main():
    global torch, DEVICE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--shapes", type=shape_list, default=shape_list("64x256"),
                   help="BATCHxPROMPT,... measured in bfloat16")
    p.add_argument("--float32-shapes", type=shape_list, default=shape_list("64x256"),
                   help="BATCHxPROMPT,... also measured eager in float32 ('' for none)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    p.add_argument("--deadline-s", type=float, default=0, help="seconds this run may take (0: no limit)")
    p.add_argument("--no-compiled", action="store_true", help="skip the compiled decode (the longest part)")
    p.add_argument("--fla", action="store_true", help="only the flash-linear-attention anchor, added to OUT.json")
    p.add_argument("--dry-run", action="store_true", help="no torch: the plan, and OUT.json with nothing measured")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script's calls on a machine without a GPU (tiny models; no figure)")
    a = p.parse_args()
    if a.steps < 1:
        p.error("--steps must be >= 1")
    if a.fla and not os.path.exists(a.out):
        p.error(f"--fla adds to {a.out}, which does not exist: run without --fla first")
    if a.dry_run:
        return dry_run(a, a.shapes)
    budget = Budget(a.deadline_s)
    DEVICE = a.device
    import torch as imported
    import transformers

    torch = imported
    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for limit in ("recompile_limit", "cache_size_limit"):  # one compile per shape
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    if a.fla:
        results = Results(a.out, {}, merge=True)
        return run_fla(a, a.shapes, results, budget)
    header = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (a check of the script)",
        "checkpoint": a.checkpoint,
        "matmul_tflops_float32": matmul_tflops(torch.float32),
        "matmul_tflops_bfloat16": matmul_tflops(torch.bfloat16),
    }
    print(f"matmul       float32 {header['matmul_tflops_float32']:.1f} TFLOP/s, "
          f"bfloat16 {header['matmul_tflops_bfloat16']:.1f} TFLOP/s [transformers {transformers.__version__}, "
          f"torch {torch.__version__}]", flush=True)
    run_all(a, a.shapes, Results(a.out, header), budget)


if __name__ == "__main__":
    main()
