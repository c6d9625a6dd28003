"""Stop strings and streamed text deltas of `Completion`, with a character tokenizer: the
text is cut before the first stop string (which may span tokens), EOS ends it, and the
streamed deltas, joined, equal the final text and hold back the last len(stop) - 1 characters until the end."""
from megalite.data.tokenizers import Tokenizer
from megalite.inference.text import Completion

EOS = 0


class Chars(Tokenizer):
    vocab_size, eod, pad = 128, EOS, EOS

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def _feed(text: str, stop: list[str], tokens: list[int] | None = None) -> tuple[Completion, str]:
    completion, streamed = Completion(Chars(), stop, Chars().tokenize("prompt: ")), ""
    for token in tokens if tokens is not None else Chars().tokenize(text):
        done = completion.add(token, {EOS})
        streamed += completion.take_delta()
        if done:
            break
    return completion, streamed + completion.take_delta(final=True)


def test_stop_string_across_tokens_cuts_the_text():
    completion, streamed = _feed("hello wor ld END more", ["END", "xyz"])
    assert completion.text == "hello wor ld " == streamed
    assert completion.finish_reason == "stop"
    assert completion.tokens == Chars().tokenize("hello wor ld END")


def test_partial_stop_string_is_held_back_while_streaming():
    completion = Completion(Chars(), ["END"], [])
    for token in Chars().tokenize("abcE"):
        completion.add(token, {EOS})
    assert completion.take_delta() == "ab"  # the last len("END") - 1 characters wait
    completion.add(ord("x"), {EOS})
    assert completion.take_delta() == "c"
    assert completion.take_delta(final=True) == "Ex"


def test_eos_ends_without_text_and_no_stop_runs_to_length():
    completion, streamed = _feed("", [], Chars().tokenize("abc") + [EOS] + Chars().tokenize("d"))
    assert (completion.text, streamed, completion.finish_reason) == ("abc", "abc", "stop")
    completion, streamed = _feed("abcdef", [])
    assert (completion.text, streamed, completion.finish_reason) == ("abcdef", "abcdef", None)
