"""The CPU kernels that multiply by GGUF-quantized weights (csrc/quant_gemm.cpp)
against `gguf.quants.dequantize`, the format's own decoder: decode-sized row
counts (the register-tiled path, with and without a remainder row), prefill
sizes (the weight widened once for a float matmul), float32 and bfloat16
activations; and the model keeps such weights quantized when they run there."""

from __future__ import annotations

import dataclasses
import sysconfig
import types

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from raylm.model.layers import quant_kernels
from raylm.model.layers.quant_linear import QuantSegment
from raylm.model.quantization import QuantizedWeight, quant_type
from raylm.testing.kquants import quantize_q4_k, quantize_q6_k
from tests.model.cpu_kernel_utils import needs_compiler

pytestmark = needs_compiler

ENCODERS = {
    "Q8_0": lambda w: quants.quantize(w, T.Q8_0),
    "Q4_0": lambda w: quants.quantize(w, T.Q4_0),
    "Q4_K": quantize_q4_k,
    "Q6_K": quantize_q6_k,
}


def _weight(qtype: str, rows: int = 40, cols: int = 512) -> tuple[QuantizedWeight, torch.Tensor]:
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    data = ENCODERS[qtype](w)
    reference = torch.from_numpy(quants.dequantize(data, T[qtype]))
    return QuantizedWeight(quant_type(qtype), torch.from_numpy(data), cols), reference


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_dequantize_equals_the_gguf_decoder(qtype, kernels):
    weight, reference = _weight(qtype)
    code = quant_kernels.GGUF_TYPE_CODES[qtype]
    assert torch.equal(kernels.quant_dequantize(weight.data, code, weight.cols, torch.float32), reference)
    assert torch.equal(kernels.quant_dequantize(weight.data, code, weight.cols, torch.bfloat16), reference.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, quant_kernels.WIDEN_FROM_ROWS + 1, quant_kernels.PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_matmul_equals_a_float_matmul_on_the_decoded_weight(qtype, rows, dtype, kernels):
    weight, reference = _weight(qtype)
    kernel = quant_kernels.kernel_for(qtype, torch.device("cpu"), dtype)
    assert kernel is not None
    x = torch.randn(rows, weight.cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    state = kernel.prepare(weight)
    got = kernel.linear(x, state)
    assert got.dtype == dtype and got.shape == (rows, weight.shape[0])
    if state.packed is not None:
        assert state.data is None  # the file's blocks are not kept beside the packed copy
    if state.packed is not None and rows <= quant_kernels.PACKED_MAX_ROWS:
        # The decode kernel quantizes the activations per block, as llama.cpp does.
        expected = (_as_quantized(x, qtype).double() @ reference.double().t()).float()
    else:
        expected = x.float() @ reference.t()
    # float32: summation order only; bfloat16: the output's rounding (and, past
    # WIDEN_FROM_ROWS, the weight's rounding to bf16 for the float matmul).
    tolerance = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.3, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected, **tolerance)


@pytest.mark.parametrize("rows", [quant_kernels.WIDEN_FROM_ROWS + 1, quant_kernels.PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_bf16_prefill_widens_to_float32_without_bf16_arithmetic(qtype, rows, kernels, monkeypatch):
    """On a CPU without bf16 arithmetic (AVX2), a bf16 prefill widens the weight
    to float32, not bf16: the float matmul on the decoded weight, rounded once."""
    monkeypatch.setattr(quant_kernels.cpu_gemm, "cpu_has_bf16_arithmetic", lambda: False)
    weight, reference = _weight(qtype)
    kernel = quant_kernels.kernel_for(qtype, torch.device("cpu"), torch.bfloat16)
    state = kernel.prepare(weight)
    widened = []
    spy = types.SimpleNamespace(
        **{name: getattr(state.module, name) for name in dir(state.module) if not name.startswith("__")}
    )
    for name in ("quant_dequantize", "quant_packed_dequantize"):
        real = getattr(state.module, name)
        setattr(spy, name, lambda *args, real=real: widened.append(args[-1]) or real(*args))
    state = dataclasses.replace(state, module=spy)
    x = torch.randn(rows, weight.cols, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = kernel.linear(x, state)
    if widened:  # the packed kernel serves up to PACKED_MAX_ROWS rows without widening
        assert widened == [torch.float32]
        assert got.dtype == torch.bfloat16
        expected = (x.float() @ reference.t()).bfloat16()
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1 / 128)
    else:
        assert state.packed is not None and rows <= quant_kernels.PACKED_MAX_ROWS


# Activations per int8 scale in the decode kernel: llama.cpp's Q8_0 blocks for
# Q8_0/Q4_0 weights, its Q8_K blocks for the K types.
ACTIVATION_BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q6_K": 256}


def _as_quantized(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """x as the decode kernel multiplies it: per block, d = amax / 127 and
    q = round(x * (127 / amax)) (to nearest even), in float32; x = q * d."""
    block = ACTIVATION_BLOCK[qtype]
    rows, cols = x.shape
    xb = x.float().reshape(rows, cols // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    # Tensor by tensor: IEEE divisions (torch computes scalar / tensor as a reciprocal times the scalar).
    c127 = torch.full_like(amax, 127.0)
    inverse = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inverse) * (amax / c127)).reshape(rows, cols)


def _packed_or_skip(kernels):
    if not quant_kernels.packed_kernel_available(kernels):
        pytest.skip("this build has no AVX2 or AVX-512 VNNI decode kernel (the row-tiled path serves decode)")


@pytest.fixture(params=["best", "avx_vnni", "avx2"])
def isa(request, kernels):
    """The packed kernel's instruction set: the best here, then the 256-bit ones
    most consumer x86 CPUs run (forced where the CPU has AVX-512 too; avx_vnni
    runs here on AVX-512 VL's encoding of the same instruction)."""
    _packed_or_skip(kernels)
    if request.param != "best" and request.param not in kernels.quant_packed_variants():
        pytest.skip(f"no {request.param} decode kernel in this build")
    kernels.quant_packed_use("auto" if request.param == "best" else request.param)
    yield kernels.quant_packed_variant()
    kernels.quant_packed_use("auto")


@pytest.mark.parametrize("shape", [(16, 256), (40, 512), (33, 1024), (7, 256)])
@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_packed_decode_kernel_equals_the_decoded_weights_times_quantized_activations(qtype, shape, kernels, isa):
    """Every row count it serves, output rows that fill no whole tile of 16, several blocks along K;
    a zero row (no activation scale) gives zeros; bf16 activations are widened first. On each
    instruction set (AVX2 splits the dot in int16 pairs: large weights and activations must not
    saturate them)."""
    rows_out, cols = shape
    w = np.random.default_rng(rows_out).standard_normal((rows_out, cols)).astype(np.float32)
    data = ENCODERS[qtype](w)
    reference = torch.from_numpy(quants.dequantize(data, T[qtype])).double()
    code = quant_kernels.GGUF_TYPE_CODES[qtype]
    packed = kernels.quant_pack(torch.from_numpy(data), code)
    for rows in sorted({1, 2, 3, 4, 7, quant_kernels.PACKED_MAX_ROWS}):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
        x[-1, : ACTIVATION_BLOCK[qtype]] = 0  # a block with amax 0
        got = kernels.quant_packed_linear(x, packed, code, rows_out)
        expected = _as_quantized(x, qtype).double() @ reference.t()
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
        got_bf16 = kernels.quant_packed_linear(x.bfloat16(), packed, code, rows_out)
        expected_bf16 = _as_quantized(x.bfloat16(), qtype).double() @ reference.t()
        assert got_bf16.dtype == torch.bfloat16
        # Written in bf16 by the kernel: the float result rounded as torch rounds.
        via_float = kernels.quant_packed_linear(x.bfloat16().float(), packed, code, rows_out)
        assert torch.equal(got_bf16, via_float.bfloat16())
        torch.testing.assert_close(got_bf16.double(), expected_bf16, atol=1e-4, rtol=1e-2)
    zero = kernels.quant_packed_linear(torch.zeros(1, cols), packed, code, rows_out)
    assert torch.equal(zero, torch.zeros(1, rows_out))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_packed_decode_kernel_at_the_extremes_of_its_integers(qtype, kernels, isa):
    """Weights at their largest magnitude (Q8_0 -128 and 127, Q4_0 0 and 15) against
    activations at +-127: the sums that would saturate a pairwise int16 dot."""
    rows_out, cols = 16, 64
    blocks = np.zeros((rows_out, cols // 32, 2 + (32 if qtype == "Q8_0" else 16)), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    extreme = np.array([0x80, 0x7F] if qtype == "Q8_0" else [0x00, 0xFF], dtype=np.uint8)  # -128/127; 0|0, 15|15
    blocks[0::2, :, 2:] = extreme[0]  # even columns all at one end, odd ones at the other
    blocks[1::2, :, 2:] = extreme[1]
    data = blocks.reshape(rows_out, -1)
    reference = torch.from_numpy(quants.dequantize(data, T[qtype])).double()
    code = quant_kernels.GGUF_TYPE_CODES[qtype]
    packed = kernels.quant_pack(torch.from_numpy(data), code)
    x = torch.full((2, cols), 5.0)
    x[1, ::2] = -5.0
    got = kernels.quant_packed_linear(x, packed, code, rows_out)
    torch.testing.assert_close(got.double(), _as_quantized(x, qtype).double() @ reference.t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_the_packed_layout_holds_the_file_blocks_bit_for_bit(qtype, kernels):
    """quant_unpack gives the file's blocks back and the tiles widen to the floats the
    file's blocks widen to: a layer can drop the file's copy after packing."""
    _packed_or_skip(kernels)
    code = quant_kernels.GGUF_TYPE_CODES[qtype]
    for rows, cols in [(40, 512), (7, 256)]:  # a last tile with padding columns
        weight, reference = _weight(qtype, rows, cols)
        packed = kernels.quant_pack(weight.data, code)
        assert torch.equal(kernels.quant_unpack(packed, code, rows, cols), weight.data)
        for dtype in (torch.float32, torch.bfloat16):
            widened = kernels.quant_packed_dequantize(packed, code, rows, cols, dtype)
            assert torch.equal(widened, kernels.quant_dequantize(weight.data, code, cols, dtype))
        assert torch.equal(kernels.quant_packed_dequantize(packed, code, rows, cols, torch.float32), reference)
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.quant_unpack(packed, code, rows + 16, cols)


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_tiles_of_any_bytes_widen_as_the_file_blocks_do(qtype, kernels):
    """Random bytes as blocks (every quant value and scale, fp16 infinities and NaNs
    among them: c10 writes every NaN as 0x7FC0 in bf16, where a bf16 instruction
    keeps its sign and payload) widen from the tiles bit for bit as from the blocks."""
    _packed_or_skip(kernels)
    code = quant_kernels.GGUF_TYPE_CODES[qtype]
    qt = quant_type(qtype)
    rows, blocks = 61, 4  # a last tile with padding columns
    data = torch.from_numpy(np.random.default_rng(7).integers(0, 256, (rows, blocks * qt.type_size), dtype=np.uint8))
    cols = blocks * qt.block_size
    packed = kernels.quant_pack(data, code)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        from_blocks = kernels.quant_dequantize(data, code, cols, dtype)
        assert from_blocks.isnan().any()
        assert torch.equal(
            kernels.quant_packed_dequantize(packed, code, rows, cols, dtype).view(bits), from_blocks.view(bits)
        )


def test_an_unknown_kernel_choice_is_refused(kernels, monkeypatch):
    _packed_or_skip(kernels)
    monkeypatch.setattr(quant_kernels, "_chosen_variant", None)
    monkeypatch.setenv(quant_kernels.KERNEL_ENV, "avx1024")
    with pytest.raises(ValueError, match="RAYLM_QUANT_KERNEL='avx1024'.*auto"):
        quant_kernels.packed_kernel_available(kernels)
    monkeypatch.setenv(quant_kernels.KERNEL_ENV, "avx2")
    if "avx2" in kernels.quant_packed_variants():
        try:
            assert quant_kernels.packed_kernel_available(kernels) and kernels.quant_packed_variant() == "avx2"
        finally:
            kernels.quant_packed_use("auto")


def test_packed_decode_kernel_refuses_a_weight_of_another_shape(kernels):
    _packed_or_skip(kernels)
    weight, _ = _weight("Q4_K", rows=40, cols=512)
    packed = kernels.quant_pack(weight.data, quant_kernels.GGUF_TYPE_CODES["Q4_K"])
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.quant_packed_linear(torch.randn(1, 256), packed, quant_kernels.GGUF_TYPE_CODES["Q4_K"], 40)


def test_model_layers_keep_gguf_weights_quantized(tmp_path, tiny_model_dir, kernels):
    from raylm.model.loader import load_model
    from raylm.testing.gguf_writer import write_gguf

    folder = tiny_model_dir(
        "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    path = write_gguf(
        folder, tmp_path / "m.gguf", tensor_type=lambda name, shape: "Q6_K" if "attn_v" in name else "Q4_K"
    )
    model = load_model(str(path), torch.bfloat16, "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    # q and k merged into one Q4_K segment, v its own Q6_K one: no float copy.
    assert [type(s) for s in qkv.quant_matmul.segments] == [QuantSegment, QuantSegment]
    assert [s.qtype.name for s in qkv.quant_matmul.segments] == ["Q4_K", "Q6_K"]
    assert qkv.weight.numel() == 0


def _reachable(root) -> list[object]:
    """Every object reachable from `root` through attributes and containers
    (not through modules, classes or functions)."""
    skip = (
        types.ModuleType,
        type,
        types.FunctionType,
        types.BuiltinFunctionType,
        types.MethodType,
        str,
        bytes,
        int,
        float,
        bool,
        torch.dtype,
        torch.device,
    )
    seen, found, stack = set(), [], [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip) or obj is None:
            continue
        seen.add(id(obj))
        found.append(obj)
        if isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


def bytes_held_once(model, dtype: torch.dtype) -> int:
    """Bytes of the `dtype` storages reachable from `model`, each counted once;
    asserts that no loaded QuantizedWeight is reachable (nothing kept beside)."""
    reachable = _reachable(model)
    assert not [o for o in reachable if isinstance(o, QuantizedWeight)]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in reachable
        if isinstance(t, torch.Tensor) and t.dtype == dtype
    }
    return sum(storages.values())


@pytest.mark.parametrize("variant", ["Q8_0", "Q4_K_M"])
def test_a_bf16_model_keeps_one_copy_of_its_quantized_weights(variant, tmp_path, tiny_model_dir, kernels):
    """The file's blocks are dropped once packed: the uint8 bytes the loaded model
    holds are those of the file's quantized matrices once (the packed layout adds
    Q4_K's unpacked scales, 64 bytes per 16 x 144, and padding to tiles of 16
    rows), not twice, and no loaded QuantizedWeight is left anywhere in it."""
    _packed_or_skip(kernels)
    from gguf import GGUFReader

    from raylm.model.loader import load_model
    from raylm.testing.gguf_writer import write_gguf

    folder = tiny_model_dir(
        "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    mix = (
        (lambda name, shape: "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K")
        if variant == "Q4_K_M"
        else None
    )
    path = write_gguf(folder, tmp_path / "m.gguf", "Q8_0", tensor_type=mix)
    file_bytes = sum(
        int(t.n_bytes)
        for t in GGUFReader(str(path)).tensors
        if t.tensor_type.name in quant_kernels.GGUF_TYPE_CODES and t.name != "token_embd.weight"
    )
    model = load_model(str(path), torch.bfloat16, "cpu")
    held = bytes_held_once(model, torch.uint8)
    assert file_bytes <= held <= 1.05 * file_bytes, (held, file_bytes)
    linears = [m for m in model.modules() if getattr(m, "quant_matmul", None) is not None]
    assert sum(m.quant_matmul.nbytes for m in linears) == held


@pytest.mark.slow
@pytest.mark.parametrize(
    "march,kernels_expected,absent",
    [
        ("haswell", ["avx2"], ("zmm", "vpdpbusd")),  # AVX2 only
        ("alderlake", ["avx_vnni", "avx2"], ("zmm",)),  # AVX2 + AVX-VNNI, no AVX-512
    ],
)
def test_the_decode_kernel_builds_for_cpus_without_avx512(march, kernels_expected, absent, tmp_path):
    """This machine runs the 256-bit kernels with AVX-512 enabled around them; compiled for
    a consumer CPU (as its -march=native build would be), quant_decode.cpp must build and
    use no AVX-512 register or (on plain AVX2) no vpdpbusd."""
    import subprocess

    from torch.utils import cpp_extension

    from raylm.model.layers.cpu_kernels import _CSRC

    include = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_path("include")]]
    assembly = tmp_path / "quant_decode.s"
    subprocess.run(
        [
            cpp_extension.get_cxx_compiler(),
            "-std=c++17",
            "-O1",
            f"-march={march}",
            "-fopenmp",
            "-S",
            "-DTORCH_EXTENSION_NAME=check",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            *include,
            str(_CSRC / "quant_decode.cpp"),
            "-o",
            str(assembly),
        ],
        check=True,
        capture_output=True,
    )
    text = assembly.read_text()
    for name in absent:
        assert name not in text, f"{name} in the -march={march} build"
    # The variants this build registers are string literals in its data.
    for name in kernels_expected:
        assert f'"{name}"' in text
    assert '"avx512_vnni"' not in text


@pytest.mark.parametrize("qtype", list(ENCODERS))
def test_every_variant_gives_the_same_bits(qtype, kernels):
    """A model gives the same tokens whichever instruction set its CPU runs
    (RAYLM_QUANT_KERNEL, or another machine of the cluster): integer dots in
    any order, then the same float operations per column, to the bit."""
    _packed_or_skip(kernels)
    weight, _ = _weight(qtype, rows=40, cols=512)
    code = quant_kernels.GGUF_TYPE_CODES[qtype]
    packed = kernels.quant_pack(weight.data, code)
    try:
        for rows in (1, 2, 3, 9):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
            outs = {}
            for variant in kernels.quant_packed_variants():
                kernels.quant_packed_use(variant)
                outs[variant] = kernels.quant_packed_linear(x, packed, code, 40)
            first = next(iter(outs.values()))
            assert all(torch.equal(first, out) for out in outs.values()), f"{rows} rows: variants differ"
    finally:
        kernels.quant_packed_use("auto")
