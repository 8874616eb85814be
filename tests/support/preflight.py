"""What the preflight's tests compare its training rows with: the rows by name, and the learning rates of the
recipe's schedule computed by transformers (an independent reference for the schedule row)."""

from __future__ import annotations

PEAK_LR = 3e-3  # the training checks' learning rate (hf_dist_recipes.preflight.training.run.LEARNING_RATE)


def rows_by_name(results: list[dict]) -> dict[str, dict]:
    """The training checks' rows (result dicts) by 'check/row', the row being the detail's first word: loss,
    clipping, schedule, agreement, nan, resume."""
    return {
        f"{r['name']}/{r['detail'].split(':')[0]}": r for r in results if r["name"] in ("training", "failure_paths")
    }


def recipe_learning_rates(steps: int, warmup: int = 1, peak_lr: float = PEAK_LR) -> list[float]:
    """The learning rate each step applies under the recipe's defaults (warm-up 5% of 20 steps = 1 step, 3 hard
    restarts, floor 0), from transformers' own schedule: step s applies the rate set after s - 1 scheduler steps."""
    import torch
    from transformers import get_cosine_with_hard_restarts_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak_lr)
    schedule = get_cosine_with_hard_restarts_schedule_with_warmup(optimizer, warmup, steps, num_cycles=3)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return out
