"""tools/convert_checkpoint.py cannot silently make the wrong model: the family is read from
the input (config.json's model_type, the GGUF's architecture, the checkpoint's config), a
--model-type that disagrees, a missing or unused weight, and a --target-tp/--target-pp the
model cannot be split into are one error line each. A GGUF file is parsed once per load.
Every family's export keeps the source's special-token ids, and the converter and
generation's --hf reader find the family from config.json alone."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite import checkpoint
from megalite.hf import FAMILIES, family_of_config
from megalite.hf.gguf import unpermute_rotary
from megalite.inference.loading import read_hf
from tests.helpers.multirank import run_on_ranks
from tests.helpers.reference import tiny_gpt2
from tests.test_bert_hf_parity import tiny_bert
from tests.test_hf_roundtrip_multinode import _tiny_hf
from tests.test_llama_hf_parity import tiny_llama
from tools import convert_checkpoint

gguf = pytest.importorskip("gguf")
GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight", "model.embed_tokens.weight":
              "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def convert(*argv) -> None:
    convert_checkpoint.main([str(a) for a in argv])


def refusal(capsys, *argv) -> str:
    """The one error line the conversion exits with (code 2; transformers' loading progress
    bars may come before it)."""
    with pytest.raises(SystemExit) as stop:
        convert(*argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.startswith("error:") for line in lines].count(True) == 1, lines
    return lines[-1]


def write_gguf(hf, path: str, extra: dict | None = None) -> None:
    """A transformers Llama as an fp32 llama GGUF (q and k in GGUF's interleaved layout)."""
    c = hf.config
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, c.num_hidden_layers),
                       (writer.add_context_length, c.max_position_embeddings),
                       (writer.add_embedding_length, c.hidden_size),
                       (writer.add_feed_forward_length, c.intermediate_size),
                       (writer.add_head_count, c.num_attention_heads),
                       (writer.add_head_count_kv, c.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (writer.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (writer.add_vocab_size, c.vocab_size)):
        add(value)
    for name, tensor in {**hf.state_dict(), **(extra or {})}.items():
        layer, _, suffix = name.removeprefix("model.layers.").partition(".")
        gguf_name = f"blk.{layer}.{GGUF_NAMES[suffix]}" if suffix in GGUF_NAMES \
            else GGUF_NAMES.get(name, name)
        heads = {"attn_q.weight": c.num_attention_heads,
                 "attn_k.weight": c.num_key_value_heads}.get(GGUF_NAMES.get(suffix))
        if heads:  # the inverse of unpermute_rotary
            tensor = tensor.reshape(heads, 2, -1, tensor.shape[1]).transpose(1, 2) \
                .reshape(tensor.shape)
            assert torch.equal(unpermute_rotary(tensor, heads), hf.state_dict()[name])
        writer.add_tensor(gguf_name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def count_gguf_parses(monkeypatch) -> list[str]:
    """Every GGUFReader construction from now on, by path."""
    parsed, reader = [], gguf.GGUFReader

    class Counting(reader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return parsed


def logits(model) -> torch.Tensor:
    tokens = torch.randint(0, model.config.vocab_size, (2, 9),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """Random transformers Llamas: GQA (4 heads, 2 groups, 4 layers, vocab 512), and one
    with 9 heads in 3 groups (SmolLM2's split)."""
    root = tmp_path_factory.mktemp("llama")
    gqa = tiny_llama(num_hidden_layers=4, num_key_value_heads=2, vocab_size=512).eval()
    gqa.save_pretrained(root / "gqa")
    tiny_llama(hidden_size=72, num_attention_heads=9, num_key_value_heads=3).save_pretrained(
        root / "nine_heads")
    return root, gqa


def test_llama_directory_without_model_type_round_trips(llama_dirs, tmp_path):
    from transformers import LlamaForCausalLM
    root, hf = llama_dirs
    convert("--direction", "hf-to-megalite", "--input", root / "gqa", "--output",
            tmp_path / "ml", "--target-tp", "2", "--target-pp", "2")
    assert checkpoint.read_meta(str(tmp_path / "ml"))["model_config"]["swiglu"]
    convert("--direction", "megalite-to-hf", "--input", tmp_path / "ml", "--output",
            tmp_path / "back")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert torch.equal(logits(back.eval()), logits(hf))


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_is_found_and_keeps_its_token_ids(family, tmp_path):
    """transformers -> megalite -> transformers with no --model-type: the family comes from
    config.json, the export's bos/eos/pad ids are the source's (an eos list for Llama), and
    the --hf reader of generation reads the same family and ids."""
    hf = tiny_bert("classification") if family == "bert" else _tiny_hf(family)
    ids = dict(bos_token_id=5, eos_token_id=[6, 7] if family == "llama" else 6, pad_token_id=0)
    for target in (hf.config, getattr(hf, "generation_config", None)):
        for name, value in ids.items() if target is not None else ():
            setattr(target, name, value)
    hf.save_pretrained(tmp_path / "hf")
    convert("--direction", "hf-to-megalite", "--input", tmp_path / "hf", "--output",
            tmp_path / "ml")
    meta = checkpoint.read_meta(str(tmp_path / "ml"))["model_config"]
    assert {name: meta[name] for name in TOKEN_IDS} == ids
    convert("--direction", "megalite-to-hf", "--input", tmp_path / "ml", "--output",
            tmp_path / "back")
    back = json.load(open(tmp_path / "back" / "config.json"))
    source = json.load(open(tmp_path / "hf" / "config.json"))
    assert back["model_type"] == source["model_type"]
    assert {name: back.get(name) for name in TOKEN_IDS} == \
        {name: source.get(name) for name in TOKEN_IDS} == ids
    if FAMILIES[family].generates:
        config, _ = read_hf(str(tmp_path / "hf"))
        assert family_of_config(config) == family
        assert {name: getattr(config, name) for name in TOKEN_IDS} == ids


@pytest.mark.parametrize("model,layout,expected", [
    ("nine_heads", ["--target-tp", "2"], "--target-tp 2 --target-pp 1: --num-attention-heads "
     "(9) must be divisible by the tensor-parallel size (2)"),
    ("gqa", ["--target-tp", "3"], "--target-tp 3 --target-pp 1: --num-attention-heads (4) "
     "must be divisible by the tensor-parallel size (3)"),
    ("gqa", ["--target-tp", "4", "--target-pp", "3"], "--target-tp 4 --target-pp 3: "
     "--num-layers (4) must be divisible by --pp x --vpp = 3"),
])
def test_impossible_target_layouts_are_refused(llama_dirs, tmp_path, capsys, model, layout,
                                               expected):
    root, _ = llama_dirs
    assert refusal(capsys, "--direction", "hf-to-megalite", "--input", root / model,
                   "--output", tmp_path / "ml", *layout) == f"error: {expected}"
    assert not (tmp_path / "ml").exists()


def test_a_model_type_that_disagrees_is_refused(llama_dirs, tmp_path, capsys):
    root, _ = llama_dirs
    assert refusal(capsys, "--direction", "hf-to-megalite", "--model-type", "gpt", "--input",
                   root / "gqa", "--output", tmp_path / "ml") == (
        f"error: --model-type gpt disagrees with --input {root / 'gqa'}, which holds a llama "
        f"model (drop --model-type, or give the right input)")
    tiny_gpt2().save_pretrained(tmp_path / "gpt2")
    convert("--direction", "hf-to-megalite", "--input", tmp_path / "gpt2", "--output",
            tmp_path / "ml")
    assert "disagrees with" in refusal(capsys, "--direction", "megalite-to-hf", "--model-type",
                                       "llama", "--input", tmp_path / "ml", "--output",
                                       tmp_path / "hf")


def test_a_missing_weight_is_refused(llama_dirs, tmp_path, capsys):
    root, _ = llama_dirs
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((root / "gqa" / "config.json").read_text())
    weights = load_file(root / "gqa" / "model.safetensors")
    del weights["model.layers.1.post_attention_layernorm.weight"]
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    line = refusal(capsys, "--direction", "hf-to-megalite", "--input", tmp_path / "hf",
                   "--output", tmp_path / "ml")
    assert "missing keys ['model.layers.1.post_attention_layernorm.weight'] (1)" in line


def test_a_checkpoint_missing_a_weight_is_refused(llama_dirs, tmp_path, capsys):
    root, _ = llama_dirs
    convert("--direction", "hf-to-megalite", "--input", root / "gqa", "--output", tmp_path / "ml")
    path = os.path.join(checkpoint.iteration_dir(str(tmp_path / "ml"), 0), "index.json")
    index = json.load(open(path))
    del index["model"]["final_layernorm.weight"]
    json.dump(index, open(path, "w"))
    assert "missing final_layernorm.weight, unexpected none" in refusal(
        capsys, "--direction", "megalite-to-hf", "--input", tmp_path / "ml", "--output",
        tmp_path / "hf")


def test_gguf_without_model_type_is_parsed_once_with_progress(llama_dirs, tmp_path, capsys,
                                                               monkeypatch):
    from transformers import LlamaForCausalLM
    _, hf = llama_dirs
    write_gguf(hf, str(tmp_path / "tiny.gguf"))
    parsed = count_gguf_parses(monkeypatch)
    convert("--direction", "hf-to-megalite", "--input", tmp_path / "tiny.gguf", "--output",
            tmp_path / "ml")
    assert parsed == [str(tmp_path / "tiny.gguf")]
    out = capsys.readouterr().out
    assert "reading" in out and "dequantised 39/39 tensors" in out, out
    convert("--direction", "megalite-to-hf", "--input", tmp_path / "ml", "--output",
            tmp_path / "back")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    assert torch.equal(logits(back.eval()), logits(hf))


def test_gguf_with_a_tensor_llama_lacks_is_refused(llama_dirs, tmp_path, capsys):
    _, hf = llama_dirs
    write_gguf(hf, str(tmp_path / "odd.gguf"), {"blk.0.attn_q.bias": torch.zeros(64)})
    assert refusal(capsys, "--direction", "hf-to-megalite", "--input", tmp_path / "odd.gguf",
                   "--output", tmp_path / "ml") == (
        f"error: {tmp_path / 'odd.gguf'}: tensor 'blk.0.attn_q.bias' has no place in a Llama "
        f"model")


def _generate_from_gguf(path: str, tokenizer: str) -> list[str]:
    """tools/generate.py on a GGUF in this rank-pool worker; the files GGUFReader parsed."""
    import gguf as package

    from tools import generate
    parsed, reader = [], package.GGUFReader

    class Counting(reader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)
    package.GGUFReader = Counting
    try:
        generate.main(["--gguf", path, "--tokenizer", tokenizer, "--prompt", "abc",
                       "--max-new-tokens", "0"])  # load only
    finally:
        package.GGUFReader = reader
    return parsed


def test_generate_parses_a_gguf_once(llama_dirs, tmp_path):
    from megalite.data.tokenizer_training import train_sentencepiece
    _, hf = llama_dirs
    write_gguf(hf, str(tmp_path / "tiny.gguf"))
    (tmp_path / "text.txt").write_text("\n".join(["abc def ghij"] * 50))
    tokenizer = train_sentencepiece([str(tmp_path / "text.txt")], str(tmp_path / "sp"), 280)
    assert run_on_ranks(1, _generate_from_gguf, str(tmp_path / "tiny.gguf"), tokenizer)[0] == \
        [str(tmp_path / "tiny.gguf")]


def test_the_tokenizer_of_a_gguf_does_not_parse_it_again(monkeypatch):
    from megalite.data.tokenizers import build_tokenizer
    from megalite.hf import smollm2_gguf_path
    parsed = count_gguf_parses(monkeypatch)
    assert build_tokenizer(smollm2_gguf_path()).vocab_size == 49152
    assert parsed == []
