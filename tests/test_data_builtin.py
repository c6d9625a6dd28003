"""Built-in corpus: extraction from Python sources, and the cached build (on a small text)."""
import json
import os

import numpy as np
import pytest

from megalite.data import builtin_corpus as bc
from megalite.data.builtin_extract import (builtin_documents, comment_blocks, docstrings,
                                           pydoc_topics, source_documents, stdlib_sources)
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import build_tokenizer

SOURCE = '''#!/usr/bin/env python3
# -*- coding: utf-8 -*-
"""Module docstring that is long enough to keep."""

# A block of comments
# spanning two lines.
x = "# not a comment"  # trailing comment

class A:
    """Class docstring."""

    def f(self):
        """Function docstring.

        detail
            indented more
        """
        #   indented comment
'''


def test_docstrings_and_comments():
    assert docstrings(SOURCE) == ["Module docstring that is long enough to keep.", "Class docstring.",
                                  "Function docstring.\n\ndetail\n    indented more"]
    assert comment_blocks(SOURCE) == ["A block of comments\nspanning two lines.", "  indented comment"]


def test_sources_and_documents(tmp_path):
    for path in ("a.py", "pkg/b.py", "test/test_c.py", "idlelib/d.py", "site-packages/e/f.py",
                 "encodings/g.py", "pkg/notes.txt"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(SOURCE)
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")
    found = [os.path.relpath(p, tmp_path) for p in stdlib_sources(str(tmp_path))]
    assert found == ["a.py", "pkg/b.py", "pkg/broken.py", "test/test_c.py"]
    assert source_documents(str(tmp_path / "pkg" / "broken.py")) == []

    topics = pydoc_topics()
    assert len(topics) > 50 and any("The \"if\" statement" in t for t in topics)
    documents = builtin_documents(str(tmp_path), workers=2)
    unique_topics = list(dict.fromkeys(t for t in topics if len(t) >= 40))
    assert documents == unique_topics + docstrings(SOURCE)[::2]  # class docstring too short


def small_documents(n=300):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    return [" ".join(words[(i * k) % len(words)] for k in range(5 + i % 17)) + f" #{i}\nend."
            for i in range(n)]


def test_builtin_corpus_build_and_reuse(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bc, "builtin_documents", lambda workers: small_documents())
    monkeypatch.setattr(bc, "VOCAB_SIZE", 300)
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path / "cache"))
    corpus = bc.builtin_corpus()
    assert "building in" in capsys.readouterr().out
    directory = tmp_path / "cache" / "builtin"
    assert corpus.data_prefix == str(directory / "builtin_text_document") and corpus.vocab_size == 300
    assert sorted(os.listdir(tmp_path / "cache")) == ["builtin"]  # staging folder renamed away
    figures = json.loads((directory / "DONE").read_text())
    tokenizer, ds = build_tokenizer(corpus.tokenizer_path), IndexedDataset(corpus.data_prefix)
    assert figures["documents"] == len(ds) == 300 and figures["tokens"] == int(ds.sizes.sum())
    for i in (0, 7, 299):
        np.testing.assert_array_equal(ds[i], tokenizer.tokenize(small_documents()[i]) + [tokenizer.eod])

    monkeypatch.setattr(bc, "_build", lambda directory: pytest.fail("rebuilt a finished corpus"))
    barriers = []
    assert bc.builtin_corpus(str(directory), is_builder_rank=False, barrier=lambda: barriers.append(1)) == corpus
    assert barriers == [1]


def test_builtin_corpus_failed_or_foreign_folders(tmp_path, monkeypatch):
    def killed(directory):
        (tmp_path / "partial").write_text(directory)
        raise KeyboardInterrupt

    monkeypatch.setattr(bc, "_build", killed)
    with pytest.raises(KeyboardInterrupt):
        bc.builtin_corpus(str(tmp_path / "c"))
    assert os.listdir(tmp_path) == ["partial"]  # neither the staging folder nor a half-built corpus
    with pytest.raises(FileNotFoundError, match="DONE: missing after the builder rank's barrier"):
        bc.builtin_corpus(str(tmp_path / "c"), is_builder_rank=False)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.txt").write_text("x")
    with pytest.raises(FileExistsError, match="exists without a DONE marker"):
        bc.builtin_corpus(str(tmp_path / "c"))
