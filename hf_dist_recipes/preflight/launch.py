"""Plan, launch and collect the preflight: `accelerate launch` over `hf_dist_recipes.preflight.worker`.

`plan_preflight` checks everything that needs no process (the YAML and its DeepSpeed JSON, the plan against the
launch's processes and the model, the lint's errors) and raises ValueError, one line naming the fix, for a plan
that cannot work: nothing is launched then. `run_preflight` launches the plan, relays the progress lines rank 0
prints, and reads the report rank 0 writes; a launch that outlives `timeout_s` is killed (the launcher's process
group, then every process it started) and each check that never finished is an error, as is each check missing
from the report of a launch that ended early (naming the rank the launcher or the watchdog named, when one did).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from hf_dist_recipes.core.launch import KILL_GRACE_S, Launch, free_port, run_launch
from hf_dist_recipes.preflight.result import CHECKS, ERROR, CheckResult, PreflightReport
from hf_dist_recipes.preflight.worker import PROGRESS_PREFIX, REPORT_FILENAME

LOG_FILENAME = "preflight_launch.log"
DEFAULT_TIMEOUT_S = 600.0  # the whole launch, a first run's DeepSpeed op build included (about 60 s on 2 cores)
LOST_GRACE_S = 5.0  # after the watchdog's verdict, rank 0's time to write the report and the launch to end
_PROGRESS = re.compile(r"^preflight: \[(\d+)/\d+\] (\w+) \.\.\.(?: (ok|warning|error))?")
# torch elastic's failure table ("rank      : 1 (local_rank: 1)", "exitcode  : -6 (pid: 12)  (SIGABRT)") and the
# watchdog's "lost rank 1 (host h)". The table lists the other failures first, then the root cause: when one rank
# fails, the launcher SIGTERMs the rest, and those are listed (exit code -15) before the rank that failed first.
_FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank")
_EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid: \d+\)\s*(?:\((\w+)\))?")
_ROOT_CAUSE = "Root Cause (first observed failure):"
_LOST_RANK = re.compile(r"lost rank (\d+) \(host ([^)]*)\)")


@dataclass(frozen=True)
class PreflightPlan:
    config_file: Path
    output_dir: Path
    world_size: int
    plan: object
    models: object
    lint_warnings: tuple[str, ...]
    launch: Launch

    @property
    def command(self) -> list[str]:
        return self.launch.argv()

    @property
    def cwd(self) -> Path:
        return self.launch.cwd

    @property
    def machine_rank(self) -> int | None:
        return self.launch.machine_rank


def plan_preflight(
    config_file: str | Path,
    *,
    model: str | None = None,
    steps: int = 20,
    seed: int = 42,
    output_dir: str | Path = "runs/preflight",
    machine_rank: int | None = None,
    cwd: str | Path | None = None,
    peer_timeout_s: float = 60.0,
) -> PreflightPlan:
    """Check the launch without launching (module docstring); the returned plan carries the command."""
    from hf_dist_recipes.core.user_values import positive_int, writable_dir
    from hf_dist_recipes.planning.lint import ERROR as LINT_ERROR
    from hf_dist_recipes.planning.lint import lint_accelerate
    from hf_dist_recipes.preflight.plan_checks import launch_plan, resolve_models, validate_against_model
    from hf_dist_recipes.reproducibility.seeding import validate_seed

    positive_int(steps, "--steps", 20, minimum=8, unit="optimizer steps")
    validate_seed(seed, "--seed")  # the arguments' rule: a seed the ranks would refuse stops here, before launching
    from hf_dist_recipes.comm.watchdog import validate_hang_settings

    if not peer_timeout_s:
        raise ValueError("--peer-timeout-s 0 would let a dead rank hang the preflight; e.g. --peer-timeout-s 60")
    validate_hang_settings(peer_timeout_s, 0)
    cwd = Path(cwd or Path.cwd()).resolve()
    out = writable_dir(output_dir, "--output", "runs/preflight")
    cfg, plan, recorded = launch_plan(config_file, root=cwd)  # cheap: one line for a plan that cannot run
    if machine_rank is not None:
        positive_int(machine_rank, "--machine-rank", 1, minimum=0)
        if machine_rank >= cfg.num_machines:
            raise ValueError(
                f"--machine-rank {machine_rank}: {cfg.path} has num_machines={cfg.num_machines}, so the "
                f"machine ranks are 0..{cfg.num_machines - 1}"
            )
    if model and (os.sep in model or model.endswith(".json")):
        model = str(Path(model).resolve())
    models = resolve_models(plan, model, recorded, deepspeed_file=cfg.deepspeed_file)
    try:
        warnings = validate_against_model(plan, models)
    except ValueError as err:
        raise ValueError(f"{cfg.path} with {models.name} ({models.source}): {err}") from None
    findings = lint_accelerate(cfg)  # the files read once above, handed on
    errors = [f for f in findings if f.level == LINT_ERROR]
    if errors:
        raise ValueError(
            f"{errors[0].path}: {errors[0].message}"
            + (
                f" (and {len(errors) - 1} more: hf-dist-recipes config validate {config_file})"
                if len(errors) > 1
                else ""
            )
        )
    port = None
    if cfg.num_machines == 1 and "main_process_port" not in cfg.raw:
        # A job already training on this machine holds accelerate's default port 29500; the preflight must not
        # collide with it (or with a second preflight).
        port = free_port()
    args = [
        "--config-file",
        str(Path(config_file).resolve()),
        "--output-dir",
        str(out),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--peer-timeout-s",
        str(peer_timeout_s),
    ]
    if model:
        args += ["--model", model]
    launch = Launch(
        module="hf_dist_recipes.preflight.worker",
        args=tuple(args),
        config_file=Path(config_file).resolve(),
        machine_rank=machine_rank,
        main_port=port,
        cwd=cwd,
        env_defaults={"PYTHONUNBUFFERED": "1"},  # rank 0's progress lines are relayed as they come
    )
    return PreflightPlan(
        config_file=Path(config_file),
        output_dir=out,
        world_size=plan.world_size,
        plan=plan,
        models=models,
        lint_warnings=tuple(w.message for w in findings if w.level != LINT_ERROR) + tuple(warnings),
        launch=launch,
    )


class _Progress:
    """What the launch's output said: the checks started and finished (from rank 0's progress lines), the rank the
    launcher or the watchdog named as failed or lost."""

    def __init__(self, on_line: Callable[[str], None]):
        self.on_line = on_line
        self.started: dict[str, int] = {}
        self.finished: dict[str, str] = {}
        self.failed_rank: int | None = None  # the table's root cause, else the first rank it lists
        self.failed_how = ""  # the root cause's exit code, with its signal when it died of one
        self._in_root_cause = False
        self.lost: str | None = None
        self.lost_at: float | None = None

    def feed(self, line: str) -> None:
        if line.startswith(PROGRESS_PREFIX):
            self.on_line(line)
            m = _PROGRESS.match(line)
            if m:
                self.started[m.group(2)] = int(m.group(1))
                if m.group(3):
                    self.finished[m.group(2)] = m.group(3)
        m = _LOST_RANK.search(line)
        if m and self.lost is None:
            self.lost, self.lost_at = f"rank {m.group(1)} (host {m.group(2)})", time.perf_counter()
        if line.strip() == _ROOT_CAUSE:
            self._in_root_cause, self.failed_rank, self.failed_how = True, None, ""
            return
        m = _FAILED_RANK.match(line)
        if m and (self.failed_rank is None or (self._in_root_cause and not self.failed_how)):
            self.failed_rank = int(m.group(1))
        m = _EXIT_CODE.match(line)
        if m and self._in_root_cause and not self.failed_how:
            self.failed_how = f"exit code {m.group(1)}" + (f", {m.group(2)}" if m.group(2) else "")


def run_preflight(
    p: PreflightPlan,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_line: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
) -> PreflightReport:
    """Launch `p`, relay its progress lines to `on_line`, and return the report (see the module docstring). The
    ranks' whole output goes to `<output_dir>/preflight_launch.log`."""
    start = time.perf_counter()
    p.output_dir.mkdir(parents=True, exist_ok=True)
    report_path = p.output_dir / REPORT_FILENAME
    if not p.machine_rank:  # machine 0 owns the output directory, which the machines may share
        report_path.unlink(missing_ok=True)  # a report left by an earlier preflight must not pass for this one's
        # The training checks start new TensorBoard runs: RecipeTrainer refuses to mix a new launch into old ones.
        for sub in ("tensorboard", "training", "failure_paths", "rank_summaries"):
            shutil.rmtree(p.output_dir / sub, ignore_errors=True)
    progress = _Progress(on_line)
    log_path = p.output_dir / (LOG_FILENAME if not p.machine_rank else f"preflight_launch_machine{p.machine_rank}.log")

    def lost_verdict_given() -> bool:
        # Once the watchdog has named a lost rank, the launch gets LOST_GRACE_S to end by itself (then 2 s more
        # after SIGTERM): torch elastic gives a stopped rank 30 s to answer SIGTERM before its SIGKILL, time the
        # verdict no longer needs.
        return progress.lost_at is not None and time.perf_counter() - progress.lost_at > LOST_GRACE_S

    launched = run_launch(
        replace(p.launch, timeout_s=timeout_s, output=log_path),
        output="merged",
        on_line=progress.feed,
        stop=lost_verdict_given,
        stop_grace_s=2.0,
        kill_grace_s=KILL_GRACE_S,  # on the timeout: the launcher's time to end its ranks
        base_env=env,
    )
    returncode, timed_out = launched.returncode, launched.timed_out
    report = read_report(report_path if not p.machine_rank else p.output_dir / "-", p)
    if p.machine_rank and returncode == 0 and not timed_out:
        # Rank 0, on machine 0, writes the report; this machine's ranks took part in every check and ended well.
        report.results = [
            CheckResult(
                name,
                "ok",
                f"machine {p.machine_rank}'s ranks took part and ended well; the "
                f"findings are in the report on machine 0 ({REPORT_FILENAME} in its output "
                "directory)",
            )
            for name in CHECKS
        ]
    report.results.extend(_unfinished(report, progress, returncode, timed_out, timeout_s, log_path))
    report.elapsed_s = time.perf_counter() - start
    return report


def read_report(path: Path, p: PreflightPlan) -> PreflightReport:
    """The report rank 0 wrote (however far it got), or an empty one for the launch when there is none."""
    if not path.is_file():
        return PreflightReport(config_file=str(p.config_file), world_size=p.world_size)
    data = json.loads(path.read_text())
    results = [CheckResult(**{**r, "ranks": tuple(r["ranks"])}) for r in data["results"]]  # CheckResult.to_dict's
    return PreflightReport(
        config_file=str(p.config_file), world_size=data["world_size"], hosts=list(data["hosts"]), results=results
    )


def _unfinished(
    report: PreflightReport,
    progress: _Progress,
    returncode: int | None,
    timed_out: bool,
    timeout_s: float,
    log_path: Path,
) -> list[CheckResult]:
    """An error for every check the report lacks, saying why: the bound, or how the launch ended."""
    done = report.by_check()
    missing = [name for name in CHECKS if name not in done]
    who = progress.lost or (
        f"rank {progress.failed_rank}" + (f" ({progress.failed_how})" if progress.failed_how else "")
        if progress.failed_rank is not None
        else None
    )
    ranks = tuple(int(x) for x in re.findall(r"rank (\d+)", who or ""))[:1]
    if not missing:
        if returncode == 0 and not timed_out:
            return []
        # Every check reported, but a rank failed or was lost at the end (the final synchronisation): a job on
        # these machines would meet the same rank; the last check carries it, an exit 0 would hide it.
        return [
            CheckResult(
                CHECKS[-1],
                ERROR,
                f"after the last check the launch ended with exit code {returncode}"
                + (f"; {who} failed or was lost" if who else "")
                + f"; log: {log_path}",
                fix="the ranks' output is in the launch log; fix what it shows and rerun the preflight",
                ranks=ranks,
            )
        ]
    if timed_out:
        why = f"never finished: the preflight was stopped after --timeout-s {timeout_s:g} s"
        fix = (
            "a rank is stuck (see the last lines of the launch log); a first run also builds DeepSpeed's ops, "
            "give it a larger --timeout-s"
        )
    else:
        why = f"never finished: the launch ended with exit code {returncode}"
        fix = "the ranks' output is in the launch log; fix what it shows and rerun the preflight"
    if who:
        why += f"; {who} failed or was lost first"
    out = []
    for name in missing:
        state = "was running" if name in progress.started else "did not start"
        out.append(CheckResult(name, ERROR, f"{why} ({name} {state}); log: {log_path}", fix=fix, ranks=ranks))
    return out
