"""The kernel registry: families, leaves, traits, features, priority bands and frozen KernelPlans.

A *family* is one operator, (family, name), with one call signature: its module declares it once
(`declare_family`, a stub function whose parameters are the contract and whose docstring gives the
shapes and dtypes). A *leaf* is one implementation of a family, registered under (family, name,
impl); registration refuses an undeclared family, a leaf whose parameters differ from the
declaration, and a second leaf of the same impl name. Selection happens once, when a model is
constructed (`plan`), and returns a frozen `KernelPlan`, which checks every call against the
family's signature and then calls the planned implementation; it never consults the registry again,
so there is no silent fallback.

Two matching mechanisms, as in the spec ("Kernel selection"):

* traits are seller-declared (``deterministic``, ``batch_invariant`` ...). A requested trait only
  excludes leaves that declare the *opposite* value. Good for ranking, useless for guarantees.
* features are buyer-required: a subset test, silent leaves excluded. Only a leaf that affirmatively
  declares ``features={"batch_invariant"}`` can serve a batch-invariant request.
"""

from __future__ import annotations

import enum
import inspect
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


class KernelRegistrationError(ValueError):
    """A family or leaf cannot be registered: undeclared family, mismatched signature, duplicate."""


@dataclass(frozen=True)
class FamilySignature:
    """The one call signature every leaf of (family, name) takes, declared by the family's module."""

    family: str
    name: str
    signature: inspect.Signature
    doc: str  # shapes and dtypes, one line

    def describe(self) -> str:
        return f"{self.family}.{self.name}{self.signature}: {self.doc}"


def _signature_mismatch(declared: inspect.Signature, fn) -> str | None:
    """Why `fn` cannot serve a family declared as `declared`, or None.

    The leaf takes the declared parameters in order, with the same names and kinds, and a default
    exactly where the family has one (what a caller may leave out). It may add keyword-only
    parameters with defaults after them (a Triton leaf's `tile` or `schedule`, for benches and
    tests calling the leaf directly): a plan's call, checked against the family, never passes them.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    want = list(declared.parameters.values())
    for i, d in enumerate(want):
        if i >= len(params):
            return f"it lacks parameter {d.name!r}"
        p = params[i]
        if (p.name, p.kind) != (d.name, d.kind):
            return f"parameter {i} is {p.name!r} ({p.kind.description}), the family declares " \
                   f"{d.name!r} ({d.kind.description})"
        if (p.default is p.empty) != (d.default is d.empty):
            has = "has no default" if p.default is p.empty else "has a default"
            return f"parameter {p.name!r} {has}, unlike the family's"
    for p in params[len(want):]:
        if p.kind is not p.KEYWORD_ONLY or p.default is p.empty:
            return f"extra parameter {p.name!r} must be keyword-only with a default"
    return None


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
    declared: FamilySignature

    def __call__(self, *args, **kwargs):
        # Checked at trace time (plans run inside jit): a wrong call fails naming the family, not
        # deep inside whichever leaf happened to be planned.
        try:
            self.declared.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.family}.{self.name}: {exc}; the family is "
                            f"{self.declared.describe()}") from None
        return self.leaf.fn(*args, **kwargs)

    def describe(self) -> str:
        return f"{self.family}.{self.name} -> {self.leaf.impl} (features {sorted(self.leaf.features)})"


class Registry:
    def __init__(self) -> None:
        self._families: dict[tuple[str, str], FamilySignature] = {}
        self._leaves: dict[tuple[str, str], list[Leaf]] = {}
        self._lock = threading.Lock()

    # -- registration -----------------------------------------------------------------------------
    def declare_family(self, family: str, name: str, stub: Callable[..., Any]) -> FamilySignature:
        """Declare (family, name)'s call signature: `stub`'s parameters, its docstring's first line
        (shapes and dtypes). Declaring it again with another signature is an error."""
        doc = (inspect.getdoc(stub) or "").split("\n")[0].strip()
        if not doc:
            raise KernelRegistrationError(f"family {family}.{name}: the signature stub "
                                          f"{stub.__name__} needs a docstring giving shapes/dtypes")
        declared = FamilySignature(family, name, inspect.signature(stub), doc)
        with self._lock:
            existing = self._families.get((family, name))
            if existing is not None and existing.signature != declared.signature:
                raise KernelRegistrationError(
                    f"family {family}.{name} is already declared as {existing.signature}; "
                    f"cannot declare it again as {declared.signature}")
            self._families[(family, name)] = declared
        return declared

    def family(self, family: str, name: str) -> FamilySignature:
        try:
            return self._families[(family, name)]
        except KeyError:
            known = ", ".join(f"{f}.{n}" for f, n in sorted(self._families)) or "none"
            raise KernelRegistrationError(f"family {family}.{name} is not declared "
                                          f"(declared: {known})") from None

    def check_signature(self, family: str, name: str, impl: str, fn: Callable[..., Any]) -> None:
        """Raise KernelRegistrationError unless `fn` can serve the declared family (family, name).
        `register` calls it; tests call it for leaves that register only on a GPU."""
        declared = self.family(family, name)
        why = _signature_mismatch(declared.signature, fn)
        if why:
            raise KernelRegistrationError(
                f"leaf {family}.{name}/{impl} ({getattr(fn, '__qualname__', fn)}) does not match "
                f"the family {declared.describe()}: {why}")

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
        """Decorator registering ``fn`` as leaf `impl` of the declared family (family, name)."""
        hw = frozenset(hardware)
        unknown = hw - set(HARDWARE)
        if unknown:
            raise ValueError(f"leaf {family}.{name}/{impl}: unknown hardware {sorted(unknown)}")

        def deco(fn):
            self.check_signature(family, name, impl, fn)
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
                if any(l.impl == impl for l in existing):
                    raise KernelRegistrationError(
                        f"leaf {family}.{name}/{impl} is already registered (family {family!r}, "
                        f"name {name!r}, impl {impl!r}); unregister it first to replace it")
                existing.append(leaf)
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
        return KernelPlan(family, name, best, want_features, hardware, self.family(family, name))


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
declare_family = REGISTRY.declare_family
register = REGISTRY.register
plan = REGISTRY.plan
