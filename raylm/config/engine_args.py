"""EngineArgs: every engine setting, declared once.

Each field is one setting: its type (the annotation), its default, and in its
metadata the flag (named after the field, vLLM's spelling, plus vLLM's short
form where it has one), the help text, the value parser and the help section.
`add_cli_args` makes the `raylm` flags from that, `from_cli_args` reads them
back, `raylm.LLM(**settings)` and `create_engine_config(**settings)` take the
same names as keywords, and `resolve_engine_config` (resolve.py) resolves
a whole EngineArgs into the EngineConfig (engine_config.py, whose parts check
the settings) that every process gets. A new setting is one new field here and its use there.

It lives beside EngineConfig rather than in raylm/engine/ (where vLLM's
`EngineArgs` lives, and where `raylm.engine.arg_utils` re-exports it) because
`raylm.config.create_engine_config(model, **settings)` needs the defaults, and
the config layer may not import the engine layer above it.
"""

from __future__ import annotations

import argparse
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

from raylm.config.engine_config import EngineConfig
from raylm.config.resolve import resolve_engine_config

PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")

# ---- value parsers of the flags ---------------------------------------------------------

_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `4G`, `1.5GB` -> bytes (units are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512MiB, 4G)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def human_readable_int(text: str) -> int:
    """vLLM's spelling of token counts: `4096`, `4k` (4000), `25.6k` (25600),
    `32K` (32768): a lowercase suffix is a power of 1000, an uppercase one a
    power of 1024 (whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 4k, 32K)")
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        hint = f"; did you mean {number}{suffix.lower()}?" if suffix else ""
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}{hint}")
    return int(number) * _BINARY_SUFFIXES.get(suffix, 1)


def max_model_len_arg(text: str) -> int | None:
    """--max-model-len: a token count, or auto (-1 too) for the model's own."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


# ---- how a setting is declared ------------------------------------------------------------

_FLAG = "raylm_flag"
_NO_FLAG = "raylm_no_flag"


@dataclass(frozen=True)
class Flag:
    """How one setting appears on the command line: `--NAME` (the field's
    name, dashed), and `short` too where vLLM has one. A switch (a bool) that
    is on by default also gets `--no-NAME`."""

    help: str
    section: str
    short: str | None = None
    # Turns the text into the value; None: the annotation's int, float or str.
    parser: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    def option_strings(self, name: str) -> list[str]:
        return [s for s in (self.short, "--" + name.replace("_", "-")) if s]


def _setting(default: Any, help: str, *, section: str, **flag: Any) -> Any:
    return field(default=default, metadata={_FLAG: Flag(help=help, section=section, **flag)})


def _program_only(default: Any, why: str) -> Any:
    """A setting no flag can carry (the test suite checks that this stays the
    only kind without a flag, and that each says why)."""
    return field(default=default, metadata={_NO_FLAG: why})


_model = partial(_setting, section="model")
_parallel = partial(_setting, section="parallelism")
_cache = partial(_setting, section="KV cache and scheduling")
_device = partial(_setting, section="device")
_faults = partial(_setting, section="failures and recovery")
_autoscale = partial(_setting, section="autoscaling (Ray Serve's names)")
_speculative = partial(_setting, section="speculative decoding")
_lora = partial(_setting, section="LoRA adapters")


@dataclass
class EngineArgs:
    """The engine's settings as given (by a program or by flags); unset ones
    (None) are decided by `create_engine_config` from the model and device."""

    model: str | None = _model(
        None,
        "Hugging Face model folder (config.json, *.safetensors, tokenizer) or Hub id (org/name, downloaded "
        "into the Hugging Face cache; HF_HUB_OFFLINE=1 uses the cache only); default: the small model embedded "
        "in raylm",
        metavar="PATH|ID",
    )
    tokenizer: str | None = _model(None, "tokenizer folder or Hub id, if not the model's", metavar="PATH|ID")
    revision: str | None = _model(None, "branch, tag or commit of a Hub model; default: main", metavar="REV")
    tokenizer_revision: str | None = _model(
        None, "branch, tag or commit of a Hub --tokenizer; default: main", metavar="REV"
    )
    download_dir: str | None = _model(
        None,
        "Hugging Face cache to download Hub models into; default: HF_HUB_CACHE, else HF_HOME/hub, else "
        "~/.cache/huggingface/hub",
        metavar="DIR",
    )
    generation_config: str = _model(
        "auto",
        "auto: the model's generation_config.json sets the default temperature, top_p, top_k, min_p "
        "and repetition_penalty of requests that leave them unset; vllm: ignore those; DIR: read "
        "generation_config.json from DIR",
        metavar="auto|vllm|DIR",
    )
    chat_template: str | None = _model(
        None,
        "Jinja chat template (a file, or the template itself) used instead of the tokenizer's by chat requests",
        metavar="FILE|TEMPLATE",
    )
    quantization: str | None = _model(
        None,
        "int8: quantize a float checkpoint's linear weights to int8 at load (one scale per output row); "
        "gguf: the model is a GGUF file (implied by one); default: none (the checkpoint's own types)",
        short="-q",
        metavar="METHOD",
    )
    gguf_file: str | None = _model(
        None,
        "with a Hub id as --model: the GGUF file of that repository to load (vLLM users may write "
        "org/name:Q4_K_M instead, which picks the repository's one file of that type)",
        metavar="NAME",
    )
    trust_remote_code: bool = _model(
        False, "accepted for vLLM compatibility; raylm runs no code from model repositories"
    )
    dtype: str = _model(
        "auto",
        "weight and activation dtype: auto (the checkpoint's; bfloat16 for float32 checkpoints on CUDA "
        "and for float16 on CPU), float32, bfloat16, float16",
    )
    max_model_len: int | None = _model(
        None,
        "longest sequence (prompt + output) in tokens, e.g. 4096, 4k (4000), 32K (32768); default (or "
        "auto): the model's max_position_embeddings",
        parser=max_model_len_arg,
        metavar="N",
    )
    seed: int = _model(0, "random seed of sampling (and of the random prompts in benchmarks)", metavar="N")

    tensor_parallel_size: int = _parallel(1, "split every layer across N workers", short="-tp", metavar="N")
    pipeline_parallel_size: int = _parallel(1, "split the layers into N consecutive stages", short="-pp", metavar="N")
    context_parallel_size: int = _parallel(
        1,
        "shard every sequence's KV cache across N workers (each holds 1/N of it; attention is merged exactly "
        "across them), so a CP group holds N times one worker's KV cache; with -tp, N x TP workers",
        short="-cp",
        metavar="N",
    )
    # A program may pass an Executor subclass instead of a name.
    distributed_executor_backend: str | type | None = _parallel(
        None,
        "how workers run: uni (in this process), mp (local processes), ray (Ray actors, local or on a "
        "cluster); default: uni for one worker, else mp",
        choices=EXECUTOR_BACKENDS,
    )
    data_parallel_size: int = _parallel(
        1,
        "N replicas of the whole engine (each with its own scheduler, KV cache and workers), requests "
        "routed to the least loaded",
        short="-dp",
        metavar="N",
    )
    data_parallel_backend: str = _parallel(
        "ray",
        "how data-parallel replicas run: ray (Ray actors, placed on the cluster's nodes, scalable at run "
        "time) or mp (engine-core processes on this machine)",
        choices=("ray", "mp"),
    )
    data_parallel_placement: str = _parallel(
        "pack", "replicas packed onto as few nodes as possible, or spread one per node", choices=("pack", "spread")
    )
    routing_policy: str = _parallel(
        "kv_aware",
        "how a new request picks its data-parallel replica: kv_aware (the least loaded, credited "
        "for the prompt prefix its cache holds, known exactly from the replicas' block events), load (the least "
        "loaded), or vllm (vLLM's 4 x waiting + running, for comparison)",
        choices=("kv_aware", "load", "vllm"),
    )
    prefix_pull: bool = _parallel(
        True,
        "when the replica routing chose holds less of a prompt's cached prefix than another one, copy the "
        "other's K/V blocks of it over (shared memory on one node, the sealed network across nodes) instead of "
        "computing them again",
    )
    prefill_replicas: int = _parallel(
        0,
        "prefill/decode disaggregation: the first P of the -dp replicas prefill new requests and hand each, "
        "with its first token sent, to the least loaded of the others, which decode (1 <= P < N; 0: every "
        "replica does both)",
        metavar="P",
    )
    pd_min_prompt_tokens: int | None = _parallel(
        None,
        "with --prefill-replicas: a prompt shorter than N tokens is prefilled and decoded on one decode "
        "replica, never handed off (conditional disaggregation); default: 256, at most a quarter of "
        "--max-model-len; 0: every prompt is handed off",
        metavar="N",
    )
    pd_handoff_queue: int = _parallel(
        8,
        "with --prefill-replicas: finished prefills that found no decode room wait (decoding where they are) "
        "in a queue of at most N per prefill replica, handed off as room appears; a prefill replica whose "
        "queue is full takes no new prompt until it drains (0: no queue, they decode where they are)",
        metavar="N",
    )
    data_parallel_rebalance: bool = _parallel(
        False, "move running requests live (KV cache and all) from a replica much busier than the least busy one"
    )
    ray_address: str | None = _parallel(
        None,
        "Ray cluster to join (e.g. auto or HOST:6379); default: RAY_ADDRESS, else a local Ray is started",
        metavar="ADDR",
    )
    ray_placement_strategy: str = _parallel(
        "PACK", "how Ray places the workers' bundles across nodes", choices=PLACEMENT_STRATEGIES
    )
    ray_placement_timeout: float = _parallel(
        60.0,
        "how long Ray may take to place the workers' (or a replica's) placement group before the start fails",
        metavar="SECONDS",
    )
    # "mq" by measurement: see ParallelConfig.ray_step_transport.
    ray_step_transport: str = _parallel(
        "mq",
        "how each step reaches Ray workers: mq (shared-memory/ZMQ message queues) or cgraph (a Ray Compiled Graph)",
        choices=("mq", "cgraph"),
    )
    placement_group: object | None = _program_only(
        None,
        "a live Ray placement group to run in: only a program holds one (raylm's own replicas hand "
        "theirs down this way)",
    )

    kv_cache_memory_bytes: int | None = _cache(
        None,
        "KV cache size per worker, e.g. 2GiB; default: sized from free device memory",
        parser=parse_bytes,
        metavar="BYTES",
    )
    kv_offloading_size: float | None = _cache(
        None,
        "GiB of host shared memory for the node's tier of evicted KV blocks: a block the prefix cache evicts "
        "is kept there, and a later prompt with its prefix loads it back instead of computing it (every "
        "replica on the node reads the node's tier; data-parallel replicas share the size out); default: off",
        parser=float,
        metavar="GiB",
    )
    kv_offloading_backend: str = _cache(
        "native", "where evicted KV blocks go with --kv-offloading-size: native (raylm's own tier)", choices=("native",)
    )
    block_size: int = _cache(16, "tokens per KV cache block", metavar="N")
    enable_prefix_caching: bool = _cache(True, "reuse the KV cache of shared prompt prefixes")
    gpu_memory_utilization: float | None = _cache(
        None,
        "fraction of the GPU's memory for this instance's weights, activations and KV cache (default "
        "0.9); GPUs only (on CPU see --kv-cache-memory-bytes)",
        metavar="FRACTION",
    )
    enforce_eager: bool = _cache(False, "accepted for vLLM compatibility; raylm always runs eagerly (no CUDA graphs)")
    max_num_seqs: int = _cache(256, "most requests in one batch", metavar="N")
    max_num_batched_tokens: int | None = _cache(
        None,
        "most tokens in one forward pass; default: 8192 (online on CPU: 2048 per rank), at least "
        "--max-num-seqs, and at least --max-model-len without chunked prefill",
        metavar="N",
    )
    enable_chunked_prefill: bool = _cache(
        True, "split long prompts across steps so that one prefill never exceeds --max-num-batched-tokens"
    )
    async_scheduling: bool = _cache(False, "schedule step N+1 while step N runs on the workers (needs -pp 1)")
    num_scheduler_steps: int | None = _cache(
        None,
        "most decode steps scheduled at once: while every running request decodes and none waits, the "
        "workers run up to N steps in a row, each step's tokens the next one's input, as many as take about 50 ms "
        "offline (10 ms serving); default 8 offline (LLM, generate, bench latency/throughput), 1 serving; 1 "
        "schedules every step (see docs/cpu.md, decode bursts)",
        metavar="N",
    )

    device: str | None = _device(None, "default: cuda when available, else cpu", choices=("cpu", "cuda"))
    num_threads: int | None = _device(
        None,
        "torch threads per worker on CPU; default: planned from the usable cores (one kept for the engine "
        "loop on small machines)",
        metavar="N",
    )
    prefill_num_threads: int | None = _device(
        None,
        "with --prefill-replicas: torch threads per worker of the prefill replicas (their ranks' layout stays "
        "the decode replicas'); default: --num-threads",
        metavar="N",
    )
    decode_num_threads: int | None = _device(
        None,
        "with --prefill-replicas: torch threads per worker of the decode replicas; default: --num-threads",
        metavar="N",
    )
    cpu_bind: str | None = _device(
        None,
        "CPU cores of each rank on a node: 'auto' (default; pins when a node runs several ranks), 'all' "
        "(no pinning), or one group per rank, e.g. '0-3|4-7'; VLLM_CPU_OMP_THREADS_BIND is read when unset",
        metavar="auto|all|GROUPS",
    )

    max_restarts: int = _faults(
        3,
        "executor (and engine-core) rebuilds allowed within --restart-window; one more and the engine is dead",
        metavar="N",
    )
    restart_window: float = _faults(600.0, "the window over which --max-restarts counts", metavar="SECONDS")
    execute_model_timeout: float = _faults(
        300.0, "a step that takes longer means a hung worker: the engine recovers", metavar="SECONDS"
    )
    autoscale: str | None = _autoscale(
        None,
        "scale the data-parallel replicas between MIN and MAX with the load (new ones warmed before they get "
        "traffic, removed ones leave by migrating their requests); starts with MIN unless --data-parallel-size "
        "says otherwise",
        metavar="MIN:MAX",
    )
    autoscale_target_ongoing_requests: float = _autoscale(
        2.0, "requests in flight per replica that the autoscaler aims for", metavar="N"
    )
    autoscale_upscale_delay: float = _autoscale(
        30.0, "how long the load must call for more replicas before they start", metavar="SECONDS"
    )
    autoscale_downscale_delay: float = _autoscale(
        600.0, "how long the load must call for fewer replicas before some leave", metavar="SECONDS"
    )
    autoscale_prefill: str | None = _autoscale(
        None,
        "with --autoscale and --prefill-replicas: the prefill pool's own bounds (default: 1 to MAX - 1)",
        metavar="MIN:MAX",
    )
    autoscale_decode: str | None = _autoscale(
        None,
        "with --autoscale and --prefill-replicas: the decode pool's own bounds (default: 1 to MAX - 1)",
        metavar="MIN:MAX",
    )
    engine_start_timeout: float = _faults(
        600.0,
        "an engine core (or a worker's start-up call) not ready by then is taken for hung: killed, and "
        "counted as a failed (re)start; /health answers 503 once a recovery has run this long",
        metavar="SECONDS",
    )
    health_check_interval: float = _faults(
        5.0, "how often an idle engine asks every worker for a sign of life", metavar="SECONDS"
    )
    health_check_timeout: float = _faults(
        30.0,
        "how long the workers may take to answer that call before they are taken for hung: the engine recovers",
        metavar="SECONDS",
    )
    # A dict from a program (LLM(speculative_config={...})), JSON text from the flag.
    speculative_config: dict | str | None = _speculative(
        None,
        'speculative decoding, vLLM\'s keys as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        "\"prompt_lookup_max\": 4}' (methods: ngram, the request's own tokens; suffix, earlier outputs of the "
        'same cache_salt; draft_model with "model", a smaller model of the same tokenizer): drafts '
        "verified in one forward, the output the same as without; it steps aside "
        "(decodes normally) where it cannot serve a request or the batch is large; default: off",
        parser=str,
        metavar="JSON",
    )
    enable_lora: bool = _lora(
        False, "serve LoRA adapters (PEFT format) beside the base model: a request names one (lora_request=)"
    )
    max_loras: int = _lora(1, "adapters in one step (each a slot of weights in every worker)", metavar="N")
    max_lora_rank: int = _lora(16, "the largest adapter rank accepted (sizes every slot)", metavar="R")
    max_cpu_loras: int | None = _lora(
        None,
        "adapters kept loaded in host memory, least recently used leaving first; default: max_loras",
        metavar="N",
    )

    # ---- command line

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add a flag for every setting, in its help section. A setting the
        parser already has a flag for (a command's own spelling, e.g. `raylm
        plan`'s shorter --ray-placement-timeout) keeps that flag."""
        taken = {action.dest for action in parser._actions}
        sections: dict[str, argparse._ArgumentGroup] = {}
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if _NO_FLAG in f.metadata or f.name in taken:
                continue
            if _FLAG not in f.metadata:
                raise TypeError(f"EngineArgs.{f.name} declares no flag: give it one (or say why it cannot have one)")
            flag: Flag = f.metadata[_FLAG]
            if flag.section not in sections:
                sections[flag.section] = parser.add_argument_group(flag.section)
            section = sections[flag.section]
            names = flag.option_strings(f.name)
            if hints[f.name] is bool:
                action = section.add_argument(
                    *names,
                    dest=f.name,
                    default=f.default,
                    action=argparse.BooleanOptionalAction if f.default else "store_true",
                )
                # Said in words (BooleanOptionalAction may append its own "(default: True)").
                action.help = flag.help + (" (on by default)" if f.default else "")
                continue
            section.add_argument(
                *names,
                dest=f.name,
                default=f.default,
                help=flag.help,
                metavar=flag.metavar,
                choices=flag.choices,
                type=flag.parser or _parser_of(hints[f.name]),
            )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The settings the parsed flags give; a setting the command has no
        flag for, or leaves at None, keeps EngineArgs' default."""
        given = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        return cls(**{name: value for name, value in given.items() if value is not None})

    # ---- programs

    def to_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `raylm.LLM` or `AsyncLLM.from_engine_args`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __post_init__(self):
        # A folder or file given as a pathlib.Path (LLM(model=Path(...))) reads as its string.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, os.PathLike):
                setattr(self, f.name, os.fspath(value))

    def create_engine_config(self, usage_context: str = "llm") -> EngineConfig:
        """Validated settings (a Hub model resolved to its local folder).
        `usage_context` is who runs the engine: "llm" (offline batches) or
        "api_server" (online streams); some defaults differ between them."""
        return resolve_engine_config(self, usage_context)

    @classmethod
    def flag_of(cls, name: str) -> Flag | None:
        """The flag of a setting (None for a program-only one)."""
        return next(f.metadata.get(_FLAG) for f in fields(cls) if f.name == name)


def _parser_of(annotation: Any) -> Callable[[str], Any]:
    """int, float or str from `int`, `float | None`, ...; str for anything else."""
    members = [a for a in typing.get_args(annotation) or (annotation,) if a is not type(None)]
    return members[0] if len(members) == 1 and members[0] in (int, float, str) else str


def create_engine_config(model: str | None = None, *, usage_context: str = "llm", **settings: Any) -> EngineConfig:
    """`EngineArgs(model, **settings).create_engine_config(usage_context)`:
    a setting not named keeps its default; an unknown name is a TypeError."""
    return EngineArgs(model=model, **settings).create_engine_config(usage_context)
