#!/usr/bin/env bash
# The GPU check: what only a CUDA device can prove of the copy engine's GPU path, in one run.
# On a fresh machine with a CUDA device, an interpreter whose torch sees it, Cython and a C
# compiler (it installs nothing: GPU machines here reach no registry), from the repository's
# root:
#   ./scripts/gpu-check.sh              (PYTHON=... to name the interpreter; OUT=DIR for files)
# it
#   1. builds hostkv's compiled modules in place (python setup.py build_ext --inplace);
#   2. runs tests/test_cuda_copy.py, whose CUDA tests must run, not skip;
#   3. runs scripts/gpu_check.py: per block layout and head slice, a save and a load under
#      torch.cuda.set_sync_debug_mode("error"), bytes compared with the CPU path's, and the
#      copy calls per step;
#   4. runs `python -m hostkv bench --section gpu-copy`: save and load GB/s against a pinned
#      cudaMemcpyAsync of the same bytes, copy calls per (page, layer), submit_save's time
#      with a save in flight, staging bytes, and a large matmul's slow-down beside saves.
# Results print, and go as JSON to $OUT (default /tmp/hostkv-gpu-check). It exits non-zero
# on the first step that fails. About 3 minutes on an H200, 1.5 of them building.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-/tmp/hostkv-gpu-check}"
mkdir -p "$OUT"
say() { printf '\n==> %s\n' "$*"; }

say "the machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
"$PYTHON" - <<'PY'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("gpu-check: torch sees no CUDA device")
print("device", torch.cuda.get_device_name())
PY

say "building the compiled modules in place"
if ! "$PYTHON" -c 'import Cython' 2>/dev/null; then
    echo "gpu-check: this interpreter has no Cython; using the modules already built, if any"
else
    "$PYTHON" setup.py build_ext --inplace -q
fi
"$PYTHON" -c 'import hostkv, hostkv._cudacopy'

say "tests/test_cuda_copy.py (no CUDA test may skip)"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest tests/test_cuda_copy.py -q -rs \
    -p no:cacheprovider 2>&1 | tee "$OUT/test_cuda_copy.txt"
if grep -q "no CUDA device here" "$OUT/test_cuda_copy.txt"; then
    echo "gpu-check: CUDA tests skipped on a machine that has a device"; exit 1
fi

say "sync-free steps, bytes against the CPU path, copy calls (scripts/gpu_check.py)"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" scripts/gpu_check.py --json "$OUT/checks.json"

say "bench: the gpu-copy section"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m hostkv bench --section gpu-copy \
    --json "$OUT/gpu-copy.json"
"$PYTHON" - "$OUT/gpu-copy.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["gpu_copy"]
if "skipped" in r:
    sys.exit(f"gpu-check: the bench skipped: {r['skipped']}")
print("vs pinned cudaMemcpyAsync (goal >= 0.8):", {k: round(v, 3) for k, v in r["vs_pinned"].items()})
print("copy calls a step:", r["copy_calls"], "(goal <= 8 per page-layer)")
print("submit_save with a save in flight, us (goal < 100):", r["submit_save_us"])
print("matmul slow-down beside saves (goal <= 1.03):", round(r["matmul"]["slowdown"], 4))
print("staging bytes:", r["staging_bytes"], "bytes exact:", r["bytes_exact"])
PY
say "done: $OUT"
