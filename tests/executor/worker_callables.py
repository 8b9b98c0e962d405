"""Small functions the executor tests send to workers through collective_rpc.

Workers (Ray actors, spawned processes) cannot import test modules by name,
so this module is registered to travel by value with both cloudpickles (Ray's
copy for actor calls, the standalone one for the message queue).
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import ray.cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rank_of(worker):
    return worker.rank


def rank_times(worker, factor, offset=0):
    return worker.rank * factor + offset


def sleep_then_rank(worker, seconds):
    time.sleep(seconds)
    return worker.rank


def sleep_on_rank_1(worker, seconds):
    time.sleep(seconds if worker.rank == 1 else 0)
    return worker.rank


def fail_on_rank_1(worker):
    if worker.rank == 1:
        raise ValueError("rank one says no")
    return "fine"


def marker_env(worker):
    return os.environ.get("RAYLM_TEST_MARKER"), "CUDA_VISIBLE_DEVICES" in os.environ
