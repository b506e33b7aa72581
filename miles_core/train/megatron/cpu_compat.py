"""Lets megatron-core 0.16.1 run on CPU over gloo: the few places it hard-codes CUDA, redirected.

Activated by the megatron backend's entry point only, and only when `torch.cuda.is_available()`
is False; on a GPU node nothing here runs.  Pinned to one megatron-core version because every
redirection names a module of that version: `activate()` refuses any other version.

Three kinds of redirection, each one counted in `HITS` when it fires, so
tests/unit/test_megatron_compat.py can fail when one is no longer needed (never fires on the
paths we use) and when a new CUDA call appears (the path raises "not compiled with CUDA"):

* module-local `torch`: in the listed megatron modules the global name `torch` becomes a view of
  torch whose `torch.cuda` is a CPU stand-in (RNG state = the CPU generator, current_device =
  "cpu", synchronize/streams/events = no-ops) and whose tensor factories map `device="cuda"` to
  the CPU.  Only the attributes listed in `_CpuCuda` exist: any other CUDA call still raises.
* one function replaced: the MoE alltoall dispatcher's host copy of its split sizes.
* type-name checks: a few functions test `tensor.type() == 'torch.cuda.FloatTensor'`; while they
  run, `Tensor.type()` (without arguments) reports CPU tensors under their CUDA type names.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from collections import Counter

import torch

MEGATRON_CORE_VERSION = "0.16.1"
HITS: Counter = Counter()  # redirection name -> times it fired in this process

# Modules whose global `torch` is replaced, and why (each is a call site on our CPU paths).
TORCH_VIEW_MODULES = {
    "megatron.core.tensor_parallel.random": "RNG tracker: torch.cuda.get_rng_state / manual_seed / default_generators",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "inv_freq.to(torch.cuda.current_device())",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YaRN (MLA, gpt-oss) inv_freq moved to torch.cuda.current_device()",
    "megatron.core.transformer.utils": 'default and sliding-window causal masks built with device="cuda"',
    "megatron.core.transformer.dot_product_attention": "learnable softmax offsets (attention sinks) created on torch.cuda.current_device()",
    "megatron.core.optimizer.optimizer": "found_inf / scale tensors with device='cuda'",
    "megatron.core.optimizer.clip_grads": "grad-norm tensors with device='cuda'",
    "megatron.core.utils": "GlobalMemoryBuffer on torch.cuda.current_device()",
    "megatron.core.pipeline_parallel.p2p_communication": "torch.cuda.synchronize() after batched p2p",
    "megatron.core.pipeline_parallel.schedules": 'token counter with device="cuda"',
    "megatron.core.transformer.moe.token_dispatcher": "alltoall dispatcher: streams, current_device",
    "megatron.core.tensor_parallel.mappings": "all-gather and reduce-scatter buffers on torch.cuda.current_device() (MoE alltoall, sequence parallel)",
    "megatron.core.tensor_parallel.layers": "sequence-parallel backward: the input gradient's reduce-scatter buffer on torch.cuda.current_device()",
    "megatron.core.transformer.moe.router": "router weight moved to torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "torch.cuda.synchronize() before writing a checkpoint",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "finalize: results moved to torch.cuda.current_device()",
    "megatron.core.distributed.param_and_grad_buffer": "grad buffers allocated on torch.cuda.current_device()",
}
# Functions that compare Tensor.type() against CUDA type names.
TYPE_NAME_FUNCTIONS = {
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups": "param dtype check",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__": "fp16/bf16 main-param check",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32": "asserts grads are torch.cuda.FloatTensor",
}

_active = False


def _move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu converts to numpy only for CUDA tensors; the alltoall
    dispatcher then hands CPU tensors to all_to_all_single as split sizes, which gloo rejects."""
    HITS["megatron.core.transformer.moe.token_dispatcher: maybe_move_tensor_to_cpu"] += 1
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


# Functions replaced outright in one module: "module:name" -> replacement.
REPLACED_FUNCTIONS = {"megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu": _move_to_host}


class _Stream:
    """A stream/event stand-in: CPU work is already ordered, so waiting is a no-op."""

    def __init__(self, *args, **kwargs): ...
    def wait_stream(self, other) -> None: ...
    def wait_event(self, event) -> None: ...
    def record_event(self, event=None):
        return _Stream()

    def record(self, stream=None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None: ...


class _AnyKey(dict):
    def __missing__(self, key):
        return torch.default_generator


def _counted(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        HITS[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def _cpu_cuda(module: str) -> types.SimpleNamespace:
    """torch.cuda as one module sees it: the CPU generator, the CPU device, no-op synchronisation."""
    cuda = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0, default_generators=_AnyKey(), FloatTensor=torch.FloatTensor)
    stand_ins = {
        "current_device": lambda: "cpu",
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "manual_seed": torch.manual_seed,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: _Stream(),
        "stream": lambda stream=None: contextlib.nullcontext(),
        "Stream": _Stream,
        "Event": _Stream,
    }
    for name, fn in stand_ins.items():
        setattr(cuda, name, _counted(f"{module}: torch.cuda.{name}", fn))
    cuda.random = cuda
    return cuda


class _TorchView(types.ModuleType):
    """`torch` as seen from one megatron module: CPU stand-in for torch.cuda, CPU factories."""

    def __init__(self, module: str):
        super().__init__("torch")
        self.cuda = _cpu_cuda(module)
        for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like"):
            setattr(self, name, self._cpu_factory(module, getattr(torch, name)))

    @staticmethod
    def _cpu_factory(module: str, fn):
        @functools.wraps(fn)
        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                HITS[f"{module}: device=cuda"] += 1
                kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name):
        return getattr(torch, name)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names(function: str):
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            HITS[f"{function}: Tensor.type"] += 1
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _wrap_type_names(function: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names(function):
            return fn(*args, **kwargs)

    return wrapper


def _resolve(path: str):
    module_name, _, qualname = path.partition(":")
    owner = importlib.import_module(module_name)
    *parents, attr = qualname.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def activate() -> bool:
    """Install the redirections once per process when no GPU is present; True if installed."""
    global _active
    if _active or torch.cuda.is_available():
        return _active
    import megatron.core  # the optional training backend: imported only where it is used

    if megatron.core.__version__ != MEGATRON_CORE_VERSION:
        raise RuntimeError(f"cpu_compat is written for megatron-core {MEGATRON_CORE_VERSION}, found {megatron.core.__version__}")
    for name in TORCH_VIEW_MODULES:
        importlib.import_module(name).torch = _TorchView(name)
    for path in TYPE_NAME_FUNCTIONS:
        owner, attr = _resolve(path)
        raw = owner.__dict__[attr]
        wrapped = _wrap_type_names(path, raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw)
        setattr(owner, attr, type(raw)(wrapped) if isinstance(raw, (staticmethod, classmethod)) else wrapped)
        _rebind_imports(raw, getattr(owner, attr))
    for path, replacement in REPLACED_FUNCTIONS.items():
        owner, attr = _resolve(path)
        setattr(owner, attr, replacement)
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # 0.16.1 names it without TransformerEngine (NameError otherwise)
    # forking the model-parallel RNG state on CPU swaps the CPU generator itself, which the tracker
    # reports as a warning on every fork: expected here
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _active = True
    return True


def _rebind_imports(old, new) -> None:
    """`from ... import fn` copies in other megatron modules must see the wrapped function too."""
    import sys

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron.core") and any(v is old for v in vars(module).values()):
            for key, value in list(vars(module).items()):
                if value is old:
                    setattr(module, key, new)
