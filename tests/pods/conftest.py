"""The pod tier's object store (moto's S3 server on loopback; each module runs under its own run root) and emulated cluster."""

import pytest

from tests.pods.emulator import Cluster, ObjectStore


@pytest.fixture(scope="session")
def store(tmp_path_factory):  # one per test process: moto keeps its buckets per process, whatever the server
    store = ObjectStore(tmp_path_factory.mktemp("store"))
    yield store
    store.close()


@pytest.fixture(scope="module")
def cluster(store, tmp_path_factory):
    return Cluster(store, tmp_path_factory.mktemp("cluster"), extra_code=("tests/pods/leaky.py",))
