"""Could a new code layout decode a bf16 pair in two instructions (funnel shift + AND)?
And what do the decode's bit moves cost at best, with the present layout or any other?

    python3 benchmarks/decode_layout_search.py --words 1 2 4
    python3 benchmarks/decode_layout_search.py --words --merged 4 --present

The decode (``gemm._CHUNK_DECODE_ASM``) builds each bf16 pair register of the wgmma
fragment from two e2m1 codes: sign bits at 15 and 31, magnitude bits at 6-8 and 22-24.
With the codes stored in some other bit order, one register could come from a funnel
shift of two code words (``shf.r.wrap``: a window of 32 bits of their 64) and one AND
with 0x81C081C0: 1 instruction a weight, plus 0.5 for the scale's fma, against 2.25
now (a PRMT per 4 values, then AND, IMAD, AND and the fma per pair). That needs the
registers' 8-bit sets (the target set shifted) to tile the stored bits exactly. This
script searches every choice of word pair and shift over ``--words`` words (4 registers
a word) by exact cover. CPU only; session 11 found none
for 1, 2 or 4 words (docs/perf-notes.md).

``--merged V``: the same question with a register built from up to four pieces (its
two sign bits and two magnitude triples), each piece from one of V rotations of a code
word (the word itself and V - 1 ``shf``), merged by LOP3s (one a distinct rotation in
the register: ``t = r1 & m1``, then ``t | (r2 & m2)``). It reports the fewest
instructions a word (rotations + LOP3s + the 4 fmas) over every set of V rotations.
Session 23: none for V up to 5 (16 s at V = 4, 112 s at V = 5 on one core); 15 with 6
(against 18 now; found by a C version of this search in 12 s, where this one ran over 40
minutes without ending), which no larger V would lower (7 rotations and 4 one-LOP3
registers is the tiling above).

``--present``: with today's layout (the registers' contents, and so the bits, fixed),
whether a register pair of one code half-word (its low nibbles' register A and its high
nibbles' register B after the PRMT that puts the two bytes 16 bits apart) comes in fewer
than today's 3 instructions each: one LOP3 of two shifted copies of the PRMT's result
(any two shifts, any LUT; the PRMT may put the bytes anywhere), or both registers from
one IMAD of it (two to four shifted copies; each register then one rotation and one AND).
"""

from __future__ import annotations

import argparse

TARGET = (6, 7, 8, 15, 22, 23, 24, 31)  # the bits of one bf16 pair register


def pieces(words: int) -> list[tuple[int, tuple[int, int, int]]]:
    """Every (bit mask over ``words`` x 32 bits, (low word, high word, shift)) that one
    funnel shift can bring to TARGET's positions."""
    out = {}
    for lo in range(words):
        for hi in range(words):
            for r in range(33):
                bits = []
                for s in TARGET:
                    p = s + r
                    if lo == hi:  # a rotation of one word
                        bits.append(lo * 32 + p % 32)
                    elif p < 32:
                        bits.append(lo * 32 + p)
                    elif p < 64:
                        bits.append(hi * 32 + p - 32)
                    else:
                        break
                else:
                    if len(set(bits)) == len(TARGET):
                        out[sum(1 << b for b in bits)] = (lo, hi, r)
    return list(out.items())


def exact_cover(words: int, limit: int = 2_000_000):
    """A list of (low word, high word, shift) whose bits tile the words exactly, or None;
    the second value is the number of search nodes visited (the search is exhaustive
    when it stays below ``limit``)."""
    cand = pieces(words)
    full = (1 << (32 * words)) - 1
    nodes = 0

    def search(covered: int, chosen: list):
        nonlocal nodes
        if covered == full:
            return chosen
        nodes += 1
        if nodes > limit:
            return None
        best = None
        for b in range(32 * words):  # the open bit with the fewest candidates
            if not covered >> b & 1:
                opts = [(m, d) for m, d in cand if m >> b & 1 and not m & covered]
                if not opts:
                    return None
                if best is None or len(opts) < len(best):
                    best = opts
        for m, d in best:
            found = search(covered | m, [*chosen, d])
            if found:
                return found
        return None

    return search(0, []), nodes


SIGN_LO, MAG_LO, SIGN_HI, MAG_HI = (15,), (6, 7, 8), (31,), (22, 23, 24)
MASK = sum(1 << b for b in TARGET)


def _rot_piece(bits: tuple[int, ...], r: int) -> int:
    """The code word's bits that a left rotation by ``r`` brings to ``bits``."""
    return sum(1 << ((b - r) % 32) for b in bits)


def merged_cover(versions: int) -> tuple[int, tuple[int, ...]] | None:
    """Fewest instructions a code word (4 registers) with ``versions`` rotations (0
    included) and LOP3 merges, and the rotations that reach it; None if no set of
    ``versions`` rotations covers the word."""
    import itertools

    best = None
    for rest in itertools.combinations(range(1, 32), versions - 1):
        rots = (0, *rest)
        regs = {}  # bit mask -> fewest LOP3s of a register covering it
        for vs in itertools.product(rots, repeat=4):
            ps = [_rot_piece(b, r) for b, r in zip((SIGN_LO, MAG_LO, SIGN_HI, MAG_HI), vs)]
            m = ps[0] | ps[1] | ps[2] | ps[3]
            if bin(m).count("1") == 8:
                regs[m] = min(regs.get(m, 9), len(set(vs)))
        by_bit = [[(m, c) for m, c in regs.items() if m >> b & 1] for b in range(32)]

        def cover(covered: int, cost: int) -> int | None:
            if covered == 0xFFFFFFFF:
                return cost
            low_bit = (~covered & (covered + 1)).bit_length() - 1  # the lowest open bit
            low = None
            for m, c in by_bit[low_bit]:
                if not m & covered:
                    got = cover(covered | m, cost + c)
                    if got is not None and (low is None or got < low):
                        low = got
            return low

        lop3 = cover(0, 0)
        if lop3 is not None:
            total = versions - 1 + lop3 + 4
            if best is None or total < best[0]:
                best = (total, rots)
    return best


def _enc(n: int) -> int:
    """e2m1 code -> its bits in a bf16 pair's low half (sign 15, magnitude 6-8)."""
    return (n & 8) << 12 | (n & 7) << 6


def present_checks(samples: int = 64, seed: int = 1) -> dict[str, int]:
    """Candidates found for today's registers (``--present``), checked on ``samples``
    random half-words and the all-ones ones first; each count 0 means no such sequence."""
    import random

    rng = random.Random(seed)
    hs = [0xFFFF, 0x8888, 0x7777, 0xF0F0, 0x0F0F] + [rng.randrange(1 << 16) for _ in range(samples)]
    want = {
        "A": [_enc(h & 15) | _enc(h >> 8 & 15) << 16 for h in hs],
        "B": [_enc(h >> 4 & 15) | _enc(h >> 12) << 16 for h in hs],
    }
    placements = [(p0, p1) for p0 in range(4) for p1 in range(4) if p0 != p1]

    def prmt(h: int, p0: int, p1: int) -> int:
        return (h & 0xFF) << 8 * p0 | (h >> 8) << 8 * p1

    def rotl(x: int, r: int) -> int:
        return (x << r | x >> (32 - r)) & 0xFFFFFFFF if r else x

    found = {"A one LOP3": 0, "B one LOP3": 0, "A and B one IMAD": 0}
    full = 0xFFFFFFFF
    for p0, p1 in placements:
        ts = [prmt(h, p0, p1) for h in hs]
        for s1 in range(32):  # one LOP3 of two shifted copies (any LUT, MASK its third input)
            for s2 in range(s1 + 1, 32):
                xs = [(t << s1) & full for t in ts]
                ys = [(t << s2) & full for t in ts]
                for name in ("A", "B"):
                    lut = {}  # LUT index -> the output bit it must give
                    ok = True
                    for x, y, w in zip(xs, ys, want[name]):
                        for i in range(8):
                            at = (x if i & 4 else ~x) & (y if i & 2 else ~y)
                            at &= (MASK if i & 1 else ~MASK) & full
                            if at & w and at & ~w:
                                ok = False
                            elif at:
                                bit = 1 if at & w else 0
                                ok = ok and lut.setdefault(i, bit) == bit
                        if not ok:
                            break
                    found[f"{name} one LOP3"] += ok
        # one IMAD for both registers: it must keep every code bit, so no AND before it
        # helps (a mask applies to every copy alike); then a rotation and an AND each
        for k in _multipliers():
            ps = [(t * k) & full for t in ts]

            def fits(name: str, ps: list[int] = ps) -> bool:
                return any(all(rotl(q, r) & MASK == w for q, w in zip(ps, want[name]))
                           for r in range(32))  # fmt: skip

            found["A and B one IMAD"] += fits("A") and fits("B")
    return found


def _multipliers():
    """The IMAD multipliers tried: sums of two to four distinct powers of two."""
    import itertools

    for n in (2, 3, 4):
        for bits in itertools.combinations(range(32), n):
            yield sum(1 << b for b in bits)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--words", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument(
        "--merged",
        type=int,
        nargs="*",
        default=[],
        help="rotations a word for the LOP3-merge search (e.g. 4 5 6)",
    )
    p.add_argument(
        "--present", action="store_true", help="check shorter sequences for today's registers"
    )
    args = p.parse_args()
    for v in args.merged:
        got = merged_cover(v)
        print(f"{v} rotations: " + (f"{got[0]} instructions a word (rotations {got[1]})"
                                    if got else "no cover"))  # fmt: skip
    if args.present:
        for name, n in present_checks().items():
            print(f"present layout, {name}: {n} sequence(s)")
    for w in args.words:
        found, nodes = exact_cover(w)
        print(f"{w} word(s): {len(pieces(w))} candidate registers, "
              f"{'layout ' + str(found) if found else 'no layout'} ({nodes} nodes)")  # fmt: skip


if __name__ == "__main__":
    main()
