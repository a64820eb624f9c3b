"""Could a new code layout decode a bf16 pair in two instructions (funnel shift + AND)?

    python3 benchmarks/decode_layout_search.py --words 1 2 4

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--words", type=int, nargs="+", default=[1, 2, 4])
    for w in p.parse_args().words:
        found, nodes = exact_cover(w)
        print(f"{w} word(s): {len(pieces(w))} candidate registers, "
              f"{'layout ' + str(found) if found else 'no layout'} ({nodes} nodes)")  # fmt: skip


if __name__ == "__main__":
    main()
