"""_native.py names each C++ build after everything its binary depends on (no build happens here)."""

import torch

from mini_transformer import _native


def test_the_build_name_follows_the_source_and_the_torch_install(monkeypatch):
    name = _native._build_name("mt_x", "int f();")
    assert name == _native._build_name("mt_x", "int f();") and name.startswith("mt_x_")
    assert _native._build_name("mt_x", "int g();") != name
    # a second virtual environment (another torch directory) builds into its own directory: the build's
    # command line names torch's include and lib paths, and ninja would rebuild on every change of them
    monkeypatch.setattr(torch, "__file__", "/elsewhere/.venv/lib/python3.11/site-packages/torch/__init__.py")
    assert _native._build_name("mt_x", "int f();") != name
