#!/usr/bin/env bash
# Profile evidence for BENCHMARKS.md (benchmarks/findings.md): per-function time per step (--timers), torch.profiler
# op tables and py-spy stacks, for lightning_zero and the approaches it is compared with, on the main configuration
# (M-2) and at world size 1 (M-1). Writes benchmarks/profiles/*.md|txt (~4 min on 2 cores).
#   usage (any interpreter with the project installed; py-spy for step 2):
#          PYTHON=.venv-peers/bin/python PYSPY=.venv-peers/bin/py-spy benchmarks/profile.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PYSPY=${PYSPY:-py-spy}
OUT=benchmarks/profiles
WORK=bench_work/profiles
mkdir -p "$OUT" "$WORK"
LZ=lightning_zero.sharding
TIMERS="zbench.model:BenchGPT.forward,torch._tensor:Tensor.backward,torch.optim.adamw:AdamW.step"
TIMERS+=",$LZ.grad_hooks:GradReducer._launch,$LZ.grad_hooks:GradReducer.finish,$LZ.grad_hooks:GradShards.store"
TIMERS+=",$LZ.flat_param:Bucket.pack,$LZ.flat_param:Bucket.unpack,$LZ.flat_param:Bucket.pack_local"
TIMERS+=",$LZ.flat_param:Bucket.unpack_to_storage,$LZ.collectives:Pending.wait"
TIMERS+=",$LZ.replicated:ReplicatedParams._launch_more,$LZ.replicated:ReplicatedParams._complete_through"
TIMERS+=",$LZ.unit_state:Unit.wait_unshard,$LZ.unit_state:Unit.start_unshard,$LZ.param_hooks:ShardedParams._launch_reduce"

# 1. Where a step's time goes, per function (rank 0), 2 ranks and 1 rank.
$PY benchmarks/compare.py --only M-2 --rounds 1 --steps 8 --timers "$TIMERS" \
    --approaches ddp,lit_ddp,torch_zero1,lz_zero1,lz_zero2,lz_zero3 \
    --workdir "$WORK/timers2" --out "$WORK/timers2/BENCH.md" --results "$WORK/timers2/r.json"
$PY benchmarks/compare.py --only M-1 --rounds 1 --steps 8 --timers "$TIMERS" \
    --approaches single,lit_single,lz_zero1,lz_zero2,lz_zero3 \
    --workdir "$WORK/timers1" --out "$WORK/timers1/BENCH.md" --results "$WORK/timers1/r.json"
(PYTHONPATH=benchmarks $PY -m zbench.report "$WORK/timers2/r.json" \
    && PYTHONPATH=benchmarks $PY -m zbench.report "$WORK/timers1/r.json") > "$OUT/timers.md"

# 2. torch.profiler op tables (rank 0, 4 timed steps) and py-spy stacks (both ranks).
$PY benchmarks/compare.py --only M-2 --rounds 0 --steps 4 --torch-profile lit_ddp,lz_zero1,lz_zero3 \
    --approaches lit_ddp,lz_zero1,lz_zero3 --workdir "$WORK/torchprof" --out "$WORK/torchprof/BENCH.md" \
    --results "$WORK/torchprof/r.json"
for a in lit_ddp lz_zero1 lz_zero3; do
    head -40 "$WORK/torchprof/full/M-2.$a.r0.rank0.torchprof.txt" | cut -c1-170 > "$OUT/torchprof_M-2_$a.txt"
done
$PY benchmarks/compare.py --only M-2 --rounds 0 --steps 12 --pyspy lit_ddp,lz_zero1,lz_zero3 --pyspy-bin "$PYSPY" \
    --approaches lit_ddp,lz_zero1,lz_zero3 --workdir "$WORK/pyspy" --out "$WORK/pyspy/BENCH.md" \
    --results "$WORK/pyspy/r.json"
for a in lit_ddp lz_zero1 lz_zero3; do
    $PY benchmarks/zbench/pyspy_summary.py "$WORK"/pyspy/full/M-2.$a.r0.rank*.pyspy.txt --top 40 \
        > "$OUT/pyspy_M-2_$a.txt"
done
echo "wrote $OUT"
