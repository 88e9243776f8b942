#!/usr/bin/env bash
# Collect one report per PyTorch release: make a virtual environment, install
# that torch from PyPI, run `qkvtrace history --python` on it, remove it.
#
#   benchmarks/collect_history.sh                 # the latest patch of every minor release 2.0 .. 2.14
#   benchmarks/collect_history.sh 2.0.1 2.5.1     # just these
#
# One environment at a time (a CUDA build of torch with its libraries is ~5 GB).
# Settings (environment variables):
#   QKVTRACE_OUT        where reports go                     (default: reports)
#   QKVTRACE_VENVS      where the environments are made      (default: /tmp/qkvtrace-history)
#   QKVTRACE_BASE_PY    the Python the environments are made from (default: python3.11, which
#                       every release from 2.0 to 2.14 has wheels for)
#   QKVTRACE_PY         an interpreter with qkvtrace installed (default: python)
#   QKVTRACE_LOCAL      a release already installed: VERSION=PYTHON, collected without a new environment
#
# A release that cannot be installed or collected is recorded in $QKVTRACE_VENVS/status.tsv with the
# last line of its log, and the script goes on with the rest. Exit status: the number of failures.
# Afterwards: `qkvtrace history $QKVTRACE_OUT` writes the timeline.
set -u

OUT=${QKVTRACE_OUT:-reports}
VENVS=${QKVTRACE_VENVS:-/tmp/qkvtrace-history}
BASE_PY=${QKVTRACE_BASE_PY:-python3.11}
QKV=${QKVTRACE_PY:-python}
LOCAL=${QKVTRACE_LOCAL:-}
if [ "$#" -eq 0 ]; then
    set -- 2.0.1 2.1.2 2.2.2 2.3.1 2.4.1 2.5.1 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.1
fi

mkdir -p "$VENVS/logs" "$OUT"
STATUS="$VENVS/status.tsv"
failures=0

record() {  # version, outcome, detail
    printf '%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$1" "$2" "$3" >>"$STATUS"
    echo "torch $1: $2 $3" >&2
}

for version in "$@"; do
    log="$VENVS/logs/torch-$version.log"
    : >"$log"
    python_for=""
    if [ -n "$LOCAL" ] && [ "${LOCAL%%=*}" = "$version" ]; then
        python_for="${LOCAL#*=}"
    fi
    venv="$VENVS/torch-$version"
    if [ -z "$python_for" ] && "$venv/bin/python" -c \
        "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" >>"$log" 2>&1; then
        python_for="$venv/bin/python"  # left by an interrupted run: reuse it
        record "$version" reused "$venv"
    fi
    if [ -z "$python_for" ]; then
        rm -rf "$venv"
        start=$(date +%s)
        if ! "$BASE_PY" -m venv "$venv" >>"$log" 2>&1 \
            || ! "$venv/bin/pip" install --no-cache-dir --disable-pip-version-check -q "torch==$version" >>"$log" 2>&1; then
            record "$version" install-failed "$(grep -v '^WARNING: Location' "$log" | tail -n 1)"
            rm -rf "$venv"
            failures=$((failures + 1))
            continue
        fi
        record "$version" installed "in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)"
        python_for="$venv/bin/python"
    fi
    start=$(date +%s)
    if COLUMNS=250 "$QKV" -m qkvtrace history --python "$python_for" --out "$OUT" --no-timeline >>"$log" 2>&1; then
        record "$version" collected "in $(($(date +%s) - start)) s: $(grep -o 'wrote [^ ]*' "$log" | tail -n 1)"
    else
        record "$version" collect-failed "$(tail -n 1 "$log")"
        failures=$((failures + 1))
    fi
    [ "$python_for" = "$venv/bin/python" ] && rm -rf "$venv"
done
exit "$failures"
