"""Local data for `run_clm.py`: train/validation text files and a tokenizer trained on them, no downloads.

    python tests/scripts/clm_data.py OUT_DIR

writes OUT_DIR/train.txt and OUT_DIR/validation.txt (Python source from the standard library: text that ships with
every Python) and OUT_DIR/tokenizer (a byte-level BPE of VOCAB_SIZE entries trained with the `tokenizers` library,
saved as a transformers fast tokenizer, so `--tokenizer_name OUT_DIR/tokenizer` loads it with `AutoTokenizer`).
The same files on every run: fixed modules, a deterministic trainer.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

# Fixed standard-library modules: a few hundred KB of text for training, a different module for validation.
TRAIN_MODULES = ("argparse.py", "textwrap.py", "string.py", "shlex.py", "fractions.py")
VALIDATION_MODULE = "glob.py"
VALIDATION_LINES = 400  # < 1,000: run_clm's group_texts sees the whole validation split as one batch
VOCAB_SIZE = 512
EOS = "<|endoftext|>"


def _lines(module: str) -> list[str]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / module).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def write_data(out: Path) -> dict[str, Path]:
    """Write the two text files and the tokenizer under `out`; returns their paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    train, validation = out / "train.txt", out / "validation.txt"
    train.write_text("\n".join(line for m in TRAIN_MODULES for line in _lines(m)) + "\n", encoding="utf-8")
    validation.write_text("\n".join(_lines(VALIDATION_MODULE)[:VALIDATION_LINES]) + "\n", encoding="utf-8")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(train)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, model_max_length=1024)
    fast.save_pretrained(out / "tokenizer")
    return {"train": train, "validation": validation, "tokenizer": out / "tokenizer"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    paths = write_data(parser.parse_args().out_dir)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
