"""The preflight on every rank: `accelerate launch --config_file X.yaml -m hf_dist_recipes.preflight.worker ...`.

`hf-dist-recipes preflight` launches this; it can also be launched by hand on each machine. The process group is
created as training creates it (`RecipeTrainingArguments`: backend policy, NCCL defaults, node-local op builds),
with `--collective-timeout-s` as its collective timeout, and the heartbeat watchdog of `hf_dist_recipes.comm.watchdog`
runs for the whole preflight: a rank that dies or hangs ends every rank within `--peer-timeout-s`, and rank 0
first writes the report with an error naming the lost rank under the check that was running.

Rank 0 prints one progress line per check (`preflight: [3/7] communication ...`, then the same line ending in its
status), which the CLI relays, and rewrites `<output_dir>/preflight_report.json` after each check, so a report
exists however far the preflight got. Every rank runs the checks in the same order and reaches the same
collectives: a check's local work never raises (an exception is that rank's error finding). The training checks'
rows are decided on every rank; rank 0's are reported once every rank's are found equal (`ranks_decided_alike`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from hf_dist_recipes.comm.backend import cuda_device_count
from hf_dist_recipes.core.files import write_atomically
from hf_dist_recipes.core.gather import gather_objects, process_rank
from hf_dist_recipes.monitoring.console import quiet_the_stack
from hf_dist_recipes.preflight.result import CHECKS, ERROR, CheckResult, PreflightReport, worst

REPORT_FILENAME = "preflight_report.json"
PROGRESS_PREFIX = "preflight: "
DEFAULT_PEER_TIMEOUT_S = 60.0  # a dead or stopped rank ends the preflight within this (+ one heartbeat interval)
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0  # covers a first run's DeepSpeed op build while the other ranks wait


def progress_line(index: int, name: str, status: str | None = None, seconds: float | None = None) -> str:
    """`preflight: [3/7] communication ...` (started) or `... ok (2.1 s)` (finished)."""
    line = f"{PROGRESS_PREFIX}[{index}/{len(CHECKS)}] {name} ..."
    if status is not None:
        line += f" {status}" + (f" ({seconds:.1f} s)" if seconds is not None else "")
    return line


class Reporter:
    """Rank 0's side of the report: progress lines and the JSON file, rewritten after each check."""

    def __init__(self, rank: int, output_dir: Path, config_file: str, world_size: int):
        self.rank, self.path = rank, output_dir / REPORT_FILENAME
        self.report = PreflightReport(config_file=config_file, world_size=world_size)
        self.current: tuple[int, str] | None = None
        self.started = time.perf_counter()
        self.check_started = self.started

    def start(self, index: int, name: str) -> None:
        self.current, self.check_started = (index, name), time.perf_counter()
        self.say(progress_line(index, name))

    def finish(self, index: int, name: str, results: list[CheckResult]) -> None:
        self.report.results.extend(results)
        self.current = None
        self.say(progress_line(index, name, worst(r.status for r in results), time.perf_counter() - self.check_started))
        self.write()

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def write(self) -> None:
        if self.rank != 0:
            return
        self.report.elapsed_s = time.perf_counter() - self.started
        write_atomically(self.path, json.dumps(self.report.to_dict(), indent=2))

    def lost(self, message: str) -> None:
        """The watchdog's verdict (called from its thread while the main thread waits in a collective): rank 0
        records it under the running check and writes the report; every rank then ends (exit 3)."""
        from hf_dist_recipes.comm.watchdog import LOST_PEER_EXIT_CODE

        print(f"[hf_dist_recipes preflight] {message}", file=sys.stderr, flush=True)
        if self.rank == 0 and self.current is not None:
            index, name = self.current
            found = re.search(r"lost rank (\d+)", message)
            self.finish(
                index,
                name,
                [
                    CheckResult(
                        name,
                        ERROR,
                        f"the preflight stopped during this check: {message.split('. Ending')[0]}",
                        fix="look at that rank's host and log (killed, out of memory, a hung device "
                        "or a network fault); "
                        "rerun the preflight once it is fixed"
                        + (
                            f"; where the other ranks waited: `hf-dist-recipes logs hang {self.path.parent / name}`"
                            if name in ("training", "failure_paths")
                            else ""
                        ),
                        ranks=(int(found.group(1)),) if found else (),
                    )
                ],
            )
        os._exit(LOST_PEER_EXIT_CODE)


def create_process_group(output_dir: Path, collective_timeout_s: float, seed: int):
    """The default process group, created the way RecipeTrainer's arguments create it."""
    from hf_dist_recipes.arguments import RecipeTrainingArguments

    return RecipeTrainingArguments(
        output_dir=str(output_dir),
        report_to="none",
        ddp_timeout=int(collective_timeout_s),
        seed=seed,
        per_rank_tensorboard=False,
    )


def run_checks(args: argparse.Namespace, reporter: Reporter, rank: int, world: int) -> None:
    from hf_dist_recipes.preflight import comm_checks, env_checks, plan_checks

    reporter.start(1, "environment")
    results, hosts = env_checks.environment_check(gather_objects)
    reporter.report.hosts = hosts
    reporter.finish(1, "environment", results)

    reporter.start(2, "backend")
    reporter.finish(2, "backend", env_checks.backend_check(gather_objects, hosts))

    reporter.start(3, "communication")
    reporter.finish(3, "communication", comm_checks.communication_check())

    reporter.start(4, "plan")
    models = plan = None
    try:
        _, plan, recorded = plan_checks.launch_plan(args.config_file)
        models = plan_checks.resolve_models(plan, args.model, recorded)
        device_bytes, device_what = plan_checks.device_memory_bytes(plan.device, plan.procs_per_node)
    except Exception as err:  # the CLI checked the files; a rank that reads them differently is the finding
        device_bytes, device_what = None, f"{type(err).__name__}: {err}"
    gathered = gather_objects((device_bytes, device_what, plan_checks.host_memory_bytes()))
    memories, hosts_memory = [(m[0], m[1]) for m in gathered], [m[2] for m in gathered]
    if rank == 0:
        if models is None:
            results = [
                CheckResult(
                    "plan",
                    ERROR,
                    f"the plan could not be read on rank 0: {device_what}",
                    fix="run the preflight from the directory the config's paths are relative to",
                )
            ]
        else:
            known = [m for m in memories if m[0] is not None]
            smallest = (
                min(known) if len(known) == len(memories) else (None, next(m[1] for m in memories if m[0] is None))
            )
            read = [h for h in hosts_memory if h[0] is not None]
            host_bytes, host_what = min(read) if read else (None, "")
            results = plan_checks.check_plan(
                plan,
                models,
                device_bytes=smallest[0],
                device_what=smallest[1],
                host_bytes=host_bytes,
                host_what=host_what,
            )
            results.append(plan_checks.check_checkpoint_space(plan, models, args.output_dir))
        reporter.finish(4, "plan", results)

    reporter.start(5, "training")
    training = _with_hang_report(_training_results(args, plan, models, reporter), args.output_dir)
    training += ranks_decided_alike(training, "training")
    reporter.finish(5, "training", [r for r in training if r.name == "training"])
    reporter.start(6, "failure_paths")
    reporter.finish(6, "failure_paths", [r for r in training if r.name == "failure_paths"])

    reporter.start(7, "logs")
    gather_objects(None)  # every rank has closed its TensorBoard writer before rank 0 reads the runs
    if rank == 0:
        from hf_dist_recipes.preflight.log_checks import logs_check

        reporter.finish(7, "logs", logs_check(logging_dir(args.output_dir), world, tp=plan.tp if plan else 1))


def logging_dir(output_dir: str | os.PathLike) -> Path:
    """Where the training checks' ranks write their TensorBoard runs: RecipeTrainingArguments' default."""
    return Path(output_dir) / "tensorboard"


def _training_results(args, plan, models, reporter: Reporter) -> list[CheckResult]:
    """Checks 5 and 6 (hf_dist_recipes.preflight.training) under `plan` (its TP degree, read from the launch config
    once), each with at least one result."""
    out: list[CheckResult] = []
    if models is None:
        reason = "no model to train: the plan could not be read"
    else:
        try:
            from hf_dist_recipes.preflight.training import run_training_checks

            out = list(
                run_training_checks(
                    models.train_config,
                    steps=args.steps,
                    output_dir=args.output_dir,
                    seed=args.seed,
                    tp=plan.tp,
                    on_progress=lambda *a, **k: _relay(reporter, *a, **k),
                )
            )
            reason = "the training checks returned no result for it"
        except Exception as err:
            reason = f"the training checks raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    for name in ("training", "failure_paths"):
        if not any(r.name == name for r in out):
            out.append(
                CheckResult(
                    name,
                    ERROR,
                    reason,
                    fix="see the launch log in the output directory (preflight_launch.log) for the traceback",
                )
            )
    return out


def _with_hang_report(results: list[CheckResult], output_dir) -> list[CheckResult]:
    """A failed training run that left hang dumps (a collective timed out or failed: `comm.flight_recorder`) gets,
    in its fix, the command that reads them: which collective the ranks parted at, and where each rank was."""
    from dataclasses import replace

    from hf_dist_recipes.comm.flight_recorder import FLIGHT_RECORDER_DIR

    runs = [Path(output_dir) / run for run in ("training", "failure_paths")]
    dumped = [run for run in runs if any((run / FLIGHT_RECORDER_DIR).glob("stack_rank_*.json"))]
    if not dumped:
        return results
    command = " and ".join(f"`hf-dist-recipes logs hang {run}`" for run in dumped)
    return [r if r.status != ERROR else replace(r, fix=f"{r.fix}; where the ranks waited: {command}") for r in results]


def ranks_decided_alike(results: list[CheckResult], name: str, gather=gather_objects) -> list[CheckResult]:
    """[] when every rank's `results` equal rank 0's, else one error under check `name` naming the ranks that
    differ. Every rank decides from the same gathered facts and only rank 0 writes the report: a difference is a
    bug in the checks, and the report would not be every rank's. Compared as JSON text, where a NaN equals
    itself; one `gather` (one object per rank in, every rank's out) of a few kilobytes."""
    texts = gather(json.dumps([r.to_dict() for r in results], sort_keys=True, default=str))
    odd = tuple(i for i, text in enumerate(texts) if text != texts[0])
    if not odd:
        return []
    return [
        CheckResult(
            name,
            ERROR,
            f"rank(s) {', '.join(map(str, odd))} decided the training and failure-path rows differently from "
            "rank 0, from the same gathered measurements; the report shows rank 0's",
            fix="a bug in hf-dist-recipes' checks: report it with preflight_report.json and preflight_launch.log",
            ranks=odd,
        )
    ]


def _relay(reporter: Reporter, *args, **kwargs) -> None:
    text = " ".join(str(a) for a in args) + "".join(f" {k}={v}" for k, v in kwargs.items())
    if text.strip():
        reporter.say(f"{PROGRESS_PREFIX}      {text.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--peer-timeout-s", type=float, default=DEFAULT_PEER_TIMEOUT_S)
    parser.add_argument("--collective-timeout-s", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S)
    args = parser.parse_args(argv)
    quiet_the_stack(cpu_run=not cuda_device_count())  # what the recipe's arguments do in a user's ranks
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    rank, world = process_rank(), int(os.environ.get("WORLD_SIZE", 1))
    reporter = Reporter(rank, output_dir, args.config_file, world)
    try:
        create_process_group(output_dir, args.collective_timeout_s, args.seed)
    except ValueError as err:  # the backend policy refuses the launch before a group exists: every rank alike
        reporter.report.results.append(
            CheckResult("backend", ERROR, f"no process group: {err}", fix=str(err).split("; ")[-1])
        )
        reporter.write()
        return 2
    import torch.distributed as dist

    from hf_dist_recipes._compat import torch as compat_torch
    from hf_dist_recipes.comm.watchdog import HeartbeatWatchdog

    if dist.is_initialized():
        # transformers 5.24 passes ddp_timeout to the group only on GPU / DeepSpeed hosts (training_args.py
        # _setup_devices: not with use_cpu), so set it on every group: ranks stuck in mismatched collectives (alive,
        # so the heartbeat cannot tell) end within it instead of Gloo's 30 minutes.
        compat_torch.set_collective_timeout(args.collective_timeout_s)

    watchdog = None
    if dist.is_initialized() and dist.get_world_size() > 1 and args.peer_timeout_s:
        # Its own key space: RecipeTrainer's watchdog (inside the training checks) beats under the same keys and
        # marks each rank "done" at the end of each run, which would make a rank stopped after that look finished.
        store = dist.PrefixStore("hf_dist_recipes/preflight/", compat_torch.default_store())
        watchdog = HeartbeatWatchdog(
            store, dist.get_rank(), dist.get_world_size(), args.peer_timeout_s, on_lost=reporter.lost
        )
        watchdog.start()
    run_checks(args, reporter, rank, world)
    gather_objects(None)  # nobody leaves (and looks lost to the others' watchdogs) before everyone is done
    if watchdog is not None:
        watchdog.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
