"""Peak memory of the loss's forward + backward on CPU: the stock causal-LM loss against the chunked one
(`hf_dist_recipes.parallel.chunked_loss`), same head, same hidden states, same labels, in one run.

    python benchmarks/chunked_loss_memory.py                      # 2,048 tokens, vocabulary 129,280: about a minute
    python benchmarks/chunked_loss_memory.py --tokens 4096 --chunks 512 2048

What is measured: the LM head (hidden -> vocabulary, bf16 like a GPU run, no bias) on `--tokens` hidden states that
require a gradient, then the loss and its backward pass: transformers' `ForCausalLMLoss` on the full logits (the
stock path) or `chunked_causal_lm_loss` with each `--chunks` size. Labels ignore 10 % of the tokens (-100).

How: each variant runs in a fresh child process (no allocator state carried over). The child builds its inputs, then
resets the kernel's peak resident set (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0), reads its resident set
(VmRSS), runs the forward pass, reads the peak (VmHWM), runs the backward pass and reads the peak again: the peaks
less the resident set before are the bytes the loss added, as the kernel counted them (glibc serves allocations of
this size by mmap and returns them when freed, so the resident set follows the tensors). Beside each: what
`hf_dist_recipes.planning.memory` counts for it (tokens or one chunk x vocabulary x 12 bytes), and the loss and the
gradient norms, which must agree across variants.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    """One variant (`chunk` 0: the stock loss) in this process; returns its peaks and results."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from hf_dist_recipes.parallel.chunked_loss import chunked_causal_lm_loss

    torch.manual_seed(0)
    torch.set_num_threads(2)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
    states = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    labels[torch.rand(1, tokens) < 0.1] = -100
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    if chunk:
        loss = chunked_causal_lm_loss(states, labels, head, chunk)
    else:
        loss = ForCausalLMLoss(head(states), labels, vocab_size=vocab)
    forward = _status_kib("VmHWM")
    loss.backward()
    peak = _status_kib("VmHWM")
    seconds = time.perf_counter() - start
    return {
        "chunk": chunk,
        "forward_mib": (forward - before) / 1024,
        "peak_mib": (peak - before) / 1024,
        "seconds": seconds,
        "loss": loss.item(),
        "grad_hidden_norm": states.grad.float().norm().item(),
        "grad_head_norm": head.weight.grad.float().norm().item(),
    }


def run(tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    argv = [sys.executable, __file__, "--child", str(chunk), "--tokens", str(tokens)]
    argv += ["--vocab", str(vocab), "--hidden", str(hidden)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode:
        raise SystemExit(f"variant chunk={chunk} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the batch (%(default)s)")
    parser.add_argument("--vocab", type=int, default=129_280, help="vocabulary, DeepSeek-V3's by default")
    parser.add_argument(
        "--hidden", type=int, default=256, help="hidden size (%(default)s; the logits do not depend on it)"
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256], help="chunk sizes (%(default)s)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.tokens, args.vocab, args.hidden, args.child)))
        return

    from hf_dist_recipes.planning.elements import LOGIT_BYTES

    print(f"tokens {args.tokens}, vocabulary {args.vocab:,}, hidden {args.hidden}, bf16 head; peak resident set added")
    rows = [run(args.tokens, args.vocab, args.hidden, c) for c in [0, *args.chunks]]
    plain = rows[0]
    head = f"{'loss':<18} {'forward MiB':>12} {'fwd+bwd MiB':>12} {'estimate MiB':>13} {'/ plain':>8} {'s':>6}"
    print(head + f" {'loss':>12} {'|dloss|':>9} {'grad h rel':>11} {'grad W rel':>11}")
    print("-" * (len(head) + 46))
    for r in rows:
        name = f"chunked {r['chunk']}" if r["chunk"] else "stock (full logits)"
        counted = min(r["chunk"] or args.tokens, args.tokens) * args.vocab * LOGIT_BYTES / MIB
        rel_h = abs(r["grad_hidden_norm"] - plain["grad_hidden_norm"]) / plain["grad_hidden_norm"]
        rel_w = abs(r["grad_head_norm"] - plain["grad_head_norm"]) / plain["grad_head_norm"]
        print(
            f"{name:<18} {r['forward_mib']:12,.0f} {r['peak_mib']:12,.0f} {counted:13,.0f} "
            f"{r['peak_mib'] / plain['peak_mib']:8.3f} {r['seconds']:6.1f} {r['loss']:12.7f} "
            f"{abs(r['loss'] - plain['loss']):9.1e} {rel_h:11.1e} {rel_w:11.1e}"
        )


if __name__ == "__main__":
    main()
