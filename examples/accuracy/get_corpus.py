"""Fetch and split the text corpus of the accuracy report: the Jargon File 4.4.7.

Source: the Debian package ``jargon-text`` version 4.4.7-4.1 (bookworm, section text),
which ships ``/usr/share/doc/jargon-text/jargon.txt.gz``. The Jargon File is in the public
domain (the package's copyright file: "This document (the Jargon File) is in the public
domain, to be freely used, shared, and modified").

The script downloads the .deb with ``apt-get download`` (no installation, so no root needed
beyond what apt needs to read its lists; run ``apt-get update`` once on a fresh machine),
unpacks it with ``dpkg-deb -x``, checks the SHA-256 of the text, and writes

    OUT/train.txt     the glossary entries with index % 10 != 0
    OUT/heldout.txt   the glossary entries with index % 10 == 0 (about a tenth)

as plain ASCII: the glossary (the lexicon entries between "Glossary" and "Appendix A"),
one entry per block, each paragraph on one line, entries separated by a blank line, curly
quotes and dashes mapped to ASCII, table lines and other non-ASCII characters dropped.
The split interleaves entries, so both halves cover the whole alphabet.

Usage: python examples/accuracy/get_corpus.py [--out examples/accuracy/data] [--deb FILE]
       [--write-samples]  (also rewrite the shipped heldout_sample.txt and calib_sample.txt)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "jargon-text"
VERSION = "4.4.7-4.1"
MEMBER = "usr/share/doc/jargon-text/jargon.txt.gz"
# SHA-256 of the decompressed jargon.txt of that package version.
SHA256 = "40dfb4b98191a670a09a183d5798d50f243d23fdbd1495dcc0aca2ce5895ba97"
HELDOUT_EVERY = 10
HERE = Path(__file__).resolve().parent

_ASCII = {
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u00b4": "'",
    "\u2014": "--", "\u2212": "-", "\u00b7": "-", "\u00a0": " ", "\u2022": "*",
    "\u2192": "->", "\u2190": "<-", "\u00d7": "x", "\u00a9": "(c)", "\u2122": "(TM)",
    "\u00ae": "(R)", "\u00b1": "+/-", "\u00b5": "u", "\u2026": "...",
}  # fmt: skip
_BOX = re.compile("[\u2500-\u257f]")
_HEADER = re.compile(r"^   :(.+?):")


def fetch(workdir: Path) -> Path:
    """Download the pinned .deb into workdir and return its path."""
    cmd = ["apt-get", "download", f"{PACKAGE}={VERSION}"]
    try:
        subprocess.run(cmd, cwd=workdir, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(
            f"{' '.join(cmd)} failed ({exc}); run 'apt-get update' first, or pass --deb with "
            f"a downloaded {PACKAGE}_{VERSION}_all.deb"
        )
    debs = sorted(workdir.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        sys.exit(f"apt-get download left no {PACKAGE} .deb in {workdir}")
    return debs[0]


def extract(deb: Path, workdir: Path) -> str:
    root = workdir / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    raw = gzip.decompress((root / MEMBER).read_bytes())
    return raw.decode("utf-8")


def to_ascii(line: str) -> str:
    line = "".join(_ASCII.get(ch, ch) for ch in line)
    return line.encode("ascii", "ignore").decode("ascii")


def glossary_entries(text: str) -> list[str]:
    """The lexicon entries, each as paragraphs joined by newlines."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if _HEADER.match(ln))
    stop = next(i for i in range(start, len(lines)) if to_ascii(lines[i]).startswith("Appendix A."))
    entries: list[list[str]] = []
    para: list[str] = []

    def flush_para() -> None:
        if para and entries:
            entries[-1].append(" ".join(para))
        para.clear()

    for ln in lines[start:stop]:
        if _BOX.search(ln):  # tables drawn with box characters
            continue
        if _HEADER.match(ln):
            flush_para()
            entries.append([])
        s = to_ascii(ln).strip()
        if not s:
            flush_para()
            continue
        para.append(re.sub(r"\s+", " ", s))
    flush_para()
    return ["\n".join(e) for e in entries if e]


def split(entries: list[str]) -> tuple[str, str]:
    train = [e for i, e in enumerate(entries) if i % HELDOUT_EVERY]
    held = [e for i, e in enumerate(entries) if i % HELDOUT_EVERY == 0]
    return "\n\n".join(train) + "\n", "\n\n".join(held) + "\n"


def samples(entries: list[str], size: int = 8192) -> tuple[str, str]:
    """The small texts shipped beside the weights for the CI test: (held-out, calibration).

    Held-out: entries i % 100 == 0 (a subset of the held-out split); calibration: entries
    i % 100 == 1 (training split); each cut to at most ``size`` bytes at an entry boundary."""

    def cut(es: list[str]) -> str:
        out = ""
        for e in es:
            if len(out) + len(e) + 2 > size:
                break
            out += e + "\n\n"
        return out

    return cut(entries[0::100]), cut(entries[1::100])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "data", help="output folder")
    ap.add_argument("--deb", type=Path, default=None, help="use this .deb instead of downloading")
    ap.add_argument(
        "--write-samples",
        action="store_true",
        help="also rewrite the shipped heldout_sample.txt and calib_sample.txt",
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        deb = args.deb.resolve() if args.deb else fetch(work)
        text = extract(deb, work)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != SHA256:
        sys.exit(f"jargon.txt sha256 {digest} != expected {SHA256}: not {PACKAGE} {VERSION}?")
    entries = glossary_entries(text)
    train, held = split(entries)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.txt").write_text(train, encoding="ascii")
    (args.out / "heldout.txt").write_text(held, encoding="ascii")
    if args.write_samples:
        held_s, cal_s = samples(entries)
        (HERE / "heldout_sample.txt").write_text(held_s, encoding="ascii")
        (HERE / "calib_sample.txt").write_text(cal_s, encoding="ascii")
    print(f"{PACKAGE} {VERSION}: jargon.txt sha256 {digest}")
    print(
        f"{len(entries)} entries -> {args.out / 'train.txt'} ({len(train)} bytes), "
        f"{args.out / 'heldout.txt'} ({len(held)} bytes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
