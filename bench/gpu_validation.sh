#!/usr/bin/env bash
# Everything docs/gpu-validation.md asks of a GPU machine, in one command that fits the
# device tool's 10-minute limit; run it from the repository root:
#
#   bash bench/gpu_validation.sh [STEP ...]       (default: every step, in this order)
#
# Steps:
#   facts       GPUs, driver, Python, torch, pytest (and the git commit)
#   build       pip install -e . into $PYTHON's environment (no dependencies fetched)
#   torch       `import torch` must leave the process forkable: no libcuda / NVML mapped,
#               one thread (else the fork server refuses and the session falls back to spawn)
#   tests       tests/gpu under both start methods, alone on the GPU
#   cuda-bench  bench/overhead.py --device cuda (tests that allocate on cuda)
#   cpu-bench   bench/overhead.py --only forkserver (the 1.3x target, on this machine's cores)
#   mem-bench   bench/memory_leases.py --cuda: 16 tests x 4 GiB, exclusive vs memory leases
#               (the >= 4x target on an 80 GB GPU)
#   health      bench/health_cost.py: the GPU health probe's NVML part (<= 10 ms) and its
#               driver part, on GPU 0
#   phases      bench/gpu_phases.py: where a GPU-leasing test's time goes (lease, start,
#               CUDA init, the test, after it) under spawn and the fork server, against the
#               floor a fresh process pays for CUDA, and pytest's process under cProfile
#   faults      bench/page_faults.py --import torch: what the kernel charges a forked test
#               (a copy-on-write fault, a fork of a torch-sized process), to set beside the
#               development VM's (docs/performance.md)
#
# Each step's output goes to $OUT/<step>.log (OUT defaults to ./gpu-validation-out) and a
# line "step exit-status seconds" to $OUT/summary.txt, which is printed at the end. A step
# that fails does not stop the next; the script exits 1 if any failed. $PYTHON (default
# python3) runs everything. Each step has its own bound (facts 60 s, build 300, torch 120,
# tests 420, cuda-bench 540, cpu-bench 300, mem-bench 540, health 120, phases 360, faults 120); $STEP_TIMEOUT, if set,
# replaces them all. Under the device tool's 600 s a command, one call each: `facts build torch
# tests`, `cuda-bench`, `cpu-bench`, `mem-bench health`.
set -u
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
export OUT=${OUT:-gpu-validation-out}
declare -A BOUND=([facts]=60 [build]=300 [torch]=120 [tests]=420 [cuda-bench]=540 [cpu-bench]=300
    [mem-bench]=540 [health]=120 [phases]=360 [faults]=120)
ALL=(facts build torch tests cuda-bench cpu-bench mem-bench health phases faults)
mkdir -p "$OUT"
: >"$OUT/summary.txt"

step_facts() {
    date -u +"%Y-%m-%d %H:%M UTC"
    git rev-parse --short HEAD 2>/dev/null || echo "not a git checkout"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ||
        echo "nvidia-smi: not available"
    nproc
    "$PYTHON" -c 'import platform, sys
print("Python", platform.python_version())
for name in ("torch", "pytest", "psutil", "pynvml", "xdist"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"), getattr(getattr(mod, "version", None), "cuda", ""))
    except ImportError as exc:
        print(name, "missing:", exc)'
}

step_build() {
    # No network on the device machine: the build uses its setuptools (pyproject.toml needs
    # >= 77); where it is older, carry a setuptools wheel and install it first.
    "$PYTHON" -c 'import setuptools; print("setuptools", setuptools.__version__)'
    "$PYTHON" -m pip install --no-build-isolation --no-deps -e . || {
        echo "build: failed; pyproject.toml needs setuptools >= 77 in \$PYTHON's environment" >&2
        return 1
    }
}

step_torch() {
    "$PYTHON" - <<'EOF'
import sys

import torch

from pytest_gpuiso.forkserver.fork import unsafe_to_fork

print("torch", torch.__version__, "built for CUDA", torch.version.cuda)
problem = unsafe_to_fork("a process that imported torch")
print("forkable after import torch:", problem or "yes")
sys.exit(1 if problem else 0)
EOF
}

step_tests() {
    # serially: the GPU tests measure one GPU's memory (and xdist may not be installed)
    "$PYTHON" -m pytest tests/gpu -p no:xdist -v -rs -p no:cacheprovider
}

step_cuda-bench() {
    "$PYTHON" bench/overhead.py --device cuda --repeat 1 --naive-tests 2
}

step_cpu-bench() {
    "$PYTHON" bench/overhead.py --only forkserver --repeat 5
}

step_mem-bench() {
    "$PYTHON" bench/memory_leases.py --cuda --tests 16 --gib 4 --workers 16 --hold 2
}

step_health() {
    "$PYTHON" bench/health_cost.py
}

step_phases() {
    "$PYTHON" bench/gpu_phases.py --tests "${PHASES_TESTS:-10}" --out "$OUT" --timeout 120
}

step_faults() {
    "$PYTHON" bench/page_faults.py --import torch
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("${ALL[@]}")
for name in "${steps[@]}"; do
    if ! declare -F "step_$name" >/dev/null; then
        echo "gpu_validation.sh: unknown step '$name' (steps: ${ALL[*]})" >&2
        exit 2
    fi
done
failed=0
for name in "${steps[@]}"; do
    echo "== $name" >&2
    start=$SECONDS
    # The step runs in a subshell, so that the timeout bounds it whole.
    timeout --kill-after=10 "${STEP_TIMEOUT:-${BOUND[$name]}}" \
        bash -c "$(declare -f "step_$name"); step_$name" \
        >"$OUT/$name.log" 2>&1
    status=$?
    [ $status -eq 0 ] || failed=1
    echo "$name $status $((SECONDS - start))s" >>"$OUT/summary.txt"
    tail -n 15 "$OUT/$name.log" >&2
done
echo "== summary (step exit-status seconds; 124: timed out)"
cat "$OUT/summary.txt"
exit $failed
