"""A gymnasium-style environment for a vision-language policy: after the model's first answer it shows a
second image (an observation with an image part) and asks again; the second answer is scored."""

from __future__ import annotations

from PIL import Image, ImageDraw


class SecondImage:
    def reset(self, *, seed=None, options=None):
        self.turn, self.seed = 0, seed or 0
        return "", {}

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            image = Image.new("RGB", (48, 48), "white")
            for k in range(1 + self.seed % 3):  # 1 to 3 red circles
                ImageDraw.Draw(image).ellipse((2 + 15 * k, 18, 12 + 15 * k, 28), fill=(220, 30, 30))
            content = [{"type": "text", "text": "and here?"}, {"type": "image", "image": image}]
            return {"role": "user", "content": content}, 0.0, False, False, {}
        return "", float(action.strip() == str(1 + self.seed % 3)), True, False, {}
