"""The building blocks a model family assembles: each layer type declares its parameters
(`ParamSpec`, param.py) where it defines them, and its forward in the model dtype.

Importing this package imports nothing heavy; each module is imported by what uses it (trainer mode
imports rope.py without flax).
"""
