"""The README and docs/ against the repository: every `--flag` they give a script exists in
that script's parser, and every repository path and relative link (with its heading) they name
exists.

Commands are read from code blocks and inline code (`python3 pretrain_gpt.py --tp 2`,
`torchrun ... finetune_gpt.py ...`, `bash tools/run_multinode.sh ...`): the flags after the
script belong to it (those before it to python, torchrun or srun). A flag named in prose is
given to the one script its sentence names; with none or several, it must be a flag of at
least one script. The flags of a script are read from its `--help`, which every script prints
from the parser it really uses; the scripts run in forked children of one helper process that
imported torch once, so the test takes seconds. A failure lists every missing flag and path.
"""
import functools
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH_ROOTS = ("megalite", "tools", "tests", "docs", "benchmarks")
SCRIPT_DIRS = ("tools", "benchmarks")
LAUNCHERS = {"python", "python3", "torchrun", "bash", "sh", "srun"}
# Scripts whose arguments go to another script's parser.
FORWARDS = {"tools/run_multinode.sh": "pretrain_gpt.py"}
# Flags of other programs (pip, torchrun, pytest) that prose may name.
EXTERNAL = {"--no-deps"}

FLAG = re.compile(r"(?<![\w-])--(\[no-\])?([a-z0-9][a-z0-9-]*[a-z0-9])(?![\w*-])")
PATH = re.compile(r"(?<![\w/.$~-])((?:%s)/[\w./*-]*)" % "|".join(PATH_ROOTS))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^\s*```")
COMMENT = re.compile(r"<!--.*?-->", re.S)
SEPARATORS = {"&&", "||", ";", "|"}
SENTENCE = re.compile(r"(?<=[.;!?])\s+(?=[A-Z`(*])")

# Run in a helper process: import what the scripts import (torch, transformers, megalite) once,
# then fork one child per script that runs it with --help; print {script: help text} as JSON.
HELP_RUNNER = r"""
import ast, importlib, json, os, runpy, sys, tempfile
root, scripts = sys.argv[1], sys.argv[2:]
sys.path.insert(0, root)
for script in scripts:  # what the scripts import at the top, imported once for all of them
    for node in ast.parse(open(os.path.join(root, script)).read()).body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:
                pass
outputs, children = {}, {}
with tempfile.TemporaryDirectory() as tmp:
    for i, script in enumerate(scripts):
        path = os.path.join(tmp, str(i))
        pid = os.fork()
        if pid == 0:
            stream = open(path, "w")
            os.dup2(stream.fileno(), 1)
            os.dup2(stream.fileno(), 2)
            sys.stdout = sys.stderr = stream
            try:
                sys.argv = [script, "--help"]
                sys.path.insert(0, os.path.dirname(os.path.join(root, script)))
                runpy.run_path(os.path.join(root, script), run_name="__main__")
            except SystemExit:
                pass
            except BaseException as error:
                print(f"error: {type(error).__name__}: {error}")
            stream.flush()
            os._exit(0)
        children[pid] = (script, path)
    for pid, (script, path) in children.items():
        os.waitpid(pid, 0)
        with open(path) as f:
            outputs[script] = f.read()
print(json.dumps(outputs))
"""


@dataclass
class Mention:
    """A flag a page names, and the script it is given to (None: any script)."""

    page: str
    line: int
    flag: str
    script: str | None


def expand(match: re.Match) -> list[str]:
    """`--[no-]overlap-grad-reduce` names both forms."""
    name = match.group(2)
    return [f"--{name}", f"--no-{name}"] if match.group(1) else [f"--{name}"]


def entry_scripts() -> set[str]:
    return {p.name for p in ROOT.glob("*.py") if p.name not in ("setup.py", "conftest.py")}


def all_scripts() -> list[str]:
    """Every script with a parser: the entry scripts, tools/*.py and benchmarks/*.py."""
    found = sorted(entry_scripts())
    for folder in SCRIPT_DIRS:
        found += sorted(f"{folder}/{p.name}" for p in (ROOT / folder).glob("*.py")
                        if not p.name.startswith("_"))
    return found


def script_pattern() -> re.Pattern:
    names = "|".join(re.escape(name) for name in sorted(entry_scripts()))
    dirs = "|".join(SCRIPT_DIRS)
    return re.compile(r"(?<![\w/.-])((?:%s)/[\w-]+\.(?:py|sh)|%s)(?![\w/-])" % (dirs, names))


def is_script(token: str, launched: bool) -> bool:
    """Whether `token` is a script of this repository: tools/X.py, benchmarks/X.py, an entry
    script, or any X.py right after python/torchrun (so a misspelled entry script is seen)."""
    token = token.removeprefix("./")
    if not token.endswith((".py", ".sh")) or token.startswith("-"):
        return False
    if "/" in token:
        return token.split("/")[0] in SCRIPT_DIRS
    return launched or token in entry_scripts()


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the comment starts at a `#` outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:]
    return line, ""


def command_flags(command: str) -> tuple[list[tuple[str, str]], list[str]]:
    """([(script, flag)], [script]) of a shell command: the flags after each script."""
    try:
        tokens = shlex.split(command, posix=True)
    except ValueError:
        tokens = command.split()
    given, scripts, script, launched = [], [], None, False
    for token in tokens:
        if token in SEPARATORS or token.startswith("$("):
            script, launched = None, False
        elif script is None and token.split("/")[-1] in LAUNCHERS:
            launched = True
        elif script is None and is_script(token, launched):
            script = token.removeprefix("./")
            scripts.append(script)
        elif script is not None and token.startswith("--"):
            match = FLAG.match(token.split("=", 1)[0])
            if match:
                given += [(script, flag) for flag in expand(match)]
    return given, scripts


def blocks(text: str):
    """(first line number, text, is_code) of each code line (continuations joined) and each
    prose paragraph (list items, headings and table rows apart)."""
    lines, para, start = text.split("\n"), [], 0
    in_code, pending, pending_start = False, "", 0
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            if para:
                yield start, " ".join(para), False
                para = []
            in_code = not in_code
            pending, pending_start = "", 0
            continue
        if in_code:
            if not pending:
                pending_start = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            yield pending_start, pending + line, True
            pending = ""
            continue
        if line.startswith(("#", "|")):  # a heading or a table row stands alone
            if para:
                yield start, " ".join(para), False
            yield number, line, False
            para = []
        elif not line.strip() or re.match(r"\s*(?:[-*]|\d+\.)\s", line):
            if para:
                yield start, " ".join(para), False
            para = [line] if line.strip() else []
            start = number
        else:
            if not para:
                start = number
            para.append(line)
    if para:
        yield start, " ".join(para), False


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    found, in_code = set(), False
    for line in page.read_text().split("\n"):
        in_code ^= bool(FENCE.match(line))
        if line.startswith("#") and not in_code:
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def read_page(page: Path) -> tuple[list[Mention], list[tuple[int, str]], list[str]]:
    """(flag mentions, (line, repository path) mentions, missing link targets) of a page."""
    text = COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    name = page_name(page)
    scripts = script_pattern()
    mentions, paths = [], []

    def commands(line: int, command: str, prose_if_none: bool) -> bool:
        """Record the flags `command` gives its scripts; False if it names no script."""
        given, named = command_flags(command)
        paths.extend((line, script) for script in named)
        mentions.extend(Mention(name, line, flag, FORWARDS.get(s, s)) for s, flag in given)
        if not named and prose_if_none:
            mentions.extend(Mention(name, line, flag, None)
                            for m in FLAG.finditer(command) for flag in expand(m))
        return bool(named)

    for line, block, is_code in blocks(text):
        paths += [(line, p) for p in PATH.findall(block)]
        if is_code:
            code, comment = split_comment(block)
            commands(line, code, prose_if_none=False)
            commands(line, comment, prose_if_none=True)
            continue
        for sentence in SENTENCE.split(block):
            prose = sentence
            for span in INLINE.findall(sentence):
                if commands(line, span, prose_if_none=False):
                    prose = prose.replace(f"`{span}`", " ", 1)
            named = {FORWARDS.get(s, s) for s in scripts.findall(sentence)}
            owner = named.pop() if len(named) == 1 else None
            mentions += [Mention(name, line, flag, owner)
                         for m in FLAG.finditer(prose) for flag in expand(m)]
    missing_links = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = page.parent / file if file else page
        if not linked.exists():
            missing_links.append(f"{name}: link target {target} does not exist")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            missing_links.append(f"{name}: link target {target}: no such heading")
    return mentions, paths, missing_links


@functools.cache
def help_flags(scripts: tuple[str, ...]) -> dict[str, set[str] | str]:
    """script -> its flags, from its --help; or the error it printed instead."""
    result = subprocess.run([sys.executable, "-c", HELP_RUNNER, str(ROOT), *scripts],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    flags = {}
    for script, text in json.loads(result.stdout.strip().splitlines()[-1]).items():
        if "usage:" not in text:
            flags[script] = (text.strip().splitlines() or ["no output"])[-1]
            continue
        usage = text[text.index("usage:"):].split("\n\n", 1)[0]
        options = [line.split("  ")[1] for line in text.splitlines() if re.match(r"  -", line)]
        flags[script] = {f for part in (usage, *options)
                         for m in FLAG.finditer(part) for f in expand(m)}
    return flags


def check_docs(pages: list[Path]) -> list[str]:
    """Every problem of `pages`, one line each."""
    problems, mentions, paths = [], [], []
    for page in pages:
        page_mentions, page_paths, missing_links = read_page(page)
        mentions += page_mentions
        paths += [(page_name(page), line, p) for line, p in page_paths]
        problems += missing_links
    for page, line, path in paths:
        path = path.rstrip(".")
        exists = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
        if not exists:
            problems.append(f"{page}:{line}: path {path} does not exist")
    wanted = sorted({m.script for m in mentions if m.script} | set(all_scripts()))
    wanted = [s for s in wanted if (ROOT / s).is_file() and s.endswith(".py")]
    flags = help_flags(tuple(wanted))
    known = set().union(*(f for f in flags.values() if isinstance(f, set)))
    for m in mentions:
        if m.flag in EXTERNAL:
            continue
        if m.script is None:
            if m.flag not in known:
                problems.append(f"{m.page}:{m.line}: {m.flag} is a flag of no script")
        elif m.script not in flags:
            continue  # a missing script is reported as a missing path
        elif isinstance(flags[m.script], str):
            problems.append(f"{m.page}:{m.line}: {m.script} --help failed: {flags[m.script]}")
        elif m.flag not in flags[m.script]:
            problems.append(f"{m.page}:{m.line}: {m.flag} is not a flag of {m.script}")
    return sorted(set(problems))


def test_docs_name_real_flags_and_paths():
    problems = check_docs(PAGES)
    assert not problems, f"{len(problems)} problems in README.md and docs/:\n" + "\n".join(
        problems)


def test_misspelled_flags_scripts_paths_and_headings_are_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Train with `python3 pretrain_gpt.py --tp 2 --tensor-paralel 2` and read\n"
                    "`megalite/no_such_module.py`; or `python3 pretrain_gtp.py --tp 2`.\n\n"
                    "```bash\ntorchrun --nproc_per_node 2 tools/plan.py --tp 2 \\\n"
                    "  --no-such-plan-flag 1   # then --no-such-flag-anywhere\n```\n\n"
                    "See [the title](other.md#title) and [nothing](other.md#no-such-heading).\n")
    (tmp_path / "other.md").write_text("# Title\n")
    problems = "\n".join(check_docs([page]))
    assert "--tensor-paralel is not a flag of pretrain_gpt.py" in problems
    assert "--no-such-plan-flag is not a flag of tools/plan.py" in problems
    assert "--no-such-flag-anywhere is a flag of no script" in problems
    assert "path megalite/no_such_module.py does not exist" in problems
    assert "path pretrain_gtp.py does not exist" in problems
    assert "other.md#no-such-heading: no such heading" in problems
    assert "other.md#title" not in problems
    assert "--tp is not" not in problems and "--nproc_per_node" not in problems
