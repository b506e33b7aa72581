import os

# huggingface_hub reads these once, when it is first imported (by transformers, from a task's module): set before any
# task module is imported. The project builds its own models and never reaches a hub; per-load progress bars
# (transformers' reads and writes of weights) drown the per-iteration lines.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import tasks.literal_types  # noqa: E402, F401 (before any task is declared: each dataclass's literal type built once)
