"""The kernels layer of the numerics envelope, as far as the process environment goes.

Three things must be settled before JAX initialises its backend, because XLA reads them once:

* which hardware we are on (``cpu`` / ``gpu`` / ``gpu-sm90``) -- detected here WITHOUT initialising
  the backend (env vars, the installed CUDA plugin, the driver's device nodes, ``nvidia-smi``);
* the deterministic XLA flags the launch's switches ask for (``deterministic_ops``,
  ``disable_autotune``, ``disable_pdl``), each checked against the installed jaxlib first: an
  unknown flag in ``XLA_FLAGS`` aborts the process (platform-facts.md), so we never put an
  unverified flag there;
* ``NVIDIA_TF32_OVERRIDE=0`` on GPUs (the spec's "no TF32"; JAX's side is
  ``jax_default_matmul_precision="highest"``, set by ``ResolvedLaunch.apply_environment``).

A flag is verified by starting a child Python that initialises the backend with the candidate
``XLA_FLAGS``; if the child dies on "Unknown flag", that flag is dropped (optional) or the launch is
refused (required). Our own process is never put at risk, and each verdict is cached per process.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass

logger = logging.getLogger("jengine.numerics")

HARDWARE_KINDS = ("cpu", "gpu", "gpu-sm90", "tpu")


class XlaFlagError(RuntimeError):
    """A required deterministic XLA flag is unknown to the installed jaxlib, or probing failed."""


@dataclass(frozen=True)
class XlaFlag:
    flag: str  # exactly as it goes into XLA_FLAGS
    platforms: frozenset[str]  # "cpu" and/or "gpu"
    switch: str  # the LaunchConfig switch that asks for it
    required: bool  # unknown to jaxlib -> refuse the launch (True) or drop it with a warning (False)
    why: str


# The deterministic flags, per platform. Verified present in jaxlib 0.10.2 (CPU) and 0.11.2 (GPU:
# jaxlib and the cuda13 plugin).
DETERMINISTIC_XLA_FLAGS: tuple[XlaFlag, ...] = (
    XlaFlag("--xla_allow_excess_precision=false", frozenset({"cpu", "gpu"}), "deterministic_ops", True,
            "keep op-by-op bf16 rounding: XLA may otherwise drop f32->bf16->f32 round trips "
            "(SimplifyFPConversions), and the trainer's torch glue rounds at every op"),
    XlaFlag("--xla_cpu_enable_fast_min_max=false", frozenset({"cpu"}), "deterministic_ops", False,
            "max/min propagate NaN as torch does (the XLA:CPU default may drop NaNs)"),
    XlaFlag("--xla_cpu_enable_fast_math=false", frozenset({"cpu"}), "deterministic_ops", False,
            "no fast-math reassociation; already the default, pinned so a new default cannot "
            "move bits"),
    XlaFlag("--xla_gpu_deterministic_ops=true", frozenset({"gpu"}), "deterministic_ops", True,
            "run-to-run determinism of XLA's own GPU ops (scatter, reductions); NOT batch "
            "invariance, which comes from the registry's batch_invariant leaves"),
    XlaFlag("--xla_gpu_autotune_level=0", frozenset({"gpu"}), "disable_autotune", True,
            "no per-shape, per-machine tactic timing: XLA takes the first config"),
    # On by default in both jaxlibs (the flag's value in their default compile options): XLA then
    # launches each of its kernels early, the kernel waiting at its entry (griddepcontrol.wait)
    # for the one before it. That wait precedes every read, so it should not move a bit (the
    # goldens did not, H100, fortieth session); the spec serialises kernel chains anyway, so the
    # contract does not rest on it.
    XlaFlag("--xla_gpu_enable_pdl=false", frozenset({"gpu"}), "disable_pdl", True,
            "no programmatic dependent launch: each kernel starts after the one before it has "
            "finished (the spec's kernels.deterministic)"),
)


# -- hardware -----------------------------------------------------------------------------------


def backend_initialized() -> bool:
    """True once JAX has created its backends (after which XLA_FLAGS is no longer read)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    probe = getattr(xla_bridge, "backends_are_initialized", None)
    if probe is not None:
        return bool(probe())
    return bool(getattr(xla_bridge, "_backends", {}))  # pragma: no cover - older/newer jax


def detect_hardware() -> str:
    """The hardware kind the backend will run on, without initialising the backend."""
    if backend_initialized():  # already up: asking costs nothing
        import jax

        if jax.default_backend() != "gpu":
            return jax.default_backend()
        caps = [getattr(d, "compute_capability", "0") for d in jax.devices()]
        return "gpu-sm90" if all(_major(c) >= 9 for c in caps) else "gpu"
    requested = _requested_platform()
    if requested == "cpu":
        return "cpu"
    if requested == "tpu":
        return "tpu"
    if requested in ("cuda", "gpu", "rocm"):
        return _gpu_kind()
    # No explicit platform: JAX picks the GPU iff a CUDA plugin is installed and a GPU is visible.
    if _cuda_plugin_installed() and _nvidia_gpu_visible():
        return _gpu_kind()
    return "cpu"


def _requested_platform() -> str | None:
    value = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME") or ""
    if not value and "jax" in sys.modules:  # set programmatically via jax.config (no backend init)
        import jax

        value = jax.config.jax_platforms or ""
    first = value.split(",")[0].strip().lower()
    return first or None


def _cuda_plugin_installed() -> bool:
    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _nvidia_gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    gpus_dir = "/proc/driver/nvidia/gpus"
    return os.path.exists("/dev/nvidiactl") or (os.path.isdir(gpus_dir) and bool(os.listdir(gpus_dir)))


def _gpu_kind() -> str:
    """gpu-sm90 when every visible GPU reports compute capability >= 9.0, else gpu."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        caps = [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return "gpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and all(p.strip().isdigit() for p in visible.split(",")):
        caps = [caps[int(p)] for p in visible.split(",") if int(p) < len(caps)]
    return "gpu-sm90" if caps and all(_major(c) >= 9 for c in caps) else "gpu"


def _major(cap) -> int:
    try:
        return int(str(cap).split(".")[0])
    except ValueError:
        return 0


# -- flags ------------------------------------------------------------------------------------------


def flags_for(hardware: str, *, deterministic_ops: bool, disable_autotune: bool,
              disable_pdl: bool = False, probe: bool = True) -> tuple[str, ...]:
    """The deterministic XLA flags these switches ask for on this hardware, verified against jaxlib."""
    platform = "gpu" if hardware.startswith("gpu") else hardware
    on = {"deterministic_ops": deterministic_ops, "disable_autotune": disable_autotune,
          "disable_pdl": disable_pdl}
    wanted = [f for f in DETERMINISTIC_XLA_FLAGS if platform in f.platforms and on[f.switch]]
    if not wanted or not probe:
        return tuple(f.flag for f in wanted)
    unknown = unknown_xla_flags(tuple(f.flag for f in wanted), _probe_platform(platform))
    missing_required = [f for f in wanted if f.flag in unknown and f.required]
    if missing_required:
        raise XlaFlagError(
            "the installed jaxlib does not know the deterministic XLA flag(s) "
            + ", ".join(f"{f.flag} ({f.switch}: {f.why})" for f in missing_required)
            + "; the numerics envelope cannot be honoured with this jaxlib")
    for f in wanted:
        if f.flag in unknown:
            logger.warning("dropping XLA flag %s (unknown to this jaxlib): %s", f.flag, f.why)
    return tuple(f.flag for f in wanted if f.flag not in unknown)


def _probe_platform(platform: str) -> str:
    # Probe on the platform the launch will use: a GPU plugin carries its own copy of XLA's flags.
    return os.environ.get("JAX_PLATFORMS") or {"gpu": "cuda"}.get(platform, platform)


_UNKNOWN_FLAG = re.compile(r"Unknown flags? in XLA_FLAGS:\s*(\S+)")


@functools.lru_cache(maxsize=None)
def unknown_xla_flags(flags: tuple[str, ...], platform: str = "cpu") -> frozenset[str]:
    """The subset of ``flags`` the installed jaxlib would abort on, found in child processes.

    The child initialises the backend with the candidate XLA_FLAGS. XLA names the first unknown
    flag in its fatal message; we drop it and retry, so this costs one child per unknown flag + 1.
    """
    remaining, unknown = list(flags), set()
    while remaining:
        ok, stderr = _probe_once(tuple(remaining), platform)
        if ok:
            return frozenset(unknown)
        match = _UNKNOWN_FLAG.search(stderr)
        named = match.group(1) if match else None
        culprit = next((f for f in remaining if named and f.split("=")[0] == named.split("=")[0]), None)
        if culprit is None:  # the message did not name one of ours: test one flag at a time
            baseline_ok, baseline_err = _probe_once((), platform)
            culprit = baseline_ok and next(
                (f for f in remaining if not _probe_once((f,), platform)[0]), None)
            if not culprit:
                raise XlaFlagError(f"probing XLA flags {list(flags)} on platform {platform!r} "
                                   f"failed for a reason other than an unknown flag:\n"
                                   f"{(stderr if baseline_ok else baseline_err)[-2000:]}")
        unknown.add(culprit)
        remaining.remove(culprit)
    return frozenset(unknown)


@functools.lru_cache(maxsize=None)
def _probe_once(flags: tuple[str, ...], platform: str) -> tuple[bool, str]:
    env = dict(os.environ)
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS=platform,
               XLA_PYTHON_CLIENT_PREALLOCATE="false")  # a GPU child must not grab the memory
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                          env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode == 0, proc.stderr


@functools.lru_cache(maxsize=None)
def _default_compile_options(xla_flags: str) -> bytes | None:
    """A child's serialized default CompileOptions, its DebugOptions read from `xla_flags`; None
    when the child dies (an unknown flag). Building the options starts no backend."""
    code = ("import sys; from jax._src.lib import xla_client as xc; "
            "sys.stdout.buffer.write(xc.CompileOptions().SerializeAsString())")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, XLA_FLAGS=xla_flags),
                          capture_output=True, timeout=300)
    return proc.stdout if proc.returncode == 0 else None


def xla_flag_default(name: str) -> bool | None:
    """The installed jaxlib's default of the boolean XLA flag `name` (``xla_gpu_enable_pdl``):
    True when setting it true leaves the default compile options as they are and setting it false
    changes them; False the other way round, or when both change them (XLA's defaults leave the
    field unset, which reads false); None when jaxlib does not know the flag. Every backend's XLA
    parses every flag, so a GPU flag's default can be read on a CPU machine."""
    base = _default_compile_options("")
    on, off = (_default_compile_options(f"--{name}={v}") for v in ("true", "false"))
    if on is None or off is None:
        return None
    if on == base != off:
        return True
    if on != base:  # off == base, or neither: the field is set false or left unset
        return False
    raise XlaFlagError(f"cannot tell {name}'s default: the options with it true, false and unset "
                       f"compare {on == base}, {off == base}")


# -- applying -------------------------------------------------------------------------------------


def merge_xla_flags(current: str, ours: tuple[str, ...]) -> str:
    """``current`` XLA_FLAGS with ``ours`` appended; a flag set to a different value is refused."""
    have = {}
    for token in current.split():
        name, _, value = token.partition("=")
        have[name] = value
    extra = []
    for flag in ours:
        name, _, value = flag.partition("=")
        if name in have and have[name] != value:
            raise XlaFlagError(f"XLA_FLAGS in the environment sets {name}={have[name]}, but the "
                               f"numerics envelope needs {flag}; remove it from XLA_FLAGS")
        if name not in have:
            extra.append(flag)
    return " ".join(current.split() + extra)
