"""Tokenizers across conversions: the one a transformers directory or a GGUF file holds goes
into the megalite checkpoint (saved there by megalite.checkpoint), and the one a
checkpoint holds goes beside exported transformers weights."""
import os

from megalite.data.tokenizers import HFTokenizer, Tokenizer, build_tokenizer

# A transformers directory with any of these holds a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")


def source_tokenizer(src: str) -> Tokenizer | None:
    """The tokenizer of a transformers directory or a GGUF file (None, with one printed line
    for a GGUF, when it holds none)."""
    if src.endswith(".gguf"):
        try:
            return build_tokenizer(src)
        except ValueError as error:  # transformers: the GGUF names no tokenizer it can build
            print(f"note: {src}: no tokenizer read ({error}); the checkpoint holds none")
            return None
    if any(os.path.isfile(os.path.join(src, name)) for name in _TOKENIZER_FILES):
        return build_tokenizer(src)
    return None


def export_tokenizer(path: str | None, directory: str) -> None:
    """Write the tokenizer at `path` (a checkpoint's) into the transformers directory
    `directory`, chat template included, for AutoTokenizer.from_pretrained. A sentencepiece
    model is not written (transformers converts it only with protobuf): one printed line."""
    if path is None:
        return
    tokenizer = build_tokenizer(path)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(directory)
    else:
        print(f"note: the tokenizer {path} is a sentencepiece model, not written to {directory} "
              f"(load it with --tokenizer or sentencepiece)")
