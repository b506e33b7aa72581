"""A checkpoint and its policy pruned in the object store (cluster.keep_checkpoints, keep_policies false): the prune
task run locally with flytekit's file access pointed at the S3 server on loopback (tests/pods/conftest.py), as a pod on
a cluster runs it."""

import json

import pytest
from flytekit.types.directory import FlyteDirectory

from miles_core.retention import TOMBSTONE, Pruned
from miles_core.weights.manifest import MANIFEST_FILE
from tasks.common import Checkpoint, Policy
from tasks.retention import prune_iteration, unpruned

pytestmark = pytest.mark.pods

CHECKPOINT = {"model.safetensors": b"w" * 4096, "optimizer/state.safetensors": b"o" * 8192, "trainer_state.json": b'{"step": 3}'}
POLICY = {"model.safetensors": b"w" * 2048, "config.json": b"{}", MANIFEST_FILE: b'{"version": 4}'}


def stored(store, tmp_path, stage: str, name: str, files: dict[str, bytes]) -> FlyteDirectory:
    local = tmp_path / stage / name
    for path, data in files.items():
        (local / path).parent.mkdir(parents=True, exist_ok=True)
        (local / path).write_bytes(data)
    uri = store.uri("prune-run", stage, name)
    store.files.put_data(str(local), uri, is_multipart=True)
    return FlyteDirectory(uri)


def test_a_pruned_iteration_leaves_its_tombstones_and_manifest_alone_and_a_reader_is_told_why(store, tmp_path):
    old = Checkpoint(dir=stored(store, tmp_path, "checkpoint", "0003-aaaa", CHECKPOINT), step=3)
    newer = Checkpoint(dir=stored(store, tmp_path, "checkpoint", "0004-bbbb", CHECKPOINT), step=4)
    policy = Policy(dir=stored(store, tmp_path, "policy", "0004-cccc", POLICY), version=4)
    old_uri, newer_uri, policy_uri = old.dir.path, newer.dir.path, policy.dir.path
    assert len(store.keys(old_uri)) == 3
    with store.context():
        for _ in range(2):  # a retried or re-run prune deletes nothing more and fails on nothing
            prune_iteration(ckpt=old, policy=policy, newer=newer, iterations_done=3, keep=1, every=2)
        assert store.keys(old_uri) == [f"{old_uri}/{TOMBSTONE}"]
        assert store.keys(policy_uri) == [f"{policy_uri}/{TOMBSTONE}", f"{policy_uri}/{MANIFEST_FILE}"]
        assert len(store.keys(newer_uri)) == 3  # the newer one untouched
        assert unpruned(newer.dir) is newer.dir
        with pytest.raises(Pruned, match=rf"checkpoint {old_uri}: pruned after 3 iterations by cluster.keep_checkpoints=1, keep_checkpoints_every=2"):
            unpruned(old.dir)
        with pytest.raises(Pruned, match=rf"policy {policy_uri}: pruned after 3 iterations"):
            unpruned(policy.dir)
    record = json.loads(store.files.get_filesystem("s3").cat_file(f"{old_uri}/{TOMBSTONE}"))
    assert (record["iterations_done"], record["newer"]) == (3, newer_uri)
