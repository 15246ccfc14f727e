"""What the API models (TrainingJob, SchedulingPolicy) share: a base class and CEL helpers.

The models are the one source of truth for the CRDs. Everything the API server
should enforce (bounds, enums, cross-field rules) is declared next to the field it
concerns, so :mod:`ringwright.operator.api.crdgen` only has to translate, never invent.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict, JsonValue

GROUP = "ringwright.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_VALUE = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

VALIDATIONS = "x-kubernetes-validations"


class ApiModel(BaseModel):
    """Base of every API model: camelCase on the wire, snake_case in Python, frozen.

    Unknown keys are ignored rather than refused: the API server has already pruned
    what the schema does not know, and an older operator must read a newer object.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="ignore",
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One ``x-kubernetes-validations`` entry.

    ``field_path`` (relative to the object the rule sits on) makes the API server
    report the error at that field, so ``kubectl`` points at what to fix.
    """
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


def validations(*rules: JsonDict) -> JsonDict:
    """Schema extra carrying ``rules`` as ``x-kubernetes-validations``."""
    entries: list[JsonValue] = [*rules]
    return {VALIDATIONS: entries}


def immutable(field: str) -> JsonDict:
    """Schema extra for a field that may not change after creation (a transition rule)."""
    return validations(cel("self == oldSelf", f"{field} is immutable"))
