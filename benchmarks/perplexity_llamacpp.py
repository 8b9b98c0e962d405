"""raylm's perplexity on quantized GGUF files against llama.cpp's `llama-perplexity` on the same files.

The embedded model is written as GGUF by raylm's writer (raylm/testing/gguf_writer.py) in
F32, Q8_0 and a Q4_K_M-like mix (Q6_K for attn_v, ffn_down and the output head, Q4_K
elsewhere), and both engines score the same held-out text (the epilogue of The Tempest, which
the embedded model never trained on; the quality test's passage).

Scoring follows llama-perplexity's own scheme so the numbers are comparable: the text is
tokenized once (with BOS), cut into chunks of --ctx tokens, each chunk's first token replaced
by BOS, and only the second half of each chunk is scored (token j+1 given tokens 0..j, for j
from ctx/2 to ctx-2). raylm computes the same with prompt logprobs.

  python benchmarks/perplexity_llamacpp.py --llamacpp-bin /tmp/peer-llamacpp/bin

llama-perplexity runs with --no-repack: on this VM the build that
benchmarks/peers/install_llamacpp.sh makes dies with SIGILL on Q8_0 and Q4_K
files otherwise (gdb: inside ggml_backend_amx_mul_mat; the CPU flags announce
AMX int8, which the VM traps). Without repacking, llama.cpp multiplies the
blocks as the file stores them, which changes its speed, not its
arithmetic's precision class. A build that still crashes on a type is
reported in its row rather than stopping the run.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import subprocess
import tempfile

from raylm import LLM, SamplingParams
from raylm.config import DEFAULT_MODEL_DIR
from raylm.testing.gguf_writer import write_gguf
from raylm.testing.held_out import HELD_OUT, q4_k_m

# llama-perplexity needs two chunks' worth of tokens: the passage twice.
TEXT = HELD_OUT * 2


def raylm_perplexity(path: str, text: str, ctx: int) -> tuple[float, int]:
    with LLM(path, dtype="float32", num_threads=1, kv_cache_memory_bytes=16 << 20) as llm:
        tokenizer = llm.get_tokenizer()
        ids = tokenizer.encode(text)
        bos = tokenizer.bos_token_id
        if ids[0] != bos:
            ids = [bos] + ids
        chunks = [ids[i * ctx : (i + 1) * ctx] for i in range(len(ids) // ctx)]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        nll, count = 0.0, 0
        for chunk in chunks:
            chunk = [bos] + chunk[1:]
            out = llm.generate([{"prompt_token_ids": chunk}], params, use_tqdm=False)[0]
            for k in range(ctx // 2 + 1, ctx):
                nll -= out.prompt_logprobs[k][chunk[k]].logprob
                count += 1
    return math.exp(nll / count), count


def llamacpp_perplexity(binary: pathlib.Path, path: str, text_file: str, ctx: int) -> float | str:
    """llama-perplexity's final estimate, or why there is none (a crash is reported, not raised:
    a build may lack a kernel for a type, e.g. one this machine's CPU flags promise but the VM traps)."""
    out = subprocess.run(
        [str(binary), "-m", path, "-f", text_file, "-c", str(ctx), "-b", str(ctx), "-t", "1", "--no-repack"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if match is None:
        return f"no estimate (exit {out.returncode})"
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-bin", required=True, type=pathlib.Path)
    parser.add_argument("--ctx", type=int, default=64, help="tokens per chunk (both engines)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text_file = f"{tmp}/text.txt"
        pathlib.Path(text_file).write_text(TEXT)
        print("| file | raylm PPL | llama-perplexity PPL | raylm / llama.cpp | scored tokens |")
        print("|---|---|---|---|---|")
        variants = ("F32", "Q8_0", "Q4_K_M")
        paths = {variant: f"{tmp}/model-{variant}.gguf" for variant in variants}
        for variant, path in paths.items():
            write_gguf(
                DEFAULT_MODEL_DIR,
                path,
                "Q4_K" if variant == "Q4_K_M" else variant,
                tensor_type=q4_k_m if variant == "Q4_K_M" else None,
            )
        # llama.cpp first: run after an engine in this process, llama-perplexity here ended
        # without printing its results (exit 0).
        theirs = {
            v: llamacpp_perplexity(args.llamacpp_bin / "llama-perplexity", p, text_file, args.ctx)
            for v, p in paths.items()
        }
        for variant, path in paths.items():
            ours, count = raylm_perplexity(path, TEXT, args.ctx)
            other = theirs[variant]
            if isinstance(other, str):
                print(f"| {variant} | {ours:.4f} | {other} | | {count} |", flush=True)
            else:
                print(f"| {variant} | {ours:.4f} | {other:.4f} | {ours / other:.4f} | {count} |", flush=True)


if __name__ == "__main__":
    main()
