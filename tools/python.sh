#!/bin/sh
# The Python that the Makefile builds its environment with: Chainer 7.8.1
# runs on CPython 3.11, 3.12 and 3.13 (3.12+ through the package's start-up
# stand-ins, _chainermn_overlap_compat.py).
#
#   sh tools/python.sh find [PYTHON]       print the path of a usable Python
#   sh tools/python.sh venv DIR [PYTHON]   make DIR a venv of one (kept if it is)
#
# PYTHON is what the user named (make PYTHON=python3.12); empty, python3 is
# taken when it is 3.11-3.13, else the newest of python3.13, python3.12,
# python3.11 on PATH, else of pyenv's installations.  A PYTHON that names
# pythonX.Y but does not run (a pyenv shim of a version not selected) is
# looked for among pyenv's installations too.  Messages go to stderr, one
# line each; a Python that cannot be used ends it with status 1.
set -u
WORKS='3.11, 3.12 or 3.13'

usable() {
    "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' \
        >/dev/null 2>&1
}

version() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

# Absolute path of a command name or path.
where() {
    case $1 in
        */*) echo "$1" ;;
        *) command -v "$1" ;;
    esac
}

pyenv_pythons() {    # newest first; $1: a version such as 3.12, or empty for all
    root=${PYENV_ROOT:-$HOME/.pyenv}
    for d in $(ls -d "$root"/versions/3.1[123]* 2>/dev/null | sort -r -V); do
        case ${d##*/} in
            ${1:-3.1[123]}|${1:-3.1[123]}.*) ;;
            *) continue ;;
        esac
        for exe in "$d"/bin/python3.1[123]; do
            [ -x "$exe" ] && echo "$exe"
        done
    done
}

find_python() {
    want=${1:-}
    if [ -n "$want" ]; then
        if usable "$want"; then where "$want"; return 0; fi
        v=$(version "$want")
        case ${want##*/} in
            python3.1[123])
                if [ -z "$v" ]; then
                    for exe in $(pyenv_pythons "${want##*python}"); do
                        if usable "$exe"; then
                            echo "PYTHON=$want does not run here; using $exe" >&2
                            echo "$exe"
                            return 0
                        fi
                    done
                fi ;;
        esac
        if [ -n "$v" ]; then
            echo "PYTHON=$want is Python $v: chainermn_overlap needs Python $WORKS (what Chainer 7.8.1 runs on); name one, e.g. make PYTHON=python3.12" >&2
        else
            echo "PYTHON=$want does not run here: chainermn_overlap needs Python $WORKS; name one, e.g. make PYTHON=python3.12" >&2
        fi
        return 1
    fi
    if usable python3; then where python3; return 0; fi
    v=$(version python3)
    was="python3 is Python $v"
    [ -n "$v" ] || was='python3 does not run here'
    for exe in python3.13 python3.12 python3.11 $(pyenv_pythons ''); do
        if usable "$exe"; then
            exe=$(where "$exe")
            echo "$was: using $exe (Python $(version "$exe"))" >&2
            echo "$exe"
            return 0
        fi
    done
    echo "no Python $WORKS found ($was): install one and run make PYTHON=/path/to/python3.12" >&2
    return 1
}

make_venv() {
    dir=$1
    want=${2:-}
    if [ -x "$dir/bin/python" ]; then
        have=$(version "$dir/bin/python")
        if [ -z "$want" ] && usable "$dir/bin/python"; then
            return 0
        fi
        py=$(find_python "$want") || return 1
        [ "$have" = "$(version "$py")" ] && return 0
        echo "replacing $dir (Python ${have:-unknown}) by a venv of Python $(version "$py") ($py)" >&2
        rm -rf "$dir"
    else
        py=$(find_python "$want") || return 1
        echo "creating $dir with Python $(version "$py") ($py)" >&2
    fi
    "$py" -m venv "$dir"
}

case ${1:-} in
    find) find_python "${2:-}" ;;
    venv) make_venv "$2" "${3:-}" ;;
    *) echo "usage: sh tools/python.sh find [PYTHON] | venv DIR [PYTHON]" >&2; exit 2 ;;
esac
