#!/usr/bin/env bash
# Issue 10's time targets against their floor, in one session: stock serialized, LongStraw detach and exact at
# P = 8,192, G = 8, R = 128 (dense-tiny, one thread, the library's default chunks: prefill 1,024, attention 4,096),
# three interleaved rounds, each configuration in a fresh process. summary.md reads the fastest of each.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OUT=$ROOT/benchmarks/results/cpu-2core-floor
: > "$OUT/results.jsonl"
for repeat in 1 2 3; do
  for mode in stock-serialized longstraw-detach longstraw-exact; do
    (cd "$ROOT" && OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/update_worker.py --mode "$mode" \
      --prompt-length 8192 --group-size 8 --completion-length 128 --prefill-chunk-size 1024 \
      --attention-chunk-size 4096 2>/dev/null | tail -1 | sed "s/^{/{\"repeat\": $repeat, /") >> "$OUT/results.jsonl"
  done
done
