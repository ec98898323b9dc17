# The project's virtual environments, built once per machine and reused (sourced, not run).
#
#   cached_venv LINK CONSTRAINTS PKG...
#
# builds a venv with PKGs installed under CONSTRAINTS in a cache folder outside the clone, named by a hash of
# everything that decides its contents (the Python, the constraints file, the PKG arguments and pyproject.toml's
# dependency lists), and points LINK (.venv, .venv-nxdi, .venv-vllm) at it. A second clone, or a second CI run on
# the same machine, finds it ready; a changed constraints file or dependency list gets a new one. A build that
# stops half way is never reused (the venv counts as built only once `.built` is written last), and two runs at
# once wait for each other (flock). The package itself is installed editable from this clone at every call
# (--no-deps, seconds), so the venv runs the code of the clone that called it.
#
# The cache folder: $MINIMAX_M3_VENV_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/minimax-m3/venvs. Remove it to
# rebuild everything; older venvs of changed constraints are left there until then.

venv_cache_root() {
  echo "${MINIMAX_M3_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/minimax-m3/venvs}"
}

cached_venv() {
  local link=$1 constraints=$2
  shift 2
  local py=${PYTHON:-python3} root key dir
  root=$(venv_cache_root)
  key=$({ "$py" -c 'import sys; print(sys.version)'; cat "$constraints"; printf '%s\n' "$@"
          sed -n '/^dependencies = \[/,/^\[project.scripts\]/p' pyproject.toml; } | sha256sum | cut -c1-16)
  dir="$root/${link#.}-$key"
  mkdir -p "$root"
  (
    flock 9
    if [ ! -f "$dir/.built" ]; then
      echo "venv: building $dir ($link, $constraints): first run on this machine or constraints changed"
      rm -rf "$dir"
      "$py" -m venv "$dir"
      "$dir/bin/python" -m pip install -q --upgrade pip setuptools wheel >/dev/null
      "$dir/bin/python" -m pip install -q -c "$constraints" "$@"
      date -u +%FT%TZ > "$dir/.built"
    fi
  ) 9>"$dir.lock"
  if [ -d "$link" ] && [ ! -L "$link" ]; then
    echo "venv: replacing the folder $link with a link to the cached venv"
    rm -rf "$link"
  fi
  ln -sfn "$dir" "$link"
}

# The package (and any further local folders) editable from this clone into LINK's venv, without dependencies.
# Skipped when the venv's own records say these folders are installed editable (pip's direct_url.json) with the
# pyproject.toml files of the last install here (the .local stamp): an editable install reads the code from the
# folder, so only another folder or changed metadata needs pip.
install_local() {
  local link=$1
  shift
  local args=() p stamp
  for p in "$@"; do args+=(-e "$p"); done
  stamp=$(for p in "$@"; do (cd "$p" && pwd && cat pyproject.toml); done | sha256sum | cut -c1-16)
  if [ "$(cat "$link/.local" 2>/dev/null)" = "$stamp" ] && "$link/bin/python" - "$@" <<'PY'
import json, sys
from importlib.metadata import distributions
from pathlib import Path

want = {Path(p).resolve().as_uri() for p in sys.argv[1:]}
have = set()
for dist in distributions():
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if url.get("dir_info", {}).get("editable"):
        have.add(url["url"])
sys.exit(0 if want <= have else 1)
PY
  then
    return 0
  fi
  rm -f "$link/.local"
  "$link/bin/python" -m pip install -q --no-deps --no-build-isolation "${args[@]}"
  echo "$stamp" > "$link/.local"
}
