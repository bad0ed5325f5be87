# Sourced by scripts/test.sh: installs the Debian packages in scripts/system-packages.txt that are
# missing, only when running as root where apt-get exists (CI runs as root). Elsewhere nothing is
# installed and the tests that need a package skip with the reason.
_sysdeps_install() {
  local root="$1" want=() pkg
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && command -v dpkg-query >/dev/null || return 0
  [ "${SWARM_NO_SYSDEPS:-}" = 1 ] && return 0
  while read -r pkg; do
    pkg="${pkg%%#*}"; pkg="${pkg//[[:space:]]/}"
    [ -n "$pkg" ] || continue
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || want+=("$pkg")
  done < "$root/scripts/system-packages.txt"
  [ "${#want[@]}" -gt 0 ] || return 0
  echo "swarm: installing system packages for the system tests: ${want[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${want[@]}"; } >/dev/null 2>&1 \
    || echo "swarm: could not install ${want[*]}; the tests that need them will skip" >&2
}
_sysdeps_install "$ROOT"
