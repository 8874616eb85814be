"""`hf-dist-recipes commbench` for real on 2 CPU processes (Gloo; GPUs hidden on a GPU host): the JSON against its
schema, every op at every size, times > 0, algbw = S / time and busbw = algbw * the factor computed by hand for n=2;
the table from inside a plain torchrun launch; bad inputs as one line with exit 2 before anything is launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema  # installed with nbformat (the dev extra)
import pytest

from hf_dist_recipes.cli.main import main
from tests.support.hosts import GPUS
from tests.support.launch import cpu_only_env, free_port, launched_ranks_env, python_for
from tests.support.paths import REPO

NUMBER_OR_NULL = {"type": ["number", "null"]}
ROW = {
    "type": "object",
    "required": ["op", "size_bytes", "time_us", "algbw_GBps", "busbw_GBps", "call", "note"],
    "properties": {
        "op": {"enum": ["all_reduce", "all_gather", "reduce_scatter"]},
        "size_bytes": {"type": "integer", "minimum": 1},
        "time_us": NUMBER_OR_NULL,
        "algbw_GBps": NUMBER_OR_NULL,
        "busbw_GBps": NUMBER_OR_NULL,
        "call": {"type": "string"},
        "note": {"type": "string"},
    },
}
LINK = {
    "type": "object",
    "required": ["src", "dst", "src_host", "dst_host", "size_bytes", "time_us", "GBps", "flagged"],
    "properties": {
        "src": {"type": "integer"},
        "dst": {"type": "integer"},
        "src_host": {"type": "string"},
        "dst_host": {"type": "string"},
        "GBps": {"type": "number", "exclusiveMinimum": 0},
        "flagged": {"type": "boolean"},
    },
}
SCHEMA = {
    "type": "object",
    "required": [
        "world_size",
        "backend",
        "device",
        "hosts",
        "rank_hosts",
        "results",
        "links",
        "links_note",
        "ranks",
        "flagged",
    ],
    "properties": {
        "world_size": {"type": "integer", "minimum": 2},
        "backend": {"enum": ["nccl", "gloo"]},
        "hosts": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "results": {"type": "array", "items": ROW, "minItems": 1},
        "links": {"type": "array", "items": LINK},
        "ranks": {"type": "array", "items": {"type": "object", "required": ["rank", "host", "time_us", "flagged"]}},
        "flagged": {"type": "object", "required": ["links", "ranks"]},
    },
}
SIZES = (1024, 65536, 1024**2)
# nccl-tests' factors worked out for n = 2: all_reduce 2 * (2 - 1) / 2 = 1; all_gather, reduce_scatter (2 - 1) / 2
FACTOR_N2 = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = launched_ranks_env(os.environ)
    return subprocess.run(
        [*python_for(env), "-m", "hf_dist_recipes.cli.main", "commbench", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.distributed
def test_two_cpu_processes_json():
    proc = _cli(
        "--num-processes", "2", "--sizes", "1K,64K,1M", "--iters", "3", "--warmup", "1", "--link-size", "64K", "--json"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    jsonschema.validate(data, SCHEMA)
    assert (data["world_size"], data["backend"], data["device"]) == (2, "gloo", "cpu")
    # one progress line per op (and one for the links) on stderr, from rank 0 only
    for op in FACTOR_N2:
        assert proc.stderr.count(f"commbench [gloo]: {op}: 3 size(s)") == 1
    rows = {(r["op"], r["size_bytes"]): r for r in data["results"]}
    assert set(rows) == {(op, s) for op in FACTOR_N2 for s in SIZES}
    for (op, size), r in rows.items():
        assert r["time_us"] > 0 and r["note"] == ""
        algbw = size / (r["time_us"] * 1e-6) / 1e9  # S / t in 10^9 bytes per second
        assert r["algbw_GBps"] == pytest.approx(algbw)
        assert r["busbw_GBps"] == pytest.approx(algbw * FACTOR_N2[op])
    assert [(x["src"], x["dst"]) for x in data["links"]] == [(0, 1), (1, 0)]
    assert all(x["size_bytes"] == 65536 and x["time_us"] > 0 for x in data["links"])
    assert [x["rank"] for x in data["ranks"]] == [0, 1]
    assert data["rank_hosts"][0] == data["links"][0]["src_host"] and data["links_note"] == ""


def test_schema_rejects_what_it_must():
    good = {
        "op": "all_reduce",
        "size_bytes": 1024,
        "time_us": 1.0,
        "algbw_GBps": 1.0,
        "busbw_GBps": 1.0,
        "call": "x",
        "note": "",
    }
    jsonschema.validate(good, ROW)
    no_time = {k: v for k, v in good.items() if k != "time_us"}
    for bad in ({**good, "op": "broadcast"}, {**good, "size_bytes": 0}, no_time):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, ROW)


@pytest.mark.distributed
def test_inside_a_torchrun_launch_rank0_prints_the_table():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "hf_dist_recipes.comm.commbench",
        "--sizes",
        "4K",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--link-size",
        "4K",
    ]
    env = cpu_only_env(dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("commbench: 2 ranks, gloo on cpu") == 1  # rank 0 only
    for op in FACTOR_N2:
        assert f"\n  {op:<15}      4K" in proc.stdout
    assert "ring links (each alone, 4K per send):" in proc.stdout


def _refuse_launches(monkeypatch, why: str) -> None:
    """Fail the test when a torchrun launch starts (core.launch starts every launch with subprocess.Popen)."""
    real = subprocess.Popen

    def popen(args, *rest, **kwargs):
        if any("torch.distributed.run" in str(a) for a in args):
            pytest.fail(f"{why}: {args}")
        return real(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--sizes", "1X"], "--sizes: '1X' is not a size in bytes"),
        (["--num-processes", "1"], "--num-processes must be a whole number of processes >= 2, got 1"),
        (["--iters", "0"], "--iters must be a whole number of iterations >= 1"),
        (["--fraction", "2"], "--fraction must be in (0, 1]"),
    ],
)
def test_bad_inputs_are_one_line_and_launch_nothing(args, message, capsys, monkeypatch):
    _refuse_launches(monkeypatch, "launched despite a bad input")
    assert main(["commbench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.skipif(GPUS > 0, reason="the NCCL refusal is for a host without CUDA; this one has GPUs")
def test_nccl_without_a_gpu_is_refused_in_one_line(capsys, monkeypatch):
    _refuse_launches(monkeypatch, "launched NCCL on a CPU host")
    assert main(["commbench", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "--backend nccl needs CUDA GPUs and this host has none visible" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "outcome, strict, code",
    [("calm", False, 0), ("calm", True, 0), ("slow link", False, 0), ("slow link", True, 1), ("failed", False, 1)],
)
def test_exit_status_follows_the_one_convention(outcome, strict, code, capsys, monkeypatch):
    """0 ok; a link or rank flagged slow is a warning (0, 1 with --strict); ranks that failed, 1. Faked: the
    outcome of the launch. A slow link needs a network we lack, and the real launch's exit 0 is asserted above."""
    import hf_dist_recipes.comm.commbench_launch as launch

    def fake_run(plan):
        if outcome == "failed":
            raise RuntimeError("rank 1 exited with 1 (its log: ...)")
        links = [{"src": 0, "dst": 1}] if outcome == "slow link" else []
        return {"flagged": {"links": links, "ranks": []}}

    monkeypatch.setattr(launch, "run_commbench", fake_run)
    assert main(["commbench", "--json", *(["--strict"] if strict else [])]) == code
    captured = capsys.readouterr()
    if outcome == "failed":
        assert captured.err == "hf-dist-recipes commbench: rank 1 exited with 1 (its log: ...)\n"
    else:
        assert json.loads(captured.out)["flagged"]["links"] == (
            [{"src": 0, "dst": 1}] if outcome == "slow link" else []
        )
