import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrepro.data import EpochOrder


def test_epoch_order_is_numpy_pcg64_of_seed_and_epoch():
    order = EpochOrder(10, seed=0)
    # pinned: a change here means NumPy's Generator stream changed (a software-version change)
    assert order.permutation(0) == [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]
    assert order.permutation(1) == [9, 1, 3, 8, 7, 6, 0, 4, 2, 5]
    for epoch in range(3):
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([0, epoch])))
        assert order.permutation(epoch) == rng.permutation(10).tolist()


def test_next_batch_crosses_epoch_boundaries():
    order = EpochOrder(5, seed=1234)
    assert order.next_batch(12) == [0, 4, 1, 3, 2, 0, 1, 4, 2, 3, 0, 3]
    assert (order.epoch, order.cursor, order.position) == (2, 2, 12)
    expected = order.permutation(0) + order.permutation(1) + order.permutation(2)[:2]
    assert expected == [0, 4, 1, 3, 2, 0, 1, 4, 2, 3, 0, 3]


def test_full_epoch_moves_to_next_epoch():
    order = EpochOrder(4, seed=3)
    order.next_batch(4)
    assert order.state_dict() == {"version": 1, "epoch": 1, "cursor": 0, "num_items": 4, "seed": 3, "shuffle": True}


def test_no_shuffle_is_identity():
    order = EpochOrder(3, seed=9, shuffle=False)
    assert order.next_batch(7) == [0, 1, 2, 0, 1, 2, 0]


def test_orders_do_not_depend_on_batch_sizes():
    a, b = EpochOrder(7, seed=5), EpochOrder(7, seed=5)
    got_a = a.next_batch(3) + a.next_batch(11) + a.next_batch(1)
    got_b = sum((b.next_batch(1) for _ in range(15)), [])
    assert got_a == got_b


def test_errors():
    with pytest.raises(ValueError, match="num_items is 0"):
        EpochOrder(0, seed=0)
    with pytest.raises(ValueError, match="num_items"):
        EpochOrder(-1, seed=0)
    with pytest.raises(ValueError, match="seed"):
        EpochOrder(3, seed=-1)
    order = EpochOrder(3, seed=0)
    for n in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            order.next_batch(n)


def test_load_state_dict_rejects_other_data_or_seed():
    state = EpochOrder(5, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_items=5 but this order has num_items=6"):
        EpochOrder(6, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 but this order has seed=2"):
        EpochOrder(5, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        EpochOrder(5, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="cursor 5 is out of range"):
        EpochOrder(5, seed=1).load_state_dict({**state, "cursor": 5})
    with pytest.raises(ValueError, match="lacks"):
        EpochOrder(5, seed=1).load_state_dict({"epoch": 0})


@settings(max_examples=100, deadline=None)
@given(num_items=st.integers(1, 40), seed=st.integers(0, 2**64 - 1), shuffle=st.booleans(),
       sizes=st.lists(st.integers(1, 90), min_size=1, max_size=12), data=st.data())
def test_resume_equals_continue(num_items, seed, shuffle, sizes, data):
    split = data.draw(st.integers(0, len(sizes)))
    straight = EpochOrder(num_items, seed, shuffle)
    expected = [straight.next_batch(n) for n in sizes]

    first = EpochOrder(num_items, seed, shuffle)
    got = [first.next_batch(n) for n in sizes[:split]]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = EpochOrder(num_items, seed, shuffle)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(n) for n in sizes[split:]]
    assert got == expected
    assert resumed.state_dict() == straight.state_dict()


@settings(max_examples=100, deadline=None)
@given(num_items=st.integers(1, 50), seed=st.integers(0, 2**32), epochs=st.integers(1, 4),
       chunk=st.integers(1, 60))
def test_each_epoch_is_a_permutation(num_items, seed, epochs, chunk):
    order = EpochOrder(num_items, seed)
    items: list[int] = []
    while len(items) < epochs * num_items:
        items += order.next_batch(chunk)
    for e in range(epochs):
        block = items[e * num_items:(e + 1) * num_items]
        assert sorted(block) == list(range(num_items))
        assert block == order.permutation(e)
