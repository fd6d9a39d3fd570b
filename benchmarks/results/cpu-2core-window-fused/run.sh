# A/B of sliding-window attention blocks that drop no pair through the fused kernel (after) against every windowed
# block through plain-torch tiles (before: a worktree of the commit before at /tmp/before), interleaved, two repeats:
# benchmarks/long_prompt_point.py (capture of P = 8,192, scoring of G = 8 members of R = 128, one replay with its
# backward), one thread, fp32, detach mode, a 4-layer hidden-256 Mistral with a 4,096-token window on every layer.
cd /work/main
dir=benchmarks/results/cpu-2core-window-fused
: > $dir/results.txt
for repeat in 1 2; do for chunk in 1024 4096; do for tree in /tmp/before /work/main; do
  OMP_NUM_THREADS=1 PYTHONPATH=$tree .venv/bin/python benchmarks/long_prompt_point.py \
    --model-config $dir/mistral-window-4096.json --prompt-lengths 8192 --completion-length 128 --group-size 8 \
    --prefill-chunk-size 1024 --attention-chunk-size $chunk --prompt-state-dtype auto --out /tmp/window.json \
    > /dev/null 2>&1
  echo "$tree attention_chunk=$chunk $(python3 -c 'import json; print(json.dumps(json.load(open("/tmp/window.json"))["points"][0]))')" >> $dir/results.txt
done; done; done
