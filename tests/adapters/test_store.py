"""The content-addressed adapter store: put validates, names by digest, and is idempotent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loramux.adapters.errors import AdapterError
from loramux.adapters.store import AdapterStore
from tests.adapters.peft_adapters import make_peft_adapter, tiny_base


def test_put_stores_the_validated_files_under_their_digest(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store", tiny_base())
    source = make_peft_adapter(
        tmp_path / "a", r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"]
    )
    stored = store.put(source)
    assert stored.path == tmp_path / "store" / stored.digest
    assert sorted(p.name for p in stored.path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "metadata.json",
    ]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (stored.path / name).read_bytes() == (source / name).read_bytes()
    metadata = json.loads((stored.path / "metadata.json").read_text())
    assert metadata["digest"] == stored.digest
    assert (metadata["rank"], metadata["scaling"], metadata["targets"]) == (8, 2.0, ["q", "down"])
    assert stored.metadata.num_modules == 4
    assert store.load(stored.digest).digest == stored.digest


def test_put_is_idempotent_and_lookups_agree(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store", tiny_base())
    first = store.put(make_peft_adapter(tmp_path / "a", seed=1))
    again = store.put(make_peft_adapter(tmp_path / "b", seed=1))
    other = store.put(make_peft_adapter(tmp_path / "c", seed=2))
    assert again == first and other.digest != first.digest
    assert store.digests() == sorted([first.digest, other.digest])
    assert first.digest in store and "0" * 64 not in store and "nope" not in store
    assert store.get(first.digest) == first
    assert store.get("0" * 64) is None


def test_refused_adapters_leave_nothing_behind(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store", tiny_base())
    biased = make_peft_adapter(tmp_path / "bias", bias="all")
    pickled = make_peft_adapter(tmp_path / "bin", safe_serialization=False)
    for folder, code in ((biased, "bias_unsupported"), (pickled, "pickled_weights")):
        with pytest.raises(AdapterError) as raised:
            store.put(folder)
        assert raised.value.code == code
    assert store.digests() == []
    assert not any((tmp_path / "store" / ".incoming").iterdir())


def test_delete_removes_the_folder_once(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store", tiny_base())
    digest = store.put(make_peft_adapter(tmp_path / "a")).digest
    assert store.delete(digest) is True
    assert store.delete(digest) is False
    assert store.digests() == [] and store.get(digest) is None
    with pytest.raises(KeyError):
        store.load(digest)


@pytest.mark.parametrize("digest", ["../etc", "A" * 64, "0" * 63, ""])
def test_digests_are_checked_before_touching_paths(tmp_path: Path, digest: str) -> None:
    store = AdapterStore(tmp_path / "store", tiny_base())
    with pytest.raises(ValueError, match="digest"):
        store.get(digest)
    with pytest.raises(ValueError, match="digest"):
        store.delete(digest)
