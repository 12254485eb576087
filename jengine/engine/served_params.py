"""The parameter tuple the runner's step programs take, across swaps and memory releases.

The jitted programs take the parameters as one flat tuple (`ModelRunner` says why). A weight update
or an EPLB rebalance swaps in a new tuple of the same shapes, so no program recompiles; an RL
framework's release_memory_occupation moves the bytes to the host and frees the device buffers,
and a resume puts the same bytes back on the same placement (the KV pool's counterpart is
`KVPool.release` / `resume`).
"""

from __future__ import annotations

import jax
import numpy as np


class ServedParams:
    def __init__(self, params: tuple):
        self.arrays: tuple | None = params  # None while released
        self._host: tuple | None = None  # the released bytes
        self._placements: tuple = ()

    @property
    def released(self) -> bool:
        return self.arrays is None

    def live(self) -> tuple:
        """The device tuple, or RuntimeError while released."""
        if self.arrays is None:
            raise RuntimeError("the weights are released; resume them first")
        return self.arrays

    def swap(self, params: tuple) -> None:
        """Serve `params` from the next step on (a swap also ends a release). Same shapes and
        dtypes as the current tuple, so the compiled step programs are reused (a difference here
        would be a runner bug)."""
        old = self._host if self.arrays is None else self.arrays
        for i, (new, cur) in enumerate(zip(params, old, strict=True)):
            if new.shape != cur.shape or new.dtype != cur.dtype:
                raise ValueError(f"parameter {i}: {new.shape} {new.dtype} would replace "
                                 f"{cur.shape} {cur.dtype}")
        self.arrays, self._host = tuple(params), None

    def release(self) -> None:
        """Copy the parameters to the host, then free their device buffers now."""
        if self.arrays is None:
            return
        # An uncommitted array goes back uncommitted: committed-ness is part of the jit cache key.
        self._placements = tuple(p.sharding if p.committed else None for p in self.arrays)
        self._host = tuple(np.asarray(p) for p in self.arrays)
        for p in self.arrays:
            p.delete()
        self.arrays = None

    def resume(self) -> None:
        """The released bytes back on their placements."""
        if self.arrays is None:
            self.arrays = tuple(jax.device_put(h, s) for h, s in zip(self._host, self._placements))
            self._host = None
