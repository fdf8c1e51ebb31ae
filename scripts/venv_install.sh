#!/bin/sh
# scripts/venv_install.sh VENV ARGS...: install ARGS (as pip install takes them:
# -e '.[dev]', -c FILE) into the virtualenv VENV, for the Makefile.
#
# uv does it: it fetches the wheels at once, where pip fetches one after the
# other (a fresh .venv took pip about a minute here, uv 10 s, 2026-12-07). uv comes
# from the virtualenv's own pip (seconds). Where no uv installs, pip does all of it.
# Neither byte-compiles what it installs (uv never does; pip is told not to): a
# module is compiled the first time it is imported, so only what runs is.
set -eu
venv=$1
shift
if "$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv; then
  exec "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" "$@"
fi
echo "scripts/venv_install.sh: uv did not install; pip installs instead (a minute or more)" >&2
"$venv/bin/python" -m pip install --quiet --upgrade pip
exec "$venv/bin/python" -m pip install --quiet --no-compile "$@"
