"""The promotion listener: the serving process carries out promotions and rollbacks, because
it owns the engine.

For a pending request it loads the release's harness from the registry (checked against its
address, and its tools, GenUI catalogue and HCP version against what this server serves) and
the release's adapters (each checked against its content address), sends a canary request
through every adapter that is new, and flips the active release in one transaction with the
promotion record; then it swaps the release, its harness and its router version (loaded from
the registry, checked against its content hash) in one step, and appends ``ReleasePromoted``
(or ``ReleaseRolledBack``; a log that is away gets it at a later poll, under the same id).
Turns in flight finish on the release and harness they began with, and the chat service
unloads the adapters no longer served when the last of those turns ends. The adapters the
flip replaced that learned from a forgotten tenant then leave the artifact store, and a
release naming one is refused (``server.erasure``). Any failure
before the flip unloads what was loaded, keeps the old release active and records why. A
server that sees another replica's flip follows it.
"""

from __future__ import annotations

import asyncio
import logging

import psycopg

from core.engine import GenerationRequest, SamplingParams
from core.errors import MacaronError, PromotionFailed
from core.events import NewEvent, PromotionRejected, ReleasePromoted, ReleaseRolledBack
from core.events.tenants import SYSTEM_TENANT
from core.harness.artifact import HarnessVersion
from core.ids import derived_id
from core.log import EventLog
from core.registry import Promotion, PromotionRequest
from core.release import Release, ServedRelease, rebased
from core.routing import RouterModel
from infra import observe
from infra.artifacts import ArtifactStore, load_release
from infra.postgres.db import DictConnection, Pool
from infra.postgres.promotions import (
    RequestClaim,
    fail_request,
    finish_request,
    record_promotion,
)
from infra.postgres.registry import (
    activate_release,
    active_release,
    file_rebased_release,
    harness_by_name,
    release_by_id,
)
from infra.postgres.routers import router_model
from server.chat import ChatService
from server.erasure import check_not_erased, erase_replaced, remove_erased
from server.releases import RELEASES_KEY, prepare_harness

log = logging.getLogger(__name__)
POLL_S = 0.5
CANARY_TIMEOUT_S = 120.0


class PromotionListener:
    def __init__(self, chat: ChatService, pool: Pool, store: ArtifactStore, log: EventLog) -> None:
        self.chat = chat
        self.pool = pool
        self.store = store
        self.log = log
        self._files_left = True  # a start looks once for what a removal cut short left
        self._unannounced: list[NewEvent] = []
        """Flips done whose event the log has not taken yet (it was away)."""

    async def run(self) -> None:
        """Poll for requests and for flips made elsewhere, until cancelled."""
        while True:
            try:
                await self.step()
            except MacaronError as exc:  # the database is away, say: keep serving, retry
                log.warning("promotion listener: %s (%s)", exc.message, exc.code)
            await asyncio.sleep(POLL_S)

    async def step(self) -> None:
        """Follow a flip made elsewhere; then carry out the pending request, unless another
        server sharing the registry is carrying one out."""
        claim = RequestClaim(self.pool)
        request = await asyncio.to_thread(claim.acquire)
        try:
            active, harness, router = await asyncio.to_thread(self._active)
            if active.release_id != self.chat.release.release_id:
                await asyncio.to_thread(load_release, self.chat.engine, self.store, active)
                self.chat.serve(ServedRelease(release=active, harness=harness), router)
            if self._unannounced:
                await asyncio.to_thread(self._announce)
            if request is not None:
                await self._carry_out(request)
            if self._files_left:
                await asyncio.to_thread(self._remove_erased)
        finally:
            await asyncio.to_thread(claim.release)

    def _active(self) -> tuple[Release, HarnessVersion, RouterModel | None]:
        with self.pool.connection() as conn:
            release = active_release(conn)
            harness = harness_by_name(conn, release.harness_version)
            return release, harness, self._router_of(conn, release)

    def _router_of(self, conn: DictConnection, release: Release) -> RouterModel | None:
        """The classifier ``release`` names, when it is not the one that routes now (nor the
        one the serving release names: a release from before router versions were stored names
        one the registry may lack, and its children inherit it)."""
        if release.router_version in (self.chat.router.version, self.chat.release.router_version):
            return None
        return router_model(conn, release.router_version)

    def _rebased(self, conn: DictConnection, release: Release, active: Release) -> Release:
        """``release``, judged against a release promoted over since, as a child of ``active``
        when its change and the one promoted since are independent (``core.release.rebased``;
        recorded by the flip, with the run that judged it); else it must be judged again."""
        judged_against = (
            None
            if release.parent_release_id is None
            else release_by_id(conn, release.parent_release_id)
        )
        child = None if judged_against is None else rebased(release, judged_against, active)
        if child is None:
            raise PromotionFailed(
                f"{release.release_id} was evaluated against {release.parent_release_id}, "
                f"but {active.release_id} is active now and changed what it changes: it must "
                "be evaluated again"
            )
        return child

    async def _carry_out(self, request: PromotionRequest) -> None:
        with observe.tracer.start_as_current_span(
            "promotion.apply",
            attributes={
                "macaron.kind": request.kind,
                "macaron.release_id": request.release_id,
                "macaron.run_id": str(request.run_id or ""),
            },
        ) as span:
            outcome = await self._attempt(request)
            span.set_attribute("macaron.outcome", outcome)
        observe.promotions.add(1, {"kind": request.kind, "outcome": outcome})
        observe.adapters_loaded.set(len(self.chat.engine.loaded_adapters()))

    async def _attempt(self, request: PromotionRequest) -> str:
        """Carry the request out; returns ``done`` or ``refused``."""
        old = self.chat.release
        try:
            with self.pool.connection() as conn:
                release = release_by_id(conn, request.release_id)
                if request.kind == "promote" and release.parent_release_id != old.release_id:
                    release = self._rebased(conn, release, old)
                check_not_erased(conn, release)
                harness = harness_by_name(conn, release.harness_version)
                router = self._router_of(conn, release)
            await asyncio.to_thread(prepare_harness, self.chat.engine, harness)
            loaded = await asyncio.to_thread(load_release, self.chat.engine, self.store, release)
        except MacaronError as exc:
            await asyncio.to_thread(self._refuse, request, old, exc.message)
            return "refused"
        try:
            await self._canary(release, loaded)
            event = await asyncio.to_thread(self._flip, request, old, release)
        except MacaronError as exc:
            for name in loaded:
                self.chat.engine.unload_adapter(name)
            await asyncio.to_thread(self._refuse, request, old, exc.message)
            return "refused"
        # The swap first: whoever saw the request done finds it served a moment later.
        self.chat.serve(ServedRelease(release=release, harness=harness), router)
        self._unannounced.append(event)
        await asyncio.to_thread(self._announce)
        await asyncio.to_thread(self._erase_replaced)
        return "done"

    def _announce(self) -> None:
        """Append the events of done flips, oldest first; a log that is away keeps the rest
        for the next poll (each event's id derives from its request: a repeat is a no-op)."""
        while self._unannounced:
            try:
                self.log.append(self._unannounced[:1])
            except MacaronError as exc:
                log.warning("the log did not take a promotion's event, tried again: %s", exc)
                return
            self._unannounced.pop(0)

    def _erase_replaced(self) -> None:
        """The adapters that learned from a forgotten tenant and that the flip replaced are
        said to be erased, and their folders leave the store as soon as nothing here or in
        the fleet may read them (``server.unlearning``; the poll removes the rest). A failure
        leaves them for the next promotion and fails nothing."""
        try:
            with self.pool.connection() as conn:
                erased = erase_replaced(conn, self.log)
        except (MacaronError, OSError, psycopg.Error) as exc:
            log.warning("erasing replaced adapters failed, left for the next promotion: %s", exc)
            return
        if erased:
            log.info("erased the weights of %s: they learned from a forgotten tenant", erased)
        self._files_left = True

    def _remove_erased(self) -> None:
        """Take out the erased adapters' folders that nothing may read any more."""
        try:
            with self.pool.connection() as conn:
                busy = self.chat.engine.loaded_adapters()
                self._files_left = remove_erased(conn, self.store, busy) > 0
        except (MacaronError, OSError, psycopg.Error) as exc:
            log.warning("removing erased adapters' files failed, tried again: %s", exc)

    async def _canary(self, release: Release, adapters: list[str]) -> None:
        """One short generation through each new adapter must succeed."""
        for name in adapters:
            prompt = self.chat.engine.chat_prompt([{"role": "user", "content": "Say hello."}])
            request = GenerationRequest(
                request_id=f"canary-{name}",
                prompt=prompt,
                adapter=name,
                params=SamplingParams(max_tokens=4),
            )
            try:
                async with asyncio.timeout(CANARY_TIMEOUT_S):
                    tokens = [c async for c in self.chat.engine.generate(request)]
            except TimeoutError:
                raise PromotionFailed(f"canary request on {name} timed out") from None
            except MacaronError as exc:
                raise PromotionFailed(f"canary request on {name} failed: {exc.message}") from exc
            if not tokens or tokens[-1].finish_reason is None:
                raise PromotionFailed(f"canary request on {name} returned no answer")

    def _flip(self, request: PromotionRequest, old: Release, release: Release) -> NewEvent:
        """Flip the registry in one transaction; returns the event that tells the log."""
        rollback = request.kind == "rollback"
        reason = f"requested by {request.requested_by}"
        rebase = None
        if release.release_id != request.release_id:
            rebase = f"rebased onto {old.release_id} as {release.release_id}"
            reason += f"; {request.release_id} {rebase}"
        with self.pool.connection() as conn, conn.transaction():
            if rebase is not None:
                file_rebased_release(conn, release, request.release_id)
            activate_release(conn, release.release_id, request.requested_by)
            record_promotion(
                conn,
                Promotion(
                    promotion_id=request.request_id,
                    kind="rolled_back" if rollback else "promoted",
                    from_release_id=old.release_id,
                    to_release_id=release.release_id,
                    run_id=request.run_id,
                    reason=reason,
                ),
            )
            finish_request(conn, request.request_id, note=rebase)
        payload = (
            ReleaseRolledBack(
                from_release_id=old.release_id,
                to_release_id=release.release_id,
                reason=reason,
            )
            if rollback
            else ReleasePromoted(
                release_id=release.release_id,
                parent_release_id=old.release_id,
                run_id=request.run_id,
            )
        )
        return NewEvent(
            payload=payload,
            tenant_id=SYSTEM_TENANT,
            key=RELEASES_KEY,
            event_id=derived_id("promotion", request.request_id),
        )

    def _refuse(self, request: PromotionRequest, old: Release, reason: str) -> None:
        with self.pool.connection() as conn, conn.transaction():
            fail_request(conn, request.request_id, reason)
            record_promotion(
                conn,
                Promotion(
                    promotion_id=request.request_id,
                    kind="rejected",
                    from_release_id=old.release_id,
                    to_release_id=request.release_id,
                    run_id=request.run_id,
                    reason=reason,
                ),
            )
        if request.run_id is not None:
            self.log.append(
                [
                    NewEvent(
                        payload=PromotionRejected(run_id=request.run_id, reason=reason),
                        tenant_id=SYSTEM_TENANT,
                        key=RELEASES_KEY,
                        event_id=derived_id("promotion", request.request_id),
                    )
                ]
            )
