"""Greedy generation vs transformers `generate(do_sample=False)` on a random GPT-2, and seeded
sampling through the whole pipeline.

A batch of four prompts of lengths 3..11 (left-padded in one batch by megalite) must give,
token for token, what transformers generates for each prompt alone, for 20 new tokens, at
TP 1, TP 2 and PP 2. The weights are drawn with std 0.3 so the greedy continuations vary.
Sampling with a seed gives the same tokens twice (at TP 2 the two ranks agree), another
seed other tokens, and top-k 1 at temperature 1.3 the greedy tokens; without a seed, the
ranks still agree (rank 0 draws the seed for all).
"""
import torch

from megalite.device import current_device
from megalite.hf import gpt2_config, load_hf
from megalite.inference import SamplingParams, generate
from megalite.models import GPTModel
from megalite.mpu import initialize_model_parallel
from megalite.mpu import parallel_state as ps
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import tiny_gpt2

VOCAB, NEW, LENGTHS = 211, 20, (3, 11, 6, 8)


def _hf_model():
    hf = tiny_gpt2(vocab=VOCAB, positions=48).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen, device="cpu") * 0.3)
    return hf


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _megalite_runs(tp: int, pp: int) -> dict:
    initialize_model_parallel(tp, pp)
    hf = _hf_model()
    model = GPTModel(gpt2_config(hf.config), pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), device=current_device()).eval()
    load_hf(model, hf.state_dict())
    prompts = _prompts()
    sampled = [generate(model, prompts, SamplingParams(NEW, temperature=1.0, seed=s))
               for s in (11, 11, 12)]
    return {"greedy": generate(model, prompts, SamplingParams(NEW)),
            "top_k_1": generate(model, prompts, SamplingParams(NEW, temperature=1.3, top_k=1,
                                                               seed=3)),
            "sampled": sampled,
            "unseeded": generate(model, prompts, SamplingParams(NEW, temperature=1.0))}


def _all_layouts() -> dict:
    return {layout: _megalite_runs(*layout) for layout in ((1, 1), (2, 1), (1, 2))}


def test_greedy_matches_hf_and_seeded_sampling_repeats():
    hf = _hf_model()
    want = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                        eos_token_id=None)[0, len(p):].tolist() for p in _prompts()]
    assert len({tuple(w) for w in want}) == len(want) and all(len(set(w)) > 3 for w in want)
    results = run_on_ranks(2, _all_layouts)
    for rank, per_layout in enumerate(results):
        for layout, got in per_layout.items():
            assert got["greedy"] == want, (rank, layout)
            assert got["top_k_1"] == want, (rank, layout)
            first, again, other = got["sampled"]
            assert first == again and first != other, (rank, layout)
            assert got["unseeded"] == results[0][layout]["unseeded"], (rank, layout)
    print("greedy continuations (HF == megalite):", want)
