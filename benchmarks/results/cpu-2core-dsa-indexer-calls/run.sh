# A/B of the DSA indexer's call blocking over the prompt's keys: the commit before (a worktree of b88c996 at /tmp/before) and
# after, interleaved, capture phase of benchmarks/long_prompt_point.py on a DSA model whose indexer query side has
# GLM-5's proportions at this size (q_lora_rank / attention_chunk_size = 1/2; GLM-5's recipe: 2,048 / 8,192).
cd /work/main
dir=benchmarks/results/cpu-2core-dsa-indexer-calls
: > $dir/results.txt
for repeat in 1 2 3; do for tree in /tmp/before /work/main; do
  OMP_NUM_THREADS=1 PYTHONPATH=$tree .venv/bin/python benchmarks/long_prompt_point.py \
    --model-config $dir/dsa-wide-indexer.json --prompt-lengths 4096 --completion-length 32 --group-size 2 \
    --prefill-chunk-size 1024 --attention-chunk-size 1024 --prompt-state-dtype auto --out /tmp/dsa.json > /dev/null 2>&1
  echo "$tree $(python3 -c 'import json; print(json.dumps(json.load(open("/tmp/dsa.json"))["points"][0]))')" >> $dir/results.txt
done; done
