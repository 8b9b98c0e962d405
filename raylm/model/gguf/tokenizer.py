"""The tokenizer a GGUF file describes (tokenizer.ggml.* and its chat
template), built by transformers from the metadata and saved as an ordinary
tokenizer folder: the engine's processes load a folder, and building it once
(about a second) spares every process that."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from raylm.model.gguf.reader import open_gguf

logger = logging.getLogger(__name__)

CACHE_ENV = "RAYLM_GGUF_CACHE"


def _cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path.home() / ".cache" / "raylm" / "gguf"


def materialize_tokenizer(gguf_path: str) -> str:
    """A folder holding the file's tokenizer (made on first use, then reused
    while the file is unchanged)."""
    # Checked by raylm's bounded reader first: transformers reads the file
    # with gguf's reader, which believes every count in the header.
    open_gguf(gguf_path)
    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    key = hashlib.sha256(f"{real}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = _cache_root() / f"{Path(real).stem}-{key}"
    if (folder / "tokenizer_config.json").is_file():
        return str(folder)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(real), gguf_file=os.path.basename(real))
    except Exception as e:  # transformers raises many kinds; the user needs the file and the cause
        raise ValueError(f"cannot build a tokenizer from the metadata of GGUF file {gguf_path!r}: {e}") from e
    # Written beside, then renamed: processes starting together never see half a folder.
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    tokenizer.save_pretrained(partial)
    try:
        os.replace(partial, folder)
    except OSError:  # another process got there first
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("tokenizer of %s written to %s", gguf_path, folder)
    return str(folder)
