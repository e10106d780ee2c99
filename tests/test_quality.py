"""ondevice.quality: the checker accepts right answers and rejects wrong ones for every task, the extractor reads
fenced and unfenced code, the sandbox contains loops and deletions, and the eval runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ondevice.errors import OndeviceError
from ondevice.quality import CLASSES, check, load_tasks, select, wilson
from ondevice.quality.confine import available, unavailable_reason
from ondevice.quality.extract import extract_code, extract_number, same_text
from ondevice.quality.sandbox import run_python

# code answers run only inside an OS sandbox (bubblewrap on Linux): without one these tests skip and say how
needs_os_sandbox = pytest.mark.skipif(available() is None, reason=f"no OS sandbox here: {unavailable_reason()}")

TASKS = {t.id: t for t in load_tasks()}

# A right answer to every code task, as a model would write it (fenced, with prose around it).
RIGHT = {
    "code-reverse-string": "def reverse_string(s):\n    return s[::-1]",
    "code-is-palindrome": "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]",
    "code-fizzbuzz": "def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0"
                     " else str(i) for i in range(1, n + 1)]",
    "code-count-vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
    "code-factorial": "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
    "code-fibonacci": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "code-is-prime": "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
                     "        if n % i == 0:\n            return False\n        i += 1\n    return True",
    "code-flatten": "def flatten(items):\n    out = []\n    for x in items:\n        if isinstance(x, list):\n"
                    "            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out",
    "code-word-count": "def word_count(text):\n    d = {}\n    for w in text.split():\n        w = w.lower()\n"
                       "        d[w] = d.get(w, 0) + 1\n    return d",
    "code-second-largest": "def second_largest(nums):\n    s = sorted(set(nums))\n    return s[-2] if len(s) > 1 else None",
    "code-merge-sorted": "def merge_sorted(a, b):\n    return sorted(a + b)",
    "code-gcd": "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
    "code-remove-duplicates": "def remove_duplicates(items):\n    return list(dict.fromkeys(items))",
    "code-sum-digits": "def sum_of_digits(n):\n    return sum(int(c) for c in str(n))",
    "code-binary-search": "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
                          "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
                          "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
                          "    return -1",
    "code-chunk": "def chunk(items, size):\n    return [items[i:i + size] for i in range(0, len(items), size)]",
    "code-is-anagram": "def is_anagram(a, b):\n    f = lambda s: sorted(s.replace(' ', '').lower())\n    return f(a) == f(b)",
    "code-valid-brackets": "def is_balanced(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    st = []\n    for c in s:\n"
                           "        if c in '([{':\n            st.append(c)\n        elif c in pairs:\n"
                           "            if not st or st.pop() != pairs[c]:\n                return False\n    return not st",
    "code-run-length": "from itertools import groupby\n\ndef run_length(s):\n    return ''.join(f'{k}{len(list(g))}' for k, g in groupby(s))",
    "code-transpose": "def transpose(matrix):\n    return [list(r) for r in zip(*matrix)]",
}


def _reply(code: str) -> str:
    return f"Here is the function:\n\n```python\n{code}\n\nprint('example:', 1)\n```\n\nIt runs in linear time."


def _wrong(code: str) -> str:
    """The same function returning a constant: runs, but is wrong."""
    head = code.split("\n")
    i = next(j for j, ln in enumerate(head) if ln.startswith("def "))
    return "\n".join(head[: i + 1] + ["    return 0"])


def test_the_task_set_is_well_formed():
    tasks = load_tasks()
    assert 40 <= len(tasks) <= 60
    assert {t.cls for t in tasks} == set(CLASSES)
    assert all(sum(t.cls == c for t in tasks) >= 10 for c in CLASSES)
    assert set(RIGHT) == {t.id for t in tasks if t.cls == "code"}  # every code task has a right answer below
    assert [t.cls for t in select(per_class=1)] == list(CLASSES)
    with pytest.raises(OndeviceError, match="choose from"):
        select(["poetry"])


@needs_os_sandbox
@pytest.mark.parametrize("task_id", sorted(RIGHT))
def test_every_code_task_accepts_a_right_answer_and_rejects_a_wrong_one(task_id):
    task = TASKS[task_id]
    ok = check(task, _reply(RIGHT[task_id]))
    assert ok.passed, ok.detail
    bad = check(task, _reply(_wrong(RIGHT[task_id])))
    assert not bad.passed and bad.detail != "all tests passed"
    assert not check(task, "I cannot help with that.").passed


@pytest.mark.parametrize("task_id", sorted(i for i, t in TASKS.items() if t.kind != "code"))
def test_every_short_answer_task_accepts_a_right_answer_and_rejects_a_wrong_one(task_id):
    task = TASKS[task_id]
    if task.kind == "number":
        right = [task.answer, f"The answer is {task.answer}.", f"**{task.answer}**"]
        wrong = [str(float(task.answer) + 1), f"The answer is {float(task.answer) * 10:g}.", "I don't know."]
    else:
        right = [task.answers[0], f"**{task.answers[-1]}**", f"The answer is {task.answers[0]}."]
        wrong = ["London", "Nitrogen", "I don't know."]
    for r in right:
        assert check(task, r).passed, (r, check(task, r).detail)
    for w in wrong:
        assert not check(task, w).passed, w


def test_short_answers_are_read_as_models_write_them():
    assert extract_number("17 * 23 = 391") == 391
    assert extract_number("To find 15% of 200, multiply by 0.15:\n\n200 × 0.15 = 30\n\nSo 15% of 200 is 30.") == 30
    assert extract_number("The answer is 30. (15% of 200)") == 30
    assert extract_number("2^10 = **1,024**") == 1024
    assert extract_number("$\\boxed{12}$") == 12
    assert extract_number("750 grams is 0.75 kg.") == 0.75
    assert extract_number("A hexagon has six sides.") == 6
    assert extract_number("It is −5 degrees.") == -5
    assert extract_number("no idea") is None
    assert same_text("The capital of France is Paris.", ["Paris"])
    assert same_text("Paris is the capital of France.", ["Paris"])
    assert same_text("William Shakespeare wrote Romeo and Juliet.", ["William Shakespeare", "Shakespeare"])
    assert same_text("Romeo and Juliet was written by William Shakespeare.", ["William Shakespeare", "Shakespeare"])
    assert same_text("Carbon dioxide (CO2).", ["carbon dioxide"])
    assert not same_text("The capital of France is Lyon, not Paris.", ["Paris"])
    assert not same_text("Mars", ["Jupiter"])


def test_extractor_reads_fenced_and_unfenced_code():
    fenced = "Sure!\n```python\ndef f(x):\n    return x + 1\n```\nExample: f(1) gives 2."
    assert extract_code(fenced, "f") == "def f(x):\n    return x + 1\n"
    assert extract_code("```\ndef f(x):\n    return 2\n```", "f").startswith("def f")  # no language tag
    assert extract_code("~~~py\ndef f(x):\n    return 3\n~~~", "f").startswith("def f")
    # a shell block first, then the Python one; a usage block after it
    two = "```bash\npip install x\n```\n```python\ndef f(x):\n    return 4\n```\n```python\nprint(f(1))\n```"
    assert extract_code(two, "f") == "def f(x):\n    return 4\n"
    # a helper in one block, the function in another: both, in order
    split = "```python\nimport math\n```\nthen\n```python\ndef g(x):\n    return math.sqrt(x)\n```"
    assert "def g" in extract_code(split, "f") and "import math" in extract_code(split, "f")
    # unfenced: prose before and after is dropped
    bare = "You can do it like this:\n\ndef f(s):\n    return s[::-1]\n\nThis slices the string backwards."
    assert extract_code(bare, "f") == "def f(s):\n    return s[::-1]\n"
    # cut off by the token limit inside the block: kept as far as it parses
    cut = "```python\ndef f(x):\n    return x\n\ndef g(y):\n    return (y +"
    assert extract_code(cut, "f") == "def f(x):\n    return x\n"
    assert extract_code("Just reverse it with slicing.", "f") is None
    # HTML code tags, as Gemma 3 270M writes them (entities decoded); a one-line <code>name</code> is not a program
    tags = "\n\n<code>def f(n):\n    return n &lt; 2\n</code>\n\nI'm not sure."
    assert extract_code(tags, "f") == "def f(n):\n    return n < 2\n"
    assert extract_code("Call <code>f</code> with a string.", "f") is None


@needs_os_sandbox
def test_sandbox_kills_an_infinite_loop_at_its_time_limit():
    t0 = time.perf_counter()
    r = run_python("while True:\n    pass", timeout=2)
    assert r.timed_out and not r.ok and "wall-clock" in r.reason()
    assert time.perf_counter() - t0 < 10
    # ... as a model's answer: the check fails, and says why
    v = check(TASKS["code-factorial"], "```python\ndef factorial(n):\n    while True:\n        pass\n```", timeout=2)
    assert not v.passed and "wall-clock" in v.detail
    # a sleeping child of a forked/exec'd process cannot outlive it either: starting processes is refused
    assert "not allowed" in run_python("import os\nos.system('sleep 60')").reason()


@needs_os_sandbox
def test_sandbox_contains_a_file_deleting_answer(tmp_path):
    victim = tmp_path / "keep" / "important.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    home = tmp_path / "home-like"
    home.mkdir()
    (home / "notes.md").write_text("mine")
    answers = [
        f"import shutil\nshutil.rmtree({str(victim.parent)!r})",
        f"import os\nos.remove({str(victim)!r})",
        f"from pathlib import Path\nPath({str(victim)!r}).unlink()",
        f"open({str(victim)!r}, 'w').write('')",
        f"import os\nos.chdir({str(home)!r})\nfor f in os.listdir('.'):\n    os.remove(f)",
        f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
        f"import os\nos.system('rm -rf {tmp_path}')",
        f"import subprocess\nsubprocess.run(['rm', '-rf', {str(tmp_path)!r}])",
        f"import ctypes\nctypes.CDLL(None).unlink({str(victim).encode()!r})",
    ]
    for code in answers:
        r = run_python(code)
        # refused by the guard (PermissionError) or the path does not exist inside the OS sandbox
        assert not r.ok and ("PermissionError" in r.stderr or "FileNotFoundError" in r.stderr), (code, r.stderr)
    reply = f"```python\nimport shutil\nshutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n\n" + RIGHT["code-factorial"] + "\n```"
    assert not check(TASKS["code-factorial"], reply).passed
    assert victim.read_text() == "precious" and (home / "notes.md").read_text() == "mine"
    # inside its own temp dir it may write, rename and delete as it likes; the dir is gone afterwards
    r = run_python("import os\nopen('a', 'w').write('x')\nos.mkdir('d')\nos.rename('a', 'd/b')\nos.remove('d/b')\n"
                   "print(os.getcwd())")
    assert r.ok, r.stderr
    from pathlib import Path

    assert not Path(r.stdout.strip()).exists()


@needs_os_sandbox
def test_sandbox_limits_memory_and_output():
    assert "MemoryError" in run_python("x = bytearray(8 << 30)", memory_bytes=512 << 20).stderr
    r = run_python("while True:\n    print('x' * 4096)", timeout=5, file_bytes=1 << 20)
    assert not r.ok and not r.timed_out  # cut by the file-size limit, long before the clock
    env = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)")
    assert env.ok and "PYTHONPATH" not in env.stdout and env.stdout.split()[-1] == "1"


def test_wilson_interval_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(0, 10), (3, 10), (10, 10), (27, 53), (1, 1)]:
        ci = stats.binomtest(k, n).proportion_ci(method="wilson")
        assert wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9)
    assert wilson(0, 0) == (0.0, 1.0)


@needs_os_sandbox
def test_evaluate_end_to_end_on_a_tiny_model(tiny_gguf, tmp_path):
    from ondevice.quality import evaluate
    from ondevice.quality.report import markdown, plot, table
    from ondevice.quality.runner import rejudge

    model = str(tiny_gguf("qwen2", "q8_0"))
    doc = evaluate([model, model], per_class=1, threads=1)
    assert [m["model"] for m in doc["models"]] == [model, model]
    for m in doc["models"]:
        assert set(m["classes"]) == set(CLASSES) and m["overall"]["n"] == len(CLASSES)
        assert 0 <= m["overall"]["ci95"][0] <= m["overall"]["ci95"][1] <= 1 and m["chat_template"]
        assert m["decode_tokens_per_second"] > 0 and m["wall_seconds"] > 0
    a, b = (x["tasks"] for x in doc["answers"])
    assert [r["answer"] for r in a] == [r["answer"] for r in b]  # greedy: the same file answers the same
    table(doc)
    assert plot(doc, tmp_path).is_file()
    assert markdown(doc).count("\n") == 2 + len(doc["models"])
    again = rejudge(json.loads(json.dumps(doc)))  # the stored answers judged again give the same verdicts
    assert [m["overall"] for m in again["models"]] == [m["overall"] for m in doc["models"]]


@needs_os_sandbox
def test_bench_quality_cli(tiny_gguf, tmp_path):
    model = str(tiny_gguf("qwen2", "q8_0"))
    out = tmp_path / "q.json"
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "bench", "--quality", f"{model},{model}", "--per-class", "1",
                        "--threads", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert len(doc["models"]) == 2 and "[1/4]" in r.stderr  # progress: one line per answer


README_PROMPT = "Write a Python function that reverses a string."
CHEAP_BYTES = 200_000_000  # as the `slow` marker: models over 200 MB are pulled only when asked for


@pytest.fixture(scope="module")
def default_chat_model():
    """The default chat model (ondevice.cli.main.DEFAULT_CHAT_MODEL): used when already in the cache (README command 1 pulls
    it) or cheap to pull; else the test is skipped with the command that enables it."""
    from ondevice.cli.main import DEFAULT_CHAT_MODEL
    from ondevice.store import catalog, fetch

    entry = catalog.get(DEFAULT_CHAT_MODEL)
    if not fetch.is_pulled(entry) and entry.size > CHEAP_BYTES:
        pytest.skip(f"the default chat model is not cached: `ondevice pull {DEFAULT_CHAT_MODEL}` "
                    f"({entry.size / 1e6:.0f} MB; README command 1 pulls it) enables this test")
    return DEFAULT_CHAT_MODEL, fetch.pull(DEFAULT_CHAT_MODEL, quiet=True)


@needs_os_sandbox
def test_default_chat_model_answers_the_readme_example_with_code_that_runs(default_chat_model):
    """README command 1 (`echo "Write a Python function that reverses a string." | ondevice chat`), greedy, and at
    the command's own sampling settings (temperature 0.8, 256 tokens) for fixed seeds: every answer's code is
    executed in the sandbox against the reverse-string task's unit tests."""
    import ondevice
    from ondevice.params import DEFAULT_MAX_TOKENS, DEFAULTS

    name, _ = default_chat_model
    task = TASKS["code-reverse-string"]
    assert task.prompt == README_PROMPT
    # --threads 1: on a shared, oversubscribed machine two llama.cpp threads wait on each other (5-9x slower);
    # the answer does not depend on it
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "chat", "--temperature", "0", "--threads", "1"],
                       input=README_PROMPT + "\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    v = check(task, r.stdout)
    assert v.passed, (v.detail, r.stdout)
    with ondevice.load(name, drafter="none", threads=1) as rt:  # plain sampling: a fixed seed, a fixed answer
        for seed in range(3):
            res = rt.chat([{"role": "user", "content": README_PROMPT}], max_tokens=DEFAULT_MAX_TOKENS,
                          temperature=DEFAULTS.temperature, seed=seed)
            v = check(task, res.text)
            assert v.passed, (seed, v.detail, res.text)
