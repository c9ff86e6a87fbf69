// pginbox from Go with pgx v4: the scenario of docs/other-languages.md, step by step.
// Connects with the PG* environment variables (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD)
// as the LOGIN role bound to consumer 'ledger'. Prints one JSON line per step.
// Build (Debian's golang-go and golang-github-jackc-pgx-v4-dev, offline, GOPATH mode):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o scenario scenario.go
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

const (
	consumer       = "ledger"
	producer       = "shop"
	handlerVersion = "v1"
)

type Message struct {
	Producer, ID, Type string
	Payload            map[string]int64 // bound as JSON text, cast with $4::jsonb
	ProducedAt         *time.Time
}

// doc:begin classify
// What to do with an error (docs/other-languages.md, section 4).
func sqlstate(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return "" // no answer from the server
}

func classify(err error) string {
	code := sqlstate(err)
	switch {
	case code == "" || strings.HasPrefix(code, "08") || strings.HasPrefix(code, "53") || strings.HasPrefix(code, "57"):
		return "retry" // connection lost, server shutting down, out of resources, 57014
	case strings.HasPrefix(code, "40") || code == "55P03":
		return "retry" // serialization failure, deadlock, lock timeout
	case code == "42501" || code == "42704" || code == "42883" || code == "42P01" ||
		code == "3F000" || code == "3D000" || strings.HasPrefix(code, "28"):
		return "halt" // configuration or rights: every message would fail the same way
	}
	return "dead-letter" // this message can never succeed as it is
}

// doc:end classify

// doc:begin retry
// inTransaction runs work in one transaction; it retries the WHOLE transaction on a transient
// error, with a bounded, jittered backoff. Safe even when a lost connection hid the COMMIT's
// outcome: the retry's claim sees 'duplicate'.
func inTransaction[T any](ctx context.Context, pool *pgxpool.Pool, iso pgx.TxIsoLevel,
	work func(pgx.Tx) (T, error), onRetry func(error)) (T, error) {
	const attempts = 5
	for attempt := 1; ; attempt++ {
		var result T
		err := pool.BeginTxFunc(ctx, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
			var err error
			result, err = work(tx)
			return err // an error rolls back, nil commits
		})
		if err == nil || classify(err) != "retry" || attempt >= attempts {
			return result, err
		}
		if onRetry != nil {
			onRetry(err)
		}
		time.Sleep(time.Duration(rand.Int63n(int64(10*time.Millisecond) << attempt)))
	}
}

// doc:end retry

// doc:begin claim
// Pattern 1: claim in your transaction, make the change in the same transaction.
type changeFailed struct{ err error } // the change failed, not the claim

func (c changeFailed) Error() string { return c.err.Error() }
func (c changeFailed) Unwrap() error { return c.err }

func handleWithClaim(ctx context.Context, tx pgx.Tx, m Message) (string, error) {
	payload, _ := json.Marshal(m.Payload)
	var outcome string
	err := tx.QueryRow(ctx, `SELECT outcome FROM inbox.claim($1, $2, $3, $4::jsonb,
	                                 handler_version => $5, produced_at => $6)`,
		consumer, m.Producer, m.ID, string(payload), handlerVersion, m.ProducedAt).Scan(&outcome)
	if err != nil {
		return "", err
	}
	if outcome == "claimed" {
		_, err = tx.Exec(ctx, "UPDATE ledger.account SET balance = balance + $1 WHERE id = $2",
			m.Payload["amount"], m.Payload["account"])
		if err != nil {
			return "", changeFailed{err}
		}
	}
	return outcome, nil
}

// deliver handles one delivery: the outcome, and what to tell the broker.
func deliver(ctx context.Context, pool *pgxpool.Pool, m Message) map[string]any {
	outcome, err := inTransaction(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) (string, error) {
		return handleWithClaim(ctx, tx, m)
	}, nil)
	if err == nil {
		return map[string]any{"outcome": outcome, "then": "ack"}
	}
	var change changeFailed
	if !errors.As(err, &change) || classify(err) != "dead-letter" {
		return map[string]any{"sqlstate": sqlstate(err), "action": classify(err)} // nothing written
	}
	// A permanent error in the change: its transaction rolled back; record the attempt.
	payload, _ := json.Marshal(m.Payload)
	var reasonCode *string
	err = pool.QueryRow(ctx, `SELECT outcome, reason_code FROM inbox.record_failure($1, $2, $3, $4::jsonb, $5, $6,
	                                                                         handler_version => $7)`,
		consumer, m.Producer, m.ID, string(payload), reasonCodeOf(err), err.Error(), handlerVersion,
	).Scan(&outcome, &reasonCode)
	if err != nil {
		return map[string]any{"sqlstate": sqlstate(err), "action": classify(err)}
	}
	then := "ack"
	if outcome == "failed" {
		then = "nack"
	}
	return map[string]any{"outcome": outcome, "reason_code": reasonCode, "then": then}
}

// reasonCodeOf: the constraint's name when there is one, else the SQLSTATE.
func reasonCodeOf(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.ConstraintName != "" {
		return pgErr.ConstraintName
	}
	return sqlstate(err)
}

// doc:end claim

// doc:begin apply
// Pattern 2: one round trip; the change is the registered SQL handler.
type result struct {
	Outcome      string
	ReasonCode   *string // NULL unless failed, quarantined or conflict
	QuarantineID *int64
	Attempts     *int32
}

type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func apply(ctx context.Context, q querier, m Message, consumer string) (result, error) {
	payload, _ := json.Marshal(m.Payload)
	var r result
	err := q.QueryRow(ctx, `SELECT outcome, reason_code, quarantine_id, attempts
	                          FROM inbox.claim_and_apply($1, $2, $3, $4, $5::jsonb, produced_at => $6)`,
		consumer, m.Producer, m.ID, m.Type, string(payload), m.ProducedAt,
	).Scan(&r.Outcome, &r.ReasonCode, &r.QuarantineID, &r.Attempts)
	return r, err
}

func deliverApply(ctx context.Context, pool *pgxpool.Pool, m Message, consumer string) map[string]any {
	r, err := inTransaction(ctx, pool, pgx.ReadCommitted, func(tx pgx.Tx) (result, error) {
		return apply(ctx, tx, m, consumer)
	}, nil)
	if err != nil {
		return map[string]any{"sqlstate": sqlstate(err), "action": classify(err)}
	}
	// failed: the handler's error was recorded (reason_code), its writes rolled back.
	then := "ack"
	if r.Outcome == "failed" {
		then = "nack"
	}
	return map[string]any{"outcome": r.Outcome, "reason_code": r.ReasonCode, "then": then}
}

// doc:end apply

func report(step string, fields map[string]any) {
	fields["step"] = step
	line, _ := json.Marshal(fields)
	fmt.Println(string(line))
}

func credit(id string, account, amount int64) Message {
	return Message{Producer: producer, ID: id, Type: "credit", Payload: map[string]int64{"account": account, "amount": amount}}
}

func main() {
	ctx := context.Background()
	pool, err := pgxpool.Connect(ctx, "") // "": the PG* environment variables
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer pool.Close()

	report("claim", deliver(ctx, pool, credit("m-1", 1, 10)))
	report("claim_duplicate", deliver(ctx, pool, credit("m-1", 1, 10)))
	report("claim_conflict", deliver(ctx, pool, credit("m-1", 1, 99)))
	report("claim_change_failed", deliver(ctx, pool, credit("m-2", 2, -5)))
	report("apply", deliverApply(ctx, pool, credit("m-3", 2, 7), consumer))
	report("apply_duplicate", deliverApply(ctx, pool, credit("m-3", 2, 7), consumer))
	report("apply_failed", deliverApply(ctx, pool, credit("m-4", 1, -1000), consumer))

	// doc:begin race
	// A REPEATABLE READ transaction whose snapshot predates another worker's commit of the same
	// message gets 40001; the retry loop runs it again and the claim says 'duplicate'.
	msg := credit("m-5", 2, 1)
	retried := []string{}
	first := ""
	outcome, err := inTransaction(ctx, pool, pgx.RepeatableRead, func(tx pgx.Tx) (string, error) {
		if _, err := tx.Exec(ctx, "SELECT 1"); err != nil { // the snapshot is taken here
			return "", err
		}
		if first == "" { // the other worker, on a connection of its own (autocommit)
			r, err := apply(ctx, pool, msg, consumer)
			if err != nil {
				return "", err
			}
			first = r.Outcome
		}
		r, err := apply(ctx, tx, msg, consumer)
		return r.Outcome, err
	}, func(err error) { retried = append(retried, sqlstate(err)) })
	// doc:end race
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	report("race", map[string]any{"first": first, "retried": retried, "outcome": outcome})

	tomorrow := time.Now().Add(24 * time.Hour)
	ahead := credit("m-6", 1, 1)
	ahead.ProducedAt = &tomorrow
	report("produced_at_ahead", deliver(ctx, pool, ahead))
	report("unbound_consumer", deliverApply(ctx, pool, credit("m-7", 1, 1), "ledgr"))
}
