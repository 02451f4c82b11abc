#!/usr/bin/env bash
# Static checks of the files in systemd/, for CI (.ci/run) and by hand:
#
#   1. `systemd-analyze verify` of peerd.service. verify insists that
#      ExecStart's binary exists, so it checks a copy whose
#      /usr/local/bin/peerd is a stub; everything else is the real unit.
#      verify exits 0 on settings it "ignores" (a misspelt key, a value it
#      cannot parse), so any line it prints about peerd fails the check too.
#   2. peerd.sysusers and peerd.tmpfiles applied to a scratch root: they parse,
#      and the user the tmpfiles line names exists.
#   3. peerd.toml parses as TOML; with PEERD=/path/to/peerd set, `peerd config`
#      also loads it (e.g. PEERD=.venv/bin/peerd systemd/verify.sh).
#
# Installs systemd with apt-get where systemd-analyze is missing (Debian, as root).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "systemd/verify.sh: FAIL: $*" >&2; exit 1; }

if ! command -v systemd-analyze >/dev/null; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "systemd/verify.sh: installing systemd for systemd-analyze"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
    else
        fail "systemd-analyze is missing (install the systemd package)"
    fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. the unit
printf '#!/bin/sh\nexit 0\n' >"$work/peerd"
chmod 0755 "$work/peerd"
mkdir "$work/unit"
sed "s#^ExecStart=/usr/local/bin/peerd #ExecStart=$work/peerd #" "$here/peerd.service" >"$work/unit/peerd.service"
grep -q "^ExecStart=$work/peerd serve " "$work/unit/peerd.service" ||
    fail "peerd.service no longer has 'ExecStart=/usr/local/bin/peerd serve ...': update systemd/verify.sh with it"
status=0
output=$(cd "$work/unit" && systemd-analyze verify --man=no --recursive-errors=no "$work/unit/peerd.service" 2>&1) || status=$?
if [ -n "$output" ]; then
    echo "$output"
fi
if [ "$status" -ne 0 ] || grep -q 'peerd' <<<"$output"; then
    fail "systemd-analyze verify peerd.service (exit $status): see above"
fi
echo "systemd/verify.sh: peerd.service: systemd-analyze verify clean ($(systemd-analyze --version | head -n1))"

# 2. sysusers and tmpfiles, into a scratch root
mkdir -p "$work/root/etc"
systemd-sysusers --root="$work/root" "$here/peerd.sysusers" >/dev/null 2>"$work/sysusers.err" ||
    { cat "$work/sysusers.err"; fail "systemd-sysusers peerd.sysusers"; }
grep -q '^peerd:' "$work/root/etc/passwd" || fail "peerd.sysusers creates no user peerd"
for group in video render; do
    grep -Eq "^$group:[^:]*:[^:]*:(.*,)?peerd(,|$)" "$work/root/etc/group" || fail "peerd.sysusers does not put peerd in $group"
done
if [ "$(id -u)" -eq 0 ]; then
    systemd-tmpfiles --root="$work/root" --create "$here/peerd.tmpfiles" 2>"$work/tmpfiles.err" ||
        { cat "$work/tmpfiles.err"; fail "systemd-tmpfiles peerd.tmpfiles"; }
    [ "$(stat -c %a "$work/root/run/peerd")" = 750 ] || fail "peerd.tmpfiles: /run/peerd is not 0750"
    echo "systemd/verify.sh: peerd.sysusers, peerd.tmpfiles: applied to a scratch root"
else
    echo "systemd/verify.sh: peerd.sysusers applied to a scratch root; peerd.tmpfiles skipped (needs root to chown)"
fi

# 3. the example configuration
python3 -c 'import sys, tomllib; tomllib.load(open(sys.argv[1], "rb"))' "$here/peerd.toml" ||
    fail "peerd.toml is not valid TOML"
if [ -n "${PEERD:-}" ]; then
    # the file names the group peerd.sysusers makes; on a machine without it, this user's group stands in
    # (the odd expansions: an empty array is unset to bash before 4.4, under set -u)
    stand_in=()
    getent group peerd >/dev/null || stand_in=(--socket-group "$(id -g)")
    "$PEERD" config --config "$here/peerd.toml" ${stand_in[@]+"${stand_in[@]}"} >/dev/null ||
        fail "$PEERD config --config peerd.toml"
    # every commented-out default, uncommented: each key known, each value the daemon's default
    sed -E 's/^# ([a-z_]+ = )/\1/' "$here/peerd.toml" >"$work/all.toml"
    "$PEERD" config --config "$work/all.toml" ${stand_in[@]+"${stand_in[@]}"} --json >"$work/all.json" ||
        fail "$PEERD config: an example value in peerd.toml"
    python3 - "$work/all.json" <<'PY' || fail "peerd.toml does not show every option of peerd serve"
import json, sys
missing = [k for k, v in json.load(open(sys.argv[1])).items() if v["source"] == "default"]
if missing:
    sys.exit(f"not in peerd.toml: {', '.join(missing)}")
PY
    echo "systemd/verify.sh: peerd.toml: loaded by $PEERD config, every option shown"
else
    echo "systemd/verify.sh: peerd.toml: valid TOML"
fi
