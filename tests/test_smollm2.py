"""Real pretrained weights: SmolLM2-135M-Instruct (Llama: 30 layers, 9 heads, 3 KV groups,
tied embeddings, rope base 1e5) read from its GGUF by megalite.hf, against transformers'
own GGUF load: logits within 1e-4 relative and the same greedy next token for three prompts
at TP 1, TP 3 (one KV group per rank) and TP 3 x PP 2 on 6 ranks (forward through the
pipeline schedule).
"""
import pytest
import torch

from megalite.device import current_device
from megalite.hf import smollm2_gguf_path
from megalite.models import GPTModel
from megalite.models.sharding import load_full_state_dict
from megalite.models.stage import build_model_chunks
from megalite.mpu import destroy_model_parallel, initialize_model_parallel
from megalite.mpu import parallel_state as ps
from megalite.mpu.mappings import gather_from_tensor_model_parallel_region
from megalite.mpu.random import weights_loaded_next
from megalite.schedules import get_forward_backward_func
from tests.helpers.multirank import run_on_ranks
from tests.helpers.smollm2 import hf_reference, read_megalite_state

TOL = 1e-4


def _logits(state_path: str, prompt_ids: list[torch.Tensor], tp: int, pp: int) -> list:
    """Full-vocabulary logits [1, s, V] per prompt on the last stage (None elsewhere; at TP 1
    x PP 1 on rank 0 only: one replica is enough)."""
    initialize_model_parallel(tp, pp)
    if tp * pp == 1 and torch.distributed.get_rank() != 0:
        return None
    config, state = read_megalite_state(state_path)
    with weights_loaded_next():  # every weight is loaded: none drawn first
        chunks = build_model_chunks(lambda pre_process, post_process: GPTModel(
            config, pre_process, post_process, device=current_device()).eval())
    load_full_state_dict(chunks, state)
    out = []

    def forward_step(data_iterator, model):
        ids = next(data_iterator)

        def keep_logits(vocab_parallel):
            out.append(gather_from_tensor_model_parallel_region(vocab_parallel))
            return vocab_parallel.sum() * 0, {}
        return model(ids), keep_logits
    with torch.no_grad():
        for ids in prompt_ids:
            get_forward_backward_func()(forward_step_func=forward_step,
                                        data_iterator=iter([ids.to(current_device())]),
                                        model=chunks[0], num_microbatches=1,
                                        seq_length=ids.shape[1], micro_batch_size=1,
                                        forward_only=True)
    last = ps.is_pipeline_last_stage()
    destroy_model_parallel()
    return out if last else None


def _tp1_and_tp3(state_path: str, prompt_ids: list[torch.Tensor]) -> dict:
    return {"tp1": _logits(state_path, prompt_ids, 1, 1),
            "tp3": _logits(state_path, prompt_ids, 3, 1)}


@pytest.fixture(scope="module")
def reference_and_state(smollm2_state):
    return hf_reference(smollm2_gguf_path()), smollm2_state


def _check(logits: list[torch.Tensor], reference: dict) -> list[float]:
    errors = []
    for ours, ref in zip(logits, reference["logits"]):
        ours = ours[..., :ref.shape[-1]]
        errors.append(((ours - ref).abs().max() / ref.abs().max()).item())
        assert ours[0, -1].argmax() == ref[0, -1].argmax()
    assert len(errors) == len(reference["logits"])
    return errors


def test_smollm2_logits_match_transformers_at_tp_1_and_3(reference_and_state):
    reference, state_path = reference_and_state
    results = run_on_ranks(3, _tp1_and_tp3, state_path, reference["ids"], timeout=600)
    assert results[0]["tp1"] is not None
    for per_rank in results:
        for layout, logits in per_rank.items():
            if logits is not None:
                errors = _check(logits, reference)
                assert max(errors) < TOL, (layout, errors)
    print("SmolLM2 logits rel. error per prompt (rank 0):",
          {k: _check(v, reference) for k, v in results[0].items()})


def test_smollm2_logits_match_transformers_at_tp3_pp2(reference_and_state):
    reference, state_path = reference_and_state
    results = run_on_ranks(6, _logits, state_path, reference["ids"], 3, 2, timeout=600)
    last_stage = [r for r in results if r is not None]
    assert len(last_stage) == 3
    for logits in last_stage:
        errors = _check(logits, reference)
        assert max(errors) < TOL, errors
    print("SmolLM2 TP3xPP2 logits rel. error per prompt:", errors)
