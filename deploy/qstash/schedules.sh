#!/usr/bin/env bash
# deploy/qstash/schedules.sh: one QStash schedule per policy, calling POST /trigger/<policy>.
#
# UNTESTED AGAINST REAL QSTASH: no Upstash account is reachable from the machines this repository
# is developed on. It has only been run with DRY_RUN=1, which prints the requests instead of
# sending them.
#
# For each policy of CONFIG it sends, with the values `sweeper schedules --format qstash` writes
# from the policy's own schedule (so the schedule is written once, in the configuration):
#   POST $QSTASH_API_URL/v2/schedules/<public_url>/trigger/<policy>
#   Authorization: Bearer $QSTASH_TOKEN
#   Upstash-Cron: CRON_TZ=<the policy's zone> <the policy's 5-field cron>
#   Upstash-Method: POST
#   Upstash-Schedule-Id: sweeper-<policy>     (a second run overwrites the schedule of that id)
#   Upstash-Retries: $RETRIES
# Each fire is a signed QStash message; sweeper accepts it when [qstash] scopes include
# trigger:<policy> and the signature's `sub` is public_url + /trigger/<policy>. A new schedule may
# take up to a minute to start firing. A policy removed from CONFIG keeps its schedule until you
# delete it: curl -X DELETE -H "Authorization: Bearer $QSTASH_TOKEN" \
#   "$QSTASH_API_URL/v2/schedules/sweeper-<policy>"
#
# Time zones: QStash evaluates Upstash-Cron in UTC unless it starts with `CRON_TZ=<zone> ` (its
# create-schedule reference gives "CRON_TZ=America/New_York 0 4 * * *"); sweeper always sends the
# prefix, UTC included. sweeper refuses a cron QStash cannot express (L, W, #, croner's `+`) and
# notes a schedule with ticks in a daylight-saving gap or fold (printed as `# note:` lines).
#
# Settings (environment; defaults in brackets):
#   CONFIG [deploy/qstash/sweeper.toml]       the configuration whose policies are scheduled
#   SWEEPER_BIN [sweeper]                      the sweeper binary (e.g. target/debug/sweeper)
#   PUBLIC_URL [the configuration's [qstash] public_url]   the base URL QStash calls
#   QSTASH_API_URL [https://qstash.upstash.io]
#   QSTASH_TOKEN                               required (not printed, not passed in argv)
#   RETRIES [3]                                Upstash-Retries of each fire
#   DRY_RUN [0]                                1 = print the requests, send none, need no token
# Needs jq to read sweeper's JSON.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CONFIG="${CONFIG:-${REPO_ROOT}/deploy/qstash/sweeper.toml}"
SWEEPER_BIN="${SWEEPER_BIN:-sweeper}"
PUBLIC_URL="${PUBLIC_URL:-}"
QSTASH_API_URL="${QSTASH_API_URL:-https://qstash.upstash.io}"
RETRIES="${RETRIES:-3}"
DRY_RUN="${DRY_RUN:-0}"

die() { echo "schedules.sh: $*" >&2; exit 1; }

quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

print_cmd() {
  local arg sep=""
  printf '+ '
  for arg in "$@"; do
    printf '%s' "$sep"
    quote "$arg"
    sep=" "
  done
  printf '\n'
}

auth_header() { printf 'Authorization: Bearer %s\n' "$QSTASH_TOKEN"; }

if [[ "$DRY_RUN" != 1 ]]; then
  [[ -n "${QSTASH_TOKEN:-}" ]] || die "set QSTASH_TOKEN (DRY_RUN=1 prints the requests without it)"
  command -v curl >/dev/null 2>&1 || die "curl not found"
fi
[[ -f "$CONFIG" ]] || die "configuration $CONFIG not found"
command -v "$SWEEPER_BIN" >/dev/null 2>&1 ||
  die "the sweeper binary ${SWEEPER_BIN} not found: set SWEEPER_BIN (e.g. target/debug/sweeper after cargo build)"
command -v jq >/dev/null 2>&1 || die "jq not found (it reads sweeper's JSON)"
QSTASH_API_URL="${QSTASH_API_URL%/}"

url_flags=()
if [[ -n "$PUBLIC_URL" ]]; then
  url_flags=(--url "$PUBLIC_URL")
fi
# The schedules, from the policies' own `schedule` (sweeper refuses what QStash cannot express).
schedules_json="$("$SWEEPER_BIN" schedules --config "$CONFIG" --format qstash ${url_flags[@]+"${url_flags[@]}"})" ||
  die "sweeper schedules refused the schedules of $CONFIG (reasons above)"

echo "# QStash ${QSTASH_API_URL}, schedules of ${CONFIG}"
if [[ "$DRY_RUN" == 1 ]]; then
  echo "# DRY_RUN=1: printing requests, sending none"
fi

while IFS=$'\t' read -r policy schedule_id destination cron method; do
  [[ "$destination" == https://* ]] || die "policy ${policy}: QStash must call an https URL, not ${destination}"
  jq -r --arg p "$policy" '.[] | select(.policy == $p) | .notes[] | "# note: " + .' <<<"$schedules_json"
  cmd=(curl --fail-with-body --silent --show-error --max-time 30 --request POST
    --header @-
    --header "Upstash-Cron: ${cron}"
    --header "Upstash-Method: ${method}"
    --header "Upstash-Schedule-Id: ${schedule_id}"
    --header "Upstash-Retries: ${RETRIES}"
    "${QSTASH_API_URL}/v2/schedules/${destination}")
  print_cmd "${cmd[@]}"
  echo "#   stdin: Authorization: Bearer \$QSTASH_TOKEN"
  if [[ "$DRY_RUN" != 1 ]]; then
    # The answer is {"scheduleId": "sweeper-<policy>"}.
    auth_header | "${cmd[@]}"
    echo
  fi
done < <(jq -r '.[] | [.policy, .scheduleId, .destination, .cron, .method] | @tsv' <<<"$schedules_json")
