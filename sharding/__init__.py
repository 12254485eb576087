"""Meshes (mesh.py), the sharding-rules table (rules.py) and the collectives with their route
(collectives.py), and the tensor-parallel call sites a model's forward uses (tensor_parallel.py).
See docs/sharding.md, "Status", for what the engine uses."""
