#!/usr/bin/env bash
# Prints a Python interpreter of one of the minor versions given, in order of
# preference, that this machine has: on PATH (python3.X), then pyenv's versions,
# then `python3` when its version is one of them. Prints nothing when none is found.
#
#   scripts/find_python.sh 3.12 3.13     # the Makefile's main lane
#   scripts/find_python.sh 3.11          # its oldest lane
set -uo pipefail

works() {  # $1: an interpreter; $2: the MAJOR.MINOR it must be
  local got
  got=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || return 1
  [ "$got" = "$2" ]
}

for want in "$@"; do
  # A pyenv shim on PATH refuses a version that is not selected: `works` tells.
  if command -v "python$want" >/dev/null 2>&1 && works "python$want" "$want"; then
    command -v "python$want"; exit 0
  fi
  if command -v pyenv >/dev/null 2>&1; then
    root=$(pyenv root 2>/dev/null)
    for exe in $(ls -d "$root"/versions/"$want".*/bin/python"$want" 2>/dev/null | sort -rV); do
      if works "$exe" "$want"; then echo "$exe"; exit 0; fi
    done
  fi
  for exe in /usr/bin/python"$want" /usr/local/bin/python"$want"; do
    if [ -x "$exe" ] && works "$exe" "$want"; then echo "$exe"; exit 0; fi
  done
  if command -v python3 >/dev/null 2>&1 && works python3 "$want"; then
    command -v python3; exit 0
  fi
done
exit 0
