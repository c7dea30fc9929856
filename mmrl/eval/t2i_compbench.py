"""T2I-CompBench in ``mmrl eval``: the six original categories, each scored with its official metric.

    mmrl eval RUN benchmarks=[t2i_compbench]                      # all six categories
    mmrl eval RUN benchmarks=[t2i_compbench:color+spatial] limit=20 images_per_prompt=2

Benchmark names: ``t2i_compbench`` (color, shape, texture, spatial, non_spatial, complex) and
``t2i_compbench:CATEGORY[+CATEGORY...]`` (a subset, in the order given; ``,`` separates categories too, but
``benchmarks=[...]`` is a YAML list split at commas, so quote such a name there:
``benchmarks=["t2i_compbench:color,shape"]``). The prompts are the official test sets, the shipped ``*_val.txt``
lists (300 prompts each; ``t2i_split=val_seen|val_unseen`` for the attribute-binding categories' seen/unseen
halves), read by :func:`mmrl.eval.benchmarks.load_t2i_compbench` and checked against the
sha256 pinned here. One benchmark holds the prompts of all its categories, **interleaved**: prompt index ``i`` is
category ``i % C`` (in the name's order) at position ``i // C`` of its list while every list lasts, then the
longer lists' remaining prompts in the same round-robin; so ``limit=N`` takes the first ``~N/C`` prompts of every
category, and a larger limit later keeps every earlier row. ``EvalItem.category`` is the category,
``metadata`` holds ``category``, ``line`` (1-based, in its file), ``category_index`` and, for complex,
``complex_kind``.

Protocol (:func:`defaults`): T2I-CompBench's ``GORS_finetune/inference_eval.py`` draws **10 images per prompt**
with seeds 42, 43, ..., 51 (mmrl's rule ``seed + k`` with seed 42) at SD-2-base's 512x512; steps and guidance are
Flow-GRPO's SD3.5-M evaluation settings (40 steps, CFG 4.5; the official script: DDIM, 30 steps, CFG 7.5 for
SD-2-base). The protocol's ``prompts_file`` is the first category's list; **every** list read (and complex's
``complex_val_{spatial,action}.txt``) is named with its sha256 in ``scorer_settings.prompt_files``, which the
protocol hash covers.

Scoring per category; each image gets ``score`` (the category's official per-image number) and its parts:

* **color, shape, texture: BLIP-VQA** (official scorer, through transformers): ``BLIPvqa_eval/BLIP_vqa.py``. The
  prompt is split into noun phrases (spaCy ``en_core_web_sm`` ``noun_chunks``, dropping ``top``, ``the side``,
  ``the left``, ``the right``); the first ``np_num`` (8) phrases are asked as ``"<phrase>?"`` (``pre_question``:
  lower case, ``.!"()*#:;~`` removed) of ``BlipForQuestionAnswering`` ``Salesforce/blip-vqa-capfilt-large`` (the
  official ``model_base_vqa_capfilt_large.pth``, converted by transformers). ``P(yes)`` is ``models/blip_vqa.py``
  ``vqa_prob`` reproduced on transformers' modules: the question's first token replaced by ``[ENC]``, BERT
  tokenisation truncated to 35 tokens, the text encoder over the ViT image embedding, then **one** text-decoder step
  from ``[DEC]``: ``softmax(logits)[yes] / (softmax[yes] + softmax[no])`` (the two answers' first-token
  likelihoods, as the official code ranks them; "yes" and "no" are single tokens). Image preprocessing is the
  official test transform: PIL bicubic resize to ``blip_image_size`` x ``blip_image_size`` (480, ``vqa.yaml``), /255,
  normalised with CLIP's mean and std. The vision LayerNorms run with BLIP's eps 1e-6 (``models/vit.py``; the
  converted checkpoint's config carries ``BlipVisionConfig``'s default 1e-5, overridden at load). **Position
  embeddings**: the official ``blip_vqa(image_size=480)`` uses the original checkpoint's own 480-px embeddings
  (``visual_encoder.pos_embed``, 30x30 + 1 = 901 positions). The hub checkpoint does not have them:
  transformers' conversion script (``convert_blip_original_pytorch_to_hf.py``) loaded the original at
  ``image_size=384``, which bicubic-interpolated them down to 24x24 + 1 = 577. ``blip_checkpoint=PATH`` (the
  original ``model_base_vqa_capfilt_large.pth``) puts the original 901 back (:func:`apply_blip_checkpoint`; the
  model's image size becomes 480, so 480-px input is not interpolated): the official embeddings. Without it (the
  default) transformers interpolates the stored 24x24 back to 30x30 (``interpolate_pos_encoding``, bicubic), a
  **named difference**: the 30 -> 24 -> 30 round trip does not restore the original embeddings (the settings record
  ``blip_position_embeddings: blip_model``, shown as overridden from the official ``blip_checkpoint``);
  ``blip_image_size=384`` runs the converted weights as stored. Image score =
  :func:`mmrl.eval.scoring.blip_vqa_image_score` (the product).
* **spatial: UniDet** is not in transformers, so a **named substitute detector** takes its place: mmrl's GenEval
  detector (:mod:`mmrl.rewards.geneval`; default Mask2Former ``facebook/mask2former-swin-small-coco-instance``, or
  OWL-ViT / OWLv2 with ``t2i_detector=``). ``UniDet_eval/2D_spatial_eval.py``'s rules are kept: the two objects are
  the prompt's first and last ``NOUN`` (spaCy), ``girl/boy/man/woman`` are ``person``, the spatial word is the first
  of the official list found in the prompt; detections above ``t2i_detector_threshold`` (0.5, UniDet's
  ``--confidence-threshold``), most confident first; each object takes the first detection with its label; score
  = :func:`mmrl.eval.scoring.t2i_spatial_image_score`. Boxes are rescaled to the frame UniDet saw
  (``Resize(479, max_size=480)``, the size torchvision computes: 479 px for a square image, 466 x 480 for 256 x 264),
  since the ``next to`` rule's 150-pixel distance is in that frame. **Vocabulary**: UniDet's unified label space has
  722 labels (Objects365, COCO, OpenImages, Mapillary), of which 448 are single words a noun can equal; COCO has 80.
  Nouns are mapped to the detector's labels with :func:`mmrl.rewards.geneval.canonical_class` (lower case; ``sofa`` ->
  ``couch``, ``television`` -> ``tv``, ``mouse`` -> ``computer mouse``, ...); a noun that is no COCO class (e.g.
  ``frog``, ``lamp``, ``desk``: 20 of the 50 object nouns of ``spatial_val.txt``) is never found by a COCO detector,
  so its prompts score 0 where UniDet may find it; OWL is queried with the two nouns themselves (open vocabulary; its
  sigmoid scores are lower than UniDet's, tune the threshold).
* **non_spatial: CLIPScore** (official scorer, through transformers): ``CLIPScore_eval/CLIP_similarity.py``, the
  cosine of the L2-normalised CLIP ViT-B/32 image and prompt embeddings (OpenAI's ``ViT-B/32`` =
  ``openai/clip-vit-base-patch32`` as a transformers ``CLIPModel``; not x100, not clipped), one image per forward.
  Images are preprocessed as OpenAI's ``clip.load`` transform does (:func:`clip_pixels`: PIL bicubic resize of the
  shorter side, torchvision's centre-crop rounding, /255, CLIP mean/std), with the processor loaded through
  transformers' PIL backend (its torchvision backend's resize is up to one uint8 level off OpenAI's).
  **Precision** (``t2i_clip_dtype``): the official ``clip.load`` on CUDA keeps OpenAI's float16 weights and computes
  the features, their normalisation and the cosine in float16; mmrl's default ``float32`` is a **named
  difference** (recorded, shown as overridden from the official ``float16``); ``t2i_clip_dtype=float16`` runs the
  transformers model in half precision with the normalisation and cosine in float16 (close to, not bit-identical
  with, OpenAI's module code, whose LayerNorms compute in float32; it also runs on CPU, whose float16 kernels round
  differently from CUDA's).
* **complex: 3-in-1** (``3_in_1_eval/3_in_1.py``): per image from BLIP-VQA on the prompt, the spatial score with the
  ``--complex`` object extraction (the nouns around the first of ``on top of / on bottom of / on the left / on the
  right / next to / on side of / near``, exactly two or none) and the CLIP cosine of the prompt with its adjectives
  removed (``--complex``: the tokens whose POS is not ``ADJ``, joined by spaces); combined by the prompt's
  ``complex_kind`` with :func:`mmrl.eval.scoring.t2i_complex_image_score` (spatial: (spatial + BLIP)/2; action:
  (CLIP + BLIP)/2; all: the mean of the three). Only the parts the kind uses are computed.

**Noun phrases and POS tags** (``noun_phrases=``): the official scorers use spaCy ``en_core_web_sm``. ``spacy``
uses it (``pip install spacy`` and the ``en_core_web_sm`` model, or ``spacy_model=`` a package name or folder);
``rules`` uses mmrl's **rule-based substitute** (:func:`rule_parse`: a tokenizer, a lexicon POS tagger and a noun
chunker written for T2I-CompBench's prompt templates, no dependency); ``auto`` (default) takes spaCy when it and its
model are installed, else the rules. The value used is recorded in the settings (the default setting is
``spacy``, so the rules show as an overridden setting). Measured against spaCy 3.8 ``en_core_web_sm`` on the shipped
val prompts (the exact list or pair must match): BLIP noun-phrase lists 93 % (color), 93 % (shape), 90 % (texture),
89 % (complex); spatial objects 100 % (spatial), 97 % (complex); the adjective-free CLIP text 78 % (complex). Most
differences are spaCy's own slips and inconsistencies (``a blue rose and a green tulip``: spaCy tags ``rose`` a verb
and finds one phrase; ``a metallic spoon and wooden chopsticks`` is one phrase to it, ``a metallic keychain and
wooden chopsticks`` two), some the rules' (an unlisted verb read as a noun). The official runs used a 2023
``en_core_web_sm``, which may differ from 3.8 too.

``official_quirks=true`` reproduces the official scripts' known oddities (default false: the rules as documented):
BLIP-VQA values rounded to 4 decimals and multiplied in float32 (:func:`~mmrl.eval.scoring.blip_vqa_image_score`);
``on top of`` gives position 0 (:func:`~mmrl.eval.scoring.t2i_position_score`); and a noun that is not exactly one
of UniDet's single-word labels (e.g. ``cow``, ``table``, ``phone``, ``bag``, ``apples``: UniDet's labels read
``cattle, cow``, ``table, desk``, ...) is never found, as the official ``obj1 in obj`` test never finds it.

Summary (:meth:`T2ICompBenchScorer.summarize`): per category :func:`mmrl.eval.scoring.t2i_compbench_summary`
(``score``: the mean over its images, ``n``, ``num_unjudged``, ``metric``) plus ``scorer`` (official or the named
substitute); complex adds its parts' means and the kinds' counts. T2I-CompBench reports no number across
categories; with several categories ``mean_of_categories`` is **mmrl's own** unweighted mean of the category
scores (the headline; a single category's headline is its score).
"""
from __future__ import annotations

import difflib
import importlib.util
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mmrl.eval import runner as _runner_module
from mmrl.eval.runner import BenchmarkSpec, EvalError, EvalItem, Scorer

__all__ = ["EVAL_KEYS", "CATEGORIES", "PINNED_SHA256", "DEFAULT_BLIP", "DEFAULT_CLIP", "DEFAULT_DETECTOR",
           "Token", "Parsed", "rule_parse", "blip_noun_phrases", "blip_question", "spatial_objects",
           "complex_spatial_objects", "remove_adjectives", "official_frame", "benchmark", "load_items", "defaults",
           "make_scorer", "main_keys", "T2ICompBenchScorer", "blip_pixels", "apply_blip_checkpoint", "clip_pixels"]

#: The original T2I-CompBench categories this plug-in scores (the ++ ones, 3d_spatial and numeracy, are not yet).
CATEGORIES = ("color", "shape", "texture", "spatial", "non_spatial", "complex")
_ATTRIBUTE = ("color", "shape", "texture")
_NOT_YET = {"3d_spatial": "T2I-CompBench++'s 3d_spatial (UniDet + DPT depth) is not in mmrl eval yet",
            "numeracy": "T2I-CompBench++'s numeracy (UniDet counting) is not in mmrl eval yet"}
_SPLITS = ("val", "val_seen", "val_unseen")

DEFAULT_BLIP = "Salesforce/blip-vqa-capfilt-large"
DEFAULT_CLIP = "openai/clip-vit-base-patch32"
DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"  # mmrl.rewards.geneval.DEFAULT_DETECTOR
_SPACY_MODEL = "en_core_web_sm"
_SOURCE = "Karine-Huang/T2I-CompBench 1b70949"

#: sha256 of the shipped lists (``assets/benchmarks/t2i_compbench/dataset/<name>``).
PINNED_SHA256 = {
    "color_val.txt": "1634259756dbc77d13093d907d414480080ec9790a8c97ad09efaea7b2534f2d",
    "color_val_seen.txt": "9b2859d9107b2ed4cae95808749de5ac3557a280eb79067a8ef55c4eec7711a9",
    "color_val_unseen.txt": "7fa6f76bb602df9624262ee819f0b1ede20c14880cbacfb7fe8ce79f8157b5c2",
    "shape_val.txt": "37e1a276906c7ea9516cbd7ac8501be896006c0c17ca7344f260562834455bae",
    "shape_val_seen.txt": "5581f4c8904e11b00fe6e33d2cc21a5822f59f39f43fa51479bc30aa6d458a4d",
    "shape_val_unseen.txt": "35b17a7b015405c5c96c51c5cd969a786b3855c48e6f68c184626f5db444d987",
    "texture_val.txt": "fbb5363515b4a28009e360afaaaf389d2dd2289e50dbb0c6ef4ea0c7fe4f3d4f",
    "texture_val_seen.txt": "5548a49c68efefbbc88b2eb6dffd0f141373235370659158a5d15fdbd82c8c96",
    "texture_val_unseen.txt": "6035f7dd8fd9efd6fbeedef64b04e1f651e977b2a1b9c47365c9e4eed0edc27b",
    "spatial_val.txt": "8707a1d7e42ce3002d95363cf55f74bd043c843ae27108f5125aaaa7840ca988",
    "non_spatial_val.txt": "04c56cc9ac441dc9ea6c5157652058bd1635b5308526dd31bb29a1caab9a758d",
    "complex_val.txt": "1b808018b8d9916db3d47d5aa2ef18377a3549a56901a474156f799824cdf3b4",
    "complex_val_spatial.txt": "6c7ac0ab75c7c9080cfc7b421fb059b9b0febb98471707aeedf58771088abc02",
    "complex_val_action.txt": "d49ee4c7f99e3f3379fb8704a54ff5288b83bb412971edf616a4721c2473308e",
}

EVAL_KEYS: dict[str, str] = {
    "t2i_split": "T2I-CompBench prompt list: val (default, the official 300-prompt test sets), val_seen or "
                 "val_unseen (color/shape/texture only)",
    "blip_model": "T2I-CompBench BLIP-VQA model: hub id or folder of a transformers BlipForQuestionAnswering with "
                  f"its tokenizer (default {DEFAULT_BLIP})",
    "blip_image_size": "T2I-CompBench BLIP-VQA input size in px (default 480, the official vqa.yaml; 384 = the "
                       "converted checkpoint's stored position embeddings)",
    "blip_checkpoint": "T2I-CompBench BLIP-VQA: path of the original BLIP model_base_vqa_capfilt_large.pth; its "
                       "480-px visual_encoder.pos_embed (30x30+1) replaces the converted checkpoint's 384-px one, as "
                       "the official blip_vqa(image_size=480) uses it (default: none, the 384-px embeddings "
                       "interpolated to 480, a named difference)",
    "np_num": "T2I-CompBench BLIP-VQA: noun phrases asked per prompt (default 8, BLIP_vqa.py --np_num)",
    "noun_phrases": "T2I-CompBench noun phrases and POS tags: auto (default: spacy if installed, else rules), spacy "
                    "(spaCy en_core_web_sm, official) or rules (mmrl's rule-based substitute)",
    "spacy_model": f"T2I-CompBench spaCy pipeline: package name or folder (default {_SPACY_MODEL})",
    "t2i_detector": "T2I-CompBench spatial detector standing in for UniDet: hub id or folder of a Mask2Former or "
                    f"OWL-ViT/OWLv2 checkpoint (default {DEFAULT_DETECTOR})",
    "t2i_detector_threshold": "T2I-CompBench spatial: keep detections scoring above this (default 0.5, UniDet's "
                              "confidence threshold)",
    "t2i_clip_model": "T2I-CompBench non_spatial/complex CLIPScore model: hub id or folder of a transformers "
                      f"CLIPModel with its processor (default {DEFAULT_CLIP}, OpenAI's ViT-B/32)",
    "t2i_clip_dtype": "T2I-CompBench CLIPScore precision: float32 (default, a named difference) or float16 (the "
                      "official clip.load on CUDA: half weights, features, normalisation and cosine in float16)",
    "official_quirks": "true: reproduce the official scorers' known quirks (T2I-CompBench: 4-decimal BLIP values "
                       "in float32, 'on top of' scores position 0, nouns outside UniDet's single-word labels are "
                       "never found); default false",
}

_BLIP_EXCLUDED = ("top", "the side", "the left", "the right")  # BLIP_vqa.py Create_annotation_for_BLIP
_COMPLEX_PREPOSITIONS = ("on top of", "on bottom of", "on the left", "on the right", "next to", "on side of", "near")
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # BLIP's test transform (data/__init__.py), = CLIP's
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_QUESTION_MAX_TOKENS = 35  # models/blip_vqa.py: tokenizer(question, truncation=True, max_length=35)
_UNIDET_FRAME = (479, 480)  # experts/model_bank.py: transforms.Resize(size=479, max_size=480)
_BLIP_POS_KEY = "visual_encoder.pos_embed"  # BLIP's models/vit.py VisionTransformer.pos_embed, checkpoint["model"]
_BLIP_LAYER_NORM_EPS = 1e-6  # BLIP's models/vit.py: partial(nn.LayerNorm, eps=1e-6); BlipVisionConfig's default 1e-5
_CLIP_DTYPES = ("float32", "float16")

#: UniDet's labels (``UniDet_eval/dataset/detection_features.pt``, the ``learned_mAP+M`` unified label space) that
#: are one word: the only ones the official ``obj1 in obj`` test can match a noun to (``official_quirks``).
_UNIDET_WORDS = frozenset("""
accordion aircraft airplane ambulance animal ant antelope apple artichoke asparagus avocado backpack bagel ball
balloon banana banner baozi barbell barrel basket basketball bat bathtub beaker bear bed bee beehive beer beetle
belt bench bench1 bicycle bicyclist bidet billboard billiards binoculars bird blender boat book bookcase boot boots
bottle bowl boy bracelet brassiere bread bread/bun broccoli broom brush building bull bus bust butterfly cabbage
cabinet/shelf cabinetry cake calculator camel camera canary candle candy canned cannon canoe car caravan carnivore
carpet carriage carrot castle cat caterpillar cd cello centipede chainsaw chair cheese cheetah cherry chicken chips
chopsticks cigar clock clutch coat cocktail coconut coffee coin comb converter corn couch countertop crab crane
crocodile croissant crosswalk crown crutch cucumber cue cup cupboard curtain cymbal dagger dates deer desk dessert
dice dinosaur dog dolphin donkey door dragonfly drawer dress drink drum duck dumbbell durian eagle earphone earrings
egg eggplant elephant envelope eraser fedora fireplace fish flag flashlight flower flowerpot flute folder fork
fountain fox frisbee frog fruit furniture garlic giraffe girl glasses globe glove goat goggles goldfish gondola
goose guacamole guitar hamburger hamimelon hammer hamster handbag handgun hanger harp harpsichord hat headphones
helicopter helmet hockey honeycomb horn horse house hurdle insect invertebrate iron jacket jaguar jeans jellyfish
jug juice kangaroo kettle key kite knife ladder ladybug lamp lantern laptop lavender lemon leopard lettuce
lifejacket lighter lighthouse lily limousine lion lizard lobster lynx mailbox man mango mangosteen manhole maple
marker medal microphone microscope microwave miniskirt mirror missile monkey mop motorcycle motorcyclist mouse1
muffin mug mule mushroom nail necklace nightstand notepaper nuts oboe okra onion orange organ ostrich otter oven owl
oyster paddle pancake papaya parachute parrot pasta peach pear penguin pepper person piano pie pig pigeon pillow
pineapple pitaya pitcher pizza plate platter pliers plum pole pomegranate pomelo popcorn porch porcupine poster
potato pretzel printer projector pumpkin rabbit racket radiator radio radish raven refrigerator remote reptile
rhinoceros rice ring rocket rose ruler sailboat salad sandals sandwich saucer sausage saw saxophone scale scallop
scarf scissors scoreboard screwdriver sculpture seafood seahorse shark sheep shelf shirt shorts shotgun shrimp sink
skateboard skirt skull skyscraper slide slippers snail snake snowboard snowman snowmobile snowplow sock sombrero
sparrow speaker spider spoon squirrel stairs stapler starfish steak stool strawberry stretcher stroller suit
suitcase sunflower sunglasses surfboard sushi suv swan swimwear swing sword tableware taco tank target tart taxi tea
teapot telephone television tent tiara tick tie tiger tire toaster toilet toiletries tomato tong toothbrush
toothpaste torch towel tower toy trailer train treadmill tree tricycle tripod trolley trombone trophy trousers truck
trumpet tuba turtle tv umbrella urinal van vase vegetable vehicle vent violin volleyball waffle watch watermelon
weapon whale wheel wheelchair willow window wine wok woman woodpecker wrench yak zebra zucchini
""".split())


def _error(message: str) -> EvalError:
    return EvalError(message)


# =============================================================================================== noun phrases


@dataclass(frozen=True)
class Token:
    """One token: its text, its Universal POS tag (spaCy's ``token.pos_``) and the whitespace after it."""

    text: str
    pos: str
    ws: str = " "


@dataclass(frozen=True)
class Parsed:
    """A prompt's tokens and noun chunks (spaCy's ``doc.noun_chunks`` texts, in order)."""

    tokens: tuple[Token, ...]
    noun_chunks: tuple[str, ...]


def _span_text(tokens: Sequence[Token]) -> str:
    """spaCy's ``Span.text``: the tokens with the whitespace between them, none after the last."""
    if not tokens:
        return ""
    return "".join(t.text + t.ws for t in tokens[:-1]) + tokens[-1].text


def blip_noun_phrases(parsed: Parsed) -> list[str]:
    """The phrases BLIP-VQA asks about (``Create_annotation_for_BLIP``): the noun chunks except ``top``,
    ``the side``, ``the left``, ``the right``."""
    return [c for c in parsed.noun_chunks if c not in _BLIP_EXCLUDED]


def blip_question(phrase: str) -> str:
    """The question asked about a phrase: ``"<phrase>?"`` through BLIP's ``pre_question`` (lower case,
    ``.!"()*#:;~`` removed, trailing spaces stripped, at most 50 words)."""
    question = re.sub(r"([.!\"()*#:;~])", "", f"{phrase}?".lower()).rstrip(" ")
    words = question.split(" ")
    return " ".join(words[:50]) if len(words) > 50 else question


def spatial_objects(parsed: Parsed) -> tuple[str | None, str | None]:
    """``2D_spatial_eval.py`` (simple prompts): the first and the last token tagged ``NOUN`` (``(None, None)``
    when there is none: the official script stops with an IndexError there)."""
    nouns = [t.text for t in parsed.tokens if t.pos == "NOUN"]
    return (nouns[0], nouns[-1]) if nouns else (None, None)


def complex_spatial_objects(parsed: Parsed) -> tuple[str | None, str | None]:
    """``2D_spatial_eval.py --complex``: for every position where a token span of 3, 2 or 1 tokens reads one of
    ``on top of, on bottom of, on the left, on the right, next to, on side of, near``: the nearest ``NOUN`` or
    ``PROPN`` before it, and the first ``NOUN`` after it (if none is found before the last token, the first
    ``PROPN`` followed by a non-``PROPN``). The two objects if exactly two were found, else ``(None, None)``."""
    tokens = list(parsed.tokens)
    n = len(tokens)
    objects: list[str] = []
    for i in range(n):
        k = next((m for m in (3, 2, 1) if _span_text(tokens[i:i + m]) in _COMPLEX_PREPOSITIONS), None)
        if k is None:
            continue
        for j in range(i - 1, -1, -1):
            if tokens[j].pos in ("NOUN", "PROPN"):
                objects.append(tokens[j].text)
                break
        reached_end = False
        for j in range(i + k, n):
            if tokens[j].pos == "NOUN":
                objects.append(tokens[j].text)
                break
            if j == n - 1:
                reached_end = True
        if reached_end:
            for j in range(i + k, n):
                if j + 1 < n and tokens[j].pos == "PROPN" and tokens[j + 1].pos != "PROPN":
                    objects.append(tokens[j].text)
                    break
    return (objects[0], objects[1]) if len(objects) == 2 else (None, None)


def remove_adjectives(parsed: Parsed) -> str:
    """``CLIP_similarity.py --complex``: the tokens not tagged ``ADJ``, joined by single spaces."""
    return " ".join(t.text for t in parsed.tokens if t.pos != "ADJ")


# ------------------------------------------------------------------ the rule-based substitute for spaCy

def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_R_DET = _words("a an the this these those each every another some any no either neither")
_R_POSS = _words("my your his its our their whose")
_R_PRON = _words("i you he she it we they me him us them myself yourself himself herself itself ourselves "
                 "themselves someone something somebody everyone everything everybody anyone anything nobody "
                 "nothing what which who whom")
_R_ADP = _words("of in on at with by from into onto over under near behind beside besides between through across "
                "above below beneath around against along among amongst toward towards for to up down past inside "
                "outside underneath atop within without upon like off out about after before during until "
                "throughout via amid amidst beyond except despite")
_R_CCONJ = _words("and or but nor")
_R_SCONJ = _words("as while because if when whenever where wherever though although since whereas how than "
                  "unless once")
_R_AUX = _words("is are was were be been being am will would can could shall should may might must do does did "
                "'re 'm")
_R_VERB_ALWAYS = _words(
    "has have had having sat sits lay lies lying hung hangs stood stands ran runs flew flies swam swims grew grows "
    "fell falls held holds sang sings spoke wore wears shone shines shine drove rode ate eats drank drinks took "
    "takes gave gives made makes saw sees went goes came comes sped sprang struck swung spun bit built caught felt "
    "found kept led lit met paid sent shot shook slid slept stuck swept taught told threw woke won dug drew blew "
    "broke chose froze shrank stole strode wove hid bent fed fled knelt leapt lent lost meant rang sank sought "
    "stung swore tore wept rests leans sways blooms hovers perches reflects sparkles glistens dangles overlooks "
    "contains reads drops features glows floats covers fills sleeps plays walks looks sitting standing wrote "
    "sank shrank rang sit swim grow lean hover sing fill reflect overlook surround carry soar melt shine stir serve "
    "give make take find keep explore provide attract avoid decorate illuminate soothe go write eat chug boil bake "
    "pound measure"
    "wearing holding looking waiting")
_R_VERB_BASE = _words(  # verb or noun by context
    "run walk play glow rest sway bloom dance cover hold wear float crash mix cook release catch love move read "
    "order sleep drink look watch ride sail paint display stand cut spread rose set fall winds light hang fly lie "
    "frame line")
_R_ADV = _words(
    "very too also just not n't quite really so always never often even again away together nearby forth otherwise "
    "almost still here there then now once most more less rather fully nearly barely ever")
_R_LY_NOT_ADV = _words(
    "friendly fly lily belly jelly family butterfly holy curly silly ugly lovely lonely chilly hilly woolly bubbly "
    "wobbly sparkly frilly prickly bully daily early only elderly lively likely unlikely costly deadly orderly "
    "fluffly smelly jolly reply supply ally rally dragonfly firefly bumblebee wiggly squiggly curly")
_R_NUM = _words("one two three four five six seven eight nine ten eleven twelve twenty hundred thousand dozen")
_R_ADJ = _words(
    # colours
    "red orange yellow green blue purple pink brown black white gray grey beige violet turquoise maroon golden "
    "silvery crimson scarlet navy teal magenta lavender ivory tan cream colorful colourful multicolored vibrant "
    "whitish dark light pale bright "
    # shapes
    "round square rectangular triangular circular oval spherical cubic cylindrical conical pyramidal pentagonal "
    "hexagonal octagonal oblong teardrop diamond-shaped heart-shaped star-shaped crescent-shaped curved straight "
    "angular geometric flat pointed tall short long big small large tiny huge giant massive miniature little "
    "wide narrow thick thin slim slender bulky compact "
    # textures, materials
    "wooden metallic plastic fluffy furry fuzzy silky smooth rough soft hard glossy shiny matte sleek velvety "
    "leathery rubbery glass-like woolen woollen knitted ceramic crystal-clear translucent transparent opaque "
    "sticky slimy bumpy lumpy prickly spiky jagged rugged rocky sandy muddy dusty rusty polished textured striped "
    "checkered spotted dotted patterned wrinkled crumpled cracked broken twisted rounded plush pillowy "
    # qualities
    "old new ancient modern vintage antique young fresh ripe juicy crunchy crisp sweet sour tart bitter salty "
    "spicy savory delicious tasty healthy hot cold warm cool icy frozen wet dry damp clean dirty empty full heavy "
    "beautiful pretty ugly elegant graceful majestic cute adorable lovely happy sad angry calm quiet loud busy "
    "peaceful serene cozy comfortable luxurious fancy simple plain ornate intricate delicate sturdy strong weak "
    "gentle fierce wild tame rich poor cheap expensive precious priceless rare common unique special different "
    "same other open closed deep shallow high low far distant close near-by hidden visible dim sunny rainy "
    "cloudy windy snowy stormy foggy misty starry dusky shimmering sparkling glowing glittering gleaming "
    "towering bustling winding rolling flowing "
    "abstract aerodynamic artistic bad best bold brilliant celestial challenging chilled choppy clear curious "
    "curvy daily delectable detailed dizzying dramatic dull dynamic eager earthy edged electronic emotional "
    "endless exhilarated fashionable favorite favourite final floral fragrant futuristic grand healthful historic "
    "homeless human hydrated imaginary joyful kind latest leaky local lush magic many maternal mid murky natural "
    "necessary perfect personal picturesque playful plump powerful pungent ready refreshing remote romantic "
    "savvy scenic seasonal sharp sheer sizzling slushy social solar soothing stainless streamlined stunning "
    "stylish sugary tired treacherous unique urban useful welcome whimsical enchanted mysterious magical "
    "colossal sturdy fluffy crispy creamy frosty steamy greasy shaggy sleepy lazy noisy tasty mighty proud "
    "brave bravest strange weird funny silly tidy messy neat clumsy only blank beloved boring busy calm candlelit "
    "comfortable cozy deaf empty glossy gnarled hardworking high lumpy natural opaque raked sheer slimy timeless "
    "vibrant visible windy whitish early gold iridescent fiery")
#: adjective words that are also nouns: inside a noun compound or ending one they are its noun
_R_ADJ_NOUN = _words("orange light cream gold silver lime olive peach plum salmon coral mint chocolate")
_R_PUNCT_TRAIL = ".,!?;:\"')]}"
_R_PUNCT_LEAD = "\"'([{"


def _rule_tokenize(text: str) -> list[tuple[str, str]]:
    """``(text, trailing whitespace)`` tokens, close to spaCy's English tokenizer on these prompts: punctuation and
    a possessive ``'s`` split off, a hyphen between two words its own token."""
    out: list[tuple[str, str]] = []
    for match in re.finditer(r"(\S+)(\s*)", text):
        word, space = match.group(1), " " if match.group(2) else ""
        lead: list[str] = []
        while len(word) > 1 and word[0] in _R_PUNCT_LEAD:
            lead.append(word[0])
            word = word[1:]
        trail: list[str] = []
        while len(word) > 1 and word[-1] in _R_PUNCT_TRAIL and not re.fullmatch(r"[A-Za-z]\.", word):
            trail.insert(0, word[-1])
            word = word[:-1]
        pieces: list[str] = []
        possessive = re.fullmatch(r"(.+?)(['’]s)", word)
        if possessive and len(possessive.group(1)) > 1:
            word, suffix = possessive.group(1), possessive.group(2)
        else:
            suffix = ""
        for k, part in enumerate(re.split(r"(?<=[A-Za-z])(-)(?=[A-Za-z])", word)):
            if part:
                pieces.append(part)
        if suffix:
            pieces.append(suffix)
        parts = lead + pieces + trail
        for k, part in enumerate(parts):
            out.append((part, space if k == len(parts) - 1 else ""))
    return out


# lexical classes (before context): DET POSS PRON ADP CCONJ SCONJ AUX VERB MAYBEV (verb-like, may be a modifier or
# a noun in an NP) ADV ADJ NUM NOUN PROPN PUNCT PART HYPH
def _rule_class(word: str, first: bool) -> str:
    low = word.lower()
    if low in ("'s", "’s"):
        return "PART"
    if word == "-":
        return "HYPH"
    if not any(c.isalnum() for c in word):
        return "PUNCT"
    if re.fullmatch(r"[\d.,:]+", word):
        return "NUM"
    for cls, words in (("DET", _R_DET), ("POSS", _R_POSS), ("PRON", _R_PRON), ("ADP", _R_ADP),
                       ("CCONJ", _R_CCONJ), ("SCONJ", _R_SCONJ), ("AUX", _R_AUX), ("NUM", _R_NUM)):
        if low in words:
            return cls
    if low in ("that", "her", "next", "all", "both"):
        return low.upper()  # resolved in context
    if low in _R_ADJ:
        return "ADJ"
    if low in _R_ADV:
        return "ADV"
    if low in _R_VERB_ALWAYS:
        return "VERB"
    if low in _R_VERB_BASE:
        return "VBASE"
    if low.endswith("ly") and len(low) > 4 and low not in _R_LY_NOT_ADV:
        return "ADV"
    if (low.endswith("ing") and len(low) > 5) or (low.endswith("ed") and len(low) > 4):
        return "MAYBEV"
    if word[0].isupper() and not first:
        return "PROPN"
    return "NOUN"


_NOMINAL = ("NOUN", "PROPN")


def rule_parse(prompt: str) -> Parsed:
    """mmrl's rule-based stand-in for spaCy ``en_core_web_sm`` on T2I-CompBench prompts (``noun_phrases=rules``):
    tokens with Universal POS tags and noun chunks.

    Tagging: closed-class word lists (determiners, pronouns, prepositions, conjunctions, auxiliaries), a lexicon of
    the colour, shape, texture and other adjectives of T2I prompts, known verb forms, ``-ly`` adverbs; an ``-ing``
    or ``-ed`` word is a modifier (``VERB``) inside a noun phrase before its noun, a noun when it ends one after a
    determiner or adjective (``a painting``), else a verb; an adjective that ends a noun phrase after a
    determiner or adjective is its noun (``a blue orange``); everything else is a ``NOUN`` (``PROPN`` when
    capitalised inside the sentence). Chunks: ``[determiner | possessive] modifiers* noun+`` (modifiers: adjectives,
    numbers, nouns, ``-ing``/``-ed`` words, an adverb before an adjective, commas and ``and``/``or`` between
    adjectives, hyphenated words, a possessive ``'s`` continuing the phrase: ``the dancer's feet``), and personal or
    relative pronouns alone (``it``, ``they``, ``which``), as spaCy's ``noun_chunks`` gives them (the text from the
    phrase's first token to its head noun)."""
    raw = _rule_tokenize(prompt)
    words = [w for w, _ in raw]
    n = len(words)
    classes = [_rule_class(w, i == 0) for i, w in enumerate(words)]

    def cls(j: int) -> str:
        return classes[j] if 0 <= j < n else "END"

    # context-resolved words
    for j, c in enumerate(classes):
        nxt = cls(j + 1)
        if c in ("THAT", "HER"):
            nominal_next = nxt in ("ADJ", "NOUN", "PROPN", "NUM") or (nxt == "ADV" and cls(j + 2) == "ADJ")
            classes[j] = ("DET" if c == "THAT" else "POSS") if nominal_next else "PRON"
        elif c == "NEXT":  # spaCy: "was next to" ADJ, "sat next to" ADV, "their next novel" ADJ
            to = j + 1 < n and words[j + 1].lower() == "to"
            classes[j] = "ADV" if to and cls(j - 1) != "AUX" else "ADJ"
        elif c in ("ALL", "BOTH"):
            classes[j] = "DET"
    pos = [""] * n
    spans: list[tuple[int, int]] = []
    modifiers = ("ADJ", "NUM", "MAYBEV")

    def np_at(i: int) -> tuple[int, int] | None:
        """(first, head) of a noun phrase starting at ``i``, or None."""
        c = cls(i)
        if c == "PRON":
            return (i, i)
        if c in ("VERB", "ADV", "AUX") or (c == "VBASE" and pos[i - 1:i] in (["NOUN"], ["PROPN"])):
            return None  # a verb after its subject: not a phrase start
        if c == "MAYBEV" and not (pos[i - 1:i] == ["VERB"] and cls(i + 1) in ("NOUN", "ADJ")):
            return None  # an -ing/-ed word starts a phrase only as an object's modifier: "provided healing relief"
        j = i
        if c in ("DET", "POSS"):
            j += 1
        head = None
        previous_head = None
        while j < n:
            c = cls(j)
            prev, nxt = cls(j - 1), cls(j + 1)
            low = words[j].lower()
            if c in _NOMINAL or (head is not None and low in _R_ADJ_NOUN):
                head = j  # "ice cream cone", "a gold orange", "a traffic light"
            elif c == "VBASE":
                if head is not None and nxt in ("DET", "POSS", "ADP", "ADV", "PRON", "AUX", "ADJ", "NUM", "THAT"):
                    break  # a verb after the subject: "the waves crash against"
                head = j
            elif c in ("VERB", "AUX"):
                if head is not None or j == i or (c == "AUX" and low != "can"):
                    break
                if words[j - 1].lower() in _R_ADJ_NOUN:
                    head = j - 1  # "the warm yellow light shone"
                    break
                head = j  # after a determiner or adjective a verb form is a noun: "a cylindrical can"
                j += 1
                break
            elif c == "ADP" and prev in ("DET", "POSS") and nxt not in _NOMINAL + ("ADJ",):
                head = j  # "the past", "the inside"
                j += 1
                break
            elif c in modifiers:
                if head is not None:
                    break
            elif c == "ADV":
                if head is not None or nxt not in ("ADJ", "MAYBEV"):
                    break
            elif words[j] == "," or c == "CCONJ":
                adjective_noun = c == "CCONJ" and nxt == "NOUN" and cls(j + 2) == "NOUN"  # "white and gold vase"
                if head is not None or prev not in ("ADJ", "MAYBEV") or (nxt not in ("ADJ", "MAYBEV", "ADV")
                                                                        and not adjective_noun):
                    break
                if c == "CCONJ" and nxt == "MAYBEV" and cls(j + 2) not in ("ADJ", "NOUN", "PROPN", "MAYBEV"):
                    break
            elif c == "HYPH":  # a hyphenated word: "diamond-studded bracelet", "mid-air"
                if j == i or j + 1 >= n or raw[j - 1][1] or raw[j][1] or cls(j + 1) in ("PUNCT", "END"):
                    break
                previous_head, head = head if head is not None else previous_head, None
                j += 2
                if cls(j - 1) in _NOMINAL:
                    head = j - 1
                continue
            elif c == "PART":  # possessive 's: the phrase goes on ("the dancer's feet")
                if head is None:
                    break
                previous_head, head = head, None
            else:
                break
            j += 1
        if head is None:
            last = j - 1
            if last > i and cls(last) in ("ADJ", "MAYBEV") and (cls(last - 1) != "HYPH" or previous_head is None):
                head = last  # "a blue orange", "the translucent oval", "a painting"
            elif previous_head is not None:
                head = previous_head
            else:
                return None
        return (i, head)

    i = 0
    while i < n:
        span = np_at(i)
        if span is None:
            c = classes[i]
            pos[i] = {"MAYBEV": "VERB", "VBASE": "VERB", "POSS": "PRON", "HYPH": "PUNCT"}.get(c, c)
            i += 1
            continue
        first, head = span
        for j in range(first, head + 1):
            c = classes[j]
            if j == head:
                pos[j] = "PRON" if c == "PRON" else ("PROPN" if c == "PROPN" else "NOUN")
            else:
                pos[j] = {"MAYBEV": "VERB", "VBASE": "NOUN", "VERB": "NOUN", "POSS": "PRON", "HYPH": "PUNCT"}.get(c, c)
        spans.append((first, head))
        i = head + 1
    # spaCy attaches a last, determiner-less conjunct to the phrase before it: "a red apple and yellow bananas"
    # (the benchmark's "a X and Y" template; spaCy is not consistent there, this is its more frequent parse)
    if len(spans) == 2:
        (f1, h1), (f2, h2) = spans
        if f1 == 0 and cls(0) == "DET" and all(cls(j) == "PUNCT" for j in range(h2 + 1, n)) and f2 == h1 + 2 \
                and words[h1 + 1].lower() == "and" and cls(f2) not in ("DET", "POSS", "PRON") and cls(h1) in _NOMINAL:
            spans[:] = [(f1, h2)]
    chunks = [_span_text([Token(words[j], "", raw[j][1]) for j in range(f, h + 1)]) for f, h in spans]
    tokens = tuple(Token(words[j], pos[j], raw[j][1]) for j in range(n))
    return Parsed(tokens, tuple(chunks))


def _spacy_parser(model: str):
    """``prompt -> Parsed`` with spaCy (``spacy.load(model)``), cached per prompt."""
    import spacy

    nlp = spacy.load(model)
    cache: dict[str, Parsed] = {}

    def parse(prompt: str) -> Parsed:
        if prompt not in cache:
            doc = nlp(prompt)
            cache[prompt] = Parsed(tuple(Token(t.text, t.pos_, t.whitespace_) for t in doc),
                                   tuple(c.text for c in doc.noun_chunks))
        return cache[prompt]

    return parse


def _spacy_available(model: str) -> bool:
    if importlib.util.find_spec("spacy") is None:
        return False
    if "/" in model or "\\" in model or Path(model).is_dir():
        return Path(model).is_dir()
    try:
        return importlib.util.find_spec(model) is not None
    except (ImportError, ValueError):
        return False


# =============================================================================================== spatial helpers


def _resize_rule(height: int, width: int, size: int, max_size: int | None = None) -> tuple[int, int]:
    """torchvision's output size for ``Resize(size, max_size=max_size)`` (an int size: the shorter side), as
    ``torchvision.transforms.functional._compute_resized_output_size`` computes it: ``(new_h, new_w)``. The
    shorter side becomes ``size`` and the longer ``int(size * long / short)``; if that exceeds ``max_size``, the
    longer side becomes ``max_size`` and the shorter ``int(max_size * size / new_long)`` (from the *rounded* new
    sizes, not the original ones)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    return new_h, new_w


def _resized_size(height: int, width: int, size: int, max_size: int | None = None) -> tuple[int, int]:
    """``(new_h, new_w)`` of torchvision's ``Resize(size, max_size=max_size)``: torchvision's own
    ``_compute_resized_output_size`` when it is importable (a private function), else :func:`_resize_rule`."""
    try:
        from torchvision.transforms.functional import _compute_resized_output_size

        new_h, new_w = _compute_resized_output_size((height, width), [size], max_size)
        return int(new_h), int(new_w)
    except (ImportError, AttributeError, TypeError):  # moved or changed: the same rule, reproduced
        return _resize_rule(height, width, size, max_size)


def official_frame(width: int, height: int) -> tuple[float, float]:
    """The x and y factors from an image's pixels to the frame UniDet's boxes are in:
    ``torchvision.transforms.Resize(size=479, max_size=480)`` (shorter side 479, longer side at most 480; the size
    torchvision computes, :func:`_resized_size`: a 256 x 264 image becomes 466 x 480)."""
    new_h, new_w = _resized_size(height, width, *_UNIDET_FRAME)
    return new_w / width, new_h / height


def _detector_label(noun: str | None, official_quirks: bool) -> tuple[str | None, str | None]:
    """A prompt noun as a detector label (``person`` for girl/boy/man/woman, then GenEval's spelling of COCO's
    names), or None with the reason it can never be found."""
    from mmrl.eval.scoring import T2I_PERSON_WORDS
    from mmrl.rewards.geneval import canonical_class

    if noun is None:
        return None, None
    if official_quirks and noun not in _UNIDET_WORDS and noun not in T2I_PERSON_WORDS:
        return None, f"{noun!r} is not one of UniDet's single-word labels (official_quirks: never found)"
    return canonical_class("person" if noun in T2I_PERSON_WORDS else noun), None


# =============================================================================================== plug-in interface


@dataclass(frozen=True)
class _Config:
    categories: tuple[str, ...]
    split: str
    blip_model: str
    blip_image_size: int
    np_num: int
    noun_phrases: str  # as asked: auto, spacy, rules
    spacy_model: str
    detector: str
    threshold: float
    clip_model: str
    official_quirks: bool
    blip_checkpoint: str | None = None
    clip_dtype: str = "float32"

    @property
    def needs_blip(self) -> bool:
        return any(c in ("color", "shape", "texture", "complex") for c in self.categories)

    @property
    def needs_detector(self) -> bool:
        return any(c in ("spatial", "complex") for c in self.categories)

    @property
    def needs_clip(self) -> bool:
        return any(c in ("non_spatial", "complex") for c in self.categories)

    @property
    def needs_nlp(self) -> bool:
        return any(c != "non_spatial" for c in self.categories)

    @property
    def nlp(self) -> str:
        """The noun-phrase backend used: spacy or rules."""
        if self.noun_phrases == "auto":
            return "spacy" if _spacy_available(self.spacy_model) else "rules"
        return self.noun_phrases


def _categories(name: str) -> tuple[str, ...]:
    if name == "t2i_compbench":
        return CATEGORIES
    head, sep, body = name.partition(":")
    if head != "t2i_compbench" or not sep:
        raise _error(f"benchmark {name!r}: expected t2i_compbench or t2i_compbench:CATEGORY[+CATEGORY...] "
                     f"(categories: {', '.join(CATEGORIES)})")
    cats = [c.strip() for c in re.split(r"[+,]", body)]
    if not all(cats):
        raise _error(f"benchmark {name!r}: an empty category; expected t2i_compbench:CATEGORY[+CATEGORY...]")
    for cat in cats:
        if cat in _NOT_YET:
            raise _error(f"benchmark {name!r}: {_NOT_YET[cat]}; categories: {', '.join(CATEGORIES)}")
        if cat not in CATEGORIES:
            close = difflib.get_close_matches(cat, CATEGORIES, n=2, cutoff=0.5)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise _error(f"benchmark {name!r}: unknown T2I-CompBench category {cat!r}; {hint}categories: "
                         f"{', '.join(CATEGORIES)}")
    repeated = [c for c, k in Counter(cats).items() if k > 1]
    if repeated:
        raise _error(f"benchmark {name!r}: category {repeated[0]!r} is listed twice")
    return tuple(cats)


def _text_option(extra: dict, key: str, default: str) -> str:
    value = extra.get(key, default)
    if value is None or isinstance(value, (bool, dict, list)) or str(value).strip() == "":
        raise _error(f"{key}={value!r}: expected a hub id, a name or a folder")
    return str(value)


def _config(name: str, options) -> _Config:
    """Every setting of a ``t2i_compbench`` benchmark from its name and the eval keys, checked."""
    categories = _categories(name)
    extra = dict(getattr(options, "extra", {}) or {})
    split = extra.get("t2i_split", "val")
    if split not in _SPLITS:
        raise _error(f"t2i_split={split!r}: expected one of {', '.join(_SPLITS)}")
    if split != "val":
        other = [c for c in categories if c not in _ATTRIBUTE]
        if other:
            raise _error(f"t2i_split={split}: only color, shape and texture ship a {split} list (not {other[0]}); "
                         f"use benchmarks=[t2i_compbench:color,shape,texture] or t2i_split=val")
    size = extra.get("blip_image_size", 480)
    if isinstance(size, bool) or not isinstance(size, int) or size < 16 or size % 16:
        raise _error(f"blip_image_size={size!r}: expected a multiple of 16 (BLIP's ViT patch size), e.g. 480 or 384")
    np_num = extra.get("np_num", 8)
    if isinstance(np_num, bool) or not isinstance(np_num, int) or np_num < 1:
        raise _error(f"np_num={np_num!r}: expected an integer >= 1 (the official --np_num is 8)")
    backend = extra.get("noun_phrases", "auto")
    if backend not in ("auto", "spacy", "rules"):
        raise _error(f"noun_phrases={backend!r}: expected auto, spacy or rules")
    spacy_model = _text_option(extra, "spacy_model", _SPACY_MODEL)
    if backend == "spacy" and not _spacy_available(spacy_model):
        raise _error(f"noun_phrases=spacy needs spaCy and its {spacy_model} pipeline (pip install spacy, then "
                     f"python -m spacy download en_core_web_sm, or spacy_model=<folder>); or noun_phrases=rules")
    threshold = extra.get("t2i_detector_threshold", 0.5)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise _error(f"t2i_detector_threshold={threshold!r}: expected a number in [0, 1) (UniDet's is 0.5)")
    quirks = extra.get("official_quirks", False)
    if not isinstance(quirks, bool):
        raise _error(f"official_quirks={quirks!r}: expected true or false")
    checkpoint = extra.get("blip_checkpoint")
    if checkpoint is not None:
        checkpoint = _text_option(extra, "blip_checkpoint", "")
        if not Path(checkpoint).is_file():
            raise _error(f"blip_checkpoint={checkpoint!r}: no such file (expected the original BLIP "
                         f"model_base_vqa_capfilt_large.pth)")
    clip_dtype = extra.get("t2i_clip_dtype", "float32")
    if clip_dtype not in _CLIP_DTYPES:
        raise _error(f"t2i_clip_dtype={clip_dtype!r}: expected float32 or float16 (the official precision)")
    return _Config(categories, split, _text_option(extra, "blip_model", DEFAULT_BLIP), size, np_num, backend,
                   spacy_model, _text_option(extra, "t2i_detector", DEFAULT_DETECTOR), float(threshold),
                   _text_option(extra, "t2i_clip_model", DEFAULT_CLIP), quirks, checkpoint, clip_dtype)


def _files(config: _Config) -> dict[str, Path]:
    """The shipped lists a benchmark reads: ``{file name: path}``."""
    from mmrl.eval.benchmarks import assets_dir

    folder = assets_dir() / "t2i_compbench" / "dataset"
    names = [f"{c}_{config.split}.txt" for c in config.categories]
    if "complex" in config.categories:
        names += ["complex_val_spatial.txt", "complex_val_action.txt"]
    return {n: folder / n for n in names}


def benchmark(name: str, options):
    """``t2i_compbench[:CATEGORY,...]``: the categories, the eval keys and the shipped lists checked (no model)."""
    config = _config(name, options)
    for file, path in _files(config).items():
        if not path.is_file():
            raise _error(f"benchmark {name!r}: the shipped T2I-CompBench list {path} is missing (restore "
                         f"assets/benchmarks/t2i_compbench/dataset/{file})")
    return BenchmarkSpec(name, "t2i_compbench", f"t2i_compbench/{config.split}:{','.join(config.categories)}")


def _checked(path: Path) -> str:
    from mmrl.data.prompts import DataError
    from mmrl.eval.protocol import file_sha256

    pinned = PINNED_SHA256[path.name]
    sha = file_sha256(path)
    if sha != pinned:
        raise DataError(f"{path}: not the version of the T2I-CompBench list mmrl pins (sha256 {sha[:16]}..., "
                        f"expected {pinned[:16]}...): restore the shipped file "
                        f"(assets/benchmarks/t2i_compbench/dataset/{path.name})")
    return sha


def load_items(spec, options):
    """The categories' prompts interleaved (see the module docstring), the first category's list and its pinned
    sha256. Every list read must have its pinned sha256."""
    from mmrl.eval.benchmarks import load_t2i_compbench

    config = _config(spec.name, options)
    for path in _files(config).values():
        _checked(path)
    lists = []
    for cat in config.categories:
        loaded = load_t2i_compbench(cat, config.split)
        if loaded.source.name != f"{cat}_{config.split}.txt":
            raise _error(f"T2I-CompBench {cat}: read {loaded.source}, expected {cat}_{config.split}.txt")
        if cat == "complex" and any(p.complex_kind is None for p in loaded):
            raise _error(f"T2I-CompBench complex: {loaded.source} has no complex_val_spatial/action lists beside it")
        lists.append((cat, list(loaded)))
    items = []
    for position in range(max(len(prompts) for _, prompts in lists)):
        for cat, prompts in lists:
            if position < len(prompts):
                p = prompts[position]
                metadata = {"category": cat, "line": p.line, "category_index": p.index}
                if cat == "complex":
                    metadata["complex_kind"] = p.complex_kind
                items.append(EvalItem(len(items), p.prompt, metadata, cat))
    first = _files(config)[f"{config.categories[0]}_{config.split}.txt"]
    return items, first, PINNED_SHA256[first.name]


def defaults(spec):
    """The official generation protocol: 10 images per prompt, seeds 42 + k, 512 px (steps and CFG: Flow-GRPO's)."""
    from mmrl.eval.protocol import _FLOW_GRPO_EVAL, Defaults

    return Defaults(10, 42, 512, 40, 4.5,
                    f"T2I-CompBench ({_SOURCE}) GORS_finetune/inference_eval.py: 10 images per prompt (--n_iter 10), "
                    "seeds 42, 43, ..., 51 (= seed 42 + k), SD-2-base at its native 512x512; steps and CFG: "
                    + _FLOW_GRPO_EVAL + " - the official script samples SD-2-base with DDIM, 30 steps, CFG 7.5; "
                    "category score = the mean over all images (300 val prompts x 10)")


def main_keys(spec) -> list[str]:
    return ["score"]


def make_scorer(spec, options) -> "T2ICompBenchScorer":
    return T2ICompBenchScorer(_config(spec.name, options))


# =============================================================================================== the scorer


class T2ICompBenchScorer(Scorer):
    """T2I-CompBench's official per-category scorers on transformers models (BLIP-VQA, CLIPScore, 3-in-1), UniDet
    replaced by mmrl's GenEval detector (the named substitute) and spaCy by mmrl's rules when it is not installed;
    see the module docstring. ``settings["scorers"]`` says per category which part is official and which a
    substitute."""

    name = "t2i_compbench"
    sample_score = "score"

    def __init__(self, config: _Config):
        runner = _runner_module
        self.config = config
        cats = config.categories
        self.nlp = config.nlp if config.needs_nlp else None
        self.headline = f"{cats[0]}.score" if len(cats) == 1 else "mean_of_categories.score"
        files = _files(config)
        settings: dict[str, Any] = {
            "benchmark": f"T2I-CompBench ({_SOURCE}), split {config.split}",
            "categories": list(cats),
            "prompt_files": {n: {"file": f"assets/benchmarks/t2i_compbench/dataset/{n}", "sha256": PINNED_SHA256[n]}
                             for n in files},
            "item_order": "categories interleaved round-robin in the name's order: index i = category i % C at "
                          "position i // C (while every list lasts)",
            "official_quirks": config.official_quirks,
            "category_score": "mmrl.eval.scoring.t2i_compbench_summary (mean over a category's images)",
        }
        defaults: dict[str, Any] = {"official_quirks": False}
        scorers: dict[str, str] = {}
        nlp_note = ("spaCy " + config.spacy_model + " (official)" if self.nlp == "spacy" else
                    "mmrl's rule-based substitute for spaCy en_core_web_sm (mmrl.eval.t2i_compbench.rule_parse; "
                    "spaCy is not installed or noun_phrases=rules)")
        if self.nlp is not None:
            settings["noun_phrases"] = self.nlp
            settings["noun_phrases_backend"] = nlp_note
            defaults["noun_phrases"] = "spacy"
            if self.nlp == "spacy":
                settings["spacy_model"] = config.spacy_model
                defaults["spacy_model"] = _SPACY_MODEL
        blip = (f"BLIP-VQA (official: {config.blip_model} = model_base_vqa_capfilt_large.pth through transformers "
                f"BlipForQuestionAnswering)") if config.blip_model == DEFAULT_BLIP else \
            f"BLIP-VQA on {config.blip_model} (not the official checkpoint {DEFAULT_BLIP})"
        blip += ("; position embeddings: the original 480-px ones from blip_checkpoint" if config.blip_checkpoint else
                 "; position embeddings: the converted 384-px ones interpolated (a named difference; "
                 "blip_checkpoint= for the official ones)")
        if config.needs_blip:
            settings.update({
                "blip_model": config.blip_model, "blip_image_size": config.blip_image_size, "np_num": config.np_num,
                "blip_rule": "BLIPvqa_eval/BLIP_vqa.py + models/blip_vqa.py vqa_prob: questions '<noun phrase>?' "
                             "(pre_question), [ENC] as the first question token, BERT tokens truncated to 35, batched unpadded "
                             "(same-length questions together); "
                             "P(yes) = softmax(first decoder logits after [DEC])[yes] / ([yes] + [no]); image score "
                             "= mmrl.eval.scoring.blip_vqa_image_score (product over the first np_num phrases)",
                "blip_preprocess": f"PIL bicubic resize to {config.blip_image_size}x{config.blip_image_size}, /255, "
                                   f"normalise mean {list(_CLIP_MEAN)} std {list(_CLIP_STD)}; position embeddings "
                                   "interpolated (bicubic, transformers interpolate_pos_encoding) only when the input "
                                   "grid differs from the embeddings' own",
                "blip_checkpoint": config.blip_checkpoint,
                "blip_position_embeddings": "blip_checkpoint" if config.blip_checkpoint else "blip_model",
                "blip_position_embeddings_note": (
                    f"the original checkpoint's own visual_encoder.pos_embed from blip_checkpoint (the 480-px "
                    f"30x30+1 positions of model_base_vqa_capfilt_large.pth, as the official blip_vqa(image_size=480) "
                    f"uses them) replaces {config.blip_model}'s; no interpolation at its size"
                    if config.blip_checkpoint else
                    f"{config.blip_model}'s own position embeddings (named difference: the hub {DEFAULT_BLIP} "
                    f"stores 24x24+1 = 577 positions, which transformers' conversion script made by interpolating "
                    f"the original 30x30+1 = 901 down to 384 px), bicubic-interpolated back to the "
                    f"{config.blip_image_size}-px grid; the 30 -> 24 -> 30 round trip does not restore the original "
                    f"embeddings; set blip_checkpoint=<model_base_vqa_capfilt_large.pth> for the official ones"),
                "blip_vision_layer_norm_eps": _BLIP_LAYER_NORM_EPS,
                "blip_vision_layer_norm_note": "BLIP's models/vit.py LayerNorms use eps 1e-6; the converted "
                                               "checkpoint's config carries BlipVisionConfig's default 1e-5, so the "
                                               "vision LayerNorms' eps is set to 1e-6 at load",
                "blip_excluded_phrases": list(_BLIP_EXCLUDED)})
            defaults.update({"blip_model": DEFAULT_BLIP, "blip_image_size": 480, "np_num": 8,
                             "blip_position_embeddings": "blip_checkpoint",
                             "blip_vision_layer_norm_eps": _BLIP_LAYER_NORM_EPS})
        detector = (f"substitute for UniDet (Unified_learned_OCIM_RS200_6x+2x, not in transformers): mmrl's GenEval "
                    f"detector {config.detector}, labels mapped to COCO/GenEval names, detections above "
                    f"{config.threshold:g}")
        if config.needs_detector:
            settings.update({
                "t2i_detector": config.detector, "t2i_detector_threshold": config.threshold,
                "spatial_rule": "UniDet_eval/2D_spatial_eval.py: objects = first and last NOUN (complex: the nouns "
                                "around the preposition), girl/boy/man/woman -> person, first detection with the "
                                "label; score = mmrl.eval.scoring.t2i_spatial_image_score",
                "spatial_labels": "noun -> mmrl.rewards.geneval.canonical_class (lower case, GenEval/COCO spelling); "
                                  "official_quirks: nouns outside UniDet's 448 single-word labels are never found",
                "spatial_box_frame": "boxes rescaled to UniDet's input frame, torchvision Resize(479, max_size=480)",
                "spatial_substitute": detector})
            defaults.update({"t2i_detector": DEFAULT_DETECTOR, "t2i_detector_threshold": 0.5})
        clip = ("CLIPScore (official: OpenAI CLIP ViT-B/32 = openai/clip-vit-base-patch32 through transformers "
                "CLIPModel)") if config.clip_model == DEFAULT_CLIP else \
            f"CLIPScore on {config.clip_model} (not the official ViT-B/32)"
        clip += ("; float16, as the official" if config.clip_dtype == "float16" else
                 "; float32 (a named difference: the official runs in float16)")
        if config.needs_clip:
            settings.update({"t2i_clip_model": config.clip_model,
                             "clip_rule": "CLIPScore_eval/CLIP_similarity.py: cosine of the L2-normalised image and "
                                          "text embeddings (not x100, not clipped), one image per forward; complex: "
                                          "prompt without its ADJ tokens, joined by spaces",
                             "clip_preprocess": "OpenAI CLIP's _transform (mmrl.eval.t2i_compbench.clip_pixels): PIL "
                                                "bicubic resize of the shorter side (torchvision's size rule), "
                                                "centre crop (torchvision's offset rounding), RGB, /255, CLIP "
                                                "mean/std; sizes from the processor, loaded with transformers' PIL "
                                                "backend",
                             "t2i_clip_dtype": config.clip_dtype,
                             "clip_dtype_note": (
                                 "float16 as the official clip.load on CUDA: half weights; image and text features, "
                                 "their L2 normalisation and the cosine in float16 (transformers' modules, not "
                                 "OpenAI's: its LayerNorms compute in float32 internally; on CPU, PyTorch's float16 "
                                 "kernels round differently from CUDA's)" if config.clip_dtype == "float16" else
                                 "named difference: float32 throughout, where the official clip.load on CUDA keeps "
                                 "OpenAI's float16 weights and computes features and cosine in float16 (the "
                                 "cosines differ in their last digits); t2i_clip_dtype=float16 for the official "
                                 "precision")})
            defaults.update({"t2i_clip_model": DEFAULT_CLIP, "t2i_clip_dtype": "float16"})
        nlp_part = f"; noun phrases: {nlp_note}" if self.nlp is not None else ""
        for cat in cats:
            if cat in _ATTRIBUTE:
                scorers[cat] = blip + nlp_part
            elif cat == "spatial":
                scorers[cat] = "spatial rule of UniDet_eval/2D_spatial_eval.py with a " + detector + nlp_part
            elif cat == "non_spatial":
                scorers[cat] = clip
            else:
                scorers[cat] = (f"3-in-1 (official rule, 3_in_1_eval/3_in_1.py) of {blip}; the spatial rule with a "
                                f"{detector}; {clip}{nlp_part}")
        settings["scorers"] = scorers
        if config.needs_blip or config.needs_detector or config.needs_clip:
            settings["device"] = "cuda if available, else cpu; float32" + (
                f" (CLIP {config.clip_dtype})" if config.needs_clip and config.clip_dtype != "float32" else "")
        self.scorers = scorers
        self.settings = settings
        self.defaults = defaults
        versions = [f"mmrl {runner._mmrl_version()}", f"transformers {runner._version('transformers')}"]
        if self.nlp == "spacy":
            versions.append(f"spacy {runner._version('spacy')}")
            model_version = runner._version(config.spacy_model)
            if model_version != "not installed":
                versions.append(f"{config.spacy_model} {model_version}")
        self.version = ", ".join(versions)
        self.parse = None
        self.blip = None
        self.blip_tokenizer = None
        self.detector = None
        self.clip = None

    # ------------------------------------------------------------------------------------------- models

    def build(self) -> None:
        import torch

        from mmrl.rewards._base import MissingWeightsError

        config = self.config
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.nlp is not None and self.parse is None:
            if self.nlp == "spacy":
                try:
                    self.parse = _spacy_parser(config.spacy_model)
                except (ImportError, OSError) as exc:
                    raise _error(f"t2i_compbench: could not load spaCy {config.spacy_model!r}: {exc} (set "
                                 f"spacy_model=, or noun_phrases=rules)") from None
            else:
                self.parse = rule_parse
        try:
            if config.needs_blip and self.blip is None:
                self.blip, self.blip_tokenizer = _load_blip(config.blip_model, device, config.blip_checkpoint)
            if config.needs_detector and self.detector is None:
                from mmrl.rewards.geneval import _build_detector

                self.detector = _build_detector(config.detector, None, None, None, 8)
            if config.needs_clip and self.clip is None:
                self.clip = _load_clip(config.clip_model, device, config.clip_dtype)
        except MissingWeightsError as exc:
            key = ("blip_model" if config.needs_blip and self.blip is None else
                   "t2i_detector" if config.needs_detector and self.detector is None else "t2i_clip_model")
            raise _error(f"t2i_compbench: {exc} (set {key}=<hub id or folder>)") from None

    # ------------------------------------------------------------------------------------------- parts

    def blip_yes_probs(self, images: list, phrases: list[str]) -> list[list[float]]:
        """``P(yes) / (P(yes) + P(no))`` per image and phrase (``vqa_prob``)."""
        if not phrases:
            return [[] for _ in images]
        return _blip_yes_probs(self.blip, self.blip_tokenizer, images, [blip_question(p) for p in phrases],
                               self.config.blip_image_size)

    def detect(self, images: list, names: list[str]) -> list[list]:
        """Per image the detections above the threshold, most confident first (``mmrl.rewards.geneval.Detection``)."""
        return self.detector(images, classes=[list(names) or ["object"]] * len(images),
                             min_score=self.config.threshold)

    def clip_cosines(self, images: list, text: str) -> list[float]:
        """The cosine of each image's CLIP embedding with ``text``'s (both L2-normalised)."""
        return _clip_cosines(*self.clip, images, text)

    # ------------------------------------------------------------------------------------------- scoring

    def _blip_scores(self, images: list, prompt: str, verdicts: list[dict]) -> list[float]:
        from mmrl.eval.scoring import blip_vqa_image_score

        phrases = blip_noun_phrases(self.parse(prompt))
        asked = phrases[:self.config.np_num]
        probs = self.blip_yes_probs(images, asked)
        out = []
        for k, p in enumerate(probs):
            out.append(blip_vqa_image_score(p, self.config.np_num, self.config.official_quirks))
            verdicts[k]["noun_phrases"] = phrases
            verdicts[k]["questions"] = [blip_question(q) for q in asked]
            verdicts[k]["yes_probs"] = [float(x) for x in p]
        return out

    def _spatial_scores(self, images: list, prompt: str, complex_: bool, verdicts: list[dict]) -> list[float | None]:
        from mmrl.eval.scoring import t2i_spatial_image_score, t2i_spatial_locality

        parsed = self.parse(prompt)
        obj1, obj2 = complex_spatial_objects(parsed) if complex_ else spatial_objects(parsed)
        locality = t2i_spatial_locality(prompt)
        (name1, why1), (name2, why2) = (_detector_label(o, self.config.official_quirks) for o in (obj1, obj2))
        names = [n for n in dict.fromkeys((name1, name2)) if n is not None]
        detections = self.detect(images, names) if names else [[] for _ in images]
        out: list[float | None] = []
        for k, (image, dets) in enumerate(zip(images, detections)):
            sx, sy = official_frame(image.width, image.height)
            scaled = [(d.label, d.score, (d.box[0] * sx, d.box[1] * sy, d.box[2] * sx, d.box[3] * sy)) for d in dets]
            score = t2i_spatial_image_score(locality, name1, name2, scaled, official_quirks=self.config.official_quirks)
            kept = [{"label": l, "score": round(s, 4), "box": [round(v, 1) for v in b]} for l, s, b in scaled[:8]]
            verdicts[k].update({"objects": [obj1, obj2], "detector_labels": [name1, name2], "locality": locality,
                                "detections": kept})
            notes = [w for w in (why1, why2) if w]
            if notes:
                verdicts[k]["not_findable"] = notes
            out.append(score)
        return out

    def _score_category(self, images: list, item) -> tuple[list[dict], list[dict]]:
        cat = item.category
        n = len(images)
        verdicts: list[dict] = [{"category": cat} for _ in range(n)]
        scores: list[dict] = [{} for _ in range(n)]
        if cat in _ATTRIBUTE:
            for k, s in enumerate(self._blip_scores(images, item.prompt, verdicts)):
                scores[k] = {"score": s, "blip_vqa": s}
        elif cat == "spatial":
            obj = spatial_objects(self.parse(item.prompt))
            if obj == (None, None):
                raise _NotJudged("no NOUN in the prompt (the official script stops here)")
            for k, s in enumerate(self._spatial_scores(images, item.prompt, False, verdicts)):
                scores[k] = {"score": s, "spatial": s}
        elif cat == "non_spatial":
            for k, c in enumerate(self.clip_cosines(images, item.prompt)):
                scores[k] = {"score": c, "clip": c}
                verdicts[k]["clip_text"] = item.prompt
        elif cat == "complex":
            from mmrl.eval.scoring import t2i_complex_image_score

            kind = item.metadata.get("complex_kind")
            blip = self._blip_scores(images, item.prompt, verdicts)
            spatial = self._spatial_scores(images, item.prompt, True, verdicts) if kind in ("spatial", "all") \
                else [None] * n
            text = remove_adjectives(self.parse(item.prompt))
            clip = self.clip_cosines(images, text) if kind in ("action", "all") else [None] * n
            for k in range(n):
                score = t2i_complex_image_score(kind, blip[k], _nan(spatial[k]), _nan(clip[k]))
                scores[k] = {"score": score, "blip_vqa": blip[k], "spatial": spatial[k], "clip": clip[k]}
                verdicts[k]["complex_kind"] = kind
                if clip[k] is not None:
                    verdicts[k]["clip_text"] = text
        else:
            raise ValueError(cat)
        return scores, verdicts

    def score(self, images: list, item) -> list[dict]:
        runner = _runner_module
        n = len(images)
        try:
            scores, verdicts = self._score_category(images, item)
        except _NotJudged as exc:
            return [{"scores": {"score": None}, "verdict": {"category": item.category}, "reason": str(exc)}] * n
        except Exception as exc:  # a model failing on one prompt: its images unjudged, with the reason
            reason = f"T2I-CompBench {item.category} scoring failed: {type(exc).__name__}: {exc}"
            return [{"scores": {"score": None}, "verdict": {"category": item.category}, "reason": reason}] * n
        out = []
        for s, v in zip(scores, verdicts):
            clean = {k: runner._float(x) for k, x in s.items()}
            reason = None if clean["score"] is not None else "a score part was NaN"
            out.append({"scores": clean, "verdict": runner._jsonable(v), "reason": reason})
        return out

    # ------------------------------------------------------------------------------------------- summary

    def summarize(self, rows: list[dict], items: list, out: Path) -> dict:
        from mmrl.eval.scoring import mean_with_count, t2i_compbench_summary

        runner = _runner_module
        by_index = {item.index: item for item in items}
        cats = self.config.categories
        per_cat: dict[str, list[float]] = {c: [] for c in cats}
        for r in rows:
            per_cat[by_index[r["prompt_index"]].category].append(runner._nan(r["scores"].get("score")))
        metrics: dict[str, Any] = t2i_compbench_summary(per_cat)
        for cat in cats:
            metrics[cat]["scorer"] = self.scorers[cat]
        if "complex" in cats:
            crows = [r for r in rows if by_index[r["prompt_index"]].category == "complex"]
            metrics["complex"]["parts"] = {
                key: mean_with_count([runner._nan(r["scores"].get(key)) for r in crows
                                      if r["scores"].get(key) is not None or r["scores"].get("score") is None])
                for key in ("blip_vqa", "spatial", "clip")}
            kinds = Counter(by_index[r["prompt_index"]].metadata.get("complex_kind") for r in crows)
            metrics["complex"]["images_per_kind"] = {k: kinds.get(k, 0) for k in ("spatial", "action", "all")}
        if len(cats) > 1:
            values = [metrics[c]["score"] for c in cats]
            mean = float(sum(values) / len(values)) if all(math.isfinite(v) for v in values) else float("nan")
            metrics["mean_of_categories"] = {
                "score": mean, "categories": list(cats),
                "note": "mmrl's own unweighted mean of the category scores, not a T2I-CompBench number (the "
                        "benchmark reports each category on its own)"}
        return metrics


class _NotJudged(Exception):
    pass


def _nan(value) -> float:
    return float("nan") if value is None else float(value)


# =============================================================================================== model code


def _load_blip(source: str, device, checkpoint: str | None = None):
    """A transformers ``BlipForQuestionAnswering`` (eval, float32, on ``device``) and its tokenizer.

    The vision LayerNorms get BLIP's eps, 1e-6 (``models/vit.py``; the converted checkpoint's config carries
    ``BlipVisionConfig``'s default 1e-5). ``checkpoint``: the original BLIP ``.pth`` whose
    ``visual_encoder.pos_embed`` replaces the model's position embeddings (:func:`apply_blip_checkpoint`)."""
    import torch
    from transformers import AutoTokenizer, BlipForQuestionAnswering

    from mmrl.rewards._base import load_pretrained
    from mmrl.rewards.geneval import _MODEL_FILES

    model = load_pretrained(BlipForQuestionAnswering, source, _MODEL_FILES, "T2I-CompBench BLIP-VQA model",
                            "blip_model", dtype=torch.float32)
    tokenizer = load_pretrained(AutoTokenizer, source, [[["tokenizer.json"], ["vocab.txt"]]],
                                "T2I-CompBench BLIP-VQA tokenizer", "blip_model",
                                needs="tokenizer.json or vocab.txt with tokenizer_config.json")
    _set_vision_layer_norm_eps(model, _BLIP_LAYER_NORM_EPS)
    if checkpoint is not None:
        apply_blip_checkpoint(model, checkpoint)
    return model.to(device).eval().requires_grad_(False), tokenizer


def _set_vision_layer_norm_eps(model, eps: float) -> None:
    """Every ``LayerNorm`` of the BLIP vision tower (the encoder layers' and ``post_layernorm``) and the config."""
    import torch

    for module in model.vision_model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = eps
    model.config.vision_config.layer_norm_eps = eps
    if getattr(model.vision_model, "config", None) is not None:
        model.vision_model.config.layer_norm_eps = eps


def _read_blip_checkpoint(path: str) -> dict:
    """The state dict of an original BLIP checkpoint (``torch.load(path)["model"]``, weights only; a plain state
    dict is accepted too)."""
    import torch

    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # mmap needs torch's zip format; an older file loads without it
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise _error(f"blip_checkpoint={path!r}: could not load it as a weights-only torch checkpoint "
                     f"({type(exc).__name__}: {first}); a file of just {{'model': {{'{_BLIP_POS_KEY}': tensor}}}} "
                     f"(torch.save) works too") from None
    state = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not isinstance(state.get(_BLIP_POS_KEY), torch.Tensor):
        raise _error(f"blip_checkpoint={path!r}: no {_BLIP_POS_KEY} tensor under 'model' (expected BLIP's "
                     f"model_base_vqa_capfilt_large.pth)")
    return state


def apply_blip_checkpoint(model, path: str) -> int:
    """Replace a transformers BLIP's vision position embeddings by the original checkpoint's
    ``visual_encoder.pos_embed`` (``[1, g*g + 1, D]``; 901 = 30x30 + 1 for ``model_base_vqa_capfilt_large.pth``,
    trained at 480 px) and make ``g * patch`` the model's image size, so that input needs no interpolation (the
    official ``blip_vqa(image_size=480)`` loads the checkpoint's own embeddings). The checkpoint's ``cls_token``
    and patch projection, where present, must equal the model's (the checkpoint ``blip_model`` was converted
    from). Returns the new image size."""
    import torch

    state = _read_blip_checkpoint(path)
    pos = state[_BLIP_POS_KEY]
    emb = model.vision_model.embeddings
    old = emb.position_embedding
    dim, patch = old.shape[-1], emb.patch_size
    grid = math.isqrt(max(pos.shape[1] - 1, 0)) if pos.dim() == 3 else 0
    if pos.dim() != 3 or pos.shape[0] != 1 or pos.shape[2] != dim or grid < 1 or grid * grid != pos.shape[1] - 1:
        raise _error(f"blip_checkpoint={path!r}: {_BLIP_POS_KEY} has shape {list(pos.shape)}, expected "
                     f"[1, g*g + 1, {dim}] (901 positions for the 480-px model_base_vqa_capfilt_large.pth)")
    for key, param in (("visual_encoder.cls_token", emb.class_embedding),
                       ("visual_encoder.patch_embed.proj.weight", emb.patch_embedding.weight)):
        theirs = state.get(key)
        if isinstance(theirs, torch.Tensor) and (
                theirs.shape != param.shape
                or not torch.allclose(theirs.float(), param.detach().float().cpu(), rtol=1e-3, atol=1e-4)):
            raise _error(f"blip_checkpoint={path!r}: its {key} differs from the BLIP model's: not the checkpoint "
                         f"blip_model was converted from")
    emb.position_embedding = torch.nn.Parameter(pos.detach().to(old.device, old.dtype).clone(), requires_grad=False)
    size = grid * patch
    emb.image_size, emb.num_patches, emb.num_positions = size, grid * grid, grid * grid + 1
    model.config.vision_config.image_size = size
    if getattr(model.vision_model, "config", None) is not None:
        model.vision_model.config.image_size = size
    return size


def _token_id(tokenizer, token: str, fallback: int | None, vocab_size: int) -> int:
    ids = tokenizer.convert_tokens_to_ids(token)
    if isinstance(ids, int) and ids != tokenizer.unk_token_id and 0 <= ids < vocab_size:
        return ids
    if fallback is not None and fallback < vocab_size:
        return fallback
    raise ValueError(f"the BLIP tokenizer has no {token!r} token")


def blip_pixels(images: list, size: int):
    """BLIP's test transform: ``Resize((size, size), BICUBIC)`` on the PIL image, ``ToTensor``, ``Normalize`` with
    CLIP's mean and std -> ``[N, 3, size, size]`` float32."""
    import numpy as np
    import torch
    from PIL import Image

    arrays = [np.asarray(im.convert("RGB").resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0
              for im in images]
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    mean = torch.tensor(_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(_CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def _blip_yes_probs(model, tokenizer, images: list, questions: list[str], size: int) -> list[list[float]]:
    """``models/blip_vqa.py`` ``vqa_prob`` on a transformers ``BlipForQuestionAnswering``: per image and question,
    ``P(yes) / (P(yes) + P(no))`` of the text decoder's first step after ``[DEC]``.

    Questions are batched only with questions of the same token length, never padded: transformers' BLIP text
    decoder drops the cross-attention mask (``BlipTextLayer`` hands it to ``BlipTextSelfAttention`` as
    ``attention_mask``, which a cross-attention replaces by its unset ``encoder_attention_mask``; transformers
    5.24), so a padded question would attend to its padding. Unpadded is what the official masked batch computes."""
    import torch

    text_cfg = model.config.text_config
    vocab = text_cfg.vocab_size
    enc_id = _token_id(tokenizer, "[ENC]", 30523, vocab)  # BLIP's init_tokenizer: [DEC] 30522, [ENC] 30523
    bos_id = text_cfg.bos_token_id if text_cfg.bos_token_id is not None else _token_id(tokenizer, "[DEC]", 30522,
                                                                                         vocab)
    yes_id = _token_id(tokenizer, "yes", None, vocab)
    no_id = _token_id(tokenizer, "no", None, vocab)
    param = next(model.parameters())
    device = param.device
    n, q = len(images), len(questions)
    out = torch.zeros(n, q)
    tokenized = [tokenizer(question, truncation=True, max_length=_QUESTION_MAX_TOKENS)["input_ids"]
                 for question in questions]
    groups: dict[int, list[int]] = {}
    for j, ids in enumerate(tokenized):
        groups.setdefault(len(ids), []).append(j)
    with torch.inference_mode():
        pixels = blip_pixels(images, size).to(device, param.dtype)
        emb = model.vision_model.embeddings
        interpolate = (size // emb.patch_size) ** 2 + 1 != emb.position_embedding.shape[1]
        image_embeds = model.vision_model(pixel_values=pixels, interpolate_pos_encoding=interpolate)[0]
        for members in groups.values():
            ids = torch.tensor([tokenized[j] for j in members], dtype=torch.long)
            ids[:, 0] = enc_id  # question.input_ids[:, 0] = tokenizer.enc_token_id
            g = len(members)
            ids = ids.repeat(n, 1).to(device)  # image-major: image i's questions at i*g .. i*g+g-1
            embeds = image_embeds.repeat_interleave(g, dim=0)
            image_mask = torch.ones(embeds.shape[:-1], dtype=torch.long, device=device)
            states = model.text_encoder(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        encoder_hidden_states=embeds, encoder_attention_mask=image_mask)[0]
            start = torch.full((n * g, 1), bos_id, dtype=torch.long, device=device)
            logits = model.text_decoder(input_ids=start, encoder_hidden_states=states,
                                        encoder_attention_mask=torch.ones_like(ids)).logits[:, 0, :]
            prob = logits.float().softmax(dim=-1)
            ratio = (prob[:, yes_id] / (prob[:, yes_id] + prob[:, no_id])).view(n, g).cpu()
            out[:, members] = ratio
    return out.tolist()


def _load_clip(source: str, device, dtype: str = "float32"):
    """A transformers ``CLIPModel`` in ``dtype`` on ``device`` and its ``CLIPProcessor``, the image processor with
    transformers' PIL backend (``backend="pil"``: ``CLIPImageProcessorPil``, not the torchvision one)."""
    import torch
    from transformers import CLIPProcessor

    from mmrl.rewards._base import load_pretrained
    from mmrl.rewards.clipscore import load_clip
    from mmrl.rewards.pickscore import _PROCESSOR_FILES

    processor = load_pretrained(CLIPProcessor, source, _PROCESSOR_FILES, "T2I-CompBench CLIPScore processor",
                                "processor", needs="preprocessor_config.json and tokenizer files", backend="pil")
    return load_clip(source, processor, device, getattr(torch, dtype), "T2I-CompBench CLIPScore")


def _size_of(size, *names):
    """A size field of an image processor (a transformers ``SizeDict`` or a dict), or None."""
    values = [size.get(n) if isinstance(size, dict) else getattr(size, n, None) for n in names]
    return None if any(v is None for v in values) else values


def clip_pixels(images: list, image_processor):
    """OpenAI CLIP's ``_transform(n_px)`` on PIL images: ``Resize(n_px, BICUBIC)`` (PIL; the shorter side to the
    processor's ``shortest_edge``, the longer ``int(n_px * long / short)``), ``CenterCrop`` to the processor's
    ``crop_size`` (torchvision's offset, ``int(round((h - crop) / 2))``; transformers' centre crop rounds it down,
    a one-pixel shift when the excess is 3 mod 4), ``convert("RGB")``, ``ToTensor`` (/255), ``Normalize`` with the
    processor's mean and std -> ``[N, 3, crop_h, crop_w]`` float32."""
    import numpy as np
    import torch
    from PIL import Image

    resample = getattr(image_processor, "resample", None)
    resample = Image.BICUBIC if resample is None else int(resample)
    short = _size_of(image_processor.size, "shortest_edge")
    exact = _size_of(image_processor.size, "height", "width")
    crop = _size_of(getattr(image_processor, "crop_size", None) or {}, "height", "width")
    do_crop = bool(getattr(image_processor, "do_center_crop", True)) and crop is not None
    scale = float(getattr(image_processor, "rescale_factor", 1 / 255))
    mean = torch.tensor(list(image_processor.image_mean), dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(list(image_processor.image_std), dtype=torch.float32).view(3, 1, 1)
    out = []
    for image in images:
        width, height = image.size
        if short is not None:
            new_h, new_w = _resized_size(height, width, int(short[0]))
        elif exact is not None:
            new_h, new_w = int(exact[0]), int(exact[1])
        else:
            raise ValueError(f"the CLIP image processor's size {image_processor.size!r} has no shortest_edge or "
                             f"height and width")
        if (new_w, new_h) != (width, height):
            image = image.resize((new_w, new_h), resample)
        if do_crop:
            crop_h, crop_w = int(crop[0]), int(crop[1])
            if crop_h > new_h or crop_w > new_w:
                raise ValueError(f"the CLIP crop {crop_h}x{crop_w} exceeds the resized image {new_h}x{new_w}")
            top, left = int(round((new_h - crop_h) / 2.0)), int(round((new_w - crop_w) / 2.0))
            image = image.crop((left, top, left + crop_w, top + crop_h))
        array = np.asarray(image.convert("RGB"), dtype=np.uint8)
        x = torch.from_numpy(array.copy()).permute(2, 0, 1).to(torch.float32)
        x = x.div(255) if abs(scale - 1 / 255) < 1e-12 else x * scale
        out.append((x - mean) / std)
    return torch.stack(out)


def _clip_cosines(model, processor, images: list, text: str) -> list[float]:
    """``CLIP_similarity.py``: per image (one per forward) the cosine of its CLIP image features with ``text``'s,
    both L2-normalised, all in the model's dtype (float16: as the official fp16 model; float32 otherwise)."""
    import torch

    from mmrl.rewards.pickscore import _embedding

    param = next(model.parameters())
    dtype = param.dtype if param.dtype in (torch.float16, torch.bfloat16) else torch.float32
    text_cfg = getattr(model.config, "text_config", None)
    max_length = int(min(77, getattr(text_cfg, "max_position_embeddings", 77)))
    with torch.inference_mode():
        tokens = processor.tokenizer([text], padding=True, truncation=True, max_length=max_length,
                                     return_tensors="pt")
        tokens = {k: v.to(param.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        text_features = _embedding(model.get_text_features(**tokens)).to(dtype)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        out = []
        for image in images:
            pixels = clip_pixels([image], processor.image_processor).to(param.device, param.dtype)
            image_features = _embedding(model.get_image_features(pixel_values=pixels)).to(dtype)
            image_features = image_features / image_features.norm(dim=-1, keepdim=True)
            out.append(float((image_features @ text_features.T).squeeze()))
        return out
