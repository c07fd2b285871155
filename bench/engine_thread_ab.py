"""kvflow engine on tiny: steps run in the main thread vs in a worker thread, alternating.

python bench/engine_thread_ab.py PAIRS
"""

import os
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, "bench")
sys.path.insert(0, "tests")
from engine_throughput import tiny_model
from kvflow_arms import new_engine, run_kvflow
from throughput_stats import WorkloadSpec, make_workload

from kvflow.engine_worker.model.loader import load_model

path = tiny_model(Path(tempfile.mkdtemp()))
loaded = load_model(path)
w = make_workload(WorkloadSpec(8, (16, 32), (24, 32)), loaded[1].vocab_size, 0)


def once():
    return run_kvflow(new_engine(path, loaded, max_num_seqs=64, kv_cache_gib=0.25), w)


def in_thread():
    box = {}
    t = threading.Thread(target=lambda: box.update(r=once()))
    t.start()
    t.join()
    return box["r"]


once()
for _ in range(int(sys.argv[1])):
    for name, fn in (("main", once), ("thread", in_thread)):
        load = os.getloadavg()[0]
        wall, n = fn()
        print(f"{name:7} {n / wall:7.1f} tok/s load {load:.1f}", flush=True)
