"""Preflight checks 1 (environment) and 2 (backend), from each rank's local findings gathered to every rank.

Each function takes `gather` (one object per rank in, the list of all ranks' objects out: `all_gather_object` in
a launch, `lambda x: [x]` in one process) so the collectives stay in one place and tests can hand in other ranks.
Local work never raises: an exception becomes that rank's error, so every rank reaches the same gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hf_dist_recipes.preflight.result import ERROR, OK, WARNING, CheckResult

Gather = Callable[[object], list]


def merge_by_rank(name: str, per_rank: Sequence[Sequence[dict]], hosts: Sequence[str]) -> list[CheckResult]:
    """One result per distinct finding (status, what, detail, fix) across ranks, naming the ranks and hosts it
    was seen on (all ranks: "every rank"). Each rank's finding is a dict with keys status, what, detail, fix."""
    seen: dict[tuple, list[int]] = {}
    for rank, findings in enumerate(per_rank):
        for f in findings:
            seen.setdefault((f["status"], f["what"], f["detail"], f["fix"]), []).append(rank)
    out = []
    for (status, what, detail, fix), ranks in seen.items():
        if len(ranks) == len(per_rank) and len(per_rank) > 1:
            where, concerned = "every rank", ()
        else:
            where = ", ".join(f"rank {r} ({hosts[r]})" for r in ranks)
            concerned = tuple(ranks)
        out.append(CheckResult(name, status, f"{what} on {where}: {detail}", fix=fix, ranks=concerned))
    return out


def local_doctor() -> list[dict]:
    """This rank's doctor findings that are not ok (the doctor's checks on `probe()`'s facts)."""
    from hf_dist_recipes.doctor.doctor import run_checks
    from hf_dist_recipes.doctor.probe import probe

    try:
        report = run_checks(probe())
    except Exception as err:  # a probe that fails on one node is that node's finding, not a crash of the launch
        return [
            {
                "status": ERROR,
                "what": "doctor",
                "detail": f"the probe failed: {type(err).__name__}: {err}",
                "fix": "run hf-dist-recipes doctor on that host to see the failure",
            }
        ]
    return [
        {"status": c.status, "what": f"doctor: {c.name}", "detail": c.detail, "fix": c.fix or "see doctor"}
        for c in report.checks
        if c.status != OK
    ]


def local_fingerprint() -> dict:
    from hf_dist_recipes.environment.fingerprint import environment_fingerprint

    try:
        return environment_fingerprint()
    except Exception as err:
        import socket

        return {"host": socket.gethostname(), "fingerprint_error": f"{type(err).__name__}: {err}"}


def environment_check(gather: Gather) -> tuple[list[CheckResult], list[str]]:
    """Check 1: the doctor on every rank and the ranks' environments agreeing. Returns (results, host per rank)."""
    from hf_dist_recipes.environment.fingerprint import describe_differences, fingerprint_differences

    fingerprints = [dict(fp) for fp in gather(local_fingerprint())]
    hosts = [str(fp.get("host")) for fp in fingerprints]
    doctor = gather(local_doctor())
    results = merge_by_rank("environment", doctor, hosts)
    diffs = fingerprint_differences(fingerprints)
    if diffs:
        results.append(
            CheckResult(
                "environment",
                ERROR,
                describe_differences(fingerprints, diffs).split(". Install")[0],
                fix="install the same versions on every node: `hf-dist-recipes pin --output DIR` on a good node "
                "writes a "
                "lock and an image, `hf-dist-recipes doctor --lock DIR/requirements.lock` on each node names what "
                "drifted",
                ranks=tuple(diffs),
                data={"fingerprints": fingerprints},
            )
        )
    if not results:
        distinct = sorted(set(hosts))
        results.append(
            CheckResult(
                "environment",
                OK,
                f"the doctor's checks pass on all {len(fingerprints)} rank(s) on {len(distinct)} "
                f"host(s) ({', '.join(distinct)}), and their environments agree (torch {fingerprints[0].get('torch')}, "
                f"deepspeed {fingerprints[0].get('deepspeed')}, transformers {fingerprints[0].get('transformers')})",
                data={"fingerprint": fingerprints[0]},
            )
        )
    return results, hosts


def local_backend() -> dict:
    """This rank's live process-group backend and the policy's verdict on it (`backend.check_process_group_backend`,
    with the GPUs this process sees unless the launch asked for the CPU)."""
    from hf_dist_recipes.comm import backend
    from hf_dist_recipes.environment import cuda_host

    gpus = 0 if cuda_host.cpu_request(False) else backend.cuda_device_count()
    try:
        live = backend.check_process_group_backend(cuda_devices=gpus)
    except ValueError as err:
        live, problem = None, (str(err).split(". ")[0], str(err).split(". ", 1)[-1])
    else:
        no_group = ("no process group on this rank", "launch with accelerate launch (the preflight does)")
        problem = deepspeed_dropped() or (no_group if live is None else None)
    detail, fix = problem or ("", "")
    return {"status": ERROR if problem else OK, "backend": live, "gpus": gpus, "detail": detail, "fix": fix}


def deepspeed_dropped(environ=None) -> tuple[str, str] | None:
    """(detail, fix) when the launch asks for DeepSpeed (`accelerate launch` sets ACCELERATE_USE_DEEPSPEED for a
    DEEPSPEED config) but ACCELERATE_USE_CPU is true in the ranks' environment: accelerate 1.16 then builds its
    state for the CPU without the DeepSpeed plugin (state.py AcceleratorState: ACCELERATE_USE_CPU -> cpu=True), so
    the Trainer trains without ZeRO, TP or EP and nothing says so (seen: `trainer.is_deepspeed_enabled` False in the
    training check). accelerate launch itself never sets ACCELERATE_USE_CPU for DeepSpeed launches: it comes from
    the user's shell. None when the launch is sound."""
    import os

    from hf_dist_recipes.environment.cuda_host import TRUE_VALUES

    env = os.environ if environ is None else environ
    wants_ds = env.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() == "true"
    cpu = env.get("ACCELERATE_USE_CPU", "").strip().lower() in TRUE_VALUES
    if not (wants_ds and cpu):
        return None
    return (
        f"the launch config asks for DeepSpeed but ACCELERATE_USE_CPU={env['ACCELERATE_USE_CPU']} is set: "
        "accelerate then drops DeepSpeed and the job trains without ZeRO/TP/EP, silently",
        "unset ACCELERATE_USE_CPU in the launching shell (use_cpu: true in the YAML is how a DeepSpeed launch "
        "asks for the CPU)",
    )


def backend_check(gather: Gather, hosts: Sequence[str]) -> list[CheckResult]:
    """Check 2: every rank's live process group is the one the policy wants for its host (NCCL with GPUs)."""
    rows = gather(local_backend())
    bad = [(r, row) for r, row in enumerate(rows) if row["status"] != OK]
    if bad:
        return merge_by_rank(
            "backend",
            [
                [{"status": row["status"], "what": "process group", "detail": row["detail"], "fix": row["fix"]}]
                if row["status"] != OK
                else []
                for row in rows
            ],
            hosts,
        )
    backends = sorted({row["backend"] for row in rows})
    gpus = sorted({row["gpus"] for row in rows})
    where = "CPU-only (use_cpu, or no GPU visible)" if gpus == [0] else f"{'/'.join(map(str, gpus))} GPU(s) per process"
    status, fix = OK, ""
    if len(backends) > 1:
        status, fix = WARNING, "launch every machine with the same accelerate config"
    return [
        CheckResult(
            "backend",
            status,
            f"process group backend {', '.join(backends)} on all {len(rows)} rank(s), {where}: right for the host",
            fix=fix,
            data={"backends": backends, "gpus": gpus},
        )
    ]
