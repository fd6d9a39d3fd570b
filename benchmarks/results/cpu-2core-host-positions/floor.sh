#!/usr/bin/env bash
# One more round of stock serialized, LongStraw detach and exact at this checkout (appended to results.jsonl as
# repeat 3): the same-session measurements the README's time floor reads (min over the repeats of each phase).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=$ROOT/benchmarks/results/cpu-2core-host-positions
for mode in stock-serialized longstraw-detach longstraw-exact; do
  (cd "$ROOT" && OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/update_worker.py --mode "$mode" \
    --prompt-length 8192 --group-size 8 --completion-length 128 2>/dev/null \
    | tail -1 | sed 's/^{/{"side": "after", "repeat": 3, /') >> "$OUT/results.jsonl"
done
