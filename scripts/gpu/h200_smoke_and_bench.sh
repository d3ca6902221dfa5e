#!/usr/bin/env bash
# One H200 call of the device tool (see ../shared/gpuhost/stage-wheels): install the staged CuTe DSL
# wheels and this tree, then write two bundles with k3-verify itself and pack them into $OUT:
#   smoke  k3-verify run --tier smoke      (kernel compile + numerics with counters + sanitizer + probes)
#   bench  k3-verify bench kernels         (kernels vs cuBLAS / PyTorch, cold L2, % of HBM floor)
# Usage on the GPU host, from the repo root:  bash scripts/gpu/h200_smoke_and_bench.sh [smoke|bench|all]
# Staging with the device tool (a later call's carry drops the earlier carried folder, so park `a` in /tmp):
#   call 1: carry [".gpuwheels/a"], command: mkdir -p /tmp/gwa && cp .gpuwheels/a/* /tmp/gwa/
#   call 2: carry [".gpuwheels/b"], command: mkdir -p .gpuwheels/a && cp /tmp/gwa/* .gpuwheels/a/ &&
#           source .gpuwheels/b/env.sh && bash scripts/gpu/h200_smoke_and_bench.sh smoke
#   call 3 (same warm machine): as call 2 with `bench`.
# The copied tree has no .git: pass K3_SOURCE_COMMIT=<sha> in the command (the bundle also records
# source_tree_sha256, a hash of the package sources, either way).
set -uo pipefail
what=${1:-all}
: "${OUT:?OUT must point at the folder whose files come back}"
export PYTHONUNBUFFERED=1 K3_KERNEL_CACHE=/tmp/k3cache NCCL_NVLS_ENABLE=0
source .gpuwheels/b/env.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/nvidia-smi.csv"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p /tmp/bundles
rc=0
if [ "$what" = smoke ] || [ "$what" = all ]; then
  timeout -s TERM ${K3_STEP_TIMEOUT:-520} python3 -m verify.cli run --tier smoke --output "/tmp/bundles/$stamp-h200-smoke" 2>&1 | tee "$OUT/smoke.log" || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout -s TERM ${K3_STEP_TIMEOUT:-520} python3 -m verify.cli bench kernels --output "/tmp/bundles/$stamp-h200-bench-kernels" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
tar -C /tmp/bundles -czf "$OUT/bundles-$stamp.tar.gz" .
ls -la /tmp/bundles
exit $rc
