"""Shared work is shared (issue 68, item 5): each (member, format) of a model quantized once per
machine (``backends.quantized_store``) and read back by the cells, the whole formats and the
offspring, with the same bytes and the same weights as quantizing again; and libggml's own
dequantizer, which reads them back, against gguf-py's."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="pip install 'quantdask[gguf]'")

from quantdask.backends import get_backend  # noqa: E402
from quantdask.backends.quantized_store import prune, store_for, store_root  # noqa: E402
from quantdask.demo_model import DEMO_MODEL_DIR  # noqa: E402
from quantdask.gguf import searched  # noqa: E402
from quantdask.gguf.source import gguf_module  # noqa: E402
from quantdask.gguf.tensors import TENSOR_TYPES, dequantize_rows, ggml_type, quantize_rows  # noqa: E402
from quantdask.sweepfile.model import ModelSpec  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("name", [t for t in TENSOR_TYPES if t not in ("F32", "F16", "BF16")])
def test_libggml_reads_each_type_back_as_gguf_py_does(name):
    import torch

    weight = torch.randn(24, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    data = quantize_rows(weight, name)
    ours = dequantize_rows(data, name)
    theirs = gguf_module().quants.dequantize(data, ggml_type(name))
    assert ours.shape == (24, 512)
    assert np.array_equal(ours.numpy(), theirs)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The demo model, the GGUF backend, a cache of this test's own, and a count of the
    tensors libggml's quantizer is asked for."""
    from quantdask.process.model_source import load_model_source

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls: list[str] = []
    original = searched.quantize_rows

    def quantize(weight, name):
        calls.append(name)
        return original(weight, name)

    monkeypatch.setattr(searched, "quantize_rows", quantize)
    spec = ModelSpec(path=DEMO_MODEL_DIR)
    return spec, load_model_source(spec).build("cpu"), get_backend("gguf"), calls


def test_a_member_is_quantized_once_and_read_back_the_same(counted):
    import torch

    from quantdask.search.probes import linear_units, swapped_weight, weighed_through

    spec, model, gguf, calls = counted
    store = store_for(spec, model, gguf)
    assert store is not None and store.folder.parent == store_root()
    options = gguf.normalize({"type": "Q4_K_M", "tensor_type": "Q4_K"}, "test")
    members = [m for ms in linear_units(model, "linear").values() for m in ms]
    first = [swapped_weight(model, m, gguf, options, store) for m in members]
    assert len(calls) == len(members) == len(list(store.folder.glob("*.safetensors")))
    again = [weighed_through(store)(model, m, gguf, options) for m in members]  # read back
    alone = [swapped_weight(model, m, gguf, options) for m in members]  # no store
    assert len(calls) == 2 * len(members)  # only the store-less ones quantized again
    for (w1, held1, b1), (w2, held2, b2), (w3, _, b3) in zip(first, again, alone, strict=True):
        assert torch.equal(w1, w2) and torch.equal(w1, w3) and b1 == b2 == b3 > 0
        assert held1 is held2 and w1.dtype == held1.dtype and w1.shape == held1.shape
    # another format is another file; a damaged file is quantized again, the same
    other = gguf.normalize({"type": "Q4_K_M", "tensor_type": "Q6_K"}, "test")
    swapped_weight(model, members[0], gguf, other, store)
    assert len(list(store.folder.glob("*.safetensors"))) == len(members) + 1
    damaged = sorted(store.folder.glob("*.safetensors"), key=os.path.getmtime)[0]
    damaged.write_bytes(b"not a safetensors file")
    count = len(calls)
    rebuilt = [weighed_through(store)(model, m, gguf, options)[0] for m in members]
    assert len(calls) == count + 1
    assert all(torch.equal(a, b[0]) for a, b in zip(rebuilt, first, strict=True))


def test_a_whole_format_reads_the_cells_tensors_and_measures_the_same(counted):
    """The whole-format measure (every unit in one format, one forward) after the cells have
    quantized each member: nothing quantized again, the same KL as without the store."""
    from quantdask.demo_model import DEMO_EVAL_TEXT
    from quantdask.measure.reference import compute_reference
    from quantdask.search.probes import Prober, linear_units, weighed_through
    from quantdask.sweepfile.settings import EvalSettings

    spec, model, gguf, calls = counted
    settings = EvalSettings(text=DEMO_EVAL_TEXT, seq_len=32, samples=4, batch_size=4)
    with open(DEMO_EVAL_TEXT) as f:
        reference = compute_reference(spec, settings, f.read())
    prober = Prober(model, reference.windows, reference.distribution, 4, "cpu")
    options = gguf.normalize({"type": "Q4_K_M", "tensor_type": "Q3_K"}, "test")
    units = linear_units(model, "linear")
    store = store_for(spec, model, gguf)
    for unit, modules in units.items():  # the cells, one unit at a time
        prober.probe(unit, modules, "Q3_K", gguf, options, weighed_through(store))
    count = len(calls)
    members = [(m, options) for ms in units.values() for m in ms]
    shared, shared_bytes = prober.whole(members, gguf, weighed_through(store))
    assert len(calls) == count  # every tensor read from the store
    fresh, fresh_bytes = prober.whole(members, gguf)
    assert len(calls) == count + len(members)
    assert shared_bytes == fresh_bytes
    assert shared.scores().kl_divergence == fresh.scores().kl_divergence > 0


def test_a_model_held_in_another_dtype_or_a_backend_keeping_nothing_gets_its_own(counted):
    import torch

    spec, model, gguf, _ = counted
    store = store_for(spec, model, gguf)
    halved = store_for(spec, model.to(torch.bfloat16), gguf)
    assert store.folder != halved.folder
    assert store_for(spec, model, get_backend("hqq")) is None  # HQQ keeps no form


def test_the_folders_opened_longest_ago_go_first_and_the_open_one_never(tmp_path):
    root = tmp_path / "quantized"
    folders = []
    for i, size in enumerate((400, 300, 200, 100)):
        folder = root / f"model-{i}"
        folder.mkdir(parents=True)
        (folder / "a.safetensors").write_bytes(b"x" * size)
        stamp = time.time() - 1000 + 100 * i
        os.utime(folder, (stamp, stamp))
        folders.append(folder)
    assert prune(root, keep=folders[0], limit=600) == [folders[1], folders[2]]
    assert sorted(p.name for p in root.iterdir()) == ["model-0", "model-3"]
    assert prune(root, keep=folders[0], limit=600) == []
