"""GGUF reading: the RoPE unpermutation against an explicitly interleaved layout, and one-line
errors for a GGUF of another architecture and for a file that is no GGUF."""
import pytest
import torch

from megalite.hf import read_llama_gguf
from megalite.hf.gguf import unpermute_rotary

gguf = pytest.importorskip("gguf")


def test_unpermute_rotary_undoes_the_interleaved_pair_layout():
    heads, d, cols = 3, 8, 5
    half_split = torch.randn(heads * d, cols)
    # interleaved: row 2i of a head holds half-split row i, row 2i+1 holds row i + d/2
    interleaved = torch.empty_like(half_split)
    for h in range(heads):
        for i in range(d // 2):
            interleaved[h * d + 2 * i] = half_split[h * d + i]
            interleaved[h * d + 2 * i + 1] = half_split[h * d + d // 2 + i]
    assert torch.equal(unpermute_rotary(interleaved, heads), half_split)


def test_gguf_of_another_architecture_is_one_clear_line(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture is 'gpt2', expected 'llama'") as error:
        read_llama_gguf(path)
    assert path in str(error.value) and "\n" not in str(error.value)


def test_not_a_gguf_file_is_one_clear_line(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF file") as error:
        read_llama_gguf(str(path))
    assert "\n" not in str(error.value)


def test_smollm2_tokenizer_from_its_gguf():
    """--tokenizer FILE.gguf: the vocabulary and end-of-document id stored in the GGUF."""
    from megalite.data.tokenizers import build_tokenizer
    from megalite.hf import smollm2_gguf_path
    path = smollm2_gguf_path()
    fields = gguf.GGUFReader(path).fields
    tokenizer = build_tokenizer(path)
    assert tokenizer.vocab_size == len(fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert tokenizer.eod == fields["tokenizer.ggml.eos_token_id"].contents()
    text = "The capital of France is Paris."
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text and len(ids) < len(text)
