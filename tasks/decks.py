"""The decks of the score and train tasks: what the Flyte console shows of a batch.

Each renders a readable frame (`miles_core.dump.readable_frame`) as flytekit decks: "samples", a table of the first
`ROWS` responses with their prompts and rewards; "histograms", the batch's rewards and response lengths; and on the
train task "mismatch", the train/rollout log-prob mismatch of the step (its `mismatch/*` metrics and the per-token
difference of the trainer's and the rollout's log-probs on the trained tokens). Plots are PNGs inside the HTML.
"""

from __future__ import annotations

import base64
import html
import io
import os

import flytekit
import numpy as np
import pandas as pd
from flytekit import Deck
from flytekit.deck import DeckField

# @task arguments of a task with decks: flytekit's own (source, timeline, inputs, outputs) beside the task's, but not
# "Dependencies", which runs `pip list` and `pip freeze` each time the task runs (about 1 s of every iteration on the
# score and train tasks); the image's packages are the pinned requirements.lock
DECKS = {"enable_deck": True, "deck_fields": (DeckField.SOURCE_CODE, DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT)}
ROWS = 16  # responses in the sample table
TABLE = ["sample_id", "weight_version", "prompt", "response", "reward", "response_length", "finish_reason"]


def batch_decks(frame: pd.DataFrame, metrics: dict[str, float]) -> None:
    """The decks of one batch; "mismatch" only where a train step traced the trainer's log-probs."""
    Deck("samples", _samples(frame))
    Deck("histograms", _figure([("reward", frame["reward"]), ("response length (tokens)", frame["response_length"])]))
    if frame["trainer_logprobs"].notna().any():
        Deck("mismatch", _mismatch(frame, metrics))


def _samples(frame: pd.DataFrame) -> str:
    shown = frame[TABLE].head(ROWS).copy()
    if frame["advantages"].notna().any():
        shown["mean advantage"] = [float(np.mean(a)) if len(a) else 0.0 for a in frame["advantages"].head(ROWS)]
    caption = f"<p>sample responses: {len(shown)} of {len(frame)}, mean reward {frame['reward'].mean():.4f}</p>"
    return caption + shown.to_html(index=False, escape=True, float_format="{:.4f}".format)


def _mismatch(frame: pd.DataFrame, metrics: dict[str, float]) -> str:
    """The step's mismatch metrics and the histogram of trainer - rollout log-prob on the tokens trained on."""
    diffs = [
        np.asarray(trainer)[np.asarray(mask) > 0] - np.asarray(rollout)[np.asarray(mask) > 0]
        for trainer, rollout, mask in zip(frame["trainer_logprobs"], frame["rollout_logprobs"], frame["loss_mask"])
    ]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in sorted(metrics.items()) if k.startswith("mismatch/"))
    table = f"<p>train/rollout mismatch</p><table><tr><th>metric</th><th>value</th></tr>{rows}</table>"
    return table + _figure([("trainer - rollout log-prob per token", np.concatenate(diffs) if diffs else np.zeros(0))])


def _figure(panels: list[tuple[str, object]]) -> str:
    """Histograms side by side, as an <img> with the PNG inline."""
    import matplotlib  # heavy import, only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # fixed margins (inches) that fit the titles and tick labels: tight_layout would measure every label first, a third of
    # the figure's time (drawn on the score and the train task of every iteration)
    width = 4.5 * len(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.2), squeeze=False)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.1 / width, bottom=0.4 / 3.2, top=1 - 0.3 / 3.2, wspace=0.3)
    for ax, (title, values) in zip(axes[0], panels):
        ax.hist(np.asarray(values, dtype=float), bins=20)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("count")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    titles = ", ".join(html.escape(title) for title, _ in panels)
    return f'<p>histograms: {titles}</p><img alt="{titles}" src="data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}">'


def own_decks_only() -> None:
    """In a forked Elastic worker, forget the decks inherited from the process that forked it.

    A forked worker starts with a copy of its parent's deck list, and flytekit's Elastic plugin (1.16) appends every deck
    rank 0 returns to the parent's list: inherited decks would come back to the parent again, doubling the list with
    every Elastic task of a local run (convert, train, publish). Every worker clears its copy first, so it returns only
    the decks it makes; on a cluster the pod's list starts empty and this changes nothing.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torch's elastic agent in its workers
        flytekit.current_context().decks.clear()
