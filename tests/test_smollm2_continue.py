"""Real pretrained weights continued in one command: SmolLM2-135M-Instruct's GGUF converted by
tools/convert_checkpoint.py, then `pretrain_gpt.py --load CK` with run-size flags only. The
model, its tokenizer, and the built-in corpus tokenised with that tokenizer all follow from the
checkpoint; the first loss equals transformers' loss on the same batch (transformers' own GGUF
load, cached as in tests/helpers/smollm2.py). The conversion is the session's
(tests/conftest.py: `smollm2_checkpoint`). The checkpoint exports to a transformers directory
that AutoTokenizer (chat template included) and AutoModelForCausalLM load, with transformers'
logits, and tools/generate.py --load (run in a rank-pool worker) finds the tokenizer in the
checkpoint.
"""
import contextlib
import hashlib
import io
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megalite.tasks import gpt as pretrain_gpt
from megalite import checkpoint
from megalite.data import builtin_corpus as bc
from megalite.data.tokenizers import build_tokenizer
from megalite.hf import smollm2_gguf_path
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import rel_err
from tests.helpers.smollm2 import PROMPTS, cached_reference, hf_reference
from tests.test_data_builtin import small_documents
from tools import convert_checkpoint

RUN_SIZE = ["--seq-length", "32", "--micro-batch-size", "2", "--exit-interval", "1"]


@pytest.fixture(scope="module")
def converted(smollm2_checkpoint, tmp_path_factory) -> tuple[str, str]:
    """(SmolLM2 converted to a megalite checkpoint, a cache holding a small built-in corpus)."""
    cache = str(tmp_path_factory.mktemp("smol") / "cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bc, "builtin_documents", lambda workers: small_documents())
        patch.setattr(bc, "VOCAB_SIZE", 300)
        bc.builtin_corpus(os.path.join(cache, "builtin"))
    return smollm2_checkpoint, cache


@contextlib.contextmanager
def _megalite_cache(cache: str):
    """MEGALITE_CACHE=cache in this process for the block."""
    previous = os.environ.get("MEGALITE_CACHE")
    os.environ["MEGALITE_CACHE"] = cache
    try:
        yield
    finally:
        os.environ.pop("MEGALITE_CACHE")
        if previous is not None:
            os.environ["MEGALITE_CACHE"] = previous


def _continue(ck: str, cache: str) -> tuple[dict[int, float], torch.Tensor]:
    """`pretrain_gpt.py --load CK` + RUN_SIZE in this process: (losses, first batch)."""
    batches, forward_step = [], pretrain_gpt.forward_step

    def keep_batch(data_iterator, model):
        batch = next(data_iterator)
        batches.append(batch["tokens"].clone())
        return forward_step(iter([batch]), model)
    pretrain_gpt.forward_step = keep_batch
    try:
        with _megalite_cache(cache):
            losses = pretrain_gpt.run(["--load", ck, *RUN_SIZE]).losses
    finally:
        pretrain_gpt.forward_step = forward_step
    return losses, batches[0]


def _generate(ck: str, cache: str) -> str:
    """`tools/generate.py --load CK` in this rank-pool worker with MEGALITE_CACHE=cache (no
    built-in tokenizer to fall back to): what it prints."""
    from tools import generate
    out = io.StringIO()
    with _megalite_cache(cache), contextlib.redirect_stdout(out):
        generate.main(["--load", ck, "--prompt", "The capital of France is",
                       "--max-new-tokens", "3"])
    return out.getvalue()


def _transformers_loss(tokens: torch.Tensor) -> float:
    """Mean next-token loss of transformers' SmolLM2 on `tokens` [b, s+1], cached by batch."""
    def compute(tokenizer, model) -> dict:
        logits = model(input_ids=tokens[:, :-1]).logits
        return {"loss": F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())}
    key = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]
    return cached_reference(smollm2_gguf_path(), f"continue-{key}", compute)["loss"].item()


def test_smollm2_continues_from_load_alone_with_transformers_loss(converted):
    ck, cache = converted
    losses, tokens = run_on_ranks(1, _continue, ck, cache, timeout=600)[0]
    assert sorted(losses) == [1] and tokens.shape == (2, 33)
    tokenizer = build_tokenizer(checkpoint.checkpoint_tokenizer(ck, checkpoint.read_meta(ck)))
    text = tokenizer.detokenize(tokens.flatten().tolist())
    assert " gamma" in text or " delta" in text  # the built-in corpus in SmolLM2's tokens
    assert losses[1] < 0.6 * math.log(49152)  # a random model: ln V = 10.8
    assert abs(losses[1] - _transformers_loss(tokens)) < 1e-4 * losses[1]


def test_smollm2_export_loads_with_autotokenizer_and_automodel(converted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ck, _ = converted
    out = str(tmp_path / "hf")
    convert_checkpoint.main(["--direction", "megalite-to-hf", "--model-type", "llama",
                             "--input", ck, "--output", out])
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>system") and "<|im_start|>user\nHi<|im_end|>" in chat
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                 dtype=torch.float32).eval()
    reference = hf_reference(smollm2_gguf_path())
    for prompt, ids, logits in zip(PROMPTS, reference["ids"], reference["logits"]):
        assert torch.equal(tokenizer(prompt, return_tensors="pt").input_ids, ids)
        with torch.no_grad():
            assert rel_err(model(input_ids=ids).logits, logits) < 1e-4


def test_generate_takes_the_tokenizer_from_the_checkpoint(converted, tmp_path):
    ck, _ = converted
    printed = run_on_ranks(1, _generate, ck, str(tmp_path))[0]
    assert "\nThe capital of France is Paris." in printed, printed
