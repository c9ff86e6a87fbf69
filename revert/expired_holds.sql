-- Revert pginbox:expired_holds: nothing to undo. The holds it added keep their identities from being
-- applied again under 0.1.0's functions too (a 'quarantined' or 'discarded' claim row answers every
-- redelivery through the unique key); removing them would reopen the hole this change closed.
BEGIN;
COMMIT;
