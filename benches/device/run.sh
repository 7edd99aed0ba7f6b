#!/usr/bin/env bash
# The CUDA executor's checks and benchmarks in one call on the device machine (see
# benches/README.md): `bash benches/device/prepare.sh` here (builds the release binary into
# .device-bin/, listed in .git/info/exclude), then through the device tool, carrying .device-bin:
#     bash benches/device/run.sh
# It runs `kvflow bench device` (parity with expected.json and the CPU executor, batch invariance,
# pack/unpack against a device-to-device copy, decode with deferred output on and off), PyTorch's
# index_select gather of the same blocks against its own copy, and `--verify` on an aggregated
# and a P/D graph with executor = "cuda" for each fixture the cuda executor runs (greedy, then
# drawing with a temperature; and in bf16 for those whose attention takes the tensor cores), then
# the offload tier with cuda ranks. Raw output
# goes to $OUT/device-run.txt (or ./device-run.txt). Exits non-zero when any check fails.
# The whole took 568 s on the H200 before the bf16 graphs were added: RUN_PARTS picks parts for
# calls of their own (default "checks verify sampled spec mtp experts specbench bf16 offload"), e.g. RUN_PARTS="checks bf16" then
# RUN_PARTS="verify offload".
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.}/device-run.txt"
source benches/device/binaries.sh
bin=.device-bin/kvflow
if [ ! -x "$bin" ]; then echo "no $bin: run benches/device/prepare.sh first and carry .device-bin" >&2; exit 2; fi
status=0
parts=" ${RUN_PARTS:-checks verify sampled spec mtp experts specbench bf16 offload} "
part() { case "$parts" in *" $1 "*) return 0 ;; *) echo "== (part $1 skipped: RUN_PARTS=${RUN_PARTS:-})"; return 1 ;; esac; }
exec > >(tee "$out") 2>&1
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! ldconfig -p | grep -q libcuda.so; then echo "no libcuda.so on this machine"; fi
if part checks; then
echo "== kvflow bench device"
"$bin" bench device --fixtures fixtures/hf --blocks-out /tmp/pack-blocks.txt || status=1
echo "== PyTorch index_select of the same 16-token blocks vs its own copy"
python3 benches/device/torch_gather.py /tmp/pack-blocks.txt || status=1
fi
part verify && for model in llama qwen3 deepseek_v3 deepseek_v32 qwen3_next_gdn qwen3_next kimi_linear; do
    for graph in cuda-aggregated pd-1p1d; do
      g=/tmp/$graph-$model.toml
      sed -e "s#fixtures/hf/llama#fixtures/hf/$model#" -e 's/^executor = "cpu"/executor = "cuda"/' \
          -e "s#out/$graph#out/$graph-$model#" "graphs/$graph.toml" > "$g"
      # the graph's relative paths are resolved from its folder
      cp "$g" "graphs/.$graph-$model.toml"
      echo "== kvflow run $graph ($model, executor = cuda) --verify"
      "$bin" run "graphs/.$graph-$model.toml" --verify 2>&1 | tail -n 25 || status=1
      rm -f "graphs/.$graph-$model.toml"
    done
done
# seeded sampling on the device (sample_drawn): the same graphs drawing at temperature 0.8 with
# top-p 0.9, exact against the cuda plain path drawing with the same keys
part sampled && for model in llama qwen3 deepseek_v3 deepseek_v32 qwen3_next_gdn qwen3_next kimi_linear; do
    for graph in cuda-aggregated pd-1p1d; do
      sed -e "s#fixtures/hf/llama#fixtures/hf/$model#" -e 's/^executor = "cpu"/executor = "cuda"/' \
          -e "s#out/$graph#out/$graph-$model-sampled#" "graphs/$graph.toml" > "graphs/.$graph-$model-sampled.toml"
      printf '\n[sampling]\ntemperature = 0.8\ntop_p = 0.9\nseed = 7\n' >> "graphs/.$graph-$model-sampled.toml"
      echo "== kvflow run $graph ($model, executor = cuda, temperature 0.8, top-p 0.9) --verify"
      "$bin" run "graphs/.$graph-$model-sampled.toml" --verify 2>&1 | tail -n 25 || status=1
      rm -f "graphs/.$graph-$model-sampled.toml"
    done
done
# n-gram drafting on cuda pools (the drafts scored and checked on the device; a rejected draft
# rolls recurrent state back on the device), every family, aggregated and 1P1D (inproc, and tcp:
# the KV streamed out of the producer's device memory a layer at a time and landed in the
# consumer's piece by piece), greedy: exact against the cuda plain path
part spec && for model in llama qwen3 deepseek_v3 deepseek_v32 qwen3_next qwen3_next_gdn kimi_linear; do
    for graph in spec pd-1p1d pd-1p1d-tcp; do
      sed -e "s#fixtures/hf/llama#fixtures/hf/$model#" -e 's/^executor = "cpu"/executor = "cuda"/' \
          -e "s#out/$graph#out/$graph-$model-cuda#" "graphs/$graph.toml" > "graphs/.$graph-$model-cuda.toml"
      grep -q '^\[speculative\]' "graphs/.$graph-$model-cuda.toml" ||
        printf '\n[speculative]\ndrafter = "ngram"\ndraft_tokens = 4\n' >> "graphs/.$graph-$model-cuda.toml"
      echo "== kvflow run $graph ($model, executor = cuda, n-gram drafting) --verify"
      "$bin" run "graphs/.$graph-$model-cuda.toml" --verify 2>&1 | tail -n 25 || status=1
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('spec', json.dumps(r['spec'])); \
print('landed_on_device', r['handoff'].get('landed_on_device'), 'of', r['completed'], 'completed')" \
          "out/$graph-$model-cuda/report.json" 2>/dev/null || true
      rm -f "graphs/.$graph-$model-cuda.toml"
    done
done
# expert parallelism on cuda ranks of one GPU (each rank holds its share of the experts; routed
# rows and expert results move device to device on the receiver's stream after the sender's
# event): the MoE families on 2, 4 and 8 ranks, aggregated and 1P1D, greedy, exact against the
# cuda plain path; then the seed's regression configuration with n-gram drafting (8 + 8 ranks)
if part experts; then
    # (EP_MODELS, EP_RANKS: a part of the sweep per device call)
    for model in ${EP_MODELS:-deepseek_v3 deepseek_v32 qwen3_next kimi_linear}; do
        for ranks in ${EP_RANKS:-2 4 8}; do
            for graph in cuda-aggregated pd-1p1d; do
                g="graphs/.$graph-$model-ep$ranks.toml"
                sed -e "s#fixtures/hf/llama#fixtures/hf/$model#" -e 's/^executor = "cpu"/executor = "cuda"/' \
                    -e "s/^ranks = .*/ranks = $ranks\nexpert_parallel = true/" \
                    -e "s#out/$graph\"#out/$graph-$model-ep$ranks\"#" "graphs/$graph.toml" > "$g"
                echo "== kvflow run $graph ($model, executor = cuda, expert_parallel on $ranks ranks) --verify"
                "$bin" run "$g" --verify 2>&1 | tail -n 12 || status=1
                python3 -c "import json,sys; r=json.load(open(sys.argv[1])); \
[print('rank', s['pool'], s['rank'], 'expert_bytes', s['expert_bytes'], 'exchange_bytes', s['exchange_bytes'], \
'exchange_host_bytes', s['exchange_host_bytes']) for s in r['rank_stats']]" \
                    "out/$graph-$model-ep$ranks/report.json" 2>/dev/null || true
                rm -f "$g"
            done
        done
    done
    if [ "${EP_REGRESS:-1}" = 1 ]; then
        sed -e 's/^executor = "cpu"/executor = "cuda"/' -e 's#out/regress-1p1d-dpa8-spec"#out/regress-1p1d-dpa8-spec-cuda"#' \
            graphs/regress-1p1d-dpa8-spec.toml > graphs/.regress-1p1d-dpa8-spec-cuda.toml
        echo "== kvflow run regress-1p1d-dpa8-spec (kimi_linear, executor = cuda, 8 + 8 expert-parallel ranks) --verify"
        "$bin" run graphs/.regress-1p1d-dpa8-spec-cuda.toml --verify 2>&1 | tail -n 25 || status=1
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('completed', r['completed'], 'spec', json.dumps(r['spec'])); \
    [print('rank', s['pool'], s['rank'], 'expert_bytes', s['expert_bytes'], 'exchange_bytes', s['exchange_bytes'], \
    'exchange_host_bytes', s['exchange_host_bytes']) for s in r['rank_stats']]" \
            out/regress-1p1d-dpa8-spec-cuda/report.json 2>/dev/null || true
        rm -f graphs/.regress-1p1d-dpa8-spec-cuda.toml
    fi
fi
# the MTP drafter on cuda pools (its layer's passes on the device after each step), on the seeded
# DeepSeek-V3 of benches/specs/deepseek_mtp.toml: graphs/spec.toml with drafter = "mtp"
# (aggregated), graphs/spec-mtp.toml without expert parallelism (1P1D over inproc: the producer's
# drafts from T0 handed off) and as it is (2 + 2 expert-parallel ranks: the draft passes are
# exchanges of the MTP layer's experts every rank joins), greedy, exact against the cuda plain path
if part mtp; then
    [ -f /tmp/deepseek-mtp/model.safetensors ] ||
        "$bin" seed-checkpoint benches/specs/deepseek_mtp.toml /tmp/deepseek-mtp || status=1
    sed -e 's#"../fixtures/hf/llama"#"/tmp/deepseek-mtp"#' -e 's/^executor = "cpu"/executor = "cuda"/' \
        -e 's/"ngram"/"mtp"/' -e 's#out/spec"#out/spec-mtp-aggregated-cuda"#' graphs/spec.toml > graphs/.spec-mtp-aggregated-cuda.toml
    sed -e 's#^path = .*#path = "/tmp/deepseek-mtp"#' -e '/^expert_parallel = true/d' \
        -e 's/^\(role = .*\)$/\1\nexecutor = "cuda"/' -e 's#out/spec-mtp"#out/spec-mtp-cuda"#' \
        graphs/spec-mtp.toml > graphs/.spec-mtp-cuda.toml
    sed -e 's#^path = .*#path = "/tmp/deepseek-mtp"#' \
        -e 's/^\(role = .*\)$/\1\nexecutor = "cuda"/' -e 's#out/spec-mtp"#out/spec-mtp-ep-cuda"#' \
        graphs/spec-mtp.toml > graphs/.spec-mtp-ep-cuda.toml
    for graph in spec-mtp-aggregated-cuda spec-mtp-cuda spec-mtp-ep-cuda; do
        echo "== kvflow run $graph (seeded DeepSeek-V3 with its MTP layer, executor = cuda, MTP drafting) --verify"
        "$bin" run "graphs/.$graph.toml" --verify 2>&1 | tail -n 25 || status=1
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('spec', json.dumps(r['spec'])); \
[print('rank', s['pool'], s['rank'], 'expert_bytes', s['expert_bytes'], 'exchange_bytes', s['exchange_bytes'], \
'exchange_host_bytes', s['exchange_host_bytes'], 'draft_passes_without_samples', s['draft_passes_without_samples']) \
for s in r['rank_stats'] if s['exchange_bytes'] > 0]" \
            "out/$graph/report.json" 2>/dev/null || true
        rm -f "graphs/.$graph.toml"
    done
fi
# n-gram drafting against plain decoding on the GPU (kvflow bench spec: the same repetitive
# workload with and without [speculative], taking turns), on the seeded dense 1 B of
# benches/device/llama-1b.toml in bf16 — a model of seeded weights, whose greedy outputs fall into
# loops that prompt lookup then proposes from — and on the llama fixture
# (SPEC_MODELS: which of them, default "llama-1b fixture smollm2")
spec_models=" ${SPEC_MODELS:-llama-1b fixture smollm2} "
if part specbench; then
    if [[ "$spec_models" == *" llama-1b "* ]]; then
        [ -f /tmp/llama-1b/model.safetensors ] || "$bin" seed-checkpoint benches/device/llama-1b.toml /tmp/llama-1b || status=1
        echo "== kvflow bench spec (dense 1 B, executor = cuda, bfloat16)"
        "$bin" bench spec --model /tmp/llama-1b --executor cuda --dtype bfloat16 --kv-budget "4 GiB" || status=1
    fi
    if [[ "$spec_models" == *" fixture "* ]]; then
        for k in 4 8; do
            echo "== kvflow bench spec (llama fixture, executor = cuda, n-gram drafts of $k)"
            "$bin" bench spec --executor cuda --draft-tokens $k || status=1
        done
    fi
    # a trained model continues a repeated passage by copying it: SmolLM2-135M-Instruct, when its
    # GGUF's pieces were carried (serve_smollm2.sh)
    if [[ "$spec_models" == *" smollm2 "* ]] && source benches/device/smollm2_gguf.sh; then
        for dtype in float32 bfloat16; do
            echo "== kvflow bench spec (SmolLM2-135M-Instruct GGUF, executor = cuda, $dtype)"
            "$bin" bench spec --model "$gguf" --executor cuda --dtype $dtype --kv-budget "2 GiB" || status=1
        done
    fi
fi
# bf16 on the tensor cores (attention.cu, bf16.cu): the families whose attention takes them, each
# graph with dtype = "bfloat16" in the cuda pools' executor settings
part bf16 && for model in llama qwen3 qwen3_next; do
    for graph in cuda-aggregated pd-1p1d; do
      sed -e "s#fixtures/hf/llama#fixtures/hf/$model#" -e 's/^executor = "cpu"/executor = "cuda"\n\n[pool.executor_settings]/' \
          -e "s#out/$graph#out/$graph-$model-bf16#" "graphs/$graph.toml" \
        | sed -e '/^\[pool.executor_settings\]$/a dtype = "bfloat16"' > "graphs/.$graph-$model-bf16.toml"
      echo "== kvflow run $graph ($model, executor = cuda, dtype = bfloat16) --verify"
      "$bin" run "graphs/.$graph-$model-bf16.toml" --verify 2>&1 | tail -n 25 || status=1
      rm -f "graphs/.$graph-$model-bf16.toml"
    done
done
# the offload tier with cuda ranks: saves read from device blocks (and slots), loads written into
# them (300 requests: enough for prefixes to leave the small KV memory and come back from the store)
part offload && for model in llama qwen3 deepseek_v3 deepseek_v32 qwen3_next_gdn qwen3_next kimi_linear; do
    sed -e "s#fixtures/hf/llama#fixtures/hf/$model#" -e 's/^executor = "cpu"/executor = "cuda"/' \
        -e "s#out/offload#out/offload-$model#" graphs/offload.toml > "graphs/.offload-$model.toml"
    # a family with recurrent state saves chunks that end where a snapshot is kept (64 tokens)
    case "$model" in qwen3_next*|kimi_linear) sed -i 's/^chunk_tokens = 32/chunk_tokens = 64/' "graphs/.offload-$model.toml" ;; esac
    echo "== kvflow run offload ($model, executor = cuda, 300 requests) --verify"
    "$bin" run "graphs/.offload-$model.toml" --verify --limit 300 2>&1 | tail -n 25 || status=1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('offload', json.dumps(r.get('offload')))" \
        "out/offload-$model/report.json" 2>/dev/null || true
    rm -f "graphs/.offload-$model.toml"
done
echo "exit status: $status"
exit $status
