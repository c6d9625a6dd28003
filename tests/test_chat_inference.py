"""Chat on real weights: SmolLM2-135M-Instruct (its GGUF converted once into a megalite
checkpoint with the GGUF's tokenizer and chat template, tests/conftest.py) behind
tools/serve.py's /v1/chat/completions and tools/generate.py --chat, against transformers'
`apply_chat_template(..., add_generation_prompt=True)` + greedy `generate` on its own GGUF
load (cached), answer text for answer text, streamed or not."""
import contextlib
import io
import json
import urllib.request

import pytest
import torch

from megalite.hf import smollm2_gguf_path
from tests.helpers.multirank import run_on_ranks
from tests.helpers.smollm2 import cached_reference
from tests.test_inference_server import _post, _stream_events, serve

CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name a primary color."},
     {"role": "assistant", "content": "Red."},
     {"role": "user", "content": "Name another one."}],
)
NEW = 12
CHAT = "/v1/chat/completions"


def _greedy_chats(tokenizer, model) -> dict:
    """Per chat: the template's prompt ids, the greedy answer's text (up to EOS), whether
    EOS ended it."""
    ids, texts, stopped = [], [], []
    eos = tokenizer.eos_token_id
    for chat in CHATS:
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), do_sample=False, max_new_tokens=NEW,
            pad_token_id=eos, eos_token_id=eos)[0, len(prompt):].tolist()
        ids.append(prompt)
        stopped.append(eos in out)
        texts.append(tokenizer.decode(out[:out.index(eos)] if eos in out else out))
    return {"ids": ids, "text": texts, "stopped": stopped}


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    """(the session's megalite checkpoint, transformers' answers to CHATS)."""
    return smollm2_checkpoint, cached_reference(smollm2_gguf_path(), f"chat{NEW}", _greedy_chats)


@pytest.fixture(scope="module")
def chat_server(smollm2):
    checkpoint, reference = smollm2
    proc, url = serve("--load", checkpoint)
    yield url, reference
    proc.terminate()
    proc.wait(timeout=30)


def test_chat_answers_equal_transformers_streamed_or_not(chat_server):
    url, reference = chat_server
    assert all(reference["text"]) and any(reference["stopped"]), reference
    for i, chat in enumerate(CHATS):
        status, body = _post(url, {"messages": chat, "max_tokens": NEW, "temperature": 0}, CHAT)
        assert status == 200 and body["object"] == "chat.completion", body
        [choice] = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": reference["text"][i]}
        assert choice["finish_reason"] == ("stop" if reference["stopped"][i] else "length")
        assert body["usage"]["prompt_tokens"] == len(reference["ids"][i])
    events = _stream_events(url, {"messages": CHATS[0], "max_tokens": NEW, "temperature": 0},
                            path=CHAT)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) > 3 and "".join(c["choices"][0]["delta"].get("content", "")
                                       for c in chunks) == reference["text"][0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 4}, "messages: expected a non-empty list"),
    ({"messages": {"role": "user", "content": "Hi"}}, "messages: expected a non-empty list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role: 'tool', expected one"),
    ({"messages": USER + [{"role": "user", "content": 7}]}, "messages[1].content: expected a "
                                                            "string, got int"),
    ({"messages": USER, "max_tokens": -1}, "max_tokens"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "stop": 3}, "'stop'"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "context"),
    (b"[1, 2]", "expected a JSON object"),
    (b"{not json", "JSON"),
])
def test_bad_chat_bodies_get_400_and_the_server_stays_up(chat_server, body, needle):
    url, _ = chat_server
    status, answer = _post(url, body, CHAT)
    assert status == 400 and needle in answer["error"]["message"], answer
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200


def _generate_chat(checkpoint: str) -> str:
    """tools/generate.py --chat in this rank-pool worker: what it prints."""
    from tools import generate
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        generate.main(["--load", checkpoint, "--chat", "--prompt", CHATS[0][0]["content"],
                       "--max-new-tokens", str(NEW)])
    return out.getvalue()


def test_generate_chat_prints_transformers_answer(smollm2):
    checkpoint, reference = smollm2
    lines = run_on_ranks(1, _generate_chat, checkpoint)[0].splitlines()
    assert lines[1] == reference["text"][0], lines  # after the "loaded ..." line
