# Shared by the off-device suites (sourced, not run): the required source variables and the suite's own venv.
#   need_sources SCRIPT HINT VAR...                 exit 2 naming the first unset VAR and the HINT
#   offdevice_venv LINK CONSTRAINTS PKG... -- DIR... the cached venv LINK (scripts/_venv.sh) with PKGs under
#                                                   CONSTRAINTS, then DIRs (this package first) editable, no deps
source scripts/_venv.sh

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
  local link=$1 constraints=$2 pkgs=()
  shift 2
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do pkgs+=("$1"); shift; done
  [ "$#" -gt 0 ] && shift
  cached_venv "$link" "$constraints" "${pkgs[@]}"
  install_local "$link" "$@"
}
