"""The content-addressed artifact store for adapters: ``$MACARON_HOME/adapters/<sha256>/``,
and the one way a release's adapters reach an engine (``load_release``).

An adapter's address is the sha256 over its files (names and contents), so a folder whose bytes
changed no longer matches its address: ``verified_path`` refuses it before an engine loads it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

from core.engine import Engine
from core.errors import AdapterInvalid, AdapterNotFound
from core.release import Release

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def folder_digest(folder: Path) -> str:
    """sha256 over the adapter files' names and contents, in a fixed order."""
    outer = hashlib.sha256()
    for name in ADAPTER_FILES:
        inner = hashlib.sha256()
        try:
            with (folder / name).open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    inner.update(block)
        except OSError as exc:
            raise AdapterInvalid(f"{folder}: cannot read {name} ({exc})") from exc
        outer.update(f"{name}\0{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, folder: Path) -> tuple[str, Path]:
        """Copy an adapter folder into the store; returns its digest and stored path.
        Storing the same content twice is a no-op."""
        digest = folder_digest(folder)
        target = self.root / digest
        if target.exists():
            return digest, target
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
        for name in ADAPTER_FILES:
            shutil.copyfile(folder / name, staging / name)
        try:
            os.rename(staging, target)  # atomic: a reader sees all of it or nothing
        except OSError:
            shutil.rmtree(staging)  # another writer stored the same content first
        return digest, target

    def remove(self, sha256: str) -> bool:
        """Delete the stored folder for ``sha256`` (renamed out of its address first, so no
        reader finds half of it); ``False`` when it was not there."""
        target = self.root / sha256
        if not target.is_dir():
            return False
        leaving = Path(tempfile.mkdtemp(prefix=".erasing-", dir=self.root))
        os.rename(target, leaving / sha256)
        shutil.rmtree(leaving)
        return True

    def sweep(self) -> int:
        """Delete what a ``remove`` killed half-way left (its ``.erasing-`` folders); returns
        how many."""
        leftovers = list(self.root.glob(".erasing-*")) if self.root.is_dir() else []
        for leftover in leftovers:
            shutil.rmtree(leftover)
        return len(leftovers)

    def verified_path(self, sha256: str, path: str) -> Path:
        """The stored folder for ``sha256``, after checking it lies in the store and that its
        content still hashes to its address."""
        folder = Path(path).resolve()
        if folder.parent != self.root.resolve() or folder.name != sha256:
            raise AdapterInvalid(f"adapter path {path} is not {sha256} in the artifact store")
        if not folder.is_dir():
            raise AdapterNotFound(f"adapter {sha256} is missing from the artifact store")
        actual = folder_digest(folder)
        if actual != sha256:
            raise AdapterInvalid(f"adapter {sha256} is corrupted: its content hashes to {actual}")
        return folder


def load_release(
    engine: Engine,
    store: ArtifactStore,
    release: Release,
    specialists: Collection[str] | None = None,
) -> list[str]:
    """Ask ``engine`` for the adapter of each specialist of ``release`` (of ``specialists``
    when given), each checked against its content address first; returns the names the engine
    lacked, which it loaded. Asking for an adapter an engine holds changes nothing there (a
    versioned name is immutable) and pins it in a shared engine's background view."""
    present = set(engine.loaded_adapters())
    loaded = []
    for specialist, ref in release.adapters.items():
        if specialists is not None and specialist not in specialists:
            continue
        engine.load_adapter(ref.name, str(store.verified_path(ref.sha256, ref.path)))
        if ref.name not in present:
            loaded.append(ref.name)
    return loaded
