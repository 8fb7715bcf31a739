"""What GPU health costs: the NVML part of a GPU's probe (target: <= 10 ms) and the driver
part (a fresh process), beside the cheapest NVML call (a memory-info read).

    python bench/health_cost.py [--repeat N] [--sim]

On a machine with an NVIDIA driver it measures GPU 0 (NVML's first device); elsewhere, or
with --sim, the simulated GPU of fixtures/gpusim/ (built with gcc into a temporary folder,
then this script runs again with it on LD_LIBRARY_PATH). Prints one line per part:
median and p95 in ms, the ratio to the 10 ms target and to the memory-info read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_MS = 10.0
SIM_ENV = "GPUISO_HEALTH_BENCH_SIM"


def _ms(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values) * 1e3, values[int(0.95 * (len(values) - 1))] * 1e3


def _rerun_on_the_simulator(argv: list[str]) -> int:
    gcc = shutil.which("gcc")
    if gcc is None:
        print("health_cost: no NVIDIA driver here and no gcc to build the simulated GPU")
        return 2
    with tempfile.TemporaryDirectory(prefix="gpuiso-health-bench-") as folder:
        for source, name in (("cuda.c", "libcuda.so.1"), ("nvml.c", "libnvidia-ml.so.1")):
            path = str(Path(folder) / name)
            src = str(ROOT / "fixtures" / "gpusim" / source)
            subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", path, src], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=folder, GPUISO_SIM_STATE=f"{folder}/gpus")
        env.update(GPUISO_SIM_GPUS="Sim H100,81559", **{SIM_ENV: "1"})
        env.pop("CUDA_VISIBLE_DEVICES", None)
        return subprocess.run([sys.executable, __file__, *argv], env=env).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200, help="NVML reads per part")
    parser.add_argument("--sim", action="store_true", help="the simulated GPU, even with a driver")
    opts = parser.parse_args(argv)
    if opts.repeat < 1:
        parser.error(f"--repeat {opts.repeat}: expected a positive count")
    sys.path.insert(0, str(ROOT))
    from pytest_gpuiso.gpu.health import driver_probe
    from pytest_gpuiso.gpu.leases import visible_env
    from pytest_gpuiso.gpu.nvml import NvmlReader

    nvml = NvmlReader()
    if not os.environ.get(SIM_ENV) and (opts.sim or not nvml.available()):
        return _rerun_on_the_simulator(argv)
    if not nvml.available():
        print(f"health_cost: NVML is not available: {nvml.error}")
        return 2
    [device, *_] = nvml.devices()
    where = "the simulated GPU" if os.environ.get(SIM_ENV) else f"GPU {device}"
    nvml.track_errors(device)
    read, probe = [], []
    for _ in range(opts.repeat):
        start = time.perf_counter()
        nvml.sample(device)
        read.append(time.perf_counter() - start)
        start = time.perf_counter()
        problems = nvml.problems(device)
        probe.append(time.perf_counter() - start)
    start = time.perf_counter()
    broken = driver_probe(visible_env((device,)))
    driver = (time.perf_counter() - start) * 1e3
    nvml.close()
    read_med, _ = _ms(read)
    med, p95 = _ms(probe)
    print(f"health_cost on {where}, {opts.repeat} reads each")
    print(f"memory-info read (NVML sample): median {read_med:.3f} ms")
    print(
        f"NVML part of the probe: median {med:.3f} ms, p95 {p95:.3f} ms; "
        f"{med / TARGET_MS:.3f}x the {TARGET_MS:g} ms target, "
        f"{med / max(read_med, 1e-9):.1f}x a memory-info read; "
        f"{'OK' if p95 <= TARGET_MS else 'OVER'}; found: {problems or 'nothing'}"
    )
    print(
        f"driver part (a fresh process): {driver:.0f} ms; "
        f"{driver / TARGET_MS:.0f}x the NVML part's target; found: {broken or 'nothing'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
