#!/usr/bin/env bash
# The README's quick-start job on two revisions, interleaved: wall on a stopwatch, decode time,
# tokens, decode tokens/s and rows a forward (docs/benchmarks.md, "The host path").
#
#   bash bench/job_revisions.sh BASE [ROUNDS] [OUT]
#
# BASE is checked out into a temporary git worktree; both revisions run with this checkout's
# virtual environment, each from its own tree (the driver and its Ray workers import that tree's
# code). The order alternates each round. One line per run goes to OUT (JSON lines).
set -euo pipefail
base=${1:?usage: bash bench/job_revisions.sh BASE [ROUNDS] [OUT]}
rounds=${2:-4}
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${3:-$repo/runs/job_revisions.jsonl}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
tmp=$(mktemp -d)
git -C "$repo" worktree add --detach -f "$tmp/base" "$base" >/dev/null 2>&1
trap 'git -C "$repo" worktree remove --force "$tmp/base"; rm -rf "$tmp"' EXIT
mkdir -p "$(dirname "$out")"
for ((r = 1; r <= rounds; r++)); do
  order=(base new)
  ((r % 2 == 0)) && order=(new base)
  for rev in "${order[@]}"; do
    tree=$repo
    [[ $rev == base ]] && tree=$tmp/base
    dir=$tmp/$rev-$r
    t0=$(date +%s.%N)
    (cd "$tree" && "$repo/.venv/bin/python" -m jobs.best_of_n \
      --problems jobs/demo_problems.jsonl --out "$dir" --set n=8 \
      --set sampling.max_new_tokens=128 --set sampling.run_nonce=7 >"$dir.log" 2>&1)
    t1=$(date +%s.%N)
    rows=$(grep -o "decoded: [0-9.]* rows a forward" "$dir.log" | grep -o "[0-9.]*" || echo null)
    "$repo/.venv/bin/python" - "$dir/summary.json" "$rev" "$r" "$t0" "$t1" "$rows" >>"$out" <<'PY'
import json, os, sys
summary, rev, r, t0, t1, rows = sys.argv[1:]
s = json.load(open(summary))
print(json.dumps({
    "revision": rev, "round": int(r), "wall_s": round(float(t1) - float(t0), 2),
    "decode_s": s["decode_s"], "tokens": s["total_tokens"],
    "decode_tokens_per_s": s["decode_tokens_per_s"], "rows_a_forward": json.loads(rows),
    "load": os.getloadavg()[0],
}))
PY
    tail -n 1 "$out"
  done
done
