"""Tiny, deterministic Hugging Face model folders (weights, config, tokenizer) for tests.

`make_tiny_model("qwen3", tmp_path)` writes a folder that both transformers and raylm load.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import pathlib
from collections.abc import Iterator
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX
from transformers.utils import logging as hf_logging

logger = logging.getLogger(__name__)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# Never produced by byte-level BPE, but naming it stops Qwen2Tokenizer adding its own.
UNK_TOKEN = "<unk>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, *CHAT_TOKENS)
TOKENIZER_VOCAB_SIZE = 768

# One turn per message, then an open assistant turn when a reply is wanted.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Training text for the tokenizer; covers ASCII prose, digits, code-ish text and
# multi-byte UTF-8 (accents, CJK, emoji) so byte-level round trips get exercised.
TRAINING_CORPUS = """\
ROMEO: But, soft! what light through yonder window breaks?
It is the east, and Juliet is the sun. Arise, fair sun, and kill the envious moon,
who is already sick and pale with grief that thou her maid art far more fair than she.
JULIET: O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name;
or, if thou wilt not, be but sworn my love, and I'll no longer be a Capulet.

The quick brown fox jumps over the lazy dog. A large language model predicts the next
token from the tokens before it. During generation the engine keeps a cache of keys and
values for every layer, so each new step only computes attention for the newest token.
Tensor parallelism splits each weight matrix across devices; pipeline parallelism gives
each device a contiguous range of layers; data parallelism runs whole replicas side by side.

Once upon a time there was a small robot who lived in a quiet town by the sea. Every
morning the robot walked to the harbour, counted the boats, and wrote the number in a
little notebook: one, two, three, four, five, six, seven, eight, nine, ten. The fishermen
laughed and asked why it cared so much about boats. "Because numbers tell stories," it said.

def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

print([fibonacci(i) for i in range(12)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89]
{"model": "tiny", "prompt": "Hello, world!", "max_tokens": 16, "temperature": 0.0}

Crème brûlée, café au lait, naïve façade, jalapeño, Zürich, São Paulo, Ærøskøbing, Łódź.
Grüße aus München! ¿Dónde está la biblioteca? Ça va très bien, merci.
Привет, как дела? Γειά σου κόσμε. שלום עולם. مرحبا بالعالم.
日本語のテキストも少し含めます。東京は大きな都市です。
你好，世界！今天天气很好，我们去公园散步吧。
한국어 문장도 있습니다. 안녕하세요.
Emoji: 😀 🚀 🌍 ❤️ 👍 🎉 🤖 🐍 — and symbols: © ® ™ € £ ¥ ° ± × ÷ → ∞ ≈ ≠ ≤ ≥.
"""


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Trains the byte-level BPE once per process; returns it serialised (callers copy it)."""
    tokenizer = Tokenizer(models.BPE())
    # transformers 5 always loads a qwen2 folder with Qwen2Tokenizer, which rebuilds the
    # pipeline as NFC + Qwen's split regex + byte level. Using that same pipeline for every
    # arch keeps tokenizer.json, HF and raylm agreeing on token ids whichever class loads it.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus gives the trainer stable pair counts without changing which merges win.
    tokenizer.train_from_iterator(TRAINING_CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama tokenizers, plain encodes start with BOS (chat templates add it themselves).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str()


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh HF fast tokenizer wrapping the cached byte-level BPE."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(CHAT_TOKENS),
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}
SUPPORTED_ARCHS: tuple[str, ...] = tuple(_CONFIG_CLASSES)

_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}

# Each architecture turns on the feature a real engine most often gets wrong for it.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": True, "rope_theta": 10000.0},
    # Qwen2 always has q/k/v bias (hard-wired in transformers, not a config switch).
    "qwen2": {"tie_word_embeddings": False, "rope_theta": 10000.0, "use_sliding_window": False},
    # head_dim * heads (128) != hidden_size (64); q_norm/k_norm come with the architecture.
    "qwen3": {"tie_word_embeddings": False, "rope_theta": 1000000.0, "head_dim": 32, "use_sliding_window": False},
    "mistral": {"tie_word_embeddings": False, "rope_theta": 1000000.0, "sliding_window": None},
}

# Re-initialisation scales: large enough that greedy top-1/top-2 logit gaps sit far above
# float32 rounding (HF's 0.02 init gives near-flat logits and flaky argmax ties).
EMBEDDING_STD = 0.5
NORM_WEIGHT_JITTER = 0.1
BIAS_STD = 0.1
RESIDUAL_WRITE_GAIN = 4.0


def _rope_parameters(arch: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Merges legacy `rope_theta`/`rope_scaling` and v5 `rope_parameters` overrides into one dict.

    transformers 5 keeps rope settings only in `rope_parameters`; a bare `rope_scaling`
    would otherwise silently reset theta to 10000, losing the architecture's default.
    """
    theta = overrides.pop("rope_theta", ARCH_DEFAULTS[arch]["rope_theta"])
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta)}
    scaling = overrides.pop("rope_scaling", None)
    if scaling:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        params.update(scaling)
    explicit = overrides.pop("rope_parameters", None)
    if explicit:
        params.update(explicit)
    return params


def build_tiny_config(arch: str, **config_overrides: Any) -> PretrainedConfig:
    """The transformers config `make_tiny_model` would write, without touching disk."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    tokenizer = build_tiny_tokenizer()
    overrides = dict(config_overrides)
    settings: dict[str, Any] = {
        **_COMMON_DEFAULTS,
        **{k: v for k, v in ARCH_DEFAULTS[arch].items() if k != "rope_theta"},
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "rope_parameters": _rope_parameters(arch, overrides),
    }
    settings.update(overrides)
    if settings["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {settings['vocab_size']} is smaller than the tokenizer's {len(tokenizer)}")
    config = _CONFIG_CLASSES[arch](**settings)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def _reinitialise_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrites every parameter from a private generator so results do not depend on HF's init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() lists a tied lm_head once (as the embedding), keeping ties intact.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                values = 1.0 + NORM_WEIGHT_JITTER * torch.randn(param.shape, generator=generator)
            elif name.endswith(".bias"):
                values = BIAS_STD * torch.randn(param.shape, generator=generator)
            elif "embed_tokens" in name or "lm_head" in name:
                values = EMBEDDING_STD * torch.randn(param.shape, generator=generator)
            else:
                # 1/sqrt(fan_in) keeps activations O(1); projections writing into the residual
                # stream get a larger gain so the input embedding does not dominate it (with tied
                # embeddings that would make every model just repeat its last token).
                gain = RESIDUAL_WRITE_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                values = gain * torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            param.copy_(values.to(param.dtype))


def _shard_size_for(model: torch.nn.Module, num_shards: int) -> int:
    """The smallest max_shard_size (bytes) that splits the weights into at most `num_shards` files."""
    unique: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor
    total = sum(t.numel() * t.element_size() for t in unique.values())
    size = math.ceil(total / num_shards)
    # Greedy bin filling can overflow into an extra file; grow the limit until it fits.
    while len(split_torch_state_dict_into_shards(unique, max_shard_size=size).filename_to_tensors) > num_shards:
        size = math.ceil(size * 1.05)
    return size


def make_tiny_model(
    arch: str,
    path: str | pathlib.Path,
    *,
    seed: int = 0,
    num_shards: int = 1,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> pathlib.Path:
    """Writes a complete HF model folder (safetensors, config, generation config, tokenizer).

    The same (arch, seed, num_shards, dtype, overrides) always produces identical bytes.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    config = build_tiny_config(arch, **config_overrides)
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    # Leftover shards from an earlier call with another layout would confuse loaders.
    for stale in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        stale.unlink()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinitialise_weights(model, seed)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    max_shard_size = "50GB" if num_shards == 1 else _shard_size_for(model, num_shards)
    with _quiet_progress_bars():
        model.save_pretrained(folder, max_shard_size=max_shard_size)

    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    _add_chat_template_to_tokenizer_config(folder)
    logger.debug("wrote tiny %s model (seed %d, %d shard(s)) to %s", arch, seed, num_shards, folder)
    return folder


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Keeps "Writing model shards" bars out of test logs, restoring the caller's setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _add_chat_template_to_tokenizer_config(folder: pathlib.Path) -> None:
    """transformers 5 saves the template as chat_template.jinja; older readers look in the config."""
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
