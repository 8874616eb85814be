"""Issue 42: the quicktour's script (docs/quicktour.md, the block that starts `# train.py`) runs as written, in one
CPU process: its `tokenize` and collator give the Trainer labels, it trains, it saves a `from_pretrained` folder.
Only what names the user's own files changes here: the model (a tiny Llama saved with a tokenizer trained on the
standard library's text, tests/scripts/clm_data.py), the data (that text as JSON lines), and the run's length."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.support.launch import launched_ranks_env, python_for
from tests.support.paths import REPO

QUICKTOUR = REPO / "docs" / "quicktour.md"


def _script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", QUICKTOUR.read_text(encoding="utf-8"), flags=re.S)
    (script,) = [b for b in blocks if b.startswith("# train.py")]
    return script


def _user_files(tmp_path):
    """A model folder and a JSON-lines file, as a user's would be."""
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    try:
        from clm_data import VOCAB_SIZE, write_data
    finally:
        sys.path.pop(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist_recipes.core.model_templates import template_config

    data = write_data(tmp_path / "data")
    config = template_config("tiny-llama")
    config.vocab_size, config.max_position_embeddings = VOCAB_SIZE, 2048  # the tokenizer's; the script's max_length
    model_dir = tmp_path / "your-model"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(data["tokenizer"]).save_pretrained(model_dir)
    lines = data["train"].read_text(encoding="utf-8").splitlines()[:200]
    jsonl = tmp_path / "your-data.jsonl"
    jsonl.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines if line.strip()), encoding="utf-8")
    return model_dir, jsonl


def test_the_quicktour_script_trains_and_saves_as_written(tmp_path):
    script = _script()
    model_dir, jsonl = _user_files(tmp_path)
    for theirs, ours in (
        ('"path/to/your-model"', repr(str(model_dir))),
        ('"path/to/your-data.jsonl"', repr(str(jsonl))),
        ("max_steps=10_000", "max_steps=4"),
        ("save_steps=500", "save_steps=2"),
    ):
        assert script.count(theirs) == 1, theirs  # the page still says it: the test runs what the page shows
        script = script.replace(theirs, ours)
    (tmp_path / "train.py").write_text(script, encoding="utf-8")
    env = launched_ranks_env(os.environ)  # forked warm in a session that launches (tests.support.warm_ranks)
    proc = subprocess.run(
        [*python_for(env), "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "my-job"
    # Trained to the end (a batch without labels stops the stock Trainer at its first step: the model gives no loss).
    assert json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert (run / "final" / "config.json").is_file() and (run / "final" / "model.safetensors").is_file()
