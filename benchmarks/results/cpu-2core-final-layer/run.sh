# A/B of the final layer's skipped prompt attention: the commit before (a worktree at /tmp/before) and after, same
# row as "Chunk sizes" (dense-tiny, P = 8,192, G = 8, R = 128, the default chunk sizes, one thread), twice each,
# then stock serialized once in the same session.
cd /work/main
out=benchmarks/results/cpu-2core-final-layer/results.txt
: > $out
for repeat in 1 2; do for tree in /tmp/before /work/main; do for mode in longstraw-detach longstraw-exact; do
  OMP_NUM_THREADS=1 PYTHONPATH=$tree timeout 300 .venv/bin/python benchmarks/update_worker.py --mode $mode \
    --prompt-length 8192 --group-size 8 --completion-length 128 --prefill-chunk-size 1024 \
    --attention-chunk-size 4096 2>/dev/null | tail -1 | sed "s|^|$tree $mode |" >> $out
done; done; done
OMP_NUM_THREADS=1 PYTHONPATH=. timeout 600 .venv/bin/python benchmarks/update_worker.py --mode stock-serialized \
  --prompt-length 8192 --group-size 8 --completion-length 128 --prefill-chunk-size 1024 --attention-chunk-size 4096 2>/dev/null | tail -1 | sed "s|^|stock |" >> $out
echo finished >> $out

# The capture alone, interleaved before/after, four pairs (engine level: benchmarks/long_prompt_point.py in the
# model dtype, the default chunk sizes; its "capture_s" per point).
for repeat in 1 2 3 4; do for tree in /tmp/before /work/main; do
  OMP_NUM_THREADS=1 PYTHONPATH=$tree .venv/bin/python benchmarks/long_prompt_point.py --preset dense-tiny \
    --prompt-lengths 8192 --completion-length 128 --group-size 8 --prefill-chunk-size 1024 \
    --attention-chunk-size 4096 --prompt-state-dtype auto --out /tmp/capture.json > /dev/null 2>&1
  echo "$tree capture $(python3 -c 'import json; print(json.dumps(json.load(open("/tmp/capture.json"))["points"][0]))')" \
    >> benchmarks/results/cpu-2core-final-layer/capture.txt
done; done
