"""Tokenizers behind one small interface: sentencepiece models and local HF tokenizers.

`build_tokenizer(path)` picks by what `path` is: a directory is a Hugging Face
tokenizer (loaded with `AutoTokenizer.from_pretrained(dir, local_files_only=True)`), a
`.gguf` file the tokenizer stored in it (transformers reads it), any other file a
sentencepiece `.model`. `Tokenizer.save` writes the files that build the same tokenizer
again (what a checkpoint carries); `tokenizer_fingerprint` hashes them, so two paths
holding the same tokenizer in different forms (a GGUF file, its saved directory) agree.
Nothing here reaches the network.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from abc import ABC, abstractmethod


class Tokenizer(ABC):
    """Text <-> token ids. `eod` ends a document; `pad` fills batches (= `eod` if absent)."""

    vocab_size: int
    eod: int
    pad: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""

    @abstractmethod
    def detokenize(self, ids: list[int]) -> str:
        """Text of token ids."""

    def save(self, directory: str) -> str:
        """Write this tokenizer's files into `directory`; returns the path `build_tokenizer`
        takes to load it again (the file-backed tokenizers below can)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be saved")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` file; `eod` is its `</s>` (eos) piece."""

    def __init__(self, model_path: str) -> None:
        import sentencepiece

        self.model_path = model_path
        with open(model_path, "rb") as f:
            self._proto = f.read()
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=self._proto)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"{model_path}: sentencepiece model has no eos piece, expected one "
                             f"to use as end-of-document")
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(list(map(int, ids)))

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "tokenizer.model")
        with open(path, "wb") as f:
            f.write(self._proto)
        return path


class HFTokenizer(Tokenizer):
    """A local Hugging Face tokenizer directory, or the tokenizer inside a GGUF file; `eod` is
    its eos token, else its sep token."""

    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        self.directory = directory
        if directory.endswith(".gguf"):  # AutoTokenizer would parse the whole file for a config
            directory, name = os.path.split(directory)
            self._tok = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name,
                                                                local_files_only=True)
        else:
            self._tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.vocab_size = len(self._tok)
        eod = self._tok.eos_token_id if self._tok.eos_token_id is not None else self._tok.sep_token_id
        if eod is None:
            raise ValueError(f"{directory}: tokenizer has neither an eos nor a sep token, expected "
                             f"one to use as end-of-document")
        self.eod = eod
        self.pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else eod

    @property
    def hf(self):
        """The wrapped transformers tokenizer (its chat template, special tokens)."""
        return self._tok

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(map(int, ids)))

    def save(self, directory: str) -> str:
        """save_pretrained: tokenizer.json, tokenizer_config.json and the chat template."""
        self._tok.save_pretrained(directory)
        return directory


def build_tokenizer(path: str) -> Tokenizer:
    """A sentencepiece tokenizer for a `.model` file, an HF tokenizer for a directory or a
    `.gguf` file."""
    if os.path.isdir(path) or (path.endswith(".gguf") and os.path.isfile(path)):
        return HFTokenizer(path)
    if os.path.isfile(path):
        return SentencePieceTokenizer(path)
    raise FileNotFoundError(f"--tokenizer {path}: no such file or directory (expected a "
                            f"sentencepiece .model file, a Hugging Face tokenizer directory or a .gguf file)")


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """SHA-256 (hex) of the files `tokenizer.save` writes: the same for every path that
    holds this tokenizer."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save(directory)
        for name in sorted(os.listdir(directory)):
            digest.update(name.encode() + b"\0")
            with open(os.path.join(directory, name), "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()
