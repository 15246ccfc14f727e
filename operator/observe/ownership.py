"""Which objects belong to a job: the controller ownerReference's UID decides, not labels.

Labels say which job an object is *for*, and anyone who may create pods can set them.
The controller reference carries the job's UID, which only the job's own objects hold:
a foreign pod labelled for the job, or the pods and ConfigMaps of an earlier job of the
same name that the garbage collector has not removed yet, are not the job's.
"""

from __future__ import annotations

from collections.abc import Iterable

from ringwright.objects import Obj


def controller_uid(obj: Obj | None) -> str | None:
    """UID of the object's controller (the ownerReference marked ``controller``), or None."""
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return next((str(r.get("uid", "")) for r in refs if r.get("controller")), None)


def owned_by(obj: Obj | None, uid: str) -> bool:
    """True when ``uid`` (a job's UID) controls ``obj``."""
    return bool(uid) and controller_uid(obj) == uid


def owned(objs: Iterable[Obj], uid: str) -> list[Obj]:
    """The objects of ``objs`` that ``uid`` controls."""
    return [o for o in objs if owned_by(o, uid)]


def left_behind(objs: Iterable[Obj], uid: str) -> list[Obj]:
    """Objects of ``objs`` controlled by another TrainingJob: one of the same name that
    was deleted (names are unique, so it cannot still exist) and whose dependents the
    garbage collector has not removed yet. They hold names the job's own pods need."""
    out = []
    for o in objs:
        refs = (o.get("metadata") or {}).get("ownerReferences") or []
        ref = next((r for r in refs if r.get("controller")), None)
        if ref is not None and ref.get("kind") == "TrainingJob" and ref.get("uid") != uid:
            out.append(o)
    return out
