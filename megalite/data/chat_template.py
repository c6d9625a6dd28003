"""Chat templates: a conversation (a list of `{"role", "content"}` messages) -> the prompt text
or token ids a chat model was trained on, with the tokenizer's own template.

The template is the one the transformers tokenizer carries, whatever `HFTokenizer` wraps: a
transformers directory (`chat_template.jinja` / `tokenizer_config.json`), the `tokenizer/`
saved in a megalite checkpoint (written by `save_pretrained`, template included), or a GGUF
file (its `tokenizer.chat_template`, read by transformers). It is rendered by transformers'
`apply_chat_template` (jinja). A tokenizer without one (a sentencepiece model, a transformers
tokenizer with no template) is one ValueError naming it: there is no silent fallback.

  check_messages(messages, where)   ValueError naming the first bad message
  chat_template(tokenizer)          the jinja template (ValueError if none)
  render_chat(tokenizer, messages)  the prompt text (tokenizer.tokenize gives its ids)
  end_of_turn_ids(tokenizer)        ids that end an assistant turn (EOS, <|im_end|>, ...)
"""
from __future__ import annotations

from megalite.data.tokenizers import HFTokenizer, Tokenizer

ROLES = ("system", "user", "assistant")


def check_messages(messages, where: str = "messages") -> None:
    """One ValueError, prefixed with `where` (e.g. "data.jsonl:12: messages"), unless
    `messages` is a non-empty list of {"role": system|user|assistant, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{\"role\", \"content\"}} "
                         f"messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}[{i}]: expected an object with \"role\" and \"content\", "
                             f"got {type(message).__name__}")
        if message.get("role") not in ROLES:
            raise ValueError(f"{where}[{i}].role: {message.get('role')!r}, expected one of "
                             f"{', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}[{i}].content: expected a string, got "
                             f"{type(message.get('content')).__name__}")


def _name(tokenizer: Tokenizer) -> str:
    return getattr(tokenizer, "directory", None) or getattr(tokenizer, "model_path", None) \
        or type(tokenizer).__name__


def chat_template(tokenizer: Tokenizer) -> str:
    """The tokenizer's jinja chat template; ValueError naming the tokenizer if it has none."""
    template = tokenizer.hf.chat_template if isinstance(tokenizer, HFTokenizer) else None
    if not isinstance(template, str) or not template:
        kind = "transformers tokenizer" if isinstance(tokenizer, HFTokenizer) else \
            "sentencepiece model" if hasattr(tokenizer, "model_path") else "tokenizer"
        raise ValueError(f"tokenizer {_name(tokenizer)}: this {kind} has no chat template "
                         f"(expected a transformers tokenizer or a .gguf carrying one: "
                         f"chat_template.jinja, tokenizer_config.json's chat_template, or the "
                         f"GGUF's tokenizer.chat_template)")
    return template


def render_chat(tokenizer: Tokenizer, messages: list[dict],
                add_generation_prompt: bool = True) -> str:
    """The conversation as the template writes it; with `add_generation_prompt`, followed by
    the opening of an assistant turn (what a model answers after). Checks `messages` first;
    a conversation the template itself refuses (e.g. roles not alternating) is a ValueError
    too."""
    from jinja2 import TemplateError
    check_messages(messages)
    template = chat_template(tokenizer)
    try:
        return tokenizer.hf.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages],
            chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as error:
        raise ValueError(f"messages: the chat template of tokenizer {_name(tokenizer)} refuses "
                         f"them ({error})") from None


def end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids after which a generated assistant turn is over: the tokenizer's EOS, and the
    special token the template writes right after an assistant message's content (ChatML's
    <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>), when there is one."""
    marker = "\x00megalite-end-of-turn\x00"
    text = render_chat(tokenizer, [{"role": "user", "content": "?"},
                                   {"role": "assistant", "content": marker}], False)
    ids = [tokenizer.eod]
    after = text.partition(marker)[2]
    special = set(tokenizer.hf.all_special_ids) | set(tokenizer.hf.added_tokens_decoder)
    following = tokenizer.tokenize(after)[:1]
    if following and following[0] in special and following[0] not in ids:
        ids.append(following[0])
    return ids
