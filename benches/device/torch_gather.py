"""PyTorch's index_select gather of the pack bench's 16-token blocks (the block list that
`kvflow bench device --blocks-out` wrote), beside a plain copy of the same bytes, timed with CUDA
events (median of 5 rounds of 50). The default bench model's KV: 8 layers of rows of 512 f32."""
import sys
import torch

LAYERS, WIDTH, BS = 8, 512, 16
blocks = [int(line) for line in open(sys.argv[1]) if line.strip()]
pool = 4 * len(blocks)
dev = torch.device("cuda")
cache = [torch.rand(pool, BS * WIDTH, device=dev) for _ in range(LAYERS)]
idx = torch.tensor(blocks, device=dev, dtype=torch.long)
out = [torch.empty(len(blocks), BS * WIDTH, device=dev) for _ in range(LAYERS)]
src = torch.rand(LAYERS * len(blocks) * BS * WIDTH, device=dev)
dst = torch.empty_like(src)
nbytes = src.numel() * 4


def timed(f, reps=50):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        f()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def gather():
    for layer in range(LAYERS):
        torch.index_select(cache[layer], 0, idx, out=out[layer])


gather()
assert all(torch.equal(out[l], cache[l][idx]) for l in range(LAYERS))
g, c = [], []
for _ in range(5):
    c.append(timed(lambda: dst.copy_(src)))
    g.append(timed(gather))
g.sort()
c.sort()
gb = lambda t: 2 * nbytes / t / 1e9
print(f"torch        index_select {gb(g[2]):.0f} GB/s, copy {gb(c[2]):.0f} GB/s (read + write), "
      f"index_select_ratio={gb(g[2]) / gb(c[2]):.3f}  [torch {torch.__version__}]")
