"""Structured outputs through the whole engine: every sampled output of a
constrained request follows its grammar, free requests beside them are
untouched, and grammar state survives async scheduling, preemption, an
executor rebuilt after a failure, a request resumed elsewhere, and TP or PP
on worker processes.

The tiny models have random weights, so the grammars are chosen bounded
(strings of at most 8 characters, numbers of at most 3 digits): every
sample must end with "stop" well within max_tokens. Any JSON object is not
bounded, and a random model almost never closes a string, so that kind runs
on a model that favours JSON's closing characters (see _closer_loving_model).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import jsonschema
import pytest
import xgrammar as xgr
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from raylm import LLM, SamplingParams
from raylm.engine.protocol import EngineCoreRequest
from raylm.executor.errors import WorkerDiedError
from raylm.sampling_params import StructuredOutputsParams

NUM_SAMPLES = 50
MAX_TOKENS = 96

SCHEMA = {
    "type": "object",
    "properties": {
        # Not maxLength: xgrammar 0.2.9 lets such strings hold raw control characters.
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,6}@[a-z]{1,5}\.(com|org)"
CHOICES = ["red", "green", "blue", 'say "hi"']
# Bounded arithmetic: at most 4 numbers of at most 3 digits.
EBNF = 'root ::= "(" num (op num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}\nop ::= " + " | " * "'
EBNF_AS_REGEX = r"\([1-9][0-9]{0,2}( [+*] [1-9][0-9]{0,2}){0,3}\)"

KINDS = {
    # Any whitespace lets a random model wander through long runs of it.
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    # One space between tokens (as xgrammar's compact separators ", " and ": " gave): the closer-loving model
    # ends its objects within max_tokens; with no blank at all its tokens wander on.
    "json_object": StructuredOutputsParams(json_object=True, whitespace_pattern=" "),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=EBNF),
}


def _engine(model: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 32 << 20)
    kwargs.setdefault("max_model_len", 256)
    return LLM(model, dtype="float32", **kwargs)


def _bytes_per_block(model: str) -> int:
    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # K and V, 16 tokens, fp32, every layer.
    return 2 * 16 * config["num_key_value_heads"] * head_dim * 4 * config["num_hidden_layers"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model):
    with _engine(model) as engine:
        yield engine


def _closer_loving_model(source: str, dest: pathlib.Path) -> str:
    """A copy of a tiny untied model whose next-token logits ignore the
    context: a fixed bias of +4 for every token holding '"', '}' or ']'.
    Residual coordinate 0 carries a large constant that no layer writes, and
    the final norm keeps only it, so the last hidden state is the same at
    every position; the LM head turns it into the bias."""
    shutil.copytree(source, dest)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    (path,) = dest.glob("*.safetensors")
    weights = load_file(path)
    weights["model.embed_tokens.weight"][:, 0] = 1000.0
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[0] = 0.0
    weights["model.norm.weight"].zero_()[0] = 1.0
    hidden = weights["model.norm.weight"].numel()
    head = weights["lm_head.weight"].zero_()
    for token_id in range(len(tokenizer)):
        if any(c in tokenizer.decode([token_id]) for c in '"}]'):
            head[token_id, 0] = 4.0 / hidden**0.5  # the normed constant is sqrt(hidden)
    save_file(weights, path, metadata={"format": "pt"})
    return str(dest)


@pytest.fixture(scope="module")
def json_llm(tiny_model_dir, tmp_path_factory):
    folder = _closer_loving_model(
        tiny_model_dir("llama", tie_word_embeddings=False), tmp_path_factory.mktemp("closers") / "model"
    )
    with _engine(folder) as engine:
        yield engine


def _follows(kind: str, text: str, token_ids: list[int], tokenizer) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text)
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(EBNF_AS_REGEX, text)
        # And xgrammar's own matcher, fed the tokens, reaches the grammar's end.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(EBNF))
        assert all(matcher.accept_token(t) for t in token_ids) and matcher.is_terminated()


def _prompts(n: int) -> list[str]:
    return [f"Sample {i}:" for i in range(n)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_sampled_outputs_follow_the_grammar(request, kind):
    llm = request.getfixturevalue("json_llm" if kind == "json_object" else "llm")
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=KINDS[kind])
        for i in range(NUM_SAMPLES)
    ]
    outputs = [r.outputs[0] for r in llm.generate(_prompts(NUM_SAMPLES), params, use_tqdm=False)]
    assert [o.finish_reason for o in outputs] == ["stop"] * NUM_SAMPLES
    for o in outputs:
        _follows(kind, o.text, o.token_ids, llm.get_tokenizer())
    assert len({o.text for o in outputs}) > (1 if kind == "choice" else NUM_SAMPLES // 2)  # sampled, not fixed


def test_cut_by_max_tokens_says_length(llm):
    out = llm.generate(
        "Hi", SamplingParams(temperature=0, max_tokens=3, structured_outputs=KINDS["json"]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith('{"')


def test_mixed_batch_leaves_free_requests_alone(llm):
    free = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
    ]
    prompts = ["The quick brown fox", "Once upon a time"]
    alone = [r.outputs[0].token_ids for r in llm.generate(prompts, free, use_tqdm=False)]
    constrained = [
        SamplingParams(temperature=t, seed=7, max_tokens=MAX_TOKENS, structured_outputs=so)
        for t in (0.0, 1.0)
        for so in KINDS.values()
        if not so.json_object
    ]
    mixed = llm.generate(prompts + ["x"] * len(constrained), free + constrained, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in mixed[:2]] == alone
    kinds = [k for k in KINDS if k != "json_object"] * 2
    for kind, r in zip(kinds, mixed[2:]):
        assert r.outputs[0].finish_reason == "stop"
        _follows(kind, r.outputs[0].text, r.outputs[0].token_ids, llm.get_tokenizer())


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            dict(json={"type": "object", "properties": 3}),
            "structured_outputs.json is invalid: properties must be an object",
        ),
        (dict(json="{not json"), "structured_outputs.json is invalid: .*Failed to parse JSON"),
        (dict(regex="[a-"), r"structured_outputs.regex is invalid: Regex parsing error .*Unclosed '\['"),
        (dict(grammar="root ::= missing"), 'structured_outputs.grammar is invalid: .*Rule "missing" is not defined'),
    ],
)
def test_bad_grammar_is_refused_at_intake(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(**bad)), use_tqdm=False)
    assert not llm.llm_engine.engine_core.engine_core.has_unfinished_requests()


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of .* got json, regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutputsParams()


def test_constraint_crosses_the_core_process_channel(llm):
    """A core in another process (or a DP replica) gets it intact, the
    schema's property order included."""
    import msgspec

    from raylm.engine.protocol import ClientMessage

    _, params = llm.llm_engine.validate("Hi", SamplingParams(structured_outputs=KINDS["json"]))
    sent = msgspec.msgpack.encode(EngineCoreRequest("r", [1, 2], params, 1))
    received = msgspec.msgpack.Decoder(ClientMessage).decode(sent).to_request()
    assert received.sampling_params.structured_outputs == KINDS["json"]
    assert list(received.sampling_params.structured_outputs.json["properties"]) == list(SCHEMA["properties"])


def _mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded requests of every bounded kind."""
    kinds = [so for so in KINDS.values() if not so.json_object]
    return [
        SamplingParams(
            temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=kinds[i % len(kinds)]
        )
        for i in range(n)
    ]


def _token_ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def reference(llm):
    """Outputs of _mixed_params(16) on an engine with room for all of them."""
    return _token_ids(llm.generate(_prompts(16), _mixed_params(16), use_tqdm=False))


def test_async_scheduling_gives_the_same_outputs(model, reference):
    """The next step is scheduled before this one's token is known: a
    constrained request's bitmask waits for that token."""
    with _engine(model, async_scheduling=True) as llm:
        assert _token_ids(llm.generate(_prompts(16), _mixed_params(16), use_tqdm=False)) == reference


def test_grammar_state_survives_preemption(model, reference):
    # Ten blocks of 16 tokens for 16 requests: they are preempted and recomputed.
    with _engine(model, max_model_len=128, kv_cache_memory_bytes=10 * _bytes_per_block(model)) as llm:
        assert _token_ids(llm.generate(_prompts(16), _mixed_params(16), use_tqdm=False)) == reference
        assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0


def test_grammar_state_survives_executor_recovery(llm, reference):
    """The executor fails mid-generation and is rebuilt; every request
    recomputes its tokens and continues, its matcher advanced once per token."""
    core = llm.llm_engine.engine_core.engine_core
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(_prompts(16), _mixed_params(16))):
        engine.add_request(str(i), prompt, params)
    results, struck = {}, False
    while engine.has_unfinished_requests():
        if not struck and all(r.num_output_tokens >= 2 for r in core.scheduler.requests.values()):

            def fail(*args, **kwargs):
                raise WorkerDiedError("simulated worker death")

            core.executor.sample_tokens = fail  # the rebuilt executor has its own
            struck = True
        for output in engine.step():
            results[output.request_id] = output
    assert struck and len(core.recoveries) == 1
    assert _token_ids(results[str(i)] for i in range(16)) == reference


def test_resumed_request_fast_forwards_its_matcher(llm):
    """A request resubmitted with the tokens it generated elsewhere (a core
    that died) continues the grammar after them."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=KINDS["json"])
    full = llm.generate("Resume me", params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    prompt, finished = engine.validate("Resume me", params)
    core.add_request(
        EngineCoreRequest(
            "resumed", prompt.prompt_token_ids, finished, engine.input_processor.eos_token_id, output_token_ids=full[:9]
        )
    )
    tokens, reason = [], None
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    assert full[:9] + tokens == full and reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_worker_processes_match_one_process(model, reference, layout):
    """Every TP rank applies the same bitmask; with PP two batches are in
    flight (the batch queue), each with its own."""
    with _engine(model, distributed_executor_backend="mp", num_threads=1, **layout) as llm:
        assert _token_ids(llm.generate(_prompts(16), _mixed_params(16), use_tqdm=False)) == reference


@pytest.mark.parametrize("transport", ["mq", "cgraph"])
def test_ray_tensor_parallel_matches_one_process(model, reference, ray_session, transport):
    """TP=2 Ray actors, on either step transport, give the constrained (and
    free) outputs of one process: the bitmask reaches the sampling rank."""
    from tests.conftest import our_live_ray_state

    with _engine(
        model, distributed_executor_backend="ray", tensor_parallel_size=2, num_threads=1, ray_step_transport=transport
    ) as llm:
        assert _token_ids(llm.generate(_prompts(16), _mixed_params(16), use_tqdm=False)) == reference
    assert our_live_ray_state() == ([], [])


def test_free_requests_never_import_xgrammar(tiny_model_dir):
    """Importing xgrammar takes a fraction of a second; it once fell on the
    first request a server answered, constrained or not."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from raylm import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir('llama'))!r}, dtype='float32', kv_cache_memory_bytes=16 << 20, num_threads=1)\n"
        "out = llm.generate('hello', SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)\n"
        "assert out[0].outputs[0].token_ids\n"
        "print('xgrammar' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
