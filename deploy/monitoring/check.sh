#!/usr/bin/env bash
# deploy/monitoring/check.sh: Prometheus's own checks of the monitoring kit, for .ci/run.
#   * promtool check rules / test rules on alerts.yml and alerts.test.yml;
#   * promtool check config on prometheus.yml;
#   * every PromQL expression of dashboard.json parses (written into a temporary rules file as
#     recording rules, which promtool checks).
# Needs promtool (Debian package `prometheus`; installed with apt-get when missing and running as
# root) and python3.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

if ! command -v promtool >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "installing promtool (Debian package prometheus)"
    (apt-get install -y -qq prometheus || { apt-get update -qq && apt-get install -y -qq prometheus; }) >/dev/null 2>&1 || true
  fi
  command -v promtool >/dev/null 2>&1 ||
    { echo "FAIL: promtool is not installed (apt-get install prometheus, as root)" >&2; exit 1; }
fi

promtool check rules alerts.yml
promtool test rules alerts.test.yml
promtool check config prometheus.yml

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp/dashboard-rules.yml" <<'PY'
import json, sys

dashboard = json.load(open("dashboard.json"))
assert any(i.get("name") == "DS_PROMETHEUS" for i in dashboard["__inputs"]), "no DS_PROMETHEUS input"
rules = []
for panel in dashboard["panels"]:
    assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    for t in panel["targets"]:
        rules.append({"record": f"dashboard:panel_{panel['id']}:{t['refId']}", "expr": t["expr"]})
with open(sys.argv[1], "w") as f:
    json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
print(f"{len(rules)} dashboard expressions")
PY
promtool check rules "$tmp/dashboard-rules.yml"
echo "ok: the monitoring kit passes promtool"
