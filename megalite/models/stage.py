"""Which part of the model a pipeline rank (and virtual chunk) builds, and the tied embedding's
marking (its grads are reduced by megalite.distributed.finalize)."""
from collections.abc import Callable

from torch import nn

from megalite.models.sharding import unwrap
from megalite.mpu import parallel_state
from megalite.placement import Placement


def pipeline_layer_range(num_layers: int, pp_size: int | None = None, pp_rank: int | None = None,
                         vpp_size: int | None = None, vpp_rank: int | None = None
                         ) -> tuple[int, int]:
    """[first, last) global layers of a (pipeline rank, virtual chunk); defaults from the grid.

    Rank r, chunk c holds global stage c * p + r of p * v equal stages (V placement, zbv:
    stage r for chunk 0 and 2p-1-r for chunk 1; see megalite.placement.Placement).
    """
    p = parallel_state.get_pipeline_model_parallel_world_size() if pp_size is None else pp_size
    r = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    v = parallel_state.get_virtual_pipeline_model_parallel_world_size() if vpp_size is None \
        else vpp_size
    c = parallel_state.get_virtual_pipeline_model_parallel_rank() if vpp_rank is None else vpp_rank
    v, c = v or 1, c or 0
    place = Placement(p, v, parallel_state.is_pipeline_v_shape())
    per_stage = place.layers_per_stage(num_layers)
    stage = place.stage(r, c)
    return stage * per_stage, (stage + 1) * per_stage



def build_model_chunks(model_provider: Callable[..., nn.Module]) -> list[nn.Module]:
    """This rank's model chunks: one per virtual rank (a list of one without VPP).

    Calls `model_provider(pre_process=..., post_process=...)` with the virtual rank set, so
    each chunk builds its own layer range, and the embedding / head on the first / last stage.
    """
    v = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for chunk in range(v or 1):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk if v else None)
        chunks.append(model_provider(pre_process=parallel_state.is_pipeline_first_stage(),
                                     post_process=parallel_state.is_pipeline_last_stage()))
    parallel_state.set_virtual_pipeline_model_parallel_rank(0 if v else None)
    return chunks



def share_embedding_with_first_stage(weight: nn.Parameter) -> None:
    """Mark the last stage's copy of the tied word embedding.

    Its value and gradient are kept equal to the first stage's by `sync_shared_embedding`
    and `allreduce_shared_embedding_grads` on the embedding group; the global grad norm
    and checkpoints count only the first stage's copy.
    """
    weight.shared_embedding_copy = True



def shared_embedding_params(model: nn.Module | list[nn.Module]) -> list[nn.Parameter]:
    """The word-embedding weights of this rank's chunks, tied across first and last stage.

    Chunks whose model sets `shares_word_embedding = False` (BERT with a classification head,
    an untied GPT without multi-token prediction: the last stage reads no word embedding)
    have none.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return []
    chunks = [unwrap(chunk) for chunk in (model if isinstance(model, list) else [model])]
    return [chunk.embedding.word_embeddings.weight for chunk in chunks
            if getattr(chunk, "shares_word_embedding", True)
            and getattr(chunk, "embedding", None) is not None]
