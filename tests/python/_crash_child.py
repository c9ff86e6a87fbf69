"""Child process for the SIGKILL tests in test_crash.py.

Usage: _crash_child.py DSN STYLE PHASE MESSAGE_ID AMOUNT
Delivers one message (STYLE: claim | claim_and_apply) inside an explicit transaction. With PHASE
`before_commit` it stops right before COMMIT; with `after_commit` it commits (and would ack next).
Either way it then prints `<phase> <backend pid> <outcome>` and waits on stdin to be killed.
"""

from __future__ import annotations

import sys

from helpers_inbox import apply_in_caller, claim, claim_and_apply, connect, payload


def main() -> None:
    dsn, style, phase, message_id, amount = sys.argv[1:]
    body = payload(message_id, int(amount))
    conn = connect(dsn)
    conn.execute("BEGIN")
    if style == "claim":
        outcome = claim(conn, message_id, body).outcome
        if outcome == "claimed":
            apply_in_caller(conn, body)
    else:
        outcome = claim_and_apply(conn, message_id, body).outcome
    if phase == "after_commit":
        conn.execute("COMMIT")
    print(f"{phase} {conn.info.backend_pid} {outcome}", flush=True)
    sys.stdin.read()  # the parent kills us here; reaching EOF means it did not
    sys.exit("not killed")


if __name__ == "__main__":
    main()
