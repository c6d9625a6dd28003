"""Parameters per pipeline rank of a GPT layout, counted from the config (the planner's model
state): per layer, per stage (embedding, output layer, MTP), experts apart, and the units
FSDP wraps.
"""
from megalite.config import ModelConfig
from megalite.models.spec import TransformerSpec
from megalite.models.stage import pipeline_layer_range


def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (megalite.models.spec)."""
    return TransformerSpec.from_config(model).layer_params(tp)



def _stage_layers(model: ModelConfig, pp: int, rank: int, vpp: int) -> list[int]:
    """Global indices of the layers on pipeline rank `rank` (all its chunks), the last rank's
    multi-token prediction layers (numbered after the main stack) included."""
    mtp = TransformerSpec.from_config(model).mtp_layers(model.num_layers)
    return [layer for chunk in range(vpp)
            for layer in range(*pipeline_layer_range(model.num_layers, pp, rank, vpp, chunk))
            ] + (list(mtp) if rank == pp - 1 else [])



def stage_expert_params(model: ModelConfig, tp: int, pp: int, rank: int, vpp: int = 1,
                        ep: int = 1) -> int:
    """MoE expert parameters on pipeline rank `rank`: E / ep experts of each of its MoE layers."""
    spec = TransformerSpec.from_config(model)
    return sum(spec.expert_params(tp, layer, ep) for layer in _stage_layers(model, pp, rank, vpp))



def _end_params(model: ModelConfig, padded_vocab: int, tp: int, pp: int, rank: int
                ) -> dict[str, int]:
    """Parameters outside the layers on pipeline rank `rank`: the word (and learned position)
    embeddings on the first rank; the final norm, the output layer, the multi-token
    prediction blocks' norms and projections on the last, with a copy of the word embedding
    when p > 1 and the head is tied or multi-token prediction embeds there."""
    spec, h = TransformerSpec.from_config(model), model.hidden_size
    word, out = padded_vocab * h // tp, {}
    if rank == 0:
        out["embedding"] = word + (model.max_position_embeddings * h
                                   if spec.position_embedding == "learned_absolute" else 0)
    if rank == pp - 1:
        out["norm"] = spec.norm_params(h)
        out["output"] = 0 if spec.tie_output else word
        out["embedding copy"] = word if pp > 1 and (spec.tie_output or spec.mtp_num_layers) \
            else 0
        out["mtp"] = spec.mtp_extra_params()
    return out



def _layer_params(model: ModelConfig, tp: int, pp: int, rank: int, vpp: int, ep: int
                  ) -> list[int]:
    """Parameters of each layer on pipeline rank `rank` (an MoE layer's E / ep experts)."""
    spec = TransformerSpec.from_config(model)
    return [spec.layer_params(tp, layer, ep) for layer in _stage_layers(model, pp, rank, vpp)]



def stage_params(model: ModelConfig, padded_vocab: int, tp: int, pp: int, rank: int,
                 vpp: int = 1, ep: int = 1) -> int:
    """Parameters on pipeline rank `rank` (all its chunks): its L/p layers and the
    embedding, final norm and output layer of `_end_params`."""
    return sum(_layer_params(model, tp, pp, rank, vpp, ep)) + sum(
        _end_params(model, padded_vocab, tp, pp, rank).values())



def fsdp_units(model: ModelConfig, padded_vocab: int, tp: int, pp: int, rank: int,
               vpp: int = 1, ep: int = 1) -> tuple[int, list[int]]:
    """(root, units): parameters of the FSDP units on pipeline rank `rank`, as
    megalite.distributed.fsdp wraps them - each layer (an MoE layer's experts a unit of their
    own, the multi-token prediction layers too) and the embedding - and of the root, what is
    left: the final norm, the output layer (read through `lm_logits`, not its forward), a
    word-embedding copy, the multi-token prediction norms and projections, and the embedding
    too when one chunk holds it and its tied head or multi-token prediction."""
    spec = TransformerSpec.from_config(model)
    units = []
    for layer in _stage_layers(model, pp, rank, vpp):
        experts = spec.expert_params(tp, layer, ep)
        units += [spec.layer_params(tp, layer, ep) - experts] + ([experts] if experts else [])
    ends = _end_params(model, padded_vocab, tp, pp, rank)
    root = sum(ends.pop(key, 0) for key in ("norm", "output", "embedding copy", "mtp"))
    if pp == 1 and (spec.tie_output or spec.mtp_num_layers):
        root += ends.pop("embedding")
    return root, units + list(ends.values())
