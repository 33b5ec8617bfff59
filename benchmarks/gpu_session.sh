#!/usr/bin/env bash
# The GPU checks of issue 13 as one prepared command, for a session that is lent a GPU (the `device` tool runs it in
# the repository root and brings back what is written under $OUT):
#
#   bash benchmarks/gpu_session.sh                 # on the GPU machine: ~5 minutes
#   SIZE=tiny bash benchmarks/gpu_session.sh       # the same steps on a CPU in about a minute (tests/gpu skip)
#
# 1. Installs the wheels carried in .whl/ (hydra-core, omegaconf, deepspeed, ...; how to download them is in the
#    shared gpu/README.md) into .site/ and puts it and the checkout on PYTHONPATH; nothing is fetched.
# 2. tests/gpu/test_cuda.py and test_user_code_cuda.py: the CUDA paths, each parity test once with the world-size-1
#    short cut and once with every NCCL collective issued (two NCCL ranks cannot share one GPU, so one rank with real
#    collectives is how one GPU proves them); a zero3 fork from a process that never initialized CUDA; ZeroMonitor's
#    event timing; lean_memory decided from the GPU's memory; user code (gradient hooks, EMA, a whole-parameter
#    optimizer) against DDP on NCCL.
# 3. tests/gpu/test_offload.py: optimizer offload to the host, parameter offload and disk offload, NCCL issued,
#    against the same stage without offload at every step (and stage 3's three modes bitwise against one another).
# 4. compare.py --gpu: the one-GPU table (single device, zero1/2/3, zero3 with its
#    collectives issued, FSDP2 and DeepSpeed ZeRO-3 through Lightning) at SIZE (default the 1.3B GPT), written to
#    $OUT/gpu.json and $OUT/GPU.md.
#
#    GPU_APPROACHES=single,zero1 runs only those; PROFILE=1 also writes each approach's torch.profiler tables of two
#    more steps to $OUT/profiles (zbench/gpu.py).
#
# Time limits per step (seconds): TESTS_S (240), OFFLOAD_S (180), BENCH_S (360); a limit of 0 skips the step.
#
# Back on the development machine: copy gpu.json to benchmarks/results/gpu.json and re-render BENCHMARKS.md with
# `python benchmarks/compare.py --report-only benchmarks/results/full.json`, which fills the one-GPU goal rows.
set -uo pipefail

OUT=${OUT:-bench_work/gpu_session}
SIZE=${SIZE:-1.3B}
PY=${PYTHON:-python}
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  "$PY" -c "import torch; cuda = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', cuda,
torch.cuda.get_device_name() if cuda else '')"
  nvidia-smi -L 2>/dev/null || true
} | tee "$OUT/env.txt"

status=0
# Each step's whole log is written under $OUT; its last lines are printed.
step() {  # step LIMIT_S LOG COMMAND...: run COMMAND under LIMIT_S seconds (0: skip it) into $OUT/LOG
  local limit=$1 log=$2
  shift 2
  [ "$limit" = 0 ] && return
  timeout "$limit" "$@" >"$OUT/$log" 2>&1 || status=1
  tail -25 "$OUT/$log"
}
step "${TESTS_S:-240}" tests_gpu.txt "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py \
  tests/gpu/test_user_code_cuda.py
step "${OFFLOAD_S:-180}" tests_gpu_offload.txt "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_offload.py
step "${BENCH_S:-360}" compare_gpu.txt "$PY" benchmarks/compare.py --gpu --gpu-size "$SIZE" \
  --results "$OUT/gpu.json" --out "$OUT/GPU.md" ${GPU_APPROACHES:+--gpu-approaches "$GPU_APPROACHES"} \
  ${PROFILE:+--gpu-profile "$OUT/profiles"}
echo "gpu_session: exit $status (results in $OUT)"
exit $status
