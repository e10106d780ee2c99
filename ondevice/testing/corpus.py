"""The deterministic text tiny tokenizers are trained on."""

from __future__ import annotations

import random

_WORDS = (
    "the model draft target token verify accept reject sample speculative decode laptop memory cache "
    "quantize weight layer attention head vector matrix python numpy return value function class import "
    "from def for while if else print list dict string number zero one two three four five six seven "
    "eight nine ten river mountain cloud apple orange green blue red fast slow small large kernel thread"
).split()
_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * 2)\n",
    "class Cache:\n    def __init__(self, n):\n        self.n = n\n",
    "import numpy as np\nx = np.zeros((4, 4))\n",
    "if value is None:\n    raise ValueError('missing value')\n",
]


def corpus(n_lines: int = 3000, seed: int = 1234) -> list[str]:
    """Deterministic mixed text: prose-like word salad, numbers, punctuation, code, unicode."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if i % 5 == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", "!", "?", ",", ";"])
        if i % 7 == 0:
            line = rng.choice(_CODE) + line
        if i % 11 == 0:
            line += " café naïve 東京 ∑ → ✓"
        lines.append(line)
    return lines
