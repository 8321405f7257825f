#!/usr/bin/env python3
"""The HTTP contract checked by a real peer: schemathesis against a live `sweeper serve`.

Every operation of the served `openapi.yaml` is exercised with `--checks all` (examples, coverage
and fuzzing phases), a fixed seed and bounded examples, with a token of exactly the scope the
operation needs (`schemathesis.toml` beside this file). Read-only operations share one server;
each operation that changes state gets a fresh database (cloned from a seeded template: demo
tickets, one completed run) and a fresh server, so no operation's findings depend on another's
leftovers. Any finding fails the run (exit 1).

    python3 tests/contract/run.py [group ...]   # groups: "read-only operations" or an
                                                # operationId that changes state
    # with the python of schemathesis's environment (PyYAML); needs DATABASE_URL's server, psql,
    # target/debug/sweeper (or SWEEPER_BIN) and schemathesis on PATH (or SCHEMATHESIS=path)
"""

import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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


def config(port):
    path = WORK / f"sweeper-{port}.toml"
    path.write_text(f"""
database_url = "{db_url(DB)}"
listen = "127.0.0.1:{port}"
migrate_on_start = true
[queue]
workers = 1
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


def serve(port):
    proc = subprocess.Popen(
        [BIN, "serve", "--config", str(config(port))], env=ENV,
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


def make_template():
    """A migrated ledger, seeded tickets and one completed run, to clone per operation."""
    for name in (DB, TEMPLATE):
        psql(f"drop database if exists {name} with (force)")
    psql(f"create database {DB}")
    psql(SEED_SQL, DB)
    port = free_port()
    proc, base = serve(port)
    req = urllib.request.Request(
        base + "/trigger/ticket-retention", method="POST",
        headers={"Authorization": "Bearer " + token(port, "trigger:*")},
    )
    urllib.request.urlopen(req, timeout=10)
    for _ in range(300):
        out = subprocess.run(
            ["psql", "-Atq", db_url(DB), "-c",
             "select count(*) from sweeper.runs where status = 'completed'"],
            capture_output=True, text=True, check=True,
        )
        if out.stdout.strip() == "1":
            break
        time.sleep(0.1)
    else:
        sys.exit("the seed run did not complete")
    stop(proc)
    psql(f"alter database {DB} rename to {TEMPLATE}")


def run_schemathesis(port, base, selection):
    env = dict(os.environ)
    for scope, var in [("ops:read", "READ"), ("ops:write", "WRITE"), ("trigger:*", "TRIGGER"),
                       ("consume", "CONSUME")]:
        env[f"SWEEPER_TOKEN_{var}"] = token(port, scope)
    cmd = [
        SCHEMATHESIS, "--no-color", "--config-file", str(HERE / "schemathesis.toml"), "run",
        str(ROOT / "openapi.yaml"), "--url", base, "--checks", "all",
        "--phases", "examples,coverage,fuzzing", "--seed", SEED, "--max-examples", MAX_EXAMPLES,
        "--request-timeout", "20", *selection,
    ]
    print("+", " ".join(cmd[1:]), flush=True)
    # In the scratch directory: schemathesis keeps a cache (`.schemathesis/`) where it runs.
    return subprocess.run(cmd, env=env, timeout=900, cwd=WORK).returncode


def main():
    make_template()
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
        proc, base = serve(port)
        try:
            if run_schemathesis(port, base, selection) != 0:
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
    main()
