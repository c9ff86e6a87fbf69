// pginbox from Java with JDBC (pgjdbc): the scenario of docs/other-languages.md, step by step.
// Connects with the PG* environment variables (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD)
// as the LOGIN role bound to consumer 'ledger'. Prints one JSON line per step.
// Build and run: javac -cp /usr/share/java/postgresql.jar -d out Scenario.java
//                java -cp out:/usr/share/java/postgresql.jar Scenario

import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.sql.Timestamp;
import java.time.Instant;
import java.time.temporal.ChronoUnit;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ThreadLocalRandom;

import org.postgresql.util.PSQLException;
import org.postgresql.util.ServerErrorMessage;

public final class Scenario {
    static final String CONSUMER = "ledger";
    static final String PRODUCER = "shop";
    static final String HANDLER_VERSION = "v1";

    record Message(String producer, String id, String type, long account, long amount, Instant producedAt) {
        String payload() { // the JSON text; bound as text and cast with ?::jsonb
            return "{\"account\": " + account + ", \"amount\": " + amount + "}";
        }
    }

    // doc:begin classify
    // What to do with an error (docs/other-languages.md, section 4).
    enum Action { RETRY, HALT, DEAD_LETTER }

    static Action classify(SQLException e) {
        String code = e.getSQLState(); // null: no answer from the server
        if (code == null || code.startsWith("08") || code.startsWith("53") || code.startsWith("57")) {
            return Action.RETRY; // connection lost, server shutting down, out of resources, 57014
        }
        if (code.startsWith("40") || code.equals("55P03")) {
            return Action.RETRY; // serialization failure, deadlock, lock timeout
        }
        if (List.of("42501", "42704", "42883", "42P01", "3F000", "3D000").contains(code) || code.startsWith("28")) {
            return Action.HALT; // configuration or rights: every message would fail the same way
        }
        return Action.DEAD_LETTER; // this message can never succeed as it is
    }
    // doc:end classify

    // doc:begin retry
    interface Work<T> { T run(Connection c) throws SQLException; }

    // Runs work in one transaction; retries the WHOLE transaction on a transient error, with a
    // bounded, jittered backoff. Safe even when a lost connection hid the COMMIT's outcome: the
    // retry's claim sees 'duplicate'.
    static <T> T inTransaction(int isolation, Work<T> work, List<String> retried) throws SQLException {
        final int attempts = 5;
        for (int attempt = 1; ; attempt++) {
            try (Connection c = connect()) {
                c.setAutoCommit(false);
                c.setTransactionIsolation(isolation);
                try {
                    T result = work.run(c);
                    c.commit();
                    return result;
                } catch (SQLException e) {
                    if (!c.isClosed()) c.rollback();
                    throw e;
                }
            } catch (SQLException e) {
                if (classify(e) != Action.RETRY || attempt >= attempts) throw e;
                if (retried != null) retried.add(e.getSQLState());
                sleep(ThreadLocalRandom.current().nextLong(1, 10L << attempt));
            }
        }
    }
    // doc:end retry

    // doc:begin claim
    // Pattern 1: claim in your transaction, make the change in the same transaction.
    // The change's error, told apart from the claim's (the retry loop still sees its SQLSTATE).
    static final class WrappedChangeFailure extends SQLException {
        private static final long serialVersionUID = 1L;
        WrappedChangeFailure(SQLException cause) { super(cause.getMessage(), cause.getSQLState(), cause); }
        SQLException cause() { return (SQLException) getCause(); }
    }

    static String handleWithClaim(Connection c, Message m) throws SQLException {
        String outcome;
        try (PreparedStatement s = c.prepareStatement(
                "SELECT outcome FROM inbox.claim(?, ?, ?, ?::jsonb, handler_version => ?, produced_at => ?)")) {
            s.setString(1, CONSUMER);
            s.setString(2, m.producer());
            s.setString(3, m.id());
            s.setString(4, m.payload());
            s.setString(5, HANDLER_VERSION);
            s.setTimestamp(6, m.producedAt() == null ? null : Timestamp.from(m.producedAt()));
            try (ResultSet r = s.executeQuery()) {
                r.next();
                outcome = r.getString("outcome");
            }
        }
        if (outcome.equals("claimed")) {
            try (PreparedStatement u = c.prepareStatement(
                    "UPDATE ledger.account SET balance = balance + ? WHERE id = ?")) {
                u.setLong(1, m.amount());
                u.setLong(2, m.account());
                u.executeUpdate();
            } catch (SQLException e) {
                throw new WrappedChangeFailure(e); // the change failed, not the claim
            }
        }
        return outcome;
    }

    // One delivery: the outcome, and what to tell the broker.
    static String deliver(Message m) throws SQLException {
        try {
            String outcome = inTransaction(Connection.TRANSACTION_READ_COMMITTED, c -> handleWithClaim(c, m), null);
            return json("outcome", outcome, "then", "ack");
        } catch (WrappedChangeFailure w) {
            SQLException e = w.cause();
            if (classify(e) != Action.DEAD_LETTER) return refused(e);
            // A permanent error in the change: its transaction rolled back; record the attempt.
            try (Connection c = connect(); PreparedStatement s = c.prepareStatement(
                    "SELECT outcome, reason_code FROM inbox.record_failure(?, ?, ?, ?::jsonb, ?, ?, handler_version => ?)")) {
                s.setString(1, CONSUMER);
                s.setString(2, m.producer());
                s.setString(3, m.id());
                s.setString(4, m.payload());
                s.setString(5, reasonCode(e));
                s.setString(6, e.getMessage());
                s.setString(7, HANDLER_VERSION);
                try (ResultSet r = s.executeQuery()) {
                    r.next();
                    String outcome = r.getString("outcome");
                    return json("outcome", outcome, "reason_code", r.getString("reason_code"),
                                "then", outcome.equals("failed") ? "nack" : "ack");
                }
            }
        } catch (SQLException e) {
            return refused(e); // refused before anything was written
        }
    }

    static String reasonCode(SQLException e) { // the constraint's name when there is one, else the SQLSTATE
        if (e instanceof PSQLException p) {
            ServerErrorMessage server = p.getServerErrorMessage();
            if (server != null && server.getConstraint() != null) return server.getConstraint();
        }
        return e.getSQLState();
    }
    // doc:end claim

    // doc:begin apply
    // Pattern 2: one round trip; the change is the registered SQL handler.
    static Map<String, String> apply(Connection c, Message m, String consumer) throws SQLException {
        try (PreparedStatement s = c.prepareStatement(
                "SELECT * FROM inbox.claim_and_apply(?, ?, ?, ?, ?::jsonb, produced_at => ?)")) {
            s.setString(1, consumer);
            s.setString(2, m.producer());
            s.setString(3, m.id());
            s.setString(4, m.type());
            s.setString(5, m.payload());
            s.setTimestamp(6, m.producedAt() == null ? null : Timestamp.from(m.producedAt()));
            try (ResultSet r = s.executeQuery()) {
                r.next(); // also: getLong("quarantine_id"), getInt("attempts"), getString("error_message")
                return Map.of("outcome", r.getString("outcome"),
                              "reason_code", String.valueOf(r.getString("reason_code")));
            }
        }
    }

    static String deliverApply(Message m, String consumer) {
        try {
            Map<String, String> r = inTransaction(Connection.TRANSACTION_READ_COMMITTED, c -> apply(c, m, consumer), null);
            String outcome = r.get("outcome");
            // failed: the handler's error was recorded (reason_code), its writes rolled back.
            return json("outcome", outcome, "reason_code", r.get("reason_code"),
                        "then", outcome.equals("failed") ? "nack" : "ack");
        } catch (SQLException e) {
            return refused(e);
        }
    }
    // doc:end apply

    static String refused(SQLException e) {
        return json("sqlstate", e.getSQLState(), "action", classify(e).name().toLowerCase().replace('_', '-'));
    }

    static Connection connect() throws SQLException {
        String url = "jdbc:postgresql://" + env("PGHOST", "localhost") + ":" + env("PGPORT", "5432") + "/"
                + env("PGDATABASE", env("PGUSER", "postgres"));
        return DriverManager.getConnection(url, env("PGUSER", "postgres"), System.getenv("PGPASSWORD"));
    }

    static String env(String name, String fallback) {
        String value = System.getenv(name);
        return value == null || value.isEmpty() ? fallback : value;
    }

    static void sleep(long ms) {
        try {
            Thread.sleep(ms);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    // A JSON object from key, value pairs; the value "null" becomes JSON null.
    static String json(String... kv) {
        StringBuilder b = new StringBuilder("{");
        for (int i = 0; i < kv.length; i += 2) {
            if (i > 0) b.append(", ");
            b.append('"').append(kv[i]).append("\": ");
            b.append(kv[i + 1] == null || kv[i + 1].equals("null") ? "null" : "\"" + kv[i + 1] + "\"");
        }
        return b.append('}').toString();
    }

    static void report(String step, String result) {
        System.out.println("{\"step\": \"" + step + "\", " + result.substring(1));
    }

    static Message credit(String id, long account, long amount) {
        return new Message(PRODUCER, id, "credit", account, amount, null);
    }

    public static void main(String[] args) throws Exception {
        report("claim", deliver(credit("m-1", 1, 10)));
        report("claim_duplicate", deliver(credit("m-1", 1, 10)));
        report("claim_conflict", deliver(credit("m-1", 1, 99)));
        report("claim_change_failed", deliver(credit("m-2", 2, -5)));
        report("apply", deliverApply(credit("m-3", 2, 7), CONSUMER));
        report("apply_duplicate", deliverApply(credit("m-3", 2, 7), CONSUMER));
        report("apply_failed", deliverApply(credit("m-4", 1, -1000), CONSUMER));

        // doc:begin race
        // A REPEATABLE READ transaction whose snapshot predates another worker's commit of the same
        // message gets 40001; the retry loop runs it again and the claim says 'duplicate'.
        Message msg = credit("m-5", 2, 1);
        List<String> retried = new ArrayList<>();
        String[] first = {null};
        String outcome = inTransaction(Connection.TRANSACTION_REPEATABLE_READ, c -> {
            try (Statement s = c.createStatement()) {
                s.execute("SELECT 1"); // the snapshot is taken here
            }
            if (first[0] == null) { // the other worker, on its own connection
                try (Connection other = connect()) {
                    first[0] = apply(other, msg, CONSUMER).get("outcome");
                }
            }
            return apply(c, msg, CONSUMER).get("outcome");
        }, retried);
        // doc:end race
        report("race", "{\"first\": \"" + first[0] + "\", \"retried\": [" + String.join(", ",
                retried.stream().map(s -> "\"" + s + "\"").toList()) + "], \"outcome\": \"" + outcome + "\"}");

        Instant tomorrow = Instant.now().plus(1, ChronoUnit.DAYS);
        report("produced_at_ahead", deliver(new Message(PRODUCER, "m-6", "credit", 1, 1, tomorrow)));
        report("unbound_consumer", deliverApply(credit("m-7", 1, 1), "ledgr"));
    }
}
