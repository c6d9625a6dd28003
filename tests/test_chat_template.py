"""megalite.data.chat_template on a small word-level transformers tokenizer whose template
ends an assistant turn with <|eot|> (not its EOS, as Llama 3 does): the rendered text is the
one the template spells out, it survives a save into a checkpoint's tokenizer/, and bad
conversations or a tokenizer without a template get one clear error."""
import pytest

from megalite.data.chat_template import end_of_turn_ids, render_chat
from megalite.data.tokenizers import HFTokenizer, build_tokenizer

TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}: {{ m['content'] }}<|eot|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant: {% endif %}")
WORDS = ["hello", "there", "be", "brief", "system:", "user:", "assistant:"]
SPECIAL = ["<unk>", "<eos>", "<|start|>", "<|eot|>"]


def _tokenizer_dir(path, template: str | None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>",
                                 additional_special_tokens=["<|start|>", "<|eot|>"])
    hf.chat_template = template
    hf.save_pretrained(str(path))
    return str(path)


def test_rendered_as_the_template_writes_it_from_a_directory_and_a_checkpoint(tmp_path):
    tokenizer = HFTokenizer(_tokenizer_dir(tmp_path / "tok", TEMPLATE))
    saved = build_tokenizer(tokenizer.save(str(tmp_path / "ckpt" / "tokenizer")))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for tok in (tokenizer, saved):
        assert render_chat(tok, messages) == ("<|start|>system: be brief<|eot|><|start|>user: "
                                              "hello<|eot|><|start|>assistant: ")
        assert render_chat(tok, messages, add_generation_prompt=False).endswith("hello<|eot|>")
        assert tok.tokenize(render_chat(tok, messages)) == [2, 8, 6, 7, 3, 2, 9, 4, 3, 2, 10]
        assert end_of_turn_ids(tok) == [1, 3]  # <eos>, then the template's <|eot|>


@pytest.mark.parametrize("messages,needle", [
    ([], "messages: expected a non-empty list"),
    ({"role": "user", "content": "hello"}, "messages: expected a non-empty list"),
    (["hello"], "messages[0]: expected an object"),
    ([{"role": "user", "content": "hello"}, {"role": "tool", "content": "x"}],
     "messages[1].role: 'tool', expected one of system, user, assistant"),
    ([{"role": "user"}], "messages[0].content: expected a string, got NoneType"),
    ([{"role": "user", "content": ["hello"]}], "messages[0].content: expected a string, got list"),
])
def test_bad_conversations_are_one_error(tmp_path, messages, needle):
    tokenizer = HFTokenizer(_tokenizer_dir(tmp_path, TEMPLATE))
    with pytest.raises(ValueError) as error:
        render_chat(tokenizer, messages)
    assert needle in str(error.value)


def test_a_tokenizer_without_a_template_is_named(tmp_path):
    from megalite.data.tokenizer_training import train_sentencepiece
    plain = _tokenizer_dir(tmp_path / "plain", None)
    (tmp_path / "text.txt").write_text("\n".join(["hello there be brief"] * 50))
    sp = train_sentencepiece([str(tmp_path / "text.txt")], str(tmp_path / "sp"), 280)
    for path, kind in ((plain, "transformers tokenizer"), (sp, "sentencepiece model")):
        with pytest.raises(ValueError) as error:
            render_chat(build_tokenizer(path), [{"role": "user", "content": "hello"}])
        assert str(error.value).startswith(f"tokenizer {path}: this {kind} has no chat "
                                           f"template"), error.value
