"""What a run directory guarantees: a run is never silently replaced, every checkpoint file is checked
against its manifest, killed saves leave nothing that loads half a model, and resuming after a kill at
any line of a save ends bit-identical to an uninterrupted run (the fault-injection test)."""

import contextlib
import io
import multiprocessing
import os
import shutil
import signal
import sys

import pytest
import torch

from mini_transformer import TransformerConfig, TransformerLM, checkpoint
from mini_transformer.checkpoint import CheckpointError, resolve_checkpoint_dir
from mini_transformer.cli import main
from mini_transformer.training import TrainConfig, train
from mini_transformer.training import io as train_io
from mini_transformer.training import loop as train_module
from mini_transformer.training.io import TRAIN_STATE_FILE, find_checkpoint, load_train_state

TINY = dict(vocab_size=1, d_model=32, n_heads=2, n_layer=2, max_seq_len=16, attn_backend="sdpa")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    words = ["the", "king", "shall", "speak", "and", "we", "hear", "him", "now.\n"]
    picks = torch.randint(len(words), (1200,), generator=torch.Generator().manual_seed(0)).tolist()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(" ".join(words[i] for i in picks))
    return path


def run_config(corpus, out, **changes) -> TrainConfig:
    values = dict(data=str(corpus), batch_size=2, block_size=16, max_steps=6, warmup_steps=1, eval_interval=2,
                  eval_batches=1, out_dir=str(out), progress=False, num_samples=0, sample_tokens=4)
    return TrainConfig(**{**values, **changes})


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    train(run_config(corpus, out, num_samples=1), TransformerConfig(**TINY))
    return out


def cli(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


# --------------------------------------------------------------------------------- the run directory
def test_a_second_run_into_the_same_directory_is_refused(corpus, finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    best_before = (out / "best" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"already holds a run.*--resume.*--overwrite"):
        train(run_config(corpus, out, max_steps=2), TransformerConfig(**TINY))
    assert (out / "best" / "model.safetensors").read_bytes() == best_before
    result = train(run_config(corpus, out, max_steps=2), TransformerConfig(**TINY), overwrite=True)
    assert load_train_state(out / "best")["step"] == 2 and result.step == 2
    assert not (out / "samples.txt").exists()  # nothing of the old run survives beside the new one


def test_a_resumed_run_does_not_write_into_another_run(corpus, finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "a")
    shutil.copytree(finished_run, tmp_path / "b")
    with pytest.raises(ValueError, match=r"'.*b' already holds a run"):
        train(run_config(corpus, tmp_path / "b", max_steps=8), resume=tmp_path / "a")
    assert load_train_state(tmp_path / "b" / "last")["step"] == 6


def test_out_dir_that_cannot_be_written_fails_before_training(corpus, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setattr(train_module, "_start", lambda *a: pytest.fail("training started"))
    for out in (blocker / "run", blocker):
        with pytest.raises(ValueError, match=r"cannot be written"):
            train(run_config(corpus, out), TransformerConfig(**TINY))
    if os.geteuid() != 0:  # root writes through a read-only mode
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match=r"cannot be written"):
            train(run_config(corpus, locked / "run"), TransformerConfig(**TINY))


def test_killed_saves_leave_nothing_behind_at_the_next_save(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    dead = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    shutil.copytree(out / "last", out / f".last.tmp-{dead.pid}")  # a killed save's temporary
    shutil.copytree(out / "best", out / ".best.old")  # a kill after the second rename
    removed = train_io.remove_leftovers(out)
    assert sorted(p.name for p in removed) == [".best.old", f".last.tmp-{dead.pid}"]
    assert sorted(p.name for p in out.iterdir()) == ["best", "last", "loss.png", "samples.txt"]


def test_a_run_killed_before_its_first_last_resumes_from_best(corpus, finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    shutil.rmtree(out / "last")  # the first eval writes best/, then last/: a kill fell between them
    assert find_checkpoint(out) == out / "best"
    assert train(run_config(corpus, out, max_steps=7), resume=out).step == 7


def test_best_is_found_in_the_rename_window(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    os.replace(out / "best", out / ".best.old")  # a kill between the two renames of a save
    assert cli(["sample", "--checkpoint", str(out / "best"), "--prompt", "the", "--max-new-tokens", "3"])[0] == 0
    assert TransformerLM.from_pretrained(out / "best").config.d_model == 32


def test_a_run_directory_means_its_best_checkpoint_and_says_so(corpus, finished_run, tmp_path, capsys):
    """`sample`, `serve` and from_pretrained take the run directory `train` printed (RUN = RUN/best,
    one stderr line says which); --resume still continues from RUN/last."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "last" / "model.safetensors").write_bytes(b"")  # loading last/ would fail loudly
    args = ["--prompt", "the", "--max-new-tokens", "5", "--temperature", "0"]
    code, err = cli(["sample", "--checkpoint", str(out), *args])
    assert code == 0 and f"loading its best checkpoint {out / 'best'}" in err
    with contextlib.redirect_stdout(io.StringIO()) as via_best:
        assert main(["sample", "--checkpoint", str(out / "best"), *args]) == 0
    with contextlib.redirect_stdout(io.StringIO()) as via_run:
        main(["sample", "--checkpoint", str(out), *args])
    assert via_run.getvalue() == via_best.getvalue()  # the same model, the same greedy text
    capsys.readouterr()
    model = TransformerLM.from_pretrained(out)
    assert f"loading its best checkpoint {out / 'best'}" in capsys.readouterr().err
    torch.testing.assert_close(model.state_dict(), TransformerLM.from_pretrained(out / "best").state_dict())
    from mini_transformer.server import build_context

    assert build_context(out).model_name == "best"  # the model id the README's examples send
    os.replace(out / "best", out / ".best.old")  # a kill between the two renames of a save
    assert resolve_checkpoint_dir(out) == out / ".best.old"
    os.replace(out / ".best.old", out / "best")
    (out / "last" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="last"):
        find_checkpoint(out)  # resume looks at last/ first: a damaged last/ is named, never skipped
    shutil.rmtree(out / "best")
    with pytest.raises(ValueError, match=r"has no config.json.*run directory holding best/"):
        TransformerLM.from_pretrained(out)  # no best/: the error names what was expected


def test_resume_after_the_last_checkpoint_writes_the_end_of_run_files(corpus, finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "loss.png").unlink()  # killed after its final checkpoint
    (out / "samples.txt").unlink()
    result = train(run_config(corpus, out, num_samples=1), resume=out)
    assert result.step == 6 and (out / "loss.png").is_file() and (out / "samples.txt").is_file()
    with pytest.raises(ValueError, match="step 6.*leaves nothing to train"):
        train(run_config(corpus, out, num_samples=1), resume=out)


def test_resume_refuses_another_tokenizer_or_preset(finished_run, capsys):
    code, err = cli(["train", "--resume", str(finished_run), "--max-steps", "8", "--tokenizer", "bpe"])
    assert code == 2 and "tokenizer='bpe'" in err and "'char'" in err
    code, err = cli(["train", "--resume", str(finished_run), "--max-steps", "8", "--preset", "tiny"])
    assert code == 2 and "--preset cannot be combined with --resume" in err


# ---------------------------------------------------------------------------- damaged files, one by one
def damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "removed":
        path.unlink()
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":  # same size: only the sha256 can tell
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :])
    elif how == "not JSON":
        path.write_bytes(b"{\xff not json")


FILES = ["model.safetensors", "config.json", "vocab.json", TRAIN_STATE_FILE, "train_config.json", "manifest.json"]


@pytest.mark.parametrize("how", ["removed", "emptied", "truncated", "flipped", "not JSON"])
@pytest.mark.parametrize("file", FILES)
def test_every_damaged_file_is_named_by_sample_and_resume(finished_run, tmp_path, file, how):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    damage(out / "last" / file, how)
    for argv in (["sample", "--checkpoint", str(out / "last"), "--prompt", "the", "--max-new-tokens", "2"],
                 ["train", "--resume", str(out), "--max-steps", "8"]):
        code, err = cli(argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{file}" in err and "Traceback" not in err
        assert f"{out / 'best'} passes its checks" in err  # points at the sound checkpoint
    with pytest.raises(ValueError, match=file.replace(".", r"\.")):
        TransformerLM.from_pretrained(out / "last")


def test_nan_weights_are_refused(finished_run, tmp_path):
    model = TransformerLM.from_pretrained(finished_run / "best")
    with torch.no_grad():
        model.blocks[1].ffn.fc2.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path)  # a sound manifest over NaN weights
    with pytest.raises(CheckpointError, match=r"'blocks\.1\.ffn\.fc2\.weight' holds NaN or inf"):
        TransformerLM.from_pretrained(tmp_path)


def test_a_truncated_training_state_is_named(finished_run, tmp_path):
    shutil.copytree(finished_run / "last", tmp_path / "last")
    (tmp_path / "last" / TRAIN_STATE_FILE).write_bytes(b"PK\x03\x04")
    with pytest.raises(CheckpointError, match=TRAIN_STATE_FILE):
        load_train_state(tmp_path / "last")


# --------------------------------------------------------------------------- the fault-injection test
SAVE_CODE = {checkpoint.__file__, train_io.__file__}
KILL_STEP = 4  # the saves at this step replace the checkpoints of step 2


class LineKiller:
    """A sys.settrace hook that SIGKILLs its process when the `kill_at`-th distinct line of checkpoint.py
    or train_io.py is about to run (the first time it runs: a loop's later turns are not new points),
    after tearing the newest file of a temporary checkpoint in half when `torn` (a write the kill cut short)."""

    def __init__(self, out, kill_at: int, torn: bool):
        self.out, self.kill_at, self.torn, self.seen = out, kill_at, torn, set()

    def __call__(self, frame, event, arg):
        return self.local if frame.f_code.co_filename in SAVE_CODE else None

    def local(self, frame, event, arg):
        line = (frame.f_code.co_filename, frame.f_lineno)
        if event == "line" and line not in self.seen:
            if len(self.seen) == self.kill_at:
                newest = max((p for p in self.out.glob(".*.tmp-*/*") if p.is_file()), default=None,
                             key=lambda p: p.stat().st_mtime_ns)
                if self.torn and newest is not None:
                    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            self.seen.add(line)
        return self.local


def killed_saves(save, out, cases) -> None:
    """Run `save()` in forked children killed at its line 0, 1, 2, ... until one finishes. Each child
    starts from the same directory; what it leaves is moved to a new folder appended to `cases`."""
    snapshot = out.with_name(f"{out.name}-before-{len(cases)}")
    shutil.copytree(out, snapshot)

    def child(kill_at):
        try:
            sys.settrace(LineKiller(out, kill_at, torn=kill_at % 2 == 1))
            save()
            sys.settrace(None)
            os._exit(0)  # the save finished before line `kill_at`
        finally:
            os._exit(3)

    for kill_at in range(1000):
        process = multiprocessing.get_context("fork").Process(target=child, args=(kill_at,))
        process.start()
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
            process.join()  # without it exitcode may still read None: SIGKILL is not instant
        assert process.exitcode in (-signal.SIGKILL, 0), f"kill point {kill_at}: exit code {process.exitcode}"
        if process.exitcode == 0:
            break
        cases.append(out.with_name(f"case-{len(cases)}"))
        os.replace(out, cases[-1])
        shutil.copytree(snapshot, out)
    shutil.rmtree(out)
    os.replace(snapshot, out)


def fingerprint(run_dir) -> tuple:
    """What a resume reads: the checkpoints a loader can find (temporaries are deleted unread)."""
    return tuple(sorted((str(p.relative_to(run_dir)), p.read_bytes()) for p in run_dir.rglob("*")
                        if p.is_file() and ".tmp-" not in str(p)))


def test_kill_at_every_line_of_a_save_then_resume_is_bit_identical(corpus, tmp_path, monkeypatch):
    """SIGKILL a training process at each line that the saves of step 4 run (every other time with the
    file being written torn in half); then every checkpoint a loader finds is whole, verified and of
    step 2 or 4, and resuming ends exactly where the uninterrupted run ends."""
    real_save, saved, cases = train_module.save_checkpoint, {}, []

    def save(path, model, tokenizer, state):
        saved[state["step"]] = {k: v.clone() for k, v in model.state_dict().items()}
        if state["step"] == KILL_STEP:
            killed_saves(lambda: real_save(path, model, tokenizer, state), path.parent, cases)
        real_save(path, model, tokenizer, state)

    monkeypatch.setattr(train_module, "save_checkpoint", save)
    monkeypatch.setattr(train_module, "finish_run", lambda *args: None)  # the plot is not under test
    model_cfg = TransformerConfig(**TINY, resid_pdrop=0.1)  # dropout: the RNG states must resume too
    reference = train(run_config(corpus, tmp_path / "run"), model_cfg)
    monkeypatch.setattr(train_module, "save_checkpoint", real_save)
    assert len(cases) > 40  # both saves of step 4 (best, last) were cut at every line
    resumed_states = {}
    for case in cases:
        for name in ("best", "last"):  # what loaders find is a whole checkpoint of step 2 or 4
            found = find_checkpoint(case / name)
            step = load_train_state(found)["step"]
            model = TransformerLM.from_pretrained(found)
            assert step in (2, 4) and all(torch.equal(v, saved[step][k]) for k, v in model.state_dict().items())
        for partial in case.glob(".*.tmp-*"):  # a temporary is either complete or refused
            with contextlib.suppress(CheckpointError):
                checkpoint.verify_manifest(partial)
                assert load_train_state(partial)["step"] == KILL_STEP
        state = fingerprint(case)
        if state in resumed_states:  # the same files as a case already resumed: the same result
            continue
        resumed = train(run_config(corpus, case), resume=case)
        resumed_states[state] = case.name
        assert resumed.losses == reference.losses, case.name
        assert all(torch.equal(v, reference.model.state_dict()[k]) for k, v in resumed.model.state_dict().items())
        assert sorted(p.name for p in case.iterdir()) == ["best", "last"], case.name  # leftovers removed
    assert len(resumed_states) >= 3  # before the renames, between them, after them


def two_step_run(data: str, out) -> list[str]:
    """`train` on `data` (as given, relative or not) for 2 tiny steps into `out`."""
    return ["train", "--data", data, "--preset", "tiny", "--set", "max_seq_len=16", "--set", "progress=false",
            "--set", "num_samples=0", "--set", "eval_batches=1", "--max-steps", "2", "--eval-interval", "2",
            "--warmup-steps", "1", "--batch-size", "2", "--out", str(out)]


def test_resume_from_another_working_directory_finds_a_relative_data_path(corpus, tmp_path, monkeypatch):
    """The first run is given --data as a path relative to its working directory; `train --resume` from
    another directory still reads the same text (the run keeps the file's absolute path)."""
    monkeypatch.chdir(corpus.parent)
    out = tmp_path / "run"
    assert cli(two_step_run(corpus.name, out))[0] == 0
    assert load_train_state(out / "last")["data_name"] == str(corpus.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, err = cli(["train", "--resume", str(out), "--max-steps", "4"])
    assert code == 0, err
    assert load_train_state(out / "last")["step"] == 4


def test_a_tokenizer_of_another_size_is_refused_at_load_naming_both(finished_run, tmp_path):
    """A checkpoint whose tokenizer has more characters than the model's vocabulary (swapped by hand and
    the manifest rewritten, as its error message tells): sample refuses it before generating, naming both sizes
    (it used to fail on the first id past the vocabulary)."""
    from mini_transformer.tokenizer import CharTokenizer, load_tokenizer

    broken = tmp_path / "broken"
    shutil.copytree(finished_run / "best", broken)
    chars = load_tokenizer(broken).chars
    for name in ("vocab.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink(missing_ok=True)
    CharTokenizer(chars + ["\u2603"]).save(broken)
    checkpoint.write_manifest(broken)
    vocab = TransformerLM.from_pretrained(broken).config.vocab_size
    code, err = cli(["sample", "--checkpoint", str(broken), "--prompt", chars[1], "--max-new-tokens", "2"])
    assert code != 0 and f"{vocab + 1} tokens" in err and f"vocab_size is {vocab}" in err, err


# --------------------------------------------------------------------------------- resume knows its data
def edited_copy(corpus, path):
    path.write_text(corpus.read_text().replace("king", "hear"))  # the same characters: the tokenizer fits
    return path


def test_a_run_records_the_sha256_of_its_data(corpus, finished_run):
    import hashlib

    want = hashlib.sha256(corpus.read_text().encode("utf-8")).hexdigest()
    assert load_train_state(finished_run / "last")["data_sha256"] == want


def test_resume_refuses_data_edited_in_place_naming_both_hashes(corpus, finished_run, tmp_path):
    """The data file changed under the run: --resume stops with one line naming both hashes and the flag
    that overrides; with the flag the run continues on the new text (a warning) and records its hash."""
    import hashlib

    data = edited_copy(corpus, tmp_path / "corpus.txt")
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    state = load_train_state(out / "last")
    new = hashlib.sha256(data.read_text().encode("utf-8")).hexdigest()
    with pytest.raises(ValueError, match=rf"sha256 {new}.*sha256 {state['data_sha256']}.*--allow-data-change"):
        train(run_config(data, out, max_steps=8), resume=out)
    code, err = cli(["train", "--resume", str(out), "--max-steps", "8", "--data", str(data)])
    assert code == 2 and "--allow-data-change" in err and len(err.strip().splitlines()) == 1
    code, err = cli(["train", "--resume", str(out), "--max-steps", "8", "--data", str(data), "--allow-data-change"])
    assert code == 0 and "warning: the training data" in err
    assert load_train_state(out / "last")["data_sha256"] == new
    assert load_train_state(out / "last")["data_name"] == str(data.resolve())


def test_an_explicit_data_on_resume_is_honoured_from_another_directory(corpus, tmp_path, monkeypatch):
    """--data corpus.txt names another file from the second working directory: that file is read (and,
    being different, refused), not the first run's file of the same relative name."""
    monkeypatch.chdir(corpus.parent)
    out = tmp_path / "run"
    assert cli(two_step_run(corpus.name, out))[0] == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    edited_copy(corpus, elsewhere / corpus.name)
    monkeypatch.chdir(elsewhere)
    code, err = cli(["train", "--resume", str(out), "--max-steps", "4", "--data", corpus.name])
    assert code == 2 and str((elsewhere / corpus.name).resolve()) in err and "--allow-data-change" in err
    assert cli(["train", "--max-steps", "4", "--allow-data-change", "--out", str(tmp_path / "x")])[0] == 2


def test_a_save_fsyncs_every_file_then_the_parent_after_the_rename(corpus, finished_run, tmp_path, monkeypatch):
    synced = []

    def fsync_path(path):
        synced.append((path, path.is_dir(), (tmp_path / "ckpt").is_dir()))

    monkeypatch.setattr(train_io, "fsync_path", fsync_path)
    model, tokenizer = TransformerLM.from_pretrained(finished_run / "last"), None
    from mini_transformer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(finished_run / "last")
    train_io.save_checkpoint(tmp_path / "ckpt", model, tokenizer, load_train_state(finished_run / "last"))
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert sorted(p.name for p, is_dir, _ in synced if not is_dir) == files  # every file, before the rename
    assert all(not renamed for _, _, renamed in synced[:-1])
    assert synced[-1] == (tmp_path, True, True)  # last: the parent directory, after the rename
