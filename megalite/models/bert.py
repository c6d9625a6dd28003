"""BERT built from the mpu blocks, one pipeline stage at a time, with one of two heads.

`head="classification"`: pooler tanh(dense(h[CLS])), dropout, linear to `num_labels`
(Hugging Face's BertForSequenceClassification). `head="mlm"`: dense + GeLU + LayerNorm,
logits tied to the word embedding plus a vocab-parallel bias (BertForMaskedLM); only
this head shares the word embedding between the first and the last stage.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.models.transformer import dropout, init_scope, layer_norm
from megalite.models.transformer_stage import TransformerStage
from megalite.mpu.cross_entropy import vocab_parallel_cross_entropy
from megalite.mpu.layers import (VocabParallelEmbedding, init_method_normal,
                                 set_tensor_model_parallel_attributes)
from megalite.mpu.mappings import gather_from_sequence_parallel_region
from megalite.mpu.random import init_generator

HEADS = ("classification", "mlm")


def replicated_linear(config: ModelConfig, in_features: int, out_features: int,
                      params_dtype: torch.dtype, device, sequence_parallel: bool = False
                      ) -> nn.Linear:
    """nn.Linear kept whole on every TP rank: normal(std) weight, zero bias (applied to s/t
    tokens with `sequence_parallel`, so its grads are TP-partial). The weight is drawn in
    params_dtype on the CPU from the seeded scope's generator, after skipping the draws
    nn.Linear's own initialisation took when the weights came from the global generator (so
    they stay what they were), then moved to `device`."""
    generator = init_generator()
    weight = torch.empty(out_features, in_features, dtype=params_dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    nn.init.uniform_(torch.empty(out_features, dtype=params_dtype), generator=generator)
    init_method_normal(config.init_method_std)(weight)
    linear = nn.Linear(in_features, out_features, device="meta")
    linear.weight = nn.Parameter(weight.to(device))
    linear.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device))
    for param in linear.parameters():
        set_tensor_model_parallel_attributes(param, False)
        param.tp_grad_partial = sequence_parallel
    return linear


class Pooler(nn.Module):
    """hidden [s, b, h] -> tanh(dense(hidden[0])) [b, h] (the [CLS] position)."""

    def __init__(self, config: ModelConfig, params_dtype: torch.dtype, device) -> None:
        super().__init__()
        self.dense = replicated_linear(config, config.hidden_size, config.hidden_size,
                                       params_dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[0]))


class MaskedLMHead(nn.Module):
    """dense + GeLU + LayerNorm, then the tied word embedding and a vocab-parallel bias.

    forward(hidden [s, b, h], word_embeddings) -> vocab-parallel logits [s, b, V_padded/tp].
    `sequence_parallel`: hidden is [s/t, b, h] until the output layer gathers it.
    """

    def __init__(self, config: ModelConfig, word_embeddings: VocabParallelEmbedding,
                 params_dtype: torch.dtype, device, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        self.sequence_parallel = sequence_parallel
        self.dense = replicated_linear(config, config.hidden_size, config.hidden_size,
                                       params_dtype, device, sequence_parallel)
        self.layernorm = layer_norm(config, params_dtype, device, sequence_parallel)
        word = word_embeddings.weight
        self.bias = nn.Parameter(torch.zeros(word.shape[0], dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.bias, word.tensor_model_parallel, 0)
        self.bias.unpadded_rows = word_embeddings.num_embeddings

    def forward(self, hidden: torch.Tensor, word_embeddings: VocabParallelEmbedding
                ) -> torch.Tensor:
        hidden = self.layernorm(F.gelu(self.dense(hidden), approximate=self.approximate))
        return word_embeddings.lm_logits(hidden, self.sequence_parallel) + self.bias


class BertModel(TransformerStage):
    """The BERT layers of one pipeline stage; see TransformerStage.

    pre_process: this stage embeds (word + position + token type, LayerNorm, dropout).
    post_process: this stage ends with the head (the MLM head ties the word embedding).
    forward(input_ids [b, s], attention_mask [b, s] 1 = token / 0 = padding | None,
            tokentype_ids [b, s] | None, labels | None) ->
      last stage, classification: loss [b] for labels [b], else logits [b, num_labels];
      last stage, mlm: per-token loss [b, s] for labels [b, s] (0 where label < 0), else
        vocab-parallel logits [b, s, V_padded/tp];
      other stages: hidden states [s, b, h] for the next stage ([s/t, b, h] with
      `sequence_parallel`: scattered after the embedding, gathered for the heads).
    Every stage needs attention_mask; only the first reads input_ids and tokentype_ids.
    """

    def __init__(self, config: ModelConfig, head: str = "classification", num_labels: int = 2,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: tuple[int, int] | None = None, init_seed: int = 1234, group=None,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False) -> None:
        if head not in HEADS:
            raise ValueError(f"BERT head {head!r} is not one of {HEADS}")
        if head == "classification" and num_labels < 2:
            raise ValueError(f"num_labels ({num_labels}) must be >= 2 for classification")
        super().__init__(config, pre_process, post_process, tie_output=head == "mlm",
                         embedding_norm=True, layer_range=layer_range, init_seed=init_seed,
                         group=group, params_dtype=params_dtype, device=device,
                         sequence_parallel=sequence_parallel)
        self.head, self.num_labels = head, num_labels
        if post_process and head == "classification":
            with init_scope(init_seed, "pooler"):
                self.pooler = Pooler(config, params_dtype, device)
            with init_scope(init_seed, "classifier"):
                self.classifier = replicated_linear(config, config.hidden_size, num_labels,
                                                    params_dtype, device)
        if post_process and head == "mlm":
            with init_scope(init_seed, "lm_head"):
                self.lm_head = MaskedLMHead(config, self.embedding.word_embeddings,
                                            params_dtype, device, self.sequence_parallel)

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None
                ) -> torch.Tensor:
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        hidden = self.encoder(self.stage_input(input_ids, tokentype_ids=tokentype_ids), mask)
        if not self.post_process:
            return hidden
        if self.head == "mlm":
            logits = self.lm_head(hidden, self.embedding.word_embeddings)
            if labels is None:
                return logits.transpose(0, 1)
            loss = vocab_parallel_cross_entropy(logits, labels.t().clamp(min=0)).t()
            return loss.masked_fill(labels < 0, 0.0)
        if self.sequence_parallel:  # the pooler reads position 0; its grads are whole per rank
            hidden = gather_from_sequence_parallel_region(hidden,
                                                          tensor_parallel_output_grad=False)
        pooled = dropout(self.pooler(hidden), self.config.hidden_dropout, self.training, False)
        logits = self.classifier(pooled)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels, reduction="none")
