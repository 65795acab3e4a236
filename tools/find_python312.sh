#!/usr/bin/env bash
# Print the path of a working CPython 3.12 interpreter, or fail with a message saying what to do.
# Order: $PYTHON, python3.12 on PATH, pyenv's 3.12.x, the usual system locations.
set -u
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
candidates+=("$(command -v python3.12 2>/dev/null)")
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
elif [ -d "$HOME/.pyenv" ]; then
  root="$HOME/.pyenv"
else
  root=""
fi
if [ -n "$root" ]; then
  for dir in $(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -rV); do
    candidates+=("$dir/bin/python3")
  done
fi
candidates+=(/usr/local/bin/python3.12 /usr/bin/python3.12 "$(command -v python3 2>/dev/null)")
for python in "${candidates[@]}"; do
  [ -n "$python" ] && [ -x "$python" ] || continue
  # A pyenv shim can exist and still fail to run: ask the interpreter itself.
  if "$python" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
    echo "$python"
    exit 0
  fi
done
echo "no working Python 3.12 found: install it or set PYTHON=/path/to/python3.12" >&2
exit 1
