"""The locks agree with what they lock: every requirement of pyproject.toml (and of the SGLang
image's requirements.in, and of requirements-uv.in: the installer `make setup` runs) is pinned, with hashes, at a
version its range allows, and the project's environment holds exactly the locked versions (`make lock` refreshes them)."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\$")


def pins(lock: Path) -> dict[str, str]:
    """{canonical name: version} of a pip-compile lock; every pin must carry at least one hash."""
    lines = lock.read_text().splitlines()
    out = {}
    for i, line in enumerate(lines):
        if m := PIN.match(line):
            assert lines[i + 1].strip().startswith("--hash=sha256:"), f"{lock.name}: {m[1]} has no hash"
            out[canonicalize_name(m[1])] = m[2]
    return out


def requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def listed(requirements_in: str) -> list[Requirement]:
    return [Requirement(r) for r in (REPO / requirements_in).read_text().splitlines() if r.strip() and not r.startswith("#")]


@pytest.mark.parametrize(
    "lock, wanted",
    [
        ("requirements.lock", requirements),
        ("containers/sglang/requirements.lock", lambda: listed("containers/sglang/requirements.in")),
        ("requirements-uv.lock", lambda: listed("requirements-uv.in")),
    ],
)
def test_every_requirement_is_pinned_within_its_range(lock, wanted):
    pinned = pins(REPO / lock)
    for req in wanted():
        name = canonicalize_name(req.name)
        assert name in pinned, f"{lock}: {req.name} is required but not locked: run `make lock`"
        assert req.specifier.contains(Version(pinned[name]), prereleases=True), (
            f"{lock}: {req.name}=={pinned[name]} is outside {req.specifier}: run `make lock`"
        )


def installed_packages() -> dict[str, str]:
    """{canonical name: version} of the environment as a fresh interpreter of it sees it (isolated
    mode: this process's sys.path, which tests and plug-ins extend, does not count)."""
    listing = subprocess.run([sys.executable, "-I", "-c", LIST], capture_output=True, text=True, check=True).stdout
    return {canonicalize_name(name): version for name, version in json.loads(listing)}


LIST = "import json, importlib.metadata as m; print(json.dumps([(d.metadata['Name'], d.version) for d in m.distributions()]))"


def test_environment_matches_the_lock():
    pinned = pins(REPO / "requirements.lock")
    installed = installed_packages()
    installed.pop("miles-flyte", None)
    installed.pop("pip", None)  # the venv's own installer, not a dependency
    assert {n: v for n, v in installed.items() if pinned.get(n) != v} == {}, "installed packages differ from requirements.lock: run `make setup`"
    assert set(pinned) - set(installed) == set(), "locked packages missing from the environment: run `make setup`"
