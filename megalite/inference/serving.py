"""An OpenAI-style completions server in front of `complete`: FastAPI on rank 0, every rank in
the generation loop. /v1/completions takes prompts; /v1/chat/completions takes a conversation,
renders it with the tokenizer's chat template (megalite.data.chat_template) and ends the
answer at an end-of-turn token; /v1/models names the model.

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

from megalite.data.chat_template import end_of_turn_ids, render_chat
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
    """A validated completion request (`chat`: a chat completion, its conversation rendered
    into the one prompt) and the queue its results come back on."""

    prompts: list[str]
    params: SamplingParams
    stop: list[str]
    stream: bool
    chat: bool = False
    id: str = ""
    events: queue.Queue = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"


def _prompts(body: dict, tokenizer: Tokenizer, chat: bool) -> list[str]:
    """The prompt texts of a completions body, or the one rendered conversation of a chat."""
    if chat:
        try:
            return [render_chat(tokenizer, body.get("messages"))]
        except ValueError as error:  # a bad conversation, or no chat template
            raise BadRequest(str(error)) from None
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not isinstance(prompts, list) or not all(isinstance(p, str)
                                                               for p in prompts):
        raise BadRequest("'prompt' is required: a string or a non-empty list of strings")
    return prompts


def parse_request(body, tokenizer: Tokenizer, context: int, limits: Limits = Limits(),
                  chat: bool = False) -> Request:
    """An OpenAI completions body (`chat`: a chat completions body, with `messages`) ->
    Request; BadRequest naming the first bad field. max_tokens defaults to 16, for a chat
    to the rest of the context (at most --max-tokens), as OpenAI's chat does."""
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    prompts = _prompts(body, tokenizer, chat)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    try:
        longest = max(map(len, encode_prompts(tokenizer, prompts, context)))
        default = min(context - longest, limits.max_tokens or context) if chat else 16
        max_tokens = body.get("max_tokens")
        params = SamplingParams(max_new_tokens=default if max_tokens is None else int(max_tokens),
                                temperature=float(body.get("temperature", 1.0)),
                                top_k=int(body.get("top_k", 0)),
                                top_p=float(body.get("top_p", 1.0)),
                                seed=None if body.get("seed") is None else int(body["seed"]))
        params.validate()
    except (TypeError, ValueError) as error:
        raise BadRequest(str(error).replace("max_new_tokens", "max_tokens")) from None
    if longest + params.max_new_tokens > context:
        raise BadRequest(f"max_tokens ({params.max_new_tokens}) plus the prompt's {longest} "
                         f"tokens exceed the model's context length ({context})")
    if limits.max_tokens is not None and params.max_new_tokens > limits.max_tokens:
        raise BadRequest(f"max_tokens ({params.max_new_tokens}) is above this server's limit "
                         f"(--max-tokens {limits.max_tokens})")
    return Request(prompts, params, stop, bool(body.get("stream", False)), chat)


def _choice(request: Request, index: int, text: str, finish_reason: str | None) -> dict:
    """One choice of a response: `text` (completions), `message` (chat) or `delta` (a chat
    stream's chunk)."""
    key, value = "text", text
    if request.chat:
        key, value = ("delta", {"content": text} if text else {}) if request.stream else \
            ("message", {"role": "assistant", "content": text})
    return {"index": index, key: value, "logprobs": None, "finish_reason": finish_reason}


class CompletionServer:
    """`app()` (rank 0) answers HTTP; `loop()` (every rank) generates."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, model_name: str,
                 limits: Limits = Limits()) -> None:
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.limits, self.created = limits, int(time.time())
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
        kind = "text_completion" if not request.chat else \
            "chat.completion.chunk" if request.stream else "chat.completion"
        return {"id": request.id, "object": kind, "created": int(time.time()),
                "model": self.model_name}

    def _run(self, request: Request) -> None:
        """Generate for one request (every rank); rank 0 posts the events and logs it."""
        stats, completions, timed_out = GenerationStats(), [], False
        post = request.events.put if dist.get_rank() == 0 else (lambda event: None)
        start = time.perf_counter()
        end_ids = end_of_turn_ids(self.tokenizer) if request.chat else None
        for completions in complete(self.model, self.tokenizer, request.prompts, request.params,
                                    request.stop, stats, end_ids):
            if request.stream:
                deltas = [c.take_delta() for c in completions]
                post(("delta", [_choice(request, i, d, None) for i, d in enumerate(deltas)
                                if d]))
            if self._timed_out(start):
                timed_out = True
                break
        choices = [_choice(request, i, c.take_delta(final=True) if request.stream else c.text,
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
               (item.prompts, item.params, item.stop, item.stream, item.chat)]
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
        """The FastAPI application: POST /v1/completions and /v1/chat/completions, GET
        /v1/models and /health."""
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

        @app.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                "created": self.created, "owned_by": "megalite"}]}

        async def answer(http_request: HTTPRequest, chat: bool):
            try:
                body = json.loads(await http_request.body())
            except ValueError:
                return error(400, "body is not valid JSON")
            try:
                request = parse_request(body, self.tokenizer, context, self.limits, chat)
            except BadRequest as bad:
                return error(400, str(bad))
            self.requests.put(request)
            if request.stream:
                return StreamingResponse(self._sse(request), media_type="text/event-stream")
            return await _in_thread(self._answer, request)

        @app.post("/v1/completions")
        async def completions(http_request: HTTPRequest):
            return await answer(http_request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http_request: HTTPRequest):
            return await answer(http_request, chat=True)

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
        if request.chat:  # OpenAI's first chunk names the role
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}
            yield f"data: {json.dumps({**self._header(request), 'choices': [role]})}\n\n"
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
