"""Token embedding: a gather of rows, [input_vocab_size, hidden]."""

from __future__ import annotations

from flax import nnx

from jengine.models.layers.param import ParamSpec


class Embedding(nnx.Module):
    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((cfg.input_vocab_size, cfg.hidden_size), dtype,
                                    ("vocab", "embed"))}

    def __init__(self, specs: dict, source):
        self.weight = nnx.Param(source.place(specs["weight"]))

    def __call__(self, input_ids, tp=None):
        """tp (inside shard_map): the table is vocab-parallel; the lookup moves rows, adds none."""
        if tp is None:
            return self.weight[...][input_ids]
        return tp.embed(self.weight[...], input_ids)
