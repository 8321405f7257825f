#!/usr/bin/env python3
"""The HTTP contract checked by a real peer: schemathesis against a live `sweeper serve`.

Every operation of the served `openapi.yaml` is exercised with `--checks all` (examples, coverage
and fuzzing phases), a fixed seed and bounded examples, with a token of exactly the scope the
operation needs, and half of the ids drawn from what the seeded template holds (OPERATIONS below
is the list of tokens, expected statuses and seeded parameters). Read-only operations share one
server; each operation that changes state gets a fresh database (cloned from the template: demo
tickets, a completed run with an item dead letter, an envelope dead letter, a running backfill)
and a fresh server, so no operation's findings depend on another's leftovers. Any finding fails
the run (exit 1).

    python3 tests/contract/run.py [group ...]   # groups: "read-only operations" or an
                                                # operationId that changes state
    # CONTRACT_REPORT_DIR=dir keeps a HAR of every request; CONTRACT_SEED and
    # CONTRACT_MAX_EXAMPLES change the seed (20261201) and examples per operation (30).
    # with the python of schemathesis's environment (PyYAML); needs DATABASE_URL's server, psql,
    # target/debug/sweeper (or SWEEPER_BIN) and schemathesis on PATH (or SCHEMATHESIS=path)
"""

import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIN = os.environ.get("SWEEPER_BIN", str(ROOT / "target/debug/sweeper"))
SCHEMATHESIS = os.environ.get("SCHEMATHESIS", shutil.which("schemathesis") or "schemathesis")
SERVER = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
SEED = os.environ.get("CONTRACT_SEED", "20261201")
MAX_EXAMPLES = os.environ.get("CONTRACT_MAX_EXAMPLES", "30")
# Named like the integration tests' databases (`sweeper_t_..._{pid}`), so a later test run drops
# them if this process was killed.
TEMPLATE = f"sweeper_t_contract_tpl_{os.getpid()}"
DB = f"sweeper_t_contract_{os.getpid()}"
SECRET = secrets.token_hex(32)
WORK = pathlib.Path(tempfile.mkdtemp(prefix="sweeper-contract-"))



def writes():
    """Every operation of the spec that is not a GET: each changes state (or may), so each runs
    against a fresh database and server. Endpoints added later join on their own."""
    import yaml  # schemathesis depends on PyYAML: run this with schemathesis's python

    spec = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    return [
        op["operationId"]
        for item in spec["paths"].values()
        for method, op in item.items()
        if method in ("post", "put", "patch", "delete")
    ]


SEED_SQL = """
create schema demo;
create table demo.tickets (id bigint primary key, status text, legal_hold boolean,
                           closed_at timestamptz not null);
create index on demo.tickets (closed_at, id);
insert into demo.tickets
select g, case when g % 11 = 0 then 'open' else 'closed' end, g % 7 = 0,
       now() - make_interval(days => 60 + g % 100)
  from generate_series(1, 500) g;
"""


def db_url(name):
    u = urllib.parse.urlparse(SERVER)
    return urllib.parse.urlunparse(u._replace(path="/" + name))


def psql(sql, database=None):
    subprocess.run(
        ["psql", "-q", "-v", "ON_ERROR_STOP=1", db_url(database) if database else SERVER, "-c", sql],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(port, workers=1):
    path = WORK / f"sweeper-{port}.toml"
    path.write_text(f"""
database_url = "{db_url(DB)}"
listen = "127.0.0.1:{port}"
migrate_on_start = true
[queue]
workers = {workers}
poll_interval = "1s"
[[auth.issuer]]
iss = "sweeper-contract"
audience = "sweeper"
keys = [ {{ kid = "c1", secret_env = "SWEEPER_CONTRACT_SECRET" }} ]
[[policy]]
name = "ticket-retention"
schedule = {{ cron = "0 2 * * *", timezone = "UTC" }}
target = {{ table = "demo.tickets", key = "id", timestamp = "closed_at" }}
retain_for = "90d"
exclude = [ {{ column = "legal_hold", equals = true }}, {{ column = "status", in = ["open"] }} ]
batch_size = 50
""")
    return path


ENV = dict(os.environ, SWEEPER_CONTRACT_SECRET=SECRET, RUST_LOG="warn")
ENV.pop("DATABASE_URL", None)


def serve(port, workers=1):
    proc = subprocess.Popen(
        [BIN, "serve", "--config", str(config(port, workers))], env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if urllib.request.urlopen(base + "/readyz", timeout=2).status == 200:
                return proc, base
        except Exception:
            pass
        if proc.poll() is not None:
            sys.exit(f"sweeper serve exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    sys.exit("sweeper serve did not become ready")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def token(port, scope):
    out = subprocess.run(
        [BIN, "token", "--config", str(config(port)), "--scope", scope, "--ttl", "2h",
         "--sub", "schemathesis"],
        env=ENV, check=True, capture_output=True, text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def fresh_database():
    psql(f"drop database if exists {DB} with (force)")
    psql(f"create database {DB} template {TEMPLATE}")


def query(sql):
    out = subprocess.run(["psql", "-Atq", db_url(DB), "-c", sql], capture_output=True, text=True,
                         check=True)
    return [line for line in out.stdout.splitlines() if line]


def call(base, path, token_, body=None):
    req = urllib.request.Request(
        base + path, method="POST", data=body,
        headers={"Authorization": "Bearer " + token_, "Content-Type": "application/json"},
    )
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code


def wait_for(sql, expected, what):
    for _ in range(300):
        if query(sql) == [expected]:
            return
        time.sleep(0.1)
    sys.exit(f"contract seed: {what} did not happen")


def make_template():
    """A migrated ledger and seeded tickets, with something for every id an operation takes: a
    completed run with an item dead letter (a referenced ticket cannot be deleted), an envelope
    dead letter, and a backfill run left running with pending commands. Cloned per operation.
    Returns the ids, for the dictionaries schemathesis draws from."""
    for name in (DB, TEMPLATE):
        psql(f"drop database if exists {name} with (force)")
    psql(f"create database {DB}")
    psql(SEED_SQL, DB)
    psql("create table demo.ticket_refs (ticket_id bigint references demo.tickets (id));"
         "insert into demo.ticket_refs values (50)", DB)
    port = free_port()
    proc, base = serve(port)
    assert call(base, "/trigger/ticket-retention", token(port, "trigger:*")) == 202
    wait_for("select count(*) from sweeper.runs where status like 'completed%'", "1",
             "the seed run")
    assert call(base, "/consume", token(port, "consume"), b"not an envelope") == 200
    stop(proc)
    # Workers off: a backfill of yesterday's tick stays running, its commands pending.
    proc, base = serve(port, workers=0)
    window = query("select to_char((window_at - interval '1 day') at time zone 'UTC', "
                   "'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') from sweeper.runs")[0]
    assert call(base, f"/trigger/ticket-retention?window={window}",
                token(port, "trigger:* ops:write")) == 202
    wait_for("select count(*) from sweeper.runs where planning_done", "2", "the backfill plan")
    stop(proc)
    ids = {
        "runs": query("select run_id from sweeper.runs order by run_id"),
        "windows": query("select to_char(window_at at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') "
                         "from sweeper.runs"),
        "commands": query("select command_id from sweeper.commands where state = 'pending' "
                          "order by 1 limit 5"),
        "dead_letters": [int(i) for i in query("select dead_letter_id from sweeper.dead_letters")],
        "policies": ["ticket-retention"],
        "item_keys": query("select distinct item_key from sweeper.audit_trail order by 1 limit 5"),
    }
    assert ids["commands"] and len(ids["dead_letters"]) >= 2, ids
    # The restore and clone guard would hold every clone of a served database (its oid differs):
    # forget the identity, so each clone records its own at its first serve.
    psql("delete from sweeper.database_identity", DB)
    psql(f"alter database {DB} rename to {TEMPLATE}")
    return ids


# Per operation: the token it gets (the scope it needs), the statuses it may answer to
# schema-valid input (positive_data_acceptance; a valid id that names nothing is 404, an act on
# something in the wrong state 409), and which parameters draw half of their values from the
# seeded ids.
OPERATIONS = {
    # 400: a window that is no tick; 404: a policy not configured. The token also holds
    # ops:write, so backfills are created (202) rather than refused.
    "trigger": ("TRIGGER_BACKFILL", [200, 202, 400, 404],
                {"path.policy": "policies", "query.window": "windows"}),
    # 404: a command id the ledger does not know (generic envelope).
    "consume": ("CONSUME", [200, 404], {"body.command_id": "commands"}),
    "listRuns": ("READ", [200], {"query.policy": "policies"}),
    "getRun": ("READ", [200, 404], {"path.run_id": "runs"}),
    "listRunItems": ("READ", [200, 404], {"path.run_id": "runs"}),
    "listDeadLetters": ("READ", [200], {"query.run_id": "runs", "query.policy": "policies"}),
    "getDeadLetter": ("READ", [200, 404], {"path.id": "dead_letters"}),
    "listPolicies": ("READ", [200], {}),
    # 400: a key that is not a bigint (the seeded policy's key type).
    "itemHistory": ("READ", [200, 400, 404],
                    {"path.policy": "policies", "path.key": "item_keys"}),
    "listOperatorLog": ("READ", [200], {}),
    "cancelRun": ("WRITE", [200, 404, 409], {"path.run_id": "runs"}),
    "redriveDeadLetters": ("WRITE", [200], {"body.run_id": "runs"}),
    "redriveDeadLetter": ("WRITE", [200, 404, 409], {"path.id": "dead_letters"}),
    "abandonDeadLetter": ("WRITE", [200, 404, 409], {"path.id": "dead_letters"}),
    "suspendPolicy": ("WRITE", [200, 404, 409], {"path.policy": "policies"}),
    "resumePolicy": ("WRITE", [200, 404, 409], {"path.policy": "policies"}),
    # No token: probes and metrics.
    "healthz": (None, [200], {}),
    "readyz": (None, [200], {}),
    "metrics": (None, [200], {}),
}

TOKENS = {"READ": "ops:read", "WRITE": "ops:write", "TRIGGER_BACKFILL": "trigger:* ops:write",
          "CONSUME": "consume"}


def schemathesis_toml(ids):
    """The configuration: OPERATIONS, the seeded ids as dictionaries, and the one exception to
    negative_data_rejection docs/design.md §5 makes (a body that is no envelope, from an authenticated
    sender, is quarantined and acknowledged with 200 so no queue redelivers it for ever)."""
    out = ["[warnings]", "fail-on = false", ""]
    for name, values in ids.items():
        out += [f"[dictionaries.{name}]", f"values = {json.dumps(values)}", ""]
    for op, (tok, statuses, params) in OPERATIONS.items():
        out += ["[[operations]]", f'include-operation-id = "{op}"']
        if tok:
            out.append(f'headers = {{ Authorization = "Bearer ${{SWEEPER_TOKEN_{tok}}}" }}')
        out.append(f"checks.positive_data_acceptance.expected-statuses = {statuses}")
        if op == "consume":
            out.append("checks.negative_data_rejection.expected-statuses = "
                       "[200, 400, 401, 403, 404, 413]")
        if params:
            bound = ", ".join(f'"{k}" = {{ dictionary = "{v}", probability = 0.5 }}'
                              for k, v in params.items())
            out.append(f"parameters = {{ {bound} }}")
        out.append("")
    path = WORK / "schemathesis.toml"
    path.write_text("\n".join(out))
    return path


def run_schemathesis(port, base, selection, config_file):
    env = dict(os.environ)
    for var, scope in TOKENS.items():
        env[f"SWEEPER_TOKEN_{var}"] = token(port, scope)
    cmd = [
        SCHEMATHESIS, "--no-color", "--config-file", str(config_file), "run",
        str(ROOT / "openapi.yaml"), "--url", base, "--checks", "all",
        "--phases", "examples,coverage,fuzzing", "--seed", SEED, "--max-examples", MAX_EXAMPLES,
        "--request-timeout", "20", *selection,
        *(["--report", "har", "--report-dir", os.environ["CONTRACT_REPORT_DIR"]]
          if os.environ.get("CONTRACT_REPORT_DIR") else []),
    ]
    print("+", " ".join(cmd[1:]), flush=True)
    # In the scratch directory: schemathesis keeps a cache (`.schemathesis/`) where it runs.
    return subprocess.run(cmd, env=env, timeout=900, cwd=WORK).returncode


def main():
    config_file = schemathesis_toml(make_template())
    failed = []
    groups = [("read-only operations", ["--include-method", "GET"])] + [
        (op, ["--include-operation-id", op]) for op in writes()
    ]
    only = sys.argv[1:]
    for name, selection in groups:
        if only and name not in only:
            continue
        print(f"== schemathesis: {name}", flush=True)
        fresh_database()
        port = free_port()
        # Workers off: the seeded running backfill stays running, its commands pending.
        proc, base = serve(port, workers=0)
        try:
            if run_schemathesis(port, base, selection, config_file) != 0:
                failed.append(name)
        finally:
            stop(proc)
    for name in (DB, TEMPLATE):
        psql(f"drop database if exists {name} with (force)")
    shutil.rmtree(WORK, ignore_errors=True)
    if failed:
        sys.exit("schemathesis findings in: " + ", ".join(failed))
    print("schemathesis: no findings")


if __name__ == "__main__":
    try:
        main()
    finally:
        # Also after a failure: no database or scratch directory is left behind.
        for name in (DB, TEMPLATE):
            subprocess.run(["psql", "-q", SERVER, "-c", f"drop database if exists {name} with (force)"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(WORK, ignore_errors=True)
