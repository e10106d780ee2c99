"""Pull what a model answered out of its reply: the code (fenced or not), a number, or a short text answer."""

from __future__ import annotations

import ast
import re
import unicodedata

_FENCE = re.compile(r"^[ \t]*(```|~~~)[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^[ \t]*\1[ \t]*$|\Z)", re.M | re.S)
_HTML = re.compile(r"<(code|pre)>\s*(.*?)(?:</\1>|\Z)", re.S | re.I)  # <code>...</code>, as some small models write
_CODE_START = re.compile(r"^(def |class |import |from \S+ import |@|async def )")
_NOT_PYTHON = {"bash", "sh", "shell", "console", "text", "plaintext", "output", "json", "javascript", "js", "java",
               "c", "cpp", "c++", "rust", "go", "ruby", "typescript", "ts", "html", "css", "sql"}


def _compiles(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def _trim_to_compile(lines: list[str]) -> str | None:
    """The longest head of ``lines`` that parses as Python (prose after code is dropped), or None."""
    for end in range(len(lines), 0, -1):
        code = "\n".join(lines[:end]).rstrip()
        if code.strip() and _compiles(code):
            return code + "\n"
    return None


def code_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block (``` or ~~~) as (language tag, body); an unclosed last fence runs to the end. Without
    fences, ``<code>`` / ``<pre>`` blocks (HTML entities decoded), as (``""``, body)."""
    import html

    blocks = [(m.group(2).lower(), m.group(3)) for m in _FENCE.finditer(text)]
    return blocks or [("", html.unescape(m.group(2))) for m in _HTML.finditer(text) if "\n" in m.group(2).strip()]


def extract_code(text: str, entry: str | None = None) -> str | None:
    """The Python program in a model's answer, or None when it holds none.

    Fenced blocks (or ``<code>`` blocks of more than one line) come first: the ones tagged as another language are skipped; the first block that parses
    and defines ``entry`` wins (``entry`` None or "*": any function), else every block that parses joined in
    order (a helper in one block, the function in the next). Without fences, the answer is read from its first
    line that starts like Python (``def``, ``import``, ...), up to the longest part that still parses (the prose
    after the code is dropped). A block cut off by the token limit is kept only as far as it parses.

    Args:
        text: the model's reply.
        entry: the name of the function the caller will test, or None / "*".
    Returns:
        Python source that parses, or None.
    """
    blocks = [body for lang, body in code_blocks(text) if lang not in _NOT_PYTHON]
    if blocks:
        parsed = [c for c in (_trim_to_compile(b.splitlines()) for b in blocks) if c]
        want = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry)}\s*\(" if entry and entry != "*" else r"^\s*(async\s+)?def\s",
                          re.M)
        for code in parsed:
            if want.search(code):
                return code
        if parsed:
            return "\n".join(parsed)
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if _CODE_START.match(ln)), None)
    if start is None:
        return None
    return _trim_to_compile(lines[start:])


_MD = re.compile(r"[*_`$]|\\boxed\{|\\text\{|\\\(|\\\)|\\\[|\\\]")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*(?:approximately\s+)?([^\n]*)", re.I)
_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}


def _plain(text: str) -> str:
    """Markdown emphasis, code ticks and LaTeX wrappers removed; Unicode minus and thin spaces made ASCII."""
    text = unicodedata.normalize("NFKC", text).replace("\u2212", "-")
    return _MD.sub("", text).replace("}", " ")


def numbers(text: str) -> list[float]:
    """Every number written in digits in ``text``, in order (``1,024`` is one number); where there is none,
    the number words zero…twelve ("six")."""
    out = [float(m.group(0).replace(",", "")) for m in _NUMBER.finditer(text)]
    if not out:
        out = [float(_WORDS[m.group(1).lower()]) for m in re.finditer(r"\b(" + "|".join(_WORDS) + r")\b", text, re.I)]
    return out


def extract_number(text: str) -> float | None:
    """The number a short answer gives, or None.

    Rules, in order: a reply that is one number is that number; the number after "answer is" / "answer:";
    else the last number written (a worked answer ends with its result: ``17 * 23 = 391``).
    """
    t = _plain(text).strip()
    found = numbers(t)
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    m = _ANSWER_IS.search(t)
    if m and numbers(m.group(1)):
        return numbers(m.group(1))[0]
    return found[-1]


def same_number(got: float | None, want: float) -> bool:
    """Exact numeric match (up to float rounding of the decimal written)."""
    return got is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want))


def normalize(text: str) -> str:
    """Lower case, accents kept, markdown and punctuation dropped, articles at the start dropped, spaces folded."""
    t = _plain(text).lower()
    t = re.sub(r"[^\w\s]", " ", t)
    t = re.sub(r"^\s*(the|a|an)\s+", "", t)
    return " ".join(t.split())


def text_candidates(text: str) -> list[str]:
    """What a short text answer may be: the first line, what follows "answer is", and the sides of the
    first sentence's last "is" / "was" / "are" / "by" (``The capital of France is Paris.`` → "paris";
    ``Paris is the capital.`` → "paris"), all normalised."""
    t = _plain(text).strip()
    first = next((ln for ln in t.splitlines() if ln.strip()), "")
    out = [first]
    m = _ANSWER_IS.search(t)
    if m:
        out.append(m.group(1))
    sentence = re.split(r"(?<=[.!?])\s", first, maxsplit=1)[0]
    out += [sentence, re.sub(r"\([^)]*\)", " ", sentence)]  # "Carbon dioxide (CO2)." → "carbon dioxide"
    parts = re.split(r"\s(?:is|was|are|by)\s", sentence)
    if len(parts) > 1:
        out += [parts[-1], parts[0]]
    return [c for c in dict.fromkeys(normalize(c) for c in out) if c]


def same_text(text: str, answers: list[str]) -> bool:
    """True when one of the candidate readings of ``text`` equals one of ``answers`` (both normalised)."""
    want = {normalize(a) for a in answers}
    cands = text_candidates(text)
    # ... or the answer's first sentence opens with the name: "William Shakespeare wrote it."
    return any(c in want for c in cands) or any(c.startswith(w + " ") for c in cands[:1] for w in want)
