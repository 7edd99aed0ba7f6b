"""Long soak of `kvflow serve` (issue 39 §2): the tiny llama fixture on one CPU rank, 128-token
distinct prompts, 4 output tokens, 16 keep-alive clients; prints the server's VmRSS every 2,000
requests. usage: python3 tools/serve_soak.py REQUESTS [ENV_JSON]  (run from a scratch folder;
HEAP=1 runs the server under heaptrack and SIGKILLs it at the end, so what it still held shows as
leaked: `heaptrack_print -d A.zst B.zst` diffs two lengths). The CI-sized check is
tests/integration/soak.rs."""
import pathlib
import http.client, json, os, subprocess, sys, threading, time, re
ROOT = pathlib.Path(__file__).resolve().parent.parent
fixture = ROOT / "fixtures/hf/llama"
graph = f'''[model]
path = "{fixture}"

[memory]
budget_bytes = "4 MiB"

[scheduler]
max_running = 16

[[pool]]
name = "main"
role = "aggregated"
ranks = 1
executor = "cpu"

[serve]
max_requests = 64
max_context = 512
'''
open("g.toml","w").write(graph)
env = dict(os.environ); env.update(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
pre = ["heaptrack","-o","/tmp/soakx/hp"] if os.environ.get("HEAP") else []
p = subprocess.Popen(pre + [str(ROOT / "target/debug/kvflow"),"serve","g.toml","--port","0","--out","out"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
port=None
for line in p.stdout:
    m = re.search(r"listening on \S*?:(\d+)", line)
    if m: port=int(m.group(1)); break
threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
def rss():
  try: return int(re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{p.pid}/status").read()).group(1))
  except Exception: return -1
total=int(sys.argv[1]); nxt=[0]; lock=threading.Lock()
def prompt(n): return [3 + ((n*131 + i*7 + n//97) % 250) for i in range(128)]
def worker():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while True:
        with lock:
            n=nxt[0]; nxt[0]+=1
        if n>=total: return
        c.request("POST","/v1/completions",json.dumps({"prompt":prompt(n),"max_tokens":4}),{"Content-Type":"application/json"})
        r=c.getresponse(); r.read()
        assert r.status==200, r.status
ts=[threading.Thread(target=worker) for _ in range(16)]
[t.start() for t in ts]
last=-1
while any(t.is_alive() for t in ts):
    time.sleep(1)
    k=nxt[0]//2000
    if k!=last: last=k; print(f"{nxt[0]:6d} requests: VmRSS {rss()} kB", flush=True)
[t.join() for t in ts]
time.sleep(1); print(f"{total:6d} requests: VmRSS {rss()} kB (end)", flush=True)
if os.environ.get("HEAP"): subprocess.run(["pkill","-9","-f","kvflow serve g.toml"])
else: p.terminate()
p.wait()
