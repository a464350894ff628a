"""helmc.model.quant_formats: the block formats against gguf's NumPy dequantizers (the reference), ggml's
reference quantizers (golden hashes) and error bounds that a broken quantizer fails."""
import hashlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")   # the GPU machine runs pytest -m gpu without it

from helmc.errors import HelmcError  # noqa: E402
from helmc.model.quant_formats import QUANT_TYPES, dequantize, quant_type, quantize  # noqa: E402

BLOCK_TYPES = ("q8_0", "q4_0", "q5_0", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")


def structured_rows(k=1024, seed=0) -> np.ndarray:
    """float32 [rows, k]: Gaussian, Laplace, Student-t(2), positive-only, negative-only, sparse outliers and
    rows over three decades of scale; then an all-zero block, a block with one outlier, a negative-only
    block and a constant block in the first rows (block boundaries at 256, so every type sees them whole).
    Scales stay >= 0.1 so that every scale is a normal fp16 (smaller ones lose precision in every ggml
    format alike: fp16 subnormals)."""
    rng = np.random.default_rng(seed)
    n = 16
    x = np.concatenate([rng.standard_normal((n, k)), rng.laplace(size=(n, k)), rng.standard_t(2, (n, k)),
                        np.abs(rng.standard_normal((n, k))) + 3, -np.abs(rng.standard_normal((n, k))),
                        np.where(rng.random((n, k)) < 0.01, 50, 1) * rng.standard_normal((n, k)),
                        rng.uniform(-1, 1, (n, k)) * 10.0 ** rng.uniform(-1, 2, (n, 1))]).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] *= 0.01
    x[1, 100] = 5.0
    x[2, 256:512] = -np.abs(x[2, 256:512])
    x[3, :256] = -0.3
    return x


def golden_rows() -> np.ndarray:
    """float32 [16, 512] from integer arithmetic and exactly rounded float ops only (the same bits on every
    platform): heavy-tailed values, rows scaled by powers of two, an all-zero block, a block with one
    outlier, a negative-only block."""
    i = np.arange(16 * 512, dtype=np.uint64)
    v = i * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)        # wraps mod 2^64
    u = ((v >> np.uint64(40)).astype(np.float32) - np.float32(2**23)) / np.float32(2**23)   # [-1, 1)
    x = (u * u * u).reshape(16, 512) * (np.float32(2) ** -(np.arange(16) % 8)).astype(np.float32)[:, None]
    x[3, 256:] = 0
    x[5, :256] *= np.float32(0.01)
    x[5, 77] = np.float32(4)
    x[7, 256:] = -np.abs(x[7, 256:])
    return x


# sha256 of ggml's reference quantizers' output for golden_rows() (quantize_row_*_ref from llama.cpp
# 0c1e570's ggml-quants.c, gcc -O2 -ffp-contract=off, called through ctypes): helmc's bytes must be these.
GGML_REFERENCE_SHA256 = {
    "q8_0": "3717f41cf41dbe3dacf131e09e5446d67edac1f9a38e5969dac95d38fa38138f",
    "q4_0": "82119e105dc248b1e360f245658cc162d27db9dc445c7a1c64b6981df7aaf72e",
    "q5_0": "4475e64ea0301aefe8465dadbfcade5b3623ba047ab829c5267009b640af024f",
    "q3_k": "be9552fba2e9d42a3844d2d01b2ef904211310231cba5666c32d5ea3f67167a6",
    "q4_k": "6f5486eb14f9c8671efee967b304a3f0525deae8ecae3e77325190b1d9af2441",
    "q5_k": "8053724638862a273e4bed7d3ec1cb084879546fd37f1335cd0f34e2a1120e34",
    "q6_k": "814d0254609c1e9d4f7f54377a58f5f4f177a42a31556d8cfc2b6d9084d69472",
    "iq4_xs": "96eb3e890566537b7aaced16a2c83e4c0203bc45dde0dc03e30a83ba3a7cdc3c",
    "mxfp4": "9ac82f85ab82969afdf56bbcd7e3aee7efe6d25ca8e530e59924c89da5c0896b",
}


def roundtrip(x, name):
    raw = quantize(x, name)
    return raw, dequantize(raw, name, x.shape)


def test_the_table_matches_gguf():
    expect = {"q8_0": (32, 34, 8.5), "q4_0": (32, 18, 4.5), "q5_0": (32, 22, 5.5), "q3_k": (256, 110, 3.4375),
              "q4_k": (256, 144, 4.5), "q5_k": (256, 176, 5.5), "q6_k": (256, 210, 6.5625), "iq4_xs": (256, 136, 4.25),
              "mxfp4": (32, 17, 4.25)}
    for name, (bw, bb, bpw) in expect.items():
        t = quant_type(name)
        assert (t.block_weights, t.block_bytes, t.bits_per_weight) == (bw, bb, bpw)
        assert gguf.GGML_QUANT_SIZES[t.ggml_type] == (bw, bb)
        assert t.row_bytes(4096) == 4096 // bw * bb
    assert quant_type("f16").row_bytes(10) == 20 and quant_type("f32").bits_per_weight == 32
    assert set(QUANT_TYPES) == {"q8_0", "q4_0", "q5_0", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "mxfp4", "f16", "bf16",
                                "f32"}


def test_iq4_xs_block_layout():
    """dequantize reads a block as ggml's dequantize_row_iq4_xs: w = d * (ls_j - 32) * kvalues[q], ls_j's low 4 bits
    in scales_l, its top 2 in scales_h."""
    kvalues = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
    block = np.zeros(136, np.uint8)
    block[0:2] = np.array([0.5], np.float16).view(np.uint8)
    scales = [(7 * j + 3) % 64 for j in range(8)]                    # 6-bit scales, both high bits used
    block[2:4] = np.array([sum((s >> 4) << (2 * j) for j, s in enumerate(scales))], np.uint16).view(np.uint8)
    block[4:8] = [(scales[2 * i] & 15) | (scales[2 * i + 1] & 15) << 4 for i in range(4)]
    q = np.arange(256) % 16                                          # weight 32j + i: its nibble
    block[8:] = [q[32 * j + i] | q[32 * j + 16 + i] << 4 for j in range(8) for i in range(16)]
    expect = np.array([0.5 * (scales[e // 32] - 32) * kvalues[q[e]] for e in range(256)], np.float32)
    assert np.array_equal(dequantize(block.reshape(1, 136), "iq4_xs", (1, 256))[0], expect)


def test_mxfp4_block_layout():
    """dequantize reads a block as ggml's dequantize_row_mxfp4: w = kvalues_mxfp4[q] * 2^(e - 128) (e2m1 doubled, the
    e8m0 scale halved), weight i in the low nibble of byte 1 + i and weight i + 16 in its high one; e = 0 and 1 are the
    subnormal scales 2^-128 and 2^-127."""
    kvalues = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
    q = (np.arange(32) * 7 + 3) % 16                                 # weight i: its nibble, every one used
    blocks = np.zeros((4, 17), np.uint8)
    blocks[:, 0] = (130, 0, 1, 200)
    blocks[:, 1:] = q[:16] | q[16:] << 4
    got = dequantize(blocks, "mxfp4", (4, 32)).astype(np.float64)
    for b, e in enumerate((130, 0, 1, 200)):
        assert np.array_equal(got[b], [kvalues[v] * 2.0 ** (e - 128) for v in q]), e
    with pytest.raises(HelmcError, match=r"\[2, 48\].*block size 32"):
        quantize(np.zeros((2, 48), np.float32), "mxfp4")


def test_an_unknown_type_is_refused_with_the_choices():
    with pytest.raises(HelmcError, match=r"q8_0, q4_0, q5_0, q3_k, q4_k, q5_k, q6_k.*'q2_k'"):
        quant_type("q2_k")


@pytest.mark.parametrize("name,k", [("q4_k", 100), ("q3_k", 320), ("q6_k", 288), ("q8_0", 48), ("q4_0", 20), ("q5_0", 40)])
def test_rows_not_a_whole_number_of_blocks_are_refused(name, k):
    bw = quant_type(name).block_weights
    with pytest.raises(HelmcError, match=rf"\[3, {k}\].*block size {bw}"):
        quantize(np.zeros((3, k), np.float32), name)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_bytes_are_ggml_reference_bytes(name):
    raw = quantize(golden_rows(), name)
    assert raw.shape == (16, quant_type(name).row_bytes(512)) and raw.dtype == np.uint8
    assert hashlib.sha256(raw.tobytes()).hexdigest() == GGML_REFERENCE_SHA256[name]


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_max_error_per_block(name):
    """Bounds on the largest error of each block, from the format (q8_0, q4_0) or measured (k-quants):
    q8_0: half a step of absmax/127 plus the fp16 rounding of d: < absmax/127.
    q4_0: d = max/-8 puts the block's extreme at -8; the opposite extreme clips at +7: one step, absmax/8.
    q5_0: the same with d = max/-16 and +15: absmax/16, times 1 + 16 * 2^-11 for the fp16 rounding of d (measured
          1.0023 of absmax/16).
    q4_k: measured <= 0.073 of the block's range (max(max, 0) - min(min, 0)) on these rows, the worst in the
          negative-only rows, where ggml's 6-bit mins of the other sub-blocks round against the largest;
          half a step of the largest sub-block scale is ~range/30. Bound range/10; a q4_k with its nibbles
          swapped breaks it in 446 of 448 blocks.
    q5_k: measured <= 0.036 of the range, the same worst rows as q4_k; bound range/20.
    q6_k: measured <= 0.016 absmax; bound absmax/32 (one step of the largest scale).
    q3_k: measured <= 0.251 absmax (three seeds): one step of the largest sub-block scale, ~absmax/4, where a
          weight clips at level +3 of a sub-block scaled from its negative extreme; bound absmax/3.5.
    iq4_xs: measured <= 0.136 absmax (three seeds): the table's widest gaps (23 and 24 of 127) at the extremes, under
          a 6-bit sub-block scale of the block's largest; bound absmax/6.
    mxfp4: the scale is P/8, P = 2^floor(log2 absmax), so the top level 12 P/8 = 1.5 P clips absmax < 2P by under
          absmax/4, and the widest gap (8 to 12) is P/2, half of it P/4 <= absmax/4; measured 0.24997 absmax."""
    x = structured_rows()
    raw, y = roundtrip(x, name)
    assert raw.shape == (x.shape[0], quant_type(name).row_bytes(x.shape[1]))
    bw = quant_type(name).block_weights
    b = x.reshape(-1, bw)                                      # [blocks, block weights]
    err = np.abs(y - x).reshape(-1, bw).max(axis=1)
    absmax = np.abs(b).max(axis=1)
    span = np.maximum(b.max(axis=1), 0) - np.minimum(b.min(axis=1), 0)      # the range, 0 included
    bound = {"q8_0": absmax / 127, "q4_0": absmax / 8 * 1.002, "q5_0": absmax / 16 * (1 + 16 * 2**-11), "q3_k": absmax / 3.5, "q4_k": span / 10, "q5_k": span / 20,
             "q6_k": absmax / 32, "iq4_xs": absmax / 6, "mxfp4": absmax / 4}[name]
    bad = np.nonzero(err > bound)[0]
    assert bad.size == 0, f"{name}: {bad.size} blocks over the bound, worst ratio {(err / np.maximum(bound, 1e-30)).max():.3f}"
    zero = absmax == 0
    assert zero.any() and np.all(y.reshape(-1, bw)[zero] == 0), "an all-zero block must come back exactly zero"


def _fixed_scale_baseline(x, name):
    """The same sub-blocks with exact float32 scales taken from the range, no search: q4_k / q5_k affine 4 / 5-bit,
    (max - min)/15 or /31 from min per 32; q6_k / q3_k symmetric 6 / 3-bit, the largest |x| at level -32 / -4
    per 16."""
    if name in ("q4_k", "q5_k"):
        top = 15 if name == "q4_k" else 31
        b = x.reshape(-1, 32)
        lo, hi = np.minimum(b.min(1, keepdims=True), 0), b.max(1, keepdims=True)
        s = np.where(hi > lo, (hi - lo) / top, 1)
        return (np.clip(np.rint((b - lo) / s), 0, top) * s + lo).reshape(x.shape)
    b = x.reshape(-1, 16)
    mx = b[np.arange(len(b)), np.abs(b).argmax(1)][:, None]
    top = 4 if name == "q3_k" else 32
    d = np.where(mx != 0, -mx / top, 1)
    return (np.clip(np.rint(b / d), -top, top - 1) * d).reshape(x.shape)


@pytest.mark.parametrize("name,ratio,rel", [("q4_k", 0.95, 0.075), ("q5_k", 0.97, 0.038), ("q6_k", 0.97, 0.019),
                                            ("q3_k", 0.985, 0.152)])
def test_k_quants_beat_a_fixed_scale_baseline(name, ratio, rel):
    """ggml's k-quant search (scales refit by weighted least squares) gets below a fixed-scale quantizer
    even though its scales are rounded to 6 / 8 bits and fp16 and the baseline's are exact: measured on
    Gaussian rows q4_k 0.912x (0.0713 of the RMS), q5_k 0.954x (0.0361), q6_k 0.947x (0.0177) and q3_k 0.975x
    (0.1509) of the baseline's RMS error;
    a quantizer without the search, or with its scales misplaced, does not."""
    x = np.random.default_rng(0).standard_normal((256, 4096)).astype(np.float32)
    _, y = roundtrip(x, name)
    rms = lambda a: float(np.sqrt(np.mean(a * a)))
    mine, base = rms(y - x), rms(_fixed_scale_baseline(x, name) - x)
    assert mine < ratio * base, (mine, base)
    assert mine < rel * rms(x)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_deterministic_and_independent_of_threads(name):
    x = structured_rows(k=512, seed=3)
    a = quantize(x, name, threads=1)
    assert np.array_equal(a, quantize(x, name, threads=1))
    assert np.array_equal(a, quantize(x, name, threads=2))
    assert np.array_equal(a[5], quantize(x[5], name)[0])            # a 1-D weight is one row


# For each type: a byte of the first block's scales and the weights it governs in gguf's dequantizer.
SCALE_BYTE = {"q8_0": (1, slice(0, 32)),          # d's high byte: the whole 32-weight block
              "q4_0": (1, slice(0, 32)),
              "q5_0": (1, slice(0, 32)),
              "q3_k": (96, slice(0, 16)),         # scales[0]: low nibbles of sub-blocks 0 (bits 0-3) and 8
              "q4_k": (4, slice(0, 32)),          # scales[0]: 6-bit scale of sub-block 0 (weights 0-31)
              "q5_k": (4, slice(0, 32)),
              "q6_k": (192 + 3, slice(48, 64)),   # scales[3]: int8 scale of sub-block 3 (weights 48-63)
              "iq4_xs": (4, slice(0, 32)),        # scales_l[0]: low nibble, sub-block 0's scale (weights 0-31)
              "mxfp4": (0, slice(0, 32))}         # e: the whole 32-weight block


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_a_corrupted_scale_byte_changes_exactly_its_weights(name):
    x = np.random.default_rng(1).standard_normal((2, 512)).astype(np.float32)
    raw = quantize(x, name)
    y = dequantize(raw, name, x.shape)
    byte, governed = SCALE_BYTE[name]
    bad = raw.copy()
    bad[0, byte] ^= 0x05
    z = dequantize(bad, name, x.shape)
    changed = np.nonzero(z[0] != y[0])[0]
    assert changed.size and changed.min() >= governed.start and changed.max() < governed.stop, changed
    assert np.array_equal(z[1], y[1])


def test_plain_float_types_round_trip():
    x = structured_rows(k=256)
    assert np.array_equal(dequantize(quantize(x, "f32"), "f32", x.shape), x)
    assert np.array_equal(dequantize(quantize(x, "f16"), "f16", x.shape), x.astype(np.float16).astype(np.float32))
    assert np.array_equal(dequantize(x.astype(np.float16), "f16", x.shape), x.astype(np.float16).astype(np.float32))
    bf = dequantize(quantize(x, "bf16"), "bf16", x.shape)
    assert np.max(np.abs(bf - x) / np.maximum(np.abs(x), 1e-30)) <= 2**-8


def test_non_finite_weights_are_refused():
    x = np.zeros((4, 256), np.float32)
    x[2, 7] = np.nan
    with pytest.raises(HelmcError, match="non-finite"):
        quantize(x, "q4_k")
