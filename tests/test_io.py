"""Files: atomic writes, clear errors for corrupt or foreign files, safe tensor loads, an isolated test cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from selfspec.core.skipset import SkipSet
from selfspec.errors import InvalidInputError
from selfspec.io import atomic_write, atomic_write_text, check_version, load_tensors, read_json
from selfspec.policies.swift import SwiftPolicy


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_text(path, "old\n")

    def crash(f):
        f.write(b"half of the new con")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="mid-write"):
        atomic_write(path, crash)
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_corrupt_and_foreign_files_name_their_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInputError, match=f"{bad}.*unreadable"):
        read_json(bad, what="thing")
    with pytest.raises(InvalidInputError, match=f"{bad}.*version 3"):
        check_version({"version": 1}, bad, what="thing", version=3)
    with pytest.raises(InvalidInputError, match=str(bad)):
        load_tensors(bad, what="weights")


class Payload:  # any pickled object that is not a tensor or a plain container
    pass


def test_tensor_files_load_without_running_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": Payload()}, path)  # unpickling it would import and build an arbitrary class
    with pytest.raises(InvalidInputError, match="cannot be loaded"):
        load_tensors(path, what="checkpoint")
    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(2), "losses": [1.0], "step": 3}, ok)
    assert load_tensors(ok, what="checkpoint")["step"] == 3


def test_swift_never_overwrites_a_corrupt_state(tmp_path, tiny_llama):
    path = tmp_path / "swift.json"
    path.write_text("{not json")
    policy = SwiftPolicy()
    policy.bind(tiny_llama)  # a fresh state; saving it into a file that went bad (or was never ours)...
    with pytest.raises(InvalidInputError, match=f"SWIFT state {path}"):
        policy.save(path)
    assert path.read_text() == "{not json"  # left for the user to look at


def test_skip_set_save_is_atomic_and_round_trips(tmp_path):
    path = tmp_path / "skip.json"
    s = SkipSet.of([1, 3], [2])
    s.save(path)
    assert SkipSet.parse(str(path)) == s
    assert sorted(p.name for p in tmp_path.iterdir()) == ["skip.json"]


def test_tests_do_not_touch_the_users_cache():
    cache = Path(os.environ["SELFSPEC_CACHE"])
    assert cache != Path.home() / ".cache" / "selfspec"
    assert "selfspec-cache" in cache.name
    assert json.dumps(str(cache))  # a plain path
