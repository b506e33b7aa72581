"""Pure-torch stand-in for `sgl_kernel` on CPU-only machines, pinned to SGLang 0.5.23.

SGLang's kernel wheels (sglang-kernel 0.4.10) hold CUDA operators only, yet with
SGLANG_USE_CPU_ENGINE=1 SGLang imports CPU operators from `sgl_kernel` at module level. Two of
them are on the serving path of a plain decoder (no speculative decoding, no AMX):
`assign_req_to_token_pool_cpu` (mem_cache/allocation.py, every extend and decode step) and
`copy_all_layer_kv_cache_cpu` (kernels/ops/kvcache/cache_move.py, KV moves). They are written
here in torch. The speculative-decoding imports only need to resolve; calling them raises
NotImplementedError. `torch.ops.sgl_kernel` stays empty, so SGLang sees no AMX and picks its
torch_native attention backend. `tests/integration/test_sglang_env.py` fails when the real
package starts to serve on CPU (stand-in no longer needed) or SGLang imports a new name.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.4.10+cpu-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [B] request slots
    req_to_token: torch.Tensor,  # [max_reqs, pool_len] int32, written in place
    start_offset: torch.Tensor,  # [B]
    end_offset: torch.Tensor,  # [B]
    out_cache_loc: torch.Tensor,  # [sum(end - start)] int64 KV slots, request after request
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the next (end[i] - start[i]) slots."""
    lengths = (end_offset - start_offset).tolist()
    slots = torch.split(out_cache_loc.to(torch.int32), lengths)
    for row, start, end, values in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), slots):
        req_to_token[row, start:end] = values


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [L] int64 base addresses of every layer's K and V buffers
    strides: torch.Tensor,  # [L] int64 bytes per token slot of each buffer
    tgt_loc: torch.Tensor,  # [N] destination token slots
    src_loc: torch.Tensor,  # [N] source token slots
) -> None:
    """Copy token slot src_loc[j] to tgt_loc[j] in every buffer (raw addresses, as the kernel)."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def _not_on_cpu(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in (speculative decoding is not supported on CPU here)")

    kernel.__name__ = name
    return kernel


# Imported at module level by SGLang's speculative-decoding modules on CPU; never called when
# speculative decoding is off.
_SPECULATIVE = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)
globals().update({name: _not_on_cpu(name) for name in _SPECULATIVE})
