"""SGLang rollout engine: the RolloutEngine contract over one or more SGLang servers' HTTP API.

Generation: each sequence (prompt x n) is one entry of a batched `/generate` call with
`input_ids` and `return_logprob`; calls of at most max_batch_sequences sequences run concurrently
(max_concurrency per server), each sent to the healthy server with the fewest calls in flight.
SGLang reports log-probs under softmax(logits / temperature) before top-k/top-p (softmax(logits)
when greedy), as the contract asks; the response's tokens are `output_ids` including the stop
token. A response carries the server's weight version; one aborted by a weight update, or
produced across two versions, is generated again, so each response comes from one version.

Departures from the embedded engine: the model's own EOS id (config.json) also ends generation,
whether or not it is in stop_token_ids (SGLang's `ignore_eos` would disable stop_token_ids too);
the seed reaches SGLang as `sampling_seed`, which it honours only with
`--enable-deterministic-inference` (rollout.sglang.extra_args), so sampled output is otherwise
not reproducible run to run.

Weights: `load_weights(dir, version)` publishes a version into every server, from disk
(`update_weights_from_disk`) or, with weight_sync "distributed", by broadcasting the directory's
tensors from this process over a process group (miles_core/weights/sync.py);
`update_weights_from_tensors` broadcasts a trainer's in-memory tensors the same way. Each
update runs pause -> begin -> update -> end -> flush -> continue; its duration is
`last_update_metrics` (rollout/weight_update_s and the version it published).
A LoRA policy (an adapter directory, weights/adapter.py) is served unmerged: the servers run the base model with
`--enable-lora` (the adapter's rank and target modules), each version's adapter is loaded by `/load_lora_adapter` under
the name `v<version>`, every `/generate` names it as `lora_path`, and the previous version's adapter is unloaded.
With speculative_tokens > 0 the servers decode speculatively (SGLang's EAGLE algorithm) with the policy's MTP head as
their draft model, converted into SGLang's MiMo MTP layout (sglang_draft.py) in a directory of this engine's; each
version rewrites it from the version's head and publishes it by a second `update_weights_from_disk` from it, in the
same pause.
A launched server that dies is restarted (at most max_restarts times) with the last published
directory (an adapter: the base, then the adapter) and the failed call is sent again; an attached one that stops answering is dropped
while others remain; every HTTP call has a timeout.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from transformers import AutoConfig

from miles_core.config import SGLangConfig
from miles_core.models import text_config
from miles_core.net import address_toward, free_port
from miles_core.rollout.base import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams
from miles_core.rollout.engines.sglang_draft import speculative_launch_args, write_draft
from miles_core.rollout.engines.sglang_server import ServerUnreachable, SGLangError, SGLangServer
from miles_core.routing import moe_layer_ids, moe_sizes
from miles_core.weights import sync
from miles_core.weights.adapter import ADAPTER_CONFIG, is_adapter_dir
from miles_core.weights.check import check_hf_dir, json_object

log = logging.getLogger(__name__)
MAX_RESUBMITS = 4  # a sequence aborted by this many consecutive weight updates is an error


class SGLangEngine:
    def __init__(
        self,
        cfg: SGLangConfig,
        policy_dir: str,
        version: int = 0,
        record_routing: bool = False,
        base_dir: str | None = None,
        speculative_tokens: int = 0,
    ):
        self.routing = _routing_layout(policy_dir) if record_routing else None  # (MoE layer ids, decoder layers, k)
        if record_routing:  # the servers capture each token's experts (R3); attached ones must have been launched so
            cfg = dataclasses.replace(cfg, extra_args=f"{cfg.extra_args} --enable-return-routed-experts")
        self.adapter: tuple[str, int] | None = None  # (name, version) of the LoRA adapter every /generate names
        self.model_dir = policy_dir  # what the servers load at launch: the policy, or a LoRA policy's base
        self.lora = is_adapter_dir(policy_dir)  # the servers run a LoRA policy's base and serve its versions as adapters
        if self.lora:  # attached servers must have been launched with --enable-lora alike
            cfg = dataclasses.replace(cfg, extra_args=f"{cfg.extra_args} {' '.join(lora_launch_args(policy_dir, cfg.device))}")
            self.model_dir = _required_base(policy_dir, base_dir)
        self.draft_dir: Path | None = None  # the SGLang draft model of the served version (speculative_tokens > 0)
        if speculative_tokens:  # one directory for the servers' lifetime: a restarted server loads the current draft
            self.draft_dir = write_draft(policy_dir, tempfile.mkdtemp(prefix="sglang-draft-"))
            cfg = dataclasses.replace(cfg, extra_args=f"{cfg.extra_args} {' '.join(speculative_launch_args(self.draft_dir, speculative_tokens))}")
        self.cfg = cfg
        self.policy_dir, self.weight_version = policy_dir, version
        self.last_update_metrics: dict[str, float] = {}
        self._sender: sync.WeightSender | None = None
        self._lock = threading.Lock()  # one restart or weight update at a time
        self._in_flight: dict[int, int] = {}
        self.resubmitted_sequences = 0  # aborted by a weight update (or split across two versions) and generated again
        urls = [u.strip() for u in cfg.urls.split(",") if u.strip()]
        try:
            with ThreadPoolExecutor(max(len(urls), cfg.num_servers)) as pool:  # servers start in parallel
                if urls:
                    self.servers = list(pool.map(lambda u: SGLangServer.attach(u, cfg), urls))
                else:
                    self.servers = list(pool.map(lambda slot: SGLangServer.launch(cfg, self.model_dir, version, slot), range(cfg.num_servers)))
        except BaseException:
            self._remove_draft()  # nothing serves it: a failed launch leaves no directory behind
            raise
        if urls or self.lora:  # attached servers hold whatever they hold; a LoRA policy's adapter is loaded now
            self.weight_version = None
            self.load_weights(policy_dir, version)
        self._pool = ThreadPoolExecutor(cfg.max_concurrency * len(self.servers))

    @property
    def in_flight(self) -> int:
        """Requests sent to the servers and not yet answered."""
        return sum(self._in_flight.values())

    # ---- generation -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        sequences = [(p, i) for p in range(len(prompts)) for i in range(params.n)]
        results: dict[tuple[int, int], Generation] = {}
        pending = sequences
        for _ in range(MAX_RESUBMITS + 1):
            chunks = [pending[s : s + self.cfg.max_batch_sequences] for s in range(0, len(pending), self.cfg.max_batch_sequences)]
            retry: list[tuple[int, int]] = []
            for chunk, outputs in zip(chunks, self._pool.map(lambda c: self._generate_chunk(c, prompts, params), chunks)):
                for key, out in zip(chunk, outputs):
                    if out is None:
                        retry.append(key)
                    else:
                        results[key] = out
            if not retry:
                return [[results[(p, i)] for i in range(params.n)] for p in range(len(prompts))]
            log.info("resubmitting %d sequences aborted or split by a weight update", len(retry))
            self.resubmitted_sequences += len(retry)
            pending = retry
        raise SGLangError(f"{len(pending)} sequences were aborted by {MAX_RESUBMITS + 1} weight updates in a row")

    def _generate_chunk(self, chunk: list[tuple[int, int]], prompts: list[list[int]], params: SamplingParams) -> list[Generation | None]:
        payload = {
            "input_ids": [prompts[p] for p, _ in chunk],
            "sampling_params": [_sampling_params(params, p * params.n + i) for p, i in chunk],
            "return_logprob": True,
            "return_routed_experts": self.routing is not None,
        }
        adapter = self.adapter
        if adapter is not None:
            payload["lora_path"] = [adapter[0]] * len(chunk)
        answers = self._call_any("/generate", payload)
        return [self._to_generation(answer, adapter[1] if adapter else None) for answer in answers]

    def _to_generation(self, answer: dict, adapter_version: int | None = None) -> Generation | None:
        """One /generate answer -> Generation, or None when it must be generated again; with a LoRA adapter, its version
        is the adapter's the request named (the server's own weight version is its base's)."""
        meta = answer["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish == "abort" or len(meta.get("weight_versions") or [None]) > 1:
            return None
        tokens = [int(t) for t in answer["output_ids"]]
        logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        if len(logprobs) != len(tokens):
            raise SGLangError(f"/generate returned {len(tokens)} tokens but {len(logprobs)} log-probs")
        finish = FINISH_STOP if finish == "stop" else FINISH_LENGTH
        version = adapter_version if adapter_version is not None else _version(meta, self.weight_version)
        return Generation(tokens, logprobs, finish, version, self._routed_experts(meta))

    def _routed_experts(self, meta: dict) -> list[int]:
        """SGLang's record (base64 int32 [positions fed, every decoder layer, k]) in miles_core/routing.py's layout."""
        if self.routing is None:
            return []
        if not meta.get("routed_experts"):
            raise SGLangError("the server returned no routed experts: an attached server must run with --enable-return-routed-experts")
        layers, decoder_layers, top_k = self.routing
        record = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, decoder_layers, top_k)
        return record[:, layers].flatten().tolist()

    def _call_any(self, path: str, payload: dict):
        """POST to the least busy live server; a dead launched server is restarted and the call sent again."""
        for _ in range(len(self.servers) + self.cfg.max_restarts + 1):
            server = self._pick()
            try:
                return server.post(path, payload)
            except ServerUnreachable as err:
                self._recover(server, err)
            finally:
                self._in_flight[id(server)] -= 1
        raise SGLangError(f"{path}: no SGLang server answered after {self.cfg.max_restarts} restarts")

    def _pick(self) -> SGLangServer:
        with self._lock:
            server = min(self.servers, key=lambda s: self._in_flight.get(id(s), 0))
            self._in_flight[id(server)] = self._in_flight.get(id(server), 0) + 1
            return server

    def _recover(self, server: SGLangServer, err: SGLangError) -> None:
        with self._lock:
            if server.alive():
                return  # another thread restarted it already
            self._close_sender()  # the group lost a member: the next distributed update builds a new one
            if not server.launched and len(self.servers) > 1:
                log.warning("%s; routing around it from now on", err)
                self.servers.remove(server)
                return
            if not server.launched or server.restarts >= self.cfg.max_restarts:
                raise SGLangError(
                    f"{err}; {'attached servers are not restarted' if not server.launched else f'gave up after {server.restarts} restarts'}"
                ) from None
            log.warning("%s; restarting", err)
            server.restart(self.model_dir if self.lora else self.policy_dir, self.weight_version)  # a LoRA policy: its base, then its adapter
            if self.adapter is not None:
                server.post("/load_lora_adapter", {"lora_name": self.adapter[0], "lora_path": str(self.policy_dir)})

    # ---- weights ----------------------------------------------------------------------------

    def load_weights(self, policy_dir: str, version: int) -> None:
        """Publish an HF weight directory into every server as `version` (no-op if already served)."""
        if (policy_dir, version) == (self.policy_dir, self.weight_version):
            return
        if self.lora or is_adapter_dir(policy_dir):
            self._swap_adapter(policy_dir, version)
            return
        check_hf_dir(policy_dir, tokenizer=False)  # refused here, not half-applied across the servers
        if self.cfg.weight_sync == "disk":
            self._update(lambda: self._load_from_disk(policy_dir, version), "disk", version)
        else:
            self._update(lambda: self._broadcast(_read_tensors(policy_dir), version), "distributed", version)
        self.policy_dir, self.weight_version = policy_dir, version

    def _load_from_disk(self, policy_dir: str, version: int) -> None:
        """The policy directory into every server, then its draft model (the target skips the draft's names, the draft
        the policy's)."""
        payload = {"model_path": str(policy_dir), "weight_version": str(version), "flush_cache": False}
        self._on_all("/update_weights_from_disk", payload)
        if self.draft_dir is not None:
            write_draft(policy_dir, self.draft_dir)
            self._on_all("/update_weights_from_disk", {**payload, "model_path": str(self.draft_dir)})

    def _swap_adapter(self, adapter_dir: str, version: int) -> None:
        """The LoRA adapter of `adapter_dir` loaded into every server as `v<version>`, named by every later /generate,
        and the previous version's adapter unloaded (SGLang finishes the requests that name it first)."""
        if not (is_adapter_dir(adapter_dir) and self.lora):
            raise SGLangError(
                f"{adapter_dir}: {'a LoRA adapter' if is_adapter_dir(adapter_dir) else 'full weights'}, and these servers were launched for "
                f"{'a LoRA policy: its base with adapters' if self.lora else 'full weights'}"
            )
        started, previous, name = time.perf_counter(), self.adapter, f"v{version}"
        with self._lock:
            self._on_all("/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)})
            self.adapter, self.policy_dir, self.weight_version = (name, version), adapter_dir, version
            if previous is not None and previous[0] != name:
                self._on_all("/unload_lora_adapter", {"lora_name": previous[0]})
        self.last_update_metrics = {"rollout/weight_update_s": time.perf_counter() - started, "rollout/weight_update_version": float(version)}

    def update_weights_from_tensors(self, named_tensors, version: int) -> None:
        """Broadcast in-memory HF-named tensors (e.g. a trainer's state_dict) as `version`."""
        self._update(lambda: self._broadcast(named_tensors, version), "distributed", version)
        self.weight_version = version

    def load_state_dict(self, state: dict, version: int) -> None:
        """A trainer's in-memory weights (the async phase's push), broadcast into the servers."""
        self.update_weights_from_tensors(state.items(), version)

    def _update(self, apply, how: str, version: int) -> None:
        started = time.perf_counter()
        with self._lock:
            self._on_all("/pause_generation", {"mode": self.cfg.pause_mode})
            try:
                self._on_all("/begin_weight_update", {})
                apply()
                self._on_all("/end_weight_update", {})
                self._on_all("/flush_cache", {})
            finally:
                self._on_all("/continue_generation", {})
        seconds = time.perf_counter() - started
        self.last_update_metrics = {"rollout/weight_update_s": seconds, "rollout/weight_update_version": float(version)}
        log.info("weights published into %d SGLang server(s) from %s in %.2fs", len(self.servers), how, seconds)

    def _on_all(self, path: str, payload: dict) -> list:
        with ThreadPoolExecutor(len(self.servers)) as pool:
            return list(pool.map(lambda s: s.post(path, payload), self.servers))

    def _broadcast(self, named_tensors, version: int) -> None:
        sender = self._sender or self._open_sender()
        bucket_bytes = int(self.cfg.bucket_mb * 2**20)
        for bucket in sync.iter_buckets(named_tensors, bucket_bytes):
            payload = {
                "names": bucket.names,
                "dtypes": bucket.dtypes,
                "shapes": bucket.shapes,
                "group_name": sender.group_name,
                "load_format": "flattened_bucket",
                "flush_cache": False,
                "weight_version": str(version),
            }
            with ThreadPoolExecutor(len(self.servers)) as pool:  # servers wait in the broadcast we send
                answers = [pool.submit(s.post, "/update_weights_from_distributed", payload) for s in self.servers]
                sender.send(bucket)
                for answer in answers:
                    answer.result()

    def _open_sender(self) -> sync.WeightSender:
        port, group_name = free_port(), f"miles-{uuid.uuid4().hex[:8]}"
        world = len(self.servers) + 1  # rank 0 here, one rank per server (tensor parallel size 1)
        address = address_toward(self.servers[0].url)  # servers share the pods' network: where they reach this process
        with ThreadPoolExecutor(len(self.servers)) as pool:
            joins = [
                pool.submit(
                    s.post,
                    "/init_weights_update_group",
                    {
                        "master_address": address,
                        "master_port": port,
                        "rank_offset": rank,
                        "world_size": world,
                        "group_name": group_name,
                        "backend": self.cfg.sync_backend,
                    },
                )
                for rank, s in enumerate(self.servers, start=1)
            ]
            self._sender = sync.WeightSender.open(address, port, world, group_name, self.cfg.sync_backend, self.cfg.request_timeout_s)
            for join in joins:
                join.result()
        return self._sender

    def _close_sender(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    # ---- control ----------------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> None:
        """Stop generating: abort (in-flight requests return, finish "abort"), retract or in_place."""
        self._on_all("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._on_all("/continue_generation", {})

    def abort_all(self) -> None:
        self._on_all("/abort_request", {"abort_all": True})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._close_sender()
        for server in self.servers:
            server.stop()
        self._remove_draft()

    def _remove_draft(self) -> None:
        if self.draft_dir is not None:
            shutil.rmtree(self.draft_dir, ignore_errors=True)


def _sampling_params(params: SamplingParams, sequence: int) -> dict:
    return {
        "temperature": params.temperature,  # 0 = greedy in SGLang too
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "sampling_seed": params.seed * 1_000_003 + sequence,
    }


def _version(meta: dict, fallback: int | None) -> int:
    try:
        return int(meta["weight_version"])
    except (KeyError, TypeError, ValueError):
        return fallback if fallback is not None else -1


def _read_tensors(policy_dir: str):
    # safetensors is the format every published policy directory holds
    from safetensors import safe_open

    for file in sorted(Path(policy_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _routing_layout(policy_dir: str) -> tuple[list[int], int, int]:
    full = AutoConfig.from_pretrained(policy_dir)
    config, layers = text_config(full), moe_layer_ids(full)
    if not layers:
        raise ValueError(f"routing replay needs a mixture-of-experts model; {policy_dir} has no routed experts")
    return layers, config.num_hidden_layers, moe_sizes(config)[1]


def lora_launch_args(adapter_dir: str, device: str) -> list[str]:
    """The launch_server arguments that serve the LoRA adapter of `adapter_dir` (and later versions of it); on CPU with
    SGLang's pure-torch LoRA backend (its default one is a Triton kernel)."""
    config = json_object(Path(adapter_dir) / ADAPTER_CONFIG, "the LoRA adapter's config")
    backend = ["--lora-backend", "torch_native"] if device == "cpu" else []
    return ["--enable-lora", "--max-lora-rank", str(config["r"]), "--lora-target-modules", *sorted(config["target_modules"]), *backend]


def _required_base(adapter_dir: str, base_dir: str | None) -> str:
    if base_dir is None:
        raise SGLangError(f"{adapter_dir}: a LoRA adapter: the servers need its base model's directory (base_dir)")
    check_hf_dir(base_dir, tokenizer=False)
    return base_dir
