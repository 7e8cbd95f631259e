#!/usr/bin/env bash
# One call on a GPU machine: the real-GPU tests, `compare` on a generated 1M-ad corpus (oracle, CPU
# index, GPU index, both architectures end to end), the demo on the GPU, and the quality experiment's
# kernel figures. Results go under $OUT (default: out/device). Run from the repository root:
#   OUT=out/device bash scripts/device_check.sh
set -uo pipefail
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
A="python3 cli.py"
{
  nvidia-smi -L; python3 -c "import numpy, numba, numba_cuda, pyarrow; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'pyarrow', pyarrow.__version__)"
} 2>&1 | tee "$OUT/env.txt"
echo "== real-GPU tests"
ANDROMEDA_TEST_GPU=1 timeout 120 python3 -m pytest -q -x -m gpu -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
echo "== generate 1M ads"
t0=$(date +%s)
timeout 150 $A generate --ads 1000000 --requests 32 --seed 1 --workers 8 --out /tmp/c1m --quiet | tee "$OUT/generate_1m.txt"
echo "== compare on the 1M-ad corpus (GPU)"
timeout ${COMPARE_TIMEOUT:-300} $A compare --data /tmp/c1m --device gpu --oracle-requests 4 --json --quiet \
  > "$OUT/compare_1m_gpu.json" 2> "$OUT/compare_1m_gpu.err"; echo "compare rc=$? after $(( $(date +%s) - t0 )) s"
tail -c 600 "$OUT/compare_1m_gpu.json"; tail -3 "$OUT/compare_1m_gpu.err"
echo "== demo on the GPU"
timeout ${DEMO_TIMEOUT:-200} $A demo --quiet > "$OUT/demo_gpu.txt" 2>&1; echo "demo rc=$?"
tail -40 "$OUT/demo_gpu.txt"
echo "== quality (small) with kernel figures"
timeout 90 $A quality --small --json --quiet > "$OUT/quality_small_gpu.json" 2>&1; echo "quality rc=$?"
python3 -c "import json,sys; d=json.loads(open('$OUT/quality_small_gpu.json').read().splitlines()[-1]); print(d.get('kernel'))" 2>&1 | tail -3
