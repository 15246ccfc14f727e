"""Where a worker goes after a failed call: the pure decision from the servers' answers."""

from __future__ import annotations

import pytest

from ringwright.runtime.ps.wire.routing import Promote, Retry, ShardView, Step, Wait, decide

P, R = "primary", "replica"


def _view(**roles: str) -> ShardView:
    return {int(k[1:]): (role, 7) for k, role in roles.items()}


@pytest.mark.parametrize(("shard", "used", "views", "step"), [
    # The primary answers: it was slow or briefly unreachable, not dead. No failover.
    (0, 0, [_view(s0=P, s1=R), _view(s0=R, s1=P)], Retry(0)),
    # The primary is silent and its replica answers: promote the replica.
    (0, 0, [None, _view(s0=R, s1=P)], Promote(1)),
    (1, 1, [_view(s0=P, s1=R), None], Promote(0)),
    # Another worker promoted it already: follow it there.
    (0, 0, [None, _view(s0=P, s1=P)], Retry(1)),
    # It stepped down (FAILED_PRECONDITION) after a false failover: go to the new primary.
    (0, 0, [_view(s0=R, s1=R), _view(s0=P, s1=P)], Retry(1)),
    # Two primaries while a false failover settles: the promoted copy wins.
    (0, 0, [_view(s0=P, s1=R), _view(s0=P, s1=P)], Retry(1)),
    (0, 1, [_view(s0=P, s1=R), _view(s0=P, s1=P)], Retry(1)),
    # After a failover the promoted copy dies: the home server (re-seeded) takes it back.
    (0, 1, [_view(s0=R, s1=R), None], Promote(0)),
    # Three servers: shard 2's copies are on 2 and 0.
    (2, 2, [_view(s0=P, s2=R), _view(s1=P), None], Promote(0)),
    # Nobody that answers holds it (a replacement not yet re-seeded, or nobody answers).
    (0, 0, [None, None], Wait()),
    (0, 1, [_view(s0=P), _view()], Retry(0)),
    (1, 1, [_view(s0=P), _view()], Wait()),
])
def test_decide(shard: int, used: int, views: list[ShardView | None], step: Step) -> None:
    assert decide(shard, used, views) == step
