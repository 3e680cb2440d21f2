"""The package itself: mypy --strict, an install from the directory, docstrings, the examples."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import obsd
import obsd.aio
from support import REPO_ROOT, WAIT, Daemon, wait_until

PACKAGE = Path(__file__).resolve().parents[1]


def test_mypy_strict() -> None:
    try:
        import mypy  # noqa: F401
    except ImportError:  # pragma: no cover
        raise AssertionError("mypy is not installed: pip install mypy (make test-deps does)") from None
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", str(PACKAGE / "pyproject.toml"), str(PACKAGE / "src" / "obsd")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success" in out.stdout


def test_pip_install_from_the_directory() -> None:
    with tempfile.TemporaryDirectory(prefix="obsd-py-install-") as target:
        out = subprocess.run(
            # as a user would: pip fetches the build backend (setuptools) if it must, nothing else
            [sys.executable, "-m", "pip", "install", "--no-deps", "--target", target, str(PACKAGE)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        check = "import obsd, obsd.aio, os; print(obsd.__file__); print(os.path.exists(os.path.join(os.path.dirname(obsd.__file__), 'py.typed')))"
        out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": target}, cwd=target, timeout=60)
        assert out.returncode == 0, out.stderr
        path, typed = out.stdout.split()
        assert path.startswith(target) and typed == "True"


def test_every_public_name_has_a_docstring() -> None:
    missing = []
    for module in (obsd, obsd.aio):
        assert module.__doc__
        for name in module.__all__:
            thing = getattr(module, name)
            if name.startswith("__") or thing in (obsd.ABSENT, obsd.UNKNOWN):
                continue
            if not inspect.getdoc(thing):
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(thing):
                for member, value in vars(thing).items():
                    if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
                        continue
                    if not inspect.getdoc(value):
                        missing.append(f"{module.__name__}.{name}.{member}")
    assert not missing, missing


def test_examples(daemon: Daemon) -> None:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE / "src"), "OBSD_SOCKET": daemon.socket}
    examples = REPO_ROOT / "Examples" / "python"
    printer = subprocess.Popen(
        [sys.executable, str(examples / "mirror_printer.py"), "presence", "--prefix", "presence/", "--changes", "2"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert printer.stdout is not None
        assert printer.stdout.readline().startswith("-- presence at revision 0")
        out = subprocess.run(
            [sys.executable, str(examples / "presence.py"), "web-1", "--for", "1.0"], capture_output=True, text=True, env=env, timeout=WAIT
        )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert "web-1 is present (lease 1)" in lines and "present (1): web-1" in lines and "web-1 left" in lines
        rest, _ = printer.communicate(timeout=WAIT)
        assert printer.returncode == 0
        assert "changed: presence/web-1\npresence/web-1 = {" in rest  # it arrived
        assert rest.rstrip().endswith("changed: presence/web-1")  # and left
    finally:
        if printer.poll() is None:
            printer.kill()
            printer.wait()
    with obsd.connect(daemon.socket) as c:
        wait_until(lambda: c.keys("presence") == [], "the presence key to be gone")
