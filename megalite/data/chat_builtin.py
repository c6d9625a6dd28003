"""The built-in chat set: questions about standard-library functions answered from their
docstrings, built on the fly from the running Python (nothing to download).

Each public function or class of a few stdlib modules that has a docstring becomes one
conversation: after a short system prompt the user asks what `module.name` does, the
assistant answers with its signature and the first paragraph of its documentation. A stable hash of the name holds out
about one in eight for validation.
"""
import importlib
import inspect
import zlib

MODULES = ("math", "string", "textwrap", "os.path", "json", "shutil", "itertools", "functools",
           "statistics", "heapq", "bisect", "fnmatch", "glob", "base64", "calendar", "difflib",
           "random", "operator", "colorsys", "html", "zlib", "secrets", "keyword", "copy")
MAX_ANSWER_CHARS = 240
SYSTEM = "Answer with the signature and the first line of the documentation."


def _answer(qualified: str, obj) -> str | None:
    """`qualified(signature)`: the first paragraph of the docstring (None: no usable one)."""
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    paragraph = " ".join(doc.split("\n\n")[0].split())
    if len(paragraph) < 20:
        return None
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        signature = "(...)"
    if len(paragraph) > MAX_ANSWER_CHARS:
        paragraph = paragraph[:MAX_ANSWER_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"`{qualified}{signature}`: {paragraph}"


def _conversations() -> list[tuple[str, list[dict]]]:
    out = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if name.startswith("_") or not callable(obj) or inspect.ismodule(obj):
                continue
            qualified = f"{module_name}.{name}"
            answer = _answer(qualified, obj)
            if answer:
                out.append((qualified, [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What does {qualified} do in Python?"},
                    {"role": "assistant", "content": answer}]))
    return out


def builtin_chat_set() -> tuple[list[list[dict]], list[list[dict]]]:
    """(training, held-out) conversations."""
    train, held_out = [], []
    for qualified, messages in _conversations():
        (held_out if zlib.crc32(qualified.encode()) % 8 == 0 else train).append(messages)
    return train, held_out
