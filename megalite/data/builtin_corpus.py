"""The built-in default corpus: Python's own documentation text, tokenised and cached.

On first use the text of `builtin_extract.builtin_documents` is written to
`corpus.jsonl`, a sentencepiece BPE model (vocabulary VOCAB_SIZE) is trained on it,
and the documents are tokenised with an end-of-document token each into
`builtin_text_document.bin/.idx`. The build happens in a temporary sibling folder
renamed into place at the end, with a `DONE` marker, so an interrupted build is
never mistaken for a finished one. Default location: `$MEGALITE_CACHE/builtin`,
`MEGALITE_CACHE` defaulting to `~/.cache/megalite`.

A run with another tokenizer (`--tokenizer`, or the one a loaded checkpoint carries) gets
the same documents tokenised with it, built the same way once per tokenizer into the
sibling folder `builtin-<first 16 hex digits of its fingerprint>` (the tokenizer's saved
files hashed: see `tokenizers.tokenizer_fingerprint`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from megalite.data.builtin_extract import builtin_documents
from megalite.data.preprocess import output_prefix_for, preprocess_documents
from megalite.data.tokenizer_training import train_sentencepiece
from megalite.data.tokenizers import build_tokenizer, tokenizer_fingerprint
from megalite.device import cache_root

VOCAB_SIZE = 8000
TRAINING_LINES = 200_000
MARKER = "DONE"


@dataclass(frozen=True)
class BuiltinCorpus:
    data_prefix: str  # indexed dataset prefix (without .bin/.idx)
    tokenizer_path: str  # sentencepiece .model, or the tokenizer it was retokenised with
    vocab_size: int


def default_cache_dir() -> str:
    """`$MEGALITE_CACHE/builtin`, or `~/.cache/megalite/builtin`."""
    return os.path.join(cache_root(), "builtin")


def _log(message: str) -> None:
    print(f"[megalite builtin corpus] {message}", flush=True)


def _build(directory: str) -> dict:
    """Extract, train the tokenizer and tokenise into `directory`; returns the figures."""
    start, workers = time.time(), os.cpu_count() or 1
    _log(f"extracting documentation text from the standard library ({workers} processes)")
    documents = builtin_documents(workers=workers)
    megabytes = sum(len(doc.encode()) for doc in documents) / 1e6
    with open(os.path.join(directory, "corpus.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in documents)
    _log(f"{len(documents)} documents, {megabytes:.1f} MB of text ({time.time() - start:.0f} s); "
         f"training a {VOCAB_SIZE}-token sentencepiece BPE model")
    lines_path = os.path.join(directory, "tokenizer_input.txt")
    with open(lines_path, "w", encoding="utf-8") as f:
        f.writelines(doc + "\n" for doc in documents)
    tokenizer_path = train_sentencepiece([lines_path], os.path.join(directory, "tokenizer"),
                                         VOCAB_SIZE, "bpe", input_sentence_size=TRAINING_LINES)
    os.remove(lines_path)
    _log(f"tokenizer trained ({time.time() - start:.0f} s); tokenizing")
    counts = preprocess_documents(({"text": doc} for doc in documents), ["text"], tokenizer_path,
                                  os.path.join(directory, "builtin"), append_eod=True,
                                  workers=workers, total=len(documents), progress=False)
    docs, tokens = counts["text"]
    figures = {"documents": docs, "tokens": tokens, "megabytes": round(megabytes, 2),
               "vocab_size": VOCAB_SIZE, "build_seconds": round(time.time() - start, 1)}
    _log(f"{docs} documents, {tokens} tokens ({figures['build_seconds']} s)")
    return figures


def _retokenize(source: str, tokenizer_path: str, directory: str) -> dict:
    """The documents of the corpus in `source` tokenised with `tokenizer_path` into
    `directory`, with a copy of the tokenizer; returns the figures."""
    start, workers = time.time(), os.cpu_count() or 1
    tokenizer = build_tokenizer(tokenizer_path)
    saved = tokenizer.save(os.path.join(directory, "tokenizer"))
    with open(os.path.join(source, "corpus.jsonl"), encoding="utf-8") as f:
        documents = [json.loads(line) for line in f]
    counts = preprocess_documents(documents, ["text"], saved, os.path.join(directory, "builtin"),
                                  append_eod=True, workers=workers, total=len(documents),
                                  progress=False)
    docs, tokens = counts["text"]
    figures = {"documents": docs, "tokens": tokens, "vocab_size": tokenizer.vocab_size,
               "tokenizer": os.path.relpath(saved, directory),
               "build_seconds": round(time.time() - start, 1)}
    _log(f"{docs} documents, {tokens} tokens with {tokenizer_path} ({figures['build_seconds']} s)")
    return figures


def _load(directory: str) -> BuiltinCorpus:
    with open(os.path.join(directory, MARKER)) as f:
        figures = json.load(f)
    return BuiltinCorpus(output_prefix_for(os.path.join(directory, "builtin"), "text"),
                         os.path.join(directory, figures.get("tokenizer", "tokenizer.model")),
                         figures["vocab_size"])


def builtin_corpus(cache_dir: str | None = None, is_builder_rank: bool = True,
                   barrier: Callable[[], None] = lambda: None,
                   tokenizer: str | None = None) -> BuiltinCorpus:
    """The built-in corpus in `cache_dir` (default `default_cache_dir()`), built there on
    first use by the builder rank while the others wait in `barrier()`; with `tokenizer`
    (a path build_tokenizer takes) other than the corpus's own, its documents tokenised with
    that tokenizer (built once, in a sibling folder)."""
    directory = os.path.abspath(cache_dir or default_cache_dir())
    corpus = _built(directory, _build, is_builder_rank, barrier)
    if tokenizer is None:
        return corpus
    key = tokenizer_fingerprint(build_tokenizer(tokenizer))
    if key == tokenizer_fingerprint(build_tokenizer(corpus.tokenizer_path)):
        return corpus
    return _built(f"{directory}-{key[:16]}",
                  lambda staging: _retokenize(directory, tokenizer, staging),
                  is_builder_rank, barrier)


def _built(directory: str, build: Callable[[str], dict], is_builder_rank: bool,
           barrier: Callable[[], None]) -> BuiltinCorpus:
    """The corpus in `directory`; first `build(staging)` (-> figures) by the builder rank
    into a staging folder renamed to `directory` with a DONE marker."""
    done = os.path.join(directory, MARKER)
    if is_builder_rank and not os.path.isfile(done):
        if os.path.isdir(directory) and os.listdir(directory):
            raise FileExistsError(f"{directory}: exists without a {MARKER} marker; expected an "
                                  f"empty or absent folder to build the builtin corpus in")
        _log(f"building in {directory} (first use; 10-30 s)")
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp-",
                                   dir=os.path.dirname(directory))
        try:
            figures = build(staging)
            with open(os.path.join(staging, MARKER), "w") as f:
                json.dump(figures, f, indent=1)
            os.chmod(staging, 0o755)
            try:
                os.replace(staging, directory)
            except OSError:  # another process finished the same build first
                if not os.path.isfile(done):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    barrier()
    if not os.path.isfile(done):
        raise FileNotFoundError(f"{done}: missing after the builder rank's barrier (expected the "
                                f"builder rank to build the builtin corpus in a shared folder)")
    return _load(directory)
