"""Memory over the iterations of the main job: does a long run hold more than a short one? Prints one JSON object.

Runs the workflow as `make run` does (`pyflyte run workflows/rl.py rl` on the Makefile's recipe and defaults, plus any
key=value overrides) for a short and a long number of iterations, each with a fresh Flyte cache and run root (no cache
hits). Every SAMPLE_S seconds it reads with psutil the resident memory of the run's whole process tree (pyflyte and
every child: forked Elastic workers, servers) and of the pyflyte process alone. A forked worker's pages shared with
its parent count in both, so the tree's figure is an upper bound of the memory the run holds.

Per run: wall time, seconds per iteration, peak RSS of the tree and of pyflyte, and the peaks over windows of the run:
until the first iteration ends (base model, SFT, conversion, first iteration), then up to ten windows of the following
iterations (each from the end of the iteration before it to the end of its last; a run that grows shows rising
windows), then what follows the last iteration (final evaluation, closing the MLflow run). The goal: the long run's
peak within GOAL times the short run's. `--plot PATH` also draws RSS over time of both runs.

    python bench/memory.py [--recipe recipes/tiny_arith_cpu.yaml] [--short 10] [--long 100] [--plot memory.png] [key=value ...]
"""

import argparse
import collections
import contextlib
import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from measure import emit
from runner import REPO, workflow_command

GOAL = 1.10  # the long run's peak over the short run's
SAMPLE_S = 0.2
MAKE_ENV = {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}  # what the Makefile exports
ITERATION_LINE = re.compile(r"iteration (\d+): ")  # tasks/tracking.py log_iteration, as each iteration ends
MIB = 2**20


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(RSS of `proc` and all its descendants, RSS of `proc` alone) in bytes; a process that ends meanwhile counts 0."""
    try:
        own, children = proc.memory_info().rss, proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    total = own
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += child.memory_info().rss
    return total, own


def follow(stream, start: float, ends: dict[int, float], tail: collections.deque) -> None:
    """Read the run's output: when (seconds from `start`) each iteration's line came, and the last lines."""
    for line in stream:
        tail.append(line)
        if found := ITERATION_LINE.match(line):
            ends.setdefault(int(found.group(1)), time.monotonic() - start)


def sampled_run(recipe: str, iterations: int, overrides: list[str]) -> tuple[np.ndarray, dict[int, float], float]:
    """One run sampled every SAMPLE_S: ([[seconds, tree bytes, pyflyte bytes], ...], {iteration: seconds at its end},
    wall seconds)."""
    with tempfile.TemporaryDirectory(prefix="memory-") as work:
        home = Path(work) / "home"
        home.mkdir()
        command = workflow_command(recipe, Path(work) / "runs", *overrides, f"iterations={iterations}")
        env = {**os.environ, **MAKE_ENV, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ends, tail = {}, collections.deque(maxlen=60)
        reader = threading.Thread(target=follow, args=(proc.stdout, start, ends, tail))
        reader.start()
        watched, samples = psutil.Process(proc.pid), []
        while proc.poll() is None:
            samples.append((time.monotonic() - start, *tree_rss(watched)))
            time.sleep(SAMPLE_S)
        wall = time.monotonic() - start
        reader.join()
    if proc.returncode or len(ends) != iterations:
        raise RuntimeError(f"{iterations} iterations: the run failed ({len(ends)} iterations logged)\n{''.join(tail)}")
    return np.array(samples), ends, wall


def peaks(samples: np.ndarray, since: float, until: float) -> dict[str, float]:
    """Peak RSS in MiB of the tree and of pyflyte over the samples in (since, until]."""
    inside = samples[(samples[:, 0] > since) & (samples[:, 0] <= until)]
    return {"tree": round(float(inside[:, 1].max()) / MIB, 1), "pyflyte": round(float(inside[:, 2].max()) / MIB, 1)}


def windows(samples: np.ndarray, ends: dict[int, float], wall: float) -> list[dict]:
    """The peaks until iteration 1 ends, over up to ten windows of the later iterations, and after the last."""
    last = max(ends)
    found = [{"window": "until iteration 1 ends", **peaks(samples, -1.0, ends[1])}]
    for chunk in np.array_split(np.arange(2, last + 1), min(10, last - 1)) if last > 1 else []:
        first, end = int(chunk[0]), int(chunk[-1])
        found.append({"window": f"iterations {first}-{end}", **peaks(samples, ends[first - 1], ends[end])})
    return found + [{"window": "after the last iteration", **peaks(samples, ends[last], wall)}]


def report(samples: np.ndarray, ends: dict[int, float], wall: float) -> dict:
    last = max(ends)
    return {
        "iterations": last,
        "wall_s": round(wall, 1),
        "s_per_iteration": round((ends[last] - ends[1]) / (last - 1), 2) if last > 1 else None,
        "samples": len(samples),
        "peak_rss_mib": peaks(samples, -1.0, wall),
        "peak_rss_mib_by_window": windows(samples, ends, wall),
    }


def plot(runs: dict[int, np.ndarray], path: str) -> None:
    """RSS over time of every run, the tree's and pyflyte's."""
    import matplotlib  # only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for iterations, samples in runs.items():
        line = ax.plot(samples[:, 0], samples[:, 1] / MIB, label=f"{iterations} iterations: process tree")[0]
        ax.plot(samples[:, 0], samples[:, 2] / MIB, color=line.get_color(), linestyle="--", label=f"{iterations} iterations: pyflyte")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("resident memory (MiB)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/tiny_arith_cpu.yaml")  # the Makefile's RECIPE
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=100)
    parser.add_argument("--plot", help="write a PNG of RSS over time of both runs here")
    parser.add_argument("overrides", nargs="*", help="key=value, as `make run ARGS=...`")
    args = parser.parse_args()
    runs = {n: sampled_run(args.recipe, n, args.overrides) for n in (args.short, args.long)}
    short, long = (report(*runs[n]) for n in (args.short, args.long))
    ratio = {k: round(long["peak_rss_mib"][k] / short["peak_rss_mib"][k], 3) for k in ("tree", "pyflyte")}
    if args.plot:
        plot({n: run[0] for n, run in runs.items()}, args.plot)
    emit(
        {
            "benchmark": "memory",
            "recipe": args.recipe,
            "overrides": args.overrides,
            "runs": [short, long],
            "peak_ratio_long_to_short": ratio,
            "goal": GOAL,
            "within_goal": ratio["tree"] <= GOAL,
        },
        indent=1,
    )


if __name__ == "__main__":
    main()
