"""GPT sample index vs brute force, splits, blending, index caches, samplers."""
import numpy as np
import pytest
import torch

from megalite.data import gpt_dataset
from megalite.data.blended_dataset import build_blending_indices
from megalite.data.gpt_dataset import (GPTDataset, build_gpt_datasets, parse_data_path,
                                       split_document_ranges)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.data.loader import TimedIterator, token_batches
from megalite.data.samplers import PretrainingSampler


def write_dataset(prefix, num_documents, base=0, seed=0, max_sequences=1):
    """Documents of 1..max_sequences sequences (some empty); token k of sequence s is
    base + 1000 * s + k, so every token in the file is distinct. Returns the sequences."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    sequences = []
    for _ in range(num_documents):
        for _ in range(rng.integers(1, max_sequences + 1)):
            size = 0 if rng.random() < 0.1 else int(rng.integers(1, 40))
            sequences.append(base + 1000 * len(sequences) + np.arange(size))
            builder.add_item(sequences[-1])
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return sequences


def test_samples_match_brute_force(tmp_path):
    sequences = write_dataset(tmp_path / "d", 25)
    indexed = IndexedDataset(str(tmp_path / "d"))
    seq_length, num_samples = 7, 300  # about 5 epochs of ~500 tokens
    ds = GPTDataset(indexed, (0, 25), seq_length, num_samples, seed=3)
    assert len(ds) == num_samples

    tokens_per_epoch = sum(map(len, sequences))
    epochs = len(ds.document_index) // 25
    assert (epochs - 1) * tokens_per_epoch < num_samples * seq_length + 1 <= epochs * tokens_per_epoch
    for e in range(epochs):
        assert sorted(ds.document_index[25 * e:25 * (e + 1)]) == list(range(25))
    stream = np.concatenate([sequences[d] for d in ds.document_index])
    assert sorted(ds.shuffle_index) == list(range(num_samples))
    for i in range(num_samples):
        j = ds.shuffle_index[i]
        sample = ds[i]["tokens"]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        np.testing.assert_array_equal(sample, stream[j * seq_length:(j + 1) * seq_length + 1])

    same = GPTDataset(indexed, (0, 25), seq_length, num_samples, seed=3)
    other = GPTDataset(indexed, (0, 25), seq_length, num_samples, seed=4)
    np.testing.assert_array_equal(same[5]["tokens"], ds[5]["tokens"])
    assert not np.array_equal(other.document_index, ds.document_index)


def test_split_ranges():
    assert split_document_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(10, "8/1/1") == [(0, 8), (8, 9), (9, 10)]
    assert split_document_ranges(7, "1") == [(0, 7), (7, 7), (7, 7)]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            split_document_ranges(10, bad)


def test_splits_use_disjoint_documents(tmp_path):
    write_dataset(tmp_path / "d", 100, max_sequences=3)
    document_indices = IndexedDataset(str(tmp_path / "d")).document_indices
    train, valid, test = build_gpt_datasets([str(tmp_path / "d")], "80,20,0", 16, (50, 10, 10),
                                            seed=1, cache_dir=None)
    assert test is None and len(train) == 50 and len(valid) == 10
    for ds, (begin, end) in ((train, (0, 80)), (valid, (80, 100))):
        expected = set(range(document_indices[begin], document_indices[end]))
        assert set(ds.document_index.tolist()) == expected
    train, valid, test = build_gpt_datasets([str(tmp_path / "d")], "80,10,10", 16, (5, 0, 1), 1, None)
    assert valid is None and len(train) == 5 and len(test) == 1


def test_data_path_errors():
    for bad in (["1", "a", "2"], ["x", "a", "y", "b"], ["0", "a", "1", "b"]):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)
    assert parse_data_path(["3", "a", "1", "b"]) == ([0.75, 0.25], ["a", "b"])


def test_index_cache_built_once_by_builder_rank(tmp_path, monkeypatch):
    write_dataset(tmp_path / "d", 20)
    indexed = IndexedDataset(str(tmp_path / "d"))
    cache = str(tmp_path / "cache")
    barriers = []
    with pytest.raises(FileNotFoundError, match="index cache file missing"):
        GPTDataset(indexed, (0, 20), 8, 40, 0, cache, is_builder_rank=False, barrier=lambda: barriers.append(1))
    built = GPTDataset(indexed, (0, 20), 8, 40, 0, cache, barrier=lambda: barriers.append(1))
    assert len(list((tmp_path / "cache").glob("GPTDataset-*.npy"))) == 3

    def fail(*args):
        raise AssertionError("rebuilt instead of loading the cache")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", fail)
    loaded = GPTDataset(indexed, (0, 20), 8, 40, 0, cache, is_builder_rank=False,
                        barrier=lambda: barriers.append(1))
    assert barriers == [1, 1, 1]
    for name in gpt_dataset.INDEX_NAMES:
        np.testing.assert_array_equal(getattr(built, name), getattr(loaded, name))


def test_blending_proportions(tmp_path):
    weights = [0.5, 0.3, 0.2]
    data_path = []
    for k, w in enumerate(weights):
        write_dataset(tmp_path / f"d{k}", 40, base=10_000_000 * k, seed=k)
        data_path += [str(w * 10), str(tmp_path / f"d{k}")]
    train, valid, test = build_gpt_datasets(data_path, "90,10,0", 16, (10_000, 100, 0), seed=2,
                                            cache_dir=str(tmp_path / "cache"))
    assert test is None and len(train) == 10_000 and len(valid) == 100
    source = np.array([train[i]["tokens"][0] // 10_000_000 for i in range(len(train))])
    fractions = np.bincount(source, minlength=3) / len(train)
    assert np.all(np.abs(fractions - weights) < 0.01), fractions

    dataset_index, sample_index = build_blending_indices(weights, 10_000)
    achieved = np.cumsum(np.eye(3)[dataset_index], axis=0)
    assert np.all(np.abs(achieved - np.arange(1, 10_001)[:, None] * weights) <= 1)
    for d in range(3):  # each dataset's samples are used in order, once
        assert sample_index[dataset_index == d].tolist() == list(range((dataset_index == d).sum()))


def test_sampler_dp_slices_and_resume():
    mbs, dp, total = 4, 3, 103
    per_rank = [list(PretrainingSampler(total, 0, mbs, rank, dp)) for rank in range(dp)]
    assert all(len(batches) == total // (mbs * dp) for batches in per_rank)
    for step, batches in enumerate(zip(*per_rank)):
        assert sum(batches, []) == list(range(step * mbs * dp, (step + 1) * mbs * dp))
    for consumed_steps in (2, 5):
        for rank in range(dp):
            resumed = list(PretrainingSampler(total, consumed_steps * mbs * dp, mbs, rank, dp))
            assert resumed == per_rank[rank][consumed_steps:]
    with pytest.raises(ValueError, match="data_parallel_rank 3"):
        PretrainingSampler(total, 0, mbs, 3, dp)


@pytest.mark.parametrize("workers", [0, 2])
def test_token_batches_follow_the_sampler_with_any_number_of_workers(tmp_path, device, workers):
    write_dataset(tmp_path / "d", 20)
    (train, _, _) = build_gpt_datasets([str(tmp_path / "d")], "1,0,0", 8, (24, 0, 0), 0, None)
    batches = TimedIterator(token_batches(train, PretrainingSampler(len(train), 8, 4, 1, 2),
                                          workers, device))
    got = list(batches)
    assert len(got) == 2 and batches.take() > 0 and batches.seconds == 0
    for step, batch in enumerate(got):
        assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (4, 9)
        assert batch["tokens"].device == device
        first = 8 + step * 8 + 4
        expected = np.stack([train[i]["tokens"] for i in range(first, first + 4)])
        np.testing.assert_array_equal(batch["tokens"].cpu().numpy(), expected)
