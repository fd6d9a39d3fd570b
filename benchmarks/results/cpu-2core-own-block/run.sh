# The "Chunk sizes" trap cell (prefill_chunk_size 4,096 over attention_chunk_size 2,048) after the forward's own keys
# stay one fused causal block; same row and worker as benchmarks/results/cpu-2core-chunk-sizes/run.sh.
cd /work/main
out=benchmarks/results/cpu-2core-own-block/results.txt
: > $out
for mode in longstraw-detach longstraw-exact; do for ac in 2048 4096; do
  OMP_NUM_THREADS=1 PYTHONPATH=. timeout 300 .venv/bin/python benchmarks/update_worker.py --mode $mode \
    --prompt-length 8192 --group-size 8 --completion-length 128 --prefill-chunk-size 4096 \
    --attention-chunk-size $ac 2>/dev/null | tail -1 | sed "s/^/$mode 4096 $ac /" >> $out
done; done
