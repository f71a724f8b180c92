"""A garbage-collection probe for every Python process of a run: with this folder on PYTHONPATH and GCPROBE_DIR
set, each process appends every collection longer than 2 ms to GCPROBE_DIR/<pid>.log (wall time, generation,
milliseconds, objects collected, the process's command line). Python imports `sitecustomize` at start-up, so
servers, engine processes and client processes are all covered without changing them:

    PYTHONPATH=$PWD/benchmarks/gcprobe:$PYTHONPATH GCPROBE_DIR=/tmp/gc bash benchmarks/serving_suite.sh 1b
"""
import gc
import os
import sys
import time

_DIR = os.environ.get("GCPROBE_DIR")
_MIN_MS = 2.0

if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _start = [0.0]

    def _probe(phase: str, info: dict) -> None:
        if phase == "start":
            _start[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - _start[0]) * 1e3
        if ms > _MIN_MS:
            with open(os.path.join(_DIR, f"{os.getpid()}.log"), "a") as f:
                f.write(f"{time.time():.3f} gen={info['generation']} ms={ms:.1f} collected={info['collected']} "
                        f"argv={' '.join(sys.argv)[:160]}\n")

    gc.callbacks.append(_probe)
