"""What crosses from the scheduler to the runner: the step's KV page transfers and a flat ragged
batch of token rows.

The model never sees requests, only rows. Every value computed for a row depends on that row's
token, position and its request's KV pages, never on which other rows share the step: that is the
property rl-bitwise's batch invariance is built on.

Padding rows and padded block-table entries point at the KV pool's null page (`NULL_PAGE`,
defined with the KV cache spec in jengine/models/kv_cache.py, re-exported here for the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    from jengine.engine.request import RetractionImage


def placeholder(index: int) -> int:
    """The input id of a row whose token the step in flight is still sampling: its `index`-th
    sampled token (the overlap schedule, docs/engine.md). Token ids are >= 0, so a negative id is
    never a real token; the runner swaps it for that token on the device (`fill_placeholders`)."""
    return -1 - index


def fill_placeholders(input_ids, previous_tokens):
    """input_ids with every placeholder replaced by the previous step's sampled token; works on
    host (numpy) and traced (jax.numpy) arrays alike, so a test's fake runner shares the rule."""
    xp = np
    if not (isinstance(input_ids, np.ndarray) and isinstance(previous_tokens, np.ndarray)):
        import jax.numpy as xp  # only here: the scheduler imports this module, and no device
    index = xp.clip(-1 - input_ids, 0, previous_tokens.shape[0] - 1)
    return xp.where(input_ids < 0, previous_tokens[index], input_ids).astype(np.int32)


@dataclass
class StepBatch:
    """Host-side arrays for one forward; the runner pads them to its shape buckets.

    T = tokens in this step, R = requests in this step, P = max pages per request, S = rows whose
    hidden states are returned (sampling rows and prompt-logprob rows).
    """

    # int32[T]: prefill chunks and decode tokens, grouped by request; a negative id is a
    # `placeholder` for a token the step in flight is sampling
    input_ids: np.ndarray
    positions: np.ndarray  # int32[T]: absolute position of each token in its request
    token_req: np.ndarray  # int32[T]: row of block_tables the token belongs to
    block_tables: np.ndarray  # int32[R, P]: page ids of each request, in position order
    hidden_rows: np.ndarray  # int32[S]: indices into T whose final hidden states are wanted

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, np.int32)
        self.positions = np.asarray(self.positions, np.int32)
        self.token_req = np.asarray(self.token_req, np.int32)
        self.block_tables = np.asarray(self.block_tables, np.int32).reshape(len(self.block_tables), -1)
        self.hidden_rows = np.asarray(self.hidden_rows, np.int32)
        t = len(self.input_ids)
        if not (len(self.positions) == len(self.token_req) == t):
            raise ValueError("input_ids, positions and token_req must have one entry per token")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class SamplingRows:
    """Per-row sampling parameters for the rows handed to the sampler (S rows)."""

    temperature: np.ndarray  # f32[S]; 0 = greedy
    top_k: np.ndarray  # int32[S]; -1 or >= vocab = off
    top_p: np.ndarray  # f32[S]; 1 = off
    min_p: np.ndarray  # f32[S]; 0 = off
    seed: np.ndarray  # uint32[S]: explicit seed, else crc32(rid)
    position: np.ndarray  # int32[S]: absolute position of the token being sampled


# -- KV page transfers ------------------------------------------------------------------------------
# The scheduler decides page moves but owns no device: it emits them as commands, and the runner
# executes a step's commands in the order they were emitted, before the step's forward. Order
# matters: a page a retraction frees may be handed to another request within the same schedule(),
# and that request's restore or copy-on-write must land after the save has read the old bytes.


@dataclass(frozen=True)
class PageCopy:
    """Prefix-cache copy-on-write: copy the bytes of pages `src` into pages `dst`."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True)
class PageSave:
    """Retraction: copy pages out to host bytes, stored as `image.kv` (an exact byte copy)."""

    pages: tuple[int, ...]
    image: "RetractionImage"


@dataclass(frozen=True)
class PageRestore:
    """Resume: write `image.kv` (filled by an earlier PageSave) into freshly allocated pages."""

    pages: tuple[int, ...]
    image: "RetractionImage"


KVTransfer = Union[PageCopy, PageSave, PageRestore]
