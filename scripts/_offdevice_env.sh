# Shared by the off-device suites (sourced, not run): the required source variables and the suite's own venv.
#   need_sources SCRIPT HINT VAR...       exit 2 naming the first unset VAR and the HINT
#   offdevice_venv DIR CONSTRAINTS PKG... create DIR (once), install PKGs under CONSTRAINTS, then this package
need_sources() {
  local who=$1 hint=$2 var
  shift 2
  for var in "$@"; do
    if [ -z "${!var:-}" ]; then
      echo "$who: set $var $hint" >&2
      exit 2
    fi
  done
}

offdevice_venv() {
  local dir=$1 constraints=$2
  shift 2
  if [ ! -x "$dir/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$dir"
  fi
  "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$dir/bin/python" -m pip install -q -c "$constraints" "$@"
}
