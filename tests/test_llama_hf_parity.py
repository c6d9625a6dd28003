"""Llama-spec GPTModel at TP in {1, 2, 4} vs transformers LlamaForCausalLM (and Qwen3ForCausalLM:
per-head q/k norms), same random weights.

fp32 (megalite on the rank's device, transformers on the CPU, once in the test process): MHA
(fused QKV), GQA with 2 groups (split at TP 2, replicated at TP 4), MQA (one group replicated
on every rank), a head dim other than hidden/heads, Llama-3 RoPE scaling, Qwen3's q/k norms
(GQA, head dim 12, their weights replicated over TP and their grads summed over it), tied and
untied heads, odd vocabulary (203) and odd sequence length (13): logits within 1e-5, loss
within 1e-5 relative, every gradient (gathered over TP) within 1e-4 relative, then three AdamW
steps on both and the losses still within 1e-5 relative. Also: one-line errors for configs
megalite cannot express, before any collective.
"""
import pytest
import torch

from megalite.device import current_device
from megalite.hf import FAMILIES, llama_config, load_hf
from megalite.models import GPTModel
from megalite.mpu import comm, initialize_model_parallel, model_parallel_seed
from megalite.mpu import parallel_state as ps
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import hf_results, parity_errors, random_hf_model

VOCAB, SEQ = 203, 13
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CASES = {  # name -> LlamaConfig overrides
    "mha tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "gqa 2 groups untied": dict(num_key_value_heads=2),
    "mqa tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "gqa head_dim 24 llama3 rope": dict(num_key_value_heads=2, head_dim=24,
                                        rope_parameters=LLAMA3_ROPE),
    "qwen3 gqa head_dim 12": dict(family="qwen3", num_key_value_heads=2, head_dim=12),
}


def tiny_llama(seed: int = 0, family: str = "llama", **overrides):
    """A random transformers LlamaForCausalLM (or Qwen3ForCausalLM: `family` "qwen3"; no
    download); norm weights away from 1."""
    import transformers
    cls = FAMILIES[family].transformers_class()
    config_cls = getattr(transformers, cls.__name__.replace("ForCausalLM", "Config"))
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=32, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return random_hf_model(cls, config_cls(**{**kw, **overrides}), seed)


def _tokens() -> torch.Tensor:
    """The batch [3, SEQ + 1], on the CPU (transformers' input; the ranks move it)."""
    return torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(1),
                         device="cpu")


def _reference(case: str) -> tuple:
    """transformers' side of `case`, computed once in the test process (the ranks never build
    the model): its config, initial weights and `hf_results`."""
    hf = tiny_llama(**CASES[case])
    weights = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    return hf.config, weights, hf_results(hf, _tokens())


def _compare(tp: int, case: str, reference: tuple) -> dict:
    initialize_model_parallel(tp, 1)
    model_parallel_seed(0, ps.get_tensor_model_parallel_rank())
    hf_config, weights, want = reference
    family = FAMILIES[CASES[case].get("family", "llama")]
    config = family.config_from_hf(hf_config)
    model = GPTModel(config, device=current_device())
    load_hf(model, weights)
    return parity_errors(model, want, lambda state: family.state_to_hf(state, config),
                         _tokens().to(current_device()), VOCAB)


def _bad_configs() -> dict[str, tuple[str, dict]]:
    """The ValueError line of each unsupported config, and the bytes moved before it."""
    from transformers import LlamaConfig, MistralConfig
    initialize_model_parallel(4, 1)
    out = {}
    builders = {
        "sliding window": lambda: llama_config(MistralConfig(sliding_window=4096)),
        "gelu": lambda: llama_config(LlamaConfig(hidden_act="gelu")),
        "yarn rope": lambda: llama_config(LlamaConfig(rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})),
        "groups vs tp": lambda: GPTModel(llama_config(tiny_llama(
            num_attention_heads=12, num_key_value_heads=3, hidden_size=96).config),
            device=current_device()),
        "heads vs tp": lambda: GPTModel(llama_config(tiny_llama(
            num_attention_heads=6, num_key_value_heads=2, hidden_size=96).config),
            device=current_device()),
    }
    for name, build in builders.items():
        with comm.count_bytes() as moved:
            try:
                build()
                out[name] = ("no error", {})
            except ValueError as error:
                out[name] = (str(error), dict(moved))
    return out


def _at_tp(tps: tuple[int, ...], references: dict) -> dict:
    return {(tp, case): _compare(tp, case, references[case]) for tp in tps for case in CASES}


@pytest.fixture(scope="module")
def references() -> dict:
    return {case: _reference(case) for case in CASES}


@pytest.mark.parametrize("world,tps", [(1, (1,)), (4, (2, 4))], ids=["tp1", "tp2-4"])
def test_llama_matches_hf(world, tps, references):
    """TP 1 on one rank (so on a machine with one GPU it runs there), TP 2 and 4 on four."""
    results = run_on_ranks(world, _at_tp, tps, references)
    for per_rank in results:
        for key, e in per_rank.items():
            assert e["logits"] < 1e-5 and e["loss"] < 1e-5, (key, e)
            assert e["grad"] < 1e-4 and not e["missing grads"], (key, e)
            assert max(e["steps"]) < 1e-5, (key, e)
    print({k: {m: e[m] for m in ("logits", "loss", "grad")} for k, e in results[0].items()})


def test_unsupported_configs_fail_with_one_line_before_any_collective():
    expected = {"sliding window": "sliding_window=4096", "gelu": "hidden_act='gelu'",
                "yarn rope": "rope_type='yarn'",
                "groups vs tp": "--num-query-groups (3) must be a multiple or a divisor",
                "heads vs tp": "--num-attention-heads (6) must be divisible by the "
                               "tensor-parallel size (4)"}
    for per_rank in run_on_ranks(4, _bad_configs):
        for name, (message, moved) in per_rank.items():
            assert expected[name] in message and "\n" not in message, (name, message)
            assert not any(moved.values()), (name, moved)
