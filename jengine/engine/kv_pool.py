"""The KV pool on the device: the arrays a model's KVCacheSpec declares, and the byte-exact page
operations the prefix cache (copy-on-write) and retraction (save to host, restore) need.

Nothing here knows K from V: every operation maps over the spec's pytree (per layer, one array
per component), so a latent-page model (jengine/models/kv_cache.py: LatentPages) gets the same
operations. The runner's jitted step takes `arrays` donated and hands back the updated ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models.kv_cache import KVCacheSpec


class KVPool:
    def __init__(self, spec: KVCacheSpec, *, num_pages: int, page_size: int, dtype,
                 sharding=None):
        """sharding: every pool array's placement (tensor parallelism: split on kv_heads; a
        data-parallel replica: its device); None = the default device."""
        self.spec, self.num_pages, self.page_size, self.dtype = spec, num_pages, page_size, dtype
        self.sharding = sharding
        self.arrays = self.allocate(num_pages)
        self._copy = jax.jit(_copy, donate_argnums=(0,))
        self._write = jax.jit(_write, donate_argnums=(0,))

    # -- memory release (an RL loop hands the accelerator to its trainer between rollouts) ----------
    @property
    def released(self) -> bool:
        return self.arrays is None

    def release(self) -> None:
        """Free the pool's device buffers now (not when the garbage collector gets to them)."""
        if self.arrays is not None:
            for array in jax.tree.leaves(self.arrays):
                array.delete()
            self.arrays = None

    def resume(self) -> None:
        """A fresh zeroed pool, the same shapes and placement: the step programs are reused."""
        if self.arrays is None:
            self.arrays = self.allocate(self.num_pages)

    def allocate(self, num_pages: int):
        """Zeroed arrays of `num_pages` pages in this pool's layout and placement."""
        return self.spec.allocate(num_pages, self.page_size, self.dtype, device=self.sharding)

    def copy(self, src: list[int], dst: list[int]) -> None:
        if len(src):
            self.arrays = self._copy(self.arrays, np.asarray(src, np.int32),
                                     np.asarray(dst, np.int32))

    def read(self, pages: list[int]) -> np.ndarray:
        """The exact bytes of those pages as one host array (KVCacheSpec.page_image_shape):
        [components, layers, n, page_size, *page_shape]; for K/V pages K then V."""
        idx = jnp.asarray(pages, jnp.int32)
        return np.stack([np.stack([np.asarray(layer[j][idx]) for layer in self.arrays])
                         for j in range(len(self.spec.layout.components))])

    def write(self, pages: list[int], image: np.ndarray) -> None:
        """Put an image `read` returned back, byte for byte, into `pages`."""
        if len(pages):
            expected = self.spec.page_image_shape(len(pages), self.page_size)
            if tuple(image.shape) != expected:
                raise ValueError(f"KV page image has shape {tuple(image.shape)}, expected "
                                 f"{expected} for {len(pages)} page(s)")
            self.arrays = self._write(self.arrays, np.asarray(pages, np.int32), jnp.asarray(image))


def _copy(arrays, src, dst):
    return jax.tree.map(lambda pages: pages.at[dst].set(pages[src]), arrays)


def _write(arrays, pages, image):
    return tuple(tuple(c.at[pages].set(image[j, i]) for j, c in enumerate(layer))
                 for i, layer in enumerate(arrays))
