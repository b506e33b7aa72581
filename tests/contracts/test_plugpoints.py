"""Every plug-point's default loads and fits its documented signature; bad paths name the field."""

import inspect

import pytest

from miles_core.config import RunConfig
from miles_core.plugins import PluginError, load_function
from miles_core.rewards.base import RewardFn
from miles_core.rollout.base import RolloutEngine
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.train.base import Trainer
from miles_core.train.torch_backend import TorchTrainer
from tasks.rl import REWARD_PARAMS


def test_default_reward_fn_fits_the_reward_protocol():
    fn = load_function(RunConfig().reward.fn, "reward.fn", REWARD_PARAMS)
    assert list(inspect.signature(fn).parameters) == list(inspect.signature(RewardFn.__call__).parameters)[1:]
    assert fn("132", "132", {}) == 1.0 and fn("garbage", "132", {}) == 0.0


@pytest.mark.parametrize(
    "path, needle",
    [
        ("no_colon", "not a dotted path"),
        ("miles_core.nope:fn", "cannot import module 'miles_core.nope'"),
        ("miles_core.rewards.math:nope", "has no callable 'nope'"),
        ("miles_core.rewards.math:first_integer", "does not take (response, label, metadata)"),
    ],
)
def test_bad_plugin_paths_name_the_field(path, needle):
    with pytest.raises(PluginError) as err:
        load_function(path, "reward.fn", REWARD_PARAMS)
    assert str(err.value).startswith("reward.fn: ") and needle in str(err.value)


def protocol_methods(protocol) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize("protocol, implementation", [(RolloutEngine, TorchEngine), (Trainer, TorchTrainer)])
def test_backends_implement_their_protocol(protocol, implementation):
    for name in protocol_methods(protocol):
        mine, theirs = inspect.signature(getattr(implementation, name)), inspect.signature(getattr(protocol, name))
        assert list(mine.parameters)[: len(theirs.parameters)] == list(theirs.parameters), name
