"""The chaos harness's fast tier: the real supervisor (EngineCoreSupervisor)
and real engine cores (EngineCore: scheduler, KV-cache manager, migration
endpoint, recovery), each core's loop turned by the harness, on a clock the
harness owns, with the content model (content_model.py) for a model: a
World, which runs them on a simulated host (sim_host.py: the clock, sockets,
processes and threads) and checks what came out.

Nothing runs by itself: no socket, thread, sleep or housekeeping timer. A
core's loop turns when the schedule says (`turn`), the supervisor reads when
it says (`read`), the clock moves when it says (`advance`), a replacement
core starts when it says (`run_background`), a copy beside the steps ends
when it says (`progress`). So a schedule replays exactly from its seed, and
Hypothesis can shrink it. What this tier does not have: the processes and
sockets themselves (a kill is a core that stops answering and a death the
launcher reports), the network, and timing inside a step; the real-engine
tier (tests/chaos/test_real_engine.py) replays schedules against those.
"""

from __future__ import annotations

import collections
import hashlib
import os
from dataclasses import dataclass, field

from raylm.config import EngineConfig, create_engine_config
from raylm.core.kv_cache_manager import hash_block, root_hash
from raylm.engine.core_tier import TIER_LOCK
from raylm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from raylm.engine.role_autoscaler import scale_steps
from raylm.lora.request import LoRARequest
from raylm.sampling_params import SamplingParams
from raylm.testing.chaos.content_model import adapter_key, reference_slots, reference_tokens
from raylm.testing.chaos.sim_host import ChaosSupervisor, Frame, SimCoreProc, SimHost

# Prefix pulls' outcomes over the schedules run in this process (the tests
# report them: a tier in which no pull happens would test none).
PULL_OUTCOMES: collections.Counter[str] = collections.Counter()
# The same for the tiers of evicted blocks: blocks stored, tokens the cores
# found there themselves, loads the supervisor sent.
TIER_LOADS: collections.Counter[str] = collections.Counter()
# The same for P/D hand-offs (raylm.engine.handoff).
HANDOFF_OUTCOMES: collections.Counter[str] = collections.Counter()
# The same for the router's reasons (raylm.engine.routing.ROUTING_REASONS):
# "adapter", a request sent to the core holding its LoRA adapter.
ROUTING_DECISIONS: collections.Counter[str] = collections.Counter()
# Per-role autoscaling decisions applied (`World.apply_roles`), by which pool grew or shrank.
ROLE_SCALES: collections.Counter[str] = collections.Counter()


def chaos_config(**overrides) -> EngineConfig:
    """The engine the fast tier runs: the embedded default model's config
    (its weights are never loaded), small blocks and a small cache, so that
    a few short requests span several blocks, stages and a full cache."""
    settings = dict(
        dtype="float32",
        data_parallel_size=2,
        block_size=4,
        max_model_len=64,
        num_scheduler_steps=1,
        data_parallel_rebalance=True,
        max_num_seqs=8,
    )
    settings.update(overrides)
    return create_engine_config(None, **settings)


# ---- the world ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the front end (the harness) received for one request."""

    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    aborted: bool = False
    poisoned: bool = False
    lora_request: LoRARequest | None = None

    @property
    def adapter(self) -> int:
        return adapter_key(self.lora_request)


class World(SimHost):
    """One engine under the harness: a supervisor, its cores, the clock (the
    host they run on, sim_host.py) and what the front end received."""

    def __init__(self, config: EngineConfig | None = None, num_blocks: int = 40):
        super().__init__(config or chaos_config(), num_blocks)
        self.outcomes: dict[str, Outcome] = {}
        self.scale_ups: list = []  # supervisor.ScaleUp, started by `finish_scale`
        self.roles_after: dict[int, int] = {}  # id of a scale-up -> the prefill pool to set once it served
        self.log: list[str] = []  # what the schedule did, for a failure's report
        self._undo_clock = self.clock.install()
        try:
            self.sup = ChaosSupervisor(self.config, self)
            self.set_clock_of(self.sup)
        except BaseException:
            self._undo_clock()
            raise

    def close(self) -> None:
        try:
            self.sup.shutdown()
        finally:
            for proc in self.procs:
                proc.kill()
            self._undo_clock()

    # ---- the front end's side ----------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        poisoned: bool = False,
        rank: int | None = None,
        adapter: str | None = None,
    ) -> None:
        """`rank`: the core it must go to (ValueError, and nothing sent, if
        that one does not serve). `adapter`: the name of the LoRA adapter it
        runs with (its K/V and tokens are the adapter's: content_model.py)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        params.all_stop_token_ids = set()
        lora = None if adapter is None else sim_adapter(adapter)
        request = EngineCoreRequest(request_id, list(prompt), params, None, self.clock.now, lora_request=lora)
        self.sup.add_request(request, data_parallel_rank=rank)
        self.outcomes[request_id] = Outcome(list(prompt), max_tokens, poisoned=poisoned, lora_request=lora)

    def abort(self, request_id: str) -> None:
        outcome = self.outcomes[request_id]
        if not outcome.finished:
            outcome.aborted = True
            outcome.finished = True
            self.sup.abort_requests([request_id])

    def read(self, max_frames: int = 1000) -> None:
        """The front end's read: housekeeping, then up to `max_frames` messages."""
        self._deliver(self.sup._housekeeping_and_pending())
        for _ in range(max_frames):
            if not self.inbox:
                return
            self._deliver(self.sup._receive(Frame(self.inbox.popleft())))

    def _deliver(self, outputs: EngineCoreOutputs | None) -> None:
        if outputs is None:
            return
        for out in outputs.outputs:
            outcome = self.outcomes[out.request_id]
            if outcome.aborted:
                continue
            outcome.tokens.extend(out.new_token_ids)
            if out.finished:
                outcome.finished = True
                outcome.error = out.error if out.finish_reason == "error" else None

    # ---- the schedule's operations ----------------------------------------------------------

    def turn(self, index: int) -> bool:
        proc = self.cores.get(index)
        return proc is not None and proc.turn()

    def kill(self, index: int, report: bool = True) -> None:
        proc = self.cores.get(index)
        if proc is None or not proc.alive:
            return
        proc.kill()
        if report:
            self.deaths.append((index, "chaos: killed (SIGKILL)"))

    def run_background(self, which: int = 0) -> bool:
        """Run one background task that is due (the clock moves to it)."""
        if not self.background:
            return False
        task = self.background.pop(which % len(self.background))
        self.clock.now = max(self.clock.now, task.due)
        task.run()
        return True

    def progress(self, index: int, which: int = 0) -> bool:
        proc = self.cores.get(index)
        if proc is None or not proc.alive or proc.frozen:
            return False
        return proc.core.executor.progress(which)

    def set_roles(self, prefill_replicas: int) -> None:
        """P/D roles from now on (0: none): the first `prefill_replicas`
        replicas prefill and hand each request to a decode one at its first
        token (raylm.engine.handoff), whatever is under way."""
        self.sup.handoffs.prefill_replicas = prefill_replicas

    def apply_roles(self, size: int, prefill_replicas: int) -> None:
        """A per-role autoscaling decision (raylm.engine.role_autoscaler), in
        its order: a smaller prefill pool now, then the scale; a larger one
        once the scale-up's cores serve (`finish_scale`), as
        AsyncLLM.scale_roles does. ValueError if refused."""
        current = self.sup.handoffs.prefill_replicas
        ROLE_SCALES[
            "prefill " + ("up" if prefill_replicas > current else "down" if prefill_replicas < current else "kept")
        ] += 1
        if scale_steps(current, prefill_replicas)[0] == "roles":
            self.sup.set_prefill_replicas(prefill_replicas)
            self.begin_scale(size)
            return
        scale_up = self.sup.begin_scale(size)
        if scale_up is None:
            self.sup.set_prefill_replicas(prefill_replicas)
            return
        self.scale_ups.append(scale_up)
        self.roles_after[id(scale_up)] = prefill_replicas

    def begin_scale(self, size: int) -> None:
        scale_up = self.sup.begin_scale(size)
        if scale_up is not None:
            self.scale_ups.append(scale_up)

    def finish_scale(self) -> bool:
        """The oldest scale-up's cores have loaded (or failed to)."""
        if not self.scale_ups:
            return False
        scale_up = self.scale_ups.pop(0)
        started = False
        try:
            self.sup.start_scaled(scale_up)
            started = True
        except RuntimeError:
            pass  # a start the schedule made fail: the scale-up changes nothing
        finally:
            self.sup.end_scale(scale_up, started)
        prefill_replicas = self.roles_after.pop(id(scale_up), None)
        if started and prefill_replicas is not None:
            try:
                self.sup.set_prefill_replicas(prefill_replicas)
            except ValueError:
                pass  # the replicas changed meanwhile (a failure, another scale): left as they are
        return True

    # ---- the end of a schedule --------------------------------------------------------

    def drain(self, max_rounds: int = 400) -> None:
        """No more faults: run until every request has ended (or the engine
        died, or `max_rounds` passed: a hang)."""
        for proc in self.cores.values():
            proc.frozen = False
            proc.core.faults.clear()
            proc.core.transfer_faults.clear()
        for _ in range(max_rounds):
            while self.scale_ups:
                self.finish_scale()
            while self.background:
                self.run_background()
            for index in list(self.cores):
                while self.progress(index):
                    pass
                self.turn(index)
            self.read()
            if self._quiet():
                return
            self.clock.now += 0.05
        raise AssertionError(
            f"requests never ended (hung): "
            f"{[rid for rid, o in self.outcomes.items() if not o.finished]}; "
            f"ledger {sorted(self.sup.ledger)}, migrations {list(self.sup.migrations.values())}"
        )

    def _quiet(self) -> bool:
        """Every request ended, and nothing is left to do anywhere."""
        if not all(o.finished for o in self.outcomes.values()) or self.sup.ledger or self.sup.migrations:
            return False
        if self.inbox or self.background or self.scale_ups:
            return False
        recovery, scaling = self.sup.recovery, self.sup.scaling
        # A restart, a replacement or a drained core's stop still under way.
        if (
            self.sup.restarting
            or recovery.starting
            or scaling.stopping
            or not recovery.started.empty()
            or not scaling.stopped.empty()
        ):
            return False
        # A draining core whose last request ended in the read just done: the
        # next housekeeping retires it (a server's next read would).
        if any(channel.draining for channel in self.sup.channels.values()):
            return False
        for proc in self.cores.values():
            if proc.input.frames or proc._has_work() or proc.core.migrations.copying:
                return False
            if proc.core.executor.copies.pending:
                return False
        return True

    def check(self) -> None:
        """The invariants of a drained schedule (AssertionError naming the first broken)."""
        vocab = self.config.model_config.vocab_size
        for rid, outcome in self.outcomes.items():
            expected = reference_tokens(outcome.prompt, outcome.max_tokens, vocab, outcome.adapter)
            assert outcome.finished, f"{rid} never ended"
            if outcome.poisoned and not outcome.aborted:
                assert outcome.error is not None, f"poison request {rid} ended without an error: {outcome}"
                continue
            if outcome.poisoned:
                continue
            assert outcome.error is None, f"innocent request {rid} failed (framed): {outcome.error}"
            if outcome.aborted:
                assert outcome.tokens == expected[: len(outcome.tokens)], f"aborted {rid} diverged: {outcome}"
            else:
                assert outcome.tokens == expected, (
                    f"request {rid} continued over K/V not its own: got "
                    f"{outcome.tokens}, an undisturbed run gives {expected}"
                )
        sup = self.sup
        assert sup.dead_error is None, f"the engine died: {sup.dead_error}"
        # Every replica settled: serving, or waiting for the restart budget;
        # no restart left open (it either served again or reported failure).
        states = {r["replica"]: r["state"] for r in sup.replica_states()}
        assert not sup.restarting and set(states.values()) <= {"serving", "waiting_for_restart_budget"}, (
            f"replicas not settled: {states}, restarting {sorted(sup.restarting)}"
        )
        assert not sup.ledger and not sup.migrations and not sup.migrations.by_request, "the supervisor kept requests"
        assert not len(sup.pulls), f"prefix pulls never ended: {sorted(sup.pulls._pulls)}"
        PULL_OUTCOMES.update(sup.pulls.counts)
        HANDOFF_OUTCOMES.update(sup.handoffs.counts)
        ROUTING_DECISIONS.update(sup.router.decisions)
        folder = sup.kv_routes.transfer_dir
        if folder is not None:
            # The serving cores' tiers of evicted blocks live there; nothing else may.
            prefixes = [self.cores[i].core.host_tier.prefix for i in sup.channels]
            tiers = {os.path.basename(p) for p in prefixes if p is not None}
            left = [f for f in os.listdir(folder) if f.rsplit(".", 1)[0] not in tiers and f != TIER_LOCK]
            assert left == [], f"transfer files left behind: {left}"
        hashes = self._expected_blocks()
        for index, proc in self.cores.items():
            self._check_core(index, proc, hashes)
        # The supervisor's prefix index (routing's) equals what each serving
        # core's prefix cache holds, however the cores came and went.
        for index in sup.channels:
            held = set(self.cores[index].core.scheduler.kv_cache_manager.pool.cached)
            indexed = sup.prefix_index.holds(index)
            assert indexed == held, (
                f"the prefix index has core {index} holding {len(indexed)} blocks, "
                f"{len(indexed - held)} of them not there, {len(held - indexed)} missing"
            )
        assert sup.prefix_index.num_blocks() == len(set().union(*(sup.prefix_index.holds(i) for i in sup.channels))), (
            "the prefix index names cores that do not serve"
        )
        for index in sup.channels:
            self._check_tier(index, self.cores[index], hashes)
        TIER_LOADS["loads"] += sup.tier_loads.counts["loads"]
        for proc in self.cores.values():
            kv = proc.core.scheduler.kv_cache_manager
            if kv.tier is not None:
                TIER_LOADS["stored"] += kv.tier.stored_blocks
                TIER_LOADS["own_hits"] += kv.tier.loaded_blocks

    def _check_tier(self, index: int, proc: SimCoreProc, hashes: dict[bytes, list]) -> None:
        """Every slot a core's tier of evicted blocks names holds the block its
        hash names, and the supervisor's index knows the tier as it is."""
        tier = proc.core.scheduler.kv_cache_manager.tier
        entries = tier.entries() if tier is not None else {}
        slots = proc.core.executor.tier_slots()
        for block_hash, slot in entries.items():
            written = slots.get(slot)
            assert written is not None and written[0] == block_hash, f"core {index}: tier slot {slot} never written"
            assert written[1] == hashes.get(block_hash), (
                f"core {index}: tier slot {slot} holds {written[1]}, its hash names {hashes.get(block_hash)}"
            )
        assert self.sup.prefix_index.tier_entries(index) == entries, f"the prefix index has core {index}'s tier wrong"

    def _check_core(self, index: int, proc: SimCoreProc, hashes: dict[bytes, list]) -> None:
        core = proc.core
        scheduler = core.scheduler
        assert not scheduler.requests and not scheduler.paused, f"core {index} kept {list(scheduler.requests)}"
        kv = scheduler.kv_cache_manager
        assert not kv.req_blocks and not kv.imports, f"core {index} kept blocks of {list(kv.req_blocks)} {kv.imports}"
        assert kv.pool.num_free_blocks == kv.num_blocks, f"core {index} leaked blocks"
        endpoint = core.migrations
        assert not (endpoint._outgoing or endpoint._incoming or endpoint._importing), (
            f"core {index} kept migrations: {endpoint._outgoing} {endpoint._incoming} {endpoint._importing}"
        )
        executor = core.executor
        for block_hash, block in kv.pool.cached.items():
            expected = hashes.get(block_hash)
            assert expected is not None, f"core {index}: a cached block under a hash no request's tokens name"
            actual = [tuple(slot) for slot in executor.kv[block.block_id]]
            assert actual == expected, (
                f"core {index}: prefix-cache block {block.block_id} holds {actual}, its hash names {expected}"
            )

    def _expected_blocks(self) -> dict[bytes, list]:
        """hash -> the slots its block must hold, for every full block of
        every request's tokens (an undisturbed run's)."""
        vocab, bs = self.config.model_config.vocab_size, self.config.cache_config.block_size
        table = {}
        for outcome in self.outcomes.values():
            tokens = outcome.prompt + reference_tokens(outcome.prompt, outcome.max_tokens, vocab, outcome.adapter)
            parent = root_hash(None, outcome.lora_request and outcome.lora_request.content_digest)
            for start in range(0, len(tokens) - bs + 1, bs):
                parent = hash_block(parent, tokens[start : start + bs])
                table[parent] = reference_slots(tokens[: start + bs], outcome.adapter, start)
        return table

    def prefixes_hold(self) -> None:
        """Mid-schedule: what every stream received so far is its reference's beginning."""
        vocab = self.config.model_config.vocab_size
        for rid, outcome in self.outcomes.items():
            if outcome.poisoned or not outcome.tokens:
                continue
            expected = reference_tokens(outcome.prompt, len(outcome.tokens), vocab, outcome.adapter)
            assert outcome.tokens == expected, (
                f"request {rid} continued over K/V not its own at token {_first_difference(outcome.tokens, expected)}"
            )


def sim_adapter(name: str) -> LoRARequest:
    """A LoRA adapter of the fast tier: no files (the content model runs it),
    its digest made from its name, as the engine stamps one at intake."""
    digest = hashlib.sha256(f"chaos adapter {name}".encode()).hexdigest()
    return LoRARequest(name, 1 + int(digest[:4], 16), "/chaos-adapters/" + name, content_digest=digest)


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
