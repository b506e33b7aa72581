"""tasks/decks.py: the decks of a batch, with the texts of the rows shown decoded and no others."""

import flytekit
import pytest
import torch

from miles_core.samples import Sample
from tasks.decks import ROWS, batch_decks


class CountingDecoder:
    def __init__(self):
        self.calls = 0

    def decode(self, tokens, skip_special_tokens=False):
        self.calls += 1
        return " ".join(map(str, tokens))


def batch(size: int) -> list[Sample]:
    return [Sample(f"p{i // 2}", i % 2, [5, 6], [7, 8, 9], [-0.5, -0.25, -1.0], [1, 1, 0], "stop", 0, "1", {}, reward=float(i % 2)) for i in range(size)]


@pytest.fixture
def decks():
    made = flytekit.current_context().decks
    before = len(made)
    yield lambda: {d.name: d.html for d in made[before:]}
    del made[before:]


def test_a_scored_batch_shows_its_first_rows_and_the_histograms_of_all(decks):
    samples, decoder = batch(3 * ROWS), CountingDecoder()
    batch_decks(samples, decoder, {})
    shown = decks()
    assert set(shown) == {"samples", "histograms"}
    assert f"sample responses: {ROWS} of {3 * ROWS}, mean reward 0.5000" in shown["samples"]
    assert shown["samples"].count("<tr>") == ROWS  # one row per sample shown (the header row has a style)
    assert decoder.calls == 2 * ROWS  # each shown row's prompt and response, nothing else
    assert f"reward ({3 * ROWS})" in shown["histograms"] and f"response length (tokens) ({3 * ROWS})" in shown["histograms"]


def test_a_trained_batch_shows_its_advantages_and_the_mismatch_on_trained_tokens(decks):
    samples = batch(4)
    trace = {"advantages": torch.ones(4, 3), "trainer_logprobs": torch.full((4, 3), -0.5)}
    batch_decks(samples, CountingDecoder(), {"mismatch/abs_logprob_diff": 0.125, "loss": 1.0}, trace)
    shown = decks()
    assert "mean advantage" in shown["samples"]
    assert "mismatch/abs_logprob_diff" in shown["mismatch"] and ">loss<" not in shown["mismatch"]
    assert "trainer - rollout log-prob per token (8)" in shown["mismatch"]  # two trained tokens in each of four samples


def test_a_tasks_source_deck_is_highlighted_once_per_process_and_the_same_each_time(monkeypatch, request):
    """flytekit renders the "Source Code" deck on every run of a task; after `source_rendered_once` (installed by
    tasks/common.py) a source is highlighted by pygments once, later runs get the same HTML, another source its own."""
    from flytekit.deck.renderer import SourceCodeRenderer

    import tasks.decks as decks_module

    decks_module.source_rendered_once()
    highlighted = []
    monkeypatch.setattr(decks_module, "_highlight", lambda renderer, source: highlighted.append(source) or f"<pre>{source}</pre>")
    decks_module._highlighted.cache_clear()
    request.addfinalizer(decks_module._highlighted.cache_clear)  # nothing rendered by the stand-in stays for other tests
    first = SourceCodeRenderer().to_html("def f():\n    return 1\n")
    assert SourceCodeRenderer().to_html("def f():\n    return 1\n") == first == "<pre>def f():\n    return 1\n</pre>"
    assert SourceCodeRenderer().to_html("def g():\n    return 2\n") == "<pre>def g():\n    return 2\n</pre>"
    assert highlighted == ["def f():\n    return 1\n", "def g():\n    return 2\n"]


def test_the_mismatch_takes_each_samples_own_trained_tokens_of_a_padded_trace(decks):
    """Responses of different lengths: the trainer's [B, T] log-probs are padded (9 here); only each row's own tokens
    where its loss mask is set count, so the histogram spans exactly the three differences -0.5, -0.25, -0.25."""
    samples = [
        Sample("p0", 0, [5], [7, 8], [-1.0, -2.0], [1, 0], "stop", 0, "1", {}, reward=1.0),
        Sample("p0", 1, [5], [7, 8, 9], [-0.5, -0.25, -0.75], [0, 1, 1], "stop", 0, "1", {}, reward=0.0),
    ]
    trace = {"advantages": torch.zeros(2, 3), "trainer_logprobs": torch.tensor([[-1.5, 9.0, 9.0], [9.0, -0.5, -1.0]])}
    batch_decks(samples, CountingDecoder(), {}, trace)
    mismatch = decks()["mismatch"]
    assert "trainer - rollout log-prob per token (3)" in mismatch
    assert '<text x="40" y="190" font-size="10">-0.5</text>' in mismatch and 'text-anchor="end">-0.25</text>' in mismatch
