"""Models built per pipeline stage / virtual chunk from a TransformerSpec."""
from megalite.models.bert import BertModel
from megalite.models.gpt import GPTModel
from megalite.models.spec import TransformerSpec
from megalite.models.transformer import ParallelTransformer, ParallelTransformerLayer
from megalite.models.transformer_stage import TransformerStage

__all__ = ["BertModel", "GPTModel", "TransformerSpec", "ParallelTransformer",
           "ParallelTransformerLayer", "TransformerStage"]
