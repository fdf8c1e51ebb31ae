"""Deterministic char-level text for the demo: streams of integer arithmetic.

Record ``i`` is a function of ``(seed, i)`` only: equations such as
``37+5=42;903-18=885;12*7=84;`` packed into ``seq_len + 1`` characters. The
records go through ``grain``: a ``MapDataset`` shuffled by a seeded index
permutation, then ``grain.experimental.ElasticIterator``, which batches and whose
whole state is ``{"global_next_index": N}``. Saving that dict with the model
state and calling ``set_state`` after a restore replays exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import grain.experimental
import grain.sharding
import numpy as np

VOCAB = "0123456789+-*=; "
CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB)}
NUM_RECORDS = 1 << 24  # records are computed from their index; the range is only an id space


def encode(text: str) -> np.ndarray:
    return np.array([CHAR_TO_ID[c] for c in text], dtype=np.int32)


def decode(ids: Any) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def equation(rng: np.random.Generator) -> str:
    op = "+-*"[int(rng.integers(3))]
    if op == "*":
        a, b = int(rng.integers(0, 100)), int(rng.integers(0, 10))
    else:
        a, b = int(rng.integers(0, 1000)), int(rng.integers(0, 1000))
    c = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}={c};"


def record_text(index: int, seed: int, length: int) -> str:
    """The text of record ``index``: whole equations, cut to ``length`` characters."""
    rng = np.random.default_rng([seed, index])
    parts: list[str] = []
    n = 0
    while n < length:
        eq = equation(rng)
        parts.append(eq)
        n += len(eq)
    return "".join(parts)[:length]


@dataclasses.dataclass(frozen=True)
class MakeRecord:
    """``index -> int32[seq_len + 1]`` (inputs are ``[:-1]``, targets ``[1:]``)."""

    seq_len: int
    seed: int

    def __call__(self, index: int) -> np.ndarray:
        return encode(record_text(int(index), self.seed, self.seq_len + 1))


def make_iterator(*, seq_len: int, global_batch_size: int, seed: int,
                  shard_index: int = 0, shard_count: int = 1) -> Any:
    """An ``ElasticIterator`` over the shuffled records: ``next`` gives ``int32[B, seq_len+1]``.

    One process feeds the whole global batch here (``shard_count=1``); with one
    process per host, each passes its own ``shard_index``/``shard_count`` and the
    saved ``global_next_index`` stays the same on every host.
    """
    ds = (grain.MapDataset.range(NUM_RECORDS)
          .shuffle(seed=seed)
          .map(MakeRecord(seq_len, seed)))
    return grain.experimental.ElasticIterator(
        ds, global_batch_size,
        grain.sharding.ShardOptions(shard_index=shard_index, shard_count=shard_count),
        # Records are cheap; a small single-thread prefetch keeps the 2 CPU cores
        # of a laptop or CI runner for XLA.
        read_options=grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))
