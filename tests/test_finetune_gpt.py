"""finetune_gpt.py end to end on a tiny random Llama (transformers directory) with a small
word-level chat tokenizer (tests.test_chat_template), on 4 ranks.

The held-out loss before training is the mean over every held-out assistant token, whatever
the packing and layout: packed and padded at DP4, packed at TP2 x PP2 and CP2 x DP2 all equal
transformers' (each held-out conversation through LlamaForCausalLM with labels -100 outside
the assistant tokens, token-weighted) within 1e-5; training lowers it, and the --export-dir
directory, loaded by transformers, gives the run's final held-out loss.
"""
import json
import random

import torch

from megalite.data.chat_data import encode_conversation
from megalite.data.tokenizers import HFTokenizer
from tests.helpers.multirank import run_on_ranks
from tests.test_chat_template import TEMPLATE, WORDS, _tokenizer_dir

LAYOUTS = {"dp4 packed": [], "dp4 padded": ["--no-packing"],
           "tp2 pp2 packed": ["--tp", "2", "--pp", "2"], "cp2 dp2 packed": ["--cp", "2"]}


def _conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = [w for w in WORDS if not w.endswith(":")]
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    return [{"messages": [{"role": "user", "content": say(rng.randint(1, 3))},
                          {"role": "assistant", "content": say(rng.randint(1, 4))}]}
            for _ in range(n)]


def _write(tmp_path) -> tuple[str, str, str]:
    """(model dir, train.jsonl, valid.jsonl)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model_dir = _tokenizer_dir(tmp_path / "model", TEMPLATE)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(WORDS) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)).save_pretrained(model_dir)
    paths = []
    for name, n, seed in (("train", 16, 1), ("valid", 8, 2)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(c) for c in _conversations(n, seed)) + "\n")
        paths.append(str(path))
    return model_dir, *paths


def _reference(model_dir: str, valid: str) -> float:
    """Token-weighted held-out loss of the transformers model in `model_dir`."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = HFTokenizer(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for line in open(valid):
            ids, flags = (torch.from_numpy(a) for a in encode_conversation(
                tokenizer, json.loads(line)["messages"]))
            n = int(flags[1:].sum())
            total += hf(input_ids=ids[None], labels=torch.where(flags, ids, -100)[None]).loss * n
            count += n
    return float(total / count)


def _finetune(argv: list[str]) -> list[float]:
    from megalite.tasks import sft as finetune_gpt
    from megalite.training import train
    task = finetune_gpt.ChatFinetuning()
    train(finetune_gpt.parse(argv), task)
    return task.valid_losses


def test_held_out_loss_is_independent_of_packing_and_layout_and_the_export_keeps_it(tmp_path):
    model_dir, train_data, valid_data = _write(tmp_path)
    want = _reference(model_dir, valid_data)
    common = ["--pretrained", model_dir, "--train-data", train_data, "--valid-data", valid_data,
              "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
              "--lr", "1e-2", "--log-interval", "100", "--epochs", "1"]
    runs = {}
    for name, extra in LAYOUTS.items():
        export = ["--export-dir", str(tmp_path / "export")] if name == "dp4 packed" else []
        runs[name] = run_on_ranks(4, _finetune, [*common, *extra, *export,
                                                 "--save", str(tmp_path / name)])[0]
    for name, losses in runs.items():
        assert abs(losses[0] - want) / want < 1e-5, (name, losses[0], want)
        assert losses[-1] < losses[0], (name, losses)
    exported = _reference(str(tmp_path / "export"), valid_data)
    assert abs(exported - runs["dp4 packed"][-1]) / exported < 1e-5, (exported, runs)
