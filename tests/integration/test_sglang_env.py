"""The CPU stand-ins of containers/sglang are still needed and still sufficient for SGLang 0.5.23.

Needed: without them (MILES_SGLANG_CPU_STANDINS=0) SGLang's CPU path fails at import, where it
loads its CPU kernels from the wheel's `sgl_kernel` (a CUDA-only operator library), and `torch.get_device_module()` answers the CUDA
module, whose synchronize() fails without a driver. Sufficient: with them every module that
imports a CPU kernel loads, the stand-in kernels compute what the kernels document, and
(tests/integration/test_sglang.py) a server serves, updates weights and generates.
Faster: a process that never imports torch starts without it, the GPU-only kernel libraries are hidden, and the
server's scheduler and detokenizer are forked where SGLang asks for `spawn`.
Each check runs in the SGLang environment's own python, as the server does.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.test_sglang import sglang_env_python

pytestmark = pytest.mark.integration

# Every SGLang module that imports a CPU kernel from sgl_kernel at import time (grep of 0.5.23).
CPU_KERNEL_IMPORTERS = [
    "sglang.srt.mem_cache.allocation",
    "sglang.kernels.ops.kvcache.cache_move",
    "sglang.kernels.ops.speculative.spec_tree",
    "sglang.kernels.ops.speculative.eagle",
    "sglang.kernels.ops.speculative.cache_locs",
    "sglang.kernels.ops.speculative.multi_layer_eagle",
]

STANDIN_KERNELS_CHECK = """
import ctypes, torch, sgl_kernel
assert sgl_kernel.__version__.endswith("cpu-standin"), sgl_kernel.__file__
req_to_token = torch.zeros((5, 32), dtype=torch.int32)
loc = torch.arange(100, 113, dtype=torch.int64)
sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 4, 1]), req_to_token, torch.tensor([0, 3, 8]), torch.tensor([6, 3, 15]), loc, 32)
assert req_to_token[2, :6].tolist() == list(range(100, 106)) and req_to_token[1, 8:15].tolist() == list(range(106, 113))
assert int(req_to_token.count_nonzero()) == 13
layers = [torch.arange(40, dtype=torch.float32).view(10, 4) for _ in range(2)]
ptrs = torch.tensor([t.data_ptr() for t in layers]); strides = torch.tensor([4 * 4, 4 * 4])
sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([7, 8]), torch.tensor([1, 2]))
assert all(t[7].tolist() == t[1].tolist() and t[8].tolist() == t[2].tolist() for t in layers)
try:
    sgl_kernel.verify_tree_greedy_cpu()
except NotImplementedError:
    pass
else:
    raise AssertionError("speculative stand-ins must refuse to run")
torch.get_device_module().synchronize()
# torch.compile's tracer looks up torch.get_device_module.__wrapped__ (SGLang compiles e.g. its MoE top-k)
compiled = torch.compile(lambda x: torch.sigmoid(x) + 1, dynamic=True, backend="eager")
assert compiled(torch.zeros(2)).tolist() == [1.5, 1.5]
print("ok")
"""

START_UP_CHECK = """
import importlib.util, inspect, multiprocessing, sys
assert "torch" not in sys.modules
assert importlib.util.find_spec("flashinfer") is None and importlib.util.find_spec("cutlass") is None
import sglang.srt.entrypoints.engine as engine
assert 'mp.set_start_method("spawn", force=True)' in inspect.getsource(engine), "SGLang no longer asks for spawn: drop the fork"
multiprocessing.set_start_method("spawn", force=True)
assert multiprocessing.get_start_method() == "fork"
print("ok")
"""


def run_in_sglang_env(code: str, standins: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "MILES_SGLANG_CPU_STANDINS": "1" if standins else "0"}
    return subprocess.run([sglang_env_python(), "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_sglang_cpu_path_fails_at_import_without_the_standins():
    out = run_in_sglang_env("import sglang.srt.mem_cache.allocation", standins=False)
    assert out.returncode != 0
    # the wheel's sgl_kernel cannot load its CUDA-only operator library on a machine without a driver
    assert "ImportError" in out.stderr and "sgl_kernel/load_utils.py" in out.stderr, out.stderr[-2000:]
    device = run_in_sglang_env("import torch; torch.get_device_module().synchronize()", standins=False)
    assert device.returncode != 0, "torch.get_device_module() now works without a GPU: drop that fix"


def test_standins_load_every_cpu_kernel_importer_and_compute_correctly():
    out = run_in_sglang_env("\n".join(f"import {m}" for m in CPU_KERNEL_IMPORTERS) + "\n" + STANDIN_KERNELS_CHECK, standins=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_cpu_server_process_starts_without_gpu_libraries_and_forks_its_children():
    out = run_in_sglang_env(START_UP_CHECK, standins=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
