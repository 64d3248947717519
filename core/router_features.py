"""What a router classifier scores a turn on, by the router's schema (``RouterModel``'s
``schema_version``); pure, so a logged decision is recomputed from its turn's text.

- Schema 1: the sentence embedding alone.
- Schema 2: the embedding, then the turn's words: its lower-cased words and pairs of adjacent
  words, each hashed (blake2b, stable across processes) into one of ``WORD_BUCKETS`` buckets,
  present or not, the bucket vector L2-normalised. A linear classifier on the embedding alone
  could not keep the seed set's boundaries while it learned the traffic's; with the words it
  keeps both (``docs/serving.md``, Router, "Features").
- Schema 3: schema 2's features, scored after a cascade: a classifier of the words alone
  decides a turn when it is clear, and only the other turns are embedded.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections.abc import Sequence

WORD_BUCKETS = 2048
_WORD = re.compile(r"[a-z0-9']+")


def _bucket(gram: str) -> int:
    digest = hashlib.blake2b(gram.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % WORD_BUCKETS


def word_buckets(text: str) -> tuple[list[int], float]:
    """The words part of schema 2, sparse: the buckets present (sorted) and the value each
    holds (the vector has unit length; no bucket for a text without a word)."""
    words = _WORD.findall(text.lower())
    pairs = [f"{a} {b}" for a, b in itertools.pairwise(words)]
    buckets = sorted({_bucket(gram) for gram in [*words, *pairs]})
    return buckets, 1 / math.sqrt(len(buckets)) if buckets else 0.0


def word_features(text: str) -> list[float]:
    """The words part of schema 2: ``WORD_BUCKETS`` values, unit length (all zero for a text
    without a word)."""
    buckets, scale = word_buckets(text)
    values = [0.0] * WORD_BUCKETS
    for index in buckets:
        values[index] = scale
    return values


def extra_features(schema_version: int) -> int:
    """How many features a schema adds to the embedding (schema 3 scores schema 2's features,
    after its words head: ``core.routing.WordsHead``)."""
    return WORD_BUCKETS if schema_version in (2, 3) else 0


def router_features(schema_version: int, embedding: Sequence[float], text: str) -> list[float]:
    """The features a router of ``schema_version`` scores ``text`` (embedded as ``embedding``)
    on."""
    if schema_version in (2, 3):
        return [*embedding, *word_features(text)]
    return list(embedding)
