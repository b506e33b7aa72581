"""A slow reward model on 127.0.0.1, for benchmarks: it scores each request with a local reward function (the
recipe's `reward.fn`, so a run scored through it earns the same rewards as one scored locally) and answers after a
delay drawn uniformly from [low, high] seconds, seeded by the request itself (the same request waits as long in
every run, whatever order the requests arrive in). It speaks what `miles_core.rewards.remote` posts:
{"response", "label", "metadata"} -> {"reward": number}, one thread per request (a model server batching
requests on an accelerator answers many at once).

    python bench/reward_server.py --delay 0.05 0.2 [--seed 0] [--reward-fn miles_core.rewards.math:integer_answer]

prints its URL on the first line of stdout once it listens, then serves until it is stopped. `serving` starts
it as a child process for the length of a `with` block.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from miles_core.plugins import load_function


def delay_of(body: bytes, seed: int, low: float, high: float) -> float:
    """The seconds this request waits: uniform in [low, high], a function of the seed and the request's bytes."""
    digest = hashlib.blake2b(body, digest_size=8, key=str(seed).encode()).digest()
    return low + (high - low) * int.from_bytes(digest, "big") / 2**64


def handler_for(reward_fn, seed: int, low: float, high: float) -> type[BaseHTTPRequestHandler]:
    class Scoring(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = json.loads(body)
            reward = float(reward_fn(request["response"], request["label"], request["metadata"]))
            time.sleep(delay_of(body, seed, low, high))  # the model's latency
            data = json.dumps({"reward": reward}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Scoring


@contextlib.contextmanager
def serving(low: float, high: float, seed: int, reward_fn: str):
    """The server in a child process on a free loopback port; yields its URL, stops it after the block."""
    command = [sys.executable, str(Path(__file__)), "--delay", str(low), str(high), "--seed", str(seed), "--reward-fn", reward_fn]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        if not url:
            raise RuntimeError(f"reward server exited before listening (exit code {proc.wait()})")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, nargs=2, metavar=("LOW", "HIGH"), default=(0.05, 0.2))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward-fn", default="miles_core.rewards.math:integer_answer")
    args = parser.parse_args()
    reward_fn = load_function(args.reward_fn, "--reward-fn", ("response", "label", "metadata"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(reward_fn, args.seed, *args.delay))
    server.daemon_threads = True
    print(f"http://127.0.0.1:{server.server_address[1]}/score", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
