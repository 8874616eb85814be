"""`report.md` and its PNG plots for a `LogSummary`: loss per rank, learning rate, a rank x time heat map of the
step time, then the straggler and divergence tables. Plots use matplotlib's Agg backend (no display needed).

matplotlib is the `[report]` extra (`pip install 'hf-dist-recipes[report]'`): a training image does not need it.
Without it the report keeps its tables and says, in the report and in `missing`, how to get the plots."""

from __future__ import annotations

import os

import numpy as np

from hf_dist_recipes.logs.aggregate import BLOCKS, LR_TAG, STEP_TIME_TAG, LogSummary, block_matrix

REPORT_EXTRA_HINT = "pip install 'hf-dist-recipes[report]' (matplotlib)"


def plots_unavailable() -> str | None:
    """Why the report can have no plots (matplotlib not installed, with the install line), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"no plots: matplotlib is not installed ({REPORT_EXTRA_HINT})"
    return None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_loss_per_rank(summary: LogSummary, path: str) -> bool:
    per_rank = summary.block_means.get(summary.loss_tag or "", {})
    if not per_rank:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = (np.arange(BLOCKS) + 0.5) * summary.block_width
    for rank in summary.ranks[:64]:  # beyond 64 lines a legend or a curve is unreadable
        y = per_rank.get(rank)
        if y is not None:
            ax.plot(x, y, lw=1, label=f"rank {rank}")
    ax.set_xlabel("step")
    ax.set_ylabel(summary.loss_tag)
    ax.set_title(f"{summary.loss_tag} per rank (mean over blocks of {summary.block_width} step(s))")
    if len(per_rank) <= 16:
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_learning_rate(summary: LogSummary, path: str) -> bool:
    s = summary.stats.get(LR_TAG)
    if s is None or not len(s.steps):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(s.steps, s.mean, lw=1.2, label="mean across ranks")
    ax.fill_between(s.steps, s.min, s.max, alpha=0.3, label="min .. max")
    ax.set_xlabel("step")
    ax.set_ylabel(LR_TAG)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_step_time_heatmap(summary: LogSummary, path: str) -> bool:
    per_rank = summary.block_means.get(STEP_TIME_TAG, {})
    if not per_rank:
        return False
    m = block_matrix(per_rank, summary.ranks)
    used = np.flatnonzero(~np.all(np.isnan(m), axis=0))
    m = m[:, : used[-1] + 1]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, max(2.5, min(12, 0.25 * len(summary.ranks) + 1.5))))
    extent = (0, m.shape[1] * summary.block_width, len(summary.ranks) - 0.5, -0.5)
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent)
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    if len(summary.ranks) <= 32:
        ax.set_yticks(range(len(summary.ranks)), [str(r) for r in summary.ranks])
    ax.set_title(f"{STEP_TIME_TAG} per rank (mean over blocks of {summary.block_width} step(s))")
    fig.colorbar(im, ax=ax, label="seconds")
    return _save(plt, fig, path)


def write_report(summary: LogSummary, out_dir: str | os.PathLike) -> str:
    """Write `<out_dir>/report.md` and its PNGs; returns the report's path."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    lines = [
        f"# Run summary: {summary.logdir}",
        "",
        f"{len(summary.ranks)} rank(s), {summary.files} event file(s), {summary.records:,} records, "
        f"{len(summary.stats)} scalar tag(s). Aggregate TensorBoard run: `aggregate/` "
        f"(`tensorboard --logdir {out_dir}`).",
        "",
    ]
    if summary.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in summary.warnings] + [""]
    lines += ["## Stragglers", ""]
    if summary.stragglers:
        lines += ["| rank | host | slower than the median | from step |", "|---|---|---|---|"]
        lines += [
            f"| {s.rank} | {s.host or '-'} | {100 * s.slower_by:.0f}% | {s.from_step} |" for s in summary.stragglers
        ]
    else:
        lines.append("None (or no `rank/step_time_s` logged).")
    lines += ["", "## Divergence", ""]
    if summary.divergences:
        lines += ["| tag | ranks that part | first step | values there |", "|---|---|---|---|"]
        lines += [
            f"| {d.tag} | {', '.join(map(str, d.ranks))} | {d.first_step} | "
            f"{', '.join(f'rank {r}: {v:.6g}' for r, v in d.values.items())} |"
            for d in summary.divergences
        ]
    else:
        lines.append("None: the learning rate (and, with --tp, the loss inside each TP group) agree on every rank.")
    lines += ["", "## Plots", ""]
    missing = plots_unavailable()
    if missing:
        lines += [missing[0].upper() + missing[1:] + ".", ""]
    for name, title, plot in (
        ()
        if missing
        else (
            ("loss_per_rank.png", "Loss per rank", plot_loss_per_rank),
            ("learning_rate.png", "Learning rate", plot_learning_rate),
            ("step_time_heatmap.png", "Step time, rank x time", plot_step_time_heatmap),
        )
    ):
        if plot(summary, os.path.join(out_dir, name)):
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
