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


def wait_for_release(worker, path, ranks=(0, 1), cap_s=120.0):
    """Answer once `path` exists (the test releases it), on the ranks in
    `ranks` (the others at once): not after a sleep that a stalled test
    thread could outlast. The cap keeps a failed test from leaving the
    shared workers blocked."""
    give_up = time.monotonic() + cap_s
    while worker.rank in ranks and not os.path.exists(path) and time.monotonic() < give_up:
        time.sleep(0.01)
    return worker.rank


def fail_on_rank_1(worker):
    if worker.rank == 1:
        raise ValueError("rank one says no")
    return "fine"


def fail_on_rank_0_while_rank_1_waits(worker, path):
    """Rank 0 raises at once; rank 1 answers once `path` exists (as a rank
    waits for a failed peer in a rendezvous)."""
    if worker.rank == 0:
        raise ValueError("rank zero says no")
    return wait_for_release(worker, path, ranks=(1,))


def marker_env(worker):
    return (
        os.environ.get("RAYLM_ALLOW_SHARED_NODE_IP"),
        "RAYLM_API_KEY" in os.environ,
        "CUDA_VISIBLE_DEVICES" in os.environ,
    )


def install_poison(worker, poison_token: int):
    """Make this worker raise on any step that holds a request whose prompt
    contains `poison_token`: a stand-in for a bug that one request triggers."""
    runner = worker.model_runner
    original = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        prompts = [new.prompt_token_ids for new in scheduler_output.scheduled_new_reqs]
        prompts += [
            runner.requests[rid].prompt_token_ids
            for rid in scheduler_output.num_scheduled_tokens
            if rid in runner.requests
        ]
        if any(poison_token in prompt for prompt in prompts):
            raise ValueError(f"poisoned token {poison_token} in the batch")
        return original(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model


def point_rank_at_model_folder(worker, rank: int, folder: str):
    """Rank `rank` loads its weights from `folder` (each process has its own config)."""
    if worker.rank == rank:
        worker.model_runner.config.model_config.model = folder
