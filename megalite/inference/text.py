"""Text in, text out: tokenised prompts, stop strings, and text deltas for streaming.

Every rank runs the same code on the same tokens, so every rank reaches the same stop
decisions without further communication.
"""
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from torch import nn

from megalite.data.tokenizers import Tokenizer
from megalite.inference.generation import GenerationStats, check_prompts, generate_steps
from megalite.inference.sampling import SamplingParams


@dataclass
class Completion:
    """One prompt's continuation: `text` (cut before a stop string, without the end token),
    `tokens`, `finish_reason` ("stop" after an end token or a stop string, "length"
    otherwise), and the text not yet handed out by `take_delta`.

    The text is decoded after the prompt's last `ANCHOR` tokens and stripped of their text,
    so word boundaries (sentencepiece's leading spaces) come out as in the whole sequence.
    """

    ANCHOR = 8
    tokenizer: Tokenizer
    stop: list[str]
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    _sent: int = 0

    def add(self, token: int, end_ids: Collection[int]) -> bool:
        """Append a token; return whether the completion is finished (a token of `end_ids`,
        which is not appended, or a stop string)."""
        if token in end_ids:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        anchor = self.prompt[-self.ANCHOR:]
        whole = self.tokenizer.detokenize(anchor + self.tokens)
        self.text = whole[len(self.tokenizer.detokenize(anchor)):]
        cut = min((self.text.find(s) for s in self.stop if s in self.text), default=-1)
        if cut >= 0:
            self.text, self.finish_reason = self.text[:cut], "stop"
        return self.finish_reason is not None

    def take_delta(self, final: bool = False) -> str:
        """The text produced since the last call. Until `final`, text that may still turn
        into a stop string or an incomplete character is held back."""
        end = len(self.text)
        if not final and self.finish_reason is None:
            end -= max((len(s) - 1 for s in self.stop), default=0)
            while end > self._sent and self.text[end - 1] == "\ufffd":
                end -= 1
        delta = self.text[self._sent:max(end, self._sent)]
        self._sent += len(delta)
        return delta


def encode_prompts(tokenizer: Tokenizer, prompts: list[str], context: int) -> list[list[int]]:
    """Token ids of each prompt; one ValueError for an empty or too long one."""
    ids = [tokenizer.tokenize(p) for p in prompts]
    check_prompts(ids, context)
    return ids


def complete(model: nn.Module, tokenizer: Tokenizer, prompts: list[str],
             params: SamplingParams, stop: list[str] | None = None,
             stats: GenerationStats | None = None,
             end_ids: Collection[int] | None = None) -> Iterator[list[Completion]]:
    """Generate for a batch of text prompts; after every decoding step yield the batch's
    `Completion`s (use `take_delta` to stream). A row ends at a token of `end_ids` (default:
    the tokenizer's EOS; a chat's: `chat_template.end_of_turn_ids`). Call on every rank of
    the model."""
    ids = encode_prompts(tokenizer, prompts, model.config.max_position_embeddings)
    completions = [Completion(tokenizer, list(stop or []), prompt) for prompt in ids]
    end_ids = frozenset(end_ids if end_ids is not None else (tokenizer.eod,))

    def finished(row: int, tokens: list[int]) -> bool:
        return completions[row].add(tokens[-1], end_ids)

    for _ in generate_steps(model, ids, params, eos_id=None, stop=finished, pad_id=tokenizer.pad,
                            stats=stats):
        yield completions
    for completion in completions:
        completion.finish_reason = completion.finish_reason or "length"
