"""Span-scoped credit: character spans -> sampled tokens (multi-byte text, non-canonical ids), response regions, and
the span-scoped variants' per-token advantages worked by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms.base import AdvantageContext, REGISTRY, TransformContext, VariantError, parse_spec
from mmrl.config import load_config
from mmrl.core.advantages import combine_rewards
from mmrl.pipelines.vlm.spans import region_spans, spans_to_token_mask, token_char_ranges
from mmrl.pipelines.vlm.tiny import build_tiny_vlm_tokenizer

TEXT = "<think>é 北京 🙂</think><answer>[1, 2]</answer>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vlm_tokenizer()


def test_region_spans_by_hand():
    assert region_spans(TEXT, "all") == [(0, len(TEXT))]
    # "<think>" is 7 characters; its content "é 北京 🙂" is 6 (the emoji is one code point)
    assert region_spans(TEXT, "think") == [(7, 13)]
    start = TEXT.index("<answer>") + len("<answer>")
    assert region_spans(TEXT, "answer") == [(start, start + 6)]  # "[1, 2]"
    assert region_spans(TEXT, "outside_answer") == [(0, start), (start + 6, len(TEXT))]
    assert region_spans("no tags", "answer") == [] and region_spans("", "all") == []
    with pytest.raises(ValueError, match="unknown region"):
        region_spans(TEXT, "middle")


def _check_ranges(tokenizer, ids, text):
    ranges = token_char_ranges(tokenizer, ids, text)
    assert len(ranges) == len(ids)
    # every character is covered by at least one token, and the tokens of one multi-byte character cover exactly it
    covered = set()
    for start, end in ranges:
        covered.update(range(start, end))
    assert covered == set(range(len(text)))
    return ranges


def test_multi_byte_characters_map_to_all_their_byte_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    ranges = _check_ranges(tokenizer, ids, TEXT)
    emoji = TEXT.index("🙂")
    on_emoji = [t for t, (s, e) in enumerate(ranges) if s <= emoji < e]
    assert len(on_emoji) == len("🙂".encode()) == 4  # the tiny byte-level BPE keeps its 4 UTF-8 bytes as 4 tokens
    mask = spans_to_token_mask(tokenizer, torch.tensor([ids]), torch.ones(1, len(ids)), [TEXT], [[(emoji, emoji + 1)]])
    assert mask[0].nonzero().flatten().tolist() == on_emoji


def test_non_canonical_ids_use_the_prefix_decoding(tokenizer):
    # one token per byte of the text: decodes to the same text, but re-encoding it merges bytes into other tokens
    byte_ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.convert_ids_to_tokens(tokenizer.encode(TEXT))]
    pieces = []
    for token in tokenizer.convert_ids_to_tokens(byte_ids):
        pieces.extend(list(token))  # the byte-level alphabet: one character per byte
    single = [tokenizer.convert_tokens_to_ids(c) for c in pieces]
    assert tokenizer.decode(single) == TEXT and tokenizer.encode(TEXT) != single
    ranges = _check_ranges(tokenizer, single, TEXT)
    beijing = TEXT.index("北")
    # 北 is three UTF-8 bytes -> three byte tokens, all on character `beijing`
    assert sum(1 for s, e in ranges if (s, e) == (beijing, beijing + 1)) == 3


def test_padding_and_special_tokens_are_in_no_span(tokenizer):
    ids = tokenizer.encode("ab")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    row = torch.tensor([ids + [eos, pad, pad]])
    mask = torch.tensor([[1.0] * (len(ids) + 1) + [0.0, 0.0]])
    out = spans_to_token_mask(tokenizer, row, mask, ["ab"], [[(0, 2)]])
    assert out[0].tolist() == [1.0] * len(ids) + [0.0, 0.0, 0.0]
    assert spans_to_token_mask(tokenizer, row, mask, ["ab"], [None]).sum() == 0
    with pytest.raises(ValueError, match="completions"):
        spans_to_token_mask(tokenizer, row, mask, ["ab", "cd"], [None])


# ----------------------------------------------------------------------------------------- the variants, by hand

ALGO = SimpleNamespace(scale="group", eps=0.0, std_ddof=0, advantage_clamp=None, reward_combination="normalize_then_sum",
                       batch_normalize_sum=False)


class FakePolicy:
    """span_mask: token t of sample i is in a span when t lies in one of the (start, end) pairs (spans in tokens)."""

    def span_mask(self, rollout, spans):
        out = torch.zeros(rollout.mask.shape)
        for i, pairs in enumerate(spans):
            for s, e in pairs or []:
                out[i, s:e] = 1.0
        return out * rollout.mask


class Rollout(SimpleNamespace):
    def __len__(self):
        return self.mask.shape[0]


def _run(variant, components, weights, rollout):
    n = len(next(iter(components.values())))
    ctx = AdvantageContext(components=components, weights=weights, labels=[0] * n, group_ids=torch.zeros(n),
                           keys=["p"] * n, algorithm=ALGO, update=0, default=lambda: None)
    total = variant.advantages(ctx)
    adv = variant.transform(TransformContext(advantages=total, scores=components, rollout=rollout, update=0,
                                             total_updates=1, policy=FakePolicy(), rows=torch.arange(n)))
    return total, adv


def test_blockwise_applies_each_objective_on_its_block():
    # accuracy R = [1, 0] -> group-normalised (biased std 0.5, eps 0) A = [1, -1]; format R = [0, 2] -> [-1, 1]
    rollout = Rollout(mask=torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]]), completions=["a", "b"],
                      spans={"fmt": [[(0, 2)], [(1, 2)]]})
    variant = parse_spec({"name": "blockwise", "scopes": {"acc": "all", "fmt": "reward"}}, 0)
    components = {"acc": torch.tensor([1.0, 0.0]), "fmt": torch.tensor([0.0, 2.0])}
    total, adv = _run(variant, components, {"acc": 1.0, "fmt": 0.5}, rollout)
    assert total.tolist() == pytest.approx([1 - 0.5, -1 + 0.5])
    # sample 0: acc +1 on all 4 tokens, fmt 0.5 * -1 on tokens 0-1;  sample 1: acc -1 on its 3 tokens, fmt +0.5 on token 1
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 1.0, 1.0], [-1.0, -0.5, -1.0, 0.0]]))


def test_all_scopes_all_is_normalize_then_sum_on_every_token():
    rollout = Rollout(mask=torch.ones(4, 3), completions=["a"] * 4, spans={})
    components = {"a": torch.tensor([1.0, 2.0, 4.0, 0.0]), "b": torch.tensor([0.0, 1.0, 1.0, 1.0])}
    weights = {"a": 1.0, "b": 2.0}
    variant = parse_spec({"name": "blockwise", "scopes": {"a": "all", "b": "all"}}, 0)
    _, adv = _run(variant, components, weights, rollout)
    expected = combine_rewards(components, [0] * 4, weights=weights, mode="normalize_then_sum", scale="group", eps=0.0,
                               std_ddof=0)
    assert torch.allclose(adv, expected.unsqueeze(1).expand(4, 3))


def test_reward_scope_without_spans_falls_back():
    rollout = Rollout(mask=torch.ones(2, 2), completions=["a", "b"], spans={"acc": [None, [(0, 1)]]})
    components = {"acc": torch.tensor([1.0, 0.0])}
    for fallback, first in (("all", [1.0, 1.0]), ("none", [0.0, 0.0])):
        variant = parse_spec({"name": "cspo", "fallback": fallback}, 0)
        _, adv = _run(variant, components, {"acc": 1.0}, rollout)
        assert adv.tolist() == [first, [-1.0, 0.0]]


def test_rs_grpo_puts_answer_rewards_on_the_answer_block():
    rollout = Rollout(mask=torch.ones(2, 3), completions=["a", "b"], spans={"evidence": [[(0, 1)], [(2, 3)]]})
    variant = parse_spec({"name": "rs_grpo", "evidence": ["evidence"], "answer": ["acc"]}, 0)
    assert variant.scope_of("evidence") == "reward" and variant.scope_of("acc") == "answer"
    assert variant.scope_of("format") == "all"
    with pytest.raises(VariantError, match="both evidence and answer"):
        parse_spec({"name": "rs_grpo", "evidence": ["x"], "answer": ["x"]}, 0)


def test_factorized_credits_vision_rewards_on_the_tool_calls_and_text_rewards_elsewhere():
    # sample 0 wrote a call on tokens 1-2 (<tool> through </tool>), its response (tokens 3-4) is context (mask 0);
    # sample 1 wrote none; token 5 of sample 1 is padding
    calls = [[SimpleNamespace(opened=1, end=3)], []]
    rollout = Rollout(mask=torch.tensor([[1.0, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 0]]), completions=["a", "b"], spans={},
                      tool_calls=calls)
    variant = parse_spec({"name": "factorized", "vision": ["crop"]}, 0)
    assert variant.scope_of("crop") == "tool_calls" and variant.scope_of("acc") == "outside_tool_calls"
    # crop R = [1, 0] -> A = [1, -1]; acc R = [0, 2] -> A = [-1, 1] (biased std, eps 0); weights 1 and 0.5
    total, adv = _run(variant, {"crop": torch.tensor([1.0, 0.0]), "acc": torch.tensor([0.0, 2.0])},
                      {"crop": 1.0, "acc": 0.5}, rollout)
    assert total.tolist() == pytest.approx([0.5, -0.5])  # the joint advantage the loop would put on every token
    # sample 0: crop's +1 on the call only, acc's 0.5 * -1 on its other sampled tokens; sample 1: no vision segment,
    # so crop's -1 goes nowhere and acc's +0.5 is on every sampled token
    assert adv.tolist() == [[-0.5, 1.0, 1.0, 0.0, 0.0, -0.5], [0.5, 0.5, 0.5, 0.5, 0.5, 0.0]]


def test_factorized_config_rules():
    path = "configs/tiny/vlm_grounding.yaml"
    with pytest.raises(Exception, match="set generation.tools"):
        load_config(path, ["algorithm.variants=[{name: factorized, vision: [iou]}]"])
    with pytest.raises(Exception, match="vision: name the reward components"):
        load_config(path, ["generation.tools=[crop]", "algorithm.variants=[{name: factorized}]"])
    with pytest.raises(Exception, match="vision rewards \\['nope'\\] are not among"):
        load_config(path, ["generation.tools=[crop]", "algorithm.variants=[{name: factorized, vision: [nope]}]"])
    config = load_config(path, ["generation.tools=[crop]", "algorithm.variants=[{name: factorized, vision: [iou]}]"])
    assert config.algorithm.variants


def test_blockwise_outcome_conditioned_baseline_stratifies_the_group():
    # confidence normalised within the group's correct samples (0, 1) and wrong samples (2, 3) separately
    variant = parse_spec({"name": "blockwise", "scopes": {"acc": "answer", "conf": "think"},
                          "conditions": {"conf": "acc"}}, 0)
    ctx = AdvantageContext(components={"acc": torch.tensor([1.0, 1, 0, 0]), "conf": torch.tensor([0.9, 0.5, 0.2, 0.6])},
                           weights={"acc": 1.0, "conf": 1.0}, labels=["p"] * 4, group_ids=torch.zeros(4),
                           keys=["p"] * 4, algorithm=ALGO, update=0, default=lambda: None)
    assert variant.group_labels("conf", ctx) == ["p|1", "p|1", "p|0", "p|0"]
    variant.advantages(ctx)
    # within (0.9, 0.5): mean 0.7, std 0.2 -> +1, -1; within (0.2, 0.6): mean 0.4, std 0.2 -> -1, +1
    assert variant.component_advantages["conf"].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)


def test_perceval_penalises_the_hallucinated_tokens():
    rollout = Rollout(mask=torch.tensor([[1.0, 1, 1], [1, 1, 0]]), completions=["a", "b"],
                      spans={"claims": [[(1, 3)], None]})
    variant = parse_spec({"name": "perceval", "claims": "claims", "penalty": 0.5}, 0)
    ctx = TransformContext(advantages=torch.tensor([1.0, -1.0]), scores={}, rollout=rollout, update=0,
                           total_updates=1, policy=FakePolicy(), rows=torch.arange(2))
    assert variant.transform(ctx).tolist() == [[1.0, 0.5, 0.5], [-1.0, -1.0, 0.0]]
    assert ctx.stats["perceval/hallucinated_tokens"] == 2.0


def test_span_variant_config_errors():
    path = "configs/tiny/vlm_grounding.yaml"
    with pytest.raises(Exception, match="needs a block for every weighted objective"):
        load_config(path, ["algorithm.variants=[{name: blockwise, scopes: {iou: answer}}]"])
    with pytest.raises(Exception, match="scopes name"):
        load_config(path, ["algorithm.variants=[{name: cspo, scopes: {nope: answer}}]"])
    with pytest.raises(Exception, match="scope of 'iou' must be one of"):
        load_config(path, ["algorithm.variants=[{name: cspo, scopes: {iou: middle}}]"])
    with pytest.raises(Exception, match="list it before the transform variants"):
        load_config(path, ["algorithm.variants=[tw_grpo, cspo]"])
    assert {"blockwise", "cspo", "rs_grpo", "perceval"} <= set(REGISTRY)


def test_box_coordinate_spans_become_the_tokens_of_that_coordinate(tokenizer):
    """A composed run reward with the four box_coordinate components: each component's reported characters map onto
    exactly the sampled tokens that write its number (in <think> and <answer>), and CSPO puts its advantage there."""
    from mmrl.rewards.compose import build_rewards

    spec = {c: {"reward": "box_coordinate", "weight": 0.5, "kwargs": {"coordinate": c, "coord_format": "qwen2"}}
            for c in ("x1", "y1", "x2", "y2")}
    reward = build_rewards(spec)
    texts = ["<think>x 105 to 348, y 9 to 312</think><answer>[105, 9, 348, 312]</answer>",
             "<think>no idea</think><answer>[40, 90, 380, 400]</answer>"]
    meta = [{"boxes": [[5, 1, 39, 35]], "image_size": [112, 112]}] * 2
    scores = reward(texts, None, meta)
    assert scores["x1"].tolist() == pytest.approx([1 - abs(11.76 - 5) / 28, 1 - abs(4.48 - 5) / 28], abs=1e-4)
    ids = [tokenizer.encode(t) for t in texts]
    width = max(map(len, ids))
    rows = torch.tensor([i + [tokenizer.pad_token_id or 0] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1.0] * len(i) + [0.0] * (width - len(i)) for i in ids])
    for key, written in {"x1": ("105", "40"), "y2": ("312", "400")}.items():
        spans = reward.last_info["components"][key]["spans"]
        token_mask = spans_to_token_mask(tokenizer, rows, mask, texts, spans)
        for i, number in enumerate(written):
            picked = tokenizer.decode(rows[i][token_mask[i].bool()])
            assert picked == number * (2 if i == 0 else 1)  # sample 0 also writes it in its <think>


# --------------------------------------------------------------------------------- spans of sums, routes and servers

BOX_TEXTS = ["<think>x 105 to 348</think><answer>[105, 9, 348, 312]</answer>",  # x1 in think and answer
             "<answer>[40, 90, 380, 400]</answer>"]
BOX_META = [{"boxes": [[5, 1, 39, 35]], "image_size": [112, 112], "coord_format": "qwen2"}] * 2


def box_spec(*coordinates, weight=1.0):
    return {c: {"reward": "box_coordinate", "weight": weight, "kwargs": {"coordinate": c}} for c in coordinates}


def written(text, spans):
    return [text[a:b] for a, b in spans]


def test_combined_spans_unions_merges_and_lets_a_spanless_component_take_the_whole_response():
    from mmrl.rewards._text import combined_spans

    a = [[(5, 8), (0, 2)], [(1, 3)], None]
    b = [[(7, 10)], [(3, 4)], [(0, 1)]]
    # sorted; (5, 8) and (7, 10) overlap, (1, 3) and (3, 4) touch: merged
    assert combined_spans([a, b], 3) == [[(0, 2), (5, 10)], [(1, 4)], None]
    assert combined_spans([b, None], 3) == [None, None, None]   # a component reporting no spans: the whole response
    assert combined_spans([None, None], 3) is None and combined_spans([], 3) is None
    assert combined_spans([[[]], [[(2, 3)]]], 1) == [[(2, 3)]]   # an empty report (nothing written) adds nothing


def test_composed_total_reports_the_union_of_its_weighted_components_spans():
    from mmrl.rewards.compose import build_rewards

    reward = build_rewards({**box_spec("x1", "x2"), "fmt": {"reward": "think_answer_format", "weight": 0.0}})
    reward(BOX_TEXTS, None, BOX_META)
    assert [written(t, s) for t, s in zip(BOX_TEXTS, reward.last_info["spans"])] == [
        ["105", "348", "105", "348"], ["40", "380"]]
    counted = build_rewards({**box_spec("x1"), "fmt": {"reward": "think_answer_format", "weight": 0.5}})
    counted(BOX_TEXTS, None, BOX_META)
    assert counted.last_info["spans"] == [None, None]  # the format reward is about the whole response
    plain = build_rewards({"fmt": {"reward": "think_answer_format", "weight": 1.0}})
    plain(BOX_TEXTS, None, BOX_META)
    assert "spans" not in plain.last_info


def test_routed_reward_reports_each_samples_spans_at_its_own_index():
    from mmrl.rewards.routing import TaskRoutedReward

    routed = TaskRoutedReward(routes={
        "grounding": {**box_spec("x1"), "fmt": {"reward": "think_answer_format", "weight": 0.0}},
        "counting": {"numeric_fuzzy": 1.0},
    })
    texts = ["<answer>3</answer>", BOX_TEXTS[1], BOX_TEXTS[0]]
    meta = [{"task": "counting", "solution": "3"}, {"task": "grounding", **BOX_META[1]},
            {"task": "grounding", **BOX_META[0]}]
    out = routed(texts, ["q"] * 3, meta)
    assert out["total"][0] > 0  # the counting sample is scored by its own route
    x1 = routed.last_info["components"]["x1"]["spans"]
    assert x1[0] is None and written(texts[1], x1[1]) == ["40"] and written(texts[2], x1[2]) == ["105", "105"]
    spans = routed.last_info["spans"]
    assert spans[0] is None  # the counting route reports none: its advantage stays on every token
    assert written(texts[1], spans[1]) == ["40"] and written(texts[2], spans[2]) == ["105", "105"]


def test_a_served_reward_sends_its_spans_to_the_client():
    from mmrl.rewards.compose import build_rewards
    from mmrl.rewards.remote import RemoteReward, RewardServer, RewardServerError

    local = build_rewards(box_spec("x1", "y2"))
    expected = local(BOX_TEXTS, None, BOX_META)
    with RewardServer(local, "127.0.0.1", 0) as srv:
        client = RemoteReward(srv.url, timeout=10)
        out = client(BOX_TEXTS, ["q"] * 2, BOX_META)
    torch.testing.assert_close(out["remote"], expected["total"])
    assert client.last_info["spans"] == local.last_info["spans"]
    assert client.last_info["component_spans"] == {k: local.last_info["components"][k]["spans"] for k in ("x1", "y2")}
    assert written(BOX_TEXTS[1], client.last_info["spans"][1]) == ["40", "400"]
    # a server whose spans do not come one per sample is a clear error, never a mis-scoped advantage
    client._request = lambda *args: {"scores": {"total": [1.0, 0.5]}, "spans": {"total": [[[0, 1]]]}}
    with pytest.raises(RewardServerError, match="one list per sample"):
        client(BOX_TEXTS, ["q"] * 2, BOX_META)
    client._request = lambda *args: {"scores": {"total": [1.0, 0.5]}, "spans": {"total": [[[0]], None]}}
    with pytest.raises(RewardServerError, match="malformed spans"):
        client(BOX_TEXTS, ["q"] * 2, BOX_META)


def test_the_trainer_takes_a_routed_rewards_spans_for_its_component():
    from types import SimpleNamespace

    from mmrl.rewards.compose import build_rewards
    from mmrl.trainer import Trainer

    reward = build_rewards({"routed": {"reward": "task_routed", "kwargs": {"routes": {"grounding": box_spec("x1")}}}})
    fake = SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(reward_batch_size=1)), reward_fn=reward,
                           reward_counts={})
    fake._count_reward_info = lambda info: None
    spans: dict = {}
    metas = [{"task": "grounding", **m} for m in BOX_META]
    Trainer._score_outputs(fake, BOX_TEXTS, ["q"] * 2, metas, spans=spans)  # one sample per reward call
    assert list(spans) == ["routed"]
    assert [written(t, s) for t, s in zip(BOX_TEXTS, spans["routed"])] == [["105", "105"], ["40"]]
