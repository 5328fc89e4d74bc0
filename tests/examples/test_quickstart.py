"""examples/quickstart.py, as README shows it, run as a program against a real daemon.

The daemon runs the built-in default configuration (the default model, tenant, host tier and
checker) except for the socket path, which is the test's, and the admin port, 0 because other
daemons may run beside it. The script must exit 0 and its output must show what README promises:
request 1 starts cold and gives SWA back past the window, request 2 gets request 1's pages for
the shared prefix, and those pages hold request 1's KV.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import default_socket_path
from examples.quickstart import default_socket

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "quickstart.py"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RADIXD_TOKEN"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


def int_list(line: str) -> list[int]:
    """The page list a line ends with, printed as a Python list of ints."""
    m = re.search(r"\[([\d, ]*)\]$", line)
    assert m, f"no list of ints in {line!r}"
    return [int(x) for x in m.group(1).split(",") if x.strip()]


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float8_e4m3fn", "float8_e5m2", "float32"])
def test_quickstart_against_the_default_daemon(make_daemon, dtype: str | None) -> None:
    """Also with the model's KV in every other dtype radixd accepts: against bfloat16 (the model
    of ``radixd config example --cpu``) the script wrote token ids up to 2000, which bfloat16
    rounds, and its own check of the page's KV failed."""
    model = {"dtype": dtype} if dtype else {}
    d = make_daemon({"models": [model], "checker": {}, "admin": {"port": 0}})
    run = run_script("--socket", d.socket, "--seed", "7")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    lines = out.splitlines()

    # the built-in default model
    assert lines[0].startswith("model 'default': page size 16, sliding window 128,"), out
    req1 = out.index("request 1:")
    req2 = out.index("request 2:")
    first, second = out[req1:req2].splitlines(), out[req2:].splitlines()
    assert first[0] == "request 1: prompt 184 tokens, 0 cached (device 0, host 0)", out
    # decoded past the window: the request's own SWA pages and its prefix's lock given back
    assert any(re.search(r"decoded 160 tokens: 344 in the sequence, [1-9]\d* SWA pages freed, "
                         r"prefix SWA released: True", line) for line in first), out
    assert second[0] == "request 2: prompt 184 tokens, 160 cached (device 160, host 0)", out
    assert "check_writable refuses a write into a matched page: it is shared" in out

    pages1 = int_list(next(x for x in first if "full pages of the prompt" in x))
    matched = int_list(next(x for x in second if "matched full pages" in x))
    pages2 = int_list(next(x for x in second if "full pages of the prompt" in x))
    assert len(pages1) == len(pages2) == 184 // 16
    assert matched == pages1[:10] == pages2[:10]  # the shared 160 tokens: request 1's pages
    assert pages2[10] not in pages1  # where the prompts differ, a page of request 2's own
    assert len(set(pages1)) == len(pages1) and 0 not in pages1
    assert "request 2 reused request 1's first 10 pages: True" in lines
    assert re.search(r"^full page \d+ holds the KV request 1 wrote for tokens \[[\d, ]+\]: True$",
                     out, re.M), out
    assert run.stderr == ""


def test_quickstart_names_the_models_when_its_model_is_not_served(make_daemon) -> None:
    d = make_daemon({"models": [{"name": "ma"}], "admin": {"port": 0}})
    run = run_script("--socket", d.socket)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "serves no model 'default' to this session; it serves ma: pass --model" in run.stderr
    run = run_script("--socket", d.socket, "--model", "ma", "--seed", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("model 'ma': page size 16")


def test_quickstart_without_a_daemon(tmp_path: Path) -> None:
    run = run_script("--socket", str(tmp_path / "none.sock"))
    assert run.returncode == 1
    assert "no socket at" in run.stderr and "./scripts/run.sh" in run.stderr


@pytest.mark.parametrize("service", [None, "/run/radixd", "/run/radixd:/run/other"])
@pytest.mark.parametrize("runtime", ["/run/user/4242", None])
def test_default_socket_is_the_daemons(monkeypatch: pytest.MonkeyPatch,
                                       runtime: str | None, service: str | None) -> None:
    """Run without --socket, the script finds a daemon started without a socket configured;
    under systemd (``RUNTIME_DIRECTORY``, which the shipped unit's RuntimeDirectory= sets) the
    socket is in the service's runtime directory, not under a /tmp that PrivateTmp= hides."""
    for name, value in (("XDG_RUNTIME_DIR", runtime), ("RUNTIME_DIRECTORY", service)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert default_socket() == default_socket_path()
    if service is not None:
        assert default_socket_path() == "/run/radixd/radixd.sock"
