"""Serve completions over HTTP (OpenAI-style) from a megalite checkpoint or a transformers
directory, at any TP x PP: rank 0 answers HTTP, every rank generates.

  python tools/serve.py --load checkpoints/gpt_default --port 8000
  torchrun --nproc_per_node 2 tools/serve.py --tp 2 --hf DIR --port 8000
  curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"prompt": "The module", "max_tokens": 32, "temperature": 0}'
  python tools/serve.py --gguf smollm2 --port 8000
  curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
       -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

POST /v1/completions: prompt (string or list), max_tokens, temperature, top_p, top_k, seed,
stop, stream (server-sent events). POST /v1/chat/completions: the same with messages
instead of prompt (rendered with the tokenizer's chat template). GET /v1/models, /health. A request whose prompt plus max_tokens
exceeds the model's context, or whose max_tokens exceeds --max-tokens, gets HTTP 400; one
that generates longer than --request-timeout seconds stops there (finish_reason "length",
and a "warning" saying so). Every request is logged; SIGTERM stops the server after the
queued requests.
"""
import argparse
import os

import torch.distributed as dist

from megalite.inference.loading import add_model_arguments, load_from_args, run_tool
from megalite.inference.serving import CompletionServer, Limits, listen, serve_http


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="largest max_tokens a request may ask for (default: the context)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds of generation per request before it is cut short "
                        "(default: no limit)")
    args = parser.parse_args(argv)
    for flag, value in (("--max-tokens", args.max_tokens),
                        ("--request-timeout", args.request_timeout)):
        if value is not None and not value > 0:
            parser.error(f"{flag} {value}: expected a positive number")
    # bind before the (slow) model load, so a taken port fails at once (rank 0 serves)
    sock = listen(args.host, args.port) if int(os.environ.get("RANK", 0)) == 0 else None
    model, tokenizer = load_from_args(args)
    server = CompletionServer(model, tokenizer, os.path.basename(
        os.path.normpath(args.load or args.hf or args.gguf)),
        Limits(args.max_tokens, args.request_timeout))
    server.stop_on_sigterm()
    if dist.get_rank() == 0:
        serve_http(server, sock)
        print(f"serving on http://{args.host}:{args.port} (POST /v1/completions, "
              f"/v1/chat/completions, GET /v1/models, /health)", flush=True)
    server.loop()
    if dist.get_rank() == 0:
        print("server stopped", flush=True)


if __name__ == "__main__":
    run_tool(main)
