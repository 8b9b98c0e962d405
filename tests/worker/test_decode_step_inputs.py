"""A decode-only step's inputs (prepare_batch's list-built path) and the
sampling metadata a steady batch reuses."""

import numpy as np
import torch

from raylm.sampling_params import SamplingParams
from raylm.worker.input_batch import CachedRequestState, prepare_batch
from raylm.worker.sampling_metadata import same_every_step

BLOCK = 4


def _state(rid, num_tokens, block_ids):
    tokens = list(range(100, 100 + num_tokens))
    return CachedRequestState(
        rid, tokens[:3], tokens, SamplingParams(temperature=0), block_ids, num_computed_tokens=num_tokens - 1
    )


def test_decode_only_step_matches_the_general_layout():
    # Contexts of 10 and 3 tokens: the second row's table is padded with its
    # first block; the first holds a spare block past its context.
    states = {"a": _state("a", 10, [7, 2, 9, 5]), "b": _state("b", 3, [4])}
    batch = prepare_batch(states, {"a": 1, "b": 1}, BLOCK, torch.device("cpu"))
    meta = batch.attn_metadata
    assert batch.input_ids.tolist() == [109, 102] and batch.input_ids.dtype == torch.int64
    assert batch.positions.tolist() == [9, 2] and batch.positions.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [9 * BLOCK + 1, 4 * BLOCK + 2] and meta.slot_mapping.dtype == torch.int64
    assert meta.num_decode_tokens == 2 and meta.prefills == []
    assert meta.decode_block_table.tolist() == [[7, 2, 9], [4, 4, 4]]
    assert meta.decode_context_lens.tolist() == [10, 3]
    expected_mask = np.arange(3 * BLOCK)[None, :] < np.array([10, 3])[:, None]
    assert meta.decode_mask.dtype == torch.bool and meta.decode_mask.shape == (2, 1, 1, 3 * BLOCK)
    assert (meta.decode_mask[:, 0, 0].numpy() == expected_mask).all()
    assert batch.sample_req_ids == ["a", "b"] and batch.sample_indices == [0, 1]


def test_metadata_is_reused_only_for_rows_that_ignore_their_output():
    assert same_every_step(SamplingParams(temperature=0))
    assert same_every_step(SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=2))
    assert not same_every_step(SamplingParams(repetition_penalty=1.2))
    assert not same_every_step(SamplingParams(min_tokens=4, max_tokens=8))
    assert not same_every_step(SamplingParams(bad_words_token_ids=[[5]]))
