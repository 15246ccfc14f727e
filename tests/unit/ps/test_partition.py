"""Properties of the parameter-server partitioner (pure, Hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwright.runtime.ps.partition import Kind, TensorSpec, partition
from tests.bench.ps_skew import ZipfIds, range_loads, spread

dense_specs = st.lists(
    st.tuples(st.integers(1, 5000), st.integers(1, 64)), min_size=1, max_size=12)
emb_specs = st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 32)), max_size=3)


def _specs(dense: list[tuple[int, int]], emb: list[tuple[int, int]]) -> list[TensorSpec]:
    out = [TensorSpec(f"d{i}", (a, b)) for i, (a, b) in enumerate(dense)]
    out += [TensorSpec(f"e{i}", (r, d), kind=Kind.EMBEDDING) for i, (r, d) in enumerate(emb)]
    return out


@settings(max_examples=60, deadline=None)
@given(dense_specs, emb_specs, st.integers(1, 9))
def test_every_element_and_row_is_placed_exactly_once(
        dense: list[tuple[int, int]], emb: list[tuple[int, int]], shards: int) -> None:
    specs = _specs(dense, emb)
    part = partition(specs, shards, min_piece_bytes=1)
    for spec in specs:
        if spec.kind is Kind.DENSE:
            covered = np.zeros(spec.numel, dtype=np.int64)
            for d in part.dense:
                if d.name == spec.name:
                    assert 0 <= d.shard < shards
                    covered[d.start:d.stop] += 1
            assert (covered == 1).all()
        else:
            held = np.concatenate([part.rows_on(spec.name, s) for s in range(shards)])
            assert sorted(held.tolist()) == list(range(spec.shape[0]))
    assert sum(part.loads) == sum(s.nbytes for s in specs)


@settings(max_examples=60, deadline=None)
@given(dense_specs, emb_specs, st.integers(1, 9))
def test_largest_first_bound(
        dense: list[tuple[int, int]], emb: list[tuple[int, int]], shards: int) -> None:
    """max load <= mean + the largest indivisible unit (an element or a row) + the cap."""
    specs = _specs(dense, emb)
    part = partition(specs, shards, granularity=0.02, min_piece_bytes=1)
    mean = sum(part.loads) / shards
    unit = max(s.row_numel * s.itemsize if s.kind is Kind.EMBEDDING else s.itemsize
               for s in specs)
    assert max(part.loads) <= mean + max(0.02 * mean, unit) + unit


@pytest.mark.parametrize("shards", [2, 3, 4, 8, 16])
def test_realistic_models_are_within_five_percent(shards: int) -> None:
    """A wide-and-deep recommender and a transformer-like stack: max/mean <= 1.05."""
    recsys = [TensorSpec("wide", (1_000_003, 1), kind=Kind.EMBEDDING),
              TensorSpec("user", (2_000_000, 64), kind=Kind.EMBEDDING),
              TensorSpec("item", (500_000, 64), kind=Kind.EMBEDDING),
              TensorSpec("mlp.0.weight", (512, 13 + 128)), TensorSpec("mlp.0.bias", (512,)),
              TensorSpec("mlp.1.weight", (256, 512)), TensorSpec("mlp.1.bias", (256,)),
              TensorSpec("out.weight", (1, 256)), TensorSpec("out.bias", (1,))]
    stack = [TensorSpec("tok", (50_257, 768), kind=Kind.EMBEDDING)]
    for layer in range(12):
        stack += [TensorSpec(f"l{layer}.{name}", shape) for name, shape in
                  [("qkv", (2304, 768)), ("o", (768, 768)), ("ff1", (3072, 768)),
                   ("ff2", (768, 3072)), ("ln", (768,))]]
    for specs in (recsys, stack):
        part = partition(specs, shards)
        print(f"shards={shards} params={len(specs)} max/mean={part.imbalance:.6f}")
        assert part.imbalance <= 1.05


def test_big_tensors_are_split_and_not_placed_by_index() -> None:
    """One huge tensor and many small ones: the huge one is spread over all shards."""
    specs = [TensorSpec("big", (4096, 4096))] + [TensorSpec(f"s{i}", (10,)) for i in range(7)]
    part = partition(specs, 4)
    assert {d.shard for d in part.dense if d.name == "big"} == {0, 1, 2, 3}
    assert part.imbalance <= 1.05


def test_hashed_buckets_spread_hot_low_ids() -> None:
    """Zipf-like traffic on low ids lands on every shard in near-equal shares."""
    spec = TensorSpec("t", (100_000, 8), kind=Kind.EMBEDDING)
    part = partition([spec], 4)
    hot = np.arange(1000, dtype=np.int64)
    counts = np.bincount(part.row_shards("t", hot), minlength=4)
    assert counts.min() >= 150, counts


def test_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        partition([TensorSpec("a", (3,))], 0)
    with pytest.raises(ValueError, match="unique"):
        partition([TensorSpec("a", (3,)), TensorSpec("a", (4,))], 2)
    with pytest.raises(ValueError, match="rows x dim"):
        partition([TensorSpec("e", (3, 2, 2), kind=Kind.EMBEDDING)], 2)


def test_small_tensors_are_not_cut_into_tiny_pieces() -> None:
    part = partition([TensorSpec("w", (4, 3)), TensorSpec("b", (3,))], 4)
    assert [(d.name, d.start, d.stop) for d in part.dense] == [("b", 0, 3), ("w", 0, 12)]


def test_zipf_ids_ask_every_shard_for_about_as_many_rows() -> None:
    """Hot ids (Zipf 1.1, id 0 hottest) cost each shard within a fifth of the mean: a
    pull asks for a row once, and hashed buckets scatter the hot ids. Contiguous id
    ranges (the skew the hashing removes) would put almost all of them on one shard."""
    rows, shards = 1_000_000, 3
    part = partition([TensorSpec("t", (rows, 16), kind=Kind.EMBEDDING)], shards)
    zipf = ZipfIds(rows, 1.1, seed=0)
    asked = np.zeros(shards, dtype=np.int64)
    contiguous = np.zeros(shards, dtype=np.int64)
    for _ in range(50):
        ids = zipf.draw(4096)
        asked += part.rows_asked("t", ids)
        contiguous += range_loads(np.unique(ids), rows, shards)
    assert spread(asked) <= 1.2, asked
    assert spread(contiguous) > 2, contiguous
