"""Encoders for GGUF's Q4_K and Q6_K blocks, for tests that write their own
GGUF files (the `gguf` package decodes every type but encodes only the simple
ones). Round to nearest with one scale per sub-block: plainer than
llama-quantize's search, and enough to make files whose decoding the tests
check against `gguf.quants.dequantize`, the format's own reference."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 144] uint8 Q4_K blocks."""
    rows, cols = weights.shape
    x = weights.astype(np.float32).reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks of 32
    lo = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - lo) / 15.0
    d = scale.max(axis=1) / 63.0
    dmin = (-lo).max(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    safe = lambda v: np.where(v == 0, 1.0, v)  # noqa: E731
    sc = np.clip(np.round(scale / safe(d16)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / safe(dmin16)[:, None]), 0, 63).astype(np.uint8)
    step = d16[:, None] * sc
    q = np.round((x + (dmin16[:, None] * mn)[:, :, None]) / safe(step)[:, :, None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # chunks of 64: low / high nibbles
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    packed = np.zeros((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    blocks = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), packed, qs], axis=1)
    return blocks.reshape(rows, cols // QK_K * 144)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 210] uint8 Q6_K blocks."""
    rows, cols = weights.shape
    x = weights.astype(np.float32).reshape(-1, 16, 16)  # super-blocks of 16 sub-blocks of 16
    scale = np.abs(x).max(axis=2) / 31.0
    d = np.abs(scale).max(axis=1) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d16 == 0, 1.0, d16)[:, None]), -128, 127).astype(np.int8)
    step = d16[:, None] * sc
    q = np.round(x / np.where(step == 0, 1.0, step)[:, :, None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)  # two halves of 4 x 32
    ql = np.concatenate(
        [q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2
    ).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1)
    return blocks.reshape(rows, cols // QK_K * 210)
