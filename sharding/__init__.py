"""Meshes (mesh.py), the sharding-rules table (rules.py) and the collectives with their route
(collectives.py). The engine is single-device today; see docs/sharding.md for what is in use."""
