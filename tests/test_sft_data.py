"""Chat finetuning data on a small word-level tokenizer with a template (tests.test_chat_template):
the loss flags fall on the assistant turns' tokens (content and end-of-turn marker), prompt /
completion records are a user and an assistant turn, overlong conversations are truncated or
dropped and counted, and each kind of bad record is one error naming the file and line."""
import json

import pytest

from megalite.data.chat_data import encode_conversation, encode_conversations, read_conversations
from megalite.data.chat_template import render_chat
from megalite.data.tokenizers import HFTokenizer
from tests.test_chat_template import TEMPLATE, _tokenizer_dir

USER, ANSWER = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "be brief"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer(_tokenizer_dir(tmp_path_factory.mktemp("tok"), TEMPLATE))


def test_loss_flags_are_the_assistant_turns(tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [USER, ANSWER, USER, ANSWER]}) + "\n\n" +
                    json.dumps({"prompt": "hello", "completion": "be brief"}) + "\n")
    first, second = read_conversations(str(path))
    assert second == [USER, ANSWER]
    ids, flags = encode_conversation(tokenizer, first)
    # <|start|> user: hello <|eot|> <|start|> assistant: be brief <|eot|>, twice
    assert tokenizer.detokenize(ids.tolist()).split() == \
        ["<|start|>", "user:", "hello", "<|eot|>", "<|start|>", "assistant:", "be", "brief",
         "<|eot|>"] * 2
    assert flags.tolist() == [False] * 6 + [True] * 3 + [False] * 6 + [True] * 3
    assert encode_conversation(tokenizer, first, loss_on_all_tokens=True)[1].all()
    kept = encode_conversations(tokenizer, [first, second], max_tokens=9)
    assert (kept.truncated, kept.dropped, len(kept.examples)) == (1, 0, 2)
    cut = encode_conversations(tokenizer, [first, second], max_tokens=9, overlong="drop")
    assert (cut.truncated, cut.dropped, len(cut.examples)) == (0, 1, 1)
    none_left = encode_conversations(tokenizer, [first], max_tokens=6)
    assert (none_left.truncated, none_left.dropped, none_left.examples) == (1, 1, [])


@pytest.mark.parametrize("line,message", [
    ('{"messages": [', ":2: malformed JSON (Expecting value at character 16)"),
    ('{"messages": [{"role": "robot", "content": "x"}]}',
     ":2: messages[0].role: 'robot', expected one of system, user, assistant"),
    ('{"messages": []}', ":2: messages: expected a non-empty list"),
    ('{"messages": [{"role": "user", "content": "hello"}]}',
     ":2: messages: no assistant message (nothing to learn)"),
    ('{"messages": [{"role": "user", "content": 3}]}',
     ":2: messages[0].content: expected a string, got int"),
    ('{"prompt": "hello", "completion": ["be"]}', ":2: completion: expected a string, got list"),
    ('{"text": "hello"}', ':2: expected an object with "messages" or with "prompt" and '
                          '"completion"'),
], ids=["malformed json", "unknown role", "empty", "no assistant", "content not a string",
        "completion not a string", "unknown record"])
def test_bad_records_are_one_line_with_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [USER, ANSWER]}) + "\n" + line + "\n")
    with pytest.raises(ValueError) as error:
        read_conversations(str(path))
    assert str(error.value).startswith(f"{path}{message}"), error.value
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("all_tokens", [True, False])
def test_logged_loss_tokens_are_the_label_positions(tokenizer, all_tokens):
    """The count the run logs: label positions (shifted labels != -100 as transformers builds
    them), so a conversation's first token, which is no label, is not counted."""
    conversations = [[USER, ANSWER], [USER, ANSWER, USER, ANSWER]]
    data = encode_conversations(tokenizer, conversations, max_tokens=64,
                                loss_on_all_tokens=all_tokens)
    labels = 0
    for messages in conversations:
        ids = tokenizer.tokenize(render_chat(tokenizer, messages, add_generation_prompt=False))
        words = tokenizer.detokenize(ids).split()  # one token per word in this tokenizer
        assistant = [word in ("be", "brief") or (word == "<|eot|>" and words[i - 1] == "brief")
                     for i, word in enumerate(words)]
        labels += sum(all_tokens or assistant[i] for i in range(1, len(ids)))
    assert labels == ((9 - 1) + (18 - 1) if all_tokens else 3 + 6)
    assert data.loss_tokens == labels
    assert f"{labels} loss tokens" in data.describe("training set")
