"""Tool calls in VLM rollouts (mmrl.pipelines.vlm.tools / tool_rollout) and TACO (DAPR + OGAR), on a tiny Qwen2.5-VL.

The tiny random model never writes a call by itself, so the tests script the policy's first turns (the tokens a
turn returns) and let everything else run for real: the call's execution, the response's tokens and image, the
next turns' sampling and the replayed log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from mmrl.algorithms.base import RewardContext, TransformContext, VariantError, item_of, parse_spec
from mmrl.config import ConfigError, load_config
from mmrl.pipelines.vlm.tools import ToolCall, ToolError, parse_call, resolve_tools, run_call

REPO = __import__("pathlib").Path(__file__).parents[1]
CALL = "<think>look</think><tool>crop(0, 0, 40, 30)</tool>"


def test_calls_are_parsed_never_evaluated():
    tools = resolve_tools(["crop", "rotate"])
    assert parse_call(" crop(1, 2.5, -3, +4) ", tools) == ("crop", [1, 2.5, -3, 4])
    assert parse_call("rotate(90)", tools) == ("rotate", [90])
    for bad, word in [("__import__('os').system('true')", "not a call"), ("crop(x=1)", "keyword"),
                      ("crop('a', 1, 2, 3)", "numbers"), ("zoom(1)", "unknown tool"), ("crop(1, 2", "parse"),
                      ("crop(True, 1, 2, 3)", "numbers"), ("crop(1e999, 1, 2, 3)", "finite"),
                      ("os.system(1)", "not a call")]:
        with pytest.raises(ToolError, match=word):
            parse_call(bad, tools)


def test_the_built_in_tools_and_their_errors():
    image = Image.new("RGB", (84, 56), (10, 20, 30))
    image.putpixel((50, 40), (255, 0, 0))
    tools = resolve_tools(["crop", "rotate", "contrast"])
    view = run_call("crop(40, 30, 60, 50)", tools, image)
    assert view.size == (20, 20) and view.getpixel((10, 10)) == (255, 0, 0)
    assert run_call("crop(-10, -10, 500, 500)", tools, image).size == (84, 56)  # clipped to the image
    assert run_call("rotate(90)", tools, image).size == (56, 84)
    assert run_call("contrast(0)", tools, image).getpixel((0, 0)) == run_call("contrast(0)", tools, image).getpixel(
        (83, 55))  # factor 0: one grey
    for call, word in [("crop(5, 5, 6, 40)", "2x2"), ("crop(1, 2)", "crop"), ("contrast(11)", "outside"),
                       ("rotate()", "rotate")]:
        with pytest.raises(ToolError, match=word):
            run_call(call, tools, image)
    with pytest.raises(ToolError, match="no image"):
        run_call("rotate(3)", tools, None)


def test_box_tools_read_their_numbers_in_the_answers_frame():
    """crop's numbers are in the frame of the box answers (the sample's coord_format): the same region as a box answer
    with those numbers, which crop_recall scores; other tools' numbers pass as written."""
    from mmrl.pipelines.vlm.tools import answer_frame
    from mmrl.rewards import build_reward

    image = Image.new("RGB", (112, 84))  # the model's input (after the pixel budget) of a 224 x 168 original
    image.putpixel((60, 50), (255, 0, 0))
    sizes = {"image_size": [224, 168], "input_size": [112, 84]}
    tools = resolve_tools(["crop", "rotate"])
    for fmt, call in [("qwen2", "crop(500, 500, 1000, 1000)"), ("qwen25", "crop(56, 42, 112, 84)"),
                      ("absolute", "crop(112, 84, 224, 168)")]:
        meta = {"coord_format": fmt, **sizes}
        view = run_call(call, tools, image, answer_frame(meta, None))
        assert view.size == (56, 42) and view.getpixel((4, 8)) == (255, 0, 0), fmt
        truth = {**meta, "boxes": [[112, 84, 224, 168]]}
        recall = build_reward("crop_recall")([f"<tool>{call}</tool>"], [None], [truth])
        assert recall["crop_recall"].tolist() == pytest.approx([1.0]), fmt
        assert run_call("rotate(90)", tools, image, answer_frame(meta, None)).size == (84, 112)
    # the sample's format wins over the policy's; none known: pixels of the input as written
    assert run_call("crop(500, 500, 1000, 1000)", tools, image, answer_frame({**sizes}, "qwen2")).size == (56, 42)
    to_pixels = answer_frame({"coord_format": "qwen2", **sizes}, "qwen25")
    assert to_pixels([0, 0, 500, 1000]) == pytest.approx([0, 0, 56, 84])
    assert answer_frame(sizes, None) is None
    with pytest.raises(ToolError, match="image_size"):
        run_call("crop(0, 0, 500, 500)", tools, image, answer_frame({"coord_format": "qwen2"}, None))


def test_tool_names_resolve_or_are_refused():
    assert set(resolve_tools(["crop", "PIL.ImageOps:mirror"])) == {"crop", "mirror"}
    mirrored = run_call("mirror()", resolve_tools(["PIL.ImageOps:mirror"]), Image.new("RGB", (4, 4)))
    assert mirrored.size == (4, 4)
    for names, word in [(["zoom"], "unknown tool 'zoom'"), (["PIL.ImageOps:nope"], "cannot import"),
                        (["crop", "crop"], "two tools")]:
        with pytest.raises(ValueError, match=word):
            resolve_tools(names)
    base = REPO / "configs/tiny/vlm_grounding.yaml"
    for override, word in [("generation.tools=[zoom]", "unknown tool"),
                           ("generation.max_tool_calls=0", "max_tool_calls"),
                           ("generation.tool_response_template=no image", "{image}")]:
        extra = [] if override.startswith("generation.tools") else ["generation.tools=[crop]"]
        with pytest.raises(ConfigError, match=word):
            load_config(base, [override, *extra])


# ---------------------------------------------------------------------------------------------- tool rollouts


def script(policy, turns: list[str], *, every_update: bool = False, as_text: bool = False) -> list:
    """Make the k-th ``generate`` call of ``policy`` return ``turns[k]`` for every row (later calls sample for
    real; ``every_update``: every group's first turn returns ``turns[0]``; ``as_text``: special tokens in the turns
    written out as ordinary tokens, as a policy can spell them); returns the list the real calls' per-step scores are
    recorded in."""
    real = policy.model.generate
    ids = [policy.tokenizer(t, add_special_tokens=False, split_special_tokens=as_text)["input_ids"] for t in turns]
    calls, recorded = [0], []

    def generate(**kwargs):
        k = calls[0]
        calls[0] += 1
        n = kwargs["generation_config"].num_return_sequences or 1
        # a group's first turn: several sequences per prompt, or rows already expanded onto a shared prefill's cache
        if every_update and (n > 1 or kwargs.get("cache") is not None):
            k = 0
        if k < len(ids) and (k == 0 or not every_update):
            prompt = kwargs["input_ids"].repeat_interleave(n, 0)
            return torch.cat([prompt, torch.tensor([ids[k]] * len(prompt))], 1)
        out = real(**kwargs, output_scores=True, return_dict_in_generate=True)
        recorded.append((kwargs["input_ids"].shape[1], torch.stack(out.scores, 1)))
        return out.sequences

    policy.model.generate = generate
    return recorded


@pytest.fixture()
def tool_trainer(tmp_path):
    from mmrl.build import build_trainer

    def build(*overrides):
        config = load_config(REPO / "configs/tiny/vlm_grounding.yaml", [
            f"output_dir={tmp_path / 'run'}", "logging.progress_bar=false", "logging.tensorboard=false",
            "generation.max_new_tokens=48", "data.prompts_per_step=2", "data.group_size=2", "train.batch_size=4",
            "generation.tools=[crop]", "resume=null", *overrides])
        return build_trainer(config)
    return build


def test_a_call_runs_and_its_response_is_context_not_action(tool_trainer):
    trainer = tool_trainer()
    policy = trainer.policy
    recorded = script(policy, [CALL])
    items = trainer.prompts.next_batch(2)
    rollout = policy.rollout(items, 2, generator=torch.Generator().manual_seed(0))
    assert len(rollout) == 4 and len(rollout.vision) == 4  # one prompt row and one Vision per sample
    call_ids = policy.tokenizer(CALL, add_special_tokens=False)["input_ids"]
    for i, (text, calls) in enumerate(zip(rollout.completions, rollout.tool_calls)):
        assert text.startswith(CALL + "\n<observation>") and len(calls) == 1
        c = calls[0]
        assert c.ok and c.call == "crop(0, 0, 40, 30)" and (c.start, c.end) == (0, len(call_ids))
        assert policy.tokenizer.decode(rollout.completion_ids[i, c.opened:c.end]).startswith("<tool>")
        assert rollout.mask[i, :c.end].eq(1).all() and rollout.mask[i, c.end:c.response_end].eq(0).all()
        assert rollout.attention[i, :c.response_end].eq(1).all()
        response = rollout.completion_ids[i, c.end:c.response_end]
        pads = response == policy.base_model.config.image_token_id
        assert pads.sum() > 0 and rollout.completion_types[i, c.end:c.response_end].eq(pads.long()).all()
        assert len(rollout.vision[i].image_grid_thw) == 2  # the prompt's image, then the view
        assert rollout.mask[i].sum() <= 48 and rollout.extras["tool_calls"][i] == 1
    # the turn after the call was sampled in the context that holds the view: replay scores it the same
    logps = policy.logprobs(rollout, torch.arange(len(rollout))).logps
    assert torch.isfinite(logps).all()
    (width, scores), = recorded
    sampled = scores.log_softmax(-1)
    start = rollout.tool_calls[0][0].response_end
    steps = sampled.shape[1]
    for i in range(len(rollout)):
        own = rollout.mask[i, start:start + steps] > 0
        targets = rollout.completion_ids[i, start:start + steps]
        expected = sampled[i].gather(-1, targets.unsqueeze(-1)).squeeze(-1)[own]
        torch.testing.assert_close(logps[i, start:start + steps][own], expected, atol=1e-5, rtol=0)
    # batch layout: any subset gives the same log-probs
    sub = policy.logprobs(rollout, torch.tensor([2, 0])).logps
    torch.testing.assert_close(sub, logps[[2, 0]], atol=1e-5, rtol=0)


def test_rollouts_and_sft_traces_run_crops_in_the_answers_frame(tool_trainer):
    """A Qwen2-VL-style sample (coord_format qwen2, 0-1000) gets its crop cut at pixels of the model's input, in a
    rollout and in an SFT trace alike."""
    from mmrl.pipelines.vlm.tool_rollout import trace

    trainer = tool_trainer()
    policy = trainer.policy
    seen = []

    def crop(image, *box):
        seen.append((image.size, box))
        return image.crop(tuple(int(round(v)) for v in box))

    crop.box_args = True
    policy.tools = {"crop": crop}
    script(policy, ["<tool>crop(0, 0, 500, 250)</tool>"])
    items = trainer.prompts.next_batch(1)
    items[0].metadata["coord_format"] = "qwen2"
    policy.rollout(items, 2, generator=torch.Generator().manual_seed(0))
    (size, box), *_ = seen
    assert box == pytest.approx((0, 0, size[0] / 2, size[1] / 4))
    images, _ = policy.media(items[0])
    seen.clear()
    row = trace(policy, "<tool>crop(0, 0, 500, 250)</tool><answer>1</answer>", images[0], 0, items[0].metadata)
    assert row.calls[0].ok and seen[0][1] == pytest.approx((0, 0, images[0].size[0] / 2, images[0].size[1] / 4))


def test_replay_matches_an_independent_forward_of_the_whole_sequence(tool_trainer):
    """The same log-probs from the model called directly on one row built by hand: the prompt's ids, the completion's
    ids, the prompt's image and the crop (cut here from the original image) through the processor."""
    trainer = tool_trainer()
    policy = trainer.policy
    script(policy, [CALL])
    items = trainer.prompts.next_batch(2)
    rollout = policy.rollout(items, 2, generator=torch.Generator().manual_seed(1))
    logps = policy.logprobs(rollout, torch.arange(len(rollout))).logps
    images, _ = policy.media(items[0])
    crop = images[0].crop((0, 0, 40, 30))
    processed = policy.processor.image_processor(images=[images[0], crop], return_tensors="pt")
    row = 1
    keep = rollout.prompt_mask[row].bool()
    length = int(rollout.attention[row].sum())
    ids = torch.cat([rollout.prompt_ids[row][keep], rollout.completion_ids[row, :length]]).unsqueeze(0)
    model = policy.base_model
    types = (ids == model.config.image_token_id).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                       pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"]).logits[0]
    suppressed = policy.suppressed_ids
    logits[:, suppressed] = float("-inf")
    prompt_len = int(keep.sum())
    scores = logits[prompt_len - 1:prompt_len - 1 + length].log_softmax(-1)
    expected = scores.gather(-1, rollout.completion_ids[row, :length].unsqueeze(-1)).squeeze(-1)
    own = rollout.mask[row, :length] > 0
    torch.testing.assert_close(logps[row, :length][own], expected[own], atol=1e-5, rtol=0)


def test_max_tool_calls_and_failed_calls(tool_trainer):
    trainer = tool_trainer("generation.max_tool_calls=2", "generation.max_new_tokens=96")
    policy = trainer.policy
    bad, good = "<tool>crop(1, 2)</tool>", "<tool>crop(0, 0, 28, 28)</tool>"
    script(policy, [bad, good, good])  # the third call is past the budget of calls: plain text
    rollout = policy.rollout(trainer.prompts.next_batch(1), 2, generator=torch.Generator().manual_seed(0))
    for i, (text, calls) in enumerate(zip(rollout.completions, rollout.tool_calls)):
        assert [c.ok for c in calls] == [False, True]
        assert "crop" in calls[0].error and f"<observation>error: {calls[0].error}</observation>" in text
        assert text.count(good) == 2 and text.count("<observation>") == 2  # the second good call got no response
        assert calls[1].start == calls[0].response_end
        assert len(rollout.vision[i].image_grid_thw) == 2  # the failed call returned no view
        assert rollout.mask[i].sum() <= 96
    assert rollout.extras["tool_errors"].tolist() == [1.0, 1.0]
    greedy = policy.sample_eval(trainer.prompts.next_batch(1))  # evaluation runs the tools too (no script left)
    assert len(greedy) == 1


def sliver(image, width: float):
    """A tool of the user's returning a view the Qwen processor refuses (aspect ratio past 200)."""
    return image.resize((int(width), 1))


def test_a_call_whose_view_or_echo_cannot_enter_the_context_is_an_error_observation(tool_trainer):
    """A view the processor refuses (a user tool's 400 x 1 sliver) ended the run with its ValueError; a call spelling
    <|image_pad|> in plain tokens came back in the parse error's echo as the special id, an image slot with no
    image (the next turn's generate failed: tokens 14, features 12). Both are now error observations, and the
    rollout trains on. The built-in crop refuses a sliver past 100:1 (DeepEyes' validate_bbox)."""
    image = Image.new("RGB", (300, 20))
    with pytest.raises(ToolError, match="sliver"):
        run_call("crop(0, 0, 300, 2)", resolve_tools(["crop"]), image)
    assert run_call("crop(0, 0, 200, 2)", resolve_tools(["crop"]), image).size == (200, 2)
    trainer = tool_trainer("generation.tools=[crop, test_tools:sliver]", "generation.max_new_tokens=96")
    policy = trainer.policy
    script(policy, ["<tool>sliver(400)</tool>", "<tool>crop(<|image_pad|>)</tool>"], as_text=True)
    rollout = policy.rollout(trainer.prompts.next_batch(1), 2, generator=torch.Generator().manual_seed(0))
    image_id = policy.base_model.config.image_token_id
    for i, calls in enumerate(rollout.tool_calls):
        assert [c.ok for c in calls[:2]] == [False, False]
        assert "aspect ratio" in calls[0].error and "cannot parse" in calls[1].error
        assert len(rollout.vision[i].image_grid_thw) == 1  # the prompt's image only
        observations = [t for t, own in zip(rollout.completion_ids[i].tolist(), rollout.mask[i].tolist()) if not own]
        assert observations and image_id not in observations  # the echo carries the text, not the special id
    assert rollout.extras["tool_errors"].tolist() == [2.0, 2.0]


# ---------------------------------------------------------------------------------------------- TACO


def test_ogar_routes_the_outcome_advantage_and_dapr_credits_each_call():
    taco = parse_spec({"name": "taco", "accuracy": "acc"}, 0)
    mask = torch.ones(3, 10)
    calls = [[ToolCall(0, 3, 5, "a", value=0.5), ToolCall(5, 7, 8, "b", value=0.0)],  # useful, redundant
             [ToolCall(0, 4, 6, "c", value=-1.0)],  # misleading
             []]
    rollout = SimpleNamespace(mask=mask, tool_calls=calls)
    advantages = torch.tensor([1.0, -2.0, 0.75])
    out = taco.transform(TransformContext(advantages=advantages, scores={}, rollout=rollout, update=0,
                                          total_updates=1))
    expected = advantages.unsqueeze(1).expand(3, 10).clone()
    expected[0, 0:3] = 1.0 + 0.5  # a success's useful call: outcome + its value
    expected[0, 5:7] = 0.0  # redundant: neither channel
    expected[1, 0:4] = -2.0 - 1.0  # a failure's misleading call
    torch.testing.assert_close(out, expected)
    # a useful call in a failure / a misleading one in a success gets only its own value
    flipped = taco.transform(TransformContext(advantages=-advantages, scores={}, rollout=rollout, update=0,
                                              total_updates=1))
    assert flipped[0, 0:3].tolist() == [0.5] * 3 and flipped[1, 0:4].tolist() == [-1.0] * 4
    assert flipped[0, 3:5].tolist() == [-1.0] * 2 and flipped[2].tolist() == [-0.75] * 10
    plain = parse_spec({"name": "taco", "accuracy": "acc", "routing": False, "dapr_weight": 0.0}, 0)
    same = plain.transform(TransformContext(advantages=advantages, scores={}, rollout=rollout, update=0,
                                            total_updates=1))
    torch.testing.assert_close(same, advantages.unsqueeze(1).expand(3, 10))
    half = parse_spec({"name": "taco", "accuracy": "acc", "dapr_weight": 0.5}, 0)
    assert half.transform(TransformContext(advantages=advantages, scores={}, rollout=rollout, update=0,
                                           total_updates=1))[0, 0].item() == pytest.approx(1.25)


class Rows(SimpleNamespace):
    def __len__(self):
        return len(self.prompts)


def test_dapr_probes_before_and_after_each_call(monkeypatch):
    import mmrl.pipelines.vlm.tool_rollout as tool_rollout

    taco = parse_spec({"name": "taco", "accuracy": "acc", "probe": "<answer>"}, 0)
    calls = [[ToolCall(0, 6, 9, "a", opened=2), ToolCall(9, 12, 15, "b", opened=10)],
             [ToolCall(0, 4, 6, "c", opened=1)]]
    rollout = Rows(tool_calls=calls, prompts=["q0", "q1"], metadata=[{"k": 0}, {"k": 1}])
    seen = {}

    def fake_probe(policy, r, rows, lengths, suffix, *, max_new_tokens, stop):
        seen.update(rows=rows, lengths=lengths, suffix=suffix, stop=stop)
        return [f"<answer>{row}:{length}</answer>" for row, length in zip(rows, lengths)]

    rewards = {"0:2": 0.0, "0:10": 1.0, "1:1": 1.0, "0:9": 1.0, "0:15": 1.0, "1:6": 0.0}

    def score_outputs(outputs, prompts, metadata):
        assert prompts == ["q0", "q0", "q1"] * 2 and metadata[2] == {"k": 1}
        return {"acc": torch.tensor([rewards[o[8:-9]] for o in outputs])}

    monkeypatch.setattr(tool_rollout, "probe", fake_probe)
    ctx = RewardContext(rollout=rollout, items=[], scores={"acc": torch.zeros(2)}, weights={"acc": 1.0}, config=None,
                        policy=None, accelerator=None, update=0, score=None, score_outputs=score_outputs, sample=None,
                        intermediate=None, stats={}, timer={})
    out = taco.rewards(ctx)
    assert seen == {"rows": [0, 0, 1] * 2, "lengths": [2, 10, 1, 9, 15, 6], "suffix": "<answer>", "stop": "</answer>"}
    assert [c.value for row in calls for c in row] == [1.0, 0.0, -1.0]  # useful, redundant, misleading
    assert out.weights == {"acc": 1.0} and torch.equal(out.scores["acc"], torch.zeros(2))
    assert ctx.stats["taco/calls"] == 1.5 and ctx.stats["taco/useful"] == pytest.approx(1 / 3)
    assert ctx.stats["taco/misleading"] == pytest.approx(1 / 3) and ctx.stats["taco/value"] == 0.0


def test_taco_needs_tools_and_its_reward():
    base = REPO / "configs/tiny/vlm_grounding.yaml"
    with pytest.raises(ConfigError, match="generation.tools"):
        load_config(base, ["algorithm.variants=[{name: taco, accuracy: iou}]"])
    with pytest.raises(ConfigError, match="not one of the configured rewards"):
        load_config(base, ["algorithm.variants=[{name: taco, accuracy: nope}]", "generation.tools=[crop]"])
    with pytest.raises(VariantError, match="accuracy"):
        parse_spec({"name": "taco"}, 0)
    assert load_config(base, ["algorithm.variants=[{name: taco, accuracy: iou}]", "generation.tools=[crop]"])


def test_probe_continues_each_cut_with_the_views_it_has_seen(tool_trainer):
    trainer = tool_trainer()
    policy = trainer.policy
    script(policy, [CALL])
    rollout = policy.rollout(trainer.prompts.next_batch(1), 2, generator=torch.Generator().manual_seed(0))
    policy.model.generate = type(policy.model).generate.__get__(policy.model)  # the real one again
    call = rollout.tool_calls[0][0]
    from mmrl.pipelines.vlm.tool_rollout import contexts, probe

    # before the call the context has one image, after its response two: a wrong count would not run at all
    outs = probe(policy, rollout, [0, 0], [call.opened, call.response_end], "<answer>", max_new_tokens=5, stop=None)
    assert all(o.startswith("<answer>") for o in outs)
    # the same continuation as greedy generation from the hand-built context (prompt + prefix + probe)
    prompt = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    suffix = policy.tokenizer("<answer>", add_special_tokens=False)["input_ids"]
    prefix = rollout.completion_ids[0, :call.opened].tolist() + suffix
    ids, attention, types = contexts(policy, [(prompt, [0] * len(prompt))], [(prefix, [0] * len(prefix))])
    types = (ids == policy.base_model.config.image_token_id).long()
    from mmrl.pipelines.vlm.qwen import Vision

    first = rollout.vision[0]
    only_prompt = Vision(image_grid_thw=first.image_grid_thw[:1], image_features=first.image_features[:1],
                         pixel_values=first.pixel_values[:int(first.image_grid_thw[0].prod())])
    config = policy.sampling_config(greedy=True)
    config.max_new_tokens = 5
    sequences = policy.generate(ids, attention, types, [only_prompt], config, torch.Generator().manual_seed(0))
    new = sequences[0, ids.shape[1]:].tolist()
    ends = [k for k, t in enumerate(new) if t in policy.eos_ids]
    assert outs[0] == "<answer>" + policy.tokenizer.decode(new[:ends[0]] if ends else new, skip_special_tokens=True)


def test_a_taco_run_trains_on_tool_rollouts(tool_trainer):
    import json

    trainer = tool_trainer("algorithm.variants=[{name: taco, accuracy: iou}]", "train.steps=2",
                           "logging.eval_every=0")
    script(trainer.policy, [CALL], every_update=True)  # each update's first turn calls; the rest is sampled
    trainer.train()
    rows = [json.loads(line) for line in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["completions/tool_calls"] for r in rows] == [1.0, 1.0]
    assert all(r["taco/calls"] == 1.0 and r["completions/tool_errors"] == 0.0 for r in rows)
    assert all(r["taco/useful"] + r["taco/misleading"] + r["taco/redundant"] == pytest.approx(1.0) for r in rows)


def test_sft_on_tool_traces_inserts_each_response_unlabelled(tool_trainer):
    """TACO's first stage: an SFT target that writes calls gets each call's response inserted, as a rollout would
    hold it: attended to, carrying no label, its view after the prompt's image."""
    import dataclasses

    from mmrl.sft import batch_loss, collate

    trainer = tool_trainer()
    policy = trainer.policy
    item = trainer.prompts.next_batch(1)[0]
    target = CALL + "<answer>[1, 2, 30, 40]</answer>"
    sample = dataclasses.replace(item, metadata={**item.metadata, "sft_target": target})
    batch = collate(policy, [sample])
    width = batch.completion_width
    completion, labels = batch.input_ids[0, -width:], batch.labels[0, -width:]
    text = policy.tokenizer.decode(completion, skip_special_tokens=True)
    assert text == CALL + "\n<observation></observation>\n<answer>[1, 2, 30, 40]</answer>"
    call_ids = policy.tokenizer(CALL, add_special_tokens=False)["input_ids"]
    assert labels[:len(call_ids)].tolist() == call_ids  # the call is taught
    pads = (completion == policy.base_model.config.image_token_id).nonzero().flatten()
    response = policy.tool_response_template.format(image="x")
    assert len(pads) == int(batch.model_kwargs["image_grid_thw"][1].prod()) // 4  # the view's merged tokens
    unlabelled = (labels == -100).nonzero().flatten()
    assert unlabelled.min() == len(call_ids) and pads.max() < unlabelled.max()  # the response, nothing after it
    assert policy.tokenizer.decode(completion[unlabelled]).startswith(response.split("x")[0])
    assert labels[-1] == policy.eos_ids[0]  # the end-of-turn token closes the target
    loss, tokens = batch_loss(policy, batch, train=True)
    assert tokens == int((labels != -100).sum()) and torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())


def test_reward_variants_find_each_samples_item_in_a_tool_rollout(tool_trainer):
    """A tool rollout keeps a prompt row per sample: variants that re-prompt from the data item (PRCO, Vision-SR1)
    must map sample i to its item through ``item_index``, not through its prompt row."""
    trainer = tool_trainer()
    policy = trainer.policy
    script(policy, [CALL])
    items = trainer.prompts.next_batch(2)
    rollout = policy.rollout(items, 2, generator=torch.Generator().manual_seed(0))
    assert rollout.prompt_index.tolist() == [0, 1, 2, 3] and rollout.item_index.tolist() == [0, 0, 1, 1]
    assert [item_of(rollout, items, i) for i in range(4)] == [items[0], items[0], items[1], items[1]]
    plain = Rows(prompts=["a", "b"], prompt_index=torch.tensor([1, 0]))  # no item_index: prompt rows are items
    assert [item_of(plain, items, i) for i in range(2)] == [items[1], items[0]]
