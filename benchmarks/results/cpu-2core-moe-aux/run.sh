# The MoE load-balancing loss on and off: a Qwen3-MoE at dense-tiny's attention geometry (moe-tiny.json: 8 experts,
# top-2, router_aux_loss_coef 0.001 as Qwen3-MoE declares), P = 4,096, G = 4, R = 128, the default chunk sizes, one
# thread, one update + AdamW per fresh process; interleaved on/off, twice; stock serialized (its own aux loss) once.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/cpu-2core-moe-aux/results.txt
: > $out
row="--model-config benchmarks/results/cpu-2core-moe-aux/moe-tiny.json --prompt-length 4096 --group-size 4"
row="$row --completion-length 128 --prefill-chunk-size 1024 --attention-chunk-size 4096"
for repeat in 1 2; do for mode in longstraw-detach longstraw-exact; do for coef in 0.001 0.0; do
  OMP_NUM_THREADS=1 PYTHONPATH=. timeout 300 .venv/bin/python benchmarks/update_worker.py --mode $mode $row \
    --router-aux-loss-coef $coef 2>/dev/null | tail -1 | sed "s|^|$mode aux=$coef |" >> $out
done; done; done
OMP_NUM_THREADS=1 PYTHONPATH=. timeout 600 .venv/bin/python benchmarks/update_worker.py --mode stock-serialized $row \
  --router-aux-loss-coef 0.001 2>/dev/null | tail -1 | sed "s|^|stock-serialized aux=0.001 |" >> $out
echo finished >> $out
