"""Why a job hung: every rank's flight recorder and stack read together (`hf-dist-recipes logs hang DIR`).

`diagnose(path)` -> `HangDiagnosis`: the first collective where the ranks part (process group, sequence id, op,
sizes), what each rank called there and from which line, the ranks that never arrived (behind in that group, or
with no dump at all: lost, killed, frozen), op / shape / dtype mismatches, and each rank's state: the reason and
message of its dump, the last collective it issued, its stack top and its innermost frame in the user's code (the
frame rule: `comm.hang_files`). `status` is "error" when a rank is named (exit 1, `core.findings.HANG_EXIT`), "ok"
when the dumps agree (exit 0); a folder without dumps is a ValueError (exit 2). `HANG_SCHEMA`: the JSON schema of
`to_dict()`, derived from the dataclasses.

What is torch's and what is ours:
- torch's (`torch.distributed.flight_recorder`, through `_compat.torch.fr_match_collectives`): the pairing of the ranks'
  entries into collectives by (group, sequence id) from the first record all ranks hold (`align_trace_from_beginning`,
  `build_collectives`), and the match rules (`Op.match`: op, input/output sizes, all_gather's world-size rule,
  dtypes), which give the first mismatch of each group, its kind and torch's own sentence, and the members missing
  from it. Not rewritten: the same rules as `python -m torch.distributed.flight_recorder.fr_trace`.
- ours, because torch's analyser lacks it: (1) the groups. Gloo's dumps name their `pg_config` "" with no ranks
  (torch 2.13), so the groups are rebuilt from the entries' `process_group` (name, description); the default group
  has every rank, a sub-group the ranks that recorded it (or the ranks the dump lists). (2) Ranks with no dump:
  torch's builder then either stops (`check_no_missing_dump_files`) or, with partial analysis, matches nothing; here
  the matching runs over the ranks that dumped and the others are named as never arrived. (3) The stacks
  (`stack_rank_<N>.json`), which torch's analyser does not read ("tracebacks aren't implemented"), the call sites of
  each collective from the recorder's frames, the frame rule, and which rank is where, in words and as JSON.
  (4) The world size, which a Gloo dump does not always state: the largest of the ranks seen, the default group's
  ranks in `pg_config`, `world_size` in a stack file, and `world_size=` given by the caller.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Literal

from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.comm.hang_files import (
    Frame,
    RankFiles,
    find_dump_dir,
    make_frame,
    read_rank_files,
    thread_frames,
    top_frame,
)
from hf_dist_recipes.core import findings
from hf_dist_recipes.core.findings import ERROR, HANG_EXIT, OK, ExitCode, Status, exit_code, json_schema

DivergenceKind = Literal[
    "not_arrived", "aborted", "op_mismatch", "shape_mismatch", "dtype_mismatch", "state_mismatch", "mismatch"
]
DEFAULT_GROUP_DESC = "default_pg"
FATAL_REASON = "fatal_signal"  # a rank's reason when only faulthandler's text of its death is there
# torch's MatchState names -> ours
_KINDS: dict[str, DivergenceKind] = {
    "COLLECTIVE_TYPE_MISMATCH": "op_mismatch",
    "SIZE_OR_SYNTAX_MISMATCH": "shape_mismatch",
    "COLLECTIVE_DTYPE_MISMATCH": "dtype_mismatch",
    "COLLECTIVE_STATE_MISMATCH": "state_mismatch",
}


@dataclass(frozen=True)
class CollectiveCall:
    """One rank's record of one collective. `group`: "<name> (<description>)"; `seq`: its collective sequence id in
    that group (p2p ops: their p2p sequence id); `op`: torch's name without the backend ("all_reduce"); `sizes`:
    input and output tensor shapes; `call_site`: the innermost library or user frame of the call, `user_frame` the
    innermost user frame (None when the recorder kept no frames, or none is of that kind); `created`: unix seconds
    at which the rank issued it."""

    rank: int
    group: str
    seq: int
    op: str
    backend: str
    input_sizes: list[list[int]]
    output_sizes: list[list[int]]
    dtypes: list[str]
    state: str
    created: float
    call_site: Frame | None
    user_frame: Frame | None

    def describe(self) -> str:
        where = self.user_frame or self.call_site
        at = f" at {where.file}:{where.line}" if where else ""
        return f"{self.op} #{self.seq} in={self.input_sizes} out={self.output_sizes}{at}"


@dataclass(frozen=True)
class RankState:
    """One rank at the moment of its dump. `reason`/`message`/`time`/`host`: from its stack file ("" / None without
    one); `recorded`: flight-recorder entries it holds; `last_call`: the last collective it issued (Gloo records no
    completion, so: the one it is in, or its last); `thread`, `stack_top`, `user_frame`: from its stack file's main
    thread, under the frame rule."""

    rank: int
    host: str
    reason: str
    message: str
    time: float | None
    has_recorder: bool
    has_stack: bool
    recorded: int
    last_call: CollectiveCall | None
    thread: str
    stack_top: Frame | None
    user_frame: Frame | None


@dataclass(frozen=True)
class Divergence:
    """Where the ranks part in one group: `seq` and `op` (the lowest rank's call there), `members` of the group,
    `calls` (each member's call at that sequence id, if it made one), `not_arrived` (members without a call there:
    behind, or without a dump), `odd_ranks` (ranks whose call differs from the majority's, when there is a majority,
    else []), `detail` (torch's match sentence, or ours), `waited_s` (from the first rank's call to the last dump;
    None when unknown)."""

    kind: DivergenceKind
    group: str
    seq: int
    op: str
    members: list[int]
    calls: list[CollectiveCall]
    not_arrived: list[int]
    odd_ranks: list[int]
    detail: str
    waited_s: float | None


@dataclass(frozen=True)
class HangDiagnosis:
    """Every rank's dump read together. `source`: the folder read; `ranks_without_files`: ranks of the world that
    wrote nothing; `first_divergence`: the earliest of `divergences` (one per group at most); `summary`: one line;
    `advice`: what to look at next (`ADVICE`, by the kind of the first divergence)."""

    source: str
    world_size: int
    status: Status
    summary: str
    advice: str
    first_divergence: Divergence | None
    divergences: list[Divergence]
    ranks: list[RankState]
    ranks_without_files: list[int]
    notes: list[str]
    json_extra: ClassVar[dict[str, object]] = {"exit_code": ExitCode}  # the key to_dict adds

    def exit_code(self) -> int:
        """1 when a rank is named (a divergence or a rank without dump), else 0 (`core.findings.HANG_EXIT`)."""
        return exit_code([self.status], HANG_EXIT)

    def to_dict(self) -> dict:
        return {**asdict(self), "exit_code": self.exit_code()}


HANG_SCHEMA: dict = json_schema(HangDiagnosis)


def _group_key(entry: dict) -> str:
    return str(entry["process_group"][0])


def _seq(entry: dict) -> int:
    return int(entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"])


def _call(rank: int, entry: dict, labels: dict[str, str]) -> CollectiveCall:
    backend, _, op = str(entry.get("profiling_name", "")).partition(":")
    frames = [make_frame(f.get("filename", ""), f.get("line", 0), f.get("name", "")) for f in entry.get("frames", [])]
    return CollectiveCall(
        rank=rank,
        group=labels[_group_key(entry)],
        seq=_seq(entry),
        op=op or backend,
        backend=backend if op else "",
        input_sizes=[list(s) for s in entry.get("input_sizes", [])],
        output_sizes=[list(s) for s in entry.get("output_sizes", [])],
        dtypes=sorted(set(entry.get("input_dtypes", [])) | set(entry.get("output_dtypes", []))),
        state=str(entry.get("state", "")),
        created=entry.get("time_created_ns", 0) / 1e9,
        call_site=top_frame(frames),  # the recorder's frames are innermost first
        user_frame=top_frame(frames, ("user",)),
    )


def _world_size(files: dict[int, RankFiles], given: int | None) -> int:
    sizes = [max(files, default=-1) + 1, given or 0]
    for f in files.values():
        sizes.append(int((f.stack or {}).get("world_size") or 0))
        for config in ((f.dump or {}).get("pg_config") or {}).values():
            if config.get("desc") == DEFAULT_GROUP_DESC or config.get("name") in ("", "0"):
                sizes.append(len(_ranks_of(config)))
    return max(sizes)


def _ranks_of(config: dict) -> list[int]:
    ranks = config.get("ranks", [])
    if isinstance(ranks, str):  # torch writes them as the text of a list
        ranks = [int(r) for r in ranks.strip("[]").split(",") if r.strip()]
    return list(ranks)


def _groups(files: dict[int, RankFiles], world: int) -> dict[str, tuple[str, list[int]]]:
    """{name: (description, members)} for every group an entry names (ours: Gloo's pg_config lists none)."""
    desc: dict[str, str] = {}
    seen: dict[str, set[int]] = {}
    listed: dict[str, set[int]] = {}
    for rank, f in files.items():
        for e in (f.dump or {}).get("entries", []):
            name = _group_key(e)
            desc.setdefault(name, str(e["process_group"][1]))
            seen.setdefault(name, set()).add(rank)
        for name, config in ((f.dump or {}).get("pg_config") or {}).items():
            if name and _ranks_of(config):
                listed.setdefault(str(name), set()).update(_ranks_of(config))
    groups = {}
    for name, d in desc.items():
        members = range(world) if d == DEFAULT_GROUP_DESC else (listed.get(name) or seen[name])
        groups[name] = (d, sorted(members))
    return groups


def _rank_state(rank: int, f: RankFiles | None, labels: dict[str, str]) -> RankState:
    stack = (f.stack if f else None) or {}
    fatal = f.fatal if f else None
    entries = ((f.dump if f else None) or {}).get("entries", [])
    thread, frames = thread_frames(stack) if stack else ("", [])
    reason, message = str(stack.get("reason", "")), str(stack.get("message", ""))
    if fatal and not stack:  # died of a fatal signal (Gloo's abort on a mismatch): faulthandler's stack instead
        thread, frames, reason, message = f"thread {fatal.thread}", fatal.frames, FATAL_REASON, fatal.error
    return RankState(
        rank=rank,
        host=str(stack.get("host", "")),
        reason=reason,
        message=message,
        time=stack.get("time"),
        has_recorder=bool(f and f.dump is not None),
        has_stack=bool(stack or fatal),
        recorded=len(entries),
        last_call=_call(rank, entries[-1], labels) if entries else None,
        thread=thread,
        stack_top=top_frame(frames),
        user_frame=top_frame(frames, ("user",)),
    )


def _majority_odd(calls: list[CollectiveCall]) -> list[int]:
    signature = {c.rank: (c.op, str(c.input_sizes), str(c.output_sizes), str(c.dtypes)) for c in calls}
    counts = Counter(signature.values())
    top, n = counts.most_common(1)[0] if counts else (None, 0)
    if n * 2 <= len(calls):
        return []
    return sorted(r for r, s in signature.items() if s != top)


def _divergence(
    kind: DivergenceKind,
    name: str,
    seq: int,
    detail: str,
    groups: dict[str, tuple[str, list[int]]],
    files: dict[int, RankFiles],
    labels: dict[str, str],
    dump_times: list[float],
) -> Divergence:
    members = groups[name][1]
    calls = []
    for r in members:
        entries = (files[r].dump or {}).get("entries", []) if r in files else []
        hit = next((e for e in entries if _group_key(e) == name and _seq(e) == seq), None)
        if hit is not None:
            calls.append(_call(r, hit, labels))
    arrived = {c.rank for c in calls}
    first = min(calls, key=lambda c: c.rank) if calls else None
    waited = max(dump_times) - min(c.created for c in calls) if calls and dump_times else None
    return Divergence(
        kind=kind,
        group=labels[name],
        seq=seq,
        op=first.op if first else "",
        members=members,
        calls=calls,
        not_arrived=[r for r in members if r not in arrived],
        odd_ranks=_majority_odd(calls) if kind not in ("not_arrived", "aborted") else [],
        detail=detail,
        waited_s=round(waited, 3) if waited is not None and waited >= 0 else None,
    )


def _kind_of(collective) -> tuple[DivergenceKind, str]:
    """Our kind and torch's sentence for one of torch's unmatched `Collective` records."""
    if collective.missing_ranks:
        missing = ", ".join(map(str, sorted(collective.missing_ranks)))
        return "not_arrived", f"torch: not all ranks joined; missing rank(s) {missing}"
    infos = [c.type_of_mismatch for c in (collective.mismatch_collectives or {}).values() if c.type_of_mismatch]
    if not infos:
        return "mismatch", "torch: the ranks' records at this sequence id do not match"
    kind = _KINDS.get(infos[0].state.name, "mismatch")
    return kind, "torch: " + "; ".join(sorted({str(i) for i in infos}))


def diagnose(path: str | Path, world_size: int | None = None) -> HangDiagnosis:
    """Read every rank's dump under `path` (the job's output directory, its logging directory or the
    `flight_recorder/` folder) and say where the ranks part. `world_size`: the job's number of ranks when the dumps
    may not show it (a lost highest rank). ValueError when there are no dumps or a file cannot be read."""
    directory = find_dump_dir(path)
    files = read_rank_files(directory)
    world = _world_size(files, world_size)
    groups = _groups(files, world)
    labels = {name: f"{name} ({d})" if d and d != "undefined" else name for name, (d, _) in groups.items()}
    dumped = {r: f.dump["entries"] for r, f in files.items() if f.dump is not None}
    notes = []
    version = next((str(f.dump.get("version", "")) for f in files.values() if f.dump is not None), "")
    if not dumped:
        notes.append("no rank wrote a flight-recorder dump (recorder off: TORCH_FR_BUFFER_SIZE=0?): stacks only")
    ranks_without_files = [r for r in range(world) if r not in files]
    dump_times = [float(f.stack["time"]) for f in files.values() if f.stack and f.stack.get("time")]

    divergences: list[Divergence] = []
    if dumped:
        # torch's matching over the ranks that dumped: a member without a dump would stop it (module docstring)
        present = {n: (d, [r for r in m if r in dumped]) for n, (d, m) in groups.items()}
        matched = compat_torch.fr_match_collectives(dumped, present, version)
        done: set[str] = set()
        for c in matched:
            name = str(c.group_id)
            if name in done or (c.pass_check and not c.missing_ranks):
                continue
            done.add(name)  # torch stops pairing a group after its first mismatch: the rest of it is noise
            kind, detail = _kind_of(c)
            divergences.append(_divergence(kind, name, c.collective_seq_id, detail, groups, files, labels, dump_times))
    silent = [r for r in range(world) if r not in dumped]
    if silent and dumped and not divergences:
        # every rank that dumped agrees: the ones that did not are where the job stops; the others wait at their
        # last collective
        last = max(((r, e[-1]) for r, e in dumped.items() if e), key=lambda x: x[1].get("time_created_ns", 0))
        name, seq = _group_key(last[1]), _seq(last[1])
        if any(r in silent for r in groups[name][1]):
            dead = [r for r in silent if r in files and files[r].fatal is not None and files[r].stack is None]
            lost = [r for r in silent if r not in dead]
            said = [f"{rank_list(lost)} wrote no flight-recorder dump (lost, killed or frozen)"] if lost else []
            if dead:
                said.append(
                    f"{rank_list(dead)} died of a fatal signal ({files[dead[0]].fatal.error}); Gloo aborts a rank "
                    "that receives more bytes than it expects: a size or op mismatch at this collective"
                )
            detail = "; ".join(said)
            kind: DivergenceKind = "aborted" if dead and not lost else "not_arrived"
            divergences.append(_divergence(kind, name, seq, detail, groups, files, labels, dump_times))
    divergences.sort(key=lambda d: min((c.created for c in d.calls), default=0.0))
    states = [_rank_state(r, files.get(r), labels) for r in range(world)]
    first = divergences[0] if divergences else None
    status = ERROR if first or ranks_without_files else OK
    return HangDiagnosis(
        source=str(directory),
        world_size=world,
        status=status,
        summary=_summary(first, ranks_without_files, states),
        advice=ADVICE[first.kind] if first else (ADVICE["lost"] if ranks_without_files else ADVICE["agree"]),
        first_divergence=first,
        divergences=divergences,
        ranks=states,
        ranks_without_files=ranks_without_files,
        notes=notes,
    )


# What to look at next, by the first divergence's kind ("lost": ranks wrote nothing; "agree": nothing parts).
ADVICE: dict[str, str] = {
    "not_arrived": "look at the stack top of the ranks that never arrived: a rank-dependent branch, a shorter "
    "dataset or an exception kept them from this collective; ranks that wrote nothing were lost, killed or frozen",
    "aborted": "Gloo aborted the ranks that died here: they received more bytes than they expected (another size, "
    "or another op, on the other side); compare what each rank passes at the lines above",
    "op_mismatch": "the ranks reached different collectives at the same point: find the rank-dependent code path "
    "between the last collective they shared and the lines above",
    "shape_mismatch": "the ranks passed tensors of different sizes to the same collective: check the shapes at the "
    "lines above (per-rank batch or sequence lengths, a rank-dependent slice)",
    "dtype_mismatch": "the ranks passed different dtypes to the same collective: check the casts before those lines",
    "state_mismatch": "the ranks disagree on the collective's state (NCCL): the rank still 'scheduled' never ran it",
    "mismatch": "the ranks' records at this collective differ: compare the calls above",
    "lost": "the ranks that wrote nothing were lost, killed or frozen: look at their logs and their hosts",
    "agree": "no desync in the dumps: the collective was slow or a rank was stuck outside collectives (its stack top)",
}
_KIND_WORDS: dict[str, str] = {
    "not_arrived": "not every rank arrived",
    "aborted": "a rank died in it",
    "op_mismatch": "different ops",
    "shape_mismatch": "different sizes",
    "dtype_mismatch": "different dtypes",
    "state_mismatch": "different states",
    "mismatch": "records that do not match",
}


def rank_list(ranks: list[int]) -> str:
    """ "rank 3" / "ranks 0-2, 5": consecutive ranks folded into ranges."""
    return f"rank{'s' if len(ranks) > 1 else ''} {findings.rank_list(ranks, min_run=2)}"


def where(frame: Frame | None) -> str:
    """ "file.py:12" (the file's name only), "" for None."""
    return f"{Path(frame.file).name}:{frame.line}" if frame else ""


def _summary(first: Divergence | None, without: list[int], states: list[RankState]) -> str:
    if first is None:
        if without:
            return f"{rank_list(without)} wrote nothing; the others' records agree"
        return "the ranks' records agree on every collective: no desync in the dumps (see each rank's stack)"
    parts: dict[str, list[int]] = {}
    for c in first.calls:
        at = where(c.call_site or c.user_frame)  # the innermost line that is not torch's: the collective's caller
        parts.setdefault(f"{c.op} {c.input_sizes}" + (f" at {at}" if at else ""), []).append(c.rank)
    last = {s.rank: s.last_call for s in states}
    by_rank = {s.rank: s for s in states}
    for r in first.not_arrived:
        call, state = last.get(r), by_rank.get(r)
        if call is None and state is not None and state.reason == FATAL_REASON:
            at = where(state.user_frame or state.stack_top)
            parts.setdefault(f"died ({state.message})" + (f" at {at}" if at else ""), []).append(r)
        elif call is None:
            parts.setdefault("no dump (lost, killed or frozen)", []).append(r)
        else:
            at = where(call.call_site or call.user_frame)
            parts.setdefault(f"not arrived (last: {call.op} #{call.seq}" + (f" at {at})" if at else ")"), []).append(r)
    said = "; ".join(f"{rank_list(ranks)}: {what}" for what, ranks in parts.items())
    return f"ranks part at collective #{first.seq} of group {first.group} ({_KIND_WORDS[first.kind]}): {said}"
