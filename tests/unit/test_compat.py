"""Fails when an installed upstream no longer matches what hf_dist_recipes/_compat.py relies on."""

import inspect
from importlib.metadata import version

import accelerate.utils.dataclasses as acc_dataclasses
import accelerate.utils.launch as acc_launch
import transformers.training_args as hf_args

from hf_dist_recipes import _compat


def test_installed_versions_are_the_covered_ones():
    for package, prefix in _compat.COVERED.items():
        assert version(package).startswith(prefix), f"{package} {version(package)}: re-check _compat.py, then COVERED"


def test_accelerate_hands_the_deepspeed_file_to_the_ranks_under_the_assumed_names():
    assert f'"{_compat.ACCELERATE_DEEPSPEED_CONFIG_FILE}"' in inspect.getsource(acc_launch)
    plugin_src = inspect.getsource(acc_dataclasses.DeepSpeedPlugin)
    assert f'os.environ.get("{_compat.ACCELERATE_DEEPSPEED_CONFIG_FILE}"' in plugin_src


def test_trainingarguments_builds_its_plugin_from_the_launcher_env():
    assert f'os.environ.get("{_compat.ACCELERATE_USE_DEEPSPEED}"' in inspect.getsource(hf_args.TrainingArguments)


def test_trainer_reads_the_tp_degree_only_from_the_arguments_config():
    """arguments.py adopts a launcher TP config into `args.deepspeed` because of this; if upstream starts reading
    the plugin's config too, the adoption can go."""
    from transformers import Trainer

    src = inspect.getsource(Trainer.get_tp_size)
    assert 'getattr(self.args, "hf_deepspeed_config", None)' in src
    assert "deepspeed_plugin" not in src


def test_accelerate_refuses_the_keys_lint_reports_beside_a_deepspeed_file():
    from hf_dist_recipes.parallel.lint import IGNORED_WITH_DS_FILE

    src = inspect.getsource(acc_dataclasses.DeepSpeedPlugin)
    assert "will be ignored" in src
    for key in IGNORED_WITH_DS_FILE:
        env = "ACCELERATE_" + ("" if key in ("mixed_precision", "gradient_accumulation_steps", "gradient_clipping")
                               else "DEEPSPEED_") + key.upper()
        assert f'"{env}"' in src, env
