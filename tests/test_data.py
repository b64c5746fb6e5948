import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_transformer.training import data
from mini_transformer.training.data import DatasetUnavailable, get_batch, load_text, split_tokens

FAKE = "To be, or not to be, that is the question.\n" * 50
FAKE_SHA = hashlib.sha256(FAKE.encode()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache directory, and no network: every test sees downloads fail unless it says otherwise."""
    monkeypatch.setenv("MINI_TRANSFORMER_CACHE", str(tmp_path / "cache"))
    calls = []

    def no_network(url):
        calls.append(url)
        raise OSError("network is disabled in tests")

    monkeypatch.setattr(data, "_fetch", no_network)
    return tmp_path / "cache", calls


def test_cache_dir_follows_the_environment(cache):
    assert data.cache_dir() == cache[0]


def test_real_sha_matches_the_cached_copy_when_present():
    try:
        raw = (data.cache_dir() / data.SHAKESPEARE_FILE).read_bytes()
    except OSError:
        pytest.skip("no cached copy of tiny shakespeare")
    assert hashlib.sha256(raw).hexdigest() == data.SHAKESPEARE_SHA256 and len(raw.decode()) == 1_115_394


def test_shakespeare_read_from_cache_without_network(cache, monkeypatch):
    folder, calls = cache
    folder.mkdir()
    (folder / data.SHAKESPEARE_FILE).write_text(FAKE)
    monkeypatch.setattr(data, "SHAKESPEARE_SHA256", FAKE_SHA)
    assert data.shakespeare_text() == FAKE
    assert load_text("shakespeare") == (FAKE, "shakespeare")
    assert calls == []


def test_corrupt_cache_is_downloaded_again_and_replaced(cache, monkeypatch):
    folder, _ = cache
    folder.mkdir()
    (folder / data.SHAKESPEARE_FILE).write_text("truncated")
    monkeypatch.setattr(data, "SHAKESPEARE_SHA256", FAKE_SHA)
    monkeypatch.setattr(data, "_fetch", lambda url: FAKE.encode())
    assert data.shakespeare_text() == FAKE
    assert (folder / data.SHAKESPEARE_FILE).read_text() == FAKE
    assert [p.name for p in folder.iterdir()] == [data.SHAKESPEARE_FILE]  # no temp file left behind


def test_download_with_wrong_sha_is_refused_and_not_cached(cache, monkeypatch):
    folder, _ = cache
    monkeypatch.setattr(data, "_fetch", lambda url: b"something else entirely")
    with pytest.raises(DatasetUnavailable, match="sha256"):
        data.shakespeare_text()
    assert not (folder / data.SHAKESPEARE_FILE).exists()


def test_no_cache_no_network_raises_for_explicit_shakespeare(cache):
    with pytest.raises(DatasetUnavailable, match="could not be downloaded"):
        load_text("shakespeare")


def test_default_falls_back_to_pydoc_with_one_line(cache, capsys):
    text, name = load_text(None)
    assert name == "pydoc" and text == data.pydoc_text() and len(text) > 100_000
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pydoc" in err
    assert cache[1] == [data.SHAKESPEARE_URL]


def test_offline_switch_blocks_the_real_fetch(monkeypatch):
    monkeypatch.setenv("MINI_TRANSFORMER_OFFLINE", "1")
    with pytest.raises(OSError, match="disabled"):
        data._fetch(data.SHAKESPEARE_URL)


def test_file_path_and_bad_sources(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(FAKE, encoding="utf-8")
    assert load_text(str(path)) == (FAKE, str(path))
    assert load_text(path)[0] == FAKE
    with pytest.raises(ValueError, match="nowhere.txt"):
        load_text(str(tmp_path / "nowhere.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_text(str(tmp_path / "empty.txt"))
    with pytest.raises(TypeError, match="data=3"):
        load_text(3)


def test_split_is_90_10_in_order():
    ids = torch.arange(1000)
    train, val = split_tokens(ids, block_size=8)
    assert torch.equal(train, ids[:900]) and torch.equal(val, ids[900:])


def test_text_shorter_than_block_size_plus_one_is_a_clear_error():
    with pytest.raises(ValueError, match=r"block_size \+ 1 = 17"):
        split_tokens(torch.arange(100), block_size=16)  # val gets 10 tokens
    split_tokens(torch.arange(170), block_size=16)  # val gets exactly 17: enough


@settings(max_examples=20, deadline=None)
@given(n=st.integers(10, 200), block=st.integers(1, 9), batch=st.integers(1, 6), seed=st.integers(0, 99))
def test_batches_are_shifted_windows(n, block, batch, seed):
    stream = torch.arange(n) * 7 + 3  # position recoverable from the value
    x, y = get_batch(stream, batch, block, torch.Generator().manual_seed(seed))
    assert x.shape == y.shape == (batch, block)
    starts = (x[:, 0] - 3) // 7
    expected = stream[starts[:, None] + torch.arange(block + 1)]
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])


def test_batches_are_seeded_and_rank_slices_make_the_global_batch():
    stream = torch.arange(500)
    a = get_batch(stream, 4, 16, torch.Generator().manual_seed(3))
    b = get_batch(stream, 4, 16, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0])
    whole = get_batch(stream, 8, 16, torch.Generator().manual_seed(5))
    parts = [get_batch(stream, 4, 16, torch.Generator().manual_seed(5), rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    with pytest.raises(ValueError, match="rank=2"):
        get_batch(stream, 4, 16, torch.Generator(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="block_size \\+ 1 = 17"):
        get_batch(torch.arange(16), 1, 16, torch.Generator())


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt' is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        load_text(path)
