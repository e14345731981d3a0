"""A Redis URL that is not one is named as such, never reported as a server that cannot be reached
(``--redis-url notaurl`` once said "cannot reach Redis at localhost:6379"); a password in it is never
shown; a well-formed URL with nothing listening still says it cannot reach the server."""

from __future__ import annotations

import socket
import subprocess

import pytest
from demo_launch import ROOT, assert_one_line_error, asyncrl, demo_launch_cmd

from asyncrl.errors import UserError
from asyncrl.fleet.redis_server import check_redis_url, redis_url_problem

NOT_URLS = [
    "notaurl",
    "localhost:6379",  # an address, not a URL
    "http://127.0.0.1:6379",
    "redis://127.0.0.1:notaport",
    "redis://127.0.0.1:6379/zero",
    "redis://:s3cret@:6379/0",  # no host
    "unix://",  # no socket path
]


@pytest.mark.parametrize("url", NOT_URLS)
def test_what_is_not_a_redis_url_is_called_so(url):
    assert redis_url_problem(url)
    with pytest.raises(UserError) as err:
        check_redis_url(url, timeout_s=1.0)
    message = str(err.value)
    assert "is not a Redis URL" in message and "cannot reach" not in message, message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379", "redis://:pw@10.0.0.1:7000/3", "rediss://host.example/0", "unix:///tmp/r.sock"]
)
def test_redis_urls_pass(url):
    assert redis_url_problem(url) is None


def test_a_url_nobody_answers_at_still_says_it_cannot_reach_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(UserError, match=f"cannot reach Redis at 127.0.0.1:{port}"):
            check_redis_url(f"redis://:pw@127.0.0.1:{port}/0", timeout_s=1.0)


def test_the_status_command_says_it_in_one_line():
    out = asyncrl("status", "--redis-url", "notaurl")
    assert out.returncode == 2
    assert_one_line_error(out, "'notaurl' is not a Redis URL")


@pytest.mark.slow  # the dry run imports the demo's reward and episode code (seconds)
def test_launch_says_it_in_one_line(tmp_path):
    cmd = demo_launch_cmd(tmp_path, "bad-url", "--redis-url", "notaurl", "--dry-run")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert_one_line_error(out, "'notaurl' is not a Redis URL")
