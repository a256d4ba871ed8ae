"""The adapter store: validated PEFT adapters on disk, addressed by content digest.

Layout:
    <root>/<digest>/adapter_config.json        the uploaded bytes, unchanged
    <root>/<digest>/adapter_model.safetensors  the uploaded bytes, unchanged
    <root>/<digest>/metadata.json              AdapterMetadata, written by the store
    <root>/.incoming/<random>/                 work folders of puts and deletes in progress
    <root>/.claims/<digest>                    publishes' claims on digests (adapters.claims)

Invariants: a `<digest>` folder appears whole or not at all (built in `.incoming`, then
renamed, which is atomic within one filesystem); its files are what was validated (the
store copies first, then validates the copy, so the source changing meanwhile cannot slip
anything past); its name is the digest of its content; putting the same adapter twice is
a no-op. Names, owners and versions are the gateway's business (SQL), not the store's.
Work folders left in `.incoming` by a crash are harmless; several processes may share one
store, so the store never sweeps them itself.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.claims import DigestClaims
from loramux.adapters.peft_format import (
    WEIGHTS_FILE,
    AdapterLimits,
    LoraAdapter,
    adapter_files,
    load_peft_adapter,
)

METADATA_FILE = "metadata.json"
_INCOMING = ".incoming"
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class AdapterMetadata:
    """What the store records about an adapter, readable without loading its weights."""

    digest: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scaling: float
    targets: tuple[str, ...]
    num_modules: int
    weights_bytes: int

    @classmethod
    def of(cls, adapter: LoraAdapter, weights_bytes: int) -> AdapterMetadata:
        return cls(
            digest=adapter.digest,
            rank=adapter.rank,
            lora_alpha=adapter.alpha,
            use_rslora=adapter.use_rslora,
            scaling=adapter.scaling,
            targets=adapter.targets,
            num_modules=len(adapter.modules),
            weights_bytes=weights_bytes,
        )


@dataclass(frozen=True)
class StoredAdapter:
    """An adapter in the store: its folder (a PEFT adapter folder) and metadata."""

    path: Path
    metadata: AdapterMetadata

    @property
    def digest(self) -> str:
        return self.metadata.digest


class AdapterStore:
    """Content-addressed adapter folders under `root` for one base model."""

    def __init__(self, root: Path, base: BaseModelSpec, limits: AdapterLimits | None = None):
        self.root = Path(root)
        self.base = base
        self.limits = limits or AdapterLimits()
        (self.root / _INCOMING).mkdir(parents=True, exist_ok=True)
        self.claims = DigestClaims(self.root)

    def put(self, folder: Path) -> StoredAdapter:
        """Validate the PEFT adapter in `folder` and store it (AdapterError if refused).

        Returns the stored adapter, which may already have been there.
        """
        with tempfile.TemporaryDirectory(dir=self.root / _INCOMING) as work:
            staged = Path(work) / "adapter"
            staged.mkdir()
            for source in adapter_files(Path(folder), self.limits):
                shutil.copyfile(source, staged / source.name)
            adapter = load_peft_adapter(staged, self.base, self.limits)
            metadata = AdapterMetadata.of(adapter, (staged / WEIGHTS_FILE).stat().st_size)
            (staged / METADATA_FILE).write_text(json.dumps(asdict(metadata), indent=1))
            final = self.root / adapter.digest
            if not final.exists():
                try:
                    staged.rename(final)
                except OSError:
                    if not final.exists():  # not lost to a concurrent put of the same adapter
                        raise
        return self._stored(final)

    def staging_folder(self, prefix: str) -> Path:
        """A new empty folder in this store's staging area, for files that `put` is to take: it
        goes with the store's folder (an engine's own, engine.adapter_folder), and a gateway's
        sweep removes one left there (gateway.adapters.sweep). The caller removes it."""
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.root / _INCOMING))

    def get(self, digest: str) -> StoredAdapter | None:
        """The stored adapter with this digest, or None."""
        path = self.root / _checked(digest)
        return self._stored(path) if path.is_dir() else None

    def load(self, digest: str) -> LoraAdapter:
        """Read and re-validate a stored adapter; KeyError when absent."""
        path = self.root / _checked(digest)
        if not path.is_dir():
            raise KeyError(digest)
        adapter = load_peft_adapter(path, self.base, self.limits)
        assert adapter.digest == digest, f"store folder {path} does not hold its digest"
        return adapter

    def delete(self, digest: str) -> bool:
        """Remove a stored adapter; False when it was not there. Readers never see half a folder."""
        path = self.root / _checked(digest)
        graveyard = Path(tempfile.mkdtemp(dir=self.root / _INCOMING))
        try:
            path.rename(graveyard / "adapter")
        except FileNotFoundError:
            return False
        finally:
            shutil.rmtree(graveyard)
        return True

    def digests(self) -> list[str]:
        """Every stored digest, sorted."""
        return sorted(p.name for p in self.root.iterdir() if _DIGEST.fullmatch(p.name))

    def __contains__(self, digest: object) -> bool:
        return (
            isinstance(digest, str)
            and _DIGEST.fullmatch(digest) is not None
            and ((self.root / digest).is_dir())
        )

    def _stored(self, path: Path) -> StoredAdapter:
        fields = json.loads((path / METADATA_FILE).read_text())
        fields["targets"] = tuple(fields["targets"])
        return StoredAdapter(path=path, metadata=AdapterMetadata(**fields))


def _checked(digest: str) -> str:
    """A digest is 64 lowercase hex digits: it is also a path component, so nothing else passes."""
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"{digest!r} is not an adapter digest")
    return digest
