"""`config generate / estimate / validate --sp`: Ulysses sequence parallelism from the command line. The YAML is read
back by accelerate's own launcher code (what `accelerate launch --config_file` does before it starts the ranks), so
the PARALLELISM_CONFIG_* variables checked here are the ones the ranks get."""

import json

import pytest
import yaml

from hf_dist_recipes.cli.main import main


def _run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _generate(capsys, tmp_path, *flags):
    code, out, err = _run(capsys, ["config", "generate", "--output", str(tmp_path), "--json", *flags])
    assert code == 0, err
    return json.loads(out)


def _launch_env(config_file) -> dict[str, str]:
    """The environment `accelerate launch --config_file config_file` gives its DeepSpeed ranks: accelerate's own
    argument handling and DeepSpeed launcher environment, without starting a process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_deepspeed and args.use_parallelism_config
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command sets it
    return prepare_deepspeed_cmd_env(args)[1]


@pytest.mark.parametrize("procs, shard", [(2, 1), (4, 2)])
def test_a_cpu_sp2_config_launches_with_accelerates_parallelism_variables(capsys, tmp_path, procs, shard):
    written = _generate(capsys, tmp_path, "--cpu", "--nodes", "1", "--gpus-per-node", str(procs), "--sp", "2")
    plan = written["plan"]
    # SP 2 on `procs` ranks: procs / 2 groups see different batches; a rank holds half of each 4,096-token sequence.
    assert (plan["sp"], plan["dp_size"], plan["tokens_per_rank"]) == (2, shard, 2048)
    assert written["yaml_file"].endswith(f"1x{procs}cpu_z3_sp2.yaml")
    env = _launch_env(written["yaml_file"])
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (env["PARALLELISM_CONFIG_SP_SIZE"], env["PARALLELISM_CONFIG_SP_BACKEND"]) == ("2", "deepspeed")
    assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == str(shard)  # world / sp: DeepSpeed's data-parallel world
    assert env["PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"] == "sdpa"
    # The ranks' ParallelismConfig, built from those variables, counts the same data-parallel ranks as the plan.
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            if key.startswith("PARALLELISM_CONFIG_"):
                mp.setenv(key, value)
        pc = ParallelismConfig()
    assert (pc.sp_size, pc.data_parallel_size, pc.sp_handler.sp_attn_implementation) == (2, shard, "sdpa")
    # What the JSON records for the ranks, and config validate passes it as written.
    ds = json.loads(open(written["deepspeed_file"]).read())
    assert ds["hf_dist_recipes"]["generated_for"]["sp"] == 2
    code, out, err = _run(capsys, ["config", "validate", written["yaml_file"], "--json"])
    assert (code, json.loads(out)) == (0, []), err


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--tp", "2"], "AutoTP replaces the sequence-parallel groups (engine.py:957)"),
        (["--ep", "2"], '"AutoEP does not currently support tensor model parallelism from mpu", engine.py:836'),
    ],
)
def test_generate_refuses_sp_with_tp_or_ep_in_one_line(capsys, tmp_path, flags, why):
    argv = ["config", "generate", "--model", "tiny-deepseek-v3", "--cpu", "--gpus-per-node", "4", "--sp", "2"]
    code, out, err = _run(capsys, [*argv, *flags, "--output", str(tmp_path)])
    assert code == 2 and out == "" and why in err and "DeepSpeed 0.19.8" in err
    assert len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written


def test_validate_catches_an_sp_block_whose_sizes_do_not_divide(capsys, tmp_path):
    written = _generate(capsys, tmp_path, "--cpu", "--gpus-per-node", "4", "--sp", "2")
    path = written["yaml_file"]
    data = yaml.safe_load(open(path).read())
    data["parallelism_config"]["parallelism_config_sp_size"] = 3  # 4 processes: no whole groups of 3
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    code, out, _ = _run(capsys, ["config", "validate", path, "--json"])
    errors = [f["message"] for f in json.loads(out) if f["level"] == "error"]
    assert code == 1 and any("parallelism_config_sp_size 3 does not divide num_processes 4" in m for m in errors)


def test_suggest_finds_sp_for_a_128k_sequence_and_prints_tokens_per_rank(capsys):
    argv = ["config", "estimate", "--model", "deepseek-v2-lite", "--gpus-per-node", "8", "--gpu-memory", "80"]
    argv += ["--seq-len", "131072", "--suggest"]
    code, out, _ = _run(capsys, [*argv, "--json"])
    data = json.loads(out)
    chosen = data["chosen"]["plan"]
    # No layout without SP fits 90% of 80 GiB at 128k tokens (958 GiB with EP 1); SP 8 with recomputation does.
    assert code == 0 and chosen["sp"] > 1 and (chosen["tp"], chosen["ep"]) == (1, 1)
    assert chosen["tokens_per_rank"] == data["tokens_per_rank"] == 131072 // chosen["sp"]
    assert data["chosen"]["device_total"] <= 0.9 * 80 * 2**30
    assert not any(r["fits"] for r in data["estimates"] if r["plan"]["sp"] == 1)
    code, text, _ = _run(capsys, argv)
    line = next(x for x in text.splitlines() if x.startswith("suggested: "))
    assert f"--sp {chosen['sp']} " in line and f"({131072 // chosen['sp']:,} tokens per rank)" in line


def test_validate_sp_assumes_another_degree_for_the_memory_check(capsys, tmp_path):
    flags = ["--model", "deepseek-v2-lite", "--gpus-per-node", "8", "--gpu-memory", "80", "--seq-len", "131072"]
    written = _generate(capsys, tmp_path, *flags, "--sp", "8", "--activation-checkpointing")
    assert written["plan"]["tokens_per_rank"] == 16384
    validate = ["config", "validate", written["yaml_file"], "--gpu-memory", "80", "--json"]
    code, out, _ = _run(capsys, validate)
    assert code == 0 and not [f for f in json.loads(out) if f["level"] == "error"]
    # The same files checked as if SP were 2: 65,536 tokens per rank do not fit (151 GiB by the estimate).
    code, out, _ = _run(capsys, [*validate, "--sp", "2"])
    messages = " ".join(f["message"] for f in json.loads(out) if f["level"] == "error")
    assert code == 1 and "SP 2" in messages and "131072 tokens (65536 per rank with SP 2)" in messages


def test_estimate_sp_prints_tokens_per_rank(capsys):
    argv = ["config", "estimate", "--model", "llama-3.1-8b", "--gpus-per-node", "8", "--seq-len", "32768"]
    code, out, _ = _run(capsys, [*argv, "--sp", "4", "--activation-checkpointing", "--gpu-memory", "80"])
    assert code == 0 and "seq 32768, 8192 tokens per rank (SP 4)," in out.splitlines()[0]
    assert "Z3 SP4 rc off:-" in out and "SP all-to-alls" in out
