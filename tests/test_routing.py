"""Per-task reward routing (mmrl.rewards.routing.TaskRoutedReward, Mixed-R1) on a mixed batch."""
from __future__ import annotations

import pytest
import torch

from mmrl.rewards import TaskRoutedReward, build_reward, build_rewards, check_reward_arguments

NAN = float("nan")

ROUTES = {
    "grounding": {"iou": 1.0, "think_answer_format": 0.5},
    "counting": {"numeric_fuzzy": 1.0, "think_answer_format": 0.25},
    "mc": {"choice_accuracy": 2.0},
}


def same(a: torch.Tensor, b: list[float]) -> bool:
    return torch.allclose(a, torch.tensor(b, dtype=torch.float32), equal_nan=True, atol=1e-6)


def mixed_batch():
    completions = [
        "<think>a</think><answer>[0, 0, 5, 10]</answer>",   # grounding: IoU 0.5, format 1
        "<think>a</think><answer>9</answer>",                # counting: FGRPR 1.5 - 0.1 = 1.4, format 1
        "<answer>B</answer>",                                # mc: right, x2
        "<answer>no box here</answer>",                      # grounding: unparseable IoU 0, format 0
        "<think>a</think><answer>C</answer>",                # mc: wrong
        "<think>a</think><answer>3</answer>",                # task without a route
    ]
    meta = [
        {"task": "grounding", "boxes": [[0, 0, 10, 10]], "coord_format": "absolute"},
        {"task": "counting", "solution": 10},
        {"task": "mc", "solution": "B"},
        {"task": "grounding", "boxes": [[0, 0, 10, 10]], "coord_format": "absolute"},
        {"task": "mc", "solution": "B"},
        {"task": "ocr", "solution": "3"},
    ]
    return completions, meta


def test_routing_with_mixed_tasks():
    reward = TaskRoutedReward(ROUTES)
    completions, meta = mixed_batch()
    out = reward(completions, None, meta)
    assert same(out["iou"], [0.5, NAN, NAN, 0.0, NAN, NAN])
    assert same(out["iou/acc@0.5"], [0.0, NAN, NAN, 0.0, NAN, NAN])
    assert same(out["numeric_fuzzy"], [NAN, 1.4, NAN, NAN, NAN, NAN])
    assert same(out["choice_accuracy"], [NAN, NAN, 1.0, NAN, 0.0, NAN])
    assert same(out["think_answer_format"], [1.0, 1.0, NAN, 0.0, NAN, NAN])  # not in the mc route
    # totals: 0.5 + 0.5*1 ; 1.4 + 0.25*1 ; 2*1 ; 0 + 0.5*0 ; 2*0 ; no route
    assert same(out["total"], [1.0, 1.65, 2.0, 0.0, 0.0, NAN])
    info = reward.last_info
    assert info["num_unrouted"] == 1 and "no route for task 'ocr'" in info["total"]["nan_samples"][5]
    assert info["tasks"] == {"grounding": 2, "counting": 1, "mc": 2, "ocr": 1}
    # the component's own info, indices mapped back to the batch
    assert info["components"]["iou"]["unparseable_samples"] == {3: "no box in the answer"}
    assert info["components"]["iou"]["num_samples"] == 2


def test_each_component_sees_only_its_samples():
    reward = TaskRoutedReward(ROUTES)
    seen = {}
    for key, comp in reward.components.items():
        def spy(completions, prompts, metadata, _comp=comp, _key=key):
            seen[_key] = [m["task"] for m in metadata]
            return _comp(completions, prompts, metadata)
        spy.name = comp.name
        reward.components[key] = spy
    completions, meta = mixed_batch()
    reward(completions, ["q"] * len(completions), meta)
    assert seen == {
        "iou": ["grounding", "grounding"],
        "think_answer_format": ["grounding", "counting", "grounding"],
        "numeric_fuzzy": ["counting"],
        "choice_accuracy": ["mc", "mc"],
    }


def test_default_route_and_missing_task():
    completions, meta = mixed_batch()
    by_name = TaskRoutedReward(ROUTES, default="counting")
    out = by_name(completions, None, meta)
    assert out["numeric_fuzzy"][5].item() == 1.5 and out["total"][5].item() == pytest.approx(1.5 + 0.25 * 1.0)
    explicit = TaskRoutedReward(ROUTES, default={"think_answer_format": 1.0})
    out = explicit(["<think>a</think><answer>x</answer>", "<answer>x</answer>"], None, [{}, {"task": "captions"}])
    assert same(out["total"], [1.0, 0.0])
    none = TaskRoutedReward(ROUTES)
    out = none(["<answer>x</answer>", "<answer>x</answer>"], None, [{}, {"task": 3}])
    assert same(out["total"], [NAN, NAN])
    reasons = none.last_info["total"]["nan_samples"]
    assert "no 'task'" in reasons[0] and "not a string" in reasons[1]
    out = none(["<answer>x</answer>"], None, None)
    assert torch.isnan(out["total"]).all()


def test_nan_component_poisons_only_its_samples_total():
    reward = TaskRoutedReward(ROUTES)
    out = reward(["<think>a</think><answer>[0,0,10,10]</answer>", "<answer>B</answer>"], None,
                 [{"task": "grounding"}, {"task": "mc", "solution": "B"}])  # grounding sample lacks boxes
    assert same(out["total"], [NAN, 2.0])
    assert "iou" in reward.last_info["total"]["nan_samples"][0]


def test_zero_weight_is_logged_not_summed():
    reward = TaskRoutedReward({"mc": {"choice_accuracy": 1.0, "think_answer_format": 0.0}})
    out = reward(["<answer>B</answer>"], None, [{"task": "mc", "solution": "B"}])
    assert out["think_answer_format"].item() == 0.0 and out["total"].item() == 1.0


def test_weights_and_registry():
    reward = build_reward("task_routed", routes=ROUTES)
    assert isinstance(reward, TaskRoutedReward)
    assert reward.weights == {"total": 1.0}
    assert reward.task_weights["counting"] == {"numeric_fuzzy": 1.0, "think_answer_format": 0.25}
    check_reward_arguments("task_routed", {"routes": ROUTES, "default": None})
    with pytest.raises(ValueError, match="did you mean 'routes'"):
        check_reward_arguments("task_routed", {"route": ROUTES})


def test_routed_reward_inside_build_rewards_trains_on_the_routed_total():
    composed = build_rewards({"task_routed": {"kwargs": {"routes": ROUTES}}})
    completions, meta = mixed_batch()
    out = composed(completions, None, meta)
    assert same(out["task_routed"], [1.0, 1.65, 2.0, 0.0, 0.0, NAN])
    assert same(out["total"], [1.0, 1.65, 2.0, 0.0, 0.0, NAN])
    assert same(out["task_routed/iou"], [0.5, NAN, NAN, 0.0, NAN, NAN])
    assert composed.weights == {"task_routed": 1.0}


def test_route_entries_with_kwargs_and_conflicts():
    routes = {
        "counting": {"count": {"reward": "numeric_fuzzy", "kwargs": {"rule": "exp", "tau": 0.5}, "weight": 1.0}},
        "exact": {"count_exact": {"reward": "numeric_accuracy", "weight": 1.0}},
    }
    reward = TaskRoutedReward(routes)
    out = reward(["<answer>15</answer>", "<answer>15</answer>"], None,
                 [{"task": "counting", "solution": 10}, {"task": "exact", "solution": 10}])
    assert out["total"][0].item() == pytest.approx(0.36787944) and out["total"][1].item() == 0.0
    with pytest.raises(ValueError, match="different keys"):
        TaskRoutedReward({"a": {"count": {"reward": "numeric_fuzzy"}},
                          "b": {"count": {"reward": "numeric_fuzzy", "kwargs": {"rule": "exp"}}}})
    with pytest.raises(ValueError, match="did you mean 'iou'"):
        TaskRoutedReward({"a": {"iuo": 1.0}})
    with pytest.raises(ValueError, match="non-finite"):
        TaskRoutedReward({"a": {"iou": float("inf")}})
    with pytest.raises(ValueError, match="non-empty"):
        TaskRoutedReward({})
    with pytest.raises(ValueError, match="not a task"):
        TaskRoutedReward(ROUTES, default="ocr")
    with pytest.raises(ValueError, match="3 outputs but 2 metadata"):
        TaskRoutedReward(ROUTES)(["a", "b", "c"], None, [{}, {}])
