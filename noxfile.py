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
import sys
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


#: The modules that produce facts, each with the tests that own it: ``nox -s mutants`` mutates one module at a
#: time (mutmut) and runs only these against each mutant. The 20,000-call long run is left out of
#: test_monitor.py's: 90 s a mutant would make the run days long (its other tests cover the same functions).
#: test_health.py is monitor's too: its health lines and scalars are written by the monitor.
MUTANT_OWNERS: dict[str, list[str]] = {
    "facts/masks": ["tests/test_records.py", "tests/test_hand_written.py"],
    "facts/refusals": ["tests/test_refusals.py", "tests/test_refusals_more.py"],
    "analyses/tracediff": ["tests/test_tracediff.py"],
    "tracer/monitor": ["tests/test_monitor.py", "tests/test_health.py", "tests/test_steady_state.py",
                       "tests/test_slots.py", "--deselect",
                "tests/test_monitor.py::test_a_long_run_reports_exactly_the_steps_where_attention_changed"],
    "facts/paths": ["tests/test_paths.py"],
    "facts/slices": ["tests/test_slices.py", "tests/test_norms.py", "tests/test_trace_reopen.py"],
    "facts/dataflow": ["tests/test_slices.py", "tests/test_hand_written.py", "tests/test_dataflow.py"],
    "facts/lineage": ["tests/test_lineage.py", "tests/test_observe_only.py", "tests/test_rows_in_use.py", "--deselect",
                "tests/test_observe_only.py::test_an_input_viewing_a_large_buffer_copies_nothing_of_it", "--deselect",
                "tests/test_observe_only.py::test_a_collective_in_the_forward_with_one_rank_traced"],
    "facts/maps": ["tests/test_maps.py", "tests/test_maps_more.py"],
    "analyses/advise": ["tests/test_advise.py", "tests/test_advise_more.py"],
    "tracer/slots": ["tests/test_slots.py", "tests/test_again.py", "tests/test_decoding.py",
                     "tests/test_steady_state.py", "tests/test_health.py", "tests/test_monitor.py", "--deselect",
                     "tests/test_monitor.py::test_a_long_run_reports_exactly_the_steps_where_attention_changed"],
    "tracer/hot": ["tests/test_slots.py", "tests/test_again.py", "tests/test_routes.py", "tests/test_norms.py",
                   "tests/test_decoding.py", "tests/test_steady_state.py", "tests/test_call_owner.py",
                   "tests/test_floors.py", "tests/test_identity.py", "tests/test_monitor.py", "--deselect",
                   "tests/test_monitor.py::test_a_long_run_reports_exactly_the_steps_where_attention_changed"],
}  # fmt: skip


def _mutmut_config(module: str) -> str:
    """mutmut's settings for one module (a setup.cfg section: mutmut reads pyproject.toml or setup.cfg only)."""
    owners = "\n    ".join(MUTANT_OWNERS[module])
    return (
        "[mutmut]\n"
        f"source_paths = qkvtrace/{module}.py\n"
        f"only_mutate = qkvtrace/{module}.py\n"
        "also_copy =\n    qkvtrace\n    cli\n    reports\n    tests\n    benchmarks\n    docs\n    examples\n"
        "    README.md\n"
        f"pytest_add_cli_args_test_selection =\n    {owners}\n"
        "pytest_add_cli_args = -p no:cacheprovider\n"
        f"process_isolation = {'fork' if module in FORK_SAFE else 'forkserver'}\n"
    )


#: Modules whose mutants may run in plain forks of the process that mapped the tests (ten times faster): pure
#: functions over records. Elsewhere each mutant runs in a child of a server that has run nothing, because a
#: fork inherits the caches the mapping run filled (kernel evidence, PyTorch's refusals) and the mutated code
#: never runs (measured: refusals.py's _stand_in, 0 of 74 mutants killed in forks, 43 of 74 so).
#: dataflow's one cache is keyed weakly by the modules a test builds (none lives at a test module's top level),
#: and maps and advise keep none: their mutated code runs again in every fork.
FORK_SAFE = {"analyses/tracediff", "facts/dataflow", "facts/lineage", "facts/maps", "analyses/advise"}


@nox.session
def mutants(session: nox.Session) -> None:
    """Mutation testing of the modules that produce facts, each against the tests that own it.

    nox -s mutants                       # every module of MUTANT_OWNERS, one after the other (hours)
    nox -s mutants -- facts/refusals facts/masks  # those modules only
    nox --no-venv -s mutants -- facts/refusals  # in the current environment (torch and qkvtrace[test] installed)

    Each module is mutated in its own copy of the tracked files under ``.nox/mutants/<module>``; the
    numbers (killed, survived, ...) land in ``.nox/mutants/<module>/mutants/mutmut-cicd-stats.json``
    and the surviving mutants are listed by ``mutmut results`` run there. docs/development.md keeps
    the scores measured and why each surviving mutant left there is equivalent.
    """
    import json
    import shutil
    import subprocess

    python = sys.executable  # --no-venv: the interpreter nox runs in
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        python = "python"
        pin = f"torch=={TORCH_VERSIONS[1]}"
        session.install(pin)
        session.install("-e", ".[test]", pin, "mutmut>=3.3")
    modules = session.posargs or list(MUTANT_OWNERS)
    unknown = sorted(set(modules) - set(MUTANT_OWNERS))
    if unknown:
        session.error(f"no such fact module: {', '.join(unknown)} (one of {', '.join(MUTANT_OWNERS)})")
    root = Path(__file__).parent
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    scores = {}
    for module in modules:
        copy = root / ".nox" / "mutants" / module
        shutil.rmtree(copy, ignore_errors=True)
        for name in filter(None, tracked.decode().split("\0")):
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, copy / name)
        (copy / "setup.cfg").write_text(_mutmut_config(module))
        with session.chdir(copy):
            session.run(python, "-m", "mutmut", "run", "--max-children", "1", external=True)
            session.run(python, "-m", "mutmut", "export-cicd-stats", external=True)
        stats = json.loads((copy / "mutants" / "mutmut-cicd-stats.json").read_text())
        scores[module] = f"{stats['killed']}/{stats['total']} killed ({stats['killed'] / max(stats['total'], 1):.0%})"
        session.log(f"{module}: {scores[module]}, {stats['survived']} survived")
    for module, score in scores.items():
        session.log(f"{module:10} {score}")
