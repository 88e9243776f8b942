"""The test suite once per supported PyTorch version, each in its own virtual environment.

    pip install nox
    nox                          # every version below, one after the other
    nox -s "tests(2.4.1)"        # one version
    nox -l                       # list the sessions

Each session creates a folder under ``.nox/``, installs that ``torch`` and
this package with the extras of the README's test command (``test``, ``plot``,
and each library of ``models`` whose pins allow that torch), and runs ``pytest`` (arguments after
``--`` go to pytest, e.g. ``nox -s "tests(2.13.0)" -- -m slow``). The wheels are
large (a CUDA build of torch is several GB): delete ``.nox/`` afterwards.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nox

#: Oldest supported (pyproject: torch>=2.4), the one the README commands pin, the newest checked.
TORCH_VERSIONS = ["2.4.1", "2.13.0", "2.14.1"]

nox.options.sessions = ["tests"]


#: how to ask an installed model library whether it works with the installed torch (prints yes or no)
_USABLE = {
    "transformers": "import importlib.util as u\n"
    "if u.find_spec('transformers') is None: print('absent')\n"
    "else:\n import transformers.utils as t; print('yes' if t.is_torch_available() else 'no')",
}


def _extra(name: str) -> list[str]:
    """The requirements of one of pyproject.toml's extras (a one-line list there; Python 3.10 has no tomllib)."""
    text = (Path(__file__).parent / "pyproject.toml").read_text()
    found = re.search(rf"^{re.escape(name)} = (\[.*\])$", text, re.MULTILINE)
    if found is None:
        raise ValueError(f"pyproject.toml has no one-line extra {name!r}")
    requirements: list[str] = ast.literal_eval(found.group(1))
    return requirements
nox.options.error_on_missing_interpreters = True


@nox.session
@nox.parametrize("torch_version", TORCH_VERSIONS, ids=TORCH_VERSIONS)
def tests(session: nox.Session, torch_version: str) -> None:
    """Install torch==<version> and qkvtrace[test], then run the default test suite."""
    pin = f"torch=={torch_version}"
    session.install(pin)
    session.install("-e", ".[test,plot]", pin)
    # the README's test command installs the model libraries too; each one whose pins allow this torch is installed
    for requirement in _extra("models"):
        session.run("python", "-m", "pip", "install", "-q", requirement, pin, success_codes=[0, 1])
    # a library can install beside a torch it then refuses at run time (transformers 5 needs torch >= 2.6)
    for name, check in _USABLE.items():
        said = session.run("python", "-c", check, silent=True, success_codes=[0, 1]) or ""
        if "no" in str(said).split():
            session.log(f"{name} installed but refuses torch {torch_version}: uninstalled, its tests skip")
            session.run("python", "-m", "pip", "uninstall", "-q", "-y", name)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile", *session.posargs)
