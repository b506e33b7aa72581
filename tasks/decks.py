"""The decks of the score and train tasks: what the Flyte console shows of a batch.

A batch as flytekit decks: "samples", a table of the first `ROWS` responses with their prompts and rewards (only those
rows decoded: decoding the whole batch's texts cost ~15 ms of the score and the train task of every iteration for 16
rows shown); "histograms", the batch's rewards and response lengths (inline SVG); and on the train task "mismatch", the
train/rollout log-prob mismatch of the step (its `mismatch/*` metrics and the per-token difference of the trainer's and
the rollout's log-probs on the trained tokens, taken from the whole padded batch at once, not sample by sample).
"""

from __future__ import annotations

import functools
import html
import itertools
from typing import TYPE_CHECKING

import flytekit
import numpy as np
from flytekit import Deck
from flytekit.deck import DeckField
from flytekit.deck.renderer import SourceCodeRenderer

from miles_core.dump import per_token
from miles_core.samples import Sample

if TYPE_CHECKING:
    import torch

# @task arguments of a task with decks: flytekit's own (source, inputs, outputs) beside the task's, but not
# "Dependencies", which runs `pip list` and `pip freeze` each time the task runs (about 1 s of every iteration on the
# score and train tasks; the image's packages are the pinned requirements.lock), nor "Timeline": flytekit 1.16 keeps one
# timeline per process, so in a local run each task's deck listed the phases of every task run before it (180 rows by
# the 13th iteration, each deck written anew: a cost growing with the run); the console shows each node's times
DECKS = {"enable_deck": True, "deck_fields": (DeckField.SOURCE_CODE, DeckField.INPUT, DeckField.OUTPUT)}
ROWS = 16  # responses in the sample table
BINS = 20  # bars of a histogram
TABLE = ["sample_id", "weight_version", "prompt", "response", "reward", "response_length", "finish_reason"]  # + "mean advantage"


def batch_decks(samples: list[Sample], tokenizer, metrics: dict[str, float], trace: dict | None = None) -> None:
    """The decks of one batch; "mismatch" only where a train step traced the trainer's log-probs (`trace`, from
    `step.optimize`)."""
    rewards, lengths = [s.reward for s in samples], [len(s.response_tokens) for s in samples]
    Deck("samples", _samples(samples[:ROWS], tokenizer, trace, len(samples), float(np.mean(rewards))))
    Deck("histograms", _figure([("reward", rewards), ("response length (tokens)", lengths)]))
    if trace and "trainer_logprobs" in trace:
        Deck("mismatch", _mismatch(samples, lengths, trace["trainer_logprobs"], metrics))


def _samples(shown: list[Sample], tokenizer, trace: dict | None, rows: int, mean_reward: float) -> str:
    """The table of the rows shown, their texts decoded; with the step's advantages (`trace`) each row's mean."""
    advantages = per_token(trace, "advantages", [len(s.response_tokens) for s in shown])  # None per row untraced
    traced = any(a is not None for a in advantages)
    table = [
        [
            s.sample_id,
            s.weight_version,
            tokenizer.decode(s.prompt_tokens),
            tokenizer.decode(s.response_tokens, skip_special_tokens=True),
            s.reward,
            len(s.response_tokens),
            s.finish_reason,
            *([float(np.mean(a)) if len(a) else 0.0] if traced else []),
        ]
        for s, a in zip(shown, advantages)
    ]
    caption = f"<p>sample responses: {len(table)} of {rows}, mean reward {mean_reward:.4f}</p>"
    cells = [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for row in table]
    return caption + _table(TABLE + ["mean advantage"] * traced, cells)


def _table(columns: list[str], rows: list[list[str]]) -> str:
    """An HTML table of text cells, escaped: what `DataFrame.to_html` makes of the same, without its ~5 ms a deck."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table border="1"><thead><tr style="text-align: right;">{head}</tr></thead><tbody>{body}</tbody></table>'


def _mismatch(samples: list[Sample], response_lengths: list[int], trainer_logprobs: torch.Tensor, metrics: dict[str, float]) -> str:
    """The step's mismatch metrics and the histogram of trainer - rollout log-prob on the tokens trained on;
    trainer_logprobs: [B, T], each row's response tokens first."""
    lengths = np.asarray(response_lengths)
    trainer = trainer_logprobs.detach().float().cpu().numpy()  # [B, T]
    own = np.arange(trainer.shape[1]) < lengths[:, None]  # [B, T] each row's own tokens, in the order they are joined
    rollout = np.fromiter(itertools.chain.from_iterable(s.rollout_logprobs for s in samples), dtype=np.float64, count=lengths.sum())
    trained = np.fromiter(itertools.chain.from_iterable(s.loss_mask for s in samples), dtype=np.float64, count=lengths.sum()) > 0
    rows = [[k, f"{v:.6g}"] for k, v in sorted(metrics.items()) if k.startswith("mismatch/")]
    table = "<p>train/rollout mismatch</p>" + _table(["metric", "value"], rows)
    return table + _figure([("trainer - rollout log-prob per token", (trainer[own] - rollout)[trained])])


def _figure(panels: list[tuple[str, object]]) -> str:
    """Histograms side by side, as inline SVG: bars of `BINS` equal bins between the values' least and greatest, each
    bar's count in its tooltip. Drawn from numpy's bin counts in about a millisecond, where a matplotlib PNG of the
    same took 0.1-0.2 s of the score and the train task of every iteration."""
    titles = ", ".join(html.escape(title) for title, _ in panels)
    return f"<p>histograms: {titles}</p><div>{''.join(_histogram(title, np.asarray(values, dtype=float)) for title, values in panels)}</div>"


def _histogram(title: str, values: np.ndarray) -> str:
    """One histogram of the finite values, titled with their count."""
    values = values[np.isfinite(values)]
    counts, edges = np.histogram(values, bins=BINS) if len(values) else (np.zeros(BINS, dtype=int), np.linspace(0.0, 1.0, BINS + 1))
    width, height, left, bottom = 360, 200, 40, 30  # pixels: the plot and its margins for the axis labels
    scale, bar = (height - bottom - 20) / max(int(counts.max()), 1), (width - left - 10) / BINS
    bars = "".join(
        f'<rect x="{left + i * bar:.1f}" y="{height - bottom - n * scale:.1f}" width="{bar - 1:.1f}" height="{n * scale:.1f}" fill="#4c72b0">'
        f"<title>[{low:.4g}, {high:.4g}): {n}</title></rect>"
        for i, (n, low, high) in enumerate(zip(counts, edges[:-1], edges[1:]))
    )
    axis = (
        f'<text x="{left}" y="{height - 10}" font-size="10">{edges[0]:.4g}</text>'
        f'<text x="{width - 10}" y="{height - 10}" font-size="10" text-anchor="end">{edges[-1]:.4g}</text>'
        f'<text x="{left - 4}" y="24" font-size="10" text-anchor="end">{int(counts.max())}</text>'
        f'<text x="{width / 2}" y="12" font-size="11" text-anchor="middle">{html.escape(title)} ({len(values)})</text>'
    )
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">{axis}{bars}</svg>'


_highlight = SourceCodeRenderer.to_html


@functools.lru_cache(maxsize=64)
def _highlighted(source_code: str) -> str:
    return _highlight(SourceCodeRenderer(), source_code)


def source_rendered_once() -> None:
    """flytekit (1.16) highlights a task's source with pygments for its "Source Code" deck each time the task runs (~6 ms
    a task on this repository's CPU, three tasks an iteration); a task's source is the same every time, so a process
    renders each source once and hands out the same HTML after."""
    SourceCodeRenderer.to_html = lambda self, source_code: _highlighted(source_code)


def own_decks_only() -> None:
    """For a forked Elastic worker: forget the decks inherited from the process that forked it.

    A forked worker starts with a copy of its parent's deck list, and flytekit's Elastic plugin (1.16) appends every deck
    rank 0 returns to the parent's list: inherited decks would come back to the parent again, doubling the list with
    every Elastic task of a local run (convert, train, publish). Every worker clears its copy first, so it returns only
    the decks it makes; on a cluster the pod's list starts empty and this changes nothing.
    """
    flytekit.current_context().decks.clear()
