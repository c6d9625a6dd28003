"""tools/serve.py keeps one request from monopolising it: max_tokens beyond the context or
above --max-tokens gets HTTP 400, --request-timeout cuts a generation short (finish_reason
"length" and a warning), every request is logged, SIGTERM stops it with a message, and a
port already in use ends it with one error line before the model is loaded."""
import contextlib
import io
import signal
import socket
import time

import pytest

from tests.helpers.multirank import run_on_ranks
from tests.test_inference_server import PROMPTS, _post, _stream_events, start_server, tiny_model
from tools import serve

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server whose every request times out after its first token (--request-timeout 1 ns);
    yields (url, the process) and then stops it with SIGTERM."""
    tmp = tmp_path_factory.mktemp("limits")
    tiny_model(tmp)
    proc, url = start_server(tmp, "--max-tokens", str(MAX_TOKENS), "--request-timeout", "1e-9")
    yield url, proc
    if proc.poll() is None:
        proc.kill()


@pytest.mark.parametrize("max_tokens,needle", [
    (60, "plus the prompt's 6 tokens exceed the model's context length (48)"),
    (MAX_TOKENS + 1, f"above this server's limit (--max-tokens {MAX_TOKENS})"),
])
def test_max_tokens_beyond_the_context_or_the_cap_get_400(limited, max_tokens, needle):
    url, _ = limited
    status, answer = _post(url, {"prompt": PROMPTS[0], "max_tokens": max_tokens})
    assert status == 400 and needle in answer["error"]["message"], answer
    assert "max_tokens" in answer["error"]["message"]


def test_request_timeout_stops_generation_and_says_so(limited):
    url, _ = limited
    status, answer = _post(url, {"prompt": PROMPTS[:2], "max_tokens": MAX_TOKENS,
                                 "temperature": 0})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 2  # one step: a token for each prompt
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]
    assert "--request-timeout" in answer["warning"]
    events = _stream_events(url, {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS})
    assert events[-1] == "[DONE]" and "--request-timeout" in events[-2]


def test_sigterm_stops_the_server_with_a_message_and_requests_were_logged(limited):
    url, proc = limited
    assert _post(url, {"prompt": PROMPTS[2], "max_tokens": 3})[0] == 200
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out and out.rstrip().endswith("server stopped"), out
    logged = [line for line in out.splitlines() if line.startswith("cmpl-")]
    assert len(logged) >= 2 and "tokens in" in logged[0] and "(timed out)" in logged[0], out


def test_port_in_use_is_one_error_line_within_seconds(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
            serve.run_tool(lambda: serve.main(["--load", str(tmp_path / "never_read"),
                                               "--port", str(port)]))
    assert stop.value.code == 2 and time.monotonic() - start < 5
    assert err.getvalue() == (f"error: --host 127.0.0.1 --port {port}: cannot listen there "
                              f"(Address already in use)\n")


def _timeout_verdicts() -> bool:
    """Rank 0 has run past a 1 s limit, rank 1 has not: what each rank decides."""
    import torch
    import torch.distributed as dist

    from megalite.device import current_device
    from megalite.inference.serving import CompletionServer, Limits
    model = torch.nn.Linear(1, 1, device=current_device())  # the verdict travels on its device
    server = CompletionServer(model, None, "m", Limits(request_timeout=1.0))
    return server._timed_out(time.perf_counter() - (5.0 if dist.get_rank() == 0 else 0.0))


def test_every_rank_takes_rank_0s_timeout_verdict():
    assert run_on_ranks(2, _timeout_verdicts) == [True, True]
