"""Chat finetuning data: JSONL conversations -> token ids with a loss flag per token.

One record per line, either `{"messages": [{"role": "system"|"user"|"assistant", "content":
str}, ...]}` or `{"prompt": str, "completion": str}` (a user turn and the assistant's
answer). Conversations are rendered with the tokenizer's own chat template
(megalite.data.chat_template); by default only the assistant turns carry loss: each
assistant turn spans the text between the conversation before it rendered with the
generation prompt and the conversation up to it (its content and end-of-turn marker), and
a token is the assistant's when it starts inside such a span (offsets from the tokenizer).

Bad data is one ValueError naming the file and line: malformed JSON, an unknown record,
role or content, an empty conversation, none with an assistant turn. A conversation longer
than the sequence is truncated (or dropped with `overlong="drop"`); one left with no
assistant token is dropped; both are counted (`ChatExamples`).
"""
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megalite.data.chat_template import check_messages, chat_template, render_chat
from megalite.data.tokenizers import Tokenizer

Example = tuple[np.ndarray, np.ndarray]  # token ids, loss flag per token


@dataclass
class ChatExamples:
    """Encoded conversations and what happened to the overlong ones."""

    examples: list[Example] = field(default_factory=list)
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0

    @property
    def loss_tokens(self) -> int:
        """Tokens that carry loss: flagged tokens after each example's first (a token is a
        label of the one before it; the first token of a conversation is no label)."""
        return sum(int(flags[1:].sum()) for _, flags in self.examples)

    def describe(self, name: str) -> str:
        return (f"{name}: {self.conversations} conversations -> {len(self.examples)} examples, "
                f"{self.loss_tokens} loss tokens ({self.truncated} truncated, "
                f"{self.dropped} dropped)")


def conversation(record, where: str) -> list[dict]:
    """The messages of one JSONL record; ValueError prefixed with `where` (file:line)."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        check_messages(messages, f"{where}: messages")
    elif isinstance(record, dict) and {"prompt", "completion"} <= set(record):
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                raise ValueError(f"{where}: {key}: expected a string, got "
                                 f"{type(record[key]).__name__}")
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["completion"]}]
    else:
        raise ValueError(f"{where}: expected an object with \"messages\" or with \"prompt\" "
                         f"and \"completion\"")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: messages: no assistant message (nothing to learn)")
    return messages


def read_conversations(path: str) -> list[list[dict]]:
    """Every conversation of a JSONL file (blank lines aside); ValueError naming file:line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: malformed JSON ({error.msg} at character "
                                 f"{error.pos + 1})") from None
            out.append(conversation(record, f"{path}:{number}"))
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


def _render(tokenizer: Tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    """The template's text of `messages` (possibly none, then '' if the template needs one)."""
    if messages:
        return render_chat(tokenizer, messages, generation_prompt)
    try:
        return tokenizer.hf.apply_chat_template([], chat_template=chat_template(tokenizer),
                                                tokenize=False,
                                                add_generation_prompt=generation_prompt)
    except Exception:  # a template that reads messages[0]: nothing precedes the first turn
        return ""


def assistant_spans(tokenizer: Tokenizer, messages: list[dict]) -> tuple[str, list[range]]:
    """(the rendered conversation, the character span of each assistant turn)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        through = render_chat(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(f"the chat template of tokenizer {getattr(tokenizer, 'directory', '')}"
                             f" renders a conversation differently from its beginning, so its "
                             f"assistant tokens cannot be found (pass --loss-on-all-tokens)")
        spans.append(range(len(before), len(through)))
    return text, spans


def encode_conversation(tokenizer: Tokenizer, messages: list[dict],
                        loss_on_all_tokens: bool = False) -> Example:
    """Token ids of the rendered conversation and their loss flags (assistant tokens, or all)."""
    if loss_on_all_tokens:
        ids = tokenizer.tokenize(render_chat(tokenizer, messages, add_generation_prompt=False))
        return np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=bool)
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer.hf(text, add_special_tokens=False, return_offsets_mapping=True)
    flags = [any(start in span for span in spans) for start, _ in encoded["offset_mapping"]]
    return np.asarray(encoded["input_ids"], dtype=np.int64), np.asarray(flags, dtype=bool)


def encode_conversations(tokenizer: Tokenizer, conversations: Sequence[list[dict]],
                         max_tokens: int, overlong: str = "truncate",
                         loss_on_all_tokens: bool = False) -> ChatExamples:
    """Encode each conversation; one longer than `max_tokens` is cut to it ("truncate") or
    left out ("drop"), one without a loss token left is dropped; all counted."""
    out = ChatExamples(conversations=len(conversations))
    for messages in conversations:
        ids, flags = encode_conversation(tokenizer, messages, loss_on_all_tokens)
        if len(ids) > max_tokens:
            if overlong == "drop":
                out.dropped += 1
                continue
            ids, flags = ids[:max_tokens], flags[:max_tokens]
            out.truncated += 1
        if not flags[1:].any():  # the first token is never a label
            out.dropped += 1
            continue
        out.examples.append((ids, flags))
    return out
