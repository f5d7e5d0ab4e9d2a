"""Every code block of README.md and docs/*.md runs as its marker says, so no example rots.

The convention (docs/README.md states it for writers): each ```bash or ```python block has
exactly one marker on the line above its fence, an HTML comment that renders as nothing:

    <!-- run -->                      executed as written
    <!-- run; CLAUSE; CLAUSE -->      executed with the changes its clauses name
    <!-- skip: REASON -->             not executed; pytest reports it skipped with REASON

Clauses, each checked against the block (a change that does not apply fails the test, so the
page and its test cannot drift apart):

    replace `OLD` with `NEW`          in the block's text; OLD must occur in it
    append `FLAGS` to python -m M     every `python -m M` the block starts also gets FLAGS,
                                      after its own (for ml_collections and argparse the last
                                      value wins); the block must start one
    python -m train stops after its checks
                                      every `python -m train` the block starts parses its
                                      flags, reads its config and checks every value, file
                                      and model directory it names, as the command does
                                      before it trains, then exits 0 without training
                                      (for a run whose results no later block reads)
    provides DIR                      DIR (a training run) is made by this block once per
                                      test session and copied to the blocks that need it
    needs DIR                         DIR, as its provider made it, is copied in first

A page's blocks run in order in one scratch directory: shell blocks with `bash -e -o
pipefail`, `python` being this interpreter (the suite's environment: fake devices, fast
compilation, a private compile cache and TFDS data directory; no network), Python blocks in
this process in one namespace per page. Blocks of other languages (```text, or none) show
output and are not code; a language outside `LANGUAGES` fails, as does a code block
without a marker, so a new block cannot escape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
README_MAX_LINES = 250

# Fence languages: code (each needs a marker), and output or data (never run).
LANGUAGES = {"bash": "bash", "sh": "bash", "python": "python"}
NOT_CODE = {"", "text", "json", "tsv"}

# Pages whose blocks train several models (seconds of test time measured with -n 0 on 2
# lightly loaded CPU cores); `pytest -m "not slow"` leaves them out of the edit loop, CI runs
# them. Every other page takes 4-37 s (README.md: the shared default run).
SLOW_PAGES = {"docs/decoding.md": 88, "docs/finetuning.md": 90, "docs/whisper.md": 27,
              "docs/sequence-training.md": 20}

FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^`\s]*)\s*$")
MARKER = re.compile(r"^<!--\s*(run|skip)\b(.*?)-->\s*$")
CLAUSES = {
    "replace": re.compile(r"^replace `([^`]+)` with `([^`]*)`$"),
    "append": re.compile(r"^append `([^`]+)` to python -m ([\w.]+)$"),
    "checks": re.compile(r"^python -m (train) stops after its checks$"),
    "provides": re.compile(r"^provides ([\w./-]+)$"),
    "needs": re.compile(r"^needs ([\w./-]+)$"),
}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and text, and its marker's parts."""

    page: str
    line: int                                   # the opening fence's, from 1
    language: str                               # "bash", "python", or an output kind
    code: str
    run: bool = False
    skip: str = ""                              # the reason, for a skipped block
    replace: tuple[tuple[str, str], ...] = ()
    append: tuple[tuple[str, tuple[str, ...]], ...] = ()
    checks: tuple[str, ...] = ()                # modules that stop after their checks
    provides: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    def runnable_code(self) -> str:
        """The block's text with its replacements made (each must occur)."""
        code = self.code
        for old, new in self.replace:
            assert old in code, f"{self.name}: `{old}` (a replace clause) is not in the block"
            code = code.replace(old, new)
        return code


def _marker(page: str, number: int, text: str, problems: list[str]) -> dict:
    """A marker line's parts as Block fields; what is wrong with it goes to `problems`."""
    kind, rest = MARKER.match(text).groups()
    rest = rest.strip()
    if kind == "skip":
        reason = rest[1:].strip() if rest.startswith(":") else ""
        if not reason:
            problems.append(f"{page}:{number}: a skip marker gives its reason: "
                            "<!-- skip: needs a download -->")
        return {"skip": reason or "no reason given"}
    fields = {"run": True, "replace": [], "append": [], "checks": [], "provides": [],
              "needs": []}
    if rest and not rest.startswith(";"):
        problems.append(f"{page}:{number}: clauses follow `run;`, got {rest!r}")
    for clause in filter(None, (c.strip() for c in rest.lstrip(";").split(";"))):
        for name, pattern in CLAUSES.items():
            m = pattern.match(clause)
            if m:
                if name == "append":
                    fields[name].append((m.group(2), tuple(shlex.split(m.group(1)))))
                elif name == "replace":
                    fields[name].append(m.groups())
                else:
                    fields[name].append(m.group(1))
                break
        else:
            problems.append(f"{page}:{number}: unknown clause {clause!r} (known: replace `A` "
                            "with `B`; append `FLAGS` to python -m M; python -m train stops "
                            "after its checks; provides DIR; needs DIR)")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def parse(page: str, text: str | None = None) -> tuple[list[Block], list[str]]:
    """The fenced blocks of `page` (relative to the repository; `text`, its contents when
    given) and the problems found."""
    if text is None:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
    lines = text.split("\n")
    blocks, problems = [], []
    pending = None                       # (line number, marker fields) awaiting its fence
    i = 0
    while i < len(lines):
        text = lines[i]
        if MARKER.match(text):
            if pending:
                problems.append(f"{page}:{pending[0]}: a marker with no code block under it")
            pending = (i + 1, _marker(page, i + 1, text, problems))
            i += 1
            continue
        fence = FENCE.match(text)
        if not fence:
            if pending and text.strip():
                problems.append(f"{page}:{pending[0]}: a marker must be the line right above "
                                "its block's fence")
                pending = None
            i += 1
            continue
        ticks, language = fence.groups()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].startswith(ticks[0] * len(ticks))
                    and not lines[j].strip(ticks[0])), None)
        assert end is not None, f"{page}:{i + 1}: a fence that never closes"
        block = Block(page, i + 1, LANGUAGES.get(language, language),
                      "\n".join(lines[i + 1:end]) + "\n", **(pending[1] if pending else {}))
        if language in LANGUAGES:
            if not pending:
                problems.append(f"{block.name}: a ```{language} block without a marker "
                                "(<!-- run -->, or <!-- skip: REASON -->)")
        elif language in NOT_CODE:
            if any(FENCE.match(line) and FENCE.match(line).group(2) for line in
                   block.code.splitlines()):
                problems.append(f"{block.name}: a fence with a language inside a block that "
                                "shows output: is a fence above it left open?")
            if pending:
                problems.append(f"{block.name}: a marker above a ```{language} block, "
                                "which shows output and never runs")
        else:
            problems.append(f"{block.name}: fence language {language!r}: code is "
                            f"{sorted(LANGUAGES)}, output {sorted(NOT_CODE - {''})} or none")
        if block.run:
            problems.extend(_clause_problems(block))
        blocks.append(block)
        pending = None
        i = end + 1
    if pending:
        problems.append(f"{page}:{pending[0]}: a marker with no code block under it")
    return blocks, problems


def _clause_problems(block: Block) -> list[str]:
    problems = []
    for old, _ in block.replace:
        if old not in block.code:
            problems.append(f"{block.name}: `{old}` (a replace clause) is not in the block")
    for module in [m for m, _ in block.append] + list(block.checks):
        if block.language != "bash" or f"python -m {module}" not in block.runnable_code():
            problems.append(f"{block.name}: its marker changes python -m {module}, which "
                            "this block does not start")
    if block.provides and block.language != "bash":
        problems.append(f"{block.name}: only a shell block provides a directory")
    return problems


PARSED = {page: parse(page) for page in PAGES}
BLOCKS = [b for page in PAGES for b in PARSED[page][0] if b.language in ("bash", "python")]
PROVIDERS = {d: b for b in BLOCKS if b.run for d in b.provides}


# --- what the pages must hold ---------------------------------------------------------------

def test_every_code_block_carries_exactly_one_marker_that_applies_to_it():
    problems = [p for page in PAGES for p in PARSED[page][1]]
    provided = [d for b in BLOCKS if b.run for d in b.provides]
    problems += [f"{d} is provided by more than one block" for d in set(provided)
                 if provided.count(d) > 1]
    problems += [f"{b.name}: needs {d}, which no block provides" for b in BLOCKS
                 for d in b.needs if d not in PROVIDERS]
    assert not problems, "\n".join(problems)


def test_the_checks_refuse_what_would_let_a_block_escape_or_drift():
    """A page made here: each mistake is named with its line."""
    page = "\n".join([
        "```bash", "python -m decode --help", "```",                        # 1: no marker
        "<!-- run; replace `nowhere` with `x` -->", "```python", "x = 1", "```",   # 4
        "<!-- run; append `--a` to python -m train -->", "```bash", "ls", "```",   # 8
        "<!-- run; frobnicate -->", "```bash", "ls", "```",                 # 12
        "<!-- skip -->", "```python", "x = 1", "```",                       # 16
        "<!-- run -->", "```text", "out", "```",                            # 20
        "<!-- run -->", "", "text between", "```bash", "ls", "```",         # 24, 27
        "```console", "$ ls", "```",                                        # 30
        "<!-- run -->", "<!-- skip: twice -->", "```bash", "ls", "```",     # 33
        "<!-- run -->"])                                                    # 38
    _, problems = parse("page.md", page)
    expected = ["page.md:1: a ```bash block without a marker",
                "page.md:5: `nowhere` (a replace clause) is not in the block",
                "page.md:9: its marker changes python -m train, which this block does not start",
                "page.md:12: unknown clause 'frobnicate'",
                "page.md:16: a skip marker gives its reason",
                "page.md:21: a marker above a ```text block",
                "page.md:24: a marker must be the line right above its block's fence",
                "page.md:27: a ```bash block without a marker",           # so it is unmarked
                "page.md:30: fence language 'console'",
                "page.md:33: a marker with no code block under it",
                "page.md:38: a marker with no code block under it"]
    assert len(problems) == len(expected), "\n".join(problems)
    for want, got in zip(expected, problems, strict=True):
        assert got.startswith(want), (want, got)


def test_readme_fits_a_screen_and_the_index_lists_every_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= README_MAX_LINES
    with open(os.path.join(ROOT, "docs", "README.md"), encoding="utf-8") as f:
        index = f.read()
    missing = [p for p in PAGES if p.startswith("docs/") and p != "docs/README.md"
               and f"({os.path.basename(p)})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def _slug(heading: str) -> str:
    """The anchor a code host gives a heading: lower case, no punctuation but - and _,
    spaces as hyphens (GitHub's rule)."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(page: str) -> set[str]:
    anchors, seen = set(), {}
    in_fence = None
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        for line in f:
            fence = FENCE.match(line.rstrip("\n"))
            if fence:
                ticks = fence.group(1)[0]
                in_fence = None if in_fence == ticks and not fence.group(2) else (
                    in_fence or ticks)
                continue
            m = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                slug = _slug(m.group(1))
                n = seen.get(slug, 0)
                anchors.add(slug if n == 0 else f"{slug}-{n}")
                seen[slug] = n + 1
    return anchors


def test_links_between_pages_reach_a_file_and_a_heading():
    """Relative links (README.md and docs/) name a file that exists and, with `#anchor`, a
    heading of that page as a code host renders it."""
    problems = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue                                    # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path \
                else page
            if not os.path.exists(os.path.join(ROOT, resolved)):
                problems.append(f"{page}: ({target}) names no file")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                problems.append(f"{page}: ({target}): no heading #{anchor} in {resolved}")
    assert not problems, "\n".join(problems)


# --- the blocks, executed ---------------------------------------------------------------------

@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip], ids=lambda b: b.name)
def test_block_marked_skip(block):
    pytest.skip(f"{block.name}: {block.skip}")


def _environment(bin_dir: str, data_dir: str) -> dict:
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": ROOT, "DOCS_REPO": ROOT, "TFDS_DATA_DIR": data_dir, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}


# `python -m train ARGS` up to the start of training: the command line's own parsing and
# checks (`train.run_config`: every key, value, file and model directory), then exit 0.
CHECK_TRAIN = """
import sys
import train.__main__ as cli
import train.trainer
from train.run_config import RunConfig

def checked(config, workdir, **_):
    RunConfig.from_config(config).check()
    print(f"checked: python -m train into {workdir}; not trained (a docs test)")
    raise SystemExit(0)

train.trainer.train_and_evaluate = checked
sys.exit(cli.main(["python -m train", *sys.argv[1:]]))
"""


def _python_shim(block: Block, bin_dir: str, log: str) -> None:
    """`python` for a shell block: this interpreter; `python -m M` also gets the flags the
    marker appends for M (or stops after its checks), and is written to `log`."""
    flags = dict(block.append)
    cases = ""
    for module in sorted(set(flags) | set(block.checks)):
        run = (f"-c {shlex.quote(CHECK_TRAIN)}" if module in block.checks
               else f"-m {shlex.quote(module)}")
        cases += (f"    {shlex.quote(module)}) shift 2; echo {shlex.quote(module)} >> "
                  f"{shlex.quote(log)}; exec {shlex.quote(sys.executable)} {run} "
                  f'"$@" {shlex.join(flags.get(module, ()))};;\n')
    script = (f'#!/bin/bash\nif [ "$1" = "-m" ]; then\n  case "$2" in\n{cases}  esac\nfi\n'
              f'exec {shlex.quote(sys.executable)} "$@"\n')
    path = os.path.join(bin_dir, "python")
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)


def _run_shell(block: Block, workdir: str, data_dir: str) -> str:
    bin_dir = tempfile.mkdtemp(prefix="docs-bin-")
    log = os.path.join(bin_dir, "started")
    open(log, "w").close()
    _python_shim(block, bin_dir, log)
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.runnable_code()],
                          cwd=workdir, env=_environment(bin_dir, data_dir), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    with open(log) as f:
        started = set(f.read().split())
    shutil.rmtree(bin_dir)
    assert done.returncode == 0, (f"{block.name} exited with {done.returncode}:\n"
                                  f"{done.stdout[-6000:]}")
    for module in [m for m, _ in block.append] + list(block.checks):
        assert module in started, (f"{block.name}: the marker changes python -m {module}, "
                                   "which the block never started")
    return done.stdout


def _run_python(block: Block, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(block.runnable_code(), block.name, "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{block.name} raised {type(e).__name__}: {e}\n"
                                 f"{out.getvalue()[-6000:]}") from e
    return out.getvalue()


class Provided:
    """The directories that blocks provide, each made once per test session: the first test
    process to need one runs its block (under a lock) in `shared`, a directory every
    process of the session sees; the others wait for it, then copy it as it is."""

    def __init__(self, shared: str, data_dir: str):
        self.shared, self.data_dir, self.made = shared, data_dir, {}

    def copy(self, name: str, workdir: str) -> None:
        if name not in self.made:
            block = PROVIDERS[name]
            done = os.path.join(self.shared, re.sub(r"\W", "_", block.name))
            with open(done + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
                if not os.path.isdir(done):
                    scratch = tempfile.mkdtemp(prefix="provided-", dir=self.shared)
                    for needed in block.needs:
                        self.copy(needed, scratch)
                    _run_shell(block, scratch, self.data_dir)
                    for made in block.provides:
                        assert os.path.isdir(os.path.join(scratch, made)), \
                            f"{block.name} provides {made} but did not make it"
                    os.rename(scratch, done)
            for made in block.provides:
                self.made[made] = os.path.join(done, made)
        target = os.path.join(workdir, name)
        if not os.path.exists(target):
            shutil.copytree(self.made[name], target, symlinks=True)


@pytest.fixture(scope="session")
def provided(tmp_path_factory, data_dir):
    """Under xdist, the session's directory above each worker's (pytest-xdist's way to
    share a session fixture between workers); else this process's own."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.makedirs(shared / "docs-provided", exist_ok=True)
    return Provided(str(shared / "docs-provided"), data_dir)


def _page_params():
    pages = [p for p in PAGES if any(b.run for b in PARSED[p][0])]
    return [pytest.param(p, marks=[pytest.mark.slow] if p in SLOW_PAGES else [], id=p)
            for p in pages]


@pytest.mark.parametrize("page", _page_params())
def test_page_runs(page, tmp_path, data_dir, provided, monkeypatch):
    """The page's runnable blocks, in order, in one scratch directory."""
    import tensorflow_datasets as tfds
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TFDS_DATA_DIR", data_dir)
    monkeypatch.setattr(tfds.core.constants, "DATA_DIR", data_dir)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    namespace = {"__name__": "__main__"}
    for block in PARSED[page][0]:
        if not block.run:
            continue
        start = time.perf_counter()
        for name in block.needs + block.provides:
            provided.copy(name, str(tmp_path))
        if block.provides:
            pass                          # it ran once for this process: its result is here
        elif block.language == "bash":
            _run_shell(block, str(tmp_path), data_dir)
        else:
            _run_python(block, namespace)
        print(f"{block.name}: {time.perf_counter() - start:.1f} s")
