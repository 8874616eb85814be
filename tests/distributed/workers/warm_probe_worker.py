"""Run by tests/distributed/test_warm_ranks.py through tests.support.warm_python, as torchrun would run a rank:

    warm_probe_worker.py OUTPUT_JSON ACTION      ACTION: exit:N | raise | signal:N | sleep | spin:SECONDS

Writes what the rank saw at its start (were torch and the stack already imported, its argv, directory, path,
environment, hash seed, first random numbers, what py-cpuinfo says of the host, transformers' weight conversions for
DeepSeek-V3), then ends as ACTION says.
"""

import json
import os
import sys
import time
from pathlib import Path

seen = {
    "preloaded": "torch" in sys.modules,  # checked before this script imports anything heavy
    "pid": os.getpid(),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "marker": os.environ.get("WARM_PROBE_MARKER"),
    "hash": hash("warm ranks"),
}
if seen["preloaded"]:
    import numpy
    import torch

    seen["numpy"] = numpy.random.random()
    seen["torch"] = torch.rand(3).tolist()
    import cpuinfo

    first = cpuinfo.get_cpu_info()
    first["flags"].clear()  # a caller's edit must not reach the next caller
    seen["cpuinfo"] = {k: cpuinfo.get_cpu_info().get(k) for k in ("vendor_id_raw", "brand_raw", "flags")}
    sys.path.append(str(Path(__file__).resolve().parents[3]))  # the checkout, for a case whose PYTHONPATH lacks it
    from tests.support.warm_ranks import weight_conversions

    seen["conversions"] = weight_conversions("deepseek_v3")
Path(sys.argv[1]).write_text(json.dumps(seen))

action, _, number = sys.argv[2].partition(":")
if action == "exit":
    sys.exit(int(number))
if action == "raise":
    raise RuntimeError("the probe raised")
if action == "signal":
    os.kill(os.getpid(), int(number))
if action == "sleep":
    time.sleep(120)
if action == "spin":  # spin:SECONDS of this process's CPU time, then exit 0
    while time.process_time() < float(number):
        pass
