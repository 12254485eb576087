"""The kernel registry: leaves, traits, features, priority bands and frozen KernelPlans.

A *leaf* is one implementation of one operator, registered under (family, name). Selection happens
once, when a model is constructed (`plan`), and returns a frozen `KernelPlan`; execution calls the
planned implementation and never consults the registry again, so there is no silent fallback.

Two matching mechanisms, as in the spec ("Kernel selection"):

* traits are seller-declared (``deterministic``, ``batch_invariant`` ...). A requested trait only
  excludes leaves that declare the *opposite* value. Good for ranking, useless for guarantees.
* features are buyer-required: a subset test, silent leaves excluded. Only a leaf that affirmatively
  declares ``features={"batch_invariant"}`` can serve a batch-invariant request.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class Priority(enum.IntEnum):
    """Priority bands. Higher wins; the leaf name breaks ties within a band."""

    PORTABLE = 0  # in-tree jnp / interpret forms that run anywhere
    TUNED = 10  # in-tree accelerator leaves (Triton / Pallas)
    VENDOR = 20  # out-of-tree leaves (a trainer's own kernels); register above in-tree ones


HARDWARE = ("cpu", "gpu", "gpu-sm90", "tpu", "any")


class KernelPlanError(RuntimeError):
    """Planning found no leaf able to serve the request. The message lists every exclusion."""


@dataclass(frozen=True)
class Leaf:
    family: str
    name: str
    impl: str  # the implementation's own name, e.g. "cpu_fixed_order"
    fn: Callable[..., Any]
    formats: frozenset[str]  # signature formats the leaf accepts, e.g. {"bf16", "f32"}
    hardware: frozenset[str]
    priority: int
    traits: Mapping[str, Any] = field(default_factory=dict)
    features: frozenset[str] = frozenset()
    # Static-geometry constraints: name -> predicate on the value (e.g. vocab % block == 0).
    constraints: Mapping[str, Callable[[Any], bool]] = field(default_factory=dict)
    # Variable dimensions (rows, tokens) this leaf constrains; such a leaf is excluded from plans
    # (spec: "Candidates constraining a variable dimension are excluded").
    constrains_variable_dims: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.family, self.name)


@dataclass(frozen=True)
class KernelPlan:
    """A frozen choice of leaf for one operator, made at construction time."""

    family: str
    name: str
    leaf: Leaf
    required_features: frozenset[str]
    hardware: str

    def __call__(self, *args, **kwargs):
        return self.leaf.fn(*args, **kwargs)

    def describe(self) -> str:
        return f"{self.family}.{self.name} -> {self.leaf.impl} (features {sorted(self.leaf.features)})"


class Registry:
    def __init__(self) -> None:
        self._leaves: dict[tuple[str, str], list[Leaf]] = {}
        self._lock = threading.Lock()

    # -- registration -----------------------------------------------------------------------------
    def register(
        self,
        family: str,
        name: str,
        impl: str,
        *,
        formats,
        hardware,
        priority: int = Priority.PORTABLE,
        traits: Mapping[str, Any] | None = None,
        features=(),
        constraints: Mapping[str, Callable[[Any], bool]] | None = None,
        constrains_variable_dims: bool = False,
    ):
        """Decorator registering ``fn`` as a leaf of (family, name)."""
        hw = frozenset(hardware)
        unknown = hw - set(HARDWARE)
        if unknown:
            raise ValueError(f"leaf {family}.{name}/{impl}: unknown hardware {sorted(unknown)}")

        def deco(fn):
            leaf = Leaf(
                family=family,
                name=name,
                impl=impl,
                fn=fn,
                formats=frozenset(formats),
                hardware=hw,
                priority=int(priority),
                traits=dict(traits or {}),
                features=frozenset(features),
                constraints=dict(constraints or {}),
                constrains_variable_dims=constrains_variable_dims,
            )
            with self._lock:
                existing = self._leaves.setdefault((family, name), [])
                existing[:] = [l for l in existing if l.impl != impl] + [leaf]
            return fn

        return deco

    def unregister(self, family: str, name: str, impl: str) -> None:
        with self._lock:
            self._leaves[(family, name)] = [
                l for l in self._leaves.get((family, name), []) if l.impl != impl
            ]

    def leaves(self, family: str, name: str) -> list[Leaf]:
        return list(self._leaves.get((family, name), []))

    def all_leaves(self) -> list[Leaf]:
        return [l for ls in self._leaves.values() for l in ls]

    # -- selection --------------------------------------------------------------------------------
    def plan(
        self,
        family: str,
        name: str,
        *,
        formats=(),
        hardware: str,
        geometry: Mapping[str, Any] | None = None,
        features=(),
        traits: Mapping[str, Any] | None = None,
        impl: str | None = None,
    ) -> KernelPlan:
        """Filter once, rank once, freeze. Raises KernelPlanError naming every exclusion."""
        want_formats = frozenset(formats)
        want_features = frozenset(features)
        geometry = dict(geometry or {})
        traits = dict(traits or {})
        candidates = self.leaves(family, name)
        if not candidates:
            raise KernelPlanError(f"no leaf is registered for {family}.{name}")
        eligible: list[Leaf] = []
        excluded: list[str] = []
        for leaf in candidates:
            why = _exclusion(leaf, want_formats, hardware, geometry, want_features, traits, impl)
            if why:
                excluded.append(f"{leaf.impl}: {why}")
            else:
                eligible.append(leaf)
        if not eligible:
            raise KernelPlanError(
                f"cannot plan {family}.{name} on {hardware} with formats {sorted(want_formats)}, "
                f"required features {sorted(want_features)}, geometry {geometry}; excluded: "
                + "; ".join(excluded)
            )
        best = sorted(eligible, key=lambda l: (-l.priority, l.impl))[0]
        return KernelPlan(family, name, best, want_features, hardware)


def _exclusion(leaf, formats, hardware, geometry, features, traits, impl) -> str | None:
    if impl is not None and leaf.impl != impl:
        return f"not the requested implementation {impl!r}"
    if "any" not in leaf.hardware and hardware not in leaf.hardware:
        if not (hardware == "gpu-sm90" and "gpu" in leaf.hardware):
            return f"hardware {sorted(leaf.hardware)} does not include {hardware}"
    if not formats <= leaf.formats:
        return f"formats {sorted(leaf.formats)} lack {sorted(formats - leaf.formats)}"
    missing = features - leaf.features
    if missing:
        return f"does not declare required features {sorted(missing)}"
    for trait, wanted in traits.items():
        if trait in leaf.traits and not _trait_matches(leaf.traits[trait], wanted):
            return f"declares {trait}={leaf.traits[trait]!r}, requested {wanted!r}"
    if leaf.constrains_variable_dims:
        return "constrains a variable dimension (rows/tokens)"
    for dim, pred in leaf.constraints.items():
        # A constraint the plan cannot check is not a pass: the leaf could meet a shape it rejects.
        if dim not in geometry:
            return f"constrains {dim} but the plan's geometry does not give it"
        if not pred(geometry[dim]):
            return f"rejects {dim}={geometry[dim]!r}"
    return None


def _trait_matches(declared, wanted) -> bool:
    """A trait is a value (batch_invariant=True) or the set of values a leaf supports
    (combine_order={"rank", "slot"}); a request names one value or a set it needs all of."""
    if isinstance(declared, (set, frozenset, tuple, list)):
        if isinstance(wanted, (set, frozenset, tuple, list)):
            return set(wanted) <= set(declared)
        return wanted in declared
    return declared == wanted


REGISTRY = Registry()
register = REGISTRY.register
plan = REGISTRY.plan
