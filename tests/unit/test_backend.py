"""The CUDA host is faked (no GPU here) where a test passes `cuda_devices`: only the device count is replaced, the
policy code runs as shipped. The tests "on this host" fake nothing: Gloo on a CPU host, NCCL on a GPU host."""

import pytest
import torch

from hf_dist_recipes.comm.backend import resolve_backend
from tests.support.hosts import GPUS, needs_gpus


def test_this_hosts_default_backend():
    from hf_dist_recipes.comm.backend import cuda_device_count

    assert cuda_device_count() == GPUS
    assert resolve_backend(None) == ("nccl" if GPUS else "gloo")
    if GPUS:  # the CPU's backend refused where GPUs are visible, unless asked for
        with pytest.raises(ValueError, match=f"{GPUS} CUDA GPU"):
            resolve_backend("gloo")
    else:
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_backend("nccl")


def test_default_is_nccl_with_gpus_and_gloo_without():
    assert resolve_backend(None, cuda_devices=8) == "nccl"
    assert resolve_backend(None, cuda_devices=0) == "gloo"


def test_gloo_on_cuda_host_is_an_error_that_names_the_fix():
    with pytest.raises(ValueError, match="allow_gloo_on_cuda=True") as err:
        resolve_backend("gloo", cuda_devices=4)
    assert "4 CUDA GPU" in str(err.value)


def test_gloo_on_cuda_host_with_explicit_opt_out():
    assert resolve_backend("gloo", cuda_devices=4, allow_gloo_on_cuda=True) == "gloo"


def test_nccl_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_backend("nccl", cuda_devices=0)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown distributed backend"):
        resolve_backend("tcp", cuda_devices=0)


@pytest.fixture
def gloo_group(tmp_path):
    """A real one-rank Gloo process group (no launcher needed)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_live_gloo_group_on_a_faked_cuda_host_is_caught(gloo_group):
    # Fake: the device count (no GPU here); the process group is real.
    from hf_dist_recipes.comm.backend import check_process_group_backend

    with pytest.raises(ValueError, match="runs on 'gloo' although 2 CUDA GPU"):
        check_process_group_backend(cuda_devices=2)
    assert check_process_group_backend(cuda_devices=2, allow_gloo_on_cuda=True) == "gloo"
    assert check_process_group_backend(cuda_devices=0) == "gloo"


def test_no_process_group_means_nothing_to_check():
    from hf_dist_recipes.comm.backend import check_process_group_backend

    assert check_process_group_backend(cuda_devices=8) is None


def test_a_gloo_group_is_destroyed_by_the_exit_handler(tmp_path):
    import torch.distributed as dist

    from hf_dist_recipes.comm.backend import destroy_gloo_group

    assert destroy_gloo_group() is False  # nothing to destroy
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert destroy_gloo_group() is True and not dist.is_initialized()


@pytest.mark.gpu
@needs_gpus(1)
def test_live_nccl_group_on_this_gpu_host_passes(tmp_path):
    """The NCCL variant of the Gloo check above, nothing faked: a real one-rank NCCL group on GPU 0."""
    import torch.distributed as dist

    from hf_dist_recipes.comm.backend import check_process_group_backend

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert check_process_group_backend() == "nccl"
    finally:
        dist.destroy_process_group()
