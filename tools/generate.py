"""Generate text from a megalite checkpoint or a transformers directory, at any TP x PP.

  python tools/generate.py --load checkpoints/gpt_default --prompt "The module"
  torchrun --nproc_per_node 2 tools/generate.py --tp 2 --hf DIR --prompt "Hello" --prompt "A"
  python tools/generate.py --load checkpoints/gpt_default        # prompts from stdin
  python tools/generate.py --gguf smollm2 --chat --prompt "What is the capital of France?"
  python tools/generate.py --gguf smollm2 --chat --system "Be brief."   # a conversation on stdin

One prompt streams its tokens as they come; several run as one batch and print at the end.
With --chat each prompt is a user message, rendered with the tokenizer's chat template, and
the answer ends at the template's end-of-turn token; lines from stdin are one conversation.
Rank 0 prints; the prompt and generation speed (tokens/s) follow each batch.
"""
import argparse
import sys

import torch.distributed as dist

from megalite.data.chat_template import chat_template, end_of_turn_ids, render_chat
from megalite.inference import GenerationStats, SamplingParams
from megalite.inference.loading import add_model_arguments, load_from_args, run_tool
from megalite.inference.text import Completion, complete


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[],
                        help="prompt text (repeatable: one batch); none: read lines from stdin")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: no nucleus cut")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--chat", action="store_true",
                        help="prompts are user messages, rendered with the tokenizer's chat "
                        "template; stdin lines are one conversation")
    parser.add_argument("--system", help="with --chat: a system message opening each "
                        "conversation")
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    return args


def _print(text: str = "", end: str = "\n") -> None:
    if dist.get_rank() == 0:
        print(text, end=end, flush=True)


def run_batch(model, tokenizer, prompts: list[str], params: SamplingParams, stop: list[str],
              conversations: list[list[dict]] | None = None) -> list[Completion]:
    """Generate for `prompts` (with `conversations`: each prompt's chat, which is what the
    model reads, rendered with the chat template; then only the answers are printed)."""
    stats = GenerationStats()
    stream = len(prompts) == 1
    if stream and not conversations:
        _print(prompts[0], end="")
    texts = [render_chat(tokenizer, c) for c in conversations] if conversations else prompts
    end_ids = end_of_turn_ids(tokenizer) if conversations else None
    completions = []
    for completions in complete(model, tokenizer, texts, params, stop, stats, end_ids):
        if stream:
            _print(completions[0].take_delta(), end="")
    if stream:
        _print(completions[0].take_delta(final=True) if completions else "")
    else:
        between = "\n" if conversations else ""
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            _print(f"[{i}] {prompt}{between}{completion.text}")
    _print(f"-- prompt: {stats.prompt_tokens} tokens in {stats.prefill_s:.3f} s "
           f"({stats.prompt_tokens / max(stats.prefill_s, 1e-9):.1f} tokens/s); generation: "
           f"{stats.new_tokens} tokens in {stats.decode_s:.3f} s "
           f"({max(stats.new_tokens - len(prompts), 0) / max(stats.decode_s, 1e-9):.1f} "
           f"tokens/s); KV cache {stats.kv_cache_bytes_per_token:,} bytes per token")
    return completions


def _next_prompt() -> str | None:
    """Rank 0 reads a line from stdin and shares it; None at end of input."""
    box = [None]
    if dist.get_rank() == 0:
        print("prompt> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        box[0] = line.rstrip("\n") if line else None
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(argv=None) -> None:
    args = parse_args(argv)
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                            args.seed)
    params.validate()
    model, tokenizer = load_from_args(args)
    if args.chat:  # one error line now when the tokenizer has no template
        try:
            chat_template(tokenizer)
        except ValueError as error:
            raise ValueError(f"--chat: {error}") from None
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    if args.prompt:
        chats = [system + [{"role": "user", "content": p}] for p in args.prompt]
        run_batch(model, tokenizer, args.prompt, params, args.stop, chats if args.chat else None)
        return
    conversation = list(system)
    while (prompt := _next_prompt()) is not None:
        if not prompt.strip():
            continue
        if not args.chat:
            run_batch(model, tokenizer, [prompt], params, args.stop)
            continue
        conversation.append({"role": "user", "content": prompt})
        completions = run_batch(model, tokenizer, [prompt], params, args.stop, [conversation])
        conversation.append({"role": "assistant",
                             "content": completions[0].text if completions else ""})


if __name__ == "__main__":
    run_tool(main)
