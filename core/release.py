"""Releases: immutable model-harness pairs, and the adapter versions they serve."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from core.canonical import canonical_json, sha256_hex


class AdapterRef(BaseModel):
    """One immutable adapter version: where its content-addressed weights are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    adapter_version_id: int
    specialist: str
    version: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    path: str
    rank: int = Field(ge=1)

    @property
    def name(self) -> str:
        """The versioned name engines serve it under (``coding@7``); never reused."""
        return f"{self.specialist}@{self.version}"


class Release(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    parent_release_id: str | None
    base_model: str
    router_version: str
    harness_version: str
    hcp_version: str
    adapters: dict[str, AdapterRef]

    def adapter_for(self, specialist: str) -> AdapterRef | None:
        return self.adapters.get(specialist)

    def successor(self, specialist: str, adapter: AdapterRef) -> Release:
        """This release with ``specialist`` served by ``adapter``: the child it would promote."""
        adapters = {**self.adapters, specialist: adapter}
        release_id = release_id_for(
            self.release_id,
            self.base_model,
            self.router_version,
            self.harness_version,
            self.hcp_version,
            {name: ref.sha256 for name, ref in adapters.items()},
        )
        return self.model_copy(
            update={
                "release_id": release_id,
                "parent_release_id": self.release_id,
                "adapters": adapters,
            }
        )


def release_id_for(
    parent_release_id: str | None,
    base_model: str,
    router_version: str,
    harness_version: str,
    hcp_version: str,
    adapter_shas: dict[str, str],
) -> str:
    """A release id that is a digest of what the release is: the same pair, the same id."""
    content = {
        "parent": parent_release_id,
        "base_model": base_model,
        "router": router_version,
        "harness": harness_version,
        "hcp": hcp_version,
        "adapters": adapter_shas,
    }
    return "rel-" + sha256_hex(canonical_json(content))[:16]
