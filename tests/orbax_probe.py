"""The tiny model loaded from its Orbax conversion at TP2 on 8 fake CPU devices, against the same
model loaded from its safetensors, measured and printed as one JSON object.

Run by tests/test_orbax.py in a subprocess (XLA reads the fake device count once per process).
Every entry is a measurement; the assertions live in the test.
"""

import dataclasses
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jengine.config import LaunchConfig  # noqa: E402
from jengine.convert import convert  # noqa: E402
from jengine.engine.model_runner import ModelRunner  # noqa: E402
from jengine.launch import plan_launch  # noqa: E402
from jengine.models import load_model  # noqa: E402
from jengine.numerics import resolve_launch  # noqa: E402
from tests.bits import count_bit_differences  # noqa: E402
from tests.tp_probe import OPTIONS, PROMPT_A, PROMPT_B, logits_of  # noqa: E402


def main():
    hf = load_model("tiny", progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        convert("tiny", tmp, progress=False)
        orbax = load_model(tmp)
        resolved = resolve_launch(LaunchConfig(numerics="rl-bitwise", **OPTIONS), hardware="cpu",
                                  probe_xla_flags=False)
        runner_cfg = dataclasses.replace(plan_launch(resolved, hf.config).runner, tp_size=2)
        from_hf = ModelRunner(hf.config, hf.checkpoint, runner_cfg)
        from_orbax = ModelRunner(orbax.config, orbax.checkpoint, runner_cfg)
        # What Orbax restores, before the model casts it: each array already on its placement.
        place = from_orbax.placement.param_placement
        restored = orbax.checkpoint.restore(place)

    def params(runner):
        return runner._model(runner._params).named_parameters()

    a, b = params(from_hf), params(from_orbax)
    q = "layers.0.self_attn.q_proj.weight"
    logits_hf = logits_of(from_hf, [PROMPT_B, PROMPT_A])
    logits_orbax = logits_of(from_orbax, [PROMPT_B, PROMPT_A])
    print(json.dumps({
        "devices": len(jax.devices()),
        "checkpoint": type(orbax.checkpoint).__name__,
        "params": len(a),
        "params_differing": {p: count_bit_differences(a[p], b[p]) for p in a
                             if count_bit_differences(a[p], b[p])},
        "shardings_differing": [p for p in a if a[p].sharding != b[p].sharding],
        "restored_q_proj_spec": str(restored[q].sharding.spec),
        "restored_q_proj_shape": list(restored[q].shape),
        "restored_q_proj_local_shape": list(restored[q].addressable_shards[0].data.shape),
        "restored_unplaced": [p for p, x in restored.items()
                              if x.sharding != place(from_orbax.param_specs()[p])],
        "logits_differing": sum(count_bit_differences(x, y)
                                for x, y in zip(logits_hf, logits_orbax)),
        "logits_elements": int(sum(x.size for x in logits_hf)),
        "greedy_ids_equal": all(bool((x.argmax(1) == y.argmax(1)).all())
                                for x, y in zip(logits_hf, logits_orbax)),
    }))


if __name__ == "__main__":
    main()
