"""tools/serve.py on 127.0.0.1 at a free port, in front of a random GPT-2 checkpoint with a
small sentencepiece tokenizer. Answers are checked against transformers' greedy `generate`
on the same weights: a completion, a streamed one, a batch prompt, eight concurrent client
threads, a client leaving mid-stream, and bad requests answered 400 while the server stays up;
/v1/models names the model, and a chat request to a tokenizer without a chat template is
answered 400 (chat on a chat model: tests/test_chat_inference.py).
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megalite.checkpoint import write_weights_checkpoint
from megalite.data.tokenizer_training import train_sentencepiece
from megalite.data.tokenizers import SentencePieceTokenizer
from megalite.device import free_port
from megalite.hf.gpt2 import gpt2_config, gpt2_to_megalite
from tests.helpers.reference import tiny_gpt2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The module", "import os", "Return the value", "A list of", "def f(x):",
           "The file", "class", "This function returns"]
CONTEXT = 48


def tiny_model(tmp) -> tuple[object, SentencePieceTokenizer]:
    """A random GPT-2 (transformers) and a 512-piece tokenizer, saved as tmp/ckpt, tmp/sp.model."""
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(m.__doc__ or "" for m in (os, json, socket, subprocess,
                                                          urllib.request, torch.nn.Module)))
    tokenizer = SentencePieceTokenizer(train_sentencepiece([str(corpus)], str(tmp / "sp"), 512))
    hf = tiny_gpt2(vocab=tokenizer.vocab_size, positions=CONTEXT).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for param in hf.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    config = gpt2_config(hf.config)
    write_weights_checkpoint(str(tmp / "ckpt"), gpt2_to_megalite(hf.state_dict(), config), config)
    return hf, tokenizer


def start_server(tmp, *flags: str) -> tuple[subprocess.Popen, str]:
    """tools/serve.py on tmp/ckpt at a free loopback port, once /health answers."""
    return serve("--load", str(tmp / "ckpt"), "--tokenizer", str(tmp / "sp.model"), *flags)


def serve(*flags: str) -> tuple[subprocess.Popen, str]:
    """tools/serve.py with `flags` at a free loopback port, once /health answers."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "serve.py"), "--port",
                             str(port), *flags], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"server did not start:\n{proc.stdout.read()}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    hf, tokenizer = tiny_model(tmp)
    proc, url = start_server(tmp)
    yield url, hf, tokenizer
    proc.terminate()
    proc.wait(timeout=30)


def _expected(hf, tokenizer, prompt: str, max_tokens: int) -> str:
    ids = tokenizer.tokenize(prompt)
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, max_new_tokens=max_tokens, pad_token_id=0,
                      eos_token_id=tokenizer.eod)[0, len(ids):].tolist()
    new = [t for t in out if t != tokenizer.eod]
    return tokenizer.detokenize(ids + new)[len(tokenizer.detokenize(ids)):]


def _post(url: str, body, path: str = "/v1/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _stream_events(url: str, body: dict, keep: int | None = None,
                   path: str = "/v1/completions") -> list:
    request = urllib.request.Request(url + path,
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"content-type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if keep is not None and len(events) >= keep:
                break  # leave mid-stream: the connection closes here
    return events


def test_completion_and_batch_match_transformers(server):
    url, hf, tok = server
    status, body = _post(url, {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == _expected(hf, tok, PROMPTS[0], 12)
    assert len(body["choices"][0]["text"]) > 5, body
    assert body["usage"]["prompt_tokens"] == len(tok.tokenize(PROMPTS[0]))
    status, body = _post(url, {"prompt": PROMPTS[:3], "max_tokens": 10, "temperature": 0})
    assert [c["text"] for c in body["choices"]] == [_expected(hf, tok, p, 10) for p in PROMPTS[:3]]


def test_streamed_completion_matches(server):
    url, hf, tok = server
    events = _stream_events(url, {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 2 and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        _expected(hf, tok, PROMPTS[1], 12)


def test_concurrent_clients_and_a_client_leaving(server):
    url, hf, tok = server
    _stream_events(url, {"prompt": PROMPTS[2], "max_tokens": 30, "temperature": 0}, keep=1)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _post(url, {"prompt": p, "max_tokens": 8,
                                                      "temperature": 0}), PROMPTS))
    for prompt, (status, body) in zip(PROMPTS, answers):
        assert status == 200, body
        assert body["choices"][0]["text"] == _expected(hf, tok, prompt, 8), prompt


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "word " * 200, "max_tokens": 5}, "context"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    (b"{not json", "JSON"),
])
def test_bad_requests_get_400_and_the_server_stays_up(server, body, needle):
    url, hf, tok = server
    status, answer = _post(url, body)
    assert status == 400 and needle in answer["error"]["message"], answer
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
    status, answer = _post(url, {"prompt": PROMPTS[5], "max_tokens": 4, "temperature": 0})
    assert status == 200 and answer["choices"][0]["text"] == _expected(hf, tok, PROMPTS[5], 4)


def test_models_names_the_model_and_chat_needs_a_chat_template(server):
    url, hf, tok = server
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
        assert [m["id"] for m in json.loads(response.read())["data"]] == ["ckpt"]
    status, answer = _post(url, {"messages": [{"role": "user", "content": "The module"}]},
                           "/v1/chat/completions")
    assert status == 400 and "sp.model: this sentencepiece model has no chat template" in \
        answer["error"]["message"], answer
