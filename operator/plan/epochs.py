"""The epoch rule: every published world is numbered above every epoch ever seen.

Runtimes ignore a world whose epoch is not above the one they follow, so an epoch that
goes back (a restarted operator, a deleted or corrupted world ConfigMap) would leave
them on the old world forever, and two writers publishing one epoch with different
members would split the job. Three places remember the last epoch, and each can be
lost on its own:

- the world document in the ConfigMap (gone when the ConfigMap is deleted, unreadable
  when its data is corrupted);
- an annotation on that ConfigMap, kept apart from the data (survives a corrupted
  document);
- the job's ``status.world.epoch`` (survives the ConfigMap's deletion).

The next epoch is one above the highest of them. The write then carries the
ConfigMap's resourceVersion as it was read (or is a create when there was none), so a
concurrent writer's world makes the write fail with a conflict and the round re-reads
instead of publishing the same epoch with other members.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringwright.objects import Obj

EPOCH_ANNOTATION = "ringwright.dev/epoch"
"""On the world ConfigMap: the epoch of the document it holds."""


@dataclass(frozen=True)
class EpochsSeen:
    """The last epoch as each place remembers it (0: that place knows none)."""

    document: int = 0
    """The parsed world document's epoch."""
    annotation: int = 0
    """The world ConfigMap's :data:`EPOCH_ANNOTATION`."""
    status: int = 0
    """The job's ``status.world.epoch``."""

    @property
    def highest(self) -> int:
        """The newest epoch anyone may have seen."""
        return max(self.document, self.annotation, self.status)


def next_epoch(seen: EpochsSeen) -> int:
    """The epoch of the next world: above everything seen."""
    return seen.highest + 1


def _count(value: object) -> int:
    """A non-negative epoch from an untrusted field; 0 when unreadable."""
    try:
        number = int(str(value))
    except ValueError:
        return 0
    return max(number, 0)


def annotated_epoch(configmap: Obj | None) -> int:
    """The epoch annotation of a world ConfigMap (0 when absent or unreadable)."""
    annotations = ((configmap or {}).get("metadata") or {}).get("annotations") or {}
    return _count(annotations.get(EPOCH_ANNOTATION, 0))
