"""A checkpoint pruned in the object store (cluster.keep_checkpoints): the prune task run locally with flytekit's file
access pointed at the S3 server on loopback (tests/pods/conftest.py), as a pod on a cluster runs it."""

import json

import pytest
from flytekit.types.directory import FlyteDirectory

from miles_core.retention import TOMBSTONE, PrunedCheckpoint
from tasks.common import Checkpoint
from tasks.retention import kept_uri, prune_checkpoint

pytestmark = pytest.mark.pods

FILES = {"model.safetensors": b"w" * 4096, "optimizer/state.safetensors": b"o" * 8192, "trainer_state.json": b'{"step": 3}'}


def stored_checkpoint(store, tmp_path, name: str) -> Checkpoint:
    local = tmp_path / name
    for path, data in FILES.items():
        (local / path).parent.mkdir(parents=True, exist_ok=True)
        (local / path).write_bytes(data)
    uri = store.uri("prune-run", "checkpoint", name)
    store.files.put_data(str(local), uri, is_multipart=True)
    return Checkpoint(dir=FlyteDirectory(uri), step=3)


def test_a_pruned_checkpoint_leaves_its_tombstone_alone_and_a_reader_is_told_why(store, tmp_path):
    old, newer = stored_checkpoint(store, tmp_path, "0003-aaaa"), stored_checkpoint(store, tmp_path, "0004-bbbb")
    old_uri, newer_uri = old.dir.path, newer.dir.path
    assert len(store.keys(old_uri)) == 3
    with store.context():
        for _ in range(2):  # a retried or re-run prune deletes nothing more and fails on nothing
            prune_checkpoint(ckpt=old, newer=newer, iterations_done=3, keep=1, every=2)
        assert store.keys(old_uri) == [f"{old_uri}/{TOMBSTONE}"]
        assert len(store.keys(newer_uri)) == 3  # the newer one untouched
        assert kept_uri(newer) == newer_uri
        with pytest.raises(PrunedCheckpoint, match=rf"checkpoint {old_uri}: pruned after 3 iterations by cluster.keep_checkpoints=1, keep_checkpoints_every=2"):
            kept_uri(old)
    record = json.loads(store.files.get_filesystem("s3").cat_file(f"{old_uri}/{TOMBSTONE}"))
    assert (record["iterations_done"], record["newer"]) == (3, newer_uri)
