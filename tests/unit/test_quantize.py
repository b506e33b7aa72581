"""FP8 (128 x 128 blocks) and MXFP8 rollout weights (miles_core/weights/quantize.py): the error bounds of e4m3 derived
by hand, the checkpoint layout SGLang's Fp8Config reads (checked against the installed SGLang in its own environment),
the embedded engine computing with a quantized published policy, and TIS correcting the mismatch it adds."""

import json
import math
import subprocess

import pytest
import torch
from safetensors import safe_open

from miles_core.algos.corrections import importance_weights
from miles_core.config import ModelConfig, SGLangConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines.sglang_server import sglang_python
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.samples import Sample
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.publish import publish
from miles_core.weights.quantize import dequantize, quantize_fp8, quantize_mxfp8

TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
HALF_SPACING = 2.0**-4  # e4m3 keeps 3 mantissa bits: a normal value rounds to within half a spacing, 2^-4 of itself
SUBNORMAL_STEP = 2.0**-9  # e4m3's smallest step (its subnormals), in units of the block's scale


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_model(TINY, str(tmp_path_factory.mktemp("m") / "base"))


def weight(shape=(200, 96), seed=0):
    """Rows of very different magnitudes (1e-4 .. 1e2), so blocks get very different scales."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-4, 2, shape[0]).unsqueeze(1)


def test_fp8_blocks_keep_every_element_within_half_a_spacing():
    w = weight()  # 200 x 96: two row blocks (the second partial), one partial column block
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, torch.stack([w[:128].abs().max(), w[128:].abs().max()]).view(2, 1) / 448)
    restored = dequantize(q, scale, "fp8")
    element_scale = scale.repeat_interleave(128, 0)[:200]
    assert ((restored - w).abs() <= HALF_SPACING * w.abs() + SUBNORMAL_STEP * element_scale).all()
    assert (restored - w).abs().max() > 0  # it did quantize


def test_mxfp8_scales_are_powers_of_two_and_saturate_at_most_one_eighth():
    w = weight((64, 96))
    q, exponents = quantize_mxfp8(w)
    assert q.dtype == torch.float8_e4m3fn and exponents.dtype == torch.uint8 and exponents.shape == (64, 3)
    amax = w.abs().view(64, 3, 32).amax(-1)
    assert torch.equal(exponents.long() - 127, torch.floor(torch.log2(amax)).long() - 8)  # OCP MX: floor(log2 amax) - emax(e4m3)
    restored = dequantize(q, exponents, "mxfp8")
    element_scale = torch.exp2(exponents.float() - 127).repeat_interleave(32, 1)
    saturated = w.abs() / element_scale > 448  # amax / scale lies in [256, 512): the top of a block may exceed 448
    error = (restored - w).abs()
    assert (error[~saturated] <= HALF_SPACING * w.abs()[~saturated] + SUBNORMAL_STEP * element_scale[~saturated]).all()
    assert (error[saturated] <= (1 - 448 / 512) * w.abs()[saturated]).all() and saturated.any()


def test_mxfp8_refuses_an_input_size_its_blocks_do_not_divide():
    with pytest.raises(ValueError, match=r"layers.0.mlp.up_proj.weight: mxfp8 scales runs of 32 inputs, and its input size 40"):
        quantize_mxfp8(torch.ones(8, 40), "layers.0.mlp.up_proj.weight")


@pytest.fixture(scope="module", params=["fp8", "mxfp8"])
def published(request, policy_dir, tmp_path_factory):
    """The tiny policy published unquantized and quantized in one format: (format, plain dir, quantized dir)."""
    out = tmp_path_factory.mktemp(request.param)
    trainer = TorchTrainer.from_hf(policy_dir, TrainConfig())
    publish(trainer, policy_dir, out / "plain", "float32", version=1, parent_version=0)
    publish(trainer, policy_dir, out / "quantized", "float32", version=1, parent_version=0, quantization=request.param)
    return request.param, out / "plain", out / "quantized"


def test_a_quantized_policy_is_laid_out_as_sglang_reads_it(published):
    fmt, plain, quantized = published
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    with safe_open(str(quantized / "model.safetensors"), "pt") as f, safe_open(str(plain / "model.safetensors"), "pt") as p:
        names = set(f.keys())
        projections = [n for n in p.keys() if n.endswith("proj.weight")]
        assert projections and {f"{n}_scale_inv" for n in projections} <= names
        for name in projections:
            out_size, in_size = p.get_slice(name).get_shape()
            scale_shape = [out_size, in_size // 32] if fmt == "mxfp8" else [math.ceil(out_size / 128), math.ceil(in_size / 128)]
            assert f.get_slice(name).get_dtype() == "F8_E4M3" and f.get_slice(f"{name}_scale_inv").get_shape() == scale_shape
            assert f.get_slice(f"{name}_scale_inv").get_dtype() == ("U8" if fmt == "mxfp8" else "F32")
        for name in set(p.keys()) - set(projections):  # embeddings, norms, output layer: as published
            assert torch.equal(f.get_tensor(name), p.get_tensor(name)), name
    read = subprocess.run(
        [sglang_python(SGLangConfig()), "-c", "import json, sys\nfrom sglang.srt.layers.quantization.fp8 import Fp8Config\n"
         "c = Fp8Config.from_config(json.loads(sys.argv[1]))\nprint(json.dumps([c.get_name(), c.weight_block_size, c.is_checkpoint_fp8_serialized]))",
         json.dumps(config)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    block = [1, 32] if fmt == "mxfp8" else [128, 128]
    assert json.loads(read.stdout.splitlines()[-1]) == [fmt, block, True]


def first_token_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)


def test_the_engine_computes_with_the_quantized_weights_and_tis_corrects_the_mismatch(published):
    """Every first token y of one prompt, as a one-token response: the rollout log-prob q(y) from the engine on the
    quantized policy, the train log-prob p(y) from the trainer. The engine's distribution moved (q != p); the
    TIS-weighted loss of the rollout distribution, sum_y q(y) w(y) A(y), is the trainer's sum_y p(y) A(y), as IS is
    exact where the weights are not truncated; uncorrected, sum_y q(y) A(y) is off by up to sum_y |p(y) - q(y)|."""
    fmt, plain, quantized = published
    prompt = [1, 5, 6, 7]
    engine, reference = TorchEngine(str(quantized), 1), TorchEngine(str(plain), 1)
    q = first_token_logprobs(engine.model, prompt)
    assert (q - first_token_logprobs(reference.model, prompt)).abs().max() > 1e-4  # quantized weights, other numbers
    vocab = q.shape[0]
    samples = [Sample("p", y, prompt, [y], [float(q[y])], [1], "length", 1, "", {}) for y in range(vocab)]
    batch = pack(samples, 0)
    p = TorchTrainer.from_hf(str(plain), TrainConfig()).logprobs(batch, 1.0)  # [V, 1]
    w, metrics = importance_weights(p, batch.rollout_logprobs, batch.loss_mask, "tis", "token", 0.0, 1e6)
    assert metrics["mismatch/abs_logprob_diff"] > 1e-4 and metrics["mismatch/tis_clipped_fraction"] == 0.0
    train_mass, rollout_mass = p[:, 0].exp(), q.exp()
    advantage = torch.sign(train_mass - rollout_mass)  # the advantage the mismatch biases most: by sum_y |p(y) - q(y)|
    exact = float((train_mass * advantage).sum())
    assert float((rollout_mass * w[:, 0] * advantage).sum()) == pytest.approx(exact, abs=1e-6)
    assert exact - float((rollout_mass * advantage).sum()) == pytest.approx(float((train_mass - rollout_mass).abs().sum()), rel=1e-4)
    assert float((train_mass - rollout_mass).abs().sum()) > 1e-3
