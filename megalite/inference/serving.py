"""An OpenAI-style completions server in front of `complete`: FastAPI on rank 0, every rank in
the generation loop.

Rank 0's HTTP handlers validate a request (400 with a message when it is bad: among others
a prompt plus max_tokens beyond the model's context, or max_tokens above the server's
`Limits.max_tokens`) and queue it; the loop, on every rank, takes one queued request at a
time (rank 0 broadcasts it on the world group; an idle tick every `IDLE_TICK_S` keeps the
followers' waits short of the process-group timeout) and generates for its prompts as one
batch, for at most `Limits.request_timeout` seconds (then finish_reason "length" and a
"warning" in the response). Events go back to the waiting handler through a queue, so a
client that leaves mid-stream costs nothing but the rest of its generation. Rank 0 logs
every request; SIGTERM ends the loop after the queued requests.
"""
import json
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megalite.data.tokenizers import Tokenizer
from megalite.inference.generation import GenerationStats
from megalite.inference.sampling import SamplingParams
from megalite.inference.text import complete, encode_prompts
from megalite.mpu import comm

IDLE_TICK_S = 2.0


class BadRequest(ValueError):
    """A request the server answers with HTTP 400."""


@dataclass(frozen=True)
class Limits:
    """What one request may take: max_tokens at most `max_tokens` (None: up to the context;
    more is answered 400), generation for at most `request_timeout` seconds (None: no limit;
    then finish_reason "length" and a warning in the response)."""

    max_tokens: int | None = None
    request_timeout: float | None = None


@dataclass
class Request:
    """A validated completion request and the queue its results come back on."""

    prompts: list[str]
    params: SamplingParams
    stop: list[str]
    stream: bool
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:16]}")
    events: queue.Queue = field(default_factory=queue.Queue)


def parse_request(body, tokenizer: Tokenizer, context: int, limits: Limits = Limits()
                  ) -> Request:
    """An OpenAI completions body -> Request; BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not isinstance(prompts, list) or not all(isinstance(p, str)
                                                               for p in prompts):
        raise BadRequest("'prompt' is required: a string or a non-empty list of strings")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    try:
        params = SamplingParams(max_new_tokens=int(body.get("max_tokens", 16)),
                                temperature=float(body.get("temperature", 1.0)),
                                top_k=int(body.get("top_k", 0)),
                                top_p=float(body.get("top_p", 1.0)),
                                seed=None if body.get("seed") is None else int(body["seed"]))
        params.validate()
        longest = max(map(len, encode_prompts(tokenizer, prompts, context)))
    except (TypeError, ValueError) as error:
        raise BadRequest(str(error).replace("max_new_tokens", "max_tokens")) from None
    if longest + params.max_new_tokens > context:
        raise BadRequest(f"max_tokens ({params.max_new_tokens}) plus the prompt's {longest} "
                         f"tokens exceed the model's context length ({context})")
    if limits.max_tokens is not None and params.max_new_tokens > limits.max_tokens:
        raise BadRequest(f"max_tokens ({params.max_new_tokens}) is above this server's limit "
                         f"(--max-tokens {limits.max_tokens})")
    return Request(prompts, params, stop, bool(body.get("stream", False)))


def _choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


class CompletionServer:
    """`app()` (rank 0) answers HTTP; `loop()` (every rank) generates."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, model_name: str,
                 limits: Limits = Limits()) -> None:
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.limits = limits
        self.requests: queue.Queue[Request | None] = queue.Queue()

    def stop_on_sigterm(self) -> None:
        """SIGTERM ends `loop` once the requests queued before it are answered (rank 0 tells
        the other ranks; they ignore their own SIGTERM and wait for that)."""
        def handler(signum, frame) -> None:
            if dist.get_rank() == 0:
                print("received SIGTERM: answering the queued requests, then stopping",
                      flush=True)
                self.requests.put(None)
        signal.signal(signal.SIGTERM, handler)

    def _timed_out(self, start: float) -> bool:
        """Whether rank 0 has spent --request-timeout on this request (every rank learns
        rank 0's answer, so all stop after the same step)."""
        timeout = self.limits.request_timeout
        if timeout is None:
            return False
        late = torch.tensor([float(time.perf_counter() - start > timeout)],
                            device=next(self.model.parameters()).device)
        comm.broadcast(late, 0, dist.group.WORLD)  # every rank generates
        return bool(late.item())

    def _header(self, request: Request) -> dict:
        return {"id": request.id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}

    def _run(self, request: Request) -> None:
        """Generate for one request (every rank); rank 0 posts the events and logs it."""
        stats, completions, timed_out = GenerationStats(), [], False
        post = request.events.put if dist.get_rank() == 0 else (lambda event: None)
        start = time.perf_counter()
        for completions in complete(self.model, self.tokenizer, request.prompts, request.params,
                                    request.stop, stats):
            if request.stream:
                deltas = [c.take_delta() for c in completions]
                post(("delta", [_choice(i, d, None) for i, d in enumerate(deltas) if d]))
            if self._timed_out(start):
                timed_out = True
                break
        choices = [_choice(i, c.take_delta(final=True) if request.stream else c.text,
                           c.finish_reason or "length") for i, c in enumerate(completions)]
        usage = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
                 "total_tokens": stats.prompt_tokens + stats.new_tokens}
        warning = f"stopped after --request-timeout {self.limits.request_timeout} s" \
            if timed_out else None
        post(("done", choices, usage, warning))
        if dist.get_rank() == 0:
            print(f"{request.id}: {len(request.prompts)} prompt(s), {stats.prompt_tokens} tokens "
                  f"in, {stats.new_tokens} out, {time.perf_counter() - start:.2f} s"
                  + (" (timed out)" if timed_out else ""), flush=True)

    def _next_request(self) -> Request | str:
        """Rank 0 takes the next queued request ("idle" after IDLE_TICK_S, "stop" for None)
        and broadcasts what the followers need to rebuild it (world group)."""
        item: Request | str = "idle"
        if dist.get_rank() == 0:
            try:
                queued = self.requests.get(timeout=IDLE_TICK_S)
                item = "stop" if queued is None else queued
            except queue.Empty:
                pass
        if dist.get_world_size() == 1:
            return item
        box = [item if isinstance(item, str) else
               (item.prompts, item.params, item.stop, item.stream)]
        dist.broadcast_object_list(box, src=0)
        if dist.get_rank() == 0 or isinstance(box[0], str):
            return item if dist.get_rank() == 0 else box[0]
        return Request(*box[0])

    def loop(self) -> None:
        """Serve queued requests one batch at a time until `None` is queued (every rank)."""
        while (request := self._next_request()) != "stop":
            if request == "idle":
                continue
            try:
                self._run(request)
            except ValueError as error:  # the same on every rank: the loop goes on
                request.events.put(("error", str(error)))

    def _events(self, request: Request) -> Iterator[tuple]:
        while True:
            event = request.events.get()
            yield event
            if event[0] in ("done", "error"):
                return

    def app(self):
        """The FastAPI application: POST /v1/completions, GET /health."""
        from fastapi import FastAPI, Request as HTTPRequest
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="megalite completions")
        context = self.model.config.max_position_embeddings

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}},
                                status_code=status)

        @app.get("/health")
        def health() -> dict:
            return {"status": "ok", "model": self.model_name}

        @app.post("/v1/completions")
        async def completions(http_request: HTTPRequest):
            try:
                body = json.loads(await http_request.body())
            except ValueError:
                return error(400, "body is not valid JSON")
            try:
                request = parse_request(body, self.tokenizer, context, self.limits)
            except BadRequest as bad:
                return error(400, str(bad))
            self.requests.put(request)
            if request.stream:
                return StreamingResponse(self._sse(request), media_type="text/event-stream")
            return await _in_thread(self._answer, request)

        return app

    def _answer(self, request: Request):
        from fastapi.responses import JSONResponse
        for event in self._events(request):
            if event[0] == "error":
                return JSONResponse({"error": {"message": event[1]}}, status_code=400)
            if event[0] == "done":
                warning = {"warning": event[3]} if event[3] else {}
                return {**self._header(request), "choices": event[1], "usage": event[2],
                        **warning}

    def _sse(self, request: Request) -> Iterator[str]:
        for event in self._events(request):
            if event[0] == "error":
                yield f"data: {json.dumps({'error': {'message': event[1]}})}\n\n"
                break
            choices = event[1]
            if event[0] == "delta" and not choices:
                continue
            warning = {"warning": event[3]} if event[0] == "done" and event[3] else {}
            chunk = {**self._header(request), "choices": choices, **warning}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"


async def _in_thread(fn, *args):
    from starlette.concurrency import run_in_threadpool
    return await run_in_threadpool(fn, *args)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port; ValueError naming --port/--host when it cannot
    (taken, or not an address of this machine)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(info[4])
            sock.listen(128)
        except OSError:
            sock.close()
            raise
    except OSError as error:
        raise ValueError(f"--host {host} --port {port}: cannot listen there "
                         f"({error.strerror or error})") from None
    return sock


def serve_http(server: CompletionServer, sock: socket.socket) -> threading.Thread:
    """Start uvicorn for `server.app()` on the listening `sock` in a daemon thread (rank 0)."""
    import uvicorn
    config = uvicorn.Config(server.app(), log_level="warning")
    thread = threading.Thread(target=uvicorn.Server(config).run, kwargs={"sockets": [sock]},
                              daemon=True)
    thread.start()
    return thread
