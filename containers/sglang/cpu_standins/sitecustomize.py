"""Activates the CPU stand-ins in the SGLang environment (installed there only, never in the project's).

Runs at interpreter start-up of every process of that environment (server, scheduler,
detokenizer). Only when SGLANG_USE_CPU_ENGINE=1 (and MILES_SGLANG_CPU_STANDINS is not "0", which
tests use to show the stand-ins are still needed) it
* puts the pure-torch `sgl_kernel` stand-in ahead of the CUDA-only wheel on sys.path,
* hides the GPU-only kernel libraries SGLang imports when present (flashinfer, and the CuTe DSL `cutlass` it probes):
  none of it runs on the CPU engine, and importing it cost each process about two seconds, and
* patches torch once a process imports it (the processes that never do, such as multiprocessing's resource tracker,
  start without it). When no GPU is usable
  - `torch.get_device_module()` (no argument) answers `torch.cpu`:
    the CUDA build of torch otherwise returns `torch.cuda`, and SGLang's weight updater calls
    `.synchronize()` on it, which fails without a driver. The replacement is cached like the
    original (`functools.cache`), so it keeps the `__wrapped__` that torch.compile's tracer looks
    up (without it every `torch.compile`d SGLang function fails, e.g. the MoE biased grouped top-k),
  - pinning a host buffer is a no-op: the routed-experts capturer (--enable-return-routed-experts)
    registers its host cache with cudaHostRegister on any device, and the LoRA layers, memory pool and
    torch_native LoRA backend (--enable-lora) allocate with `pin_memory=True` or call `.pin_memory()`;
    all of it fails without a driver, and on a CPU server every buffer is ordinary memory already, and
  - the server's scheduler and detokenizer processes are forked instead of spawned (`_forked_not_spawned`).
Pinned to one SGLang version: another version stops with a message instead of half-working.
"""

import functools
import importlib.abc
import importlib.util
import os
import sys

PINNED_SGLANG = "0.5.23"
GPU_ONLY = ("flashinfer", "cutlass")


def _activate() -> None:
    from importlib.metadata import version

    found = version("sglang")
    if found != PINNED_SGLANG:
        raise RuntimeError(
            f"the CPU stand-ins in {os.path.dirname(__file__)} are made for sglang {PINNED_SGLANG}, "
            f"this environment has {found}: rebuild it with `make sglang-env`"
        )
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "miles_sglang_cpu"))
    sys.modules.update(dict.fromkeys(GPU_ONLY))  # `import` raises ImportError, importlib.util.find_spec answers None
    _after_import("torch", _without_gpu)


def _without_gpu(torch) -> None:
    if torch.cuda.is_available():
        return
    by_device = torch.get_device_module

    @functools.cache
    def get_device_module(device=None):
        return torch.cpu if device is None else by_device(device)

    torch.get_device_module = get_device_module
    _after_import("sglang.srt.mem_cache.pool_host.common", lambda module: setattr(module, "_cuda_host_register", lambda *args, **kwargs: None))
    _unpinned(torch)
    _forked_not_spawned()


def _forked_not_spawned() -> None:
    """The start method SGLang sets for its scheduler and detokenizer processes, `spawn`, taken as `fork`: a spawned
    process imports SGLang, torch and transformers anew (about fifteen seconds of CPU each here), a forked one has them
    already. Spawn keeps a child clear of its parent's CUDA context; without a GPU there is none."""
    import multiprocessing

    chosen = multiprocessing.set_start_method
    multiprocessing.set_start_method = lambda method, force=False: chosen("fork" if method == "spawn" else method, force=force)


def _unpinned(torch) -> None:
    """Pinning asked of torch answered with ordinary host memory: `Tensor.pin_memory()` returns the tensor itself, and
    the factories drop `pin_memory=True`."""
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for name in ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "ones_like"):
        factory = getattr(torch, name)

        @functools.wraps(factory)
        def unpinned(*args, _factory=factory, **kwargs):
            kwargs.pop("pin_memory", None)
            return _factory(*args, **kwargs)

        setattr(torch, name, unpinned)


def _after_import(name: str, patch) -> None:
    """Run patch(module) once module `name` has been executed, whoever imports it first."""

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and os.environ.get("MILES_SGLANG_CPU_STANDINS", "1") != "0":
    _activate()
