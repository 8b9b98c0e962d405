"""routing.plan_rebalance: when the load is uneven enough to move requests,
from where to where, and how many (half the gap: the two meet in the middle)."""

from raylm.engine.routing import CoreLoad, plan_rebalance


def test_even_or_slightly_uneven_loads_stay():
    assert plan_rebalance([CoreLoad(0, 5), CoreLoad(1, 5)]) is None
    assert plan_rebalance([CoreLoad(0, 8), CoreLoad(1, 5)]) is None  # gap 3 < 4
    assert plan_rebalance([CoreLoad(0, 20), CoreLoad(1, 15)]) is None  # gap 5, but 20 < 1.5 * 16
    assert plan_rebalance([CoreLoad(0, 9)]) is None


def test_the_busiest_gives_half_the_gap_to_the_idlest():
    assert plan_rebalance([CoreLoad(0, 5), CoreLoad(1, 0)]) == (0, 1, 2)
    assert plan_rebalance([CoreLoad(0, 1), CoreLoad(1, 12), CoreLoad(2, 4)]) == (1, 0, 5)
    # Waiting requests weigh double: a core with a queue is busier than its count says.
    assert plan_rebalance([CoreLoad(0, 4, num_waiting=2), CoreLoad(1, 2)]) == (0, 1, 3)


def test_after_the_move_nothing_moves_back():
    source, destination, count = plan_rebalance([CoreLoad(0, 9), CoreLoad(1, 1)])
    after = [CoreLoad(source, 9 - count), CoreLoad(destination, 1 + count)]
    assert plan_rebalance(after) is None
