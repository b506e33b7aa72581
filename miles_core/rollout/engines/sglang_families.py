"""What SGLang 0.5.23 serves on CPU, by model family: the families it refuses there, each with the error it stops
with and why (found by tests/integration/test_sglang_families.py, which asserts each refusal still happens).

Admission (`miles_core.models.source.admit`) refuses a run that would launch a CPU server on such a family before
any compute, with the reason; on GPUs (`rollout.sglang.device: cuda`) these limits do not apply. The keys are the
config.json `model_type` of the checkpoint (the family's `model.arch`).
"""

from __future__ import annotations

_DSA = (r"Found no NVIDIA driver", "DeepSeek sparse attention's set-up asks torch.cuda for the device capability; it has no CPU path")
# SGLang loads the image processor of every multimodal checkpoint (the tiny ones have none) and its
# --language-model-only (serve the text model alone) supports only DeepSeek-V4 and a few others
_NO_PROCESSOR = (r"Can't load image processor", "a vision-language checkpoint needs its image processor, even to be served for text")

# model_type -> (a pattern of the error SGLang stops with, why)
CPU_REFUSALS = {
    "deepseek_v3": (
        r"Expected size for first two dimensions of batch2 tensor to be: \[4, 24\] but got: \[4, 40\]",
        "the CPU attention backend (torch_native: no AMX here) reads keys from the MLA latent cache in DeepSeek's MHA prefill path",
    ),
    "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA,
    "glm5_next": _DSA,
    "deepseek_v4": (
        r"has no attribute 'compress_ratios'",
        "SGLang reads the published per-layer compress_ratios (each 0, 1, 2, 4 or 128), transformers writes compress_rates by layer kind",
    ),
    "qwen3_next": (r"No module named 'sgl_kernel.mamba'", "the CPU Gated DeltaNet needs sgl_kernel.mamba's CPU kernels (causal conv1d, chunked delta rule)"),
    "qwen3_5": _NO_PROCESSOR,
    "qwen3_5_moe": _NO_PROCESSOR,
    "kimi_k25": _NO_PROCESSOR,
    "llama4": (
        r"expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float",
        "Llama 4's QK norm casts q and k to bfloat16 (models/llama4.py), so an fp32 server fails",
    ),
    "gpt_oss": (
        r"The size of tensor a \(64\) must match the size of tensor b \(32\) at non-singleton dimension 2",
        "the unquantized expert loader fails on a down_proj whose expert width (32) differs from the hidden size (64); published gpt-oss has both 2880",
    ),
    "minimax_m2": (r"assert x1\.is_cuda and x2\.is_cuda", "MiniMax-M2's QK norm is a CUDA-only kernel (rms_sumsq_serial)"),
    "nemotron_h": (
        r"layers_block_type contains invalid types",
        "SGLang's NemotronHConfig reads the published kinds (mamba, moe, attention); transformers writes linear_attention and full_attention",
    ),
}
