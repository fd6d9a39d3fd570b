#!/usr/bin/env bash
# Before/after A/B of host-side positions (the key-chunk decisions read no device tensor, and build no mask for a
# chunk the fused kernels take), interleaved, two repeats, one thread; plus stock serialized once, in the same session.
# BEFORE: a checkout of the commit before (git worktree add /tmp/before <commit>); AFTER: this checkout.
set -euo pipefail
BEFORE=${BEFORE:-/tmp/before}
AFTER=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=${OUT_DIR:-$AFTER/benchmarks/results/cpu-2core-host-positions}
PY=$AFTER/.venv/bin/python
ARGS="--prompt-length 8192 --group-size 8 --completion-length 128"
for repeat in 1 2; do
  for mode in longstraw-detach longstraw-exact; do
    for side in before after; do
      root=$([ "$side" = before ] && echo "$BEFORE" || echo "$AFTER")
      (cd "$root" && OMP_NUM_THREADS=1 PYTHONPATH=. "$PY" benchmarks/update_worker.py --mode "$mode" $ARGS 2>/dev/null \
        | tail -1 | sed "s/^{/{\"side\": \"$side\", \"repeat\": $repeat, /") >> "$OUT/results.jsonl"
    done
  done
done
(cd "$AFTER" && OMP_NUM_THREADS=1 PYTHONPATH=. "$PY" benchmarks/update_worker.py --mode stock-serialized $ARGS 2>/dev/null \
  | tail -1 | sed 's/^{/{"side": "after", "repeat": 1, /') >> "$OUT/results.jsonl"
