"""An optimizer's state through a safetensors file (train/optimizer_state.py): the same state back, the same next
step, and a file that is not this optimizer's state refused naming it."""

import pytest
import torch

from miles_core.train.optimizer_state import load_optimizer, save_optimizer
from miles_core.weights.check import CheckpointError


def trained(seed: int = 0, fused: bool = True) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A small model and its AdamW after three steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    for _ in range(3):
        step(model, optimizer)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.linspace(-1, 1, 12).view(3, 4)).square().sum().backward()
    optimizer.step()


@pytest.mark.parametrize("fused", [True, False])
def test_the_state_comes_back_and_the_next_step_is_the_same(tmp_path, fused):
    model, optimizer = trained(fused=fused)
    save_optimizer(optimizer, tmp_path / "optimizer.safetensors")
    copy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    copy.load_state_dict(model.state_dict())
    resumed = torch.optim.AdamW(copy.parameters(), lr=1.0, fused=fused)  # its own settings are replaced by the saved ones
    load_optimizer(resumed, tmp_path / "optimizer.safetensors")
    saved, loaded = optimizer.state_dict(), resumed.state_dict()
    assert loaded["param_groups"] == saved["param_groups"] and isinstance(loaded["param_groups"][0]["betas"], tuple)
    assert loaded["state"].keys() == saved["state"].keys()
    for index, values in saved["state"].items():
        assert loaded["state"][index].keys() == values.keys()
        assert all(torch.equal(loaded["state"][index][k], v) and loaded["state"][index][k].dtype == v.dtype for k, v in values.items())
    step(model, optimizer)
    step(copy, resumed)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copy.parameters()))


def test_a_file_that_is_not_this_optimizers_state_is_refused_naming_it(tmp_path):
    _, optimizer = trained()
    path = tmp_path / "optimizer.safetensors"
    save_optimizer(optimizer, path)
    other = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters())  # two parameters where the state has four
    with pytest.raises(CheckpointError, match=f"{path}: not the optimizer state of this model"):
        load_optimizer(other, path)
    path.write_bytes(path.read_bytes()[:100])  # cut short
    with pytest.raises(CheckpointError, match=f"{path}: not the optimizer state"):
        load_optimizer(optimizer, path)


def test_a_checkpoint_written_before_holds_the_state_as_torch_saved_it_and_it_is_read(tmp_path):
    """A run resumed across the change of format keeps its optimizer's moments: optimizer.pt, read where no
    optimizer.safetensors is; with neither (a converted checkpoint), the optimizer is left as it was."""
    model, optimizer = trained()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed = torch.optim.AdamW(model.parameters(), lr=1.0)
    load_optimizer(resumed, tmp_path / "optimizer.safetensors")
    assert resumed.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    assert all(torch.equal(resumed.state[p]["exp_avg"], optimizer.state[p]["exp_avg"]) for p in model.parameters())
    fresh = torch.optim.AdamW(model.parameters(), lr=1.0)
    load_optimizer(fresh, tmp_path / "empty" / "optimizer.safetensors")
    assert not fresh.state and fresh.param_groups[0]["lr"] == 1.0
    (tmp_path / "optimizer.pt").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="optimizer.pt: not the optimizer state"):
        load_optimizer(fresh, tmp_path / "optimizer.safetensors")
