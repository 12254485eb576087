"""The Sampler: token choice and logprobs for the rows the model runner hands back.

It plans its leaves once, at construction, from the resolved launch (required features and
hardware), so under rl-bitwise a missing batch-invariant leaf fails at startup instead of falling
back. Execution calls the saved plans inside jitted functions over padded row buckets: S is padded up
to a power of two so only a few shapes compile. Padding rows are zeros with greedy parameters; every
leaf is row-local, so they never change a real row's bits (tested in tests/test_sampling_logprobs.py).

Streams: the only random stream is per-request, keyed by (request seed, absolute position). A launch
whose `sampling_stream` says "batch" gets it too; it is strictly stronger and needs no step key.
"""

from __future__ import annotations

import logging
import jax
import jax.numpy as jnp
import numpy as np

from jengine.engine.batch import SamplingRows
from jengine.launch import SamplerOptions
from pallas_kernels import sampling as _sampling  # noqa: F401  (registers the sampling leaves)
from pallas_kernels.logprobs import gather_token_logprobs, logprob_block_width, top_logprobs
from pallas_kernels.fixed_order import next_pow2
from pallas_kernels.registry import plan

logger = logging.getLogger(__name__)


def row_bucket(rows: int) -> int:
    """Smallest power of two >= rows (>= 1): the padded row count a call compiles for."""
    return next_pow2(int(rows))


class Sampler:
    """`Sampler(options, vocab_size)`; see docs of `sample`, `token_logprobs`, `top_logprobs`.

    `options` is the launch plan's `SamplerOptions` (jengine/launch.py): the logprob order, the
    hardware and the kernel features every leaf must declare.
    """

    def __init__(self, options: SamplerOptions, vocab_size: int) -> None:
        if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} must be a positive integer")
        order = options.logprob_order
        self.vocab_size = int(vocab_size)
        self.logprob_order = order
        self.block_width = logprob_block_width(order, self.vocab_size)  # ValueError names both
        self.required_features = frozenset(options.required_features)
        self.hardware = options.hardware
        common = dict(formats={"f32"}, hardware=self.hardware, features=self.required_features)
        self.block_sumexp_plan = plan("sampling", "block_sumexp",
                                      geometry={"vocab_size": self.vocab_size,
                                                "block_size": self.block_width}, **common)
        self.argmax_plan = plan("sampling", "argmax", **common)
        self.gumbel_plan = plan("sampling", "gumbel", **common)
        for p in (self.block_sumexp_plan, self.argmax_plan, self.gumbel_plan):
            logger.info("sampler plan: %s", p.describe())

        block_plan = self.block_sumexp_plan
        self._token_logprobs = jax.jit(
            lambda logits, ids: gather_token_logprobs(logits, ids, order, block_plan))
        self._top_logprobs = jax.jit(
            lambda logits, k: top_logprobs(logits, k, order, block_plan), static_argnums=1)
        argmax_plan, gumbel_plan = self.argmax_plan, self.gumbel_plan
        self._argmax = jax.jit(lambda logits: argmax_plan(logits))

        def gumbel(logits, *rows, use_top_k: bool, use_top_p: bool):
            return gumbel_plan(logits, *rows, use_top_k=use_top_k, use_top_p=use_top_p)

        self._gumbel = jax.jit(gumbel, static_argnames=("use_top_k", "use_top_p"))
        # Padding rows' draws zeroed, as the host pads ids: token_logprobs then sees equal inputs.
        self._zero_padding = jax.jit(
            lambda tokens, n: jnp.where(jnp.arange(tokens.shape[0]) < n, tokens, 0).astype(jnp.int32))

    # -- helpers ----------------------------------------------------------------------------------
    def _check_logits(self, logits, rows: int | None = None) -> int:
        """The row count S. Logits may carry padding rows past S (ModelRunner.logits_at's
        bucket); they are ignored."""
        if logits.ndim != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits shape {tuple(logits.shape)} is not [rows, vocab_size="
                             f"{self.vocab_size}]")
        if rows is None:
            return int(logits.shape[0])
        if rows > logits.shape[0]:
            raise ValueError(f"{rows} rows asked of logits with {logits.shape[0]} rows")
        return int(rows)

    @staticmethod
    def _pad_rows(logits, bucket: int):
        rows = logits.shape[0]
        logits = jnp.asarray(logits)
        if logits.dtype != jnp.float32:
            logits = logits.astype(jnp.float32)  # bf16 -> f32 is exact
        if rows == bucket:
            return logits
        if rows > bucket:  # padded logits (both sizes are powers of two: few shapes)
            return logits[:bucket]
        return jnp.pad(logits, ((0, bucket - rows), (0, 0)))

    @staticmethod
    def _pad_host(values, bucket: int, dtype, fill) -> np.ndarray:
        out = np.full(bucket, fill, dtype)
        out[: len(values)] = values
        return out

    # -- the three calls --------------------------------------------------------------------------
    def sample(self, logits, rows: SamplingRows) -> np.ndarray:
        """np.int32[S]: greedy rows take the canonical argmax, others a per-request Gumbel draw.
        S = the rows' count; logits rows past S are padding."""
        s, fields = self._sampling_fields(logits, rows)
        if s == 0:
            return np.zeros(0, np.int32)
        return np.asarray(self._sample_padded(logits, s, fields))[:s].astype(np.int32)

    def sample_on_device(self, logits, rows: SamplingRows):
        """`sample`'s tokens left on the device: int32[row_bucket(S)], rows past S zero (S >= 1).
        The overlap schedule feeds them to the next step without waiting (docs/engine.md)."""
        s, fields = self._sampling_fields(logits, rows)
        if s == 0:
            raise ValueError("sample_on_device: no rows")
        tokens = self._sample_padded(logits, s, fields)
        if tokens.shape[0] == s and tokens.dtype == np.int32:
            return tokens  # a full bucket has no padding rows: one program and one copy fewer
        return self._zero_padding(tokens, np.int32(s))

    def _sampling_fields(self, logits, rows: SamplingRows) -> tuple[int, dict]:
        fields = {name: np.asarray(getattr(rows, name)) for name in
                  ("temperature", "top_k", "top_p", "min_p", "seed", "position")}
        s = self._check_logits(logits, len(fields["temperature"]))
        for name, value in fields.items():
            if value.shape != (s,):
                raise ValueError(f"SamplingRows.{name} has shape {value.shape}, expected ({s},)")
        temperature = fields["temperature"] = fields["temperature"].astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(temperature) | (temperature < 0))
        if bad.size:
            raise ValueError(f"SamplingRows.temperature[{bad[0]}]={temperature[bad[0]]} must be a "
                             "finite number >= 0")
        return s, fields

    def _sample_padded(self, logits, s: int, fields: dict):
        """The draw over the padded bucket (a device array; rows past S are padding)."""
        temperature = fields["temperature"]
        bucket = row_bucket(s)
        padded = self._pad_rows(logits, bucket)
        if not np.any(temperature > 0):
            return self._argmax(padded)
        top_k = fields["top_k"].astype(np.int32)
        top_p = fields["top_p"].astype(np.float32)
        args = (
            self._pad_host(temperature, bucket, np.float32, 0.0),
            self._pad_host(top_k, bucket, np.int32, -1),
            self._pad_host(top_p, bucket, np.float32, 1.0),
            self._pad_host(fields["min_p"].astype(np.float32), bucket, np.float32, 0.0),
            self._pad_host(fields["seed"].astype(np.uint32), bucket, np.uint32, 0),
            self._pad_host(fields["position"].astype(np.int32), bucket, np.int32, 0),
        )
        sampled = temperature > 0  # filters on greedy rows do not matter; skip their sort
        use_top_k = bool(np.any(sampled & (top_k > 0) & (top_k < self.vocab_size)))
        use_top_p = bool(np.any(sampled & (top_p < 1.0)))
        return self._gumbel(padded, *args, use_top_k=use_top_k, use_top_p=use_top_p)

    def token_logprobs(self, logits, token_ids) -> np.ndarray:
        """np.float32[S]: THE logprob function (launch's --logprob-order), prompt and output alike.
        S = len(token_ids); logits rows past S are padding."""
        ids = np.asarray(token_ids)
        s = self._check_logits(logits, len(ids) if ids.ndim == 1 else None)
        if ids.shape != (s,):
            raise ValueError(f"token_ids has shape {ids.shape}, expected ({s},)")
        if s == 0:
            return np.zeros(0, np.float32)
        return np.asarray(self.token_logprobs_on_device(logits, ids))[:s]

    def token_logprobs_on_device(self, logits, ids):
        """`token_logprobs` over the padded bucket, left on the device. ids: host ids int32[S]
        (checked, then zero-padded to row_bucket(S)) or `sample_on_device`'s tokens (already
        padded with zeros), so both give the jitted program the same input."""
        if isinstance(ids, np.ndarray):
            self._check_ids(ids)
            ids = self._pad_host(ids.astype(np.int32), row_bucket(len(ids)), np.int32, 0)
        return self._token_logprobs(self._pad_rows(logits, len(ids)), ids)

    def _check_ids(self, ids: np.ndarray) -> None:
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise ValueError(f"token_ids[{bad[0]}]={int(ids[bad[0]])} is outside the output "
                             f"vocabulary [0, {self.vocab_size})")

    def top_logprobs(self, logits, k: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(np.float32[S, k], np.int32[S, k]): each row's k largest logprobs, lowest id on ties.
        S = rows (default: every logits row)."""
        s = self._check_logits(logits, rows)
        if not isinstance(k, (int, np.integer)) or not 0 <= k <= self.vocab_size:
            raise ValueError(f"top_logprobs_num={k!r} must be an integer in [0, {self.vocab_size}]")
        if s == 0 or k == 0:
            return np.zeros((s, k), np.float32), np.zeros((s, k), np.int32)
        values, ids = self.top_logprobs_on_device(logits, k, s)
        return np.asarray(values)[:s], np.asarray(ids)[:s].astype(np.int32)

    def top_logprobs_on_device(self, logits, k: int, rows: int):
        """`top_logprobs` over the padded bucket of `rows` rows (k >= 1), left on the device."""
        return self._top_logprobs(self._pad_rows(logits, row_bucket(rows)), int(k))

    def describe(self) -> dict[str, str]:
        return {"logprob_order": self.logprob_order, "block_width": str(self.block_width),
                **{p.name: p.leaf.impl for p in (self.block_sumexp_plan, self.argmax_plan,
                                                 self.gumbel_plan)}}
