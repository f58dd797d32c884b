"""Token-id prompts for the plan: random ids, distinct per request so prefix caching cannot
shrink a prefill (a cached prefix would not be scheduled, and the forward would miss the band)."""

from __future__ import annotations

import random

VOCAB_LO = 10  # keep clear of special ids


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    hi = max(VOCAB_LO + 1, vocab - 1)
    return [rng.randrange(VOCAB_LO, hi) for _ in range(n)]
