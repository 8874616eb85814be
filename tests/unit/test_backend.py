"""The CUDA host is faked (no GPU here): only the device count is replaced, the policy code runs as shipped."""

import pytest

from hf_dist_recipes.backend import resolve_backend


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
    from hf_dist_recipes.backend import check_process_group_backend

    with pytest.raises(ValueError, match="runs on 'gloo' although 2 CUDA GPU"):
        check_process_group_backend(cuda_devices=2)
    assert check_process_group_backend(cuda_devices=2, allow_gloo_on_cuda=True) == "gloo"
    assert check_process_group_backend(cuda_devices=0) == "gloo"


def test_no_process_group_means_nothing_to_check():
    from hf_dist_recipes.backend import check_process_group_backend

    assert check_process_group_backend(cuda_devices=8) is None


def test_a_gloo_group_is_destroyed_by_the_exit_handler(tmp_path):
    import torch.distributed as dist

    from hf_dist_recipes.backend import destroy_gloo_group

    assert destroy_gloo_group() is False  # nothing to destroy
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert destroy_gloo_group() is True and not dist.is_initialized()
