"""A model whose every token shows the K/V it was computed over, and an
executor that runs it, for the chaos harness's fast tier (raylm.testing.chaos).

The "model" writes, into each KV slot a step computes, the token and the
position it holds (what a real layer's K/V depends on), and samples the next
token as a hash of every slot the request's block table reads. So a request
that continues over K/V not its own (a block never written, another
request's, a stale one) samples another token than `reference_tokens` says,
at the first step that reads the wrong slot, whatever the wrong content is:
the fast tier's oracle for "greedy output equals an undisturbed run" is a
function, not a second run.

The executor keeps that KV cache in Python lists and answers the executor
contract (raylm.executor.abstract) as the real workers do, the calls a
migration makes included: a transfer "file" is a real file in the
supervisor's folder, holding the slots of the blocks exported. A copy beside
the steps (a background export's filling, a background import's reading)
happens when the harness says so (`SimKVCopies.progress`), so that the
schedule decides what runs between a stage's start and its end. Faults are
injected by the harness: the next step raises as a dead, hung or failing
worker would, and a request whose prompt holds `POISON_TOKEN` kills its
worker in every step it is in (a poison request).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from raylm.executor.abstract import Executor
from raylm.executor.errors import ExecutorFailedError, WorkerDiedError, WorkerHungError
from raylm.messages import KVCacheConfig, ModelRunnerOutput, SchedulerOutput

# A prompt holding this token kills the worker in each step it is in.
POISON_TOKEN = 3
# Tokens the model samples: [FIRST_SAMPLED, vocab); never the poison.
FIRST_SAMPLED = 16
# A slot no step or import wrote.
_UNWRITTEN = (-1, -1)


# A LoRA adapter's part in the K/V: a slot a request with adapter `k`
# computed holds (token + k * ADAPTER_STRIDE, position), so a request that
# reads a block another adapter (or the base model, k = 0) computed samples
# another token than its reference, as a real model would.
ADAPTER_STRIDE = 1 << 20


def adapter_key(lora_request) -> int:
    """The content model's number for a request's adapter (0: none), from
    its content digest: what the prefix cache keys its blocks by."""
    return 0 if lora_request is None else int(lora_request.content_digest[:6], 16) + 1


def next_token(slots: list[tuple[int, int]], vocab_size: int) -> int:
    """The token sampled after a context whose K/V slots hold `slots`
    ((token, position) each, in position order)."""
    flat = [x for slot in slots for x in slot]
    digest = hashlib.blake2b(struct.pack(f"<{len(flat)}q", *flat), digest_size=8).digest()
    return FIRST_SAMPLED + int.from_bytes(digest, "little") % (vocab_size - FIRST_SAMPLED)


def reference_tokens(prompt: list[int], num_tokens: int, vocab_size: int, adapter: int = 0) -> list[int]:
    """What an undisturbed run samples after `prompt` (with the adapter
    numbered `adapter`, adapter_key): every slot right."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(reference_slots(tokens, adapter), vocab_size))
    return tokens[len(prompt) :]


def reference_slots(tokens: list[int], adapter: int = 0, start: int = 0) -> list[tuple[int, int]]:
    """The slots of `tokens[start:]` as a run with the adapter computes them."""
    return [(tokens[p] + adapter * ADAPTER_STRIDE, p) for p in range(start, len(tokens))]


@dataclass
class _RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    adapter: int = 0  # adapter_key of its LoRA adapter


@dataclass
class _Copy:
    """A background copy waiting for the harness: an export filling its file,
    or an import reading one into blocks."""

    kind: str  # "export" or "import"
    path: str
    block_ids: list[int]
    name: str = ""  # an import's name (kv_copies_done's key)
    cancelled: bool = False


@dataclass
class SimKVCopies:
    """One executor's copies beside the steps, and the imports that ended."""

    pending: list[_Copy] = field(default_factory=list)
    finished: dict[str, list] = field(default_factory=dict)  # name -> [ok, bytes or error]


class ContentModelExecutor(Executor):
    """One rank running the content model in the engine core's process.
    `faults` is the harness's: a list of pending fault kinds ("died", "hung",
    "raise") the next steps raise, shared with the core's later executors."""

    workers_die_apart = False

    def __init__(
        self,
        config,
        num_blocks: int,
        faults: list[str],
        on_step: Callable[[], None] | None = None,
        transfer_faults: list[str] | None = None,
    ):
        self._num_blocks = num_blocks
        self.faults = faults
        # The harness's too: the next imports fail ("import"), or the next
        # final stages ("final"), as a stage whose file or frames cannot be
        # read does. No worker dies of it.
        self.transfer_faults = transfer_faults if transfer_faults is not None else []
        self.on_step = on_step
        super().__init__(config)

    def _init_executor(self) -> None:
        # Each step's tokens come back to the scheduler before the next step
        # (a decode burst would feed them back inside the worker).
        if self.config.scheduler_config.num_scheduler_steps != 1:
            raise ValueError(
                "the content model runs single steps: num_scheduler_steps must be 1, got "
                f"{self.config.scheduler_config.num_scheduler_steps}"
            )
        self.block_size = self.config.cache_config.block_size
        self.vocab_size = self.config.model_config.vocab_size
        self.kv: list[list[tuple[int, int]]] = []
        self.requests: dict[str, _RequestState] = {}
        self.copies = SimKVCopies()
        self._sampled: ModelRunnerOutput | None = None
        self.closed = False

    # ---- the executor contract ------------------------------------------------------

    def determine_available_memory(self) -> list[int]:
        return [self._num_blocks]

    def get_kv_cache_bytes_per_block(self) -> list[int]:
        return [1]

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv = [[_UNWRITTEN] * kv_cache_config.block_size for _ in range(kv_cache_config.num_blocks)]

    def check_health(self) -> None:
        if self.faults and self.faults[0] == "died":
            self.faults.pop(0)
            raise WorkerDiedError("chaos: worker 0 was killed")

    def shutdown(self) -> None:
        self.closed = True
        self.copies.pending.clear()  # a dead worker's copy threads die with it

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
        if self.on_step is not None:
            self.on_step()
        if self.faults:
            fault = self.faults.pop(0)
            if fault == "died":
                raise WorkerDiedError("chaos: worker 0 was killed")
            if fault == "hung":
                raise WorkerHungError("chaos: worker 0 did not answer the step")
            raise ExecutorFailedError("chaos: the step raised")
        self._update_states(scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            if POISON_TOKEN in self.requests[rid].token_ids:
                raise WorkerDiedError(f"chaos: poison request {rid} killed worker 0")
        self._sampled = self._forward(scheduler_output)
        done: Future = Future()
        done.set_result(None)
        return done if non_block else None

    def sample_tokens(self, grammar_output, non_block: bool = False):
        output, self._sampled = self._sampled, None
        if not non_block:
            return output
        done: Future = Future()
        done.set_result(output)
        return done

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        # One rank, in this process: the executor is its own worker (a
        # callable gets it, as the uni backend passes its worker).
        call = (lambda *a, **k: method(self, *a, **k)) if callable(method) else getattr(self, f"_rpc_{method}")
        reply = call(*args, **(kwargs or {}))
        return reply if unique_reply_rank is not None else [reply]

    # ---- a step ----------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        """What the real workers keep of each request (ModelRunner._update_states)."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _RequestState(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                adapter_key(new.lora_request),
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _forward(self, so: SchedulerOutput) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        bs = self.block_size
        for rid, n in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            end = state.num_computed_tokens + n
            for pos in range(state.num_computed_tokens, end):
                slot = (state.token_ids[pos] + state.adapter * ADAPTER_STRIDE, pos)
                self.kv[state.block_ids[pos // bs]][pos % bs] = slot
            req_ids.append(rid)
            if end < len(state.token_ids):  # a prefill chunk that samples nothing
                sampled.append([])
                continue
            slots = [self.kv[state.block_ids[pos // bs]][pos % bs] for pos in range(end)]
            sampled.append([next_token(slots, self.vocab_size)])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    # ---- the K/V of a migration (the real worker's calls, with files of slots) ---------------
    # The worker's transfer methods (raylm.kv_transfer.transport); every
    # route goes through files of slots here (the supervisor's harness puts
    # its cores on one node). The files' export and import are methods of
    # their own (`_rpc_export_kv`, `_rpc_import_kv`), which the chaos tests
    # replace to make a transfer fail.

    def _rpc_torch_threads(self) -> int:
        return 0  # no forward pass runs here: unknown, as the stats say

    def _rpc_kv_export(self, route: dict, block_ids: list[int], background: bool = False) -> list:
        return [self._rpc_export_kv(route["path_prefix"], block_ids, background), None]

    def _rpc_kv_import(self, route: dict, block_ids: list[int], background: bool = False):
        return self._rpc_import_kv(route["path_prefix"], block_ids, background)

    def _rpc_kv_take_copy_cpu(self) -> float:
        return 0.0  # the content model's copies are not timed

    def _rpc_export_kv(self, path_prefix: str, block_ids: list[int], background: bool = False) -> int:
        path = f"{path_prefix}.rank0"
        if not background:
            _write_slots(path, [self.kv[b] for b in block_ids])
            return len(block_ids)
        _write_slots(path, None)  # created now, filled beside the steps
        self.copies.pending.append(_Copy("export", path, list(block_ids)))
        return len(block_ids)

    def _rpc_import_kv(self, path_prefix: str, block_ids: list[int], background: bool = False):
        path = f"{path_prefix}.rank0"
        if not background:  # the final stage (stop-and-copy): a fault armed for it strikes here
            return self._read_into(path, block_ids, final=True)
        self.copies.pending.append(_Copy("import", path, list(block_ids), name=os.path.basename(path_prefix)))
        return None

    def _rpc_kv_copies_done(self, names: list[str]) -> dict:
        return {name: self.copies.finished.pop(name) for name in names if name in self.copies.finished}

    def _rpc_kv_cancel(self, names: list[str]) -> None:
        for copy in self.copies.pending:
            if copy.kind == "import" and copy.name in names:
                copy.cancelled = True

    def _rpc_kv_withdraw(self, route: dict, prefix: str) -> int:
        return 0  # the content model offers nothing on the network

    def _rpc_check_health(self) -> None:
        self.check_health()

    def progress(self, which: int) -> bool:
        """Run pending copy `which` (modulo their count) to its end, as its
        thread would; False when none is pending."""
        if not self.copies.pending:
            return False
        copy = self.copies.pending.pop(which % len(self.copies.pending))
        if copy.kind == "export":
            if os.path.exists(copy.path):  # the real filling opens the file its stage made, never a new one
                _write_slots(copy.path, [self.kv[b] for b in copy.block_ids])
            return True
        if copy.cancelled:
            self.copies.finished[copy.name] = [False, "cancelled"]
            return True
        try:
            self.copies.finished[copy.name] = [True, self._read_into(copy.path, copy.block_ids)]
        except (OSError, ValueError) as e:
            self.copies.finished[copy.name] = [False, f"{type(e).__name__}: {e}"]
        return True

    def _read_into(self, path: str, block_ids: list[int], final: bool = False) -> int:
        # "import": the next import fails, whatever its stage; "final": the
        # next final stage's (a fault that waits for the hand-over).
        for kind in ("import", "final") if final else ("import",):
            if kind in self.transfer_faults:
                self.transfer_faults.remove(kind)
                raise ValueError(f"chaos: {path} could not be read")
        slots = _read_slots(path)
        if slots is None:
            raise ValueError(f"{path} was never filled (its source's copy died)")
        if len(slots) != len(block_ids):
            raise ValueError(f"{path} holds {len(slots)} blocks, {len(block_ids)} were reserved")
        for block_id, block in zip(block_ids, slots):
            self.kv[block_id] = [tuple(slot) for slot in block]
        return len(block_ids)

    # ---- the tier of evicted blocks (the real rank: raylm.kv_transfer.host_tier) -------------
    # One file of slots per core ({slot: [hash hex, its block's slots]}), in
    # the supervisor's folder as the real ranks' are. A dead worker leaves
    # its file (the real one cannot unlink it either): its core's rebuild,
    # or its supervisor, removes it.

    def _rpc_kv_tier_slots(self, budget_bytes: int) -> int:
        return budget_bytes  # a block is one "byte" here (get_kv_cache_bytes_per_block)

    def _rpc_kv_tier_open(self, prefix: str, num_slots: int) -> None:
        self._tier_path = f"{prefix}.rank0"
        with open(self._tier_path, "x") as f:
            json.dump({}, f)

    def _rpc_kv_tier_copy(self, stores: list, loads: list) -> None:
        with open(self._tier_path) as f:
            tier = json.load(f)
        for block_id, slot, block_hash in stores:
            tier[str(slot)] = [block_hash.hex(), self.kv[block_id]]
        with open(self._tier_path, "w") as f:
            json.dump(tier, f)
        for slot, block_id, block_hash in loads:
            held = tier.get(str(slot))
            if held is None or held[0] != block_hash.hex():
                raise RuntimeError("a K/V tier slot this core reads does not hold the block it wrote there")
            self.kv[block_id] = [tuple(x) for x in held[1]]

    def _rpc_kv_tier_read(self, prefix: str, slots: list, hashes: list, block_ids: list) -> int:
        try:
            with open(f"{prefix}.rank0") as f:
                tier = json.load(f)
        except OSError:
            return 0
        for n, (slot, block_hash, block_id) in enumerate(zip(slots, hashes, block_ids)):
            held = tier.get(str(slot))
            if held is None or held[0] != block_hash.hex():
                return n
            self.kv[block_id] = [tuple(x) for x in held[1]]
        return len(slots)

    def tier_slots(self) -> dict[int, tuple[bytes, list]]:
        """slot -> (the hash written with it, the block's slots), for the harness's checks."""
        path = getattr(self, "_tier_path", None)
        if path is None or not os.path.exists(path):
            return {}
        with open(path) as f:
            return {int(s): (bytes.fromhex(h), [tuple(x) for x in b]) for s, (h, b) in json.load(f).items()}


def _write_slots(path: str, blocks: list | None) -> None:
    with open(path, "w") as f:
        json.dump(blocks, f)


def _read_slots(path: str) -> list | None:
    with open(path) as f:
        return json.load(f)
