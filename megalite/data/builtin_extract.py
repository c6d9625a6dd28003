"""English text that ships with every Python installation, as a list of documents.

Documents: the `pydoc_data.topics` help texts, then per standard-library source file
(parsed with `ast` and `tokenize`, never imported) its module/class/function
docstrings and its blocks of consecutive whole-line comments. The test suite is
kept (its comments are mostly prose); IDLE, demos, codec tables, bundled wheels and
site-packages are skipped, and so are short and duplicate documents.
"""
from __future__ import annotations

import ast
import io
import multiprocessing
import os
import sysconfig
import tokenize
SKIP_DIRS = frozenset({"idlelib", "turtledemo", "encodings", "site-packages", "dist-packages",
                       "__pycache__", "pydoc_data", "ensurepip"})
MIN_CHARS = 40


def stdlib_sources(stdlib_dir: str | None = None) -> list[str]:
    """Sorted paths of the standard library's `.py` files, minus SKIP_DIRS."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("config-"))
        paths += [os.path.join(directory, f) for f in sorted(files)
                  if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return paths


def docstrings(source: str) -> list[str]:
    """Cleaned docstrings of the module and of every class and function in `source`."""
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in ast.walk(ast.parse(source)) if isinstance(node, nodes)
            for doc in [ast.get_docstring(node, clean=True)] if doc]


def comment_blocks(source: str) -> list[str]:
    """Runs of consecutive whole-line comments, '#' and one space stripped, one line each."""
    blocks, block, last_row = [], [], -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT or token.line[:token.start[1]].strip():
            continue
        if token.start[0] != last_row + 1 and block:
            blocks.append("\n".join(block))
            block = []
        text = token.string.lstrip("#")
        block.append(text[1:] if text.startswith(" ") else text)
        last_row = token.start[0]
    if block:
        blocks.append("\n".join(block))
    return [b for b in blocks if not b.startswith(("!", " -*-"))]


def source_documents(path: str) -> list[str]:
    """Docstrings then comment blocks of one source file ([] if it does not parse)."""
    try:
        with open(path, "rb") as f:
            source = f.read().decode("utf-8")
        return docstrings(source) + comment_blocks(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return []


def pydoc_topics() -> list[str]:
    """The interpreter's `help()` topic texts, by topic name."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def builtin_documents(stdlib_dir: str | None = None, workers: int = 1) -> list[str]:
    """All documents of at least MIN_CHARS characters, first occurrence of each only;
    source files are parsed by `workers` processes (same result for any number)."""
    paths = stdlib_sources(stdlib_dir)
    with multiprocessing.Pool(workers) as pool:
        per_file = pool.imap(source_documents, paths, chunksize=8)
        candidates = pydoc_topics() + [doc for docs in per_file for doc in docs]
    stripped = (doc.strip() for doc in candidates)
    return list(dict.fromkeys(doc for doc in stripped if len(doc) >= MIN_CHARS))
