"""Hugging Face Hub model ids ("org/name") to local folders.

A model or tokenizer may be given as a folder or as a Hub id, as in vLLM. The
config layer resolves it once, here, so every process (workers, Ray actors)
receives a local path and never talks to the Hub itself.

A folder that exists always wins. Otherwise the id is fetched with
huggingface_hub's snapshot_download into its usual cache (HF_HUB_CACHE, or
HF_HOME/hub, or --download-dir), or found there when HF_HUB_OFFLINE is set or
the Hub cannot be reached.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

# What an engine needs from a repository: weights, configs, tokenizer files and
# chat templates; not the pickled (*.bin, *.pt) or GGUF copies many repos also carry.
MODEL_FILE_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken"]

# huggingface_hub's own rule: one or two names of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_TRUE = {"1", "on", "yes", "true"}


def is_offline() -> bool:
    """HF_HUB_OFFLINE, read now rather than when huggingface_hub was imported,
    so that a program (or a test) may set it after importing transformers."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUE
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(download_dir: str | None = None) -> str:
    """Where snapshots live: --download-dir, else HF_HUB_CACHE, else HF_HOME/hub,
    else huggingface_hub's default (also read now, for the same reason)."""
    if download_dir:
        return os.path.expanduser(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def resolve_model_path(name: str, revision: str | None = None, download_dir: str | None = None,
                       what: str = "model") -> str:
    """The local folder for `name` (a folder, or a Hub id at `revision`).

    `what` ("model", "tokenizer") names the setting in error messages.
    Raises ValueError when it is neither a folder nor a Hub id that can be
    found, saying what was tried.
    """
    name = os.fspath(name)
    if os.path.isdir(name):
        if revision is not None:
            logger.warning("%s %r is a local folder; --revision %s is ignored", what, name, revision)
        return name
    if not looks_like_repo_id(name):
        raise ValueError(f"{what} path {name!r} is not a folder (nor a Hugging Face Hub id like 'org/name')")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache_dir = hub_cache_dir(download_dir)
    offline = is_offline()
    at_revision = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=MODEL_FILE_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError as e:
        # Offline, or online with the Hub unreachable, and nothing in the cache.
        how = ("HF_HUB_OFFLINE is set, so only the cache was searched" if offline
               else f"the Hub could not be reached ({_first_line(e)}) and the cache has no copy")
        raise ValueError(
            f"{what} {name!r}{at_revision} is not a local folder and was not found in the Hugging Face "
            f"cache {cache_dir!r}: {how}"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        # Repository or revision missing, gated, or a network failure mid-download.
        raise ValueError(
            f"{what} {name!r}{at_revision} could not be downloaded from the Hugging Face Hub into "
            f"{cache_dir!r}: {_first_line(e)}"
        ) from e
    logger.info("%s %s%s resolved to %s", what, name, at_revision, path)
    return path


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
