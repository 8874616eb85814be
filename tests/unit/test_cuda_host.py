"""A machine with NVIDIA GPUs that torch cannot use stops with the reason instead of training on the CPU.

Fakes: this project's machine has no NVIDIA GPU, driver or nvidia-smi, so the hardware facts are faked -- a dev
folder in tmp_path with the device files a 2-GPU node has, and an `nvidia-smi` shell script printing what the real
one prints on such a node. What torch sees is injected (`cuda_devices=0`, `backend.cuda_device_count`), and
`torch.version.cuda` is set per test, so every test means the same on a CPU host and on a GPU host.
"""

import logging
import os
import stat
import warnings

import pytest
import torch

from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes.comm import process_setup
from hf_dist_recipes.environment import cuda_host
from hf_dist_recipes.environment.cuda_host import check_torch_sees_gpus

H100_LIST = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f2c0d3e-8f3a-4b7e-9a1c-1d2e3f4a5b6c)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-0a9b8c7d-6e5f-4a3b-2c1d-0e9f8a7b6c5d)"""
SMI_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
    "latest NVIDIA driver is installed and running."
)


def _dev_dir(tmp_path, names=("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset")):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in names:
        (dev / name).write_text("")
    return str(dev)


def _nvidia_smi(tmp_path, driver="550.54.15", fail=False):
    """A stand-in for nvidia-smi on a 2 x H100 node: `-L` and the driver query, as the real tool prints them."""
    script = tmp_path / "nvidia-smi"
    if fail:
        body = f'echo "{SMI_NO_DRIVER}"\nexit 9\n'
    else:
        body = (
            f'case "$1" in\n  -L) cat <<EOF\n{H100_LIST}\nEOF\n  ;;\n'
            f'  --query-gpu=driver_version) printf "{driver}\\n{driver}\\n" ;;\n  *) exit 2 ;;\nesac\n'
        )
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.fixture
def cuda_wheel(monkeypatch):
    """torch as a CUDA 12.4 wheel would report itself, whatever wheel this host has."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_device_files_are_the_gpus_not_the_control_files(tmp_path):
    dev = _dev_dir(
        tmp_path,
        names=("nvidia10", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps"),
    )
    assert cuda_host.nvidia_device_files(dev) == [os.path.join(dev, "nvidia2"), os.path.join(dev, "nvidia10")]


def test_nvidia_smi_output_is_read(tmp_path):
    host = cuda_host.inspect_host(dev_dir=_dev_dir(tmp_path), nvidia_smi=_nvidia_smi(tmp_path, driver="535.104.05"))
    assert host.gpu_count == 2 and host.driver_version == "535.104.05"
    assert host.smi_gpus[1].startswith("GPU 1: NVIDIA H100")


def test_cpu_only_wheel_is_named_with_the_install_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ValueError, match="2 NVIDIA GPU.* torch sees none") as err:
        check_torch_sees_gpus(cuda_devices=0, dev_dir=_dev_dir(tmp_path), nvidia_smi=_nvidia_smi(tmp_path))
    message = str(err.value)
    assert "is a CPU-only build" in message
    base = torch.__version__.split("+")[0]
    assert f"pip install torch=={base} --index-url https://download.pytorch.org/whl/cu130" in message
    assert "allow_cpu_with_gpus" in message


def test_driver_too_old_for_the_wheels_cuda(tmp_path, cuda_wheel):
    # 470.82.01 is a CUDA 11.4 driver; CUDA 12.x needs >= 525.60.13 (NVIDIA CUDA Compatibility guide).
    smi = _nvidia_smi(tmp_path, driver="470.82.01")
    with pytest.raises(
        ValueError,
        match=r"driver 470\.82\.01 is older than torch's CUDA 12\.4 needs "
        r"\(>= 525\.60\.13\)",
    ):
        check_torch_sees_gpus(cuda_devices=0, dev_dir=_dev_dir(tmp_path), nvidia_smi=smi)


def test_driver_at_the_floor_is_not_blamed_and_torchs_own_words_are_repeated(tmp_path, cuda_wheel, monkeypatch):
    # 525.60.13 is exactly the 12.x floor, so the driver is fine and the reason must come from torch itself.
    said = "CUDA initialization: Unexpected error from cudaGetDeviceCount(). Error 802: system not yet initialized"
    monkeypatch.setattr(cuda_host, "torch_cuda_warnings", lambda: [said])
    with pytest.raises(ValueError) as err:
        check_torch_sees_gpus(
            cuda_devices=0, dev_dir=_dev_dir(tmp_path), nvidia_smi=_nvidia_smi(tmp_path, driver="525.60.13")
        )
    assert f"torch says: {said}" in str(err.value) and "older" not in str(err.value)


def test_floors_per_cuda_major():
    # NVIDIA CUDA Compatibility guide, minor-version compatibility: 11.x 450.80.02, 12.x 525.60.13, 13.x 580.
    assert [cuda_host.min_driver_for_cuda(v) for v in ("11.8", "12.0", "12.8", "13.0", "99.1")] == [
        "450.80.02",
        "525.60.13",
        "525.60.13",
        "580",
        None,
    ]


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles"])
def test_hidden_gpus_are_named(tmp_path, cuda_wheel, monkeypatch, value):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    with pytest.raises(ValueError, match=f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU"):
        check_torch_sees_gpus(cuda_devices=0, dev_dir=_dev_dir(tmp_path), nvidia_smi=_nvidia_smi(tmp_path))


@pytest.mark.parametrize(
    "value", ["", "-1", "NoDevFiles", "0", "1,0", "+1", "-0", "2gpu", "GPU-5f2c0d3e", "MIG-0a9b", " 3", "a,0"]
)
def test_hidden_gpus_agree_with_torchs_own_parser(monkeypatch, value):
    # The reference is torch's parser itself (private; read by the test only), for the non-ROCm reading.
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert cuda_host.visible_devices_hide_all(value) == (torch.cuda._parse_visible_devices() == [])


def test_broken_driver_is_named_from_nvidia_smi(tmp_path, cuda_wheel):
    with pytest.raises(ValueError, match="driver does not answer .nvidia-smi: NVIDIA-SMI has failed"):
        check_torch_sees_gpus(cuda_devices=0, dev_dir=_dev_dir(tmp_path), nvidia_smi=_nvidia_smi(tmp_path, fail=True))


def test_no_nvidia_hardware_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    dev = _dev_dir(tmp_path, names=("null", "shm"))
    host = check_torch_sees_gpus(cuda_devices=0, dev_dir=dev, nvidia_smi=str(tmp_path / "absent-nvidia-smi"))
    assert host.gpu_count == 0
    # nvidia-smi installed on a node without GPU device files (it then fails): no GPU is lost either.
    broken = _nvidia_smi(tmp_path, fail=True)
    assert check_torch_sees_gpus(cuda_devices=0, dev_dir=dev, nvidia_smi=broken).gpu_count == 0


def test_torch_seeing_gpus_or_the_opt_out_passes(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.version, "cuda", None)
    dev, smi = _dev_dir(tmp_path), _nvidia_smi(tmp_path)
    assert check_torch_sees_gpus(cuda_devices=2, dev_dir=dev, nvidia_smi=smi) is None
    with caplog.at_level(logging.WARNING, logger=cuda_host.__name__):
        host = check_torch_sees_gpus(cuda_devices=0, allow_cpu_with_gpus=True, dev_dir=dev, nvidia_smi=smi)
    assert host.gpu_count == 2
    assert "training on the CPU although this machine has 2 NVIDIA GPU(s)" in caplog.text


def test_torchs_warning_is_caught_in_process_or_replayed_in_a_fresh_one(tmp_path, monkeypatch):
    said = "The NVIDIA driver on your system is too old (found version 11040)."

    def warns():
        warnings.warn(said, UserWarning, stacklevel=2)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", warns)
    assert cuda_host.torch_cuda_warnings() == [said]
    # torch warns once per process; a fresh interpreter says it again. This stand-in prints what torch prints.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    python = tmp_path / "python"
    python.write_text(
        f"#!/bin/sh\necho '/opt/venv/torch/cuda/__init__.py:174: UserWarning: CUDA initialization: "
        f"{said} (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)' >&2\n"
    )
    python.chmod(0o755)
    assert cuda_host.torch_cuda_warnings(str(python)) == [
        f"CUDA initialization: {said} (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)"
    ]


def test_the_arguments_stop_or_train_on_the_cpu_by_choice(tmp_path, monkeypatch):
    # torch sees no GPU (injected, so on a GPU host too) on a faked 2-GPU node with a CPU-only wheel.
    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(cuda_host, "DEV_DIR", _dev_dir(tmp_path))
    monkeypatch.setattr(cuda_host, "NVIDIA_SMI", _nvidia_smi(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    with pytest.raises(ValueError, match="CPU-only build.*allow_cpu_with_gpus=True"):
        RecipeTrainingArguments(output_dir=str(tmp_path / "out"))
    args = RecipeTrainingArguments(output_dir=str(tmp_path / "out"), allow_cpu_with_gpus=True)
    assert args.use_cpu is True and args.allow_cpu_with_gpus is True


@pytest.mark.parametrize("name", ["ACCELERATE_USE_CPU", "HF_DIST_RECIPES_USE_CPU"])
@pytest.mark.parametrize("value", ["true", "True", "1", "yes", "false", "False", "0", "no", ""])
def test_cpu_request_reads_use_cpu_and_the_variables_as_accelerate_reads_its_own(name, value):
    from accelerate.utils import str_to_bool

    assert cuda_host.cpu_request(True, {}) == "use_cpu=True"
    assert cuda_host.cpu_request(False, {}) is None
    # accelerate's own reading of ACCELERATE_USE_CPU (launch sets it, PartialState reads it) is the reference.
    expected = bool(str_to_bool(value)) if value else False
    asked = cuda_host.cpu_request(False, {name: value})
    assert (asked is not None) == expected
    if asked:
        assert asked == f"{name}={value}"


def test_an_explicit_cpu_request_on_a_gpu_machine_with_hidden_gpus_trains_on_the_cpu(
    tmp_path, cuda_wheel, monkeypatch, caplog
):
    """What the CPU launches of this suite do on a GPU host: CUDA_VISIBLE_DEVICES="" plus a use_cpu config."""
    # Fakes: the 2-GPU node (dev folder, nvidia-smi script) and torch seeing none of them (device count 0).
    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 0)
    monkeypatch.setattr(cuda_host, "DEV_DIR", _dev_dir(tmp_path))
    monkeypatch.setattr(cuda_host, "NVIDIA_SMI", _nvidia_smi(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.delenv("HF_DIST_RECIPES_USE_CPU", raising=False)
    # Nothing asked for the CPU: the silent fallback is still stopped, naming the variable.
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='' hides every GPU.*use_cpu=True"):
        RecipeTrainingArguments(output_dir=str(tmp_path / "out"))
    with caplog.at_level(logging.INFO, logger="hf_dist_recipes.environment.cuda_host"):
        args = RecipeTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True)
    assert args.use_cpu is True and args.ddp_backend is None and args.bf16 is False
    assert "as use_cpu=True asks, although this machine has 2 NVIDIA GPU(s)" in caplog.text
    for name, value in (("ACCELERATE_USE_CPU", "True"), ("HF_DIST_RECIPES_USE_CPU", "1")):
        # accelerate's plain launcher sets the first from use_cpu: true; its DeepSpeed launcher passes nothing on,
        # so a DeepSpeed CPU run (this suite's, tests.support.launch.cpu_only_env) sets the second.
        monkeypatch.setenv(name, value)
        args = RecipeTrainingArguments(output_dir=str(tmp_path / "out"))
        assert args.use_cpu is True and args.bf16 is False
        monkeypatch.setenv(name, "False")  # what accelerate sets from a GPU config: no request
    with pytest.raises(ValueError, match="hides every GPU"):
        RecipeTrainingArguments(output_dir=str(tmp_path / "out"))


def test_an_explicit_cpu_request_with_visible_gpus_chooses_gloo_and_fp32(tmp_path, monkeypatch):
    # Fakes: 8 visible bf16 GPUs (device count and bf16 support replaced) on a faked 2-GPU dev folder; the stock
    # __post_init__ is run, on the CPU this host has (use_cpu=True asks for nothing else).
    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)
    monkeypatch.setattr("hf_dist_recipes.environment.precision.cuda_bf16_supported", lambda: True)
    monkeypatch.setattr(cuda_host, "DEV_DIR", _dev_dir(tmp_path))
    monkeypatch.setattr(cuda_host, "NVIDIA_SMI", _nvidia_smi(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.delenv("HF_DIST_RECIPES_USE_CPU", raising=False)
    args = RecipeTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True)
    # Without the request the same host gets NCCL and bf16 (tests/unit/test_precision.py); asked, the CPU's choices.
    assert args.use_cpu is True and args.ddp_backend is None and args.bf16 is False
    assert process_setup.current().nccl_env_applied == {}


def test_accelerates_deepspeed_launcher_passes_no_use_cpu_on():
    """Why HF_DIST_RECIPES_USE_CPU exists: accelerate 1.16 tells the ranks of its plain launcher about use_cpu
    (ACCELERATE_USE_CPU) and those of its DeepSpeed launcher nothing. When this fails, the launch config's use_cpu
    reaches DeepSpeed ranks and the recipe variable may go."""
    import inspect

    from accelerate.utils import launch

    assert "ACCELERATE_USE_CPU" in inspect.getsource(launch.prepare_simple_launcher_cmd_env)
    assert "USE_CPU" not in inspect.getsource(launch.prepare_deepspeed_cmd_env)
