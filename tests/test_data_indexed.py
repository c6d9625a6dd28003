"""Megatron .bin/.idx format: round trip, an independent writer, clear errors."""
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype


def spec_writer(prefix, documents, dtype, code):
    """Writes documents (lists of sequences) straight from the documented layout."""
    sequences = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(s.tobytes())
    lengths = [len(s) for s in sequences]
    offsets = [sum(lengths[:i]) * np.dtype(dtype).itemsize for i in range(len(lengths))]
    doc_starts = [0]
    for doc in documents:
        doc_starts.append(doc_starts[-1] + len(doc))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_starts)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(offsets)}q", *offsets))
        f.write(struct.pack(f"<{len(doc_starts)}q", *doc_starts))
    return sequences, doc_starts


def random_documents(seed=0, vocab=60000):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, vocab, rng.integers(0, 50)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(30)]


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
def test_builder_matches_spec_writer_byte_for_byte(tmp_path, dtype, code):
    documents = random_documents()
    sequences, doc_starts = spec_writer(str(tmp_path / "spec"), documents, dtype, code)
    builder = IndexedDatasetBuilder(str(tmp_path / "built.bin"), dtype)
    for doc in documents:
        for sequence in doc:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(str(tmp_path / "built.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"built{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()

    for prefix in ("spec", "built"):
        ds = IndexedDataset(str(tmp_path / prefix))
        assert ds.dtype == np.dtype(dtype) and len(ds) == len(sequences)
        assert ds.document_indices.tolist() == doc_starts
        assert ds.num_documents == len(documents)
        assert ds.sizes.tolist() == [len(s) for s in sequences]
        for i, s in enumerate(sequences):
            np.testing.assert_array_equal(ds[i], s)
        longest = int(np.argmax(ds.sizes))
        np.testing.assert_array_equal(ds.get(longest, 3, 5), sequences[longest][3:8])
        np.testing.assert_array_equal(ds.get(longest, 4), sequences[longest][4:])


def test_empty_dataset_and_bounds(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "e.bin"), np.uint16)
    builder.finalize(str(tmp_path / "e.idx"))
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
    spec_writer(str(tmp_path / "s"), [[[1, 2, 3]]], np.uint16, 8)
    with pytest.raises(IndexError):
        IndexedDataset(str(tmp_path / "s")).get(0, 2, 5)


def test_best_dtype():
    assert best_dtype(32000) == np.uint16 and best_dtype(65500) == np.int32


@pytest.mark.parametrize("case,message", [
    ("magic", "magic"), ("version", "version 2, expected 1"), ("idx_truncated", "truncated .idx"),
    ("idx_tiny", "header"), ("bin_truncated", "truncated or mismatched .bin"),
])
def test_clear_errors(tmp_path, case, message):
    prefix = tmp_path / "d"
    spec_writer(str(prefix), random_documents(1), np.uint16, 8)
    idx, bin_ = tmp_path / "d.idx", tmp_path / "d.bin"
    data = idx.read_bytes()
    path, new = {
        "magic": (idx, b"NOTANIDX\x00" + data[9:]),
        "version": (idx, data[:9] + struct.pack("<Q", 2) + data[17:]),
        "idx_truncated": (idx, data[:-8]),
        "idx_tiny": (idx, data[:10]),
        "bin_truncated": (bin_, bin_.read_bytes()[:-2]),
    }[case]
    path.write_bytes(new)
    with pytest.raises(ValueError) as error:
        IndexedDataset(str(prefix))
    text = str(error.value)
    assert message in text and str(tmp_path) in text and "\n" not in text


def test_missing_file(tmp_path):
    spec_writer(str(tmp_path / "d"), [[[1]]], np.uint16, 8)
    (tmp_path / "d.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"d\.bin: no such file"):
        IndexedDataset(str(tmp_path / "d"))
