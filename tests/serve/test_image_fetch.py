"""Remote image URLs (--allow-image-urls, runtime/vision/fetch.py) against a local host that misbehaves: a body
dribbled a byte at a time, a redirect loop, more slow fetches than the server takes at once. A text-only request
is answered promptly meanwhile; each slow fetch fails at its total deadline in one line; one fetch too many is a
503 at once."""

import json
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install .[serve]")
httpx = pytest.importorskip("httpx")
from fake_backend import make_llm  # noqa: E402
from serve_helpers import running  # noqa: E402

from decodert.errors import Busy, DecodertError  # noqa: E402
from decodert.runtime.vision.fetch import Fetcher  # noqa: E402
from decodert.runtime.vision.images import ImageLimits  # noqa: E402

DEADLINE = 1.5  # seconds for one whole fetch
DRIBBLE = 0.25  # seconds between bytes: every read gets a byte long before any per-read timeout


class _Host(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            part = self.request.recv(4096)
            if not part:
                return
            data += part
        path = data.split(b" ", 2)[1].decode()
        self.server.paths.append(path)
        try:
            if path == "/slow":  # headers at once, then one byte of a long body every DRIBBLE seconds
                self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n")
                for _ in range(int(30 / DRIBBLE)):
                    self.request.sendall(b"x")
                    time.sleep(DRIBBLE)
            elif path == "/slow-headers":  # the status line itself dribbles
                for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * 500:
                    self.request.sendall(bytes([byte]))
                    time.sleep(DRIBBLE)
            elif path == "/loop":
                self.request.sendall(b"HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\n\r\n")
            elif path == "/hop":
                self.request.sendall(b"HTTP/1.1 301 Moved\r\nLocation: /image\r\nContent-Length: 0\r\n\r\n")
            elif path == "/image":
                self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nbytes")
            else:
                self.request.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        except OSError:  # the fetcher hung up: what a deadline does
            pass


@pytest.fixture(scope="module")
def host():
    server = _Host(("127.0.0.1", 0), _Handler)
    server.paths = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_fetch_has_one_deadline_for_all_of_it(host):
    fetch = Fetcher(ImageLimits(), deadline_s=DEADLINE, max_fetches=4)
    assert fetch(f"{host}/hop", "image 0") == b"bytes"  # a redirect followed
    for path in ("/slow", "/slow-headers"):
        t0 = time.monotonic()
        with pytest.raises(DecodertError, match=r"took longer than 1.5 s \(the deadline of one image fetch") as e:
            fetch(f"{host}{path}", "image 0")
        assert DEADLINE <= time.monotonic() - t0 < DEADLINE + 1.0 and "\n" not in str(e.value)
    with pytest.raises(DecodertError, match=r"failed \(more than 5 redirects \(a redirect loop\?\)\)$") as e:
        fetch(f"{host}/loop", "image 0")
    assert "\n" not in str(e.value)  # urllib's loop error spanned 3 lines
    with pytest.raises(DecodertError, match=r"failed \(HTTP 404 Not Found\)$"):
        fetch(f"{host}/missing", "image 0")
    with pytest.raises(DecodertError, match="is 5 bytes; the limit is 4$"):
        Fetcher(ImageLimits(max_bytes=4))(f"{host}/image", "image 0")
    with pytest.raises(DecodertError, match="failed .*ConnectionRefusedError"):
        fetch("http://127.0.0.1:1/x.png", "image 0")


def test_fetches_beyond_the_cap_are_refused_at_once_and_their_threads_end(host):
    fetch = Fetcher(ImageLimits(), deadline_s=DEADLINE, max_fetches=2)
    before = threading.active_count()
    with ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(fetch, f"{host}/slow", f"image {i}") for i in range(2)]
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(Busy, match=r"^image 9: 2 image fetches are running already"):
            fetch(f"{host}/image", "image 9")
        assert time.monotonic() - t0 < 0.2
        for f in slow:
            with pytest.raises(DecodertError, match="took longer than"):
                f.result(10)
    deadline = time.monotonic() + 5  # the fetch threads end once their sockets are shut down
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
    assert fetch(f"{host}/image", "image 0") == b"bytes"  # both places are free again


def _image_chat(url: str) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


def test_slow_image_hosts_do_not_block_other_requests(host):
    """45 requests whose image dribbles in (the trial's case) with 8 fetch places: a text-only chat is answered
    promptly while they run; 8 fail at their deadline with a one-line 400, the other 37 get a 503 at once."""
    llm = make_llm(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    llm.fetch_image = Fetcher(llm.image_limits, deadline_s=DEADLINE, max_fetches=8)
    with running(llm, model_name="tiny") as (url, app):
        with ThreadPoolExecutor(45) as pool, httpx.Client(base_url=url, timeout=30) as client:
            slow = [pool.submit(client.post, "/v1/chat/completions", json=_image_chat(f"{host}/slow"))
                    for _ in range(45)]
            time.sleep(0.5)
            t0 = time.monotonic()
            text = client.post("/v1/chat/completions", timeout=5,
                               json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert text.status_code == 200 and time.monotonic() - t0 < 1.0, text.text
            answers = [f.result(30) for f in slow]
        codes = sorted(r.status_code for r in answers)
        assert codes == [400] * 8 + [503] * 37, codes
        for r in answers:
            err = r.json()["error"]
            assert "\n" not in err["message"]
            if r.status_code == 400:
                assert "took longer than 1.5 s" in err["message"] and err["param"] == "messages"
            else:
                assert "8 image fetches are running already" in err["message"] and r.headers["retry-after"] == "1"
        loop = _post(url, _image_chat(f"{host}/loop"))
        assert loop.status_code == 400 and loop.json()["error"]["message"].endswith("(a redirect loop?))")
        assert httpx.get(f"{url}/health").json()["queued"] == 0


def _post(url: str, body: dict):
    return httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=30)


def test_the_serve_flags_reach_the_fetcher(tmp_path, capsys):
    from decodert.cli import main

    for flag, value in (("--image-fetch-timeout", "0"), ("--image-fetch-timeout", "inf"), ("--max-image-fetches", "0")):
        assert main(["serve", str(tmp_path), flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"decodert: error: {flag} must be") and len(err.splitlines()) == 1, err
