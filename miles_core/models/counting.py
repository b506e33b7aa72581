"""A noisy counting language, and a tiny policy trained on it: peaked but not deterministic, as a policy is after RL.

Each token is the previous word + 1, 2 or 3 (probabilities 0.7, 0.15, 0.15) over the words 3..vocab-1, or a stop id
(probability 0.05).  A random tiny model samples near noise, which no draft head can predict; a model trained on this
language has a next-token distribution a draft head can learn, so speculative decoding's tests and bench
(tests/unit/test_speculative.py, bench/speculative.py) see realistic acceptance.
"""

from __future__ import annotations

import torch

FIRST_WORD = 3  # ids below are special: pad, stop ids
STEP_PROBS = (0.7, 0.15, 0.15)  # of a step of 1, 2, 3 words
STOP_PROB = 0.05


def counting_text(batch: int, length: int, vocab: int, stop_id: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, length] token ids of the language."""
    words = vocab - FIRST_WORD
    steps = torch.multinomial(torch.tensor(STEP_PROBS), batch * length, replacement=True, generator=generator).view(batch, length) + 1
    start = torch.randint(0, words, (batch, 1), generator=generator)
    text = FIRST_WORD + (start + steps.cumsum(dim=1)) % words
    return text.masked_fill(torch.rand((batch, length), generator=generator) < STOP_PROB, stop_id)


def train_counting(model: torch.nn.Module, steps: int, stop_id: int, seed: int = 0, lr: float = 1e-2) -> torch.nn.Module:
    """`model` (a causal LM) trained in place for `steps` AdamW steps on batches of 32 x 16 tokens of the language."""
    optimizer, generator = torch.optim.AdamW(model.parameters(), lr=lr), torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    for _ in range(steps):
        text = counting_text(32, 16, vocab, stop_id, generator)
        model(input_ids=text, labels=text).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()
