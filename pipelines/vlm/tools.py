"""Tool calls inside VLM rollouts: image operations the policy invokes mid-completion and reasons over.

With ``generation.tools`` set, a rollout is multi-turn ("thinking with images", the setting of TACO's code-tool
agents): generation stops when the policy closes a call ``<tool>name(arg, ...)</tool>``; the call is executed on the
sample's image and its result, a new view, is appended to the completion inside ``generation.tool_response_template``
(``{image}`` is the view's vision placeholder, an error message replaces it when the call fails); generation then
continues from the whole context, until the end-of-turn token, the completion budget or ``generation.max_tool_calls``
(after that a written call is plain text).

The appended tokens are context, not actions: they are attended to (``VLMRollout.completion_attention``) but carry no
loss (``VLMRollout.mask`` is 0 on them) and are never scored as the policy's. Their images travel with the sample
(``VLMRollout.vision`` then has one entry per sample), so replaying the completion's log-probs reads exactly what was
sampled.

Calls are parsed, never evaluated: :func:`parse_call` accepts one call of a registered tool with number arguments
(Python call syntax, read with :mod:`ast`), so a completion can run no code of its own. A box tool (``box_args``:
``crop``) reads its four numbers in the frame of the model's box answers, the sample's ``coord_format`` (pixels of
the resized input for Qwen2.5-VL, 0-1000 for Qwen2-VL / Qwen3-VL; :func:`answer_frame`), so a crop and a box answer
name the same region; other numbers are passed as written. A tool is a function ``(image: PIL.Image, *numbers) ->
PIL.Image`` on the image as the model sees it (after the pixel budget): the built-in ones (:data:`TOOLS`) or
``package.module:function`` (set ``box_args = True`` on it to get its first four numbers as pixels of that image).
mmrl's choices: the tag, the call
syntax, the response template and that every call operates on the sample's first image.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import Callable

from PIL import Image, ImageEnhance

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.S)


class ToolError(ValueError):
    """A call the policy wrote that cannot be executed (its message goes back to the policy as the response)."""


def _box(image: Image.Image, x1: float, y1: float, x2: float, y2: float) -> tuple[int, int, int, int]:
    width, height = image.size
    left, top = max(0, math.floor(min(x1, x2))), max(0, math.floor(min(y1, y2)))
    right, bottom = min(width, math.ceil(max(x1, x2))), min(height, math.ceil(max(y1, y2)))
    if right - left < 2 or bottom - top < 2:
        raise ToolError(f"crop box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) holds under 2x2 pixels of the {width}x{height} "
                        f"image")
    if max(right - left, bottom - top) > MAX_ASPECT * min(right - left, bottom - top):
        raise ToolError(f"crop box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) is a sliver ({right - left}x{bottom - top} "
                        f"pixels): at most {MAX_ASPECT}:1")
    return left, top, right, bottom


#: The most elongated crop a box tool returns (DeepEyes' ``validate_bbox``: 100; Qwen-VL processors refuse past 200)
MAX_ASPECT = 100


def crop(image: Image.Image, x1: float, y1: float, x2: float, y2: float) -> Image.Image:
    """The region ``[x1, x2] x [y1, y2]`` (pixels of ``image``, clipped to it; in a rollout the policy writes them in
    its answers' frame, :func:`answer_frame`); the processor's pixel budget enlarges a small crop, so it is also the
    zoom."""
    return image.crop(_box(image, x1, y1, x2, y2))


crop.box_args = True


def answer_frame(metadata: dict, default_format: str | None) -> Callable[[list[float]], list[float]] | None:
    """The map from a box in the frame of the model's answers (the sample's ``coord_format``, else
    ``default_format``, the policy's) to pixels of the image the tools receive (the model's input, ``input_size``),
    as :func:`mmrl.rewards.grounding.rescale_box` reads answers (to original pixels) then scaled to the input:
    ``qwen25`` is the identity, ``qwen2`` ``x / 1000 * W_in``, ``absolute`` ``x * W_in / W``. ``None`` (numbers
    taken as pixels of the input) when no format is known; a call whose sizes are missing gets a :class:`ToolError`."""
    coord_format = metadata.get("coord_format") or default_format
    if coord_format is None:
        return None

    def to_pixels(box: list[float]) -> list[float]:
        from mmrl.rewards._text import Unjudgeable
        from mmrl.rewards.grounding import _size, rescale_box

        if coord_format == "absolute" and metadata.get("image_size") is None:
            return [float(v) for v in box]
        try:
            x1, y1, x2, y2 = rescale_box(box, coord_format, metadata.get("image_size"), metadata.get("input_size"))
            (w, h), (w_in, h_in) = _size(metadata.get("image_size"), "image_size"), _size(
                metadata.get("input_size", metadata.get("image_size")), "input_size")
        except Unjudgeable as exc:
            raise ToolError(f"cannot read the box in the {coord_format} frame: {exc}") from None
        sx, sy = w_in / w, h_in / h
        return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]

    return to_pixels


def rotate(image: Image.Image, degrees: float) -> Image.Image:
    """The image turned ``degrees`` counter-clockwise (canvas enlarged to hold it, corners black)."""
    return image.rotate(float(degrees), expand=True)


def contrast(image: Image.Image, factor: float) -> Image.Image:
    """Contrast scaled by ``factor`` (1 unchanged, 0 grey), as ``PIL.ImageEnhance.Contrast``."""
    if not 0 <= factor <= 10:
        raise ToolError(f"contrast factor {factor:g} is outside [0, 10]")
    return ImageEnhance.Contrast(image).enhance(float(factor))


#: the built-in tools, by the name a call uses
TOOLS: dict[str, Callable[..., Image.Image]] = {"crop": crop, "rotate": rotate, "contrast": contrast}


def resolve_tools(names: list[str]) -> dict[str, Callable[..., Image.Image]]:
    """``generation.tools`` -> ``{call name: function}``: a built-in name, or ``package.module:function`` (called by
    its function name). ValueError for an unknown name or an import that fails."""
    tools: dict[str, Callable[..., Image.Image]] = {}
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"generation.tools: expected tool names, got {name!r}")
        if ":" in name:
            from mmrl.config import import_attribute

            try:
                function = import_attribute(name)
            except ValueError as exc:
                raise ValueError(f"generation.tools: {exc}") from None
            attr = name.partition(":")[2]
            if not callable(function):
                raise ValueError(f"generation.tools: {name!r} is not callable")
            key = attr
        elif name in TOOLS:
            function, key = TOOLS[name], name
        else:
            raise ValueError(f"generation.tools: unknown tool {name!r}; built-in: {', '.join(sorted(TOOLS))}, or "
                             f"'package.module:function'")
        if key in tools:
            raise ValueError(f"generation.tools: two tools are called {key!r}")
        tools[key] = function
    return tools


def _number(node: ast.AST) -> float:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _number(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if not math.isfinite(node.value):
            raise ToolError("arguments must be finite numbers")
        return node.value
    raise ToolError("arguments must be numbers")


def parse_call(text: str, tools: dict) -> tuple[str, list[float]]:
    """``"crop(10, 20, 40, 52)"`` -> ``("crop", [10, 20, 40, 52])``. :class:`ToolError` unless ``text`` is exactly one
    call of a tool in ``tools`` with positional number arguments."""
    text = text.strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse the call {text[:80]!r}: write name(number, ...)") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ToolError(f"{text[:80]!r} is not a call: write name(number, ...)")
    if call.func.id not in tools:
        raise ToolError(f"unknown tool {call.func.id!r}; tools: {', '.join(sorted(tools))}")
    if call.keywords:
        raise ToolError("keyword arguments are not accepted")
    return call.func.id, [_number(a) for a in call.args]


def run_call(text: str, tools: dict, image: Image.Image | None,
             frame: Callable[[list[float]], list[float]] | None = None) -> Image.Image:
    """Execute the call written in ``text`` (the inside of ``<tool>...</tool>``) on ``image``: the new view, or
    :class:`ToolError` with the reason (bad syntax, unknown tool, wrong arguments, no image, a tool's own error).
    ``frame`` (:func:`answer_frame`) maps the first four numbers of a ``box_args`` tool to pixels of ``image``."""
    name, args = parse_call(text, tools)
    if image is None:
        raise ToolError("this sample has no image to operate on")
    if frame is not None and getattr(tools[name], "box_args", False) and len(args) >= 4:
        args = [*frame(args[:4]), *args[4:]]
    try:
        view = tools[name](image, *args)
    except ToolError:
        raise
    except TypeError as exc:
        raise ToolError(f"{name}: {exc}") from None
    except Exception as exc:  # a tool's own failure goes back to the policy, never ends the run
        raise ToolError(f"{name} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(view, Image.Image):
        raise ToolError(f"{name} returned {type(view).__name__}, not an image")
    return view.convert("RGB")


def calls_in(text: str) -> list[tuple[int, int, str]]:
    """Every complete ``<tool>...</tool>`` in ``text``: ``(start, end, inside)``, ``[start, end)`` the characters from
    ``<tool>`` through ``</tool>``."""
    return [(m.start(), m.end(), m.group(1)) for m in _CALL.finditer(text)]


def last_call(text: str) -> str | None:
    """The inside of the last complete ``<tool>...</tool>`` in ``text`` (``None`` when there is none)."""
    found = calls_in(text)
    return found[-1][2] if found else None


@dataclass
class ToolCall:
    """One call in a sampled completion, in completion-token positions: the segment that wrote it is
    ``[start, end)`` (from the end of the previous response, or the completion's start, through the call's closing
    tag), its response ``[end, response_end)`` (context tokens, loss mask 0). ``error`` is empty when the call ran
    and returned a view."""

    start: int
    end: int
    response_end: int
    call: str
    error: str = ""
    #: the token where ``<tool>`` begins (the context "without the tool" ends before it)
    opened: int = 0
    #: set by TACO: the call's value, the outcome reward with its response minus without (``None``: not probed)
    value: float | None = None

    @property
    def ok(self) -> bool:
        return not self.error
