"""Convert a Hugging Face model folder to GGUF with llama.cpp's own converter.

Usage:
  python benchmarks/peers/convert_to_gguf.py SRC_TREE HF_DIR --outtype bf16 --outfile OUT.gguf
      [--tokenizer-pre NAME] [any other convert_hf_to_gguf.py option]

SRC_TREE is the llama.cpp tree that install_llamacpp.sh unpacks (DEST/src). This script loads
that tree's convert_hf_to_gguf.py (and its `conversion` package where the tree has one) with
the tree's own gguf-py first on sys.path, so the file is written by the llama.cpp version the
binaries were built from, not by whatever `gguf` package this interpreter has. Every argument
after SRC_TREE except --tokenizer-pre goes to the converter unchanged (--outtype is one of
f32, f16, bf16, q8_0, ...; quantize further with DEST/bin/llama-quantize IN OUT Q4_K_M).

Needs, in the interpreter running it: torch, numpy, safetensors, transformers and
sentencepiece. The converter imports sentencepiece for Llama folders even when the tokenizer
is a byte-level BPE (it tries a SentencePiece vocabulary first); `pip install sentencepiece`,
or `pip install --target DIR sentencepiece` and PYTHONPATH=DIR to keep it out of an env.

Why the tokenizer's pre-tokenizer is declared here
---------------------------------------------------
A GGUF file of a BPE vocabulary must name its pre-tokenizer (tokenizer.ggml.pre): the regex
split llama.cpp applies to text before the BPE merges. The HF tokenizer does not state it in
a form llama.cpp reads, so the converter identifies it by fingerprint: it encodes a fixed
check text with the HF tokenizer, hashes the resulting ids, and looks the hash up in a table
of released models. The benchmark models' tokenizer is trained on the spot
(raylm/testing/tiny_models.py, a byte-level BPE with a few thousand merges), so its ids, and
hence its hash, are in no table, and the converter stops with "BPE pre-tokenizer was not
recognized". This script keeps the converter's lookup and only handles that miss: an
unrecognised tokenizer is declared as --tokenizer-pre, "gpt-2" unless told otherwise (the
generic byte-level split, and what the GGUF files behind the published llama.cpp comparisons
declare). A tokenizer the table knows keeps the name the converter finds.

The choice does not affect what compare_llamacpp.py measures: its prompts are token ids,
which llama.cpp never pre-tokenizes. It does affect anything that hands llama.cpp text
(llama-perplexity on a text file, llama-lookup or llama-server with a text prompt): the
trained tokenizer splits with Qwen2's regex after NFC, and llama.cpp's "gpt-2" split differs
from it on digit runs and upper-case contractions, so there the ids can differ from HF's.
Pass --tokenizer-pre qwen2 where text must tokenize as raylm tokenizes it (llama.cpp's
"qwen2" split is the same regex; it does not apply NFC, which matters only for text that is
not already NFC).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

NEEDED_MODULES = ("torch", "numpy", "safetensors", "transformers", "sentencepiece")


def usage_error(message: str) -> None:
    sys.exit(
        f"convert_to_gguf: {message}\nusage: python {sys.argv[0]} SRC_TREE HF_DIR "
        "--outtype bf16 --outfile OUT.gguf [--tokenizer-pre NAME] [converter options]"
    )


def split_args(argv: list[str]) -> tuple[Path, str, list[str]]:
    """(SRC_TREE, pre-tokenizer name, the converter's own arguments)."""
    if len(argv) < 2 or argv[0].startswith("-"):
        usage_error("SRC_TREE and HF_DIR are required")
    tree, rest, pre = Path(argv[0]).resolve(), [], "gpt-2"
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--tokenizer-pre":
            if i + 1 >= len(argv):
                usage_error("--tokenizer-pre needs a name (gpt-2, qwen2, ...)")
            pre, i = argv[i + 1], i + 2
        elif arg.startswith("--tokenizer-pre="):
            pre, i = arg.split("=", 1)[1], i + 1
        else:
            rest.append(arg)
            i += 1
    return tree, pre, rest


def load_converter(tree: Path):
    """Imports SRC_TREE/convert_hf_to_gguf.py as a module (its main() not run)."""
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file() or not (tree / "gguf-py" / "gguf").is_dir():
        usage_error(f"{tree} is not a llama.cpp tree (no convert_hf_to_gguf.py and gguf-py/gguf)")
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(
            f"convert_to_gguf: this Python ({sys.executable}) lacks {', '.join(missing)}; "
            "pip install them (sentencepiece: see this script's docstring)"
        )
    # The tree's gguf-py and `conversion` package come before anything installed.
    sys.path[:0] = [str(tree / "gguf-py"), str(tree)]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    gguf_file = getattr(sys.modules.get("gguf"), "__file__", "") or ""
    if not Path(gguf_file).resolve().is_relative_to(tree / "gguf-py"):
        sys.exit(f"convert_to_gguf: gguf was imported from {gguf_file}, not from {tree}/gguf-py (unset NO_LOCAL_GGUF)")
    return module


def classes_defining_pre(module) -> list[type]:
    """Every loaded converter class that defines get_vocab_base_pre itself."""
    namespaces = [vars(module)]
    base = sys.modules.get("conversion.base")  # newer trees keep the model classes there
    if base is not None:
        namespaces.append(vars(base))
    seen: dict[int, type] = {}
    stack = [obj for ns in namespaces for obj in ns.values() if isinstance(obj, type)]
    while stack:
        cls = stack.pop()
        if id(cls) in seen:
            continue
        seen[id(cls)] = cls
        stack.extend(cls.__subclasses__())
    return [cls for cls in seen.values() if "get_vocab_base_pre" in vars(cls)]


def declare_unknown_pre_as(cls: type, pre: str, log: logging.Logger) -> None:
    """Keeps cls's hash lookup; where it finds nothing, answers `pre` instead of raising."""
    lookup = vars(cls)["get_vocab_base_pre"]

    def get_vocab_base_pre(self, tokenizer) -> str:
        # The lookup logs a page of "update the converter" advice before it raises; that
        # advice is for models published on the Hub, not for a locally trained tokenizer.
        before = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:
            pass
        finally:
            logging.disable(before)
        log.warning(
            "the tokenizer's pre-tokenizer is not in llama.cpp's table "
            "(a locally trained tokenizer); declaring it as %r",
            pre,
        )
        return pre

    cls.get_vocab_base_pre = get_vocab_base_pre


def main() -> None:
    tree, pre, converter_args = split_args(sys.argv[1:])
    module = load_converter(tree)
    targets = classes_defining_pre(module)
    if not targets:
        sys.exit(
            f"convert_to_gguf: no get_vocab_base_pre in {tree}'s converter; this script "
            "does not know this llama.cpp version's layout"
        )
    log = logging.getLogger("convert_to_gguf")
    for cls in targets:
        declare_unknown_pre_as(cls, pre, log)
    sys.argv = [str(tree / "convert_hf_to_gguf.py"), *converter_args]
    module.main()


if __name__ == "__main__":
    main()
