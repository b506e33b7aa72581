"""A prompt source (plug-point data.source_fn) that notes, each time the rollout task builds it, how many decks the
workflow's process holds: one line per iteration in the file $DECKS_SEEN."""

import os

import flytekit

from miles_core.data.source import PromptSource


def counting_source(prompts, seed, state):
    with open(os.environ["DECKS_SEEN"], "a", encoding="utf-8") as seen:
        seen.write(f"{len(flytekit.current_context().decks)}\n")
    return PromptSource(prompts, seed, state)
