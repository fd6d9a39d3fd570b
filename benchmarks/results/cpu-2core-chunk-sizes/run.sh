cd /work/main
for mode in longstraw-exact longstraw-detach; do for pc in 512 1024 2048 4096; do for ac in 2048 4096 8192; do
  OMP_NUM_THREADS=1 PYTHONPATH=. timeout 300 .venv/bin/python benchmarks/update_worker.py --mode $mode --prompt-length 8192 --group-size 8 --completion-length 128 --prefill-chunk-size $pc --attention-chunk-size $ac 2>/dev/null | tail -1 | sed "s/^/$mode $pc $ac /" >> /tmp/x/chunks/out.txt
done; done; done
OMP_NUM_THREADS=1 PYTHONPATH=. timeout 600 .venv/bin/python benchmarks/update_worker.py --mode stock-serialized --prompt-length 8192 --group-size 8 --completion-length 128 2>/dev/null | tail -1 | sed "s/^/stock-serialized - - /" >> /tmp/x/chunks/out.txt
echo finished >> /tmp/x/chunks/out.txt
