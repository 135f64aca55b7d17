"""Build the built-in model's corpus: twelve books of the King James Bible as plain text, split into
data/kjv/train.txt and data/kjv/heldout.txt (every 20th chapter held out). Deterministic.

The text comes from Debian's bible-kjv-text package (the compressed text) read through the `bible`
program of the bible-kjv package; neither needs installing:

    cd /tmp && apt-get download bible-kjv bible-kjv-text
    dpkg -x bible-kjv_*.deb kjv && dpkg -x bible-kjv-text_*.deb kjv
    python tools/make_corpus.py --bible /tmp/kjv/usr/bin/bible --text-dir /tmp/kjv/usr/lib
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

# (the bible program's book abbreviation, the name written in each chapter's heading)
BOOKS = (("Ge", "Genesis"), ("Exo", "Exodus"), ("Ruth", "Ruth"), ("1Sm", "1 Samuel"), ("Psa", "Psalms"),
         ("Prv", "Proverbs"), ("Eccl", "Ecclesiastes"), ("Mat", "Matthew"), ("Mark", "Mark"), ("Luke", "Luke"),
         ("John", "John"), ("Acts", "Acts"))
HELDOUT_EVERY = 20          # chapter k (counted over all selected chapters) is held out when k % 20 == 10
_VERSE = re.compile(r"^(?P<book>[0-9]?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")


def read_bible(bible: Path, text_dir: Path) -> list[tuple[str, int, str]]:
    """Every verse as (book abbreviation, chapter, text), Genesis 1:1 to Revelation 22:21."""
    out = subprocess.run([str(bible), "-p", str(text_dir), "-f", "Gen1:1-Rev22:21"], check=True,
                         capture_output=True, text=True).stdout
    verses = []
    for line in out.splitlines():
        m = _VERSE.match(line)
        if m is None:
            raise SystemExit(f"unexpected line from {bible}: {line!r}")
        verses.append((m["book"], int(m["chapter"]), m["text"].strip()))
    if len(verses) != 31102:
        raise SystemExit(f"expected the 31102 verses of the KJV, got {len(verses)}")
    return verses


def chapters(verses: list[tuple[str, int, str]]) -> list[str]:
    """The selected books' chapters, each as 'Name N' then one verse per line, in canonical order."""
    names = dict(BOOKS)
    out: dict[tuple[str, int], list[str]] = {}
    for book, chapter, text in verses:
        if book in names:
            out.setdefault((book, chapter), [f"{names[book]} {chapter}"]).append(text)
    missing = sorted(set(names) - {b for b, _ in out})
    if missing:
        raise SystemExit(f"books not found in the bible program's output: {missing}")
    return ["\n".join(lines) + "\n" for lines in out.values()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bible", type=Path, required=True, help="the `bible` program (from bible-kjv)")
    p.add_argument("--text-dir", type=Path, required=True, help="folder holding bible.data (from bible-kjv-text)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "kjv")
    args = p.parse_args()
    chaps = chapters(read_bible(args.bible, args.text_dir))
    held = [c for k, c in enumerate(chaps) if k % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    train = [c for k, c in enumerate(chaps) if k % HELDOUT_EVERY != HELDOUT_EVERY // 2]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.txt", train), ("heldout.txt", held)):
        text = "\n".join(part)
        (args.out / name).write_text(text, encoding="ascii")
        print(f"{args.out / name}: {len(part)} chapters, {len(text)} bytes")


if __name__ == "__main__":
    main()
