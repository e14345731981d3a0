"""The sandboxed Python tool (``asyncrl.episodes.sandbox``): each limit on its own, isolation, cancellation, schema.

Limits are small so the file stays fast on a busy machine. Isolation (network, files, the uid's processes) needs
root; those tests skip with the reason elsewhere. The fork bomb runs only as root, where its process limit is
per-sandbox-uid and real (not root, RLIMIT_NPROC would count all of this user's processes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import resource
import socket
import sys
import time
import uuid

import psutil
import pytest

from asyncrl.episodes import sandbox
from asyncrl.episodes.tools import Tool, load_tools, parse_hermes
from asyncrl.errors import EpisodeFailure
from asyncrl.service import sandbox as engine

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="network/mount/PID namespaces and the uid drop need root")
REPO = pathlib.Path(__file__).resolve().parents[2]


def run(code: str, **limits) -> str:
    return asyncio.run(sandbox.run_python(code, sandbox.Limits(**limits)))


def sandbox_processes() -> list[psutil.Process]:
    """Live processes (zombies included) of this process's sandbox uids."""
    uids = sandbox.sandbox_uids()
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in uids]


_THERE_BEFORE: set[int] = set()  # processes of other tests' fixtures (a session's redis-server)


@pytest.fixture(autouse=True)
def _others_before():
    _THERE_BEFORE.clear()
    _THERE_BEFORE.update(p.pid for p in psutil.Process().children(recursive=True))


def descendants() -> list[psutil.Process]:
    """This test's processes (not those already running when it started)."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in _THERE_BEFORE]


def test_schema_is_one_string_argument_named_code():
    tool = sandbox.python
    assert isinstance(tool, Tool) and tool.name == "python"
    assert tool.parameters == {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    assert tool.timeout_s > sandbox.WALL_S  # the sandbox's own deadline speaks before the machinery's
    custom = sandbox.make_python_tool("py", cpu_s=2, wall_s=3)
    assert custom.name == "py" and "2 s CPU" in custom.description and custom.timeout_s > 3
    with pytest.raises(ValueError, match="memory_mb"):
        sandbox.make_python_tool(memory_mb=0)


def test_loads_by_path_and_answers_a_parsed_call():
    tools = load_tools(["asyncrl.episodes.sandbox:python"])
    text = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    [call] = parse_hermes(text, tools)
    assert asyncio.run(tools["python"](call.arguments, timeout_s=10)) == "42"
    with pytest.raises(EpisodeFailure, match="code must be a string") as failure:
        asyncio.run(tools["python"]({"code": 42}, timeout_s=10))
    assert failure.value.cause == "tool_error"


def test_hello_world():
    assert run("print('hello')") == "hello"
    assert run("x = 1") == "(no output)"


def test_an_exception_ends_with_its_traceback_and_exit_status():
    lines = run("def f():\n    return 1 / 0\nprint('before')\nf()").splitlines()
    assert lines[0] == "before"
    assert lines[-2:] == ["ZeroDivisionError: division by zero", "error: exit status 1"]
    assert "return 1 / 0" in "\n".join(lines)  # the source line: the program is a file


def test_a_busy_loop_hits_the_cpu_limit():
    t0 = time.monotonic()
    result = run("while True: pass", cpu_s=1, wall_s=20)
    assert result == "error: CPU time limit (1 s) exceeded"
    assert time.monotonic() - t0 < 15


def test_sleeping_hits_the_wall_limit_and_keeps_what_was_printed():
    t0 = time.monotonic()
    result = run("import time\nprint('started')\ntime.sleep(60)", wall_s=1.5)
    assert result.splitlines() == ["started", "error: wall time limit (1.5 s) exceeded"]
    assert time.monotonic() - t0 < 6
    assert not descendants() and not sandbox_processes()  # the program was reaped, not left to the host's init


def test_a_huge_allocation_hits_the_memory_limit():
    result = run("x = bytearray(10 * 1024**3)", memory_mb=256)
    assert "MemoryError" in result
    assert result.splitlines()[-1] == "error: memory limit (256 MB) exceeded"


def test_a_big_file_hits_the_file_size_limit():
    result = run("open('big', 'wb').write(b'x' * (2 << 20))", file_mb=1)
    assert "File too large" in result
    assert result.splitlines()[-1] == "error: file size limit (1 MB) exceeded"


def test_an_output_flood_is_cut_with_bounded_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.monotonic()
    result = run("print('x' * 10**8)", output_bytes=4096, wall_s=20)
    assert time.monotonic() - t0 < 15
    *printed, last = result.splitlines()
    assert printed == ["x" * 4096]
    assert last == "error: output limit (4096 bytes) exceeded: the rest was cut, the program stopped"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # never the 100 MB


@needs_root
def test_a_fork_bomb_is_contained_and_leaves_nothing():
    t0 = time.monotonic()
    result = run("import os\nwhile True:\n    os.fork()", processes=8, wall_s=5, cpu_s=2)
    assert time.monotonic() - t0 < 10
    assert "error: process limit (8, threads included) reached" in result
    assert not sandbox_processes()
    assert not descendants()


@needs_root
def test_what_the_program_leaves_behind_is_killed_when_it_ends():
    t0 = time.monotonic()
    code = "import os, subprocess, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    code += "subprocess.Popen(['sleep', '60'], start_new_session=True)\nprint('done')"
    assert run(code, wall_s=10) == "done"
    assert time.monotonic() - t0 < 5  # not the wall time: its PID namespace ended with it
    assert not sandbox_processes() and not descendants()


@needs_root
def test_no_network_not_even_this_hosts_loopback():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"for address in [('1.1.1.1', 53), ('127.0.0.1', {port})]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=2).close()\n"
            "        print('connected', address)\n"
            "    except OSError as exc:\n"
            "        print('blocked', address, exc)\n"
        )
        result = run(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever arrived
    assert "connected" not in result
    assert result.count("blocked") == 2


@needs_root
def test_writes_stay_in_the_sandbox():
    name = f"asyncrl-sandbox-test-{uuid.uuid4().hex}"
    outside = [pathlib.Path("/tmp") / name, REPO / name, pathlib.Path.home() / name, pathlib.Path("/var/tmp") / name]
    code = (
        f"for path in {[str(p) for p in outside]!r} + ['here.txt']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('denied', path, exc.strerror)\n"
        "print(open('here.txt').read())\n"
    )
    lines = run(code).splitlines()
    assert f"denied {REPO / name} Permission denied" in lines
    assert f"denied {pathlib.Path.home() / name} Permission denied" in lines
    assert "wrote here.txt" in lines and lines[-1] == "x"
    assert not [p for p in outside if p.exists()]  # /tmp and /var/tmp were the sandbox's private tmpfs


@needs_root
def test_runs_as_an_unprivileged_uid_without_inherited_secrets(monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "hunter2")
    code = "import os\nprint(os.getuid())\nprint(os.getcwd())\nprint(sorted(os.environ))\n"
    code += "print(os.listdir('/proc/self/fd'))"
    uid, cwd, env, fds = run(code).splitlines()
    # the private /tmp; its subdirectory ``work`` when this interpreter lives under /tmp (bound back there)
    workdir = "/tmp/work" if os.path.realpath(sys.prefix).startswith("/tmp/") else "/tmp"
    assert int(uid) in sandbox.sandbox_uids() and cwd == workdir
    assert "ASYNCRL_TEST_SECRET" not in env and "PYTHONPATH" not in env
    assert fds == "['0', '1', '2', '3']"  # stdin, stdout, stderr and listdir's own: no status pipe to forge


def test_numpy_imports_within_the_default_limits():
    assert run("import numpy as np\nprint(np.arange(4) @ np.arange(4))") == "14"


def test_concurrent_sandboxes_do_not_share_anything():
    async def many() -> list[str]:
        code = "import os\nprint(os.getuid(), sorted(os.listdir('.')))"
        return await asyncio.gather(*[sandbox.run_python(code) for _ in range(4)])

    results = asyncio.run(many())
    assert all(r.endswith("['main.py']") for r in results)
    if ROOT:
        assert len({r.split()[0] for r in results}) == 4  # a uid each


def test_cancellation_kills_the_whole_tree():
    async def scenario() -> None:
        call = asyncio.ensure_future(sandbox.run_python("import time\ntime.sleep(60)"))
        while len(descendants()) < 2:  # the bootstrap and the program
            assert not call.done()
            await asyncio.sleep(0.02)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(scenario())
    assert not descendants()  # killed and reaped: not even a zombie
    assert not sandbox_processes()


def test_the_tool_machinerys_timeout_kills_the_tree():
    with pytest.raises(EpisodeFailure) as failure:
        asyncio.run(sandbox.python({"code": "import time\ntime.sleep(60)"}, timeout_s=0.5))
    assert failure.value.cause == "tool_timeout"
    assert not descendants() and not sandbox_processes()


def test_unprivileged_fallback_runs_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(engine, "_privileged", lambda: False)
    monkeypatch.setattr(engine, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="asyncrl.service.sandbox"):
        cwd, uid = run("import os\nprint(os.getcwd())\nprint(os.getuid())").splitlines()
        assert run("import time\nprint('started')\ntime.sleep(60)", wall_s=1).endswith("(1 s) exceeded")
    assert int(uid) == os.getuid() and cwd.startswith("/tmp/asyncrl-sandbox-")
    assert not os.path.exists(cwd)  # removed after the call
    assert [r.getMessage() for r in caplog.records] == [
        "python sandbox not isolated: not root: the program can reach the network and write wherever this user can"
    ]
    assert not descendants()
