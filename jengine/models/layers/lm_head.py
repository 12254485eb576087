"""LM head: [hidden, vocab_size] through the GEMM leaf, logits widened to f32.

Tied to the embedding, it is the embedding's first vocab_size rows (the spec's reduced head when
the output vocabulary is the smaller one); the family's name map points it at that tensor.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jengine.models.layers.param import ParamSpec


class LMHead(nnx.Module):
    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, ParamSpec]:
        rows = cfg.vocab_size if cfg.tie_word_embeddings else None
        return {"weight": ParamSpec((cfg.hidden_size, cfg.vocab_size), dtype, ("embed", "vocab"),
                                    transpose=True, rows=rows)}

    def __init__(self, specs: dict, source):
        self.weight = nnx.Param(source.place(specs["weight"]))
        # Under TP the runner may pad the weight with zero columns (whole logprob blocks per rank);
        # the gathered logits are cut back to the vocabulary.
        self.vocab_size = specs["weight"].shape[1]

    def __call__(self, kern, hidden, *, out_dtype, tp=None):
        """[n, H] -> [n, V] in the model dtype, widened to f32 (an exact conversion).

        tp (inside shard_map): vocab-parallel; each rank's columns are gathered in vocabulary
        order, so every rank returns all V logits (a sampler sees the unsharded row)."""
        logits = kern.gemm(hidden, self.weight[...], None, out_dtype=out_dtype).astype(jnp.float32)
        return logits if tp is None else tp.gather_vocab(logits)[:, : self.vocab_size]
