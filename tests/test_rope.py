"""RoPE inverse frequencies: HF's formulas as torch evaluates them (jengine/models/layers/rope.py).

On the CPU, HF's own ``ROPE_INIT_FUNCTIONS`` run in torch under trainer mode (which routes torch's
pow to XLA's, the one transcendental function in them) must give the engine's frequencies bit for
bit, for every rope type the engine implements. The CUDA spelling (``t / s`` as a multiply by the
reciprocal) is checked against torch on the H200 (scripts/gpu_align.py); here it is the negative
control: it must differ from the CPU spelling where a scalar divisor is not a power of two.
"""

from __future__ import annotations

import numpy as np
import pytest

from jengine.models.layers.rope import TorchF32, inv_freq_and_scaling, rope_tables
from tests.bits import count_bit_differences

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROPES = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "llama3-odd": {"rope_type": "llama3", "factor": 6.0, "low_freq_factor": 1.5,
                   "high_freq_factor": 5.0, "original_max_position_embeddings": 1000},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
}
THETAS = {"default": 500000.0, "llama3": 500000.0, "llama3-odd": 10000.0, "yarn": 10000.0,
          "yarn-mscale": 10000.0}


def _hf_inv_freq(kind: str, head_dim: int):
    """HF's own init function on the CPU, under trainer mode (pow -> XLA's pow)."""
    from interop import trainer_mode
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "default", **(ROPES[kind] or {}), "rope_theta": THETAS[kind]}
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                      head_dim=head_dim, max_position_embeddings=16384,
                                      rope_parameters=rope)
    with trainer_mode.enable(device="cpu"):
        if rope["rope_type"] == "default":
            model_cls = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
            inv, scaling = model_cls.compute_default_rope_parameters(config, device="cpu")
        else:
            inv, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, device="cpu")
    return inv.numpy(), scaling


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("head_dim", [128, 96, 16])
def test_cpu_frequencies_are_hf_torch_bits(kind, head_dim):
    want, want_scaling = _hf_inv_freq(kind, head_dim)
    got, scaling = inv_freq_and_scaling(head_dim, THETAS[kind], ROPES[kind], 16384,
                                        frequency_device="cpu", ramp_device="cpu")
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    assert count_bit_differences(got, want) == 0
    assert scaling == want_scaling


def test_negative_control_cuda_spelling_differs_on_a_scalar_divisor():
    """The comparison above can fail: the CUDA spelling of t / s (times the f32 reciprocal of s)
    is not the CPU's division when s is not a power of two (llama3-odd divides by 3.5 and 6)."""
    want, _ = _hf_inv_freq("llama3-odd", 128)
    cpu = TorchF32("cpu", None)
    cuda = TorchF32("cuda", None)
    x = np.linspace(0.1, 9.0, 4096, dtype=np.float32)
    assert count_bit_differences(cpu.div(x, 3.5), cuda.div(x, 3.5)) > 0
    import jengine.models.layers.rope as rope

    original = rope.semantics_of
    rope.semantics_of = lambda where: "cuda"
    try:
        got, _ = inv_freq_and_scaling(128, THETAS["llama3-odd"], ROPES["llama3-odd"], 16384,
                                      frequency_device="cpu")
    finally:
        rope.semantics_of = original
    assert count_bit_differences(got, want) > 0


def test_rdiv_is_reciprocal_then_multiply_as_in_torch():
    x = torch.rand(1 << 16) * 100 + 0.01
    want = (2 * np.pi / x).numpy()  # torch: x.reciprocal() * 2pi
    assert count_bit_differences(TorchF32.rdiv(2 * np.pi, x.numpy()), want) == 0
    assert count_bit_differences(np.float32(2 * np.pi) / x.numpy(), want) > 0  # one division


def test_tables_are_the_hf_forward_of_those_frequencies():
    """cos/sin = cos(position * inv_freq) * scaling in the model dtype, as HF's forward makes them
    (trainer mode routes cos and sin to XLA's, which the tables use)."""
    import jax.numpy as jnp

    from interop import trainer_mode

    inv, scaling = inv_freq_and_scaling(128, 500000.0, None, 4096, frequency_device="cpu")
    cos, sin = rope_tables(128, 500000.0, None, 4096, jnp.bfloat16, frequency_device="cpu")
    positions = torch.arange(4096)[None]
    with trainer_mode.enable(device="cpu"):
        freqs = positions[..., None].float() * torch.from_numpy(inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        want_cos = (emb.cos() * scaling).to(torch.bfloat16)[0]
        want_sin = (emb.sin() * scaling).to(torch.bfloat16)[0]
    assert count_bit_differences(np.asarray(cos), want_cos.float().numpy()) == 0
    assert count_bit_differences(np.asarray(sin), want_sin.float().numpy()) == 0
