"""`hf-dist-recipes doctor --report`: the doctor's data as a block to paste into an issue, in the shape of
`accelerate env` and `transformers env` (one `- name: value` line each), plus what only the doctor knows: which
known-bad combinations apply to this environment and which checks failed. Built from `doctor.run_checks(...)
.to_dict()` (the same data `--json` prints), so the block and the table never disagree."""

from __future__ import annotations

import platform

RULE_PREFIX = "rule "
# The stack people are asked for in an issue, in this order; others of the facts' packages follow.
STACK = ("torch", "deepspeed", "transformers", "accelerate", "datasets", "trl", "hf-dist-recipes")


def render_report(data: dict) -> str:
    """The block: platform, Python, the stack with torch's CUDA and NCCL, the driver, the GPUs, the NCCL/TORCH
    variables set, the known issues that apply (by id) and the checks that did not pass."""
    facts, checks = data["facts"], data["checks"]
    torch, nccl, driver = facts["torch"], facts["nccl"], facts["driver"]
    packages = dict(facts.get("packages") or {})
    if torch.get("version"):
        packages.setdefault("torch", torch["version"])
    lines = [
        "Copy-and-paste the text below in your GitHub issue.",
        "",
        f"- Platform: {platform.platform()} ({facts['arch']}){', in a container' if facts['in_container'] else ''}",
        f"- Python version: {facts['python']}",
    ]
    for name in [*STACK, *sorted(set(packages) - set(STACK))]:
        if name in packages:
            lines.append(f"- {name} version: {packages[name]}")
    cuda = torch.get("cuda") or "none (CPU build)"
    lines.append(f"- torch CUDA / NCCL (compiled): {cuda} / {torch.get('nccl_compiled') or 'none'}")
    if nccl.get("loaded") or nccl.get("installed"):
        lines.append(f"- NCCL loaded / installed: {nccl.get('loaded') or '-'} / {nccl.get('installed') or '-'}")
    lines.append(f"- NVIDIA driver: {driver.get('version') or 'none'}")
    gpus = facts.get("gpus") or []
    names = sorted({g.get("name", "?") for g in gpus})
    lines.append(f"- GPUs: {len(gpus)} x {', '.join(names)}" if gpus else "- GPUs: none visible")
    env = facts.get("env") or {}
    variables = ", ".join(f"{k}={v}" for k, v in sorted(env.items()))
    lines.append(f"- NCCL/TORCH/CUDA variables set: {variables or 'none'}")
    applying = [c["name"].removeprefix(RULE_PREFIX) for c in checks if c["name"].startswith(RULE_PREFIX)]
    lines.append("- Known issues that apply: " + (", ".join(applying) or "none"))
    failed = [f"{c['name']} ({c['status']})" for c in checks if c["status"] != "ok"]
    lines.append("- Checks not passed: " + (", ".join(failed) or "none") + f" (doctor exit {data['exit_code']})")
    return "\n".join(lines)
