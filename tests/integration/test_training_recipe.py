"""The successor-adapter recipe on a tiny random Llama: pinned losses, the PEFT folder the
engine serves, determinism, DPO against the parent, and the tokenising of answers."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F
from transformers import AutoTokenizer

from core.engine import GenerationRequest, SamplingParams
from core.errors import ConfigError, NothingToTrain
from core.events import ChatMessage
from engines.local.engine import LocalEngine
from engines.local.lora_layers import read_adapter_config
from infra.artifacts import ADAPTER_FILES
from infra.hardware import has_native_bf16
from infra.identity_adapter import write_identity_adapter
from learners.recipes.config import (
    CPU_CONFIG,
    DEFAULT_CONFIG,
    RLOO_CONFIG,
    Examples,
    LiveSample,
    PreferencePair,
    RolloutGroup,
    SFTExample,
    TrainingConfig,
    TrainingResult,
    load_config,
)
from learners.recipes.lora import (
    batch_shares,
    group_samples,
    load_model,
    setup,
    train_step,
    train_successor_adapter,
)
from learners.recipes.losses import (
    SHARED_PREFIX_MIN,
    answer_logprobs,
    answer_token_logprobs,
    dpo_loss,
    output_nll,
    sft_loss,
    shared_prefix,
    token_nll,
)
from learners.recipes.policy import pg_loss, rloo_advantages
from learners.recipes.tokens import IGNORE, collate, end_of_turn_ids, tokenize_turn
from tests.numeric import assert_close

TREE = '{"type":"card","children":[{"type":"text","value":"Hello"}]}'
TOPICS = [
    "a greeting",
    "a welcome",
    "hello",
    "a hi card",
    "a greeting card",
    "a salutation",
    "a warm hello",
    "a friendly card",
    "an intro",
    "a hello card",
    "a greeting box",
    "a hello panel",
]
SYSTEM = ChatMessage(role="system", content="Answer with a UI tree.")
SFT = [
    SFTExample(messages=[SYSTEM, ChatMessage(role="user", content=f"Show me {topic}")], target=TREE)
    for topic in TOPICS
]
CONFIG = TrainingConfig(steps=6, batch_size=4, learning_rate=1e-2)
# Observed on the tiny model (seed 0): a change to the recipe's maths or sampling shows here.
# Tolerances in float32 ulps, relative norm (tests/numeric.py); the most seen on the default and
# AVX2 kernels and on one thread in brackets.
PINNED_ULPS = 128  # a loss pinned after a few optimizer steps, on another machine (13)
LOSS_ULPS = 64  # one loss computed two ways, the same tokens summed in another order (16)
GRADIENT_ULPS = 128  # a LoRA gradient computed two ways, summed over every token (27)
FIRST_LOSS = 13.708668
LAST_LOSS = 9.525846

Metrics = list[tuple[int, int, dict[str, float]]]


@pytest.fixture(scope="module")
def parent(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("parent")
    write_identity_adapter(tiny_model, folder, base_model="tiny", rank=4, seed=1)
    return folder


@pytest.fixture(scope="module")
def trained(
    tiny_model: Path, parent: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TrainingResult, Path, Metrics]:
    out = tmp_path_factory.mktemp("successor")
    seen: Metrics = []
    result = train_successor_adapter(
        tiny_model,
        parent,
        out,
        Examples(sft=SFT),
        CONFIG,
        progress=lambda step, steps, metrics: seen.append((step, steps, metrics)),
    )
    return result, out, seen


@pytest.mark.numeric
def test_losses_are_pinned_and_decrease(trained: tuple[TrainingResult, Path, Metrics]) -> None:
    """Six SFT steps give the pinned first and last losses, to float32's rounding. Guards the
    recipe's maths: a loss averaged over a token count off by one, a label shifted, another
    schedule or data order moves them by thousands of ulps."""
    result, _, seen = trained
    print(f"losses {result.losses}, {result.seconds / result.steps:.2f} s per step")
    assert result.steps == 6 and len(result.losses) == 6
    assert (result.examples, result.pairs) == (12, 0)
    assert_close(result.losses[0], FIRST_LOSS, ulps=PINNED_ULPS)
    assert_close(result.losses[-1], LAST_LOSS, ulps=PINNED_ULPS)
    assert result.final_loss == result.losses[-1]
    assert result.losses[-1] < result.losses[0] - 1.0
    assert [(step, steps) for step, steps, _ in seen] == [(n, 6) for n in range(1, 7)]
    assert [m["loss"] for _, _, m in seen] == result.losses
    assert all(m["sft_loss"] == m["loss"] and m["dpo_loss"] == 0.0 for _, _, m in seen)


@pytest.mark.numeric
def test_auto_precision_trains_in_bf16_where_the_cpu_has_it_within_1_percent(
    tiny_model: Path, parent: Path, trained: tuple[TrainingResult, Path, Metrics], tmp_path: Path
) -> None:
    """``precision: auto`` computes in bf16 on a CPU with bf16 instructions (float32
    elsewhere), and every step's loss stays within 1 % of the float32 run's (0.5 % seen); the
    LoRA weights it trains and writes stay float32."""
    result = train_successor_adapter(
        tiny_model,
        parent,
        tmp_path,
        Examples(sft=SFT),
        CONFIG.model_copy(update={"precision": "auto"}),
    )
    assert result.precision == ("bfloat16" if has_native_bf16() else "float32")
    assert trained[0].precision == "float32"
    for mine, float32 in zip(result.losses, trained[0].losses, strict=True):
        assert mine == pytest.approx(float32, rel=0.01)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    assert weights and {w.dtype for w in weights.values()} == {torch.float32}


def test_successor_folder_is_a_peft_adapter_the_engine_serves(
    trained: tuple[TrainingResult, Path, Metrics], parent: Path, tiny_model: Path
) -> None:
    _, out, _ = trained
    assert sorted(p.name for p in out.iterdir()) == sorted(ADAPTER_FILES)
    config = read_adapter_config(out)
    assert (config.rank, config.alpha) == (4, 8.0)
    successor, origin = (
        load_file(out / "adapter_model.safetensors"),
        load_file(parent / "adapter_model.safetensors"),
    )
    assert successor.keys() == origin.keys()  # the names the engine's reader expects
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.count_nonzero(successor[key]) > 0  # trained away from the identity parent

    engine = LocalEngine(tiny_model)
    try:
        engine.load_adapter("genui@1", str(out))
        prompt = engine.chat_prompt([m.model_dump() for m in SFT[0].messages])

        async def greedy(adapter: str | None) -> list[int]:
            request = GenerationRequest(
                request_id=f"r-{adapter}",
                prompt=prompt,
                adapter=adapter,
                params=SamplingParams(max_tokens=12),
            )
            return [t async for chunk in engine.generate(request) for t in chunk.token_ids]

        assert asyncio.run(greedy("genui@1")) != asyncio.run(greedy(None))
    finally:
        engine.close()


def test_same_seed_gives_identical_bytes(
    trained: tuple[TrainingResult, Path, Metrics], tiny_model: Path, parent: Path, tmp_path: Path
) -> None:
    first, out, _ = trained
    again = train_successor_adapter(tiny_model, parent, tmp_path, Examples(sft=SFT), CONFIG)
    assert again.losses == first.losses
    for name in ADAPTER_FILES:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_training_starts_from_the_parent_weights(
    trained: tuple[TrainingResult, Path, Metrics], tiny_model: Path, tmp_path: Path
) -> None:
    """The grandchild's first loss is measured before its first update, on the same first
    batch as its parent's run: it is the parent's trained loss, not the identity's."""
    child, out, _ = trained
    grandchild = train_successor_adapter(
        tiny_model, out, tmp_path, Examples(sft=SFT), CONFIG.model_copy(update={"steps": 1})
    )
    assert grandchild.losses[0] < child.losses[-1]


@pytest.mark.numeric
def test_preference_pairs_add_a_dpo_loss_against_the_parent(
    tiny_model: Path, parent: Path, tmp_path: Path
) -> None:
    """At the first step the policy is the parent, the DPO reference, so the DPO loss is
    log 2 to float32's rounding. Guards the reference: chosen and rejected answers swapped in
    it, or log-probs taken from another model than the parent, move it off log 2."""
    pairs = [
        PreferencePair(messages=example.messages, chosen=TREE, rejected="I cannot draw that.")
        for example in SFT[:4]
    ]
    older = [
        SFTExample(messages=[ChatMessage(role="user", content=f"Say {word}")], target=word)
        for word in ("yes", "no")
    ]
    seen: Metrics = []
    result = train_successor_adapter(
        tiny_model,
        parent,
        tmp_path,
        Examples(sft=SFT[4:8], pairs=pairs, older=older),
        CONFIG.model_copy(update={"steps": 2, "replay_share": 0.25}),
        progress=lambda step, steps, metrics: seen.append((step, steps, metrics)),
    )
    assert result.pairs == 4
    first, second = seen[0][2], seen[1][2]
    # At the first step the policy is the parent, which is the reference: the margin is 0.
    assert_close(first["dpo_loss"], math.log(2), ulps=LOSS_ULPS)
    assert math.isfinite(second["dpo_loss"]) and second["dpo_loss"] < first["dpo_loss"]
    assert_close(first["loss"], first["sft_loss"] + first["dpo_loss"], ulps=8)  # one addition


def test_dpo_raises_the_chosen_answer_over_the_rejected_one(
    tiny_model: Path, parent: Path, tmp_path: Path
) -> None:
    """Pairs whose chosen and rejected answers were swapped anywhere on the way would still
    lower the DPO loss; only the direction of the learned margin tells."""
    pairs = [
        PreferencePair(messages=example.messages, chosen=TREE, rejected="I cannot draw that.")
        for example in SFT[:4]
    ]
    train_successor_adapter(
        tiny_model, parent, tmp_path, Examples(pairs=pairs), CONFIG.model_copy(update={"steps": 3})
    )

    def margin(adapter: Path) -> float:
        model, tokenizer = load_model(tiny_model, adapter)
        model.eval()
        end = end_of_turn_ids(tokenizer)
        rows = [
            tokenize_turn(tokenizer, p.messages, answer, end, CONFIG.max_length)
            for p in pairs
            for answer in (p.chosen, p.rejected)
        ]
        with torch.no_grad():
            logps = answer_logprobs(token_nll(model, collate(rows, end[-1])))
        return float((logps[0::2] - logps[1::2]).mean())

    before, after = margin(parent), margin(tmp_path)
    assert after > before + 1.0, (before, after)


GROUPS = [
    RolloutGroup(
        messages=example.messages,
        answers=[TREE, "I cannot draw that.", TREE.upper(), "No."],
        rewards=[1.0, 0.0, 1.0, 0.0],
    )
    for example in SFT[:3]
]
RLOO = CONFIG.model_copy(update={"steps": 4, "pg_weight": 1.0, "kl_beta": 0.04})
# Observed on the tiny model (seed 0), policy gradient alone.
FIRST_PG_LOSS = -1 / 3  # the first 4 answers drawn: 3 rewarded (A = 2/3), 1 not (A = -2/3)
LAST_PG_LOSS = -0.777315


def test_rloo_advantages_and_the_clipped_surrogate_match_hand_computed_values() -> None:
    assert rloo_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert rloo_advantages([1.0, 1.0]) == [0.0, 0.0] and rloo_advantages([1.0]) == [0.0]
    # The policy is the parent: ratio 1, KL 0, each answer's loss is -A.
    same = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    assert pg_loss(same, same, torch.tensor([1.0, -0.5]), 0.2, 0.1).item() == pytest.approx(-0.25)
    # ratio 1.5 on A = 1 is clipped to 1.2; the KL estimate is exp(-d) + d - 1 for d = log 1.5.
    d = math.log(1.5)
    loss = pg_loss([torch.tensor([d])], [torch.tensor([0.0])], torch.tensor([1.0]), 0.2, 0.1)
    assert loss.item() == pytest.approx(0.1 * (math.exp(-d) + d - 1) - 1.2, rel=1e-6)
    # ratio 0.5 on A = -1: min(-0.5, -0.8) = -0.8, the clip keeps the update from overshooting.
    d = math.log(0.5)
    loss = pg_loss([torch.tensor([d])], [torch.tensor([0.0])], torch.tensor([-1.0]), 0.2, 0.0)
    assert loss.item() == pytest.approx(0.8, rel=1e-6)
    # ratio 5 on A = -1: the dual clip bounds the loss at 3 (and stops the push).
    d = math.log(5.0)
    loss = pg_loss([torch.tensor([d])], [torch.tensor([0.0])], torch.tensor([-1.0]), 0.2, 0.0)
    assert loss.item() == pytest.approx(3.0, rel=1e-6)


@pytest.mark.numeric
def test_policy_gradient_raises_rewarded_answers_over_the_others(
    tiny_model: Path, parent: Path, tmp_path: Path
) -> None:
    """RLOO on rollout groups with pinned losses: at the first step the policy is the parent,
    so every ratio is 1 and the loss is minus the mean advantage of the drawn answers; after a
    few steps the rewarded answers are likelier than before against the others. Guards the
    advantages and the surrogate: a baseline that counts the sample's own reward, or another
    clip, moves the pinned losses by far more than float32's rounding."""
    seen: Metrics = []
    result = train_successor_adapter(
        tiny_model,
        parent,
        tmp_path,
        Examples(groups=GROUPS),
        RLOO,
        progress=lambda step, steps, metrics: seen.append((step, steps, metrics)),
    )
    print(f"pg losses {[m['pg_loss'] for _, _, m in seen]}")
    assert (result.examples, result.pairs, result.samples) == (0, 0, 12)
    assert_close(seen[0][2]["pg_loss"], FIRST_PG_LOSS, ulps=PINNED_ULPS)
    assert_close(seen[-1][2]["pg_loss"], LAST_PG_LOSS, ulps=PINNED_ULPS)
    assert all(m["loss"] == m["pg_loss"] for _, _, m in seen)

    def margin(adapter: Path) -> float:
        model, tokenizer = load_model(tiny_model, adapter)
        model.eval()
        end = end_of_turn_ids(tokenizer)
        group = GROUPS[0]
        rows = [
            tokenize_turn(tokenizer, group.messages, answer, end, CONFIG.max_length)
            for answer in group.answers
        ]
        with torch.no_grad():
            logps = answer_logprobs(token_nll(model, collate(rows, end[-1])))
        rewarded = torch.tensor(group.rewards) > 0
        return float(logps[rewarded].mean() - logps[~rewarded].mean())

    before, after = margin(parent), margin(tmp_path)
    assert after > before + 1.0, (before, after)


LIVE = [
    LiveSample(messages=SFT[0].messages, answer=TREE, reward=1.0),
    LiveSample(messages=SFT[1].messages, answer="No.", reward=0.0),
    LiveSample(messages=SFT[2].messages, answer='{"tool": "calculator", "args": {}}', reward=0.5),
]


def test_live_samples_take_the_other_live_rewards_as_their_baseline() -> None:
    """Each live sample is its own context: its advantage is its reward minus the mean of the
    other live samples'; a group's answers are judged within the group; alike rewards (also
    after rounding) teach nothing."""
    found = group_samples([], LIVE)  # the third scored the others' mean: advantage 0
    assert [(m, a) for m, a, _ in found] == [(s.messages, s.answer) for s in LIVE[:2]]
    assert [a for _, _, a in found] == pytest.approx([0.75, -0.75])
    third = [LiveSample(messages=SFT[0].messages, answer=TREE, reward=2 / 3)] * 3
    assert group_samples([], third) == [] and group_samples([], LIVE[:1]) == []
    mixed = group_samples(GROUPS[:1], LIVE[:2])
    assert [a for _, _, a in mixed] == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3, 1.0, -1.0])


def test_nothing_to_train(tiny_model: Path, parent: Path, tmp_path: Path) -> None:
    """Older examples alone, pairs at DPO weight 0, groups or live rewards at policy-gradient
    weight 0, or groups and live samples whose answers all scored alike: nothing to learn,
    and nothing written."""
    pairs = [PreferencePair(messages=SFT[0].messages, chosen=TREE, rejected="No.")]
    alike = [GROUPS[0].model_copy(update={"rewards": [1.0] * 4})]
    downs = [s.model_copy(update={"reward": 0.0}) for s in LIVE]
    for preferences, groups, live, config in [
        ([], [], [], CONFIG),
        (pairs, [], [], CONFIG.model_copy(update={"dpo_weight": 0.0})),
        ([], GROUPS, LIVE, CONFIG),
        ([], alike, downs, RLOO),
    ]:
        with pytest.raises(NothingToTrain) as caught:
            train_successor_adapter(
                tiny_model,
                parent,
                tmp_path,
                Examples(pairs=preferences, older=SFT, groups=groups, live=live),
                config,
            )
        assert caught.value.code == "nothing_to_train"
        assert not list(tmp_path.iterdir())


def test_dpo_loss_matches_hand_computed_values() -> None:
    zero = torch.zeros(3)
    assert dpo_loss(zero, zero, zero, zero, 0.1).item() == pytest.approx(math.log(2))
    # margin = ((-1) - (-2)) - ((-3) - (-2)) = 2; beta 0.5: -log(sigmoid(1)) = log(1 + e^-1)
    loss = dpo_loss(
        torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), 0.5
    )
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1)), rel=1e-6)
    # the mean over pairs: margins 2 and -2 at beta 1
    loss = dpo_loss(
        torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0]), torch.zeros(2), torch.zeros(2), 1.0
    )
    expected = (math.log1p(math.exp(-2)) + math.log1p(math.exp(2))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_answer_tokens_end_with_the_end_of_turn_token(tiny_model: Path) -> None:
    """The prompt is exactly what the engine sends; the target is the answer and ``<|im_end|>``,
    the tokens the full conversation holds after the prompt, less the newline after the turn."""
    tokenizer: Any = AutoTokenizer.from_pretrained(tiny_model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    end = end_of_turn_ids(tokenizer)
    assert end == [im_end]
    messages = SFT[0].messages
    chat = [m.model_dump() for m in messages]
    prompt = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    full = list(
        tokenizer.apply_chat_template(
            [*chat, {"role": "assistant", "content": TREE}], return_dict=True
        )["input_ids"]
    )
    turn = tokenize_turn(tokenizer, messages, TREE, end, max_length=512)
    assert turn.ids == full[: full.index(im_end, len(prompt)) + 1]
    assert turn.ids[: len(prompt)] == prompt
    assert turn.labels == [IGNORE] * len(prompt) + turn.ids[len(prompt) :]
    assert tokenizer.decode(turn.ids[len(prompt) :]) == TREE + "<|im_end|>"

    short = tokenize_turn(tokenizer, messages, TREE, end, max_length=len(prompt))
    assert short.ids == turn.ids[-len(prompt) :]  # the oldest context goes, the answer stays
    assert short.labels == turn.labels[-len(prompt) :]


@pytest.mark.numeric
def test_a_shared_prompt_prefix_is_computed_once_with_the_same_loss_and_gradients(
    tiny_model: Path, parent: Path
) -> None:
    """A batch whose rows share a long system prompt computes it once; the loss and the LoRA
    gradients are those of computing every row whole (each row alone shares nothing), to
    float32's rounding. Guards the packing after the prefix: rows given positions one off
    (their queries rotated against the prefix's keys) move the loss by 1 %, far outside."""
    model, tokenizer = load_model(tiny_model, parent)
    _perturb(model)
    end = end_of_turn_ids(tokenizer)
    system = ChatMessage(role="system", content="You design small interfaces. " * 8)
    items = [
        tokenize_turn(
            tokenizer, [system, ChatMessage(role="user", content=f"Show me {t}")], TREE, end, 512
        )
        for t in TOPICS[:4]
    ]
    batch = collate(items, pad_id=end[-1])
    shared = shared_prefix(batch)
    first_answer = min(
        item.labels.index(next(x for x in item.labels if x != IGNORE)) for item in items
    )
    assert SHARED_PREFIX_MIN <= shared < first_answer

    def loss_and_grads(compute: Any) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss = compute()
        loss.backward()
        grads = [
            p.grad.clone() for p in model.parameters() if p.requires_grad and p.grad is not None
        ]
        return float(loss.detach()), grads

    together = loss_and_grads(lambda: sft_loss(token_nll(model, batch), batch.labels))
    rows = [collate([item], pad_id=end[-1]) for item in items]
    targets = sum(int((row.labels[:, 1:] != IGNORE).sum()) for row in rows)
    alone = loss_and_grads(lambda: sum(token_nll(model, row).sum() for row in rows) / targets)
    assert all(shared_prefix(row) == 0 for row in rows)
    with torch.no_grad():  # a row alone, as the model's own forward pass scores it
        logits = model(input_ids=rows[0].input_ids).logits[0, :-1]
        whole = F.cross_entropy(logits, rows[0].labels[0, 1:], reduction="sum")
        assert_close(token_nll(model, rows[0]).sum(), whole, ulps=LOSS_ULPS)
    assert_close(together[0], alone[0], ulps=LOSS_ULPS)
    assert len(together[1]) == len(alone[1]) > 0
    for mine, theirs in zip(together[1], alone[1], strict=True):
        assert_close(mine, theirs, ulps=GRADIENT_ULPS)


@pytest.mark.numeric
@pytest.mark.parametrize(("dtype", "ulps"), [(torch.float32, 32), (torch.bfloat16, 2)])
def test_the_output_layer_nll_and_its_gradient_are_cross_entropys(
    dtype: torch.dtype, ulps: float
) -> None:
    """``output_nll`` (the gradient to the hidden states computed in the forward pass) gives
    the NLL and the gradient that autograd's cross-entropy gives, logits far apart included;
    in bf16 (the training step's dtype there) within bf16's rounding of the gradient. Guards
    the hand-written gradient: a position's weight in the loss (the upstream gradient) left
    out, or the softmax not normalised, is off by far more."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 24, generator=generator).to(dtype)
    hidden = (8 * torch.randn(7, 24, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, 500, (7,), generator=generator)
    upstream = torch.rand(7, generator=generator)  # each position's weight in a loss

    nll = output_nll(hidden, weight, targets)
    (nll * upstream).sum().backward()
    mine = hidden.grad
    hidden.grad = None
    theirs = F.cross_entropy((hidden @ weight.T).float(), targets, reduction="none")
    (theirs * upstream).sum().backward()

    assert float((hidden.detach() @ weight.T).float().std()) > 30  # spreads that underflow exp
    assert_close(nll, theirs, ulps=LOSS_ULPS)
    assert mine is not None and hidden.grad is not None and mine.abs().sum() > 0
    assert mine.dtype == hidden.dtype
    assert_close(mine, hidden.grad, ulps=ulps, dtype=dtype)
    with pytest.raises(ValueError):  # the output layer is frozen: no gradient for it
        output_nll(hidden.detach(), weight.clone().requires_grad_(), targets)


@pytest.mark.numeric
def test_a_training_step_has_the_losses_and_gradients_of_its_parts_computed_apart(
    tiny_model: Path, parent: Path
) -> None:
    """A step with an SFT batch, preference pairs and rollout samples (one forward and one
    backward pass over all their rows, one prompt prefix computed for them) leaves the losses
    and the gradients of the summed loss computed part by part, to float32's rounding.
    Guards how the parts are weighed and split: a part's weight left out, or rows split at
    the wrong place, moves the gradients by far more."""
    config = RLOO.model_copy(update={"batch_size": 3, "dpo_weight": 0.5})
    pairs = [PreferencePair(messages=e.messages, chosen=TREE, rejected="No.") for e in SFT[3:5]]
    run = setup(tiny_model, parent, config, Examples(sft=SFT[:6], pairs=pairs, groups=GROUPS))
    _perturb(run.model)
    run.model.train()
    sft_batch, pair_ids, sample_ids = run.sft[:3], [1, 0], [0, 1, 3]
    paired = [run.pairs[i][0] for i in pair_ids] + [run.pairs[i][1] for i in pair_ids]
    rows = collate(sft_batch + paired + [run.samples[i] for i in sample_ids], run.pad_id)
    assert shared_prefix(rows) >= SHARED_PREFIX_MIN  # the step shares a prefix

    trainable = [p for p in run.model.parameters() if p.requires_grad]
    run.optimizer = torch.optim.SGD(trainable, lr=0.0)  # the weights stay, the gradients too
    metrics = train_step(run, config, sft_batch, pair_ids, sample_ids)
    stepped = [p.grad.clone() for p in trainable if p.grad is not None]

    run.model.zero_grad()
    sft_rows = collate(sft_batch, run.pad_id)
    sft = sft_loss(token_nll(run.model, sft_rows), sft_rows.labels)
    chosen, rejected = answer_logprobs(token_nll(run.model, collate(paired, run.pad_id))).chunk(2)
    reference = run.reference[pair_ids]
    dpo = dpo_loss(chosen, rejected, reference[:, 0], reference[:, 1], config.dpo_beta)
    sampled = collate([run.samples[i] for i in sample_ids], run.pad_id)
    policy = answer_token_logprobs(token_nll(run.model, sampled), sampled.labels)
    pg = pg_loss(
        policy,
        [run.sample_reference[i] for i in sample_ids],
        run.advantages[sample_ids],
        config.pg_clip,
        config.kl_beta,
    )
    (sft + config.dpo_weight * dpo + config.pg_weight * pg).backward()
    whole = [p.grad for p in trainable if p.grad is not None]
    assert_close(metrics["sft_loss"], sft, ulps=LOSS_ULPS)
    assert_close(metrics["dpo_loss"], dpo, ulps=LOSS_ULPS)
    assert_close(metrics["pg_loss"], pg, ulps=LOSS_ULPS)
    assert len(stepped) == len(whole) == len(trainable)
    for mine, theirs in zip(stepped, whole, strict=True):
        assert theirs.abs().sum() > 0
        assert_close(mine, theirs, ulps=GRADIENT_ULPS)


def _perturb(model: Any) -> None:
    """LoRA B weights away from 0 (an identity adapter's), so the A weights get gradients."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)


def test_replay_share_of_each_batch() -> None:
    config = TrainingConfig(batch_size=8, replay_share=0.2)
    assert batch_shares(config, new=10, older=10) == (6, 2)
    assert batch_shares(config, new=10, older=0) == (8, 0)
    assert batch_shares(config, new=0, older=10) == (0, 2)


def test_default_config_file_holds_the_defaults(tmp_path: Path) -> None:
    assert load_config(DEFAULT_CONFIG) == TrainingConfig()
    assert load_config(CPU_CONFIG).dpo_weight == 0.0
    rloo = load_config(RLOO_CONFIG)
    assert (rloo.pg_weight, rloo.dpo_weight) == (1.0, 0.0)
    bad = tmp_path / "bad.yaml"
    for text in ("steps: 3\nlearning_rte: 0.1\n", "precision: float16\n"):
        bad.write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_config(bad)
        assert caught.value.code == "config_invalid"
