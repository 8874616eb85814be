import json

import pytest

from hf_dist_recipes.planning.launch_config import check_launch_config, load_launch_config
from tests.support.paths import REPO


def _write(tmp_path, yaml_text, ds=None):
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
    path = tmp_path / "acc.yaml"
    path.write_text(yaml_text)
    return path


DS_YAML = (
    "distributed_type: DEEPSPEED\nnum_processes: {n}\nuse_cpu: true\n"
    "deepspeed_config:\n  deepspeed_config_file: ds.json\n"
)


def test_demo_configs_are_consistent():
    for name, world in (("cpu_zero3_2proc.yaml", 2), ("zero3_1node_8gpu.yaml", 8)):
        cfg = load_launch_config(REPO / "accelerate_configs" / name, root=REPO)
        assert cfg.deepspeed["zero_optimization"]["stage"] == 3
        assert check_launch_config(cfg) == world


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_launch_config(tmp_path / "nope.yaml")


def test_malformed_yaml_names_the_line(tmp_path):
    path = _write(tmp_path, "num_processes: 2\ndeepspeed_config: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML at line"):
        load_launch_config(path)


def test_yaml_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ValueError, match="mapping"):
        load_launch_config(_write(tmp_path, "- a\n- b\n"))


def test_malformed_deepspeed_json(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3,}')
    with pytest.raises(ValueError, match="not valid JSON"):
        load_launch_config(_write(tmp_path, DS_YAML.format(n=2)), root=tmp_path)


def test_num_processes_disagreeing_with_the_json(tmp_path):
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    cfg = load_launch_config(_write(tmp_path, DS_YAML.format(n=2), ds), root=tmp_path)
    with pytest.raises(ValueError, match=r"num_processes=2 .* set train_batch_size to 16"):
        check_launch_config(cfg)
    assert check_launch_config(cfg, num_processes=4) == 4


def test_tp_that_does_not_divide_the_processes(tmp_path):
    ds = {"tensor_parallel": {"autotp_size": 4}}
    cfg = load_launch_config(_write(tmp_path, DS_YAML.format(n=6), ds), root=tmp_path)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel degree 4"):
        check_launch_config(cfg)


def test_deepspeed_file_without_deepspeed_type(tmp_path):
    text = DS_YAML.format(n=2).replace("DEEPSPEED", "MULTI_CPU")
    cfg = load_launch_config(_write(tmp_path, text, {"zero_optimization": {"stage": 3}}), root=tmp_path)
    with pytest.raises(ValueError, match="set distributed_type: DEEPSPEED"):
        check_launch_config(cfg)


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_bad_num_processes(tmp_path, bad):
    with pytest.raises(ValueError, match="num_processes must be a positive integer"):
        load_launch_config(_write(tmp_path, f"num_processes: {bad}\n"))


def test_degrees_derived_from_the_json(tmp_path):
    ds = {
        "zero_optimization": {"stage": 3},
        "tensor_parallel": {"autotp_size": 2},
        "expert_parallel": {"enabled": True, "autoep_size": 4},
    }
    cfg = load_launch_config(_write(tmp_path, DS_YAML.format(n=8), ds), root=tmp_path)
    assert (cfg.view.tp, cfg.view.ep, cfg.view.stage) == (2, 4, 3)
    # A section switched off, one without `enabled` (DeepSpeed ignores it), or none at all, is degree 1; no
    # DeepSpeed JSON: stage 0.
    for ep in ({"enabled": False, "autoep_size": 4}, {"autoep_size": 4}):
        cfg = load_launch_config(_write(tmp_path, DS_YAML.format(n=8), {**ds, "expert_parallel": ep}), root=tmp_path)
        assert (cfg.view.tp, cfg.view.ep) == (2, 1)
    plain = load_launch_config(_write(tmp_path, "num_processes: 2\n"))
    assert (plain.view.tp, plain.view.ep, plain.view.stage) == (1, 1, 0)


def test_a_bad_tp_degree_raises_where_it_is_used_not_at_load(tmp_path):
    ds = {"tensor_parallel": {"autotp_size": "two"}}
    cfg = load_launch_config(_write(tmp_path, DS_YAML.format(n=2), ds), root=tmp_path)  # the lint reports it
    with pytest.raises(ValueError, match="refuses the config: tensor_parallel: .*input_value='two'"):
        check_launch_config(cfg)
