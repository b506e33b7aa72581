"""Real servers on 127.0.0.1 that several test tiers start: a free port, an `mlflow server` until the block ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from miles_core.net import free_port


@contextlib.contextmanager
def mlflow_server(backend_store: str, *artifact_args: str):
    """`mlflow server` on a free loopback port with the backend store (a sqlite URI) and artifact options given; yields its
    base URL once /health answers, stops it after the block."""
    port = free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    command = [str(mlflow), "server", "--backend-store-uri", backend_store, *artifact_args, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runners (seven huey processes): nothing here submits jobs
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server not healthy within 120 s"
            time.sleep(0.5)  # polling the server's start, not synchronising a test's steps
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
