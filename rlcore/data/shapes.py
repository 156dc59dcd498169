"""The built-in vision task `shapes`: count the shapes of one color and kind in a small drawn image.

    rows = generate_rows("train", 1000, seed=0)     # verl-format rows with an `images` column
    compute_score("builtin/shapes", "2", "2")       # 1.0

An image is 48x48 pixels: a 3x3 grid of 16-pixel cells (one cell per image token of `builtin:tiny-vl`,
whose 8-pixel patches merge 2x2), 2 to 5 of them holding a red or blue circle or square of 8 to 12
pixels, jittered inside its cell. The prompt is `<image>how many red circles?` (a color and a kind,
drawn at random); the ground truth is the count, 0 to 5, and the reward is 1 for exactly that count
(the response stripped) and 0 otherwise. A problem's split is fixed by its layout, as for
`rlcore.data.tasks`: 'val' iff crc32 of its description is 0 mod 10. Images travel as PNG bytes, as
verl's multimodal rows carry them.
"""

from __future__ import annotations

import io
import random

from rlcore.data.tasks import draw_rows

NAME = "shapes"
DATA_SOURCE = f"builtin/{NAME}"
COLORS = {"red": (220, 30, 30), "blue": (30, 60, 220)}
KINDS = ("circle", "square")
SIDE, CELL = 48, 16


def make_problem(rng: random.Random) -> tuple[list[tuple[int, str, str, int, int, int]], str, str]:
    """(shapes as (cell, color, kind, size, dx, dy), question, count) drawn from `rng`."""
    cells = rng.sample(range(9), rng.randint(2, 5))
    shapes = [(c, rng.choice(list(COLORS)), rng.choice(KINDS), rng.randint(8, 12), rng.randint(-2, 2),
               rng.randint(-2, 2)) for c in sorted(cells)]  # fmt: skip
    color, kind = rng.choice(list(COLORS)), rng.choice(KINDS)
    count = sum(1 for s in shapes if s[1] == color and s[2] == kind)
    return shapes, f"how many {color} {kind}s?", str(count)


def draw(shapes: list[tuple[int, str, str, int, int, int]]) -> bytes:
    """The PNG bytes of a white 48x48 image with `shapes` drawn in their cells."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), "white")
    pen = ImageDraw.Draw(image)
    for cell, color, kind, size, dx, dy in shapes:
        cx, cy = (cell % 3) * CELL + CELL // 2 + dx, (cell // 3) * CELL + CELL // 2 + dy
        box = (cx - size // 2, cy - size // 2, cx - size // 2 + size - 1, cy - size // 2 + size - 1)
        (pen.ellipse if kind == "circle" else pen.rectangle)(box, fill=COLORS[color])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def generate_rows(split: str, n: int, *, seed: int = 0) -> list[dict]:
    """`n` verl-format rows for `split` (an `images` column of PNG bytes), the same for the same arguments."""

    def draw_row(rng: random.Random) -> tuple[str, dict]:
        shapes, question, count = make_problem(rng)
        return f"{shapes} {question}", {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"<image>{question}"}],
            "images": [{"bytes": draw(shapes)}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": count},
            "extra_info": {"shapes": len(shapes)},
        }

    return draw_rows(NAME, split, n, seed, draw_row)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """verl-signature reward: 1 if the stripped response is exactly the count, else 0."""
    return float(solution_str.strip() == str(ground_truth))
