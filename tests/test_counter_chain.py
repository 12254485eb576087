"""The launcher's counters: one buffer threaded through a step's counting launches.

The kernels' side (each launch leaves its counters zero) is checked under Triton's interpreter
(tests/test_triton_gemm_interpreter.py, tests/test_triton_attention.py) and on the H200 by the
goldens. Here, on any machine, the launcher's side with jax-triton replaced by a recorder: which
buffer each launch gets, how it is aliased, and that the caller never sees it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _triton_launch as launch
from pallas_kernels import counter_chain


class Recorder:
    """Stands in for jax_triton: records each call's arguments; an aliased output is its input
    plus 0 (a new value, as an updated buffer is), every other output zeros."""

    def __init__(self):
        self.calls = []

    def triton_call(self, *args, out_shape, input_output_aliases, zeroed_outputs=(), **_):
        arrays = [a for a in args if not isinstance(a, (bool, int, float, np.floating))]
        outs = [jnp.zeros(s.shape, s.dtype) for s in out_shape]
        for i, o in input_output_aliases.items():
            outs[o] = arrays[i] + 0
        self.calls.append(dict(args=args, out_shape=out_shape, zeroed=tuple(zeroed_outputs),
                               aliases=dict(input_output_aliases), outs=outs))
        return outs


@pytest.fixture()
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(launch, "import_jax_triton", lambda: rec)
    monkeypatch.setattr(launch, "_register_ffi_lowering", lambda jt: None)
    return rec


def _launch(x, size, outs=None):
    out = jax.ShapeDtypeStruct((2,), jnp.float32)
    return launch.jax_launch("kernel", (x, 7, np.float32(0.5), launch.Counters(size)),
                             out if outs is None else outs, (1,), num_warps=4, num_stages=1)


def test_outside_a_chain_each_launch_counts_in_fresh_zeros(recorder):
    x = jnp.ones(3)
    result = _launch(x, 5)
    assert result.shape == (2,)  # one output asked for, one returned: the counters stay inside
    (call,) = recorder.calls
    counters = call["args"][-1]
    assert counters.dtype == jnp.int32 and counters.shape == (5,) and not np.asarray(counters).any()
    # The counters are the second array argument (x, then them; the scalars do not count) and
    # the last output; nothing is zeroed by a memset.
    assert call["aliases"] == {1: 1} and call["zeroed"] == ()
    assert call["out_shape"][-1] == jax.ShapeDtypeStruct((5,), jnp.int32)
    _launch(x, 5)
    assert recorder.calls[1]["args"][-1] is not call["outs"][-1]


def test_a_chain_threads_one_buffer_and_grows_it_when_a_launch_needs_more(recorder):
    x = jnp.ones(3)

    def step(x):
        with counter_chain():
            a = _launch(x, 6)
            b, c = _launch(a, 4, outs=(jax.ShapeDtypeStruct((2,), jnp.float32),) * 2)
            d = _launch(b + c, 9)
            e = _launch(d, 2)
        return e

    jax.jit(step)(x)  # traced: the buffer passed along is a tracer of the step's own trace
    first, second, third, fourth = recorder.calls[-4:]
    assert first["args"][-1].shape == (6,)
    # The second launch (4 counters) counts in the first's returned buffer, all 6 of it.
    assert second["args"][-1] is first["outs"][-1]
    assert second["out_shape"][-1].shape == (6,) and second["aliases"] == {1: 2}
    # The third needs 9: a fresh zeroed buffer of 9, which the fourth then takes.
    assert third["args"][-1] is not second["outs"][-1] and third["args"][-1].shape == (9,)
    assert fourth["args"][-1] is third["outs"][-1]
    # After the chain, launches count in fresh zeros again.
    _launch(x, 6)
    assert recorder.calls[-1]["args"][-1] is not fourth["outs"][-1]


def test_torch_launches_get_zeroed_counters_as_their_last_output():
    torch = pytest.importorskip("torch")
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **_):
                seen["args"] = args
            return run

    out = torch.empty(2)
    returned = launch.torch_launch(Kernel(), (torch.ones(3), 7, launch.Counters(4)), (out,), (1,),
                                   num_warps=4, num_stages=1)
    assert returned == (out,)
    x, seven, counters, out_arg, counters_out = seen["args"]
    assert counters is counters_out and counters.dtype == torch.int32
    assert counters.shape == (4,) and not counters.any() and out_arg is out
