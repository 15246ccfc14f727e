"""values.yaml against values.schema.json, both ways: every key the schema describes
is in values.yaml with a comment, every key in values.yaml is in the schema with a
description. A key shown commented out (``# key: value``) counts as present: it is how
values.yaml shows a value that has no default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from pydantic.alias_generators import to_camel

from ringwright.devcluster.helm import CHART
from ringwright.objects import Obj
from ringwright.operator.settings import OperatorSettings
from tests.unit.test_chart_render import helm, one, render

__all__ = ["helm"]  # the fixture, shared with the chart render tests

KeyPath = tuple[str, ...]

COMMENTED_KEY = re.compile(r"^(?P<indent> *)# (?P<key>[a-z][A-Za-z0-9]*):(?P<rest> .*)?$")
"""A commented-out key. Prose comments never start with a lower-case word and a colon."""
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_.-]*):(?: |$)")
COMMENT = re.compile(r"^(?P<indent> *)#")


@dataclass(frozen=True)
class Values:
    """values.yaml read with its commented-out keys uncommented."""

    tree: Obj
    documented: frozenset[KeyPath]
    """Keys with a comment of their own: on the lines just above, at the key's
    indentation, or at the end of the key's line."""
    commented_out: frozenset[KeyPath]


def read_values(text: str) -> Values:
    """Uncomment ``# key: value`` lines, parse the result and note which keys have a comment.

    ``key: {}`` followed by deeper commented-out keys (the ``helm create`` way of
    showing optional entries of an empty map) becomes ``key:`` with those entries.
    """
    raw = text.splitlines()
    lines: list[str] = []
    commented: list[bool] = []
    for line in raw:
        match = COMMENTED_KEY.match(line)
        lines.append(f"{match['indent']}{match['key']}:{match['rest'] or ''}" if match else line)
        commented.append(match is not None)
    for i, line in enumerate(lines):
        following = next((n for n in lines[i + 1:] if n.strip() and not COMMENT.match(n)), "")
        if line.endswith(": {}") and _indent(following) > _indent(line) and KEY.match(following):
            lines[i] = line.removesuffix(" {}")
    tree = yaml.safe_load("\n".join(lines))
    assert isinstance(tree, dict)

    documented: set[KeyPath] = set()
    commented_out: set[KeyPath] = set()
    stack: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        match = KEY.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        path = tuple(key for _, key in stack)
        above = raw[i - 1] if i else ""
        comment_above = COMMENT.match(above)
        if ((comment_above and len(comment_above["indent"]) == indent and not commented[i - 1])
                or (not commented[i] and " # " in raw[i])):
            documented.add(path)
        if commented[i]:
            commented_out.add(path)
    return Values(tree, frozenset(documented), frozenset(commented_out))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _resolve(schema: Obj, root: Obj) -> Obj:
    """The schema with a local $ref followed (siblings win) and allOf parts merged in."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/definitions/")
        schema = {**_resolve(root["definitions"][name], root),
                  **{k: v for k, v in schema.items() if k != "$ref"}}
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema.get("allOf", []):
        merged = {**_resolve(part, root), **merged}
    return merged


def schema_properties(schema: Obj, root: Obj, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Obj]]:
    """Every property the schema names, parents before children, resolved."""
    for key, sub in _resolve(schema, root).get("properties", {}).items():
        resolved = _resolve(sub, root)
        yield (*path, key), resolved
        yield from schema_properties(resolved, root, (*path, key))


def value_keys(tree: Obj, schema: Obj, root: Obj, path: KeyPath = ()) -> Iterator[KeyPath]:
    """Every key of ``tree`` down to where the schema stops naming properties (a
    free-form map such as podAnnotations ends the walk)."""
    properties = _resolve(schema, root).get("properties")
    if properties is None or not isinstance(tree, dict):
        return
    for key, sub in tree.items():
        yield (*path, key)
        if key in properties:
            yield from value_keys(sub, properties[key], root, (*path, key))


@pytest.fixture(scope="module")
def schema() -> Obj:
    loaded: Obj = json.loads((CHART / "values.schema.json").read_text())
    return loaded


@pytest.fixture(scope="module")
def values() -> Values:
    return read_values((CHART / "values.yaml").read_text())


def _dotted(paths: set[KeyPath]) -> list[str]:
    return sorted(".".join(p) for p in paths)


def test_every_schema_property_is_in_values_yaml(schema: Obj, values: Values) -> None:
    described = {path for path, _ in schema_properties(schema, schema)}
    present = set(value_keys(values.tree, schema, schema))
    assert not described - present, (
        f"in values.schema.json but not in values.yaml: {_dotted(described - present)}")


def test_every_values_yaml_key_is_a_schema_property(schema: Obj, values: Values) -> None:
    described = {path for path, _ in schema_properties(schema, schema)}
    present = set(value_keys(values.tree, schema, schema))
    assert not present - described, (
        f"in values.yaml but not in values.schema.json: {_dotted(present - described)}")


def test_every_value_has_a_comment_and_a_schema_description(
    schema: Obj, values: Values
) -> None:
    undocumented = {p for p in value_keys(values.tree, schema, schema)
                    if p not in values.documented}
    assert not undocumented, f"values.yaml keys without a comment: {_dotted(undocumented)}"
    undescribed = {path for path, sub in schema_properties(schema, schema)
                   if not str(sub.get("description", "")).strip()}
    assert not undescribed, f"schema properties without a description: {_dotted(undescribed)}"


def test_commented_out_keys_are_values_the_chart_accepts(
    helm: Path, tmp_path: Path, values: Values
) -> None:
    """Uncommenting every shown key gives values that pass the schema and render."""
    assert values.commented_out, "values.yaml shows no optional key"
    objs = render(helm, tmp_path, values.tree)
    policy = one(objs, "SchedulingPolicy")["spec"]
    assert policy["nodeLabels"]["spine"] == values.tree["schedulingPolicy"]["nodeLabels"]["spine"]
    assert policy["limits"]["maxRacksPerJob"] == \
        values.tree["schedulingPolicy"]["limits"]["maxRacksPerJob"]


def test_settings_show_the_operators_defaults(values: Values) -> None:
    """Each operator setting is shown with the value the operator uses when it is unset."""
    shown = values.tree["operator"]["settings"]
    defaults = {to_camel(name): field.default
                for name, field in OperatorSettings.model_fields.items()}
    assert shown == defaults
    assert all(("operator", "settings", key) in values.commented_out for key in shown), (
        "a shown setting is set: it would override the operator's default")


# ------------------------------------------------------------------ the reader itself


def test_reader_finds_missing_comments_and_commented_out_keys() -> None:
    read = read_values(
        "# Documented.\n"
        "a: 1\n"
        "b: 2\n"
        "c:  # inline\n"
        "  # A nested one.\n"
        "  d: 3\n"
        "  # Shown, unset.\n"
        "  # e: 4\n"
        "m: {}\n"
        "  # An optional entry.\n"
        "  # f: x\n")
    assert read.tree == {"a": 1, "b": 2, "c": {"d": 3, "e": 4}, "m": {"f": "x"}}
    assert read.documented == {("a",), ("c",), ("c", "d"), ("c", "e"), ("m", "f")}
    assert read.commented_out == {("c", "e"), ("m", "f")}
