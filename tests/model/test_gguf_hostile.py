"""Crafted GGUF files (issue 48): every declared count, length, dimension and
offset is checked against the file's bytes, and the metadata that sizes the
model against sane limits and the tensors present, before anything is read
or allocated by it. Each bad file is a quick ValueError naming the field; the
timeouts only guard against a hang (gguf's own reader loops on the first file
for hours, its memory growing)."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from raylm.model.gguf import open_gguf
from raylm.model.gguf.header import MAX_ARRAY_ELEMENTS, check_header

U8, STRING, ARRAY = 0, 8, 9  # GGUF value types
F32 = 0  # ggml type


def string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def key_value(key: bytes, vtype: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", vtype) + payload


def tensor_info(name: bytes, dims: list[int], ggml_type: int = F32, offset: int = 0) -> bytes:
    return string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def refused(path, *fragments: str) -> str:
    """open_gguf's ValueError, which must name each of `fragments`."""
    with pytest.raises(ValueError) as info:
        open_gguf(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def crafted(tmp_path):
    def write(data: bytes, name: str = "x.gguf"):
        path = tmp_path / name
        path.write_bytes(data)
        return path

    return write


@pytest.mark.timeout(20)
def test_uint8_array_counting_2_to_the_40_in_73_bytes(crafted):
    # The issue's file: gguf's reader walks 2**40 elements past the end of it.
    data = header(0, 1) + key_value(b"tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", U8, 2**40))
    assert len(data) == 73
    refused(crafted(data), "'tokenizer.ggml.token_type'", "array")


@pytest.mark.timeout(20)
def test_array_within_the_file_but_past_the_element_limit(crafted):
    # Every byte present, but gguf's reader would spend ~650 bytes and 9 us on each.
    count = MAX_ARRAY_ELEMENTS + 1
    data = header(0, 1) + key_value(b"tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", U8, count) + bytes(count))
    refused(crafted(data), "'tokenizer.ggml.scores'", f"more than the {MAX_ARRAY_ELEMENTS} allowed")


@pytest.mark.timeout(20)
def test_string_array_whose_strings_outrun_the_file(crafted):
    items = string(b"a") + struct.pack("<Q", 2**62)  # the second string claims 2**62 bytes
    data = header(0, 1) + key_value(b"tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2) + items)
    refused(crafted(data), "'tokenizer.ggml.tokens'")


@pytest.mark.timeout(20)
def test_arrays_nested_deeply(crafted):
    nested = struct.pack("<IQ", ARRAY, 1) * 5 + struct.pack("<IQ", U8, 0)
    refused(crafted(header(0, 1) + key_value(b"general.deep", ARRAY, nested)), "'general.deep'", "nested")


@pytest.mark.timeout(20)
def test_string_value_of_length_2_to_the_62(crafted):
    data = header(0, 1) + key_value(b"general.name", STRING, struct.pack("<Q", 2**62) + b"tiny")
    refused(crafted(data), "'general.name'")


@pytest.mark.timeout(20)
def test_key_of_length_2_to_the_62(crafted):
    refused(crafted(header(0, 1) + struct.pack("<Q", 2**62) + b"general.name"), "metadata key #0")


@pytest.mark.timeout(20)
def test_tensor_count_2_to_the_50(crafted):
    refused(crafted(header(2**50, 0) + bytes(64)), "tensor count", str(2**50))


@pytest.mark.timeout(20)
def test_metadata_key_count_past_the_bytes_left(crafted):
    refused(crafted(header(0, 1000) + bytes(64)), "metadata key count", "1000")


@pytest.mark.timeout(20)
def test_tensor_with_1000_dims(crafted):
    data = header(1, 0) + string(b"blk.0.attn_q.weight") + struct.pack("<I", 1000) + bytes(64)
    refused(crafted(data), "'blk.0.attn_q.weight'", "n_dims 1000")


@pytest.mark.timeout(20)
def test_dims_whose_product_overflows_64_bits(crafted):
    # 2**33 * 2**31 = 2**64: numpy's uint64 product (gguf's) wraps it to 0 bytes.
    data = header(1, 0) + tensor_info(b"token_embd.weight", [2**33, 2**31])
    data += bytes(-len(data) % 32) + bytes(64)
    refused(crafted(data), "'token_embd.weight'", "needs bytes up to")


@pytest.mark.timeout(20)
def test_tensor_data_offset_past_the_end_of_the_file(crafted):
    data = header(1, 0) + tensor_info(b"output_norm.weight", [4], offset=4096)
    data += bytes(-len(data) % 32) + bytes(16)
    refused(crafted(data), "'output_norm.weight'", "needs bytes up to")


@pytest.mark.timeout(20)
def test_tensor_name_too_long_and_unknown_type(crafted):
    refused(crafted(header(1, 0) + tensor_info(b"w" * 100, [4]) + bytes(32)), "the name of tensor #0")
    refused(
        crafted(header(1, 0) + tensor_info(b"w", [4], ggml_type=999) + bytes(32), "t.gguf"),
        "'w'",
        "unknown ggml type 999",
    )


# A tiny valid llama file, written with the gguf package: hidden 8, 2 heads,
# feed-forward 16, one block, 16 tokens; float32 weights.
TINY = {
    "context_length": 64,
    "embedding_length": 8,
    "feed_forward_length": 16,
    "block_count": 1,
    "attention.head_count": 2,
    "attention.head_count_kv": 2,
    "vocab_size": 16,
}


def write_tiny(path, byte_order=gguf.GGUFEndian.LITTLE, **metadata):
    writer = gguf.GGUFWriter(str(path), "llama", endianess=byte_order)
    for key, value in {**TINY, **metadata}.items():
        writer.add_uint64(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    shapes = {
        "token_embd.weight": (16, 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (8, 8),
        "blk.0.attn_v.weight": (8, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_gate.weight": (16, 8),
        "blk.0.ffn_up.weight": (16, 8),
        "blk.0.ffn_down.weight": (8, 16),
    }
    for name, shape in shapes.items():  # numpy shapes: ggml's dims reversed
        writer.add_tensor(name, np.ones(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.timeout(20)
def test_the_tiny_file_itself_opens(tmp_path):
    config = open_gguf(write_tiny(tmp_path / "tiny.gguf")).config_dict()
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (8, 1, 16)
    check_header(write_tiny(tmp_path / "big_endian.gguf", gguf.GGUFEndian.BIG))  # gguf's reader reads both orders


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "key, value",
    [
        ("context_length", 2**40),
        ("block_count", 2**31),
        ("vocab_size", 2**40),
        ("attention.head_count", 2**20),
        ("attention.head_count", 0),
        ("attention.head_count_kv", 2**32),
        ("embedding_length", 2**33),
        ("feed_forward_length", 2**40),
        ("attention.key_length", 2**20),
        ("expert_count", 2**40),
    ],
)
def test_absurd_model_sizes_in_a_valid_file(tmp_path, key, value):
    refused(write_tiny(tmp_path / "m.gguf", **{key: value}), f"llama.{key}", str(value))


@pytest.mark.timeout(20)
def test_more_heads_than_embedding_width(tmp_path):
    # No key_length: the head dim is the width over the heads, here 0.
    refused(
        write_tiny(tmp_path / "m.gguf", **{"attention.head_count": 16}),
        "llama.attention.key_length (absent: embedding_length 8 / head_count 16)",
    )


@pytest.mark.timeout(20)
def test_sizes_within_limits_but_beyond_the_tensors(tmp_path):
    # The model is allocated from these before a weight is read.
    wide = write_tiny(tmp_path / "wide.gguf", embedding_length=1 << 16, **{"attention.head_count": 64})
    refused(wide, "'token_embd.weight'", "[65536, 16]")
    refused(write_tiny(tmp_path / "deep.gguf", block_count=512), "'blk.1.attn_q.weight'", "block_count 512")
    refused(write_tiny(tmp_path / "ff.gguf", feed_forward_length=1 << 18), "'blk.0.ffn_gate.weight'")


@pytest.mark.timeout(60)
def test_engine_start_up_refuses_the_73_byte_file(crafted, tiny_model_dir, tmp_path, monkeypatch):
    # The issue's command line: `raylm generate --model x.gguf --tokenizer DIR`;
    # without --tokenizer, transformers would read the file with gguf's reader.
    from raylm.config import create_engine_config

    monkeypatch.setenv("RAYLM_GGUF_CACHE", str(tmp_path / "cache"))
    path = crafted(header(0, 1) + key_value(b"tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", U8, 2**40)))
    for settings in ({"tokenizer": tiny_model_dir("llama")}, {}):
        with pytest.raises(ValueError, match="tokenizer.ggml.token_type"):
            create_engine_config(str(path), **settings)
