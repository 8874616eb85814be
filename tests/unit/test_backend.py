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

