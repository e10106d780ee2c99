"""Several models behind one ``ondevice serve``: listed, loaded on first use, at most ``--max-loaded`` at once (LRU
evicted, a request waiting for room), unloaded after ``--keep-alive`` idle and reloaded with the same greedy
answer, a model that fails to load answering one clear error while the others serve."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

PROMPT = "1, 2, 3, 4,"
GREEDY = dict(temperature=0, max_tokens=12)


def _ids(path: Path) -> str:
    return path.name.removesuffix(".gguf")


@pytest.fixture(scope="module")
def pair(tiny_gguf, tmp_path_factory):
    """Two tiny GGUFs under distinct names (the fixture's files are all called model.gguf)."""
    d = tmp_path_factory.mktemp("models")
    out = []
    for name in ("llama", "qwen2"):
        p = d / f"tiny-{name}.gguf"
        p.symlink_to(tiny_gguf(name))
        out.append(p)
    return out


def _direct(path: Path) -> str:
    from ondevice.loader import load

    with load(path, n_ctx=128, threads=1) as rt:
        return rt.generate(PROMPT, **GREEDY).text


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def _loaded(url: str) -> dict:
    return {m["id"]: m["loaded"] for m in _health(url)["models"]}


def _until(pred, timeout: float = 30) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("state not reached")


@pytest.fixture
def serve():
    from ondevice.server.run import launch

    procs = []

    def start(*args: str) -> str:
        proc, url = launch(*map(str, args), "--n-ctx", "128", "--threads", "1")
        procs.append(proc)
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=30)


def test_lru_eviction_keep_alive_and_reload(pair, serve):
    a, b = pair
    want = {_ids(p): _direct(p) for p in pair}
    url = serve(a, b, "--max-loaded", "1", "--keep-alive", "3")
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [_ids(a), _ids(b)]
    assert _loaded(url) == {_ids(a): True, _ids(b): False}  # the first loads at startup, the others on demand
    for p in (b, a, b):  # each request for the other model evicts the one loaded (max 1)
        got = client.completions.create(model=_ids(p), prompt=PROMPT, **GREEDY).choices[0].text
        assert got == want[_ids(p)]
        assert _loaded(url) == {_ids(a): p == a, _ids(b): p == b}
    _until(lambda: not any(_loaded(url).values()), timeout=15)  # idle past --keep-alive: unloaded
    got = client.completions.create(model=_ids(b), prompt=PROMPT, **GREEDY).choices[0].text
    assert got == want[_ids(b)]  # reloaded: the same greedy answer
    loads = {m["id"]: m["loads"] for m in _health(url)["models"]}
    assert loads == {_ids(a): 2, _ids(b): 3}
    # a request's own keep_alive (Ollama's field): 0 unloads right after it
    r = httpx.post(url + "/v1/completions", json={"model": _ids(a), "prompt": PROMPT, "keep_alive": 0, **GREEDY},
                   timeout=60)
    assert r.json()["choices"][0]["text"] == want[_ids(a)]
    _until(lambda: not _loaded(url)[_ids(a)], timeout=5)
    r = httpx.post(url + "/v1/completions", json={"model": _ids(a), "prompt": "x", "keep_alive": "soon"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_two_clients_two_models_at_once_and_a_broken_model(pair, serve, tmp_path):
    a, b = pair
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    want = {_ids(p): _direct(p) for p in pair}
    url = serve(a, b, broken, "--max-loaded", "2")
    got: dict = {}

    def ask(p: Path) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        got[_ids(p)] = [c.completions.create(model=_ids(p), prompt=PROMPT, **GREEDY).choices[0].text for _ in range(3)]

    threads = [threading.Thread(target=ask, args=(p,)) for p in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {k: [v] * 3 for k, v in want.items()}
    r = httpx.post(url + "/v1/completions", json={"model": "broken", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "model_load_failed" and "'broken' could not be loaded" in err["message"]
    assert "\n" not in err["message"] and str(tmp_path) not in err["message"]  # the server's folders stay private
    r = httpx.post(url + "/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
                   timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and _ids(a) in r.json()["error"]["message"]
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert c.completions.create(model=_ids(b), prompt=PROMPT, **GREEDY).choices[0].text == want[_ids(b)]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident memory from /proc")
def test_unloading_gives_the_memory_back(pair, smollm2):
    """After the keep-alive the process's resident memory falls by about the model's size."""
    from ondevice.server.run import launch

    proc, url = launch(str(pair[0]), str(smollm2), "--n-ctx", "128", "--threads", "1", "--keep-alive", "2")
    try:
        big = Path(smollm2).name.removesuffix(".gguf")
        before = _rss(proc.pid)
        r = httpx.post(url + "/v1/completions", json={"model": big, "prompt": PROMPT, "max_tokens": 4,
                                                      "keep_alive": 2}, timeout=120)
        assert r.status_code == 200
        loaded = _rss(proc.pid)
        _until(lambda: not _loaded(url)[big], timeout=20)
        time.sleep(0.5)
        after = _rss(proc.pid)
        size = Path(smollm2).stat().st_size
        print(f"rss MB: before {before >> 20}, loaded {loaded >> 20}, after unload {after >> 20}; file {size >> 20}")
        assert loaded - before > 0.5 * size, (before, loaded, size)
        assert loaded - after > 0.5 * size, (loaded, after, size)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class _FakeRuntime:
    drafter = None
    n_ctx = 64

    class target:  # noqa: N801
        vocab_size = 8

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def close(self) -> None:
        self.log.append(("close", self.name))


def test_a_request_waits_for_room_instead_of_being_refused():
    """max_loaded 1 and model a leased: a request for b waits; once a is released, a is unloaded and b loads."""
    from ondevice.server.models import Models

    log: list = []

    def loader(spec: str):
        log.append(("load", spec))
        return _FakeRuntime(spec, log)

    async def main() -> None:
        ms = Models([("a", "a"), ("b", "b")], loader, max_loaded=1, keep_alive=60)
        held = await ms.acquire("a")
        waiting = asyncio.ensure_future(ms.acquire("b"))
        await asyncio.sleep(0.2)
        assert not waiting.done() and log == [("load", "a")]
        held.release()
        other = await asyncio.wait_for(waiting, 5)
        assert other.model_id == "b" and log == [("load", "a"), ("close", "a"), ("load", "b")]
        other.release()
        ms.close()

    asyncio.run(main())


def test_a_load_is_shared_and_outlives_a_client_that_leaves():
    """Requests for a model being loaded wait for that one load (one error each if it fails); a client that
    leaves mid-load does not cancel it: the model ends up loaded and its idle clock unloads it."""
    import threading as th

    from ondevice.server.errors import ApiError
    from ondevice.server.models import Models

    log: list = []
    gate = th.Event()

    def loader(spec: str):
        log.append(("load", spec))
        assert gate.wait(10)
        if spec == "bad":
            raise ValueError("bad.gguf: not a model\nmore detail")
        return _FakeRuntime(spec, log)

    async def main() -> None:
        ms = Models([("a", "a"), ("bad", "bad")], loader, max_loaded=2, keep_alive=0.3)
        first = asyncio.ensure_future(ms.acquire("a"))
        second = asyncio.ensure_future(ms.acquire("a"))
        await asyncio.sleep(0.2)
        first.cancel()  # this client leaves while the model loads
        gate.set()
        held = await asyncio.wait_for(second, 5)
        assert log == [("load", "a")] and held.rt.name == "a"
        held.release()
        await asyncio.sleep(1.0)
        assert log == [("load", "a"), ("close", "a")]  # idle past its keep-alive: unloaded
        errors = await asyncio.gather(ms.acquire("bad"), ms.acquire("bad"), return_exceptions=True)
        assert all(isinstance(e, ApiError) and e.status == 500 for e in errors), errors
        assert str(errors[0]) == "the model 'bad' could not be loaded: bad.gguf: not a model"
        assert log.count(("load", "bad")) == 1  # one load, its error answered to both
        ms.close()

    asyncio.run(main())
