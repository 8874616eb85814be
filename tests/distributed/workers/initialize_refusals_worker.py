"""Run by tests/distributed/test_initialize_refusals.py in plain processes (a Gloo group of WORLD_SIZE ranks, this
one RANK; default one rank): a real `deepspeed.initialize` for each DeepSpeed config of CASES_JSON, on a fresh tiny
model each time. Every rank runs the same cases in the same order, so a refusal stops all ranks at the same point.

    RANK=r WORLD_SIZE=n MASTER_PORT=p initialize_refusals_worker.py CASES_JSON RESULTS_JSON

CASES_JSON: [[name, "tiny-llama" | "tiny-deepseek-v3", config], ...]. The optimizer comes as the Trainer passes it:
with an `optimizer` section DeepSpeed builds it from the parameters (transformers' DummyOptim route); without one a
torch AdamW is handed over, and `zero_force_ds_cpu_optimizer: false` is added, standing in for accelerate's mapping
of that AdamW to DeepSpeedCPUAdam under offload (accelerator.py, `map_pytorch_optim_to_deepspeed`), which would
JIT-build the CPU Adam op first. RESULTS_JSON: {name: {"ok": bool, "type", "message", "where"}}, `where` the deepest
frame inside the deepspeed package as "path/under/deepspeed.py:line".
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def deepest_deepspeed_frame(err: BaseException) -> str | None:
    where = None
    for frame in traceback.extract_tb(err.__traceback__):
        marker = f"{os.sep}deepspeed{os.sep}"
        if marker in frame.filename:
            where = f"{frame.filename.rsplit(marker, 1)[1]}:{frame.lineno}"
    return where


def main(cases_json: str, results_json: str) -> None:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist_recipes.core.model_templates import template_config

    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, template, config in json.loads(Path(cases_json).read_text()):
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, **config}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(template_config(template))
        kwargs = {"model": model}
        if "optimizer" in config:
            kwargs["model_parameters"] = model.parameters()
        else:
            kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
            config["zero_force_ds_cpu_optimizer"] = False
        try:
            engine, *_ = deepspeed.initialize(config=config, **kwargs)
            engine.destroy()
            results[name] = {"ok": True}
        except Exception as err:  # the point: which exception DeepSpeed raises, and where
            results[name] = {
                "ok": False,
                "type": type(err).__name__,
                "message": str(err)[:400],
                "where": deepest_deepspeed_frame(err),
            }
    Path(results_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.update(LOCAL_RANK=os.environ["RANK"], LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"])
    main(*sys.argv[1:3])
