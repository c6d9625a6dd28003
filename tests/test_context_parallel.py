"""Context parallelism end to end on 8 ranks: TP2 x CP2 x PP2, CP4 x DP2, and CP2 with
sequence parallelism at TP2 (x DP2), fp32, dropout off.

GPT-2 and Llama (RMSNorm, RoPE, SwiGLU, GQA with 2 KV groups, untied output): weights from
random transformers GPT2LMHeadModel / LlamaForCausalLM models (on the CPU); the mean loss
over all tokens of the global batch and every parameter's gradient (full over TP) against the
transformers model's within 1e-5 relative. pretrain_gpt.py trains the same
losses (3 AdamW steps) at TP2 x CP2 with --sequence-parallel, with and without the
distributed optimizer, as at TP2 x DP2. Bad sequence splits fail with
one line before any collective.
"""
import pytest

from megalite.config import parse_configs
from megalite.hf import (gpt2_config, gpt2_to_megalite, llama_config, llama_to_megalite,
                         load_hf)
from megalite.mpu import comm
from megalite.mpu.parallel_state import GridLayout
from megalite.layout import RunLayout, check_sequence_split
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.helpers.parallel_step import VOCAB, SEQ, global_batch, parallel_step
from tests.test_llama_hf_parity import tiny_llama
from tests.helpers.reference import hf_token_loss, rel_err, tiny_gpt2

TOL = 1e-5
LAYOUTS = {"tp2 cp2 pp2": (2, 2, 2, False), "cp4 dp2": (1, 1, 4, False),
           "tp2 cp2 dp2 sp": (2, 1, 2, True)}  # (tp, pp, cp, sp) on 8 ranks


def _hf_reference(hf, dp: int, to_megalite) -> dict:
    """The transformers model's mean loss over the global batch and its grads, renamed."""
    loss = hf_token_loss(hf, global_batch(dp, hf.config.vocab_size))
    loss.backward()
    grads = to_megalite({n: p.grad for n, p in hf.named_parameters()})
    hf.zero_grad()
    return {"loss": loss.item(), "grads": grads}


def _errors(got: dict, want: dict) -> dict:
    missing = set(got["grads"]) - set(want["grads"])
    return {"loss": abs(got["loss"] - want["loss"]) / abs(want["loss"]),
            "grad": max(rel_err(g, want["grads"][n]) for n, g in got["grads"].items()
                        if n in want["grads"]), "missing": sorted(missing)}


def _references() -> dict:
    """model name -> (megalite config, the transformers weights, {DP size: the transformers
    model's loss and grads on that global batch}): computed here once, the ranks never import
    transformers."""
    gpt2 = tiny_gpt2(vocab=VOCAB, positions=SEQ, layers=4, hidden=32)
    llama = tiny_llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=4, num_key_value_heads=2)
    gpt2_cfg, llama_cfg = gpt2_config(gpt2.config), llama_config(llama.config)
    models = {"gpt2": (gpt2, gpt2_cfg, lambda g: gpt2_to_megalite(g, gpt2_cfg)),
              "llama": (llama, llama_cfg, lambda g: llama_to_megalite(g, llama_cfg))}
    sizes = {8 // (tp * pp * cp) for tp, pp, cp, _ in LAYOUTS.values()}
    return {name: (config, hf.state_dict(), {dp: _hf_reference(hf, dp, to_megalite)
                                             for dp in sizes})
            for name, (hf, config, to_megalite) in models.items()}


def _all(references: dict) -> dict:
    out = {}
    for model_name, (config, weights, want) in references.items():
        for name, (tp, pp, cp, sp) in LAYOUTS.items():
            got = parallel_step(config, tp, pp, cp, sp,
                                load=lambda chunks: load_hf(chunks, weights, config))
            out[f"{model_name} vs transformers, {name}"] = _errors(got, want[8 // (tp * pp * cp)])
    return out


def _bad_splits() -> dict:
    out = {}
    for flags in [(16, 1, True, 1), (18, 4, True, 1), (18, 1, False, 2), (16, 1, False, 3)]:
        with comm.count_bytes() as moved:
            try:
                check_sequence_split(*flags)
                out[flags] = ("no error", {})
            except ValueError as error:
                out[flags] = (str(error), dict(moved))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(8, _all, _references())


def test_context_parallel_matches_references(results):
    for rank, per_rank in enumerate(results):
        for name, e in per_rank.items():
            assert not e["missing"], (rank, name, e)
            assert e["loss"] < TOL and e["grad"] < TOL, (rank, name, e)
    print({name: "loss {:.1e} grad {:.1e}".format(
        max(r[name]["loss"] for r in results), max(r[name]["grad"] for r in results))
        for name in results[0]})


def test_bad_sequence_splits_fail_with_one_line():
    errors = _bad_splits()
    expected = {(16, 1, True, 1): "--sequence-parallel needs --tensor-model-parallel-size > 1",
                (18, 4, True, 1): "must be divisible by --tensor-model-parallel-size (4)",
                (18, 1, False, 2): "--seq-length (18) must be divisible by 2 x "
                                   "--context-parallel-size (4)",
                (16, 1, False, 3): "--seq-length (16) must be divisible by 2 x "
                                   "--context-parallel-size (6)"}
    for flags, want in expected.items():
        message, moved = errors[flags]
        assert want in message and "\n" not in message and not moved, (flags, message)


@pytest.mark.parametrize("argv,world,message", [
    (["--sequence-parallel"], 2, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--tp", "4", "--sequence-parallel", "--seq-length", "18"], 4,
     "--seq-length (18) / --context-parallel-size (1) must be divisible by "
     "--tensor-model-parallel-size (4)"),
    (["--cp", "2", "--seq-length", "18"], 2, "--seq-length (18) must be divisible by 2 x "
                                            "--context-parallel-size (4)"),
    (["--cp", "3"], 4, "world size 4 is not divisible by tensor (1) x context (3)"),
    (["--cp", "2", "--attention-dropout", "0.1"], 2, "--context-parallel-size 2 needs "
                                                    "--attention-dropout 0 (got 0.1)"),
])
def test_bad_flags_fail_in_validation(argv, world, message):
    configs = parse_configs(["--max-position-embeddings", "32", "--seq-length", "16", *argv])
    with pytest.raises(ValueError) as error:
        RunLayout.from_configs(configs, world)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_pretrain_gpt_context_and_sequence_parallel_trains_like_data_parallel(tmp_path):
    prefix = make_dataset(str(tmp_path))
    common = ["--hidden-dropout", "0", "--attention-dropout", "0", "--tp", "2"]
    runs = {}
    layouts = {"tp2 dp2": [], "tp2 cp2 sp": ["--cp", "2", "--sequence-parallel"],
               "tp2 cp2 sp zero-1": ["--cp", "2", "--sequence-parallel",
                                     "--use-distributed-optimizer"]}
    for name, extra in layouts.items():
        argv = tiny_args(prefix, str(tmp_path / name), 3, *common, *extra)
        runs[name] = run_on_ranks(4, train, argv)[0]
    want = runs["tp2 dp2"]
    for name in ("tp2 cp2 sp", "tp2 cp2 sp zero-1"):
        got = runs[name]
        assert max(abs(got[i] - want[i]) / want[i] for i in want) < 1e-5, runs


def test_grid_layout_is_tp_cp_dp_pp():
    grid = GridLayout(tp=2, pp=2, dp=1, cp=2)
    assert grid.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.context_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.pipeline_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.model_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    grid = GridLayout(tp=1, pp=1, dp=2, cp=4)
    assert grid.context_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.data_context_groups() == [list(range(8))]
    assert [grid.coords(r)[1] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [grid.coords(r) for r in (0, 3, 4, 7)] == [(0, 0, 0, 0), (0, 3, 0, 0), (0, 0, 1, 0),
                                                      (0, 3, 1, 0)]


def test_any_sequence_length_without_context_parallelism():
    check_sequence_split(9, 1, False, 1)  # odd lengths split only when CP > 1
