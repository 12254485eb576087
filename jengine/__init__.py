"""jengine: a JAX/XLA LLM inference engine whose `--numerics rl-bitwise` mode is a contract.

    from jengine import Engine
    with Engine(model_path="tiny") as eng:
        out = eng.generate(prompt="Hello", sampling_params={"max_new_tokens": 8, "temperature": 0})
"""

from jengine.engine.engine import Engine

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]
