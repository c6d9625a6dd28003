"""A tiny DeepSeek-V3 (multi-head latent attention with query compression, YaRN RoPE with
mscale, transformers' interleaved RoPE layout, untied head) against transformers
DeepseekV3ForCausalLM with the same weights, fp32, plus multi-token prediction against an
explicit reference written here: per depth k, plain-torch RMSNorms, the [emb; h] projection
and cross entropy over the tokens i + k + 1 inside the sequence, the block being
transformers' own DeepseekV3DecoderLayer loaded with the MTP block's weights.

One step through the real training path (tests.helpers.parallel_step: DDP, pipeline schedule,
pretrain_gpt.forward_step) at one rank, TP2 with sequence parallelism, PP2, TP2 x PP2 and CP2
(CP without MTP: refused, see test_mtp_with_context_parallelism_is_refused): the main loss,
the MTP loss and every gradient within 1e-5 relative of the references. Generation with the
compressed cache (latent + RoPE key) equals greedy decoding by full forwards.
"""
import dataclasses
import tempfile

import pytest
import torch

from megalite.config import parse_configs
from megalite.device import current_device
from megalite.hf.deepseek_v3 import convert_layers, deepseek_v3_config, deepseek_v3_to_megalite
from megalite.layout import RunLayout
from megalite.models import GPTModel
from megalite.models.sharding import full_names, load_full_state_dict, persistent_buffers
from megalite.mpu import initialize_model_parallel
from tests.helpers.gpt_run import make_dataset, tiny_args, train
from tests.helpers.multirank import run_on_ranks
from tests.helpers.parallel_step import VOCAB, global_batch, parallel_step
from tests.helpers.reference import rel_err, random_hf_model

TOL = 1e-5
MTP_FACTOR = 0.3
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8}
LAYOUTS = {"ep2 x tp2 sp": (2, 1, 1, True, 2), "pp2 ep2": (1, 2, 1, False, 2),
           "tp2 pp2": (2, 2, 1, False, 1), "cp2 ep2": (1, 1, 2, False, 2)}
# (tp, pp, cp, sp, ep) on 4 ranks
LAST, HF_LAST = "encoder.layers.3.", "model.layers.3."  # the last layer (MoE): MTP blocks' kind


def tiny_deepseek_v3(seed: int = 0, **overrides):
    """A random transformers DeepseekV3ForCausalLM (no download): 2 dense then 2 MoE layers
    of 8 routed experts (top-2 inside the best of 2 groups, scaled by 2.5) and one shared
    expert, with a selection bias that changes some choices."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=2,
              n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16,
              num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
              max_position_embeddings=32, rope_parameters=YARN, tie_word_embeddings=False)
    model = random_hf_model(DeepseekV3ForCausalLM, DeepseekV3Config(**{**kw, **overrides}),
                            seed)
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(torch.linspace(-0.1, 0.1, bias.numel(), device="cpu").flip(0))
    return model


def mtp_weights(config) -> dict[str, torch.Tensor]:
    """Random full weights of the megalite model's `mtp.` parameters (norms near 1)."""
    generator = torch.Generator().manual_seed(5)
    model, out = GPTModel(config, device="meta"), {}
    for name, param in [*model.named_parameters(), *persistent_buffers(model)]:
        for key in full_names(name, param):
            if key.startswith("mtp."):
                noise = torch.randn(param.shape[1:] if key != name else param.shape,
                                    generator=generator, device="cpu")
                out[key] = 1 + 0.1 * noise if key.endswith("norm.weight") else 0.05 * noise
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _mtp_blocks(hf, config, weights: dict) -> list:
    """Per depth: transformers' decoder layer of the last layer's kind (MoE) holding the MTP
    block's weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    blocks = []
    for depth in range(config.mtp_num_layers or 0):
        ours = {LAST + n.removeprefix(f"mtp.layers.{depth}.layer."): w
                for n, w in weights.items() if n.startswith(f"mtp.layers.{depth}.layer.")}
        block = DeepseekV3DecoderLayer(hf.config, config.num_layers - 1)
        block.load_state_dict({n.removeprefix(HF_LAST): w for n, w in convert_layers(
            ours, config, to_hf=True, interleave=hf.config.rope_interleave).items()})
        blocks.append(block)
    return blocks


def reference(hf, config, weights: dict, tokens: torch.Tensor) -> dict:
    """Main and MTP losses of tokens [b, s + 1] and the grads of main + factor x MTP:
    transformers' names mapped to megalite's, and the MTP weights' own."""
    inputs, labels = tokens[:, :-1].cpu(), tokens[:, 1:].cpu()
    b, s = inputs.shape
    leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
    blocks = _mtp_blocks(hf, config, weights)
    captured = {}
    hook = hf.model.norm.register_forward_hook(lambda m, args, out: captured.update(h=args[0]))
    logits = hf(input_ids=inputs).logits
    hook.remove()
    ce = torch.nn.functional.cross_entropy
    main = ce(logits.reshape(b * s, -1), labels.reshape(-1))
    hidden, eps = captured["h"], hf.config.rms_norm_eps
    causal = torch.full((s, s), float("-inf"), device="cpu").triu(1)[None, None]
    positions = torch.arange(s, device="cpu")[None]
    losses = []
    for depth, block in enumerate(blocks, start=1):
        p = f"mtp.layers.{depth - 1}."
        embedded = hf.model.embed_tokens(inputs.roll(-depth, dims=1))
        combined = torch.cat([_rms(embedded, leaves[p + "enorm.weight"], eps),
                              _rms(hidden, leaves[p + "hnorm.weight"], eps)], dim=-1)
        x = combined @ leaves[p + "eh_proj"].t()
        hidden = block(x, attention_mask=causal,
                       position_embeddings=hf.model.rotary_emb(x, positions))
        depth_logits = hf.lm_head(_rms(hidden, leaves[p + "final_layernorm.weight"], eps))
        losses.append(ce(depth_logits[:, :s - depth].reshape(-1, VOCAB),
                         labels.roll(-depth, dims=1)[:, :s - depth].reshape(-1)))
    mtp = torch.stack(losses).mean() if losses else torch.zeros((), device="cpu")
    (main + MTP_FACTOR * mtp).backward()
    grads = deepseek_v3_to_megalite({n: p.grad for n, p in hf.named_parameters()}
                                    | dict(hf.named_buffers()), config,
                                    hf.config.rope_interleave)
    grads.update({n: w.grad for n, w in leaves.items()})
    for depth, block in enumerate(blocks):
        block_grads = convert_layers({HF_LAST + n: p.grad for n, p in block.named_parameters()}
                                     | {HF_LAST + n: b for n, b in block.named_buffers()},
                                     config, to_hf=False, interleave=hf.config.rope_interleave)
        grads.update({f"mtp.layers.{depth}.layer." + n.removeprefix(LAST): g
                      for n, g in block_grads.items() if not n.endswith("expert_bias")})
    hf.zero_grad()
    return {"loss": main.item(), "mtp loss": mtp.item(), "grads": grads}


def _layout_errors(layouts: dict) -> dict:
    initialize_model_parallel(1, 1)  # mtp_weights builds a (meta) model of full shapes
    hf = tiny_deepseek_v3()
    with_mtp = dataclasses.replace(deepseek_v3_config(hf.config), mtp_num_layers=2,
                                   mtp_loss_scaling_factor=MTP_FACTOR)
    all_mtp = mtp_weights(with_mtp)
    out = {}
    for name, (tp, pp, cp, sp, ep) in layouts.items():
        config = dataclasses.replace(with_mtp, mtp_num_layers=None) if cp > 1 else with_mtp
        mtp = all_mtp if config.mtp_num_layers else {}
        full = deepseek_v3_to_megalite(hf.state_dict(), config) | mtp
        got = parallel_step(config, tp, pp, cp, sp, ep=ep,
                            load=lambda chunks: load_full_state_dict(chunks, full))
        dp = torch.distributed.get_world_size() // (tp * pp * cp)
        want = reference(hf, config, mtp, global_batch(dp))
        errors = {"loss": abs(got["loss"] - want["loss"]) / want["loss"],
                  "grad": max(rel_err(g, want["grads"][n]) for n, g in got["grads"].items()),
                  "unchecked": sorted(set(got["grads"]) - set(want["grads"])),
                  "partial grads agree": got["tp partial grads agree"]}
        if config.mtp_num_layers:
            errors["mtp loss"] = abs(got["mtp loss"] - want["mtp loss"]) / want["mtp loss"]
        out[name] = errors
    return out


def _generation() -> dict:
    """Greedy tokens from the compressed cache vs full forwards vs transformers' generate, and
    the cache's bytes; the model read from a saved directory as `tools/generate.py --hf`
    reads it."""
    from megalite.inference import GenerationStats, SamplingParams, generate
    from megalite.inference.generation import BatchDecoder
    from megalite.inference.loading import build_inference_model, read_hf
    initialize_model_parallel(1, 1)
    hf = tiny_deepseek_v3()
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        config, full = read_hf(directory)
    model = build_inference_model(config, full)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3),
                           device="cpu")
    transformers_tokens = hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=8, do_sample=False)[:, 5:]
    decoder, cached = BatchDecoder(model, prompt.tolist(), 8), []
    logits = decoder.prefill()
    for _ in range(8):
        cached.append(logits.argmax(-1))
        logits = decoder.decode(cached[-1])
    full = prompt.to(current_device())
    with torch.no_grad():
        for _ in range(8):
            full = torch.cat([full, model(full)[:, -1].argmax(-1, keepdim=True)], dim=1)
    stats = GenerationStats()
    generate(model, prompt.tolist(), SamplingParams(2), stats=stats)
    return {"cached": torch.stack(cached, 1).cpu(), "full": full[:, 5:].cpu(),
            "transformers": transformers_tokens, "bytes per token": stats.kv_cache_bytes_per_token}


def test_deepseek_v3_one_rank_matches_transformers_and_generates_from_the_latent_cache():
    errors, generated = run_on_ranks(1, _one_rank)[0]
    e = errors["one rank"]
    assert e["loss"] < TOL and e["mtp loss"] < TOL and e["grad"] < TOL, e
    assert not e["unchecked"], e
    assert torch.equal(generated["cached"], generated["full"]), generated
    assert torch.equal(generated["cached"], generated["transformers"]), generated
    # latent (12) + RoPE key (4) fp32 values per token per layer, 4 layers
    assert generated["bytes per token"] == 4 * (12 + 4) * 4, generated
    print(errors, generated["bytes per token"])


def _one_rank() -> tuple[dict, dict]:
    return _layout_errors({"one rank": (1, 1, 1, False, 1)}), _generation()


def test_deepseek_v3_parallel_layouts_match_references():
    results = run_on_ranks(4, _layout_errors, LAYOUTS)
    for rank, per_rank in enumerate(results):
        for name, e in per_rank.items():
            assert e["loss"] < TOL and e["grad"] < TOL, (rank, name, e)
            assert e.get("mtp loss", 0.0) < TOL and not e["unchecked"], (rank, name, e)
            assert e["partial grads agree"], (rank, name, e)
    print({name: {k: max(r[name][k] for r in results) for k in ("loss", "grad")}
           for name in LAYOUTS})


MLA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--multi-latent-attention"]


@pytest.mark.parametrize("argv,message", [
    ([*MLA, "--qk-pos-emb-head-dim", "5"], "an even --qk-pos-emb-head-dim (got 5)"),
    (["--multi-latent-attention"], "--multi-latent-attention needs --position-embedding-type "
                                   "rope"),
    ([*MLA, "--group-query-attention", "--num-query-groups", "2"],
     "--multi-latent-attention excludes --group-query-attention"),
    ([*MLA, "--kv-lora-rank", "0"], "--kv-lora-rank must be positive"),
    ([*MLA, "--rotary-scaling-factor", "4", "--use-rope-scaling"],
     "--rotary-scaling-factor (YaRN) excludes --use-rope-scaling"),
    (["--mtp-num-layers", "-1"], "--mtp-num-layers (-1) must be >= 0"),
])
def test_bad_mla_and_mtp_flags_fail_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_configs(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_bias=True), "unsupported DeepSeek-V3 config: attention_bias=True"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05 (the latent norms use 1e-06)"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type='linear' (supported: default, yarn)")])
def test_unsupported_transformers_configs_fail_with_one_line(overrides, message):
    from transformers import DeepseekV3Config
    with pytest.raises(ValueError) as error:
        deepseek_v3_config(DeepseekV3Config(**overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_mtp_with_context_parallelism_is_refused():
    configs = parse_configs(["--max-position-embeddings", "32", "--seq-length", "16",
                             "--cp", "2", "--mtp-num-layers", "1", "--attention-dropout", "0"])
    with pytest.raises(ValueError, match="--mtp-num-layers needs --context-parallel-size 1"):
        RunLayout.from_configs(configs, 2)


DEEPSEEK_FLAGS = [
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
    "--swiglu", "--ffn-hidden-size", "48", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--q-lora-rank", "16",
    "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
    "--v-head-dim", "6", "--rotary-scaling-factor", "4", "--rope-original-max-position-embeddings",
    "8", "--mscale-all-dim", "0.8", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "16",
    "--moe-layer-freq", "[0]*2+[1]*2", "--moe-router-score-function", "sigmoid",
    "--moe-router-topk-renorm", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "2",
    "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3",
    "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_pretrain_gpt_deepseek_v3_tp2_pp2_dp2_ep2_has_the_single_process_loss_curve(tmp_path):
    """pretrain_gpt.py with the DeepSeek-V3 flags (MLA, YaRN, 2 dense + 2 MoE layers with
    the selection bias updated each step, group-limited routing, MTP): the loss curve at
    TP2 x PP2 x DP2 x EP2 with SP (8 ranks) equals one process's (fp32; summation order
    differs, so 1e-5 relative)."""
    prefix = make_dataset(str(tmp_path))
    single = run_on_ranks(1, train, tiny_args(prefix, f"{tmp_path}/single", 3,
                                              *DEEPSEEK_FLAGS))[0]
    layout = ["--tp", "2", "--sequence-parallel", "--pp", "2", "--dp", "2", "--ep", "2"]
    parallel = run_on_ranks(8, train, tiny_args(prefix, f"{tmp_path}/parallel", 3,
                                                *DEEPSEEK_FLAGS, *layout))[0]
    assert sorted(single) == sorted(parallel) == [1, 2, 3]
    for it in single:
        assert abs(parallel[it] - single[it]) / single[it] < TOL, (single, parallel)
    print("DeepSeek-V3 loss curve single vs", " ".join(layout), single, parallel)
