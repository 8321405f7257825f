#!/usr/bin/env bash
# deploy/check.sh: static checks of the deployment files, for .ci/run. Exits non-zero on any
# failure and prints what it checked. Needs bash, python3 (3.11+, for tomllib) with PyYAML, jq,
# the shellcheck binary (installed with apt-get when missing and running as root), and a built
# sweeper binary: SWEEPER_BIN, default ${CARGO_TARGET_DIR:-target}/debug/sweeper (`cargo build`).
#
#   * shellcheck on every deploy/**/*.sh;
#   * DRY_RUN=1 runs of deploy/cloudrun/setup.sh and deploy/qstash/schedules.sh, with stubs in
#     front of gcloud, curl, openssl, podman and docker that fail the check if either script calls
#     them (both take their schedules from `sweeper schedules`, run from SWEEPER_BIN);
#   * deploy/kubernetes/cronjob.yaml is exactly what `sweeper schedules --format kubernetes` writes
#     for deploy/sweeper.example.toml, and every deploy configuration's schedules can be written
#     in every format (systemd's calendar events checked with systemd-analyze when installed);
#   * every deploy/kubernetes/*.yaml and deploy/monitoring/*.yaml parses, and each document has
#     apiVersion, kind, metadata.name;
#   * every deploy/**/*.toml parses;
#   * the scripts agree with the configurations they go with (policies, schedules, audiences,
#     service accounts, deadlines, attempts, scopes), and the Kubernetes CronJob with the
#     configuration its ConfigMap ships (deploy/sweeper.example.toml).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== shellcheck"
if ! command -v shellcheck >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing shellcheck (Debian package)"
    (apt-get install -y -qq shellcheck || { apt-get update -qq && apt-get install -y -qq shellcheck; }) >/dev/null 2>&1 || true
  fi
  command -v shellcheck >/dev/null 2>&1 ||
    { echo "FAIL: shellcheck is not installed (apt-get install shellcheck, as root)" >&2; exit 1; }
fi
mapfile -t scripts < <(find deploy -type f -name '*.sh' | sort)
[[ ${#scripts[@]} -gt 0 ]] || { echo "FAIL: no deploy/**/*.sh found" >&2; exit 1; }
shellcheck "${scripts[@]}" || { echo "FAIL: shellcheck found problems (above)" >&2; exit 1; }
printf 'ok: shellcheck %s\n' "${scripts[@]}"

echo "== sweeper schedules"
SWEEPER_BIN="${SWEEPER_BIN:-${CARGO_TARGET_DIR:-target}/debug/sweeper}"
[[ "$SWEEPER_BIN" == /* ]] || SWEEPER_BIN="$PWD/$SWEEPER_BIN"
[[ -x "$SWEEPER_BIN" ]] ||
  { echo "FAIL: no sweeper binary at $SWEEPER_BIN: run cargo build --locked, or set SWEEPER_BIN" >&2; exit 1; }
command -v jq >/dev/null 2>&1 || { echo "FAIL: jq is not installed (apt-get install jq)" >&2; exit 1; }
CRONJOB_URL="http://sweeper:8080"
if ! diff -u deploy/kubernetes/cronjob.yaml <("$SWEEPER_BIN" schedules --config deploy/sweeper.example.toml \
  --format kubernetes --url "$CRONJOB_URL"); then
  echo "FAIL: deploy/kubernetes/cronjob.yaml differs from sweeper's output (above); regenerate it:" >&2
  echo "  sweeper schedules --config deploy/sweeper.example.toml --format kubernetes --url $CRONJOB_URL > deploy/kubernetes/cronjob.yaml" >&2
  exit 1
fi
echo "ok: deploy/kubernetes/cronjob.yaml = sweeper schedules --format kubernetes for deploy/sweeper.example.toml"
for config in deploy/sweeper.example.toml deploy/cloudrun/sweeper.toml deploy/qstash/sweeper.toml; do
  for format in cloud-scheduler kubernetes qstash crontab systemd; do
    if ! out="$("$SWEEPER_BIN" schedules --config "$config" --format "$format" --url https://sweeper.example.com)"; then
      echo "FAIL: sweeper schedules --format $format refused $config (above)" >&2
      exit 1
    fi
    if [[ "$format" == systemd ]] && command -v systemd-analyze >/dev/null 2>&1; then
      while IFS= read -r calendar; do
        systemd-analyze calendar "$calendar" >/dev/null ||
          { echo "FAIL: systemd-analyze refuses OnCalendar=$calendar ($config)" >&2; exit 1; }
      done < <(sed -n 's/^OnCalendar=//p' <<<"$out")
    fi
  done
  echo "ok: sweeper schedules writes every format for $config"
done

echo "== dry runs"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
for tool in gcloud curl openssl podman docker; do
  printf '#!/bin/sh\necho "%s $*" >>"%s/called"\nexit 97\n' "$tool" "$tmp" >"$tmp/bin/$tool"
  chmod +x "$tmp/bin/$tool"
done
dry_run() { # dry_run OUTPUT SCRIPT [VAR=value...]: the script with default settings and DRY_RUN=1
  local out="$1" script="$2"
  shift 2
  if ! env -i PATH="$tmp/bin:$PATH" HOME="$tmp" DRY_RUN=1 SWEEPER_BIN="$SWEEPER_BIN" "$@" bash "$script" >"$out" 2>&1; then
    cat "$out" >&2
    echo "FAIL: DRY_RUN=1 ${*:+$* }$script failed" >&2
    exit 1
  fi
  echo "ok: DRY_RUN=1 ${*:+$* }$script ($(grep -c '^+ ' "$out") commands printed)"
}
dry_run "$tmp/setup.out" deploy/cloudrun/setup.sh
dry_run "$tmp/setup-build.out" deploy/cloudrun/setup.sh BUILD_IMAGE=1
dry_run "$tmp/schedules.out" deploy/qstash/schedules.sh
if [[ -e "$tmp/called" ]]; then
  echo "FAIL: a dry run called external tools:" >&2
  cat "$tmp/called" >&2
  exit 1
fi
echo "ok: the dry runs called none of gcloud, curl, openssl, podman, docker"

echo "== manifests, configurations and cross-checks"
python3 - "$tmp" <<'PY'
import glob, re, shlex, sys

try:
    import tomllib
except ImportError:
    sys.exit("FAIL: python3 lacks tomllib (3.11+ needed)")
try:
    import yaml
except ImportError:
    sys.exit("FAIL: python3 lacks PyYAML")

tmp = sys.argv[1]
failures = []


def check(cond, what):
    print(("ok: " if cond else "FAIL: ") + what)
    if not cond:
        failures.append(what)
    return cond


def seconds(d):
    m = re.fullmatch(r"(\d+)([smhdw])", str(d))
    if not m:
        raise ValueError(f"bad duration {d!r}")
    return int(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m[2]]


def commands(path):
    """The commands a dry run printed ("+ " lines), as argument lists."""
    return [shlex.split(l[2:]) for l in open(path) if l.startswith("+ ")]


def flags(cmd):
    out = {}
    for a in cmd:
        if a.startswith("--"):
            k, _, v = a.partition("=")
            out.setdefault(k, []).append(v)
    return out


def script_default(path, var):
    m = re.search(rf'^{var}="\$\{{{var}:-(.*)\}}"$', open(path).read(), re.M)
    return m[1] if m else None


def zone(policy):
    return policy.get("schedule", {}).get("timezone", "UTC")


def max_attempts(policy):
    return policy.get("retry", {}).get("max_attempts", 5)


# --- YAML manifests --------------------------------------------------------------------------
manifests = {}
for path in sorted(glob.glob("deploy/kubernetes/*.yaml") + glob.glob("deploy/monitoring/*.yaml")):
    try:
        docs = [d for d in yaml.safe_load_all(open(path)) if d is not None]
    except yaml.YAMLError as e:
        check(False, f"{path} parses as YAML: {e}")
        continue
    good = bool(docs) and all(
        isinstance(d, dict) and d.get("apiVersion") and d.get("kind")
        and isinstance(d.get("metadata"), dict) and d["metadata"].get("name")
        for d in docs)
    check(good, f"{path}: {len(docs)} document(s), each with apiVersion, kind, metadata.name")
    manifests[path] = docs

# --- TOML files ------------------------------------------------------------------------------
configs = {}
for path in sorted(glob.glob("deploy/**/*.toml", recursive=True)):
    try:
        with open(path, "rb") as f:
            configs[path] = tomllib.load(f)
        check(True, f"{path} parses as TOML")
    except tomllib.TOMLDecodeError as e:
        check(False, f"{path} parses as TOML: {e}")

# --- Cloud Run: setup.sh against deploy/cloudrun/sweeper.toml --------------------------------
SETUP, CR = "deploy/cloudrun/setup.sh", "deploy/cloudrun/sweeper.toml"
cr = configs.get(CR)
if check(cr is not None, f"{CR} exists and parses"):
    cmds = commands(f"{tmp}/setup.out")
    deploy = [flags(c) for c in cmds if c[:3] == ["gcloud", "run", "deploy"]]
    subs = [flags(c) for c in cmds if c[:4] == ["gcloud", "pubsub", "subscriptions", "create"]]
    jobs = [(c[5], flags(c)) for c in cmds if c[:5] == ["gcloud", "scheduler", "jobs", "create", "http"]]
    policies = {p["name"]: p for p in cr.get("policy", [])}
    google = [i for i in cr.get("auth", {}).get("jwks_issuer", []) if i.get("google")]
    check(len(google) == 1, f"{CR} has one google = true [[auth.jwks_issuer]]")
    issuer = google[0] if google else {}
    principals = {k.lower(): v for k, v in issuer.get("principals", {}).items()}
    audiences = issuer.get("audiences", [])
    check(issuer.get("iss") == "https://accounts.google.com"
          and issuer.get("jwks_url") == "https://www.googleapis.com/oauth2/v3/certs"
          and issuer.get("algorithms") == ["RS256"],
          f"{CR}: the Google issuer's iss, jwks_url and algorithms")
    check(len(deploy) == 1 and len(subs) == 1,
          f"{SETUP} dry run: one gcloud run deploy and one subscription create")
    run = deploy[0] if deploy else {}
    sub = subs[0] if subs else {}

    projects = {v for c in cmds for v in flags(c).get("--project", [])}
    check(projects == {cr.get("pubsub", {}).get("project")},
          f"{SETUP} deploys to project {sorted(projects)} = [pubsub] project of {CR}")
    check(sub.get("--topic") == [cr.get("pubsub", {}).get("topic")],
          f"the subscription's topic {sub.get('--topic')} = [pubsub] topic")

    # (b) the audience
    default_aud = script_default(SETUP, "AUDIENCE")
    check(default_aud is not None and default_aud in audiences,
          f"{SETUP}'s AUDIENCE default {default_aud!r} is in the issuer's audiences {audiences}")
    used = set(sub.get("--push-auth-token-audience", []))
    for _, j in jobs:
        used.update(j.get("--oidc-token-audience", []))
    check(bool(used) and used <= set(audiences),
          f"every OIDC audience the dry run sets ({sorted(used)}) is in audiences")

    # (c) the service accounts
    push_sa = (sub.get("--push-auth-service-account") or [""])[0]
    check(principals.get(push_sa.lower()) == ["consume"],
          f"push SA {push_sa!r} is a principal with exactly [\"consume\"]")
    sched_sas = {j.get("--oidc-service-account-email", [""])[0] for _, j in jobs}
    check(len(sched_sas) == 1, f"every Scheduler job uses one OIDC service account {sorted(sched_sas)}")
    sched_sa = next(iter(sched_sas), "")
    sched_scopes = principals.get(sched_sa.lower())
    check(sched_scopes is not None, f"scheduler SA {sched_sa!r} is a principal")
    sched_scopes = sched_scopes or []

    # (a) one trigger scope and one Scheduler job per policy, on the policy's schedule
    check(bool(policies), f"{CR} defines policies: {sorted(policies)}")
    by_uri = {}
    for name, j in jobs:
        uri = j.get("--uri", [""])[0]
        m = re.search(r"/trigger/([a-z0-9_-]+)$", uri)
        by_uri[m[1] if m else uri] = (name, j)
        check(j.get("--http-method") == ["POST"] and bool(j.get("--oidc-service-account-email")),
              f"Scheduler job {name}: POST with an OIDC token")
    for name, p in policies.items():
        cron, tz = p.get("schedule", {}).get("cron"), zone(p)
        check(f"trigger:{name}" in sched_scopes,
              f"policy {name}: the scheduler SA has trigger:{name} (it has {sched_scopes})")
        job = by_uri.get(name)
        check(job is not None
              and job[1].get("--schedule") == [cron] and job[1].get("--time-zone") == [tz],
              f"policy {name}: a Scheduler job POSTs /trigger/{name} on {cron!r} in {tz}")
        check(p.get("transport") == "pubsub", f"policy {name}: transport = \"pubsub\"")
    for target in by_uri:
        check(target in policies, f"Scheduler job for /trigger/{target} has a policy in {CR}")
    for scope in sched_scopes:
        check(scope.startswith("trigger:") and scope[8:] in policies,
              f"scheduler SA scope {scope} names a policy of {CR}")

    # (d) dead-lettering after more attempts than sweeper's own budget
    mda = int((sub.get("--max-delivery-attempts") or ["0"])[0])
    budget = max([max_attempts(p) for p in policies.values()] or [5])
    check(5 <= mda <= 100 and mda > budget and sub.get("--dead-letter-topic") == ["sweeper-commands-dead"],
          f"--max-delivery-attempts={mda} (5-100) > every policy's retry.max_attempts (max {budget}), "
          f"dead-letter topic sweeper-commands-dead")

    # (e) deadlines above consume.command_deadline
    deadline = seconds(cr.get("consume", {}).get("command_deadline", "60s"))
    ack = int((sub.get("--ack-deadline") or ["0"])[0])
    check(deadline < ack <= 600, f"--ack-deadline={ack} > consume.command_deadline ({deadline}s), at most 600")
    timeout = int((run.get("--timeout") or ["0"])[0])
    check(timeout > deadline, f"Cloud Run --timeout={timeout} > consume.command_deadline ({deadline}s)")
    check("--no-cpu-throttling" in run and int((run.get("--min-instances") or ["0"])[0]) >= 1,
          "Cloud Run: --no-cpu-throttling and --min-instances >= 1")
    check(all(f in sub for f in ("--min-retry-delay", "--max-retry-delay")),
          "the subscription has a retry policy (--min-retry-delay, --max-retry-delay)")
    check((sub.get("--push-endpoint") or [""])[0].endswith("/consume"), "the push endpoint is /consume")
    envs = {k.get("secret_env") for i in cr.get("auth", {}).get("issuer", []) for k in i.get("keys", [])}
    secrets = (run.get("--set-secrets") or [""])[0]
    for env in sorted(e for e in envs if e):
        check(f"{env}=" in secrets, f"Cloud Run sets {env} (an HS256 secret_env) from a secret")
    check(cr.get("listen") == "0.0.0.0:8080" and "--port" in run and run["--port"] == ["8080"],
          "listen 0.0.0.0:8080 and Cloud Run --port=8080")
    build = commands(f"{tmp}/setup-build.out")
    check(any(c[:4] == ["gcloud", "artifacts", "repositories", "create"] for c in build)
          and any(c[1:2] == ["push"] for c in build),
          "BUILD_IMAGE=1 creates the Artifact Registry repository and pushes the image")

# --- Kubernetes: the CronJob against the configuration its ConfigMap ships -------------------
SHIPPED = "deploy/sweeper.example.toml"   # deployment.yaml: ConfigMap sweeper-config from it
shipped = {p["name"]: p for p in configs.get(SHIPPED, {}).get("policy", [])}
cronjobs = [d for docs in manifests.values() for d in docs if d.get("kind") == "CronJob"]
check(bool(cronjobs), "deploy/kubernetes has a CronJob")
for cj in cronjobs:
    name = cj["metadata"]["name"]
    spec = cj.get("spec", {})
    text = yaml.safe_dump(spec.get("jobTemplate", {}))
    targets = re.findall(r"https?://[^\s'\"]+/trigger/([a-z0-9_-]+)", text)
    check(len(set(targets)) == 1, f"CronJob {name} POSTs one /trigger/<policy>: {targets}")
    for t in set(targets):
        p = shipped.get(t)
        if check(p is not None, f"CronJob {name}: policy {t} is defined in {SHIPPED}"):
            cron, tz = p.get("schedule", {}).get("cron"), zone(p)
            check(spec.get("schedule") == cron and spec.get("timeZone", "UTC") == tz,
                  f"CronJob {name}: schedule {spec.get('schedule')!r} {spec.get('timeZone')} "
                  f"= policy {t}'s {cron!r} {tz}")
        label = cj["metadata"].get("labels", {}).get("sweeper.example.com/policy")
        check(label in (None, t), f"CronJob {name}: policy label {label} = {t}")

# --- QStash: schedules.sh against deploy/qstash/sweeper.toml ---------------------------------
SCHED, QS = "deploy/qstash/schedules.sh", "deploy/qstash/sweeper.toml"
qs = configs.get(QS)
if check(qs is not None and "qstash" in qs, f"{QS} exists, parses and has [qstash]"):
    q = qs["qstash"]
    public = q.get("public_url", "").rstrip("/")
    scopes = q.get("scopes", ["consume"])
    qpol = {p["name"]: p for p in qs.get("policy", []) if p.get("transport") == "qstash"}
    check(bool(qpol), f"{QS} has qstash policies: {sorted(qpol)}")
    check("consume" in scopes, f"[qstash] scopes {scopes} include consume")
    made = {}
    for c in commands(f"{tmp}/schedules.out"):
        url = c[-1]
        hdr = {}
        for i, a in enumerate(c[:-1]):
            if a in ("--header", "-H") and c[i + 1] != "@-":
                k, _, v = c[i + 1].partition(":")
                hdr[k.strip().lower()] = v.strip()
        m = re.fullmatch(r"https://qstash\.upstash\.io/v2/schedules/(.+)/trigger/([a-z0-9_-]+)", url)
        check(m is not None and c[0] == "curl" and "POST" in c and "@-" in c,
              f"{SCHED} dry run: curl POST {url} (Authorization from stdin)")
        if m:
            made[m[2]] = (m[1], hdr)
    for name, p in qpol.items():
        cron, tz = p.get("schedule", {}).get("cron"), zone(p)
        check(f"trigger:{name}" in scopes, f"qstash policy {name}: [qstash] scopes include trigger:{name}")
        s = made.get(name)
        if check(s is not None, f"qstash policy {name}: {SCHED} creates its schedule"):
            dest, hdr = s
            want = f"CRON_TZ={tz} {cron}"
            check(dest == public, f"schedule {name} calls {dest}/trigger/{name} (public_url {public})")
            check(hdr.get("upstash-cron") == want, f"schedule {name}: Upstash-Cron {hdr.get('upstash-cron')!r} = {want!r}")
            check(hdr.get("upstash-method") == "POST" and hdr.get("upstash-schedule-id") == f"sweeper-{name}"
                  and hdr.get("upstash-retries", "").isdigit(),
                  f"schedule {name}: Upstash-Method POST, Upstash-Schedule-Id sweeper-{name}, Upstash-Retries")
    for name in made:
        check(name in qpol, f"QStash schedule /trigger/{name} has a qstash policy in {QS}")

if failures:
    print(f"\n{len(failures)} check(s) failed:")
    for f in failures:
        print(f"  FAIL: {f}")
    sys.exit(1)
print("\nall deploy checks passed")
PY
