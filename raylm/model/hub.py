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


def resolve_model_path(
    name: str, revision: str | None = None, download_dir: str | None = None, what: str = "model"
) -> str:
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
        path = snapshot_download(
            name, revision=revision, cache_dir=cache_dir, allow_patterns=MODEL_FILE_PATTERNS, local_files_only=offline
        )
    except LocalEntryNotFoundError as e:
        # Offline, or online with the Hub unreachable, and nothing in the cache.
        how = (
            "HF_HUB_OFFLINE is set, so only the cache was searched"
            if offline
            else f"the Hub could not be reached ({_first_line(e)}) and the cache has no copy"
        )
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


def resolve_gguf_model(
    model: str, gguf_file: str | None = None, revision: str | None = None, download_dir: str | None = None
) -> str:
    """The local path of a GGUF model: a file; a folder or Hub id with `gguf_file`
    (a file name in it); or `org/name:QUANT` (vLLM's spelling), the one file of
    the repository whose name holds QUANT, e.g. Q4_K_M. Only the chosen file is
    downloaded."""
    model = os.fspath(model)
    if gguf_file is None and model.lower().endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"GGUF model file {model!r} does not exist")
        return model
    if gguf_file is not None:
        repo, wanted = model, gguf_file
        if os.path.isdir(repo):
            path = os.path.join(repo, gguf_file)
            if not os.path.isfile(path):
                raise ValueError(f"gguf_file {gguf_file!r} is not in folder {repo!r}")
            return path
        patterns = [gguf_file]
    else:
        repo, _, wanted = model.rpartition(":")
        if not wanted:
            raise ValueError(f"model {model!r}: name a GGUF type after ':', e.g. {repo}:Q4_K_M")
        patterns = [f"*{wanted}*.gguf", f"*{wanted.lower()}*.gguf", f"*{wanted.upper()}*.gguf"]
    if not looks_like_repo_id(repo):
        raise ValueError(f"model {repo!r} is not a Hugging Face Hub id like 'org/name' (for its GGUF file {wanted!r})")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache_dir = hub_cache_dir(download_dir)
    try:
        folder = snapshot_download(
            repo, revision=revision, cache_dir=cache_dir, allow_patterns=patterns, local_files_only=is_offline()
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ValueError(
            f"GGUF file {wanted!r} of {repo!r} could not be found in the Hugging Face cache "
            f"{cache_dir!r} or downloaded: {_first_line(e)}"
        ) from e
    names = sorted(
        f
        for f in os.listdir(folder)
        if f.lower().endswith(".gguf") and (f == gguf_file if gguf_file else wanted.lower() in f.lower())
    )
    if not names:
        raise ValueError(f"{repo!r} has no GGUF file {'named' if gguf_file else 'of type'} {wanted!r}")
    if len(names) > 1:
        raise ValueError(
            f"{repo!r} has several GGUF files for {wanted!r} ({', '.join(names)}); name one with --gguf-file"
        )
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", names[0]):
        raise ValueError(f"{names[0]!r} is one part of a split GGUF file; raylm loads single-file GGUF models")
    path = os.path.join(folder, names[0])
    logger.info("GGUF model %s (%s) resolved to %s", repo, wanted, path)
    return path
