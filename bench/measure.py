"""What every benchmark shares: peak resident memory, in the one JSON object it prints, and a timer's wait for a device."""

import json
import resource


def peak_rss_mib() -> dict[str, float]:
    """Peak resident set size in MiB of this process and of its largest finished child (subprocesses a benchmark
    started and waited for: workflow runs, servers, workers); Linux reports ru_maxrss in KiB."""
    return {
        "self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "children": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    }


def emit(result: dict, indent: int | None = None) -> None:
    """Print the benchmark's one JSON object, with its peak resident memory added as "peak_rss_mib"."""
    print(json.dumps({**result, "peak_rss_mib": peak_rss_mib()}, indent=indent))


def synchronize(device) -> None:
    """Wait for the work queued on `device` (a torch device or its name) before reading a clock: CUDA runs
    asynchronously, the CPU needs no wait. torch is imported here: benchmarks that drive only workflows skip it."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
