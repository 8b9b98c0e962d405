"""One request pinned to a data-parallel replica, run to its end (the
prefix pull and tier tests place each request on the replica they mean)."""

from __future__ import annotations


def run_pinned(llm, outputs: dict, rid: str, prompt: list[int], rank: int, params) -> None:
    """Add `prompt` as `rid` on replica `rank` and step until nothing is
    unfinished; each request's tokens so far land in `outputs`."""
    engine = llm.llm_engine
    engine.add_request(rid, {"prompt_token_ids": prompt}, params, data_parallel_rank=rank)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
