"""checkpoint/resume_loading.py: the checkpoint engine that memory-maps a resume's files and copies the optimizer
states out afterwards, on real files and a real torch optimizer, with DeepSpeed's own `TorchCheckpointEngine` inside.
The trainer-level proof (a 2-rank resume equal to the uninterrupted run, every file mapped) is
tests/distributed/test_checkpoint_lifecycle.py::test_resume_continues_exactly; the memory it saves,
benchmarks/resume_host_memory.py."""

from types import SimpleNamespace

import pytest
import torch

from hf_dist_recipes.checkpoint import resume_loading
from hf_dist_recipes.checkpoint.resume_loading import MappedLoads, mapped_files


@pytest.fixture(scope="module")
def torch_engine():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return TorchCheckpointEngine


def _stepped_adam(seed: int) -> tuple[torch.nn.Parameter, torch.optim.Adam]:
    torch.manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(1000))
    optimizer = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.randn(1000)
    optimizer.step()
    return param, optimizer


def _saved_checkpoint(tmp_path, zipped: bool = True):
    """A file shaped like a ZeRO optimizer file: an fp32 partition and the optimizer state dict."""
    param, optimizer = _stepped_adam(seed=0)
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = {"fp32_flat_groups": [param.detach().clone()], "optimizer_state_dict": optimizer.state_dict()}
    torch.save(state, path, _use_new_zipfile_serialization=zipped)
    return path, optimizer.state_dict()


def test_a_resume_maps_the_file_and_leaves_the_optimizer_states_in_memory_of_their_own(tmp_path, torch_engine):
    path, saved = _saved_checkpoint(tmp_path)
    loads = MappedLoads(torch_engine())
    loaded = loads.load(str(path), map_location="cpu")
    assert [(f.path, f.mapped) for f in loads.loads] == [(str(path), True)]
    assert str(path.resolve()) in mapped_files()
    param, optimizer = _stepped_adam(seed=1)  # the live states a resume replaces
    param.data.copy_(loaded["fp32_flat_groups"][0])
    optimizer.load_state_dict(loaded["optimizer_state_dict"])
    state = optimizer.state[param]
    # torch keeps the loaded tensors themselves as the state: without the copy they would stay pages of the file.
    assert loads.is_mapped(state["exp_avg"]) and loads.is_mapped(state["exp_avg_sq"])
    del loaded
    record = loads.materialize([optimizer])
    assert not any(loads.is_mapped(v) for v in state.values())
    assert str(path.resolve()) not in mapped_files() and record.still_mapped == ()
    assert record.copied_bytes == 2 * 1000 * 4 + 4  # the two moments and Adam's step tensor
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(state[key], saved["state"][0][key], rtol=0, atol=0)
    state["exp_avg"].add_(1.0)  # a copy of its own: writes stay in the process
    reread = torch.load(path, weights_only=False)["optimizer_state_dict"]["state"][0]["exp_avg"]
    torch.testing.assert_close(reread, saved["state"][0]["exp_avg"], rtol=0, atol=0)


def test_a_legacy_file_is_read_whole_by_deepspeed(tmp_path, torch_engine):
    path, saved = _saved_checkpoint(tmp_path, zipped=False)
    loads = MappedLoads(torch_engine())
    loaded = loads.load(str(path), map_location="cpu")
    assert [f.mapped for f in loads.loads] == [False] and str(path.resolve()) not in mapped_files()
    torch.testing.assert_close(loaded["optimizer_state_dict"]["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])


def test_another_engines_load_and_every_other_call_are_the_inner_engines(tmp_path):
    calls = []

    class OwnLoader:
        name = "own"

        def load(self, path, map_location=None):
            calls.append(("load", path))
            return {"read": "by its own load"}

        def save(self, state_dict, path):
            calls.append(("save", path))

    loads = MappedLoads(OwnLoader())
    path, _ = _saved_checkpoint(tmp_path)
    assert loads.load(str(path)) == {"read": "by its own load"} and not loads.loads[0].mapped
    loads.save({}, "elsewhere.pt")
    assert loads.name == "own" and calls == [("load", str(path)), ("save", "elsewhere.pt")]


def test_install_maps_the_engines_loads_and_copies_the_states_out_when_load_checkpoint_returns(tmp_path, torch_engine):
    path, saved = _saved_checkpoint(tmp_path)
    param, optimizer = _stepped_adam(seed=1)

    def load_checkpoint(load_dir):  # what DeepSpeed's does with the optimizer file, in short
        loaded = engine.checkpoint_engine.load(load_dir, map_location="cpu")
        optimizer.load_state_dict(loaded["optimizer_state_dict"])
        return load_dir, {}

    engine = SimpleNamespace(checkpoint_engine=torch_engine(), optimizer=optimizer, load_checkpoint=load_checkpoint)
    installed = resume_loading.install(engine)
    assert resume_loading.install(engine) is installed and resume_loading.installed(engine) is installed
    assert engine.load_checkpoint(str(path)) == (str(path), {})
    record = installed.record()
    assert [f.mapped for f in record.files] == [True] and record.copied_bytes > 0 and record.still_mapped == ()
    assert not any(installed.is_mapped(v) for v in optimizer.state[param].values())
    torch.testing.assert_close(optimizer.state[param]["exp_avg_sq"], saved["state"][0]["exp_avg_sq"])
