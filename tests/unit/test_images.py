"""Each image's build description, made as `pyflyte register` makes it but without a registry or a docker daemon
(flytekit's default builder writes the Dockerfile, the requirements and the copied sources into a folder), and the
image each loop stage's node gets under a recipe."""

import dataclasses
import subprocess
import sys
import tempfile
import tomllib

import pytest
from flytekit.image_spec.default_builder import create_docker_context

from containers import images
from miles_core.config import ConfigError, load_recipe
from tests.conftest import REPO

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


@pytest.fixture(scope="module")
def contexts(tmp_path_factory):
    """{image name: (Dockerfile text, requirements text, copied source folder)}"""
    out = {}
    for name in ("cpu_image", "train_image", "rocm_image", "sglang_image"):
        folder = tmp_path_factory.mktemp(name)
        create_docker_context(getattr(images, name), folder)
        out[name] = ((folder / "Dockerfile").read_text(), (folder / "requirements_uv.txt").read_text(), folder / "src")
    return out


def test_the_cpu_image_is_the_locked_environment(contexts):
    dockerfile, requirements, _ = contexts["cpu_image"]
    locked = {line.strip() for line in (REPO / "requirements.lock").read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")}
    assert "torch==2.13.0+cpu \\" in locked and locked <= {line.strip() for line in requirements.splitlines()}  # every pin and hash
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in dockerfile and "bubblewrap" in dockerfile


@pytest.mark.parametrize("name, index, kernels", [("train_image", "cu128", True), ("rocm_image", "rocm", False), ("sglang_image", "cu128", True)])
def test_a_gpu_image_installs_the_project_with_its_platforms_torch(contexts, name, index, kernels):
    dockerfile, requirements, _ = contexts[name]
    lines = requirements.split()
    assert set(PROJECT) <= set(lines)  # torch==2.13.0 and megatron-core==0.16.1 among them, from the platform's index
    assert f"--extra-index-url https://download.pytorch.org/whl/{index}" in dockerfile
    assert any(line.startswith("transformer-engine[pytorch]") for line in lines) == kernels
    assert dockerfile.count("FROM ") == 3 and f"FROM {images.ROCM_BASE if index == 'rocm' else images.CUDA_BASE}" in dockerfile


def test_every_image_holds_the_repository_but_not_what_git_ignores(contexts):
    for _, _, src in contexts.values():
        for path in ("miles_core/step.py", "tasks/rl.py", "workflows/rl.py", "recipes/frontier_base.yaml", "containers/sglang/requirements.lock"):
            assert (src / path).is_file(), path
        assert not (src / ".venv").exists() and not (src / "runs").exists()


def test_every_image_compiles_the_code_it_copied(contexts):
    """A pod's Python reads the project's bytecode from the image instead of compiling every module at its start."""
    for dockerfile, _, _ in contexts.values():
        assert dockerfile.index("COPY --chown=flytekit ./src /root") < dockerfile.index("python -m compileall -q /root")


def test_the_sglang_image_installs_sglang_in_its_own_environment_after_the_code(contexts):
    dockerfile, _, _ = contexts["sglang_image"]
    install = "/opt/sglang/bin/pip install --no-cache-dir --require-hashes --no-deps -r /root/containers/sglang/requirements.lock"
    assert dockerfile.index("COPY --chown=flytekit ./src /root") < dockerfile.index(install)
    assert "MILES_SGLANG_ENV=/opt/sglang" in dockerfile


def test_registry_and_base_images_come_from_the_environment():
    probe = "from containers import images as i; print(i.train_image.image_name(), i.train_image.base_image, i.rocm_image.base_image)"
    env = {"MILES_IMAGE_REGISTRY": "registry.example:5000/rl", "MILES_CUDA_BASE_IMAGE": "nvcr.io/nvidia/cuda:13.0", "MILES_ROCM_BASE_IMAGE": "rocm/dev:7"}
    plain = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "TMPDIR": tempfile.gettempdir()}  # flytekit's import makes a folder there
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**plain, **env}, capture_output=True, text=True)
    name, cuda, rocm = out.stdout.split()
    assert name.startswith("registry.example:5000/rl/miles-flyte-cuda:") and (cuda, rocm) == ("nvcr.io/nvidia/cuda:13.0", "rocm/dev:7")


def test_each_stage_gets_the_image_it_needs():
    cfg = load_recipe(REPO / "recipes" / "gpt_oss_20b.yaml")  # SGLang servers and training on GPUs
    assert [images.image_for(cfg, s) for s in ("rollout", "evaluate", "train", "async", "score", "convert", "publish")] == [
        images.sglang_image,
        images.sglang_image,
        images.train_image,
        images.sglang_image,  # an async phase's pods: SGLang servers and a trainer, one image (the SGLang one is built on the CUDA one)
        *[images.cpu_image] * 3,
    ]
    rocm = load_recipe(REPO / "recipes" / "gpt_oss_20b.yaml", {"cluster.gpu_platform": "rocm", "rollout.sglang.urls": "http://sglang:30000"})
    assert [images.image_for(rocm, s) for s in ("train", "rollout", "async")] == [images.rocm_image, images.cpu_image, images.rocm_image]
    tiny = load_recipe(REPO / "recipes" / "tiny_arith_cpu.yaml")
    assert {images.image_for(tiny, s) for s in ("rollout", "train", "evaluate")} == {images.cpu_image}


def test_rocm_refuses_gpu_sglang_servers_and_nvidia_gpu_types():
    with pytest.raises(ConfigError, match="cluster.gpu_platform: the SGLang image is built for CUDA"):
        load_recipe(REPO / "recipes" / "gpt_oss_20b.yaml", {"cluster.gpu_platform": "rocm"})
    with pytest.raises(ConfigError, match="cluster.accelerator: 'nvidia-h100' is an NVIDIA GPU type"):
        load_recipe(REPO / "recipes" / "gpt_oss_20b.yaml", {"cluster.gpu_platform": "rocm", "cluster.accelerator": "nvidia-h100"})


def test_a_plug_in_module_no_image_holds_is_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def fn(sample, label):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_recipe(REPO / "recipes" / "tiny_arith_cpu.yaml")
    images.check_plugins_in_image(cfg)  # the project's own
    outside = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, fn="my_rewards:fn"))
    with pytest.raises(ConfigError, match=r"reward.fn: module 'my_rewards' \(.*my_rewards.py\) is neither in the repository"):
        images.check_plugins_in_image(outside)
