"""Every output path is checked before the work starts: --save, --tensorboard-dir,
--data-cache-dir (pretrain_gpt.py) and --export-dir (finetune_bert.py) that are files, inside
files or not writable end the run with one line naming the flag, before any process group;
tools/preprocess_data.py on an input without text says so and writes nothing."""
import os

import pytest

from megalite.tasks import bert as finetune_bert
from megalite.tasks import gpt as pretrain_gpt
from megalite.training.checks import check_writable_dir
from tests.helpers.gpt_run import make_dataset, tiny_args
from tools import preprocess_data


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("data")))


@pytest.fixture
def a_file(tmp_path) -> str:
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return str(path)


def _error(capsys, main, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir", "--data-cache-dir"])
@pytest.mark.parametrize("inside", [False, True])
def test_pretrain_output_that_is_a_file(data, tmp_path, a_file, capsys, flag, inside):
    path = os.path.join(a_file, "sub") if inside else a_file
    argv = tiny_args(data, str(tmp_path / "ck"), 2) + [flag, path]
    reason = f"is inside {a_file}, which is not a directory" if inside else "is not a directory"
    assert _error(capsys, pretrain_gpt.main, argv) == f"error: {flag} {path}: {reason}"
    assert not (tmp_path / "ck").exists()


def test_finetune_export_dir_that_is_a_file(a_file, capsys):
    assert _error(capsys, finetune_bert.main, ["--export-dir", a_file]) == \
        f"error: --export-dir {a_file}: is not a directory"


def test_a_directory_that_refuses_files(tmp_path, monkeypatch):
    """What a read-only mount or missing permission gives (root ignores chmod, so simulated)."""
    def refuse(dir):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr("megalite.training.checks.tempfile.TemporaryFile", refuse)
    with pytest.raises(ValueError) as error:
        check_writable_dir("--save", str(tmp_path / "ck"))
    assert str(error.value) == \
        f"--save {tmp_path}/ck: {tmp_path} is not writable (Permission denied)"


def test_a_new_directory_below_a_writable_one_is_fine_and_not_created(tmp_path):
    check_writable_dir("--save", str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    from megalite.data.tokenizer_training import train_sentencepiece
    from tests.test_data_tokenizers import tiny_lines
    directory = tmp_path_factory.mktemp("sp")
    (directory / "lines.txt").write_text("\n".join(tiny_lines()))
    return train_sentencepiece([str(directory / "lines.txt")], str(directory / "sp"), 400)


@pytest.mark.parametrize("name,text,expected", [
    ("empty.jsonl", "", "no JSON lines (the file is empty)"),
    ("blank.jsonl", '{"text": ""}\n', "no document has text under --json-keys text"),
    ("blank.txt", "\n \n\n", "no document has text under --json-keys text"),
])
def test_preprocess_input_without_text(tmp_path, sp_model, name, text, expected):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as stop:
        preprocess_data.main(["--input", str(tmp_path / name), "--tokenizer", sp_model,
                              "--output-prefix", str(tmp_path / "out" / "o")])
    assert str(stop.value.code).startswith(f"preprocess_data: --input {tmp_path / name}: "
                                           f"{expected}")
    assert not list(tmp_path.glob("out/o_*"))
