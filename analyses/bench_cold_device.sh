#!/usr/bin/env bash
# The cold bench (analyses/bench_cold.py) at 1024, 768 and 224 px, then a first and a second call phase by phase at
# 1024 and 768 px, on a many-core machine: pinned by taskset to two CPUs of two different physical cores (lscpu's
# CORE column; the machine's first core left to the system), --threads 2, the native kernels built before any timed
# call. Each step is skipped when less than its estimate is left of BUDGET_S. JSON and logs go to $OUT.
#
#   OUT=cold-out bash analyses/bench_cold_device.sh [PAIRS=3] [BUDGET_S=530]
set -u
OUT=${OUT:-cold-out}
mkdir -p "$OUT"
PAIRS=${1:-3}
BUDGET=${2:-530}
PY=${PYTHON:-python3}
start=$(date +%s)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

lscpu -e >"$OUT/lscpu.txt" 2>&1
# CPUs of socket 0, one per physical core, the first core skipped: the first two
cpus=$(lscpu -p=CPU,CORE,SOCKET | grep -v '^#' | awk -F, '$3 == 0 && !seen[$2]++ {print $1}' | sed -n 2,3p | paste -sd,)
[ -n "$cpus" ] || cpus=2,3
echo "pinned to CPUs $cpus (one per physical core); $(nproc) CPUs; THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
$PY -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, torch.backends.cpu.get_cpu_capability())"
$PY -c "import vitlens.core.native as n; print('native kernels:', n.library() is not None, n.compile_failure())"

step() {  # name, estimate (s), bench arguments...
  local name=$1 need=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - start)))
  if [ "$left" -lt "$need" ]; then
    echo "== $name skipped: $left s left, ~$need s needed"
    return
  fi
  echo "== $name ($left s left): analyses/bench.py --cold --threads 2 $*"
  taskset -c "$cpus" $PY analyses/bench.py --cold --threads 2 "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
}

step cold1024 160 --img-size 1024 --batch 2 --pairs "$PAIRS" --goal distance_rollout=1.30
step cold768 150 --img-size 768 --batch 4 --pairs "$PAIRS" --goal distance_rollout=1.20
step cold224 60 --img-size 224 --batch 16 --pairs "$PAIRS" --goal distance_rollout=1.05
step phases1024 100 --img-size 1024 --batch 2 --pairs 1 --phases
step phases768 90 --img-size 768 --batch 4 --pairs 1 --phases
echo "done in $(($(date +%s) - start)) s"
