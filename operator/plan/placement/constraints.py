"""The node constraints a pod template states, as the planner applies them.

A template's ``nodeSelector`` and required node affinity (``matchExpressions`` on node
labels, ``matchFields`` on ``metadata.name``) decide which nodes the scheduler may
bind its pods to; tolerations against node taints are matched in
:mod:`ringwright.operator.plan.placement.inventory`. The planner only plans onto nodes
all of them allow, so a plan never names a node the scheduler would refuse (which
would leave the pods unbound until the gang timeout withdraws them, round after round).

The node labels of a Kueue ResourceFlavor join the template's ``nodeSelector`` (see
:mod:`ringwright.operator.plan.kueue`), so there is one placement, not two that disagree.

Pure: parsing, matching and explaining, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .inventory import NodeInfo, Taint, blocking_taints

OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"})
_FIELD_OPERATORS = frozenset({"In", "NotIn"})
_NODE_NAME_FIELD = "metadata.name"


class ConstraintError(ValueError):
    """A template constraint the API server would refuse or could never match."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One ``matchExpressions`` (or ``matchFields``) entry of a node selector term."""

    key: str
    operator: str
    values: tuple[str, ...] = ()
    field: bool = False
    """A ``matchFields`` entry: ``key`` is ``metadata.name``, not a label."""

    def matches(self, labels: Mapping[str, str], name: str) -> bool:
        """Whether a node with ``labels`` called ``name`` satisfies this requirement."""
        value = name if self.field else labels.get(self.key)
        op = self.operator
        if op == "In":
            return value is not None and value in self.values
        if op == "NotIn":
            return value is None or value not in self.values
        if op == "Exists":
            return value is not None
        if op == "DoesNotExist":
            return value is None
        # Gt / Lt: the label must parse as an integer (core/v1 semantics).
        try:
            number = int(value) if value is not None else None
        except ValueError:
            return False
        if number is None:
            return False
        bound = int(self.values[0])
        return number > bound if op == "Gt" else number < bound

    def describe(self) -> str:
        """``key In [a, b]`` / ``key Exists``, as a user wrote it."""
        if self.operator in ("Exists", "DoesNotExist"):
            return f"{self.key} {self.operator}"
        if self.operator in ("Gt", "Lt"):
            return f"{self.key} {self.operator} {self.values[0]}"
        return f"{self.key} {self.operator} [{', '.join(self.values)}]"

    def to_wire(self) -> dict[str, Any]:
        """The requirement as a ``matchExpressions``/``matchFields`` entry."""
        out: dict[str, Any] = {"key": self.key, "operator": self.operator}
        if self.values:
            out["values"] = list(self.values)
        return out


Term = tuple[Requirement, ...]
"""Requirements that must all hold (one ``nodeSelectorTerm``)."""


@dataclass(frozen=True, slots=True)
class Selector:
    """One ``key=value`` of a ``nodeSelector``: a node must carry it."""

    key: str
    value: str


@dataclass(frozen=True, slots=True)
class NodeConstraints:
    """Which nodes a role's pods may go to, apart from taints and room.

    Hashable: the node groups remember their room per constraints.
    """

    selector: tuple[Selector, ...] = ()
    """Every entry must match (the template's ``nodeSelector``)."""
    terms: tuple[Term, ...] = ()
    """Required node affinity: at least one term must match; none means no affinity."""

    @property
    def empty(self) -> bool:
        """True when any node is allowed."""
        return not self.selector and not self.terms

    def allows(self, node: NodeInfo) -> bool:
        """Whether the scheduler may bind a pod with these constraints to ``node``."""
        if self.empty:
            return True
        labels = dict(node.labels)
        if any(labels.get(s.key) != s.value for s in self.selector):
            return False
        return not self.terms or any(
            term and all(r.matches(labels, node.name) for r in term) for term in self.terms)

    def terms_wire(self) -> list[dict[str, Any]]:
        """The required terms as ``nodeSelectorTerms`` entries."""
        out = []
        for term in self.terms:
            wire: dict[str, Any] = {}
            exprs = [r.to_wire() for r in term if not r.field]
            fields = [r.to_wire() for r in term if r.field]
            if exprs:
                wire["matchExpressions"] = exprs
            if fields:
                wire["matchFields"] = fields
            out.append(wire)
        return out


NO_CONSTRAINTS = NodeConstraints()


def _requirement(raw: Mapping[str, Any], where: str, field: bool) -> Requirement:
    key = str(raw.get("key") or "")
    op = str(raw.get("operator") or "")
    values = tuple(str(v) for v in raw.get("values") or ())
    if not key:
        raise ConstraintError(f"{where}: a requirement without a key")
    if op not in (_FIELD_OPERATORS if field else OPERATORS):
        allowed = ", ".join(sorted(_FIELD_OPERATORS if field else OPERATORS))
        raise ConstraintError(f"{where}: operator {op!r} of {key!r} is not one of {allowed}")
    if field and key != _NODE_NAME_FIELD:
        raise ConstraintError(f"{where}: matchFields supports only {_NODE_NAME_FIELD}, "
                              f"not {key!r}")
    if op in ("In", "NotIn") and not values:
        raise ConstraintError(f"{where}: {key} {op} needs at least one value")
    if op in ("Exists", "DoesNotExist") and values:
        raise ConstraintError(f"{where}: {key} {op} takes no values; remove them")
    if op in ("Gt", "Lt") and (len(values) != 1 or not _is_int(values[0])):
        raise ConstraintError(f"{where}: {key} {op} needs exactly one integer value, "
                              f"got {list(values)}")
    return Requirement(key, op, values, field)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def node_constraints(pod_spec: Mapping[str, Any], where: str) -> NodeConstraints:
    """The ``nodeSelector`` and required node affinity of ``pod_spec``.

    ``where`` names the template in error messages (``spec.workers.template.spec``).
    Raises :class:`ConstraintError` for a constraint the API server would refuse.
    """
    selector = tuple(Selector(str(k), str(v))
                     for k, v in sorted((pod_spec.get("nodeSelector") or {}).items()))
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = []
    for i, term in enumerate(required.get("nodeSelectorTerms") or ()):
        at = (f"{where}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
              f".nodeSelectorTerms[{i}]")
        reqs = tuple(_requirement(r, at, False) for r in term.get("matchExpressions") or ())
        reqs += tuple(_requirement(r, at, True) for r in term.get("matchFields") or ())
        # An empty term matches no node (core/v1); keep it, so such a template is refused
        # by the explanation below rather than silently allowed everywhere.
        terms.append(reqs)
    return NodeConstraints(selector, tuple(terms))


@dataclass(frozen=True)
class Narrowing:
    """How many of the nodes considered each constraint leaves (for a condition)."""

    considered: int
    """Nodes the planner looked at (schedulable, of the job's GPU model when it has one)."""
    left: int
    """Nodes all constraints together leave."""
    steps: tuple[tuple[str, int], ...]
    """(constraint as written, nodes it alone leaves), in the order the template states them."""

    def message(self, role: str, scope: str) -> str:
        """One sentence naming the tightest constraint, e.g. ``the workers' nodeSelector
        disk=ssd leaves 0 of 16 schedulable nodes``."""
        if not self.steps:
            return f"no {scope} admits the {role}"
        tightest = min(self.steps, key=lambda s: s[1])
        if tightest[1] > self.left:
            # Each allows some node, none allows one the others do: name them all.
            return (f"the {role}' constraints together leave {self.left} of "
                    f"{self.considered} {scope} (alone: "
                    + "; ".join(f"{what}: {n}" for what, n in self.steps) + ")")
        text = (f"the {role}' {tightest[0]} leaves {tightest[1]} of {self.considered} "
                f"{scope}")
        others = [f"{what}: {n}" for what, n in self.steps if (what, n) != tightest]
        if others:
            text += f" (others alone: {'; '.join(others)}; all together: {self.left})"
        return text


def narrowing(constraints: NodeConstraints, tolerations: Sequence[Mapping[str, Any]],
              nodes: Iterable[NodeInfo]) -> Narrowing:
    """What each of a role's constraints (and its tolerations against taints) leaves of
    ``nodes``: the numbers a user needs to see which constraint to loosen."""
    listed = list(nodes)
    steps: list[tuple[str, int]] = []
    for s in constraints.selector:
        steps.append((f"nodeSelector {s.key}={s.value}",
                      sum(dict(n.labels).get(s.key) == s.value for n in listed)))
    if constraints.terms:
        only_terms = NodeConstraints(terms=constraints.terms)
        described = " or ".join(
            "(" + ", ".join(r.describe() for r in term) + ")" if term else "(empty term)"
            for term in constraints.terms)
        steps.append((f"required node affinity {described}",
                       sum(only_terms.allows(n) for n in listed)))
    untolerated = _untolerated(tolerations, listed)
    if untolerated:
        taints = ", ".join(sorted({f"{t.key}={t.value}:{t.effect}" if t.value
                                   else f"{t.key}:{t.effect}" for t in untolerated}))
        steps.append((f"tolerations (untolerated taints: {taints})",
                       sum(not blocking_taints(n, tolerations) for n in listed)))
    left = sum(constraints.allows(n) and not blocking_taints(n, tolerations) for n in listed)
    return Narrowing(len(listed), left, tuple(steps))


def _untolerated(tolerations: Sequence[Mapping[str, Any]],
                 nodes: Sequence[NodeInfo]) -> set[Taint]:
    return {t for n in nodes for t in blocking_taints(n, tolerations)}
