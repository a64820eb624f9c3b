"""The fields layout of prepared weight codes (kernels/gemm/fields.py): the bit permutation,
its conversions, and the decode formulas the kernels' asm runs on it."""

from __future__ import annotations

import struct
from collections import OrderedDict

import pytest
import torch

import fp4moe
from fp4moe.kernels.gemm.fields import (
    FIELD_MASK,
    FIELD_ROTATIONS,
    LAST_KEEP,
    LAST_MOVE,
    REGISTERS,
    field_bit,
    from_fields,
    to_fields,
)
from fp4moe.nvfp4 import decode_e2m1
from testing import random_moe_weights


def _rotl(x: int, d: int) -> int:
    return ((x << d) | (x >> (32 - d))) & 0xFFFFFFFF


def _decode(word: int) -> list[float]:
    """The four registers of the decode asm (``decode._register``) of a fields-layout word,
    each half read as bf16 and times 2^126: the word's 8 values in element order."""
    regs = [_rotl(word, d) & FIELD_MASK for d in FIELD_ROTATIONS]
    regs.append((word & LAST_KEEP) + ((word & LAST_MOVE) << 8))
    out = [0.0] * 8
    for r, pair in zip(regs, REGISTERS):
        for h, e in enumerate(pair):
            half = (r >> (16 * h)) & 0xFFFF
            out[e] = struct.unpack("<f", struct.pack("<I", half << 16))[0] * 2.0**126
    return out


def _word(b: torch.Tensor) -> int:
    return int(b.view(torch.int32).item()) & 0xFFFFFFFF


def test_field_bits_are_a_permutation():
    assert sorted(field_bit(i) for i in range(32)) == list(range(32))
    with pytest.raises(StopIteration):
        field_bit(32)


def test_decode_of_every_code_at_every_place():
    """Each of the 16 codes at each of the 8 places of a word (the others random) decodes
    to its e2m1 value, code 8 to zero, through the asm's masks and rotations."""
    g = torch.Generator().manual_seed(0)
    for place in range(8):
        for code in range(16):
            lin = torch.randint(0, 256, (4,), dtype=torch.uint8, generator=g)
            nib = torch.stack((lin & 0xF, lin >> 4), dim=-1).flatten()
            nib[place] = code
            lin = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)
            got = _decode(_word(to_fields(lin)))
            want = decode_e2m1(nib).tolist()
            assert got == want, (place, code)


def test_conversions_round_trip_and_refuse_bad_codes():
    g = torch.Generator().manual_seed(1)
    for shape in ((3, 5, 64), (7, 16), (0, 16), (2, 0, 32)):
        c = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        f = to_fields(c)
        assert f.shape == c.shape and f.dtype == torch.uint8 and f.is_contiguous()
        assert torch.equal(from_fields(f), c)
    c = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=g)
    w, x = _word(c[1, 4:8]), _word(to_fields(c)[1, 4:8])
    assert x == sum(((w >> i) & 1) << field_bit(i) for i in range(32))
    strided = c.t().contiguous().t()  # the same values, not contiguous
    assert torch.equal(to_fields(strided), to_fields(c))
    kept = c.clone()
    to_fields(c)
    assert torch.equal(c, kept)  # the caller's tensor unchanged
    with pytest.raises(TypeError, match=r"codes: expected torch\.uint8"):
        to_fields(c.to(torch.int16))
    with pytest.raises(ValueError, match="codes: the last dimension"):
        to_fields(c[:, :6])


def test_conversions_in_chunks_match_row_by_row():
    """Codes of more than one conversion chunk (1 MB on the CPU; the last one partial): the
    same words as converting each row on its own."""
    g = torch.Generator().manual_seed(2)
    c = torch.randint(0, 256, (40001, 64), dtype=torch.uint8, generator=g)  # 2.4 chunks
    f = to_fields(c)
    for r in (0, 16383, 16384, 32768, 40000):
        assert torch.equal(f[r], to_fields(c[r : r + 1])[0]), r
    assert torch.equal(from_fields(f), c)


def test_layer_converts_a_version_1_state_dict():
    """A MoELayer state dict whose metadata says version 1 (linear codes, earlier fp4moe)
    loads as the same experts; one of version 2, or without metadata, loads as it is."""
    w13, w2 = random_moe_weights(4, 64, 32, seed=3)
    experts = fp4moe.prepare_experts(w13, w2)
    layer = fp4moe.MoELayer(experts, fp4moe.RouterConfig(top_k=2), policy="w4a16")
    sd = layer.state_dict()
    lin = experts.to_linear()
    old = OrderedDict(sd)
    old["w13_codes"], old["w2_codes"] = lin["w13_codes"], lin["w2_codes"]
    old._metadata = {"": {"version": 1}}  # what an earlier fp4moe's state_dict carried
    other = fp4moe.MoELayer(
        fp4moe.prepare_experts(w13 * 2, w2), fp4moe.RouterConfig(top_k=2), policy="w4a16"
    )
    other.load_state_dict(old)
    assert torch.equal(other.w13_codes, experts.w13_codes)
    assert torch.equal(other.w2_codes, experts.w2_codes)
    assert torch.equal(old["w13_codes"], lin["w13_codes"])  # the caller's dict unchanged
    assert sd._metadata[""]["version"] == 2
    plain = {k: v.clone() for k, v in sd.items()}  # no metadata: taken as it is
    other.load_state_dict(plain)
    assert torch.equal(other.w13_codes, experts.w13_codes)


# ------------------------------------------------------------------ the decode's PTX


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bits16(v: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", v))[0]
    assert b & 0xFFFF == 0, v  # every product of the decode is exact in bf16
    return b >> 16


def _run_ptx(text: str, regs: dict) -> dict:
    """The decode asm's PTX (``decode._decode_asm``, ``decode._word_asm``), one statement
    at a time on Python ints: the few instructions it uses. ``regs``: "$k" -> value."""
    r = dict(regs)

    def val(x: str) -> int:
        x = x.strip()
        return r[x] if x in r else int(x, 0)

    for stmt in text.replace("{\n", "\n").split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        if op == "mov.b32" and rest.startswith("{"):  # unpack: the first the low half
            dst, src = rest.split("},")
            lo, hi = (d.strip() for d in dst.strip("{ ").split(","))
            r[lo], r[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *a = (x.strip() for x in rest.split(",", 1)[0:1] + rest.split(",", 1)[1:])
        if op == "mov.b32" and a[0].startswith("{"):  # pack two halves
            lo, hi = (x.strip() for x in a[0].strip("{} ").split(","))
            r[d] = val(lo) | (val(hi) << 16)
            continue
        a = [x.strip() for x in a[0].split(",")] if a else []
        if op == "mov.b32":
            r[d] = val(a[0])
        elif op == "and.b32":
            r[d] = val(a[0]) & val(a[1])
        elif op == "shf.l.wrap.b32":
            n = val(a[2]) % 32
            r[d] = (((val(a[1]) << 32 | val(a[0])) << n) >> 32) & 0xFFFFFFFF
        elif op in ("mad.lo.u32", "mul.lo.u32"):
            r[d] = val(a[0]) * val(a[1]) + (val(a[2]) if op[0] == "m" and len(a) > 2 else 0)
            r[d] &= 0xFFFFFFFF
        elif op == "prmt.b32":
            src = val(a[0]) | (val(a[1]) << 32)
            sel = val(a[2])
            r[d] = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "fma.rn.bf16x2":
            x, y, z = (val(v) for v in a)
            r[d] = sum(_bits16(_bf16(x >> s) * _bf16(y >> s) + _bf16(z >> s)) << s for s in (0, 16))
        else:
            raise AssertionError(f"unexpected PTX {stmt!r}")
    return r


def _linear_values(lin_word: int, scale: float) -> list[float]:
    """The 8 elements of a linear code word times ``scale`` times 2^-8 (what the asm gives)."""
    nib = torch.tensor([(lin_word >> (4 * n)) & 0xF for n in range(8)], dtype=torch.uint8)
    return [v * scale * 2.0**-8 for v in decode_e2m1(nib).tolist()]


@pytest.mark.parametrize("words", [2, 1])
def test_decode_asm_gives_the_linear_elements(words):
    """The weights' decode asm (``CHUNK_DECODE_ASM``, ``HALF_DECODE_ASM``) on fields-layout
    words gives what the linear asm gives on the same codes linear (activations; the
    8-byte ``LINEAR_DECODE_ASM``): output register j (j < 2 words) the even elements of
    bytes 2j and 2j + 1, register 2 words + j their odd ones, each times its byte pair's
    scale."""
    from fp4moe.kernels.gemm import decode

    g = torch.Generator().manual_seed(words)
    n = 2 * words
    for _ in range(200):
        lin = torch.randint(0, 256, (4 * words,), dtype=torch.uint8, generator=g)
        fld = to_fields(lin)
        scales = [float(2 ** int(torch.randint(-6, 9, (1,), generator=g))) for _ in range(n)]
        sreg = {f"${2 * n + words + j}": _bits16(scales[j] * 2.0**118) * 0x10001 for j in range(n)}
        weights = (decode.CHUNK_DECODE_ASM if words == 2 else decode.HALF_DECODE_ASM).value
        regs = {f"${2 * n + w}": _word(fld[4 * w : 4 * w + 4]) for w in range(words)}
        got = _run_ptx(weights, {**regs, **sreg})
        outs = [[got[f"${k}"] for k in range(2 * n)]]
        if words == 2:  # the activations' decode of the same codes, linear
            regs = {f"${2 * n + w}": _word(lin[4 * w : 4 * w + 4]) for w in range(words)}
            got = _run_ptx(decode.LINEAR_DECODE_ASM.value, {**regs, **sreg})
            assert [got[f"${k}"] for k in range(2 * n)] == outs[0]
        for j in range(n):  # the linear meaning: byte pair j's even, then odd elements
            w, p = divmod(j, 2)
            vals = _linear_values(_word(lin[4 * w : 4 * w + 4]), scales[j])
            lo, hi = outs[0][j], outs[0][n + j]
            assert [_bf16(lo), _bf16(lo >> 16)] == [vals[4 * p], vals[4 * p + 2]]
            assert [_bf16(hi), _bf16(hi >> 16)] == [vals[4 * p + 1], vals[4 * p + 3]]


def test_word_asm_gives_the_elements_in_order():
    """The portable kernels' one-word decode (``WORD_DECODE_ASM``): output k is element k."""
    from fp4moe.kernels.gemm.decode import WORD_DECODE_ASM

    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        lin = torch.randint(0, 256, (4,), dtype=torch.uint8, generator=g)
        scale = float(2 ** int(torch.randint(-6, 9, (1,), generator=g))) * 1.5
        got = _run_ptx(
            WORD_DECODE_ASM.value, {"$8": _word(to_fields(lin)), "$9": _bits16(scale * 2.0**118)}
        )
        assert [_bf16(got[f"${k}"]) for k in range(8)] == _linear_values(_word(lin), scale)
