#!/usr/bin/env bash
# deploy/qstash/schedules.sh: one QStash schedule per policy, calling POST /trigger/<policy>.
#
# UNTESTED AGAINST REAL QSTASH: no Upstash account is reachable from the machines this repository
# is developed on. It has only been run with DRY_RUN=1, which prints the requests instead of
# sending them.
#
# For each policy below it sends
#   POST $QSTASH_API_URL/v2/schedules/$PUBLIC_URL/trigger/<policy>
#   Authorization: Bearer $QSTASH_TOKEN
#   Upstash-Cron: <the policy's 5-field cron>
#   Upstash-Method: POST
#   Upstash-Schedule-Id: sweeper-<policy>     (a second run overwrites the schedule of that id)
#   Upstash-Retries: $RETRIES
# Each fire is a signed QStash message; sweeper accepts it when [qstash] scopes include
# trigger:<policy> and the signature's `sub` is public_url + /trigger/<policy>. A new schedule may
# take up to a minute to start firing. A policy removed from the list keeps its schedule until
# you delete it: curl -X DELETE -H "Authorization: Bearer $QSTASH_TOKEN" \
#   "$QSTASH_API_URL/v2/schedules/sweeper-<policy>"
#
# Time zones: QStash evaluates Upstash-Cron in UTC. A policy's schedule must therefore be in UTC
# (as in deploy/qstash/sweeper.toml), or its cron must be translated to UTC by hand, which only
# works for zones without daylight-saving time. Newer material reports a `CRON_TZ=<zone> ` prefix
# on the cron; that is UNCONFIRMED here, so this script refuses a non-UTC policy unless
# ALLOW_CRON_TZ=1, which sends "CRON_TZ=<zone> <cron>". Check the schedule's next fire time in the
# Upstash console if you use it.
#
# Settings (environment; defaults in brackets):
#   PUBLIC_URL [https://sweeper.example.com]   must equal [qstash] public_url in the configuration
#   QSTASH_API_URL [https://qstash.upstash.io]
#   QSTASH_TOKEN                               required (not printed, not passed in argv)
#   RETRIES [3]                                Upstash-Retries of each fire
#   ALLOW_CRON_TZ [0]                          see "Time zones" above
#   DRY_RUN [0]                                1 = print the requests, send none, need no token
set -euo pipefail

PUBLIC_URL="${PUBLIC_URL:-https://sweeper.example.com}"
QSTASH_API_URL="${QSTASH_API_URL:-https://qstash.upstash.io}"
RETRIES="${RETRIES:-3}"
ALLOW_CRON_TZ="${ALLOW_CRON_TZ:-0}"
DRY_RUN="${DRY_RUN:-0}"

# One line per policy: name|cron|time zone. They must mirror the [[policy]] schedules of the
# configuration (deploy/check.sh compares them with deploy/qstash/sweeper.toml).
POLICIES=(
  "ticket-retention|0 2 * * *|UTC"
)

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
[[ "$PUBLIC_URL" == https://* ]] || die "PUBLIC_URL must be an https URL"
PUBLIC_URL="${PUBLIC_URL%/}"
QSTASH_API_URL="${QSTASH_API_URL%/}"

echo "# QStash ${QSTASH_API_URL}, sweeper at ${PUBLIC_URL}"
if [[ "$DRY_RUN" == 1 ]]; then
  echo "# DRY_RUN=1: printing requests, sending none"
fi

for entry in "${POLICIES[@]}"; do
  IFS='|' read -r policy cron tz <<<"$entry"
  case "$tz" in
    UTC | Etc/UTC) qstash_cron="$cron" ;;
    *)
      [[ "$ALLOW_CRON_TZ" == 1 ]] ||
        die "policy ${policy} is scheduled in ${tz}, QStash evaluates cron in UTC: put the policy in UTC, or set ALLOW_CRON_TZ=1 to send the unconfirmed CRON_TZ prefix"
      qstash_cron="CRON_TZ=${tz} ${cron}"
      ;;
  esac
  cmd=(curl --fail-with-body --silent --show-error --max-time 30 --request POST
    --header @-
    --header "Upstash-Cron: ${qstash_cron}"
    --header "Upstash-Method: POST"
    --header "Upstash-Schedule-Id: sweeper-${policy}"
    --header "Upstash-Retries: ${RETRIES}"
    "${QSTASH_API_URL}/v2/schedules/${PUBLIC_URL}/trigger/${policy}")
  print_cmd "${cmd[@]}"
  echo "#   stdin: Authorization: Bearer \$QSTASH_TOKEN"
  if [[ "$DRY_RUN" != 1 ]]; then
    # The answer is {"scheduleId": "sweeper-<policy>"}.
    auth_header | "${cmd[@]}"
    echo
  fi
done
