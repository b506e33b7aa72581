"""Container images the tasks run in, as flytekit ImageSpecs: one per platform, each with the project's code.

Locally `pyflyte run` executes in the current environment and builds nothing; on a cluster `pyflyte run --remote` /
`pyflyte register` build or look up these images. What a cluster decides comes from the environment of the machine
that registers: MILES_IMAGE_REGISTRY (where images are pushed and pulled), MILES_CUDA_BASE_IMAGE and
MILES_ROCM_BASE_IMAGE (the GPU platforms' base images: drivers' user space, compilers for the kernels).

* `cpu_image`: the exact environment of requirements.lock (CPU torch), for every task by default.
* `train_image`: CUDA torch, megatron-core with TransformerEngine, for the tasks that train, convert and publish on
  NVIDIA GPUs.
* `sglang_image`: the train image plus SGLang in its own environment (/opt/sglang, from containers/sglang's lock: its
  own CUDA torch stack cannot share the project's), for rollout and evaluation that launch SGLang servers on GPUs.
* `rocm_image`: ROCm torch and megatron-core, for training on AMD GPUs.

Every image holds the repository's files (what git does not ignore) at /root, on the PYTHONPATH: the project and
every plug-in module a recipe names from inside it. `check_plugins_in_image` refuses a recipe whose plug-in module
lives elsewhere. The workflow picks each node's image from the recipe (`image_for`).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from pathlib import Path

from flytekit import ImageSpec
from flytekit.constants import CopyFileDetection

from miles_core.config import ConfigError
from miles_core.plugins import PLUGPOINTS, source_file

REPO = Path(__file__).resolve().parents[1]
REGISTRY = os.environ.get("MILES_IMAGE_REGISTRY", "ghcr.io/miles-flyte")
CUDA_BASE = os.environ.get("MILES_CUDA_BASE_IMAGE", "nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04")
ROCM_BASE = os.environ.get("MILES_ROCM_BASE_IMAGE", "rocm/dev-ubuntu-24.04:6.4.1")
TORCH_INDEX = {
    "cpu": "https://download.pytorch.org/whl/cpu",
    "cuda": "https://download.pytorch.org/whl/cu128",
    "rocm": "https://download.pytorch.org/whl/rocm6.4",
}
SGLANG_ENV = "/opt/sglang"  # MILES_SGLANG_ENV in the image: where miles_core.rollout.engines.sglang_server finds SGLang's python

PROJECT_PACKAGES = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
KERNELS = {"cuda": ["transformer-engine[pytorch]>=2.8"], "rocm": []}  # megatron-core's fused kernels on each platform
APT = ["bubblewrap"]  # the code sandbox (miles_core/tools/sandbox.py)


def _with_code(commands: tuple[str, ...] = (), **spec) -> ImageSpec:
    """An image of the registry with the repository's files copied in (source_root, git's ignores apply) and compiled,
    after `commands`: each pod's Python reads the project's bytecode instead of compiling its ~120 modules at every
    start (1.3 s of a task pod's 9 s start on 2 cores, tests/pods)."""
    return ImageSpec(
        python_version="3.11",
        registry=REGISTRY,
        apt_packages=APT,
        source_root=str(REPO),
        source_copy_mode=CopyFileDetection.ALL,
        commands=[*commands, "python -m compileall -q /root"],
        **spec,
    )


def _gpu_image(platform: str, base: str, name: str = "", **spec) -> ImageSpec:
    return _with_code(
        name=name or f"miles-flyte-{platform}",
        base_image=base,
        packages=PROJECT_PACKAGES + KERNELS[platform],
        pip_extra_index_url=[TORCH_INDEX[platform]],
        **spec,
    )


cpu_image = _with_code(name="miles-flyte-cpu", requirements=str(REPO / "requirements.lock"), pip_extra_index_url=[TORCH_INDEX["cpu"]])
train_image = _gpu_image("cuda", CUDA_BASE)
rocm_image = _gpu_image("rocm", ROCM_BASE)
sglang_image = _gpu_image(
    "cuda",
    CUDA_BASE,
    name="miles-flyte-sglang",
    commands=(  # run after the repository's files are copied to /root
        f"python -m venv {SGLANG_ENV}",
        f"{SGLANG_ENV}/bin/pip install --no-cache-dir --require-hashes --no-deps -r /root/containers/sglang/requirements.lock",
    ),
    env={"MILES_SGLANG_ENV": SGLANG_ENV},
)


def image_for(cfg, stage: str) -> ImageSpec:
    """The image of a loop stage's node (`stage` as in tasks/metadata.py) under the recipe `cfg` (a RunConfig): SGLang's
    where the stage launches SGLang servers on GPUs (rollout, evaluate), the GPU platform's where it trains on GPUs,
    else the CPU image. An async phase does both, every pod of its Ray cluster in the task's one image."""
    if stage in ("rollout", "evaluate", "async") and cfg.rollout.gpus():
        return sglang_image
    if stage in ("train", "async") and cfg.train.gpus_per_node:
        return rocm_image if cfg.cluster.gpu_platform == "rocm" else train_image
    return cpu_image


def _distribution(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def check_plugins_in_image(cfg) -> None:
    """Every plug-in module the recipe `cfg` names is in the images: a file of the repository (copied to /root), or a
    module of a package the images install; else a ConfigError names the key and where the module lives."""
    installed = {_distribution(r) for r in PROJECT_PACKAGES}
    providers = importlib.metadata.packages_distributions()
    for field in PLUGPOINTS:
        section, name = field.split(".")
        module = getattr(getattr(cfg, section), name).partition(":")[0]
        path = source_file(module)
        if path and path.resolve().is_relative_to(REPO):
            continue
        if installed & {_distribution(d) for d in providers.get(module.split(".")[0], [])}:
            continue
        raise ConfigError(
            f"{field}: module {module!r} ({path or 'no source file'}) is neither in the repository ({REPO}) nor in a package the "
            "images install (pyproject.toml dependencies), so no pod could import it: move it under the repository"
        )
