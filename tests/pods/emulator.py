"""A Flyte cluster emulated from its real pieces, for the pod-isolation tier.

Real: flytekit's serializer (the compiled workflow and task templates a cluster registers), the pod entrypoint
(`pyflyte-execute` with the task template's own container args), flytekit's type engine and file access, and an
S3-compatible object store (moto's server on loopback) as the only thing the pods share.

Emulated here: flytepropeller (nodes run one at a time in dependency order; inputs bound from upstream outputs,
attribute paths and collections as the compiled bindings say; a `@dynamic` node's futures.pb run the same way, recursively;
retries of recoverable failures), datacatalog (a cached task's outputs stored under its id, cache version and the hash of
its input literal map), and the pod (its own process, an empty working directory, its own HOME and TMPDIR, the image's code
read-only on PYTHONPATH, under bubblewrap a filesystem without this machine's temporary folders, home or checkouts and with
a /tmp of its own, and a disk that is gone when the pod ends). A Ray task's pod starts Ray in itself, as the Ray plugin
does outside a KubeRay cluster: its actors run in the pod.

Not emulated: sub-workflow and branch nodes (refused by name), nodes running side by side, resources, timeouts and
interruptible (they are checked in the compiled spec), a multi-node Elastic job (one pod runs all its processes).
"""

from __future__ import annotations

import compileall
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from flyteidl.core import errors_pb2, literals_pb2
from flyteidl.core.dynamic_job_pb2 import DynamicJobSpec as DynamicJobSpecPb
from flytekit.configuration import DataConfig, Image, ImageConfig, S3Config, SerializationSettings
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.data_persistence import FileAccessProvider
from flytekit.core.type_engine import TypeEngine
from flytekit.core.utils import load_proto_from_file, write_proto_to_file
from flytekit.models import literals as lits
from flytekit.models.core.workflow import Node
from flytekit.models.dynamic_job import DynamicJobSpec
from flytekit.tools.translator import get_serializable

from miles_core.net import free_port

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix).resolve()  # the image's Python environment
CODE_PACKAGES = ("miles_core", "tasks", "workflows", "containers")  # what the image ships of the project
CODE_FILES = ("pyproject.toml", "requirements.lock")  # the image holds the repository's files; containers/images.py reads these
BUCKET = "miles-pods"
PROJECT, DOMAIN, VERSION = "miles", "development", "pods"
CONFINED = shutil.which("bwrap") is not None  # pods under bubblewrap (see Cluster._confined)
PASSED_ENV = ("OMP_NUM_THREADS", "LANG", "TRANSFORMERS_VERBOSITY", "TOKENIZERS_PARALLELISM")  # what the image's env would set


class PodFailed(RuntimeError):
    """A node's pod exited with an error (the message is the task's error document and the pod's log tail)."""


class ObjectStore:
    """An S3 server (moto) on loopback with one bucket; the credentials and endpoint pods get through flytekit's env vars."""

    def __init__(self, workdir: Path):
        from moto.server import ThreadedMotoServer  # the test extra's S3 server, only this tier needs it

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the server's access log, a line per request
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"FLYTE_AWS_ENDPOINT": self.endpoint, "FLYTE_AWS_ACCESS_KEY_ID": "pods", "FLYTE_AWS_SECRET_ACCESS_KEY": "pods-secret"}
        data = DataConfig(s3=S3Config(endpoint=self.endpoint, access_key_id="pods", secret_access_key="pods-secret"))
        self.local = workdir
        self.files = FileAccessProvider(local_sandbox_dir=str(workdir / "sandbox"), raw_output_prefix=self.uri("raw"), data_config=data)
        self.files.get_filesystem("s3").mkdir(BUCKET)

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{BUCKET}", *parts])

    def exists(self, uri: str) -> bool:
        return self.files.exists(uri)

    def keys(self, prefix: str) -> list[str]:
        """Every object under `prefix` (an s3:// URI), as s3:// URIs."""
        return sorted(f"s3://{k}" for k in self.files.get_filesystem("s3").find(prefix))

    def read(self, uri: str, pb_type):
        local = tempfile.mktemp(dir=self.local)
        self.files.get_data(uri, local)
        return load_proto_from_file(pb_type, local)

    def write(self, uri: str, proto) -> None:
        local = tempfile.mktemp(dir=self.local)
        write_proto_to_file(proto, local)
        self.files.put_data(local, uri)

    def read_literals(self, uri: str) -> lits.LiteralMap:
        return lits.LiteralMap.from_flyte_idl(self.read(uri, literals_pb2.LiteralMap))

    def context(self):
        """A flytekit context whose file access is the store's: `with store.context() as ctx:` converts and downloads outputs."""
        ctx = FlyteContextManager.current_context()
        return FlyteContextManager.with_context(ctx.with_file_access(self.files))

    def close(self) -> None:
        self.server.stop()


@dataclass
class Execution:
    """One workflow execution: its outputs and, per task node run (dynamic sub-nodes as "parent/child"), how it ran."""

    name: str
    outputs: lits.LiteralMap | None = None
    nodes: dict[str, str] = field(default_factory=dict)  # node path -> "ran" | "cache hit" ; task name in `tasks`
    tasks: dict[str, str] = field(default_factory=dict)  # node path -> task name

    def by_task(self, status: str) -> list[str]:
        return [self.tasks[n] for n, s in self.nodes.items() if s == status]


class Cluster:
    """Runs workflows compiled by flytekit's serializer, every task node as a pod (see the module docstring)."""

    def __init__(self, store: ObjectStore, workdir: Path, extra_code: tuple[str, ...] = ()):
        self.store, self.workdir = store, workdir
        self.code = self._image_code(workdir / "image", extra_code)
        self.settings = SerializationSettings(
            image_config=ImageConfig(default_image=Image(name="default", fqn="miles-flyte/pods", tag=VERSION)),
            project=PROJECT,
            domain=DOMAIN,
            version=VERSION,
        ).with_serialized_context()  # a dynamic node's pod compiles its sub-nodes with these settings, as on a cluster

    @staticmethod
    def _image_code(dest: Path, extra_code: tuple[str, ...]) -> Path:
        """The project's packages (and `extra_code`, files relative to the repo) copied and compiled, read-only: the code an
        image holds (containers/images.py compiles it as the image is built)."""
        for package in CODE_PACKAGES:
            shutil.copytree(REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in (*CODE_FILES, *extra_code):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / name, dest / name)
        if not compileall.compile_dir(dest, quiet=1):
            raise AssertionError(f"the image's code in {dest} does not compile")
        for path in [dest, *dest.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        return dest

    def run(self, workflow, **inputs) -> Execution:
        """Compile `workflow`, bind `inputs` (Python values of its signature), and run it to its outputs."""
        entities = OrderedDict()
        spec = get_serializable(entities, self.settings, workflow)
        self.templates = {s.template.id: s.template for s in entities.values() if hasattr(s, "template") and hasattr(s.template, "container")}
        types = workflow.python_interface.inputs
        with self.store.context() as ctx:
            literals = {k: TypeEngine.to_literal(ctx, v, types[k], TypeEngine.to_literal_type(types[k])) for k, v in inputs.items()}
        execution = Execution(name=f"x{uuid.uuid4().hex[:10]}")
        graph = spec.template
        execution.outputs = self._run_graph(execution, graph.nodes, graph.outputs, lits.LiteralMap(literals), prefix="")
        return execution

    # propeller: nodes in dependency order, bindings resolved against the outputs so far

    def _run_graph(self, execution: Execution, nodes: list[Node], outputs: list, inputs: lits.LiteralMap, prefix: str) -> lits.LiteralMap:
        done: dict[str, lits.LiteralMap] = {"": inputs, "start-node": inputs}
        for node in _in_dependency_order(nodes):
            node_inputs = lits.LiteralMap({b.var: _resolve(b.binding, done) for b in node.inputs})
            done[node.id] = self._run_node(execution, node, node_inputs, f"{prefix}{node.id}")
        return lits.LiteralMap({b.var: _resolve(b.binding, done) for b in outputs})

    def _run_node(self, execution: Execution, node: Node, inputs: lits.LiteralMap, path: str) -> lits.LiteralMap:
        if node.task_node is None:
            raise NotImplementedError(f"node {path}: only task nodes (and the dynamic nodes they return) are emulated")
        template = self.templates[node.task_node.reference_id]
        execution.tasks[path] = template.id.name
        cached = self._catalog_key(template, inputs) if template.metadata.discoverable else None
        if cached and self.store.exists(cached):
            execution.nodes[path] = "cache hit"
            return self.store.read_literals(cached)
        started = time.monotonic()
        outputs = self._run_pod(execution, template, inputs, path)
        execution.nodes[path] = "ran"
        print(f"{execution.name} {path} {template.id.name}: ran in {time.monotonic() - started:.1f} s", flush=True)  # a long run's progress
        if cached:
            self.store.write(cached, outputs.to_flyte_idl())
        return outputs

    def _catalog_key(self, template, inputs: lits.LiteralMap) -> str:
        """datacatalog: the task's id and cache version, and the hash of its input literal map."""
        digest = hashlib.sha256(inputs.to_flyte_idl().SerializeToString(deterministic=True)).hexdigest()
        return self.store.uri("datacatalog", template.id.name, template.metadata.discovery_version, f"{digest}.pb")

    # the pod

    def _run_pod(self, execution: Execution, template, inputs: lits.LiteralMap, path: str) -> lits.LiteralMap:
        retries = template.metadata.retries.retries if template.metadata.retries else 0
        for attempt in range(retries + 1):
            meta = self.store.uri("metadata", execution.name, path, str(attempt))
            self.store.write(f"{meta}/inputs.pb", inputs.to_flyte_idl())
            log = self._start_pod(execution, template, meta, path, attempt)
            if self.store.exists(f"{meta}/error.pb"):
                error = self.store.read(f"{meta}/error.pb", errors_pb2.ErrorDocument).error
                if error.kind == errors_pb2.ContainerError.RECOVERABLE and attempt < retries:
                    continue
                raise PodFailed(f"node {path} ({template.id.name}), attempt {attempt}: {error.code}: {error.message}\n{log}")
            if self.store.exists(f"{meta}/futures.pb"):  # a dynamic node: run what it compiled, the same way
                spec = DynamicJobSpec.from_flyte_idl(self.store.read(f"{meta}/futures.pb", DynamicJobSpecPb))
                self.templates.update({t.id: t for t in spec.tasks})
                outputs = self._run_graph(execution, spec.nodes, spec.outputs, inputs, prefix=f"{path}/")
                self.store.write(f"{meta}/outputs.pb", outputs.to_flyte_idl())
                return outputs
            if not self.store.exists(f"{meta}/outputs.pb"):
                raise PodFailed(f"node {path} ({template.id.name}): the pod left neither outputs nor an error\n{log}")
            return self.store.read_literals(f"{meta}/outputs.pb")
        raise AssertionError("unreachable")

    def _start_pod(self, execution: Execution, template, meta: str, path: str, attempt: int) -> str:
        """`pyflyte-execute` with the template's container args in a fresh pod; returns the tail of its log."""
        container = template.container
        if container is None:
            raise AssertionError(f"{template.id.name}: a pod template, which the emulator does not start (every task here is a container)")
        args = list(container.args)
        raw = self.store.uri("raw", execution.name, path.replace("/", "-"), str(attempt))
        values = {"{{.input}}": f"{meta}/inputs.pb", "{{.outputPrefix}}": meta, "{{.rawOutputDataPrefix}}": raw}
        values |= {"{{.checkpointOutputPrefix}}": f"{raw}/_flytecheckpoints", "{{.prevCheckpointPrefix}}": '""'}
        args = [values.get(a, a) for a in args]
        pod = Path(tempfile.mkdtemp(prefix="pod-", dir=self.workdir))
        try:
            for sub in ("work", "home", "tmp"):
                (pod / sub).mkdir()
            env = self._pod_env(execution, template, pod, attempt) | dict(container.env.items())
            proc = subprocess.run(self._confined(args, pod), cwd=pod / "work", env=env, capture_output=True, text=True, timeout=1800)
        finally:
            shutil.rmtree(pod, ignore_errors=True)  # a pod's disk ends with the pod
        log = (proc.stdout + proc.stderr)[-6000:]
        if proc.returncode and not self.store.exists(f"{meta}/error.pb"):
            raise PodFailed(f"node {path} ({template.id.name}): pyflyte-execute exited {proc.returncode}\n{log}")
        return log

    def _confined(self, args: list[str], pod: Path) -> list[str]:
        """The pod's view of the filesystem (bubblewrap): the system, the image's Python and packages and the project's code
        read-only, its own disk writable, and nothing of this machine's temporary folders, home or checkouts, so a path the
        submitter or another pod wrote is simply not there. The network is shared: the object store is on loopback."""
        if not CONFINED:  # `make setup` installs bubblewrap; without it a pod sees the machine's files, its disk still goes
            return args
        hidden = {tempfile.gettempdir(), os.path.expanduser("~"), f"/{REPO.parts[1]}"}
        view = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        view += [arg for path in sorted(hidden) for arg in ("--tmpfs", path)]
        view += ["--bind", str(pod / "tmp"), "/tmp"]  # the pod's own /tmp (short paths: Ray puts its sockets there)
        view += [arg for path in (sys.base_prefix, VENV, self.code) for arg in ("--ro-bind", str(path), str(path))]
        return ["bwrap", *view, "--bind", str(pod), str(pod), "--die-with-parent", "--", *args]

    def _pod_env(self, execution: Execution, template, pod: Path, attempt: int) -> dict[str, str]:
        return {
            "PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(pod / "home"),
            "TMPDIR": "/tmp" if CONFINED else str(pod / "tmp"),
            "PYTHONPATH": str(self.code),
            "PYTHONDONTWRITEBYTECODE": "1",  # the image's code is read-only
            **{k: os.environ[k] for k in PASSED_ENV if k in os.environ},
            **self.store.env,
            "FLYTE_INTERNAL_EXECUTION_ID": execution.name,
            "FLYTE_INTERNAL_EXECUTION_PROJECT": PROJECT,
            "FLYTE_INTERNAL_EXECUTION_DOMAIN": DOMAIN,
            "FLYTE_INTERNAL_TASK_PROJECT": template.id.project,
            "FLYTE_INTERNAL_TASK_DOMAIN": template.id.domain,
            "FLYTE_INTERNAL_TASK_NAME": template.id.name,
            "FLYTE_INTERNAL_TASK_VERSION": template.id.version,
            "FLYTE_ATTEMPT_NUMBER": str(attempt),
        }


def _upstream(node: Node) -> set[str]:
    ids = set(node.upstream_node_ids or [])
    stack = [b.binding for b in node.inputs]
    while stack:
        data = stack.pop()
        if data.promise is not None:
            ids.add(data.promise.node_id)
        stack.extend(data.collection.bindings if data.collection is not None else [])
        stack.extend(data.map.bindings.values() if data.map is not None else [])
    return ids - {"", "start-node"}


def _in_dependency_order(nodes: list[Node]) -> list[Node]:
    ordered, seen, pending = [], set(), list(nodes)
    while pending:
        ready = [n for n in pending if _upstream(n) <= seen]
        if not ready:
            raise ValueError(f"nodes {[n.id for n in pending]} wait on nodes that never run")
        for node in ready:
            ordered.append(node)
            seen.add(node.id)
            pending.remove(node)
    return ordered


def _resolve(data: lits.BindingData, done: dict[str, lits.LiteralMap]) -> lits.Literal:
    """A binding's literal: a scalar as compiled, a collection or map element-wise, a promise from the node's outputs."""
    if data.scalar is not None:
        return lits.Literal(scalar=data.scalar)
    if data.collection is not None:
        return lits.Literal(collection=lits.LiteralCollection([_resolve(b, done) for b in data.collection.bindings]))
    if data.map is not None:
        return lits.Literal(map=lits.LiteralMap({k: _resolve(b, done) for k, b in data.map.bindings.items()}))
    promise = data.promise
    return _attribute(done[promise.node_id].literals[promise.var], list(promise.attr_path))


def _attribute(value: lits.Literal, path: list) -> lits.Literal:
    """An attribute path into a literal, as propeller resolves it: map keys and list indices, then into a dataclass's
    msgpack (the result is msgpack again, whatever its type)."""
    while path and (value.map is not None or value.collection is not None):
        key = path.pop(0)
        value = value.map.literals[key] if value.map is not None else value.collection.literals[key]
    if not path:
        return value
    binary = value.scalar.binary
    if binary is None or binary.tag != "msgpack":
        raise ValueError(f"attribute path {path} into a literal that is no msgpack dataclass: {value}")
    inner = msgpack.loads(binary.value, strict_map_key=False)
    for key in path:
        inner = inner[key]
    return lits.Literal(scalar=lits.Scalar(binary=lits.Binary(value=msgpack.dumps(inner), tag="msgpack")))
