"""The pod tier's object store (moto's S3 server on loopback) and emulated cluster, one per test module."""

import pytest

from tests.pods.emulator import Cluster, ObjectStore


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = ObjectStore(tmp_path_factory.mktemp("store"))
    yield store
    store.close()


@pytest.fixture(scope="module")
def cluster(store, tmp_path_factory):
    return Cluster(store, tmp_path_factory.mktemp("cluster"), extra_code=("tests/pods/leaky.py",))
