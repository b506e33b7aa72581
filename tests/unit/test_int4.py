"""INT4 rollout weights (miles_core/weights/int4.py, publish.quantization: int4): the error bound of symmetric per-group
int4 derived by hand, the packing, the checkpoint layout SGLang's compressed-tensors W4A16 scheme reads (checked
against the installed SGLang and compressed-tensors in their own environment), and the embedded engine loading it."""

import json
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles_core.config import ModelConfig, PublishConfig, SGLangConfig, TrainConfig
from miles_core.config.base import ConfigError
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.engines.sglang_server import sglang_python
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from miles_core.weights.publish import publish
from miles_core.weights.quantize import FORMATS, dequantize_state, quantization_format

# every projection's input size (hidden 128, 4 heads of 32, MLP 256) a multiple of both group sizes
TINY = ModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)
FP32_ROUNDING = 2.0**-23  # w / scale and q * scale each round once in fp32: at most 2^-24 of the value each


def weight(shape=(24, 256), seed=0):
    """Rows of very different magnitudes (1e-4 .. 1e2), so groups get very different scales."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-4, 2, shape[0]).unsqueeze(1)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_keeps_every_element_within_half_a_scale(group):
    """q = round(w / s) with s = max|w| / 7 of the group: |w / s| <= 7, so q is in [-7, 7] and |w / s - q| <= 1/2, i.e.
    |w - q s| <= s / 2 (up to the two fp32 roundings)."""
    w = weight()
    q, scale = quantize_int4(w, group)
    assert q.dtype == torch.int8 and scale.shape == (24, 256 // group) and scale.dtype == torch.float32
    assert torch.equal(scale, w.abs().view(24, -1, group).amax(-1) / 7)
    assert q.min() == -7 and q.max() == 7  # each group's extremes land on the grid's ends, and -8 is never written
    element_scale = scale.repeat_interleave(group, 1)
    error = (dequantize_int4(q, scale) - w).abs()
    assert (error <= element_scale / 2 + FP32_ROUNDING * w.abs()).all()
    assert (error > element_scale / 4).any()  # it did quantize, with errors of the order of the bound


@pytest.mark.parametrize("group", [32, 128])
def test_int4_is_exact_on_its_grid(group):
    """A group holding q0 * s (q0 integers in [-7, 7], +-7 among them, s a power of two) comes back unchanged."""
    g = torch.Generator().manual_seed(1)
    q0 = torch.randint(-7, 8, (6, 256), generator=g, dtype=torch.int8)
    q0[:, ::group] = 7
    q0[:, 1::group] = -7
    s = torch.exp2(torch.randint(-12, 4, (6, 256 // group), generator=g).float())
    w = dequantize_int4(q0, s)
    q, scale = quantize_int4(w, group)
    assert torch.equal(scale, s) and torch.equal(q, q0) and torch.equal(dequantize_int4(q, scale), w)


def test_a_zero_group_stays_zero_and_a_bf16_weight_keeps_its_dtype():
    w = torch.zeros(4, 64)
    w[2:, 32:] = weight((2, 32))
    q, scale = quantize_int4(w, 32)
    assert torch.equal(scale[:2], torch.zeros(2, 2)) and not q[:2].any() and torch.isfinite(dequantize_int4(q, scale)).all()
    q16, scale16 = quantize_int4(w.bfloat16(), 32)
    assert scale16.dtype == torch.bfloat16 and q16.abs().max() <= 7 and dequantize_int4(q16, scale16, torch.bfloat16).dtype == torch.bfloat16


def test_packing_puts_eight_nibbles_in_a_word_first_lowest():
    row = torch.arange(-8, 8, dtype=torch.int8).view(1, 16)  # nibbles 0 .. 15
    packed = pack_int4(row)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0] == sum(n << (4 * i) for i, n in enumerate(range(8)))
    assert packed[0, 1] == sum(n << (4 * i) for i, n in enumerate(range(8, 16))) - 2**32  # top nibble 15: the sign bit
    q = torch.randint(-8, 8, (3, 5, 64), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_int4_refuses_an_input_size_its_groups_do_not_divide():
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj.weight: int4 scales runs of 128 inputs, and its input size 96"):
        quantize_int4(torch.ones(8, 96), 128, "layers.0.mlp.down_proj.weight")


def test_the_int4_keys_name_themselves():
    with pytest.raises(ConfigError, match="publish.group_size: must be one of"):
        PublishConfig(quantization="int4", group_size=64)
    with pytest.raises(ConfigError, match="publish.group_size: is read by publish.quantization: int4 only"):
        PublishConfig(quantization="fp8", group_size=32)
    with pytest.raises(ConfigError, match="train.qat: must be '' \\(off\\) or int4"):
        TrainConfig(qat="int8")
    with pytest.raises(ConfigError, match="train.qat_group_size: must be one of"):
        TrainConfig(qat="int4", qat_group_size=16)
    with pytest.raises(ConfigError, match="train.qat_group_size: is read by train.qat: int4 only"):
        TrainConfig(qat_group_size=32)
    assert PublishConfig(quantization="int4", group_size=32).fmt == "int4-g32" and PublishConfig(quantization="fp8").fmt == "fp8"


@pytest.fixture(scope="module", params=[32, 128])
def published(request, tmp_path_factory):
    """The tiny policy published unquantized and as int4 in groups of 32 or 128: (format, plain dir, int4 dir)."""
    out = tmp_path_factory.mktemp(f"int4-g{request.param}")
    base = build_tiny_model(TINY, str(out / "base"))
    trainer = TorchTrainer.from_hf(base, TrainConfig())
    fmt = PublishConfig(quantization="int4", group_size=request.param).fmt
    publish(trainer, base, out / "plain", "float32", version=1, parent_version=0)
    publish(trainer, base, out / "quantized", "float32", version=1, parent_version=0, quantization=fmt)
    return fmt, out / "plain", out / "quantized"


SGLANG_READS = """
import json, sys, torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from safetensors.torch import load_file
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from sglang.srt.layers.quantization.compressed_tensors.utils import should_ignore_layer

config = CompressedTensorsConfig.from_config(json.loads(sys.argv[1]))
parts = config.target_scheme_map["Linear"]
scheme = config._get_scheme_from_parts(parts["weights"], parts["input_activations"], parts["format"])
state, expected = load_file(sys.argv[2]), load_file(sys.argv[3])
layers = {}
for name in expected:
    prefix = name.removesuffix(".weight")
    out, inp = state[prefix + ".weight_shape"].tolist()
    layer = torch.nn.Module()
    scheme.create_weights(layer, out, inp, [out], inp, torch.float32, lambda *args: None)
    made = {k: [list(v.shape), str(v.dtype)] for k, v in layer.named_parameters()}
    stored = {k: [list(state[f"{prefix}.{k}"].shape), str(state[f"{prefix}.{k}"].dtype)] for k in made}
    module_state = {k: state[f"{prefix}.{k}"] for k in made}
    restored = PackedQuantizationCompressor.decompress(module_state, QuantizationScheme(targets=["Linear"], weights=parts["weights"]))["weight"]
    layers[name] = [sorted(made), made == stored, torch.equal(restored, expected[name])]
fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
names = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "lm_head"]
print(json.dumps({
    "scheme": [type(scheme).__name__, scheme.group_size, scheme.symmetric, scheme.pack_factor, str(scheme.quant_type)],
    "layers": layers,
    "ignored": [should_ignore_layer(n, config.ignore, fused) for n in names],
}))
"""


def test_an_int4_policy_is_laid_out_as_sglang_reads_it(published, tmp_path):
    """SGLang's CompressedTensorsConfig picks its W4A16 scheme (Marlin's uint4b8: q + 8) with the group size; the
    scheme's own create_weights makes the three tensors in the names, shapes and dtypes stored; compressed-tensors'
    decompression of them gives the weights the embedded engine computes with; the output layer stays unquantized."""
    fmt, plain, quantized = published
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config == FORMATS[fmt] and quantization_format({"quantization_config": config}) == fmt
    group = int(fmt.removeprefix("int4-g"))
    with safe_open(str(quantized / "model.safetensors"), "pt") as f, safe_open(str(plain / "model.safetensors"), "pt") as p:
        names = set(f.keys())
        projections = [n for n in p.keys() if n.endswith("proj.weight")]
        assert len(projections) == 14 and not names & set(projections)
        for name in projections:
            out_size, in_size = p.get_slice(name).get_shape()
            assert f.get_slice(f"{name}_packed").get_shape() == [out_size, in_size // 8] and f.get_slice(f"{name}_packed").get_dtype() == "I32"
            assert f.get_slice(f"{name}_scale").get_shape() == [out_size, in_size // group] and f.get_slice(f"{name}_scale").get_dtype() == "F32"
            assert f.get_tensor(f"{name}_shape").tolist() == [out_size, in_size]
        for name in set(p.keys()) - set(projections):  # embeddings, norms, output layer: as published
            assert torch.equal(f.get_tensor(name), p.get_tensor(name)), name
        expected = {k: v for k, v in dequantize_state({n: f.get_tensor(n) for n in names}, fmt).items() if k in projections}
    save_file(expected, str(tmp_path / "expected.safetensors"))
    read = subprocess.run(
        [sglang_python(SGLangConfig()), "-c", SGLANG_READS, json.dumps(config), str(quantized / "model.safetensors"), str(tmp_path / "expected.safetensors")],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(read.stdout.splitlines()[-1])
    assert report["scheme"] == ["CompressedTensorsWNA16", group, True, 8, "uint4b8"]
    assert report["layers"] == {name: [["weight_packed", "weight_scale", "weight_shape"], True, True] for name in projections}
    assert report["ignored"] == [False, False, False, False, True]


def test_the_engine_computes_with_the_dequantized_int4_weights(published):
    fmt, plain, quantized = published
    engine, reference = TorchEngine(str(quantized), 1), TorchEngine(str(plain), 1)
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        restored = dequantize_state({n: f.get_tensor(n) for n in f.keys()}, fmt)
    weights, plain_weights = engine.model.state_dict(), reference.model.state_dict()
    for name, tensor in restored.items():
        assert torch.equal(weights[name], tensor), name
    moved = [n for n in restored if not torch.equal(weights[n], plain_weights[n])]
    assert sorted(moved) == sorted(n for n in restored if n.endswith("proj.weight"))
