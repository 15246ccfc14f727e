"""The generation rule: every published world is numbered above every generation ever seen.

Runtimes ignore a world whose generation is not above the one they follow, so a generation that
goes back (a restarted operator, a deleted or corrupted world ConfigMap) would leave
them on the old world forever, and two writers publishing one generation with different
members would split the job. Three places remember the last generation, and each can be
lost on its own:

- the world document in the ConfigMap (gone when the ConfigMap is deleted, unreadable
  when its data is corrupted);
- an annotation on that ConfigMap, kept apart from the data (survives a corrupted
  document);
- the job's ``status.world.generation`` (survives the ConfigMap's deletion).

The next generation is one above the highest of them. The write then carries the
ConfigMap's resourceVersion as it was read (or is a create when there was none), so a
concurrent writer's world makes the write fail with a conflict and the round re-reads
instead of publishing the same generation with other members.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringwright.objects import Obj

GENERATION_ANNOTATION = "ringwright.dev/generation"
"""On the world ConfigMap: the generation of the document it holds."""
LEGACY_GENERATION_ANNOTATION = "ringwright.dev/epoch"
"""The same, under the name an operator one version older reads and writes: still
written and read. Deprecated: removed in the next version."""


@dataclass(frozen=True)
class GenerationsSeen:
    """The last generation as each place remembers it (0: that place knows none)."""

    document: int = 0
    """The parsed world document's generation."""
    annotation: int = 0
    """The world ConfigMap's :data:`GENERATION_ANNOTATION` (or the legacy one)."""
    status: int = 0
    """The job's ``status.world.generation``."""

    @property
    def highest(self) -> int:
        """The newest generation anyone may have seen."""
        return max(self.document, self.annotation, self.status)


def next_generation(seen: GenerationsSeen) -> int:
    """The generation of the next world: above everything seen."""
    return seen.highest + 1


def _count(value: object) -> int:
    """A non-negative generation from an untrusted field; 0 when unreadable."""
    try:
        number = int(str(value))
    except ValueError:
        return 0
    return max(number, 0)


def annotated_generation(configmap: Obj | None) -> int:
    """The generation annotation of a world ConfigMap (0 when absent or unreadable).

    The higher of the annotation and its legacy name: a ConfigMap last written one
    version older carries the legacy one alone."""
    annotations = ((configmap or {}).get("metadata") or {}).get("annotations") or {}
    return max(_count(annotations.get(GENERATION_ANNOTATION, 0)),
               _count(annotations.get(LEGACY_GENERATION_ANNOTATION, 0)))
