"""A store whose values carry a tag made with the job's join token.

The rendezvous store (a TCPStore) has no authentication: whoever reaches its port can
read, list and write every key. The NetworkPolicy keeps other pods off that port;
this wrapper keeps a process that reaches it anyway, without the job's token (or with
another job's), from taking part. Every value written through it is tagged with an
HMAC of the key and the value, under a key derived from the token and the generation's
prefix; every value read through it must carry a valid tag, so a forged claim, a
forged heartbeat or a forged address in the library's own rendezvous is refused, and
a value of one generation cannot be replayed in another. Such a process can still disturb
a generation (delete keys, inflate counters); it cannot claim a rank.

Counters (``add``) stay untagged: only the claims and what is read back decide who is
a member.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Store

TAG_BYTES = 64
"""Length of the hex tag in front of every value."""


class ForgedValue(dist.DistStoreError):
    """A value in the store does not carry this job's tag."""


def generation_key(token: bytes, prefix: str) -> bytes:
    """The tagging key of one generation: bound to the token and the generation's key prefix."""
    return hmac.new(token, prefix.encode(), hashlib.sha256).digest()


def _as_bytes(value: str | bytes | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SignedStore(Store):
    """``inner`` with every value tagged on write and checked on read."""

    def __init__(self, inner: Store, key: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._key = key

    def _tag(self, name: str, value: bytes) -> bytes:
        digest = hmac.new(self._key, name.encode() + b"\0" + value, hashlib.sha256)
        return digest.hexdigest().encode()

    def private_key(self, name: str) -> str:
        """``name`` suffixed with a tag: processes with another token write elsewhere,
        so they can neither take nor overwrite this job's value there."""
        return f"{name}/{self._tag(name, b'')[:16].decode()}"

    def seal(self, name: str, value: str | bytes) -> bytes:
        """The stored form of ``value`` at ``name``: tag, then value."""
        data = _as_bytes(value)
        return self._tag(name, data) + data

    def open(self, name: str, stored: bytes) -> bytes:
        """The value inside ``stored``; :class:`ForgedValue` when its tag is not valid."""
        tag, data = stored[:TAG_BYTES], stored[TAG_BYTES:]
        if len(stored) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(name, data)):
            raise ForgedValue(f"store key {name!r} holds a value without this job's token")
        return data

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value`` tagged."""
        # The binding takes bytes too (the library stores binary addresses); its stub
        # only names str.
        self._inner.set(key, self.seal(key, value))  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        """The checked value at ``key`` (waits for it like the inner store)."""
        return self.open(key, _as_bytes(self._inner.get(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The checked values at ``keys``."""
        return [self.open(k, _as_bytes(v)) for k, v in zip(keys, self._inner.multi_get(keys),
                                                           strict=True)]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if absent (``expected`` empty) or still ``expected``.

        Returns the stored value, checked: ``desired`` when the write happened.
        """
        sealed_expected = self.seal(key, expected).decode() if expected else ""
        stored = self._inner.compare_set(key, sealed_expected, self.seal(key, desired).decode())
        return self.open(key, _as_bytes(stored))

    def add(self, key: str, value: int) -> int:
        """Counters are not tagged (see the module docstring)."""
        return self._inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        """Whether all ``keys`` exist (forged or not)."""
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until all ``keys`` exist."""
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``."""
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        """Number of keys in the inner store."""
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        """Timeout of the inner store's blocking calls."""
        self._inner.set_timeout(timeout)
