#!/usr/bin/env bash
# deploy/cloudrun/setup.sh: set up sweeper on Cloud Run with Pub/Sub push and Cloud Scheduler.
#
# UNTESTED AGAINST REAL GOOGLE CLOUD: no Google Cloud project is reachable from the machines this
# repository is developed on. It has only been run with DRY_RUN=1, which prints the commands
# instead of running them. Read the commands it prints, and check them against the current gcloud
# reference, before the first real run.
#
# What it does, in order (docs/transports-and-deployment.md, "Deploy on Google Cloud"):
#   1. service accounts sweeper-run (the service), sweeper-scheduler (Scheduler's OIDC tokens),
#      sweeper-push (the push subscription's OIDC tokens);
#   2. optionally (BUILD_IMAGE=1) an Artifact Registry repository, and the image built from
#      deploy/Containerfile and pushed there;
#   3. secrets: the database URL, the HS256 on-call key, and the configuration file
#      (deploy/cloudrun/sweeper.toml), readable by sweeper-run;
#   4. the topic sweeper-commands (sweeper-run may publish) and its dead-letter topic
#      sweeper-commands-dead;
#   5. the Cloud Run service: CPU allocated outside requests (--no-cpu-throttling), one warm
#      instance, a request timeout above consume.command_deadline;
#   6. the push subscription to /consume with an OIDC token of sweeper-push for $AUDIENCE, an ack
#      deadline above consume.command_deadline, a retry policy, and dead-lettering after more
#      delivery attempts than any policy's retry.max_attempts; the Pub/Sub service agent's rights
#      on the dead-letter topic and the subscription;
#   7. one Cloud Scheduler job per policy of CONFIG calling /trigger/<policy> with an OIDC token of
#      sweeper-scheduler for $AUDIENCE, on the policy's cron and time zone: the jobs are the ones
#      `sweeper schedules --format cloud-scheduler` writes from CONFIG, so the schedules are
#      written once, in the configuration.
#
# Running it again is meant to be harmless: existing service accounts, repositories, secrets and
# topics are kept (the configuration secret gets a new version), IAM bindings are added again
# (a no-op), `gcloud run deploy` makes a new revision, and an existing subscription or Scheduler
# job is updated with the same settings.
#
# Usage (from anywhere; paths are relative to the repository):
#   DRY_RUN=1 deploy/cloudrun/setup.sh                  # print every command, touch nothing
#   SWEEPER_DATABASE_URL='postgres://...' deploy/cloudrun/setup.sh
#
# Settings (environment; defaults in brackets):
#   PROJECT [my-project]   REGION [europe-west1]   AUDIENCE [https://sweeper.example.com]
#   IMAGE [$REGION-docker.pkg.dev/$PROJECT/sweeper/sweeper:0.1.0]
#   BUILD_IMAGE [0]        1 = create the Artifact Registry repository, build and push IMAGE
#   CONTAINER_CLI [podman] docker works the same way
#   CONFIG [deploy/cloudrun/sweeper.toml]
#   SWEEPER_BIN [sweeper]  the sweeper binary (e.g. target/debug/sweeper after `cargo build`);
#                          it writes the Scheduler jobs from CONFIG's policies (no database or
#                          secret needed), and refuses a cron Cloud Scheduler cannot express
#   SWEEPER_DATABASE_URL   required when the secret sweeper-database-url does not exist yet;
#                          when set and the secret exists, a new version is added
#   HS256_KID [2026-06]    the on-call key's kid: secret sweeper-hs256-<kid>, variable
#                          HS256_KEY_<kid with - as _>, as in the configuration's secret_env
#   SERVICE_URL            the URL the push subscription and the Scheduler jobs call [the Cloud
#                          Run service's URL, read after the deploy]
#   PROJECT_NUMBER         [read with gcloud projects describe]
#   VPC_NETWORK, VPC_SUBNET  when set, Direct VPC egress to that network and subnet for private
#                          ranges (--vpc-egress=private-ranges-only), to reach a database on a
#                          private IP
#   LEGACY_PUBSUB_AGENT [0] 1 = grant the Pub/Sub service agent roles/iam.serviceAccountTokenCreator
#                          on the project (needed only in projects created before April 2021)
#   DRY_RUN [0]            1 = print the commands (lines starting "+ "; existence checks start
#                          "? " and are assumed to find nothing), run nothing, need no gcloud
#
# Whoever runs it needs rights to create all of the above and iam.serviceAccounts.actAs on the
# three service accounts. The configuration must match these settings: the script refuses to
# deploy a CONFIG that does not list $AUDIENCE, the two service accounts' emails, the project and
# a trigger:<policy> scope for every policy.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

PROJECT="${PROJECT:-my-project}"
REGION="${REGION:-europe-west1}"
AUDIENCE="${AUDIENCE:-https://sweeper.example.com}"
IMAGE="${IMAGE:-${REGION}-docker.pkg.dev/${PROJECT}/sweeper/sweeper:0.1.0}"
BUILD_IMAGE="${BUILD_IMAGE:-0}"
CONTAINER_CLI="${CONTAINER_CLI:-podman}"
CONFIG="${CONFIG:-${REPO_ROOT}/deploy/cloudrun/sweeper.toml}"
SWEEPER_BIN="${SWEEPER_BIN:-sweeper}"
HS256_KID="${HS256_KID:-2026-06}"
LEGACY_PUBSUB_AGENT="${LEGACY_PUBSUB_AGENT:-0}"
DRY_RUN="${DRY_RUN:-0}"

SERVICE="sweeper"
TOPIC="sweeper-commands"
DEAD_TOPIC="sweeper-commands-dead"
SUBSCRIPTION="sweeper-commands-push"
AR_REPOSITORY="sweeper"

# Cloud Run's request timeout (s) and the subscription's ack deadline (s, 10-600): both above
# consume.command_deadline (60s by default; deploy/check.sh compares them with the configuration).
RUN_TIMEOUT="${RUN_TIMEOUT:-300}"
ACK_DEADLINE="${ACK_DEADLINE:-120}"
# Pub/Sub's own redelivery backoff after a nack or an ack-deadline expiry (0-600s each).
MIN_RETRY_DELAY="${MIN_RETRY_DELAY:-10s}"
MAX_RETRY_DELAY="${MAX_RETRY_DELAY:-600s}"
# Delivery attempts before Pub/Sub dead-letters a message (5-100). Above every policy's
# retry.max_attempts (5 by default): sweeper acknowledges every "not now", so Pub/Sub counts only
# nacks, and sweeper's ledger decides when a command is quarantined.
MAX_DELIVERY_ATTEMPTS="${MAX_DELIVERY_ATTEMPTS:-20}"
# Cloud Scheduler: how long one trigger call may take (15s-30min) and its retries (0-5).
SCHEDULER_ATTEMPT_DEADLINE="${SCHEDULER_ATTEMPT_DEADLINE:-60s}"
SCHEDULER_RETRIES="${SCHEDULER_RETRIES:-5}"

RUN_SA="sweeper-run@${PROJECT}.iam.gserviceaccount.com"
SCHED_SA="sweeper-scheduler@${PROJECT}.iam.gserviceaccount.com"
# The name `sweeper schedules --format cloud-scheduler` gives the scheduler's service account
# (read by the generated lines, through job_words).
export SCHEDULER_SA="$SCHED_SA"
PUSH_SA="sweeper-push@${PROJECT}.iam.gserviceaccount.com"

HS256_SECRET="sweeper-hs256-${HS256_KID}"
HS256_ENV="HS256_KEY_${HS256_KID//-/_}"
DB_SECRET="sweeper-database-url"
CONFIG_SECRET="sweeper-config"
CONFIG_MOUNT="/etc/sweeper-config/sweeper.toml"

die() { echo "setup.sh: $*" >&2; exit 1; }
step() { printf '\n# == %s\n' "$*"; }

# Prints one argument so that a shell (and python's shlex) reads it back unchanged.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

print_cmd() {
  local prefix="$1" arg sep=""
  shift
  printf '%s' "$prefix"
  for arg in "$@"; do
    printf '%s' "$sep"
    quote "$arg"
    sep=" "
  done
  printf '\n'
}

# run CMD...: runs it, or prints it under DRY_RUN=1.
run() {
  print_cmd "+ " "$@"
  if [[ "$DRY_RUN" != 1 ]]; then
    "$@"
  fi
}

# run_stdin DESCRIPTION PRODUCER CMD...: runs CMD with the output of the shell function PRODUCER
# on its stdin. Under DRY_RUN=1 it prints CMD and the description, never the data (secrets).
run_stdin() {
  local what="$1" producer="$2"
  shift 2
  print_cmd "+ " "$@"
  echo "#   stdin: ${what}"
  if [[ "$DRY_RUN" != 1 ]]; then
    "$producer" | "$@"
  fi
}

# absent CMD...: true when the describe command CMD fails (the resource does not exist). Under
# DRY_RUN=1 it prints CMD and assumes absence, so the create command is printed.
absent() {
  print_cmd "? " "$@"
  if [[ "$DRY_RUN" == 1 ]]; then
    return 0
  fi
  ! "$@" >/dev/null 2>&1
}

# scheduler_jobs URL: the `gcloud scheduler jobs create http` lines sweeper writes from CONFIG's
# policies for the base URL URL, one per policy; fails (with sweeper's reasons on stderr) when a
# policy's cron cannot be expressed for Cloud Scheduler.
scheduler_jobs() {
  "$SWEEPER_BIN" schedules --config "$CONFIG" --format cloud-scheduler --url "$1" |
    grep '^gcloud scheduler jobs create http '
}

# job_words LINE: sets the array `job` to LINE's words, as bash reads them. LINE is one of
# sweeper's generated command lines: every value is quoted, and the only expansions are
# "$REGION", "$SCHEDULER_SA" and "$AUDIENCE".
job=()
job_words() {
  eval "job=($1)"
}

database_url() { printf '%s' "$SWEEPER_DATABASE_URL"; }
new_hs256_key() { openssl rand -hex 32 | tr -d '\n'; }

# --- checks before anything is changed ---------------------------------------------------------

[[ -f "$CONFIG" ]] || die "configuration $CONFIG not found"
command -v "$SWEEPER_BIN" >/dev/null 2>&1 ||
  die "the sweeper binary ${SWEEPER_BIN} not found: set SWEEPER_BIN (e.g. target/debug/sweeper after cargo build)"
if [[ "$DRY_RUN" != 1 ]]; then
  command -v gcloud >/dev/null 2>&1 || die "gcloud not found (DRY_RUN=1 prints the commands without it)"
  command -v openssl >/dev/null 2>&1 || die "openssl not found"
fi
(( MAX_DELIVERY_ATTEMPTS >= 5 && MAX_DELIVERY_ATTEMPTS <= 100 )) || die "MAX_DELIVERY_ATTEMPTS must be 5-100"
(( ACK_DEADLINE >= 10 && ACK_DEADLINE <= 600 )) || die "ACK_DEADLINE must be 10-600"

# The configuration is the other half of the trust relation: a token is accepted only for an
# audience it lists, and a service account gets only the scopes it maps.
must_mention() {
  grep -qF -- "$1" "$CONFIG" || die "$CONFIG does not mention $1 ($2)"
}
must_mention "\"${AUDIENCE}\"" "AUDIENCE must be in the jwks issuer's audiences"
must_mention "\"${SCHED_SA}\"" "the scheduler service account must be a principal"
must_mention "\"${PUSH_SA}\"" "the push service account must be a principal with [\"consume\"]"
must_mention "project = \"${PROJECT}\"" "[pubsub] project must be PROJECT"
must_mention "topic = \"${TOPIC}\"" "[pubsub] topic must be ${TOPIC}"
must_mention "secret_env = \"${HS256_ENV}\"" "the on-call issuer's key variable"
# The policies, and whether Cloud Scheduler can express their schedules, before anything changes
# (the URL here only fills the lines; step 7 writes them again with the service's URL).
jobs_checked="$(scheduler_jobs "${SERVICE_URL:-https://SERVICE-URL.invalid}")" ||
  die "sweeper schedules refused CONFIG's schedules for Cloud Scheduler (reasons above)"
[[ -n "$jobs_checked" ]] || die "sweeper schedules wrote no Cloud Scheduler job for $CONFIG"
while IFS= read -r line; do
  job_words "$line"
  policy="${job[5]#sweeper-}"
  must_mention "\"trigger:${policy}\"" "the scheduler service account's scope for the policy"
done <<<"$jobs_checked"

echo "# project ${PROJECT}, region ${REGION}, audience ${AUDIENCE}, image ${IMAGE}"
if [[ "$DRY_RUN" == 1 ]]; then
  echo "# DRY_RUN=1: printing commands, running none"
fi

# --- 1. service accounts -----------------------------------------------------------------------

step "APIs"
run gcloud services enable run.googleapis.com pubsub.googleapis.com cloudscheduler.googleapis.com \
  secretmanager.googleapis.com artifactregistry.googleapis.com iam.googleapis.com \
  --project="$PROJECT"

step "service accounts"
for sa in sweeper-run sweeper-scheduler sweeper-push; do
  if absent gcloud iam service-accounts describe "${sa}@${PROJECT}.iam.gserviceaccount.com" --project="$PROJECT"; then
    run gcloud iam service-accounts create "$sa" --project="$PROJECT" --display-name="$sa"
  fi
done

# --- 2. the image (optional) -------------------------------------------------------------------

if [[ "$BUILD_IMAGE" == 1 ]]; then
  step "Artifact Registry and the image"
  if absent gcloud artifacts repositories describe "$AR_REPOSITORY" --project="$PROJECT" --location="$REGION"; then
    run gcloud artifacts repositories create "$AR_REPOSITORY" --project="$PROJECT" --location="$REGION" \
      --repository-format=docker
  fi
  access_token() { gcloud auth print-access-token; }
  run_stdin "an access token from gcloud auth print-access-token" access_token \
    "$CONTAINER_CLI" login -u oauth2accesstoken --password-stdin "${REGION}-docker.pkg.dev"
  run "$CONTAINER_CLI" build -f "${REPO_ROOT}/deploy/Containerfile" -t "$IMAGE" "$REPO_ROOT"
  run "$CONTAINER_CLI" push "$IMAGE"
else
  step "image: using ${IMAGE} as it is (BUILD_IMAGE=1 builds and pushes it)"
fi

# --- 3. secrets --------------------------------------------------------------------------------

step "secrets"
if absent gcloud secrets describe "$DB_SECRET" --project="$PROJECT"; then
  if [[ "$DRY_RUN" != 1 && -z "${SWEEPER_DATABASE_URL:-}" ]]; then
    die "set SWEEPER_DATABASE_URL: the secret ${DB_SECRET} does not exist yet"
  fi
  run_stdin "the database URL from SWEEPER_DATABASE_URL" database_url \
    gcloud secrets create "$DB_SECRET" --project="$PROJECT" --data-file=-
elif [[ -n "${SWEEPER_DATABASE_URL:-}" ]]; then
  run_stdin "the database URL from SWEEPER_DATABASE_URL" database_url \
    gcloud secrets versions add "$DB_SECRET" --project="$PROJECT" --data-file=-
fi
# A new key only when the secret is missing: rotating it is a deliberate step (deploy/README.md,
# "Key rotation").
if absent gcloud secrets describe "$HS256_SECRET" --project="$PROJECT"; then
  run_stdin "a new key from openssl rand -hex 32" new_hs256_key \
    gcloud secrets create "$HS256_SECRET" --project="$PROJECT" --data-file=-
fi
# The configuration: a new version on every run, so a redeploy picks up the edited file.
if absent gcloud secrets describe "$CONFIG_SECRET" --project="$PROJECT"; then
  run gcloud secrets create "$CONFIG_SECRET" --project="$PROJECT" --data-file="$CONFIG"
else
  run gcloud secrets versions add "$CONFIG_SECRET" --project="$PROJECT" --data-file="$CONFIG"
fi
for secret in "$DB_SECRET" "$HS256_SECRET" "$CONFIG_SECRET"; do
  run gcloud secrets add-iam-policy-binding "$secret" --project="$PROJECT" \
    --member="serviceAccount:${RUN_SA}" --role=roles/secretmanager.secretAccessor
done

# --- 4. topics ---------------------------------------------------------------------------------

step "topics"
for topic in "$TOPIC" "$DEAD_TOPIC"; do
  if absent gcloud pubsub topics describe "$topic" --project="$PROJECT"; then
    run gcloud pubsub topics create "$topic" --project="$PROJECT"
  fi
done
run gcloud pubsub topics add-iam-policy-binding "$TOPIC" --project="$PROJECT" \
  --member="serviceAccount:${RUN_SA}" --role=roles/pubsub.publisher

# --- 5. Cloud Run ------------------------------------------------------------------------------

# CPU outside requests and one warm instance: the relay, the planner, housekeeping and the
# built-in workers run in the background. sweeper checks every token itself, so Cloud Run's own
# IAM check is off (--allow-unauthenticated); /healthz, /readyz and /metrics are then public (the
# metrics name your policies).
step "Cloud Run service"
egress_flags=()
if [[ -n "${VPC_NETWORK:-}" ]]; then
  egress_flags=(--network="$VPC_NETWORK" --subnet="${VPC_SUBNET:-$VPC_NETWORK}"
    --vpc-egress=private-ranges-only)
fi
run gcloud run deploy "$SERVICE" --project="$PROJECT" --region="$REGION" --image="$IMAGE" \
  --service-account="$RUN_SA" --port=8080 ${egress_flags[@]+"${egress_flags[@]}"} \
  --no-cpu-throttling --min-instances=1 --timeout="$RUN_TIMEOUT" \
  --allow-unauthenticated \
  --set-env-vars="SWEEPER_CONFIG=${CONFIG_MOUNT}" \
  --set-secrets="SWEEPER_DATABASE_URL=${DB_SECRET}:latest,${HS256_ENV}=${HS256_SECRET}:latest,${CONFIG_MOUNT}=${CONFIG_SECRET}:latest"

if [[ -n "${SERVICE_URL:-}" ]]; then
  URL="$SERVICE_URL"
elif [[ "$DRY_RUN" == 1 ]]; then
  print_cmd "? " gcloud run services describe "$SERVICE" --project="$PROJECT" --region="$REGION" \
    --format='value(status.url)'
  URL="https://SERVICE-URL.invalid"
  echo "#   dry run: the service URL is read from the command above; ${URL} stands for it"
else
  URL="$(gcloud run services describe "$SERVICE" --project="$PROJECT" --region="$REGION" \
    --format='value(status.url)')"
  [[ -n "$URL" ]] || die "could not read the Cloud Run service's URL"
fi
URL="${URL%/}"

# --- 6. push subscription ----------------------------------------------------------------------

step "push subscription"
sub_flags=(
  --push-endpoint="${URL}/consume"
  --push-auth-service-account="$PUSH_SA"
  --push-auth-token-audience="$AUDIENCE"
  --ack-deadline="$ACK_DEADLINE"
  --min-retry-delay="$MIN_RETRY_DELAY"
  --max-retry-delay="$MAX_RETRY_DELAY"
  --dead-letter-topic="$DEAD_TOPIC"
  --max-delivery-attempts="$MAX_DELIVERY_ATTEMPTS"
)
if absent gcloud pubsub subscriptions describe "$SUBSCRIPTION" --project="$PROJECT"; then
  run gcloud pubsub subscriptions create "$SUBSCRIPTION" --project="$PROJECT" --topic="$TOPIC" \
    "${sub_flags[@]}"
else
  run gcloud pubsub subscriptions update "$SUBSCRIPTION" --project="$PROJECT" "${sub_flags[@]}"
fi

# Dead-lettering needs the Pub/Sub service agent's rights on both ends.
if [[ -n "${PROJECT_NUMBER:-}" ]]; then
  :
elif [[ "$DRY_RUN" == 1 ]]; then
  print_cmd "? " gcloud projects describe "$PROJECT" --format='value(projectNumber)'
  PROJECT_NUMBER="PROJECT_NUMBER"
  echo "#   dry run: the project number is read from the command above"
else
  PROJECT_NUMBER="$(gcloud projects describe "$PROJECT" --format='value(projectNumber)')"
  [[ -n "$PROJECT_NUMBER" ]] || die "could not read the project number of ${PROJECT}"
fi
PUBSUB_AGENT="service-${PROJECT_NUMBER}@gcp-sa-pubsub.iam.gserviceaccount.com"
run gcloud pubsub topics add-iam-policy-binding "$DEAD_TOPIC" --project="$PROJECT" \
  --member="serviceAccount:${PUBSUB_AGENT}" --role=roles/pubsub.publisher
run gcloud pubsub subscriptions add-iam-policy-binding "$SUBSCRIPTION" --project="$PROJECT" \
  --member="serviceAccount:${PUBSUB_AGENT}" --role=roles/pubsub.subscriber
if [[ "$LEGACY_PUBSUB_AGENT" == 1 ]]; then
  run gcloud projects add-iam-policy-binding "$PROJECT" \
    --member="serviceAccount:${PUBSUB_AGENT}" --role=roles/iam.serviceAccountTokenCreator
fi

# --- 7. Cloud Scheduler ------------------------------------------------------------------------

# The jobs as `sweeper schedules --format cloud-scheduler` writes them from CONFIG's policies
# (schedule, time zone, URI, POST, an OIDC token of $SCHEDULER_SA for $AUDIENCE: without
# --oidc-token-audience the token's audience would be the full URI, which sweeper does not list),
# with this script's project, attempt deadline and retries. Cloud Scheduler sends
# X-CloudScheduler-ScheduleTime, which names the tick.
step "Cloud Scheduler jobs, one per policy (from sweeper schedules --format cloud-scheduler)"
jobs_text="$(scheduler_jobs "$URL")" ||
  die "sweeper schedules refused CONFIG's schedules for Cloud Scheduler (reasons above)"
while IFS= read -r line; do
  job_words "$line"
  name="${job[5]}"
  extra_flags=(
    --project="$PROJECT"
    --attempt-deadline="$SCHEDULER_ATTEMPT_DEADLINE"
    --max-retry-attempts="$SCHEDULER_RETRIES"
  )
  if absent gcloud scheduler jobs describe "$name" --project="$PROJECT" --location="$REGION"; then
    run "${job[@]}" "${extra_flags[@]}"
  else
    run gcloud scheduler jobs update http "${job[@]:5}" "${extra_flags[@]}"
  fi
done <<<"$jobs_text"

step "done"
echo "# Next: the first Scheduler run should answer 202 (200 for an existing run); follow it with"
echo "# GET ${URL}/runs/{run_id} and an on-call token, minted where the configuration is:"
echo "#   ${HS256_ENV}=\$(gcloud secrets versions access latest --secret=${HS256_SECRET} --project=${PROJECT}) \\"
echo "#   SWEEPER_DATABASE_URL=postgres://unused sweeper token --config ${CONFIG} --scope ops:read --sub you@example.com"
