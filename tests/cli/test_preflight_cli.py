"""`hf-dist-recipes preflight`: a plan that cannot work stops before launching; both shipped CPU configs pass on
2 and 4 real processes and the JSON report validates against REPORT_SCHEMA. Each shipped config is launched once, by
a module fixture (`shipped_zero3`, `shipped_tp2_ep2`), whose report also carries the training checks' assertions:
the rows of checks 5 and 6 with their numbers against independent references (the user-JSON and seed cases, which
must not pass, are in tests/distributed/test_preflight_training.py).

About 520 lines in one file because a module fixture's launch serves only its own file: the assertions that read
the two shipped launches stay here, so each launch happens once (split, each new file would launch again)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from hf_dist_recipes.cli.main import main
from hf_dist_recipes.comm.watchdog import heartbeat_interval
from hf_dist_recipes.monitoring.tensorboard import rank_log_dir
from hf_dist_recipes.planning import models  # noqa: F401  (torch + transformers imported before timing)
from hf_dist_recipes.preflight.launch import KILL_GRACE_S, LOST_GRACE_S
from hf_dist_recipes.preflight.result import CHECKS, REPORT_SCHEMA
from hf_dist_recipes.preflight.training.checks import MIN_STEPS
from tests.support.hosts import cpu_only_host
from tests.support.launch import fresh_env, python_for, two_machine_config
from tests.support.paths import REPO
from tests.support.preflight import recipe_learning_rates, rows_by_name

STEPS = 20  # the preflight's default --steps: checkpoint at 10, the resumed run's NaN at step 12 on the last rank
SAVE_AT, NAN_STEP = STEPS // 2, STEPS // 2 + 2
# The 4-rank launch takes the fewest steps the preflight allows (MIN_STEPS): the default's rows are the 2-rank
# launch's; what the 4 ranks add (TP and EP groups, the NaN carried inside the TP group) needs no more steps.
TP2_EP2_STEPS = MIN_STEPS


@pytest.fixture
def no_launch(monkeypatch):
    """What was launched, to be asserted empty: the plan check must stop before the launcher (`run_preflight`) is
    reached and before any `accelerate launch` or worker process starts (either is refused and recorded, so a
    caller that swallowed the error would still fail the test)."""
    launched: list = []

    def run_preflight(plan, **kwargs):
        launched.append(("run_preflight", plan.command))
        raise AssertionError(f"the launcher was reached: {plan.command}")

    class NoLaunchPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            words = args if isinstance(args, (list, tuple)) else [args]
            if any("accelerate" in str(a) or "preflight.worker" in str(a) for a in words):
                launched.append(("Popen", args))
                raise AssertionError(f"a launch was started: {args}")
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr("hf_dist_recipes.preflight.launch.run_preflight", run_preflight)
    monkeypatch.setattr(subprocess, "Popen", NoLaunchPopen)
    return launched


def test_tp_not_dividing_the_processes_exits_2_before_launching(tmp_path, capsys, no_launch):
    yaml = tmp_path / "tp2_3proc.yaml"
    text = (REPO / "accelerate_configs" / "cpu_zero3_tp2_ep2_4proc.yaml").read_text()
    yaml.write_text(text.replace("num_processes: 4", "num_processes: 3"))
    out_dir = tmp_path / "out"
    cwd = os.getcwd()
    os.chdir(REPO)  # the YAML's DeepSpeed path is relative to the repository, as accelerate launch resolves it
    try:
        start = time.perf_counter()
        code = main(["preflight", "--config-file", str(yaml), "--output-dir", str(out_dir)])
        seconds = time.perf_counter() - start
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "not divisible by the tensor-parallel degree 2" in captured.err
    # Nothing launched: the launcher never reached, no process started, no output directory (so no launch log).
    assert no_launch == [] and not out_dir.exists()
    print(f"refused in {seconds:.2f} s")


def run_preflight_json(config: str, tmp_path, *options: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run(
        [
            *python_for(env),  # the CLI forked warm (its launch starts fresh, its ranks warm)
            "-m",
            "hf_dist_recipes.cli.main",
            "preflight",
            "--config-file",
            config,
            "--json",
            "--output-dir",
            str(tmp_path / "preflight"),
            *options,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = time.perf_counter() - start
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"exit {proc.returncode}, stdout is not the JSON report:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    return proc, report, seconds


def check_passes(proc, report: dict, world_size: int) -> None:
    jsonschema.validate(report, REPORT_SCHEMA)
    assert set(report["checks"]) == set(CHECKS), report["checks"]
    assert report["world_size"] == world_size and len(report["hosts"]) == world_size
    problems = [r for r in report["results"] if r["status"] != "ok"]
    # Honest warnings only: measurements that shared CPU cores make noisy (a ring link or rank of commbench, a
    # straggler in the logs); every functional check must be ok.
    assert all(r["status"] == "warning" and r["name"] in ("communication", "logs") for r in problems), problems
    assert proc.returncode == 0 == report["exit_code"], proc.stderr[-3000:]  # warnings exit 0 (no --strict)
    # Every check's progress line was relayed, on stderr under --json.
    for i, name in enumerate(CHECKS, 1):
        assert f"preflight: [{i}/{len(CHECKS)}] {name} ... " + report["checks"][name] in proc.stderr


@pytest.fixture(scope="module")
def shipped_zero3(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """The one launch of the shipped 2-process ZeRO-3 config, through the CLI: (the CLI's process, its JSON report,
    the output directory). It serves the CLI's assertions and the training checks' (the preflight trains its
    default model, demo-deepseek-v3, as itself)."""
    out = tmp_path_factory.mktemp("zero3")
    proc, report, seconds = run_preflight_json("accelerate_configs/cpu_zero3_2proc.yaml", out)
    print(f"preflight cpu_zero3_2proc: {seconds:.1f} s wall, report elapsed {report['elapsed_s']:.1f} s")
    return proc, report, out / "preflight"


@pytest.mark.distributed
@cpu_only_host
def test_shipped_two_process_config_passes(shipped_zero3):
    proc, report, _ = shipped_zero3
    check_passes(proc, report, 2)


def _zero3_rows(shipped_zero3) -> dict[str, dict]:
    return rows_by_name(shipped_zero3[1]["results"])


@pytest.mark.distributed
@cpu_only_host
def test_zero3_ranks_return_the_same_training_rows(shipped_zero3):
    proc, report, _ = shipped_zero3
    # Every rank decided the same rows: rank 0 reports them only after comparing every rank's with its own
    # (preflight.worker.ranks_decided_alike), which adds an error row naming the odd ranks otherwise.
    assert not [r for r in report["results"] if "decided the training and failure-path rows" in r["detail"]]
    rows = [r for r in report["results"] if r["name"] in ("training", "failure_paths")]
    assert [r["name"] for r in rows] == ["training"] * 4 + ["failure_paths"] * 2
    assert all(r["status"] == "ok" and r["fix"] == "" for r in rows), rows
    # The training checks' two stage lines, relayed from rank 0 in order under the check lines.
    stages = [line.split("preflight:", 1)[1].strip() for line in proc.stderr.splitlines() if "preflight:      " in line]
    assert [line.split(":")[0] for line in stages] == ["training", "failure paths"], stages


@pytest.mark.distributed
@cpu_only_host
def test_zero3_loss_falls_from_the_untrained_level(shipped_zero3):
    plan = next(r for r in shipped_zero3[1]["results"] if r["name"] == "plan" and "train_model" in r["data"])
    assert plan["data"]["train_model"] == "demo-deepseek-v3"
    loss = _zero3_rows(shipped_zero3)["training/loss"]["data"]
    assert len(loss["losses"]) == STEPS and all(math.isfinite(x) for x in loss["losses"])
    # An untrained model predicts about uniformly over its vocabulary, demo-deepseek-v3's 256 tokens: ln 256 =
    # 5.55 nats at the start (measured 5.57). Python source has far fewer likely bytes; the measured quarters are
    # 5.04 then 3.10, a drop of 1.9 nats: 0.5 is asked.
    assert abs(loss["losses"][0] - math.log(256)) < 0.3
    assert loss["first_quarter"] - loss["last_quarter"] > 0.5
    assert loss["first_quarter"] == pytest.approx(sum(loss["losses"][:5]) / 5)
    assert loss["last_quarter"] == pytest.approx(sum(loss["losses"][-5:]) / 5)


@pytest.mark.distributed
@cpu_only_host
def test_zero3_clipping_is_the_engines_at_one(shipped_zero3):
    clip = _zero3_rows(shipped_zero3)["training/clipping"]["data"]
    assert clip["source"] == "engine", "not a DeepSpeed run: the launch did not give the ranks DeepSpeed"
    assert clip["expected"] == 1.0 and clip["applied"] == {"0": [1.0], "1": [1.0]}  # engine and ZeRO-3 optimizer
    assert len(clip["pre_clip_norms"]) == STEPS and clip["steps_above_clip"] == sum(
        n > 1.0 for n in clip["pre_clip_norms"]
    )


@pytest.mark.distributed
@cpu_only_host
def test_zero3_learning_rates_are_transformers_cosine_with_restarts(shipped_zero3):
    schedule = _zero3_rows(shipped_zero3)["training/schedule"]["data"]
    assert schedule["learning_rates"] == pytest.approx(recipe_learning_rates(STEPS), rel=1e-9, abs=1e-15)
    assert schedule["mismatched_steps"] == []


@pytest.mark.distributed
@cpu_only_host
def test_zero3_ranks_agree_and_weights_were_compared(shipped_zero3):
    agreement = _zero3_rows(shipped_zero3)["training/agreement"]["data"]
    # Built whole on each rank (not under zero.Init), so the built weights were really compared: 1.0, not -1.0.
    assert agreement["rank_check"] == {
        "rank_check/seed_ok": 1.0,
        "rank_check/data_ok": 1.0,
        "rank_check/weights_ok": 1.0,
    }
    assert agreement["mismatches"] == []


@pytest.mark.distributed
@cpu_only_host
def test_zero3_nan_on_the_last_rank_is_skipped_on_both(shipped_zero3):
    nan = _zero3_rows(shipped_zero3)["failure_paths/nan"]["data"]
    assert nan["step"] == NAN_STEP and nan["rank"] == 1
    for rank in ("0", "1"):
        got = nan["ranks"][rank]
        assert got["not_applied"] == [NAN_STEP] and got["skipped_steps"] == 1 and got["flagged_ranks"] == [1]
        assert got["event"].startswith(
            "step 12: non-finite value first on rank 1 (rank(s) 1); loss non-finite on rank(s) 1"
        )


@pytest.mark.distributed
@cpu_only_host
def test_zero3_resume_reproduces_the_next_step(shipped_zero3):
    resume = _zero3_rows(shipped_zero3)["failure_paths/resume"]["data"]
    assert resume["saved_at"] == SAVE_AT and resume["step"] == SAVE_AT + 1
    for rank in resume["ranks"].values():
        # fp32 on CPU, the same forward on the same restored state: equal (measured difference 0).
        assert rank["loss"] == pytest.approx(rank["uninterrupted_loss"], abs=1e-6) and rank["same_batch"]
    assert (shipped_zero3[2] / "training" / f"checkpoint-{SAVE_AT}").is_dir()


@pytest.mark.distributed
@cpu_only_host
def test_zero3_tensorboard_runs_are_left_for_the_logs_check(shipped_zero3):
    out = shipped_zero3[2]
    for rank in (0, 1):
        assert list((out / "tensorboard" / f"rank{rank}").glob("events.out.tfevents.*"))
        assert rank_log_dir(out / "tensorboard", rank) == str(out / "tensorboard" / f"rank{rank}")


@pytest.fixture(scope="module")
def shipped_tp2_ep2(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """The one 4-rank launch of the shipped ZeRO-3 + TP 2 + EP 2 config, through the CLI; its report serves the
    CLI's assertions and the training checks' (the preflight trains the model the JSON records, tiny-deepseek-v3,
    as itself)."""
    out = tmp_path_factory.mktemp("tp2_ep2")
    config = "accelerate_configs/cpu_zero3_tp2_ep2_4proc.yaml"
    proc, report, seconds = run_preflight_json(config, out, "--steps", str(TP2_EP2_STEPS))
    print(f"preflight cpu_zero3_tp2_ep2_4proc: {seconds:.1f} s wall, report elapsed {report['elapsed_s']:.1f} s")
    return proc, report


@pytest.mark.distributed
@pytest.mark.slow
@cpu_only_host
def test_shipped_tp2_ep2_config_passes(shipped_tp2_ep2):
    proc, report = shipped_tp2_ep2
    check_passes(proc, report, 4)
    plan = next(r for r in report["results"] if r["name"] == "plan")
    assert plan["data"]["plan"]["tp"] == 2 and plan["data"]["plan"]["ep"] == 2


@pytest.mark.distributed
@pytest.mark.slow
@cpu_only_host
def test_shipped_tp2_ep2_training_rows_hold_on_every_rank(shipped_tp2_ep2):
    _, report = shipped_tp2_ep2
    # Every rank decided the same rows: rank 0 reports them only after comparing every rank's with its own
    # (preflight.worker.ranks_decided_alike), which adds an error row naming the odd ranks otherwise.
    assert not [r for r in report["results"] if "decided the training and failure-path rows" in r["detail"]]
    rows = rows_by_name(report["results"])
    assert set(rows) == {
        "training/loss",
        "training/clipping",
        "training/schedule",
        "training/agreement",
        "failure_paths/resume",
        "failure_paths/nan",
    }
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["training/clipping"]["data"]["applied"] == {str(r): [1.0] for r in range(4)}
    # The NaN is on rank 3; TP's backward all-reduce inside the TP group (2, 3) carries it to rank 2's gradients.
    nan = rows["failure_paths/nan"]["data"]
    nan_step = TP2_EP2_STEPS // 2 + 2
    assert nan["rank"] == 3 and nan["tp_group"] == [2, 3] and nan["step"] == nan_step
    assert all(r["not_applied"] == [nan_step] and 3 in r["flagged_ranks"] for r in nan["ranks"].values())
    assert rows["training/schedule"]["data"]["learning_rates"] == pytest.approx(
        recipe_learning_rates(TP2_EP2_STEPS), rel=1e-9, abs=1e-15
    )


@pytest.mark.distributed
@pytest.mark.slow
@cpu_only_host
def test_a_stopped_rank_ends_the_preflight_naming_it(tmp_path, warm_ranks):
    """Rank 1 is SIGSTOPped as the backend check starts (alive to the kernel, silent to its peers: the case no
    socket error reveals). The preflight must end within the heartbeat bound, exit 1, and the report must name
    rank 1 under the training check and list the checks that never ran."""
    import signal
    import threading

    import psutil

    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    output_dir = str(tmp_path / "preflight")
    # stdout into a file: the watcher below must be the only reader of stderr. With communicate() reading it as well,
    # the "[2/7] backend" line once went to communicate() on loaded cores and rank 1 was never stopped.
    stdout_file = (tmp_path / "stdout.json").open("w")
    proc = subprocess.Popen(
        [
            *python_for(env),  # forked warm, as its launcher and ranks: rank 1 is found below all the same
            "-m",
            "hf_dist_recipes.cli.main",
            "preflight",
            "--config-file",
            "accelerate_configs/cpu_zero3_2proc.yaml",
            "--json",
            "--peer-timeout-s",
            "10",
            "--output-dir",
            output_dir,
        ],
        cwd=REPO,
        env=env,
        stdout=stdout_file,
        stderr=subprocess.PIPE,
        text=True,
    )
    stopped: list = []
    stopped_at: list[float] = []

    def rank_1() -> psutil.Process | None:
        """Rank 1 of this launch (its output folder is in the worker's command line), or None while not found. A
        warm rank is a server's child, not its stand-in's (the process torchrun started, which cannot forward
        SIGSTOP): the servers record which rank each stand-in stands for (tests.support.warm_ranks)."""
        client = env.get("PYTHON_EXEC")
        for process in psutil.process_iter():
            try:
                cmdline = process.cmdline()
                if "hf_dist_recipes.preflight.worker" not in cmdline or output_dir not in cmdline:
                    continue
                if process.environ().get("RANK") != "1":
                    continue
                if warm_ranks is None or client not in cmdline:
                    return process  # started fresh: the process is the rank
                rank_pid = warm_ranks.rank_behind(process.pid)
                return psutil.Process(rank_pid) if rank_pid else None
            except psutil.Error:
                pass
        return None

    def stop_rank_1() -> bool:
        rank = rank_1()
        try:
            if rank is not None:
                rank.send_signal(signal.SIGSTOP)
                stopped.append(rank)
                stopped_at.append(time.perf_counter())
                return True
        except psutil.Error:
            pass
        return False

    def watch_progress():
        for line in proc.stderr:
            if "[2/7] backend ..." in line and not stopped:
                # Looked for again for a while: on loaded cores one look once missed it (a child's environ or
                # cmdline not readable at that instant).
                deadline = time.monotonic() + 30
                while not stop_rank_1() and time.monotonic() < deadline:
                    time.sleep(0.2)

    watcher = threading.Thread(target=watch_progress, daemon=True)
    watcher.start()
    try:
        proc.wait(timeout=600)
        watcher.join(timeout=30)  # stderr is at its end once the process is
    finally:
        for child in stopped:  # whatever happens, leave no stopped process behind
            try:
                child.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.kill()
    ended = time.perf_counter()
    stdout_file.close()
    out = (tmp_path / "stdout.json").read_text()
    assert stopped, "rank 1 was not found to stop"
    print(f"stopped rank 1: the preflight ended {ended - stopped_at[0]:.1f} s later")
    # The bound from the settings: the heartbeat's 10 s of silence, noticed at the next check (one interval), then
    # LOST_GRACE_S for rank 0 to write the report, 2 s before the SIGKILL, and 20 s for the verdict's line to reach
    # the launcher and for the CLI to write the report and exit on two cores shared by make test's 4 processes.
    bound = 10 + heartbeat_interval(10) + LOST_GRACE_S + 2 + 20
    assert ended - stopped_at[0] <= bound, f"{ended - stopped_at[0]:.0f} s after rank 1 stopped, bound {bound:g} s"
    report = json.loads(out)
    jsonschema.validate(report, REPORT_SCHEMA)
    assert proc.returncode == 1 == report["exit_code"]
    # The check running when the heartbeat verdict came (the one after backend, unless the stop landed late)
    # carries it; every check after it never ran and is an error too.
    # (A stop that lands after the last check is caught at the final synchronisation and carried by "logs".)
    lost = [r for r in report["results"] if r["status"] == "error" and r["ranks"] == [1]]
    assert lost and ("lost rank 1" in lost[0]["detail"] or "rank 1 (host" in lost[0]["detail"]), report["results"]
    after = CHECKS[CHECKS.index(lost[0]["name"]) + 1 :]
    assert all(report["checks"][name] == "error" for name in after), report["checks"]
    assert report["checks"]["logs"] == "error"


@pytest.mark.distributed
@cpu_only_host
def test_the_outer_timeout_kills_the_launch_and_names_the_unfinished_checks(tmp_path):
    import psutil

    # Fresh ranks: what must not outlive the preflight is the launch's process tree, and warm ranks live outside it
    # (tests.support.warm_ranks).
    env = fresh_env({k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"})
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hf_dist_recipes.cli.main",
            "preflight",
            "--config-file",
            "accelerate_configs/cpu_zero3_2proc.yaml",
            "--json",
            "--timeout-s",
            "8",
            "--output-dir",
            str(tmp_path / "preflight"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = set()
    try:
        while proc.poll() is None and time.perf_counter() - start < 120:
            try:
                seen |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.Error:
                pass
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    seconds = time.perf_counter() - start
    report = json.loads(out)
    jsonschema.validate(report, REPORT_SCHEMA)
    print(f"outer timeout 8 s: {seconds:.1f} s wall, {report['elapsed_s']:.1f} s from the launch to the verdict")
    # The behaviour under test is the bound, timed from the launch (the report's elapsed_s; the CLI's start-up and
    # plan check before it are not part of it): --timeout-s, then at most one 1 s poll of _wait, then KILL_GRACE_S
    # for the launcher to end its ranks after SIGTERM before SIGKILL, then 5 s for the kill to be reaped and the
    # output reader to see the pipe close.
    assert report["elapsed_s"] <= 8 + 1 + KILL_GRACE_S + 5, report["elapsed_s"]
    assert proc.returncode == 1 == report["exit_code"]
    unfinished = [r for r in report["results"] if "--timeout-s 8" in r["detail"]]
    assert unfinished and {r["status"] for r in unfinished} == {"error"}
    assert set(CHECKS) == set(report["checks"])
    assert not [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"], (
        "processes of the launch outlived the preflight"
    )


@pytest.mark.distributed
@pytest.mark.slow
@cpu_only_host
def test_two_machines_each_run_the_same_command_with_their_machine_rank(tmp_path):
    """Machines 0 and 1 on 127.0.0.1 (one process each) sharing the output directory (the resume check reads
    the checkpoint rank 0 saved, as a job's resume would): machine 0 gets the report; machine 1 exits 0 saying so."""
    config, _ = two_machine_config(tmp_path / "configs")
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    procs = [
        subprocess.Popen(
            [
                *python_for(env),
                "-m",
                "hf_dist_recipes.cli.main",
                "preflight",
                "--config-file",
                str(config),
                "--json",
                "--machine-rank",
                str(m),
                "--timeout-s",
                "300",
                "--output-dir",
                str(tmp_path / "shared"),
            ],
            cwd=tmp_path / "configs",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in (0, 1)
    ]
    outs = [p.communicate(timeout=400) for p in procs]
    reports = [json.loads(out) for out, _ in outs]
    for report in reports:
        jsonschema.validate(report, REPORT_SCHEMA)
    assert reports[0]["world_size"] == 2 and len(reports[0]["hosts"]) == 2
    check_passes(type("P", (), {"returncode": procs[0].returncode, "stderr": outs[0][1]}), reports[0], 2)
    assert procs[1].returncode == 0 and set(reports[1]["checks"]) == set(CHECKS)
    assert all("report on machine 0" in r["detail"] for r in reports[1]["results"])
