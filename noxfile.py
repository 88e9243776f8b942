"""The test suite once per supported PyTorch version, each in its own virtual environment.

    pip install nox
    nox                          # every version below, one after the other
    nox -s "tests(2.4.1)"        # one version
    nox -l                       # list the sessions

Each session creates a folder under ``.nox/``, installs that ``torch`` and
this package with the extras of the README's test command (``test``, ``plot``,
and ``models`` where its pins allow that torch), and runs ``pytest`` (arguments after
``--`` go to pytest, e.g. ``nox -s "tests(2.13.0)" -- -m slow``). The wheels are
large (a CUDA build of torch is several GB): delete ``.nox/`` afterwards.
"""

from __future__ import annotations

import nox

#: Oldest supported (pyproject: torch>=2.4), the one the README commands pin, the newest checked.
TORCH_VERSIONS = ["2.4.1", "2.13.0", "2.14.1"]

nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True


@nox.session
@nox.parametrize("torch_version", TORCH_VERSIONS, ids=TORCH_VERSIONS)
def tests(session: nox.Session, torch_version: str) -> None:
    """Install torch==<version> and qkvtrace[test], then run the default test suite."""
    pin = f"torch=={torch_version}"
    session.install(pin)
    session.install("-e", ".[test,plot]", pin)
    # the README's test command installs the model libraries too; where their pins allow this torch, so does this
    session.run("python", "-m", "pip", "install", "-q", "-e", ".[models]", pin, success_codes=[0, 1])
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile", *session.posargs)
