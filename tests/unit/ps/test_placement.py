"""Which server holds each shard as the job's servers grow and shrink: the pure plan."""

from __future__ import annotations

import pytest

from ringwright.runtime.ps.placement import Move, Placement, handovers, homes, moves


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_one_shard_per_server_is_the_layout_without_resizing(servers: int) -> None:
    place = Placement(servers, servers)
    assert [place.home(s) for s in range(servers)] == list(range(servers))
    assert [place.replica_host(s) for s in range(servers)] == [
        (s + 1) % servers for s in range(servers)]


@pytest.mark.parametrize("shards", range(1, 13))
def test_every_size_is_balanced_and_a_step_moves_only_the_joining_servers_shards(
        shards: int) -> None:
    for servers in range(1, shards + 1):
        held = [list(homes(shards, servers)).count(i) for i in range(servers)]
        assert max(held) - min(held) <= 1, (shards, servers, held)
        if servers == shards:
            continue
        grown = moves(shards, servers, servers + 1)
        # Only what the new server takes moves, and it takes its fair share.
        assert {m.target for m in grown} == {servers}
        assert len(grown) == list(homes(shards, servers + 1)).count(servers)
        assert len(grown) >= shards // (servers + 1)
        # Shrinking back moves exactly those shards back where they were.
        assert moves(shards, servers + 1, servers) == [
            Move(m.shard, m.target, m.source) for m in grown]


def test_shard_0_never_moves() -> None:
    # It holds the data-shard service, and server 0 is never the one a shrink removes.
    assert all(homes(shards, servers)[0] == 0
               for shards in range(1, 20) for servers in range(1, shards + 1))


def test_more_servers_than_shards_leaves_the_extra_ones_empty() -> None:
    assert homes(3, 5) == (0, 1, 2)
    assert moves(3, 3, 5) == []


def test_three_shards_on_two_then_three_servers() -> None:
    assert homes(3, 2) == (0, 1, 0)
    assert moves(3, 2, 3) == [Move(2, 0, 2)]
    assert moves(3, 3, 2) == [Move(2, 2, 0)]
    # Replicas follow their primaries' homes: shard 1's goes from ps-0 to ps-2.
    assert [Placement(3, 2).replica_host(s) for s in range(3)] == [1, 0, 1]
    assert [Placement(3, 3).replica_host(s) for s in range(3)] == [1, 2, 0]


def test_other_copy_after_a_failover_or_a_move_goes_home() -> None:
    place = Placement(3, 3)
    assert place.other_copy(2, at=2) == 0  # the home sends to its replica host
    assert place.other_copy(2, at=0) == 2  # a copy away from home goes home
    assert place.other_copy(2, at=1) == 2
    assert place.keeps(2, 2) and place.keeps(2, 0) and not place.keeps(2, 1)


def test_handovers_after_a_resize() -> None:
    two, three = Placement(3, 2), Placement(3, 3)
    # Growing: ps-0 gives shard 2 to the new ps-2 and keeps shard 0.
    assert handovers(two, three, 0, [0, 2]) == {2: 2}
    assert handovers(two, three, 1, [1]) == {}
    # Shrinking: the leaving ps-2 gives everything it serves to the new homes.
    assert handovers(three, two, 2, [2]) == {2: 0}
    # A primary here after a failover (shard 1 promoted on ps-2, its replica host) and
    # whose home did not move stays, as it would without the resize...
    assert handovers(Placement(3, 3), Placement(3, 4), 2, [1, 2]) == {}
    # ... unless this server is leaving.
    assert handovers(Placement(4, 3), Placement(4, 2), 2, [1, 2]) == {1: 1, 2: 1}
