"""Container images the tasks run in, as flytekit ImageSpecs.

Locally `pyflyte run` executes in the current environment and builds nothing; on a cluster
`pyflyte run --remote` / `pyflyte register` build or look up these images.  The packages mirror
pyproject.toml; the CPU build of torch comes from PyTorch's CPU wheel index.
"""

from flytekit import ImageSpec

from miles_core.rollout.engines.sglang_server import SGLANG_VERSION

CPU_PACKAGES = [
    "torch==2.13.0",
    "flytekit>=1.16,<1.17",
    "flytekitplugins-kfpytorch>=1.16,<1.17",
    "flytekitplugins-ray>=1.16,<1.17",
    "flytekitplugins-pandera>=1.16,<1.17",
    "flytekitplugins-deck-standard>=1.16,<1.17",
    "pandera>=0.35",
    "mlflow>=3,<4",
    "ray[default]>=2.60,<3",
    "transformers>=5.20,<6",
    "safetensors>=0.6",
    "tokenizers>=0.22",
    "pyarrow>=20",
    "pyyaml>=6",
    "tqdm>=4.66",
    "matplotlib>=3.9",
    "requests>=2.31",
    "math-verify>=0.9,<0.10",
    "megatron-core==0.16.1",
    "psutil>=5.9",
]

cpu_image = ImageSpec(
    name="miles-flyte-cpu",
    python_version="3.11",
    packages=CPU_PACKAGES,
    pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
    registry="ghcr.io/miles-flyte",
    apt_packages=["bubblewrap"],  # the code sandbox (miles_core/tools/sandbox.py)
)

# The rollout servers' image on GPU nodes: SGLang with its own CUDA torch stack, as pinned by the
# SGLang release (it cannot share an environment with the CPU torch above). Rollout tasks reach
# these servers by URL (rollout.sglang.urls). The CPU stand-ins of containers/sglang/ are for
# CPU-only machines and are not installed here.
sglang_image = ImageSpec(
    name="miles-flyte-sglang",
    python_version="3.11",
    packages=[f"sglang=={SGLANG_VERSION}"],
    cuda="12.8",
    registry="ghcr.io/miles-flyte",
)
