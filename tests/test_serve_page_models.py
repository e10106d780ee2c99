"""The chat page's model selector: filled with every served model, and a request from the page names the chosen
one (in headless Debian chromium when installed, as tests/test_serve.py drives it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def two_models(tiny_gguf, tmp_path_factory):
    from ondevice.server.run import launch

    d = tmp_path_factory.mktemp("page-models")
    for name in ("llama", "qwen2"):  # distinct file names: a model's id is its file's stem
        (d / f"tiny-{name}.gguf").symlink_to(tiny_gguf(name))
    proc, url = launch(str(d / "tiny-llama.gguf"), str(d / "tiny-qwen2.gguf"), "--n-ctx", "128", "--threads", "1")
    ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    yield url, ids
    proc.terminate()
    proc.wait(timeout=30)


def test_page_has_a_model_selector_filled_from_health(two_models):
    url, ids = two_models
    html = httpx.get(url + "/").text
    assert 'id="model-select"' in html and "health.models" in html and "state.model = select.value" in html
    assert [m["id"] for m in httpx.get(url + "/health").json()["models"]] == ids  # the page's list = /v1/models


def test_the_chosen_model_answers_in_chromium(two_models, tmp_path):
    from test_serve import _cdp, _js, _poll

    url, ids = two_models
    assert not {m["id"]: m for m in httpx.get(url + "/health").json()["models"]}[ids[1]]["loaded"]
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    profile = tmp_path / "profile"
    args = [exe, "--headless", "--disable-gpu", "--remote-debugging-port=0", f"--user-data-dir={profile}",
            "--no-first-run", "about:blank"]
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")
    browser = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        t0 = time.perf_counter()
        while not (port_file.is_file() and port_file.read_text().count("\n") >= 1):
            assert time.perf_counter() - t0 < 60 and browser.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        conn, call = _cdp(pages[0]["webSocketDebuggerUrl"])
        with conn:
            call("Page.enable")
            call("Page.navigate", url=url + "/")
            _poll(call, "document.body && document.body.dataset.ready === '1'")
            options = _js(call, "[...document.getElementById('model-select').options].map(o => o.value)")
            assert options == ids and _js(call, "document.getElementById('model-select').value") == ids[0]
            assert not _js(call, "document.getElementById('model-label').classList.contains('hidden')")
            _js(call, f"""(() => {{
                window.sent = [];
                const real = window.fetch;
                window.fetch = (u, o) => {{ if (o && o.body) window.sent.push(JSON.parse(o.body)); return real(u, o); }};
                const s = document.getElementById('model-select');
                s.value = {json.dumps(ids[1])}; s.dispatchEvent(new Event('change'));
                document.getElementById('max-tokens').value = '5';
                document.getElementById('input').value = 'Hi';
                document.getElementById('send').click(); return true; }})()""")
            _poll(call, "(document.querySelector('.msg.assistant') || {dataset: {}}).dataset.state === 'done'")
            sent = _js(call, "window.sent")
    finally:
        browser.terminate()
        browser.wait(timeout=30)
    assert [b["model"] for b in sent] == [ids[1]]
    each = {m["id"]: m for m in httpx.get(url + "/health").json()["models"]}
    assert each[ids[1]]["loaded"] and each[ids[1]]["loads"] == 1  # the chosen model was loaded and answered
