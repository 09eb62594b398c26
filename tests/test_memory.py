"""What a loaded model keeps in memory beside its weights: the tokenizer's build sources dropped, the heap's
freed pages given back (core/heap.py, arch/tokenizers.py)."""

from __future__ import annotations

import platform

import pytest
from conftest import char_tokenizer
from transformers import AutoTokenizer

from selfspec.arch import tokenizers
from selfspec.core import heap

TEXTS = ["Hello there!", "def f(x):\n    return x ** 2  # square", "naïve café — 東京 🙂", "  leading spaces\t\ttabs"]


@pytest.mark.parametrize(("fixture", "sources"), [("gemma3", True), ("smollm2", False)])
def test_a_loaded_tokenizer_drops_its_build_sources_and_tokenizes_the_same(fixture, sources, request, tmp_path):
    """A loaded model's tokenizer holds no Python copy of its vocabulary or merges (transformers' ``_vocab`` /
    ``_merges`` of Gemma's and Qwen2's tokenizer classes: 30-90 MB on 152k-262k vocabularies; SmolLM2's
    generic class keeps none) and encodes, decodes and applies its chat template exactly as the same tokenizer
    loaded afresh, which keeps them."""
    model = request.getfixturevalue(fixture)
    tok = model.tokenizer
    fresh = AutoTokenizer.from_pretrained(tok.name_or_path)
    kept = len(getattr(fresh, "_vocab", None) or []) + len(getattr(fresh, "_merges", None) or [])
    assert not getattr(tok, "_vocab", None) and not getattr(tok, "_merges", None)
    assert len(tok) == len(fresh) and tok.get_vocab() == fresh.get_vocab()
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == fresh(text).input_ids
        assert tok.decode(ids) == fresh.decode(ids)
    if tok.chat_template:
        chat = [{"role": "user", "content": TEXTS[2]}]
        assert tok.apply_chat_template(chat, tokenize=False) == fresh.apply_chat_template(chat, tokenize=False)
    tok.save_pretrained(tmp_path)  # saved from the Rust tokenizer: a whole tokenizer again
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert [again(t).input_ids for t in TEXTS] == [fresh(t).input_ids for t in TEXTS]
    if sources and kept < 100_000:  # (transformers 5.24 keeps 777k objects for Gemma 3)
        pytest.skip("this transformers keeps no Python copy of the vocabulary: nothing was dropped")


def test_slim_leaves_other_tokenizers_alone():
    """A tokenizer without those attributes (or a slow one, which reads its tables) is returned as it is."""
    tok = char_tokenizer()
    before = tok("abc").input_ids
    assert tokenizers.slim(tok) is tok
    assert tok("abc").input_ids == before


def test_heap_trimmer_trims_once_per_budget(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "return_free_heap", lambda: calls.append(1))
    trim = heap.HeapTrimmer(100)
    for n in (30, 30, 30):
        trim(n)
    assert calls == []
    trim(30)  # 120 >= 100: trimmed, count restarts
    assert calls == [1]
    trim(99)
    assert calls == [1]
    trim(1)
    assert calls == [1, 1]


@pytest.mark.parametrize("error", [None, OSError, AttributeError, TypeError])
def test_return_free_heap_runs_anywhere(error, monkeypatch):
    """glibc's malloc_trim where there is one; nothing where the C library has none (macOS, musl) or the
    process cannot be opened as a library (Windows)."""
    if error is not None:
        def refuse(*args, **kwargs):
            raise error("no malloc_trim here")

        monkeypatch.setattr(heap.ctypes, "CDLL", refuse)
    heap._malloc_trim.cache_clear()
    try:
        glibc = error is None and platform.libc_ver()[0] == "glibc"
        assert (heap._malloc_trim() is not None) == glibc
        heap.return_free_heap()
    finally:
        monkeypatch.undo()
        heap._malloc_trim.cache_clear()


def test_a_load_freezes_what_it_made_and_a_dropped_model_is_still_freed():
    """models.load pauses the cyclic collector and freezes the objects alive at its end (later passes skip them);
    the collector is back on after it, and a model dropped later is freed all the same (its objects hold no
    cycles that only the collector, which skips frozen objects, could break)."""
    import gc
    import weakref

    from selfspec.model.models import load

    model = load("smollm2-135m")
    assert gc.isenabled() and gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}  # frozen objects are in no generation
    assert id(model.hf) not in tracked and id(model.engine) not in tracked
    engine, hf = weakref.ref(model.engine), weakref.ref(model.hf)
    del model
    gc.collect()
    assert engine() is None and hf() is None


def _weights_digest(model) -> str:
    """A digest of every quantised weight a model holds (row forms and interleaved copies, module by module)."""
    import hashlib

    import torch

    from selfspec.core.quant import QuantWeight

    digest = hashlib.sha256()
    for name, module in model.hf.named_modules():
        for attr in ("qweight", "weight"):
            w = getattr(module, attr, None)
            if isinstance(w, QuantWeight):
                for t in [*(w.__dict__.get("_x16") or ()), w._codes, w._scale, w._minv]:
                    if t is not None:
                        digest.update(name.encode())
                        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_tensors_repacked_on_several_loader_threads_are_the_weights_one_thread_makes(name, monkeypatch):
    """The loader repacks a file's tensors on a few threads at once (arch/gguf.py); every weight comes out as the
    one thread's load makes it, rows permuted where the architecture reorders them (SmolLM2's q and k)."""
    from selfspec.arch import gguf
    from selfspec.model.models import load

    digests = []
    for threads in (1, 3):
        monkeypatch.setattr(gguf, "loader_threads", lambda n=threads: n)
        digests.append(_weights_digest(load(name)))
    assert digests[0] == digests[1]
