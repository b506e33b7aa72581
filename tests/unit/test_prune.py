"""Pruning a checkpoint folder on a local disk (miles_core/retention.py); tests/pods/test_prune_in_store.py does it in
an S3 store."""

import fsspec
import pytest

from miles_core.retention import TOMBSTONE, Pruned, check_kept, prune

RECORD = {"kind": "checkpoint", "iterations_done": 7, "keep_checkpoints": 2, "keep_checkpoints_every": 5, "newer": "/runs/checkpoint/0009-x"}


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "checkpoint" / "0007-abcd"
    (folder / "model" / "shard").mkdir(parents=True)
    (folder / "model" / "shard" / "0.distcp").write_bytes(b"w" * 100)
    (folder / "optimizer.safetensors").write_bytes(b"o" * 100)
    (folder / "trainer_state.json").write_text('{"step": 7}')
    return folder


def test_pruning_leaves_the_tombstone_alone_at_any_depth_and_twice_deletes_nothing_more(checkpoint):
    fs = fsspec.filesystem("file")
    assert prune(fs, str(checkpoint), RECORD) == 3  # the model folder, the optimizer state, the trainer state
    assert [p.name for p in checkpoint.iterdir()] == [TOMBSTONE]
    assert prune(fs, str(checkpoint), RECORD) == 0
    assert check_kept(fs, str(checkpoint.parent)) == str(checkpoint.parent)  # a folder without a tombstone is kept
    with pytest.raises(
        Pruned,
        match=rf"^checkpoint {checkpoint}: pruned after 7 iterations by cluster.keep_checkpoints=2, keep_checkpoints_every=5 \(the run keeps the newest 2 and those after a multiple of 5 iterations\)",
    ):
        check_kept(fs, str(checkpoint))


@pytest.mark.parametrize("tombstone", [b"", b"not json", b"[1, 2]"])
def test_a_tombstone_that_says_nothing_readable_still_stops_a_reader(checkpoint, tombstone):
    (checkpoint / TOMBSTONE).write_bytes(tombstone)
    with pytest.raises(Pruned, match=rf"^folder {checkpoint}: pruned"):
        check_kept(fsspec.filesystem("file"), str(checkpoint))
