#!/usr/bin/env bash
# A GPU session's checks in one command, in priority order, each time-boxed so that a slow
# step cannot take the others with it: the CUDA tests, the host path on the GPU (bench.host;
# host-graph: the acceptance captured, as model.graph_acceptance does by default beside the
# forward's graphs; host-cost: with `auto`'s planner), the 7B device report (bench.device), the
# live runner's timing replay (bench.runner_replay: fresh runners as a first job meets them,
# then `--served`, one runner per method as a Serve replica keeps it; runner-replay-eager, the
# acceptance eager, `device-repeat-kv`, the baseline attention, `step-kernels`, a verify step's
# kernels, plain against trees, bench.step_kernels, and `acceptance-cost`, p and the verdict
# over a 152k vocabulary, bench.acceptance_cost, on request) and measured beside predicted
# (bench.device --predict); `host-drawn`: `stand-dyn`'s drawn children against deterministic
# ones on the device's host path, at T = 1.0 and 0.6 (whether `auto` should draw on a GPU).
# Everything goes to OUT_DIR (default runs/gpu): one log, and each step's JSON as it is measured.
# The default steps answer the GPU engine's targets (docs/gpu.md) in at most 8 minutes, with the
# compact forward: `device-compact` (plain decoding of one sequence against the HBM bound, the
# verify surface at 4k tokens of context), `runner-long` (best-of-16 through the live runner at
# 4k-token prompts: plain, `auto`, `stand`, and each step's phases and kernels), `predict-compact`
# (measured beside predicted, the roofline refitted); then `bench.gpu_summary` writes
# OUT_DIR/summary.json, one record per target.
#
#   bash bench/gpu_check.sh [OUT_DIR]      # at most 8 minutes on one H100/H200 (the default steps)
#   STEPS="host host-graph host-drawn host-cost runner-replay-served predict" bash bench/gpu_check.sh
#   STEPS="cuda-tests predict" bash bench/gpu_check.sh   # some of the steps
#   STEPS="device-compiled runner-long-compiled" bash bench/gpu_check.sh   # torch.compile'd
#   STEPS="cuda-tests host host-graph runner-replay runner-replay-eager" bash bench/gpu_check.sh
#                                       # the captured acceptance against the eager one, alone
#
# Needs torch, transformers, scipy, pytest, and this repository's Python dependencies
# (pydantic, redis) importable; nothing is downloaded.
set -u
out=${1:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}

# default: the GPU engine's targets (the compact forward on the 7B shape: device, live runner at
# reasoning-length contexts, the refitted prediction), within 8 minutes; the rest on request
steps=" ${STEPS:-cuda-tests device-compact runner-long predict-compact} "

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ $steps == *" $name "* ]] || return 0
    echo "== $name: $* ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
    timeout "$limit" "$@" 2>&1
    echo "== $name: rc $? ($(date +%T))"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    $py -m pip list 2>/dev/null > "$out/pip-list.txt"
    # the peers and kernels this machine has (a peer engine found here: run its plain n=16)
    for mod in triton flash_attn flashinfer vllm sglang; do
        $py -c "import importlib.util as u, sys; sys.exit(u.find_spec('$mod') is None)" \
            && echo "has $mod" || echo "no $mod"
    done
    step cuda-tests 60 $py -m pytest -q -p no:cacheprovider tests/unit/engine/test_cuda.py
    step host 130 $py -m bench.host --device cuda --rows 1 16 64 --nodes 0 8 32 --steps 30 \
        --json "$out/host-gpu.json"
    step host-graph 80 $py -m bench.host --device cuda --graph-acceptance --rows 1 16 64 \
        --nodes 0 8 --steps 30 --json "$out/host-gpu-graph.json"
    step host-cost 60 $py -m bench.host --device cuda --speculation cost --rows 16 64 --nodes 8 \
        --method stand stand-dyn --steps 30 --json "$out/host-gpu-cost.json"
    for t in 1.0 0.6; do  # drawn children against deterministic ones (`auto` on a GPU)
        for drawn in false true; do
            step host-drawn 40 $py -m bench.host --device cuda --graph-acceptance \
                --rows 1 16 64 --nodes 8 --method stand-dyn --temperature $t --set drawn=$drawn \
                --steps 30 --json "$out/host-gpu-drawn-$drawn-t$t.json"
        done
    done
    step device-compact-512 130 $py -m bench.device --model-config qwen2.5-7b --problems 2 \
        --rows 1,16,64 --tokens 1,2,4,8,16,32,64 --forward compact \
        --json "$out/device-7b-compact-512.json"
    step device-compact 120 $py -m bench.device --model-config qwen2.5-7b --problems 2 \
        --rows 1,16,64 --tokens 1,2,4,8,16 --context 4096 --forward compact \
        --json "$out/device-7b-compact.json"
    step runner-long 180 $py -m bench.runner_replay --context 4096 --forward compact \
        --out "$out/long"
    step device-compiled 180 $py -m bench.device --model-config qwen2.5-7b --problems 2 \
        --rows 1,16,64 --tokens 1,2,4,8,16 --context 4096 --forward compiled \
        --json "$out/device-7b-compiled.json"
    step runner-long-compiled 200 $py -m bench.runner_replay --context 4096 --forward compiled \
        --out "$out/long-compiled"
    step predict-compact 100 $py -m bench.device --predict --forward compact --contexts 4096 \
        --json "$out/predicted-measured.json"
    step device 130 $py -m bench.device --model-config qwen2.5-7b --problems 2 \
        --rows 1,16,64 --tokens 1,2,4,8,16,32,64 --json "$out/device-7b.json"
    step device-repeat-kv 150 $py -m bench.device --model-config qwen2.5-7b --problems 2 \
        --rows 1,16,64 --tokens 1,2,4,8,16,32,64 --repeat-kv --json "$out/device-7b-repeat-kv.json"
    step acceptance-cost 60 $py -m bench.acceptance_cost --device cuda --vocab 152064 \
        --cells 16x1 16x9 16x17 64x5 --json "$out/acceptance-cost.json"
    step step-kernels 150 $py -m bench.step_kernels --widths 1 4 8 16 \
        --json "$out/step-kernels.json"
    step runner-replay 150 $py -m bench.runner_replay --out "$out"
    step runner-replay-eager 150 $py -m bench.runner_replay --eager-acceptance --out "$out/eager"
    step runner-replay-served 150 $py -m bench.runner_replay --served --out "$out/served"
    step predict 200 $py -m bench.device --predict --json "$out/predicted-measured.json"
    $py -m bench.gpu_summary "$out" --out "$out/summary.json"
} 2>&1 | tee "$out/gpu_check.log"
