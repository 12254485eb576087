"""Meshes (mesh.py), the sharding-rules table (rules.py) and the collectives with their route
(collectives.py), the tensor-parallel call sites a model's forward uses (tensor_parallel.py), and the
vocab-parallel head's argmax and logprobs (vocab_parallel.py).
See docs/parallelism.md for the layouts and what each launch promises."""
