"""The `--logprob-order` table: the vocabulary block width each order folds over, and its form.

The blockwise orders fold fixed BLOCKWISE_VOCAB_BLOCK-wide blocks -- the trainer's vocabulary-shard
width (spec, "alignment.trainer") -- and the `-16384` orders the narrower shards of a trainer that
splits its vocabulary finer. The negated form is the trainer's negative cross-entropy (-0.0 for a
certain token), the direct form subtracts log(sum_exp) from the target (+0.0).

One table, imported by the launch options (jengine/config.py), the logprob leaves
(pallas_kernels/logprobs.py) and the trainer's twin (interop/trainer_logprobs.py). It imports
nothing, so the launch options can be parsed before JAX is loaded.
"""

BLOCKWISE_VOCAB_BLOCK = 32768
NARROW_VOCAB_BLOCK = 16384
LOGPROB_BLOCK_WIDTHS = (BLOCKWISE_VOCAB_BLOCK, NARROW_VOCAB_BLOCK)

# order -> (block width, or None for the whole row; negated form?)
LOGPROB_ORDERS: dict[str, tuple[int | None, bool]] = {
    "torch": (None, False),
    "blockwise": (BLOCKWISE_VOCAB_BLOCK, True),
    "blockwise-direct": (BLOCKWISE_VOCAB_BLOCK, False),
    "blockwise-16384": (NARROW_VOCAB_BLOCK, True),
    "blockwise-direct-16384": (NARROW_VOCAB_BLOCK, False),
}
